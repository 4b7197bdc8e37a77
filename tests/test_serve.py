"""`kvsim serve` as clients meet it: the real `openai` client streaming, a `vllm bench serve`-style Poisson load
of streaming clients, OpenAI-style errors, and a Prometheus scrape of /metrics. The server (a `kvsim serve`
process at --time-scale 10) records the arrivals it received; `kvsim simulate` on that trace is the
reference: the clients' TTFT/TPOT/E2E percentiles equal its own within 5% plus the HTTP overhead this test
measures beside the load (the latest first token of one-token probe streams, against their simulated TTFT),
and the metrics' counters equal its totals. The simulated times themselves equal `kvsim simulate`'s exactly
(tests/test_serve_engine.py)."""
from __future__ import annotations

import asyncio
import json
import signal
import urllib.error
import urllib.request

import numpy as np
import pytest

openai = pytest.importorskip("openai")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from kvsim.sim.config import load_config  # noqa: E402
from kvsim.sim.serve.client import ServerDidNotStart, free_port, launch_server, stream_completion  # noqa: E402
from kvsim.sim.simulator.simulate import run_simulation  # noqa: E402
from kvsim.traces.tokenizer import load_tokenizer  # noqa: E402

SCALE = 10.0
MODEL = "llama-3.1-8b"
ENGINE = {"engine.num_gpu_blocks": 2000}          # 32,000 KV slots: a 40,000-token prompt never fits
EOS_TOKENS = 16
PROBE = {"model": MODEL, "prompt": "ping", "max_tokens": 1, "ignore_eos": True}
VOCABULARY = ("cache", "block", "token", "prefill", "decode", "batch", "request", "engine", "memory", "latency",
              "throughput", "scheduler", "queue", "router", "replica", "model", "weight", "layer", "head",
              "attention")


def _get(port: int, path: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("serve")
    port = free_port()
    args = ["--model", MODEL, "--time-scale", str(SCALE), "--eos-tokens", str(EOS_TOKENS),
            "--record-trace", str(folder / "served.jsonl"), *[f"--set={k}={v}" for k, v in ENGINE.items()]]
    try:
        proc = launch_server(port, args)
    except ServerDidNotStart as exc:
        pytest.fail(str(exc))
    info = {"port": port, "trace": folder / "served.jsonl", "proc": proc}
    yield info
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def _stop(server) -> None:
    proc = server["proc"]
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=30)


def _client(server):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server['port']}/v1", api_key="none", max_retries=0)


def _post(server, path: str, body) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{server['port']}{path}", data=data,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


# ----- the API, through the openai client -----------------------------------------------------------
def test_openai_client_streams_completion_with_usage(server):
    client = _client(server)
    assert [m.id for m in client.models.list()] == [MODEL]
    stream = client.completions.create(model=MODEL, prompt="The capital of France is " * 20, max_tokens=24,
                                       stream=True, stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True})
    chunks = list(stream)
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert len(texts) == 24 and all(t.startswith(" ") and len(t) > 1 for t in texts)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    usage = chunks[-1].usage
    assert not chunks[-1].choices and usage.completion_tokens == 24 and usage.prompt_tokens > 100


def test_openai_client_chat_stream_and_eos(server):
    client = _client(server)
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}],
        max_tokens=100, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    content = [c.choices[0].delta.content for c in chunks[1:] if c.choices[0].delta.content]
    # without ignore_eos the simulated model stops after --eos-tokens tokens: finish_reason "stop"
    assert len(content) == EOS_TOKENS and chunks[-1].choices[0].finish_reason == "stop"
    whole = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi!"}], max_tokens=5)
    assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == 5
    assert len(whole.choices[0].message.content.split()) == 5
    # ChatML with the shipped SmolLM2 tokenizer: <|im_start|> user \n TEXT <|im_end|> \n (5 tokens and the
    # text's), then <|im_start|> ass istant \n for the answer's turn (4)
    assert whole.usage.prompt_tokens == 5 + len(load_tokenizer().encode("Hi!", add_special_tokens=False).ids) + 4


def test_bad_requests_get_openai_errors(server):
    client = _client(server)
    with pytest.raises(openai.BadRequestError, match="maximum context length is 131072 tokens"):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=200_000)
    with pytest.raises(openai.NotFoundError, match="The model `gpt-4` does not exist"):
        client.completions.create(model="gpt-4", prompt="hi", max_tokens=4)
    status, body = _post(server, "/v1/completions", b"{not json")
    assert status == 400 and "not valid JSON" in body["error"]["message"]
    status, body = _post(server, "/v1/completions", {"model": MODEL, "max_tokens": 4})
    assert status == 400 and body["error"]["param"] == "prompt" and body["error"]["type"] == "BadRequestError"
    status, body = _post(server, "/v1/chat/completions", {"model": MODEL, "messages": [], "max_tokens": 4})
    assert status == 400 and body["error"]["param"] == "messages"
    status, body = _post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 0})
    assert status == 400 and body["error"]["param"] == "max_tokens"
    status, body = _post(server, "/v1/completions", {"prompt": "hi", "n": 2})
    assert status == 400 and body["error"]["param"] == "n"
    # longer than the whole KV pool (2,000 blocks of 16, one the null block) though within max_model_len
    status, body = _post(server, "/v1/completions", {"prompt": [7] * 40_000, "max_tokens": 4})
    assert status == 400 and "whole KV pool holds 31984 tokens" in body["error"]["message"]
    assert _get(server["port"], "/health")[0] == 200          # still serving


# ----- a Poisson load against the simulator's own answer ---------------------------------------------
def _load_bodies(n: int, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    system = "You are a helpful assistant that answers questions about serving systems. " * 8
    bodies = []
    for i in range(n):
        words = " ".join(VOCABULARY[x] for x in rng.integers(0, len(VOCABULARY), int(rng.integers(20, 400))))
        bodies.append({"model": MODEL, "prompt": (system if i % 2 else "") + words,
                       "max_tokens": int(rng.integers(8, 64)), "ignore_eos": True})
    return bodies


async def _poisson_load(port: int, bodies: list[dict], rate_per_s: float, seed: int):
    """The bodies sent at Poisson times (streaming, one connection each), and beside them probes: one-token
    streams, one 5 ms after another, whose lateness over their simulated TTFT (once `kvsim simulate` has it)
    is the HTTP overhead of a token on this machine then (connection, parsing, the server's timers, delivery)."""
    rng = np.random.default_rng(seed)
    probes = []
    done = asyncio.Event()

    async def probe():
        while not done.is_set():
            probes.append(await stream_completion("127.0.0.1", port, PROBE))
            await asyncio.sleep(0.005)

    prober = asyncio.create_task(probe())
    tasks = []
    for body in bodies:
        await asyncio.sleep(rng.exponential(1.0 / rate_per_s) / SCALE)
        tasks.append(asyncio.create_task(stream_completion("127.0.0.1", port, body)))
    results = await asyncio.gather(*tasks)
    done.set()
    await prober
    return results, probes


def _ids(results) -> list[int]:
    return [int(r.response_id.rsplit("-", 1)[1]) for r in results]


def _metrics(port: int) -> dict:
    status, text = _get(port, "/metrics")
    assert status == 200
    out = {}
    for family in text_string_to_metric_families(text.decode()):
        for s in family.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value        # summed over engines and labels
    return out


def test_poisson_load_matches_simulate_and_metrics_match_its_totals(server):
    bodies = _load_bodies(30, seed=11)
    results, probes = asyncio.run(_poisson_load(server["port"], bodies, rate_per_s=2.0, seed=12))
    assert all(r.status == 200 and r.error is None for r in results + probes), [r.error for r in results if r.error]
    assert [len(r.chunk_times) for r in results] == [b["max_tokens"] for b in bodies]
    assert all(r.finish_reason == "length" for r in results)
    scraped = _metrics(server["port"])
    _stop(server)

    cfg = load_config(None, {"model": MODEL, "trace": str(server["trace"]), **ENGINE})
    sim = run_simulation(cfg)
    df = sim.requests.set_index("request_id")
    done = df[df["status"] == "finished"]

    # every counter equals the run's totals (the whole run: the API tests' requests too)
    assert scraped["vllm:request_success_total"] == len(df) == len(done)
    assert scraped["vllm:generation_tokens_total"] == done["output_tokens"].sum()
    assert scraped["vllm:prompt_tokens_total"] == done["prompt_tokens"].sum()
    assert scraped["vllm:num_preemptions_total"] == sim.summary["preemptions"]
    assert scraped["vllm:prefix_cache_hits_total"] > 0
    assert scraped["vllm:prefix_cache_hits_total"] / scraped["vllm:prefix_cache_queries_total"] == \
        pytest.approx(sim.summary["prefix_hit_rate"], rel=1e-12)
    assert scraped["vllm:time_to_first_token_seconds_count"] == len(done)
    assert scraped["vllm:time_to_first_token_seconds_sum"] == pytest.approx(done["ttft_s"].sum(), rel=1e-9)
    assert scraped["vllm:e2e_request_latency_seconds_sum"] == pytest.approx(done["e2e_s"].sum(), rel=1e-9)
    assert scraped["vllm:inter_token_latency_seconds_count"] == (done["output_tokens"] - 1).sum()
    assert scraped["vllm:num_requests_running"] == scraped["vllm:num_requests_waiting"] == 0
    assert scraped["vllm:kv_cache_usage_perc"] == 0.0

    # the clients' latencies (wall x time scale) against the simulator's on the same arrivals
    sims = done.loc[_ids(results)]
    overhead = max(r.ttft * SCALE - ttft for r, ttft in zip(probes, done.loc[_ids(probes), "ttft_s"], strict=True))
    client = {"ttft": [r.ttft * SCALE for r in results], "e2e": [r.e2e * SCALE for r in results],
              "tpot": [r.tpot * SCALE for r in results]}
    reference = {"ttft": sims["ttft_s"], "e2e": sims["e2e_s"], "tpot": sims["tpot_s"]}
    min_gaps = min(b["max_tokens"] for b in bodies) - 1
    for key in ("ttft", "tpot", "e2e"):
        slack = overhead / min_gaps if key == "tpot" else overhead
        # (not p99: of 30 requests it is their slowest, which no sample of probes bounds surely)
        for q in (50, 90):
            measured, expected = np.percentile(client[key], q), np.percentile(reference[key], q)
            assert abs(measured - expected) <= 0.05 * expected + slack, \
                f"p{q} {key}: clients {measured:.4f} s, kvsim simulate {expected:.4f} s (overhead {overhead:.4f} s)"
    # and the clients saw the simulated times, late by no more than the overhead, never early
    for r, (_, row) in zip(results, sims.iterrows(), strict=True):
        assert r.ttft * SCALE >= row["ttft_s"] - 0.05 * row["ttft_s"] - 1e-3
