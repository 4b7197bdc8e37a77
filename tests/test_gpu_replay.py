"""Replaying traces on the real backend through the shared engine core (CPU, truncated SmolLM2)."""
import gc
import json
import time

import numpy as np
import pandas as pd
import pytest
import torch
import yaml
from typer.testing import CliRunner

from kvsim.gpu.model import rope_cos_sin
from kvsim.gpu.replay import replay_config, run_replay
from kvsim.sim.model.catalog import get_model
from kvsim.sim.config import ConfigError, load_config
from kvsim.sim.kv.slots import SLOT_STRATEGIES
from kvsim.sim.simulator.simulate import run_simulation
from kvsim.traces.trace import Trace

BASE = {"model": "smollm2-135m", "gpu": "cpu-2core", "profile": "cpu-2core", "engine.block_size": 4,
        "check_invariants": True}


pytestmark = pytest.mark.usefixtures("one_thread")


def config(**overrides):
    return load_config(None, {**BASE, **overrides})


def trace(prompts, outputs, arrivals=None):
    return Trace.from_columns(arrival_time_s=arrivals if arrivals is not None else [0.0] * len(prompts),
                              prompt_tokens=prompts, output_tokens=outputs, name="tiny")


def assert_greedy(model, tokens: pd.DataFrame):
    """Every output token is the dense model's greedy choice given the tokens before it."""
    for prompt, output in zip(tokens["prompt_token_ids"], tokens["output_token_ids"]):
        seq = list(prompt) + list(output)
        dense = model.dense_forward(torch.tensor(seq))
        assert list(output) == dense[len(prompt) - 1:-1].argmax(-1).tolist()


def test_tiny_trace_replays_with_simulate_schema(small, tmp_path):
    tr = trace([37, 22, 30, 45], [5, 7, 3, 4], arrivals=[0.0, 0.01, 0.02, 5.0])
    cfg = config(**{"engine.num_gpu_blocks": 40})
    res = run_replay(cfg, tmp_path / "replay", model=small, trace=tr)
    run_simulation(cfg, tmp_path / "sim", trace=tr)
    for name in ("requests.parquet", "steps.parquet"):
        real, simulated = pd.read_parquet(tmp_path / "replay" / name), pd.read_parquet(tmp_path / "sim" / name)
        assert list(real.columns) == list(simulated.columns) and (real.dtypes == simulated.dtypes).all(), name
    summary = json.loads((tmp_path / "replay" / "summary.json").read_text())
    assert set(json.loads((tmp_path / "sim" / "summary.json").read_text())) - {"wall_s"} <= set(summary)
    assert summary["num_finished"] == 4 and not summary["partial"]
    steps = res.steps
    assert (steps["duration_s"] > 0).all() and np.isfinite(steps["predicted_s"]).all()
    # measured clock: each step starts when the previous one ended, or at an arrival when idle
    ends = (steps["time_s"] + steps["duration_s"]).to_numpy()
    starts = steps["time_s"].to_numpy()
    assert (starts[1:] >= ends[:-1] - 1e-12).all()
    assert (res.requests["output_tokens"] == [5, 7, 3, 4]).all()
    assert res.tokens["output_token_ids"].map(len).tolist() == [5, 7, 3, 4]
    stats = pd.read_parquet(tmp_path / "replay" / "attention_stats.parquet")
    assert len(stats) == 4 * 2 * 3                   # one row per (request, layer, KV head)
    assert ((stats["keys_95"] >= 1) & (stats["keys_95"] <= stats["num_keys"])).all()
    assert stats["sink_share"].between(0, 1 + 1e-6).all() and stats["recent_share"].between(0, 1 + 1e-6).all()
    assert_greedy(small, res.tokens)


def test_idle_gap_is_skipped_to_the_next_arrival(small):
    res = run_replay(config(**{"engine.num_gpu_blocks": 40}), model=small, trace=trace([9, 9], [2, 2], [0.0, 50.0]))
    late = res.steps[res.steps["time_s"] >= 50.0]
    assert late["time_s"].iloc[0] == 50.0           # the clock jumped over the idle gap
    assert res.summary["wall_s"] < 50.0


def test_full_smollm2_replay_is_greedy(smollm2):
    res = run_replay(config(**{"engine.num_gpu_blocks": 8, "engine.block_size": 16}), model=smollm2,
                     trace=trace([11, 7], [2, 3]))
    assert res.summary["num_finished"] == 2 and res.summary["model_layers"] == 30
    assert_greedy(smollm2, res.tokens)


@pytest.mark.parametrize("layout", ["shared", "per_head"])
def test_policy_none_matches_dense_greedy_also_under_preemption(small, layout):
    tr = trace([30, 26, 21], [9, 8, 12])
    roomy = run_replay(config(**{"engine.num_gpu_blocks": 64, "kv.layout": layout}), model=small, trace=tr)
    assert roomy.steps["preemptions"].sum() == 0
    assert_greedy(small, roomy.tokens)
    # 16 blocks of 4 slots: the first two requests grow to 10 + 9 blocks, so one is preempted and recomputed
    tight = run_replay(config(**{"engine.num_gpu_blocks": 16, "kv.layout": layout}), model=small, trace=tr)
    assert tight.steps["preemptions"].sum() > 0 and tight.summary["num_finished"] == 3
    assert tight.tokens["output_token_ids"].tolist() == roomy.tokens["output_token_ids"].tolist()


@pytest.mark.parametrize("kv", [{}, {"kv.policy": "streaming", "kv.params": {"sink": 3, "window": 9},
                                   "kv.layout": "per_head", "kv.slot_strategy": "compact"}])
def test_same_engine_core_as_the_simulator_step_for_step(small, kv, tmp_path):
    """With every request at t=0 and a score-free policy, scheduling cannot depend on time: the replay's
    step log equals the simulator's in every batch and memory column, and its predicted_s is the
    simulator's step time."""
    tr = trace([41, 29, 60, 33], [12, 20, 9, 15])
    spec = get_model("smollm2-135m").model_copy(update={   # the simulator prices the model that really runs
        "name": "SmolLM2-2L", "aliases": (), "num_layers": 2, "weight_dtype": "fp32", "activation_dtype": "fp32",
        "kv_dtype": "fp32"})
    (tmp_path / "model.yaml").write_text(yaml.safe_dump({"models": [spec.model_dump(mode="json")]}))
    cfg = config(**{"engine.num_gpu_blocks": 22, "model": str(tmp_path / "model.yaml"), **kv})
    real = run_replay(cfg, model=small, trace=tr).steps
    sim = run_simulation(replay_config(cfg), trace=tr).steps       # the engine settings the replay ran with
    assert real["preemptions"].sum() > 0 if not kv else real["evicted_tokens"].sum() > 0
    same = ["batch_size", "num_prefill_seqs", "prefill_tokens", "decode_tokens", "kv_tokens_read", "blocks_used",
            "blocks_free", "live_slots", "allocated_slots", "num_running", "num_waiting", "preemptions", "finished",
            "evicted_tokens", "blocks_freed_by_eviction", "bytes_moved"]
    pd.testing.assert_frame_equal(real[same], sim[same])
    np.testing.assert_allclose(real["predicted_s"], sim["duration_s"], rtol=1e-12)


def masked_last_query(model, ids: list[int], keep: np.ndarray):
    """Dense forward where every earlier token attends causally and the LAST token attends only to the
    positions `keep` [layers, kv_heads, T] marks: the logits and attention probabilities [L, heads, T]
    of the last token, i.e. decoding over exactly the tokens that survived eviction."""
    c = model.config
    n = len(ids)
    group = c.heads // c.kv_heads
    h = model.w["embed"][torch.tensor(ids)]
    rope = rope_cos_sin(torch.arange(n), c.head_dim, c.rope_theta)
    probs = []
    with torch.inference_mode():
        for i in range(c.layers):
            q, k, v = model._qkv(i, h, rope)
            qh = q.float().transpose(0, 1)
            kh = k.float().repeat_interleave(group, dim=1).transpose(0, 1)
            vh = v.float().repeat_interleave(group, dim=1).transpose(0, 1)
            mask = torch.ones(n, n, dtype=torch.bool).tril().expand(c.heads, n, n).clone()
            mask[:, -1, :] = torch.from_numpy(keep[i]).repeat_interleave(group, 0)
            p = torch.softmax(((qh @ kh.transpose(1, 2)) * model.scale).masked_fill(~mask, float("-inf")), dim=-1)
            probs.append(p[:, -1])
            h = model._finish_layer(i, h, (p @ vh).transpose(0, 1).to(h.dtype))
        return model._logits(h[-1:])[0], torch.stack(probs)


def live_positions(kv, req, layers: int, kv_heads: int) -> tuple[np.ndarray, dict]:
    """keep [L, H, T] of the request's live positions, and {(row, pos): accumulated score}."""
    st = kv.req_kv[req].state
    keep = np.zeros((st.rows, st.num_tokens + 1), dtype=bool)
    r, s = np.nonzero(st.live)
    keep[r, st.pos[r, s]] = True
    scores = {(int(a), int(st.pos[a, b])): float(st.score[a, b]) for a, b in zip(r, s)}
    return np.broadcast_to(keep.reshape(-1, 1, keep.shape[1]) if st.rows == 1 else
                           keep.reshape(layers, kv_heads, -1), (layers, kv_heads, keep.shape[1])), scores


@pytest.mark.parametrize("layout", ["shared", "per_head"])
@pytest.mark.parametrize("policy", ["streaming", "h2o"])
def test_eviction_with_every_slot_strategy_decodes_over_exactly_the_survivors(small, layout, policy):
    """After the post-prefill eviction (and whatever relocation each slot strategy does), the first
    decode step's logits equal a dense forward whose last query sees exactly the surviving tokens, the
    real scores handed to the policy equal that query's attention, and all strategies give the same tokens."""
    c = small.config
    kv_opts = {"kv.policy": policy, "kv.layout": layout}
    kv_opts.update({"kv.params": {"sink": 5, "window": 11}} if policy == "streaming" else {"kv.budget": 14})
    tr = trace([41, 29], [3, 3])
    outputs = {}
    for strategy in SLOT_STRATEGIES:
        seen = {}

        def hook(replica):
            kv, ex = replica.kv, replica.executor
            running = {r.request_id: r for r in replica.scheduler.running}
            if replica.num_steps == 1:          # after the prefill step: the survivors of the eviction
                seen["before"] = {rid: live_positions(kv, r, c.layers, c.kv_heads) for rid, r in running.items()}
            if replica.num_steps == 2:          # after the first decode step
                seen["logits"] = dict(zip(ex.last_request_ids, ex.last_logits))
                seen["after"] = {rid: live_positions(kv, r, c.layers, c.kv_heads)[1] for rid, r in running.items()}

        cfg = config(**{"engine.num_gpu_blocks": 48, "kv.slot_strategy": strategy, **kv_opts})
        res = run_replay(cfg, model=small, trace=tr, on_step=hook)
        assert res.summary["num_finished"] == 2 and res.steps["evicted_tokens"].sum() > 0
        if strategy in ("compact", "parallel_compact", "sparse_copy"):
            assert res.steps["bytes_moved"].sum() > 0, strategy
        assert len(res.decisions) == res.steps["evicted_tokens"].sum()
        outputs[strategy] = res.tokens["output_token_ids"].tolist()
        for rid, toks in zip(res.tokens["request_id"], res.tokens["prompt_token_ids"]):
            keep, before = seen["before"][rid]
            keep = keep.copy()
            keep[..., len(toks)] = True                      # the decoded token attends to itself
            first = res.tokens.set_index("request_id").loc[rid, "output_token_ids"][0]
            logits, probs = masked_last_query(small, list(toks) + [first], keep)
            torch.testing.assert_close(seen["logits"][rid], logits, atol=2e-4, rtol=1e-4)
            if policy == "h2o":      # score added by the decode step == real attention of its query
                group = probs.view(c.layers, c.kv_heads, -1, probs.shape[-1]).sum(2).numpy()
                per_row = group.mean(axis=(0, 1))[None] if layout == "shared" else group.reshape(-1, group.shape[-1])
                after = seen["after"][rid]
                common = [k for k in before if k in after]
                assert len(common) > 10
                got = np.array([after[k] - before[k] for k in common])
                want = np.array([per_row[row, pos] for row, pos in common])
                np.testing.assert_allclose(got, want, atol=1e-5)
    first = outputs[SLOT_STRATEGIES[0]]
    for strategy, toks in outputs.items():
        assert toks == first, f"{strategy} changed the generated tokens"


def test_decisions_and_stats_use_the_recorded_format(small, tmp_path):
    cfg = config(**{"engine.num_gpu_blocks": 200, "kv.policy": "h2o", "kv.budget": 12, "kv.layout": "per_head",
                    "kv.slot_strategy": "compact"})
    res = run_replay(cfg, tmp_path, model=small, trace=trace([33, 20], [4, 6]))
    d = pd.read_parquet(tmp_path / "decisions.parquet")
    assert list(d.columns)[:6] == ["request_id", "step", "layer", "head", "position", "action"]
    assert (d["action"] == "evict").all() and d["layer"].between(0, 1).all() and d["head"].between(0, 2).all()
    assert set(d["step"]) <= {-1, 1, 2, 3, 4, 5}
    # after prefill each (layer, head) of a request keeps exactly the budget: prompt - 12 evictions
    after_prefill = d[d["step"] == -1].groupby(["request_id", "layer", "head"]).size()
    assert (after_prefill.xs(0, level="request_id") == 33 - 12).all()
    assert (after_prefill.xs(1, level="request_id") == 20 - 12).all()
    # a position is evicted at most once per (request, layer, head)
    assert not d.duplicated(["request_id", "layer", "head", "position"]).any()
    assert res.summary["evicted_tokens"] == pytest.approx(len(d) / 6)


def test_ctrl_c_leaves_a_valid_partial_result(small, tmp_path):
    def interrupt(replica):
        if replica.num_steps == 4:
            raise KeyboardInterrupt

    tr = trace([20, 18, 25], [3, 12, 4], arrivals=[0.0, 0.0, 1000.0])
    res = run_replay(config(**{"engine.num_gpu_blocks": 40}), tmp_path, model=small, trace=tr, on_step=interrupt)
    assert res.partial
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["partial"] is True and summary["num_trace_requests"] == 3
    steps = pd.read_parquet(tmp_path / "steps.parquet")
    assert len(steps) == 4 and steps["step"].tolist() == [0, 1, 2, 3]
    req = pd.read_parquet(tmp_path / "requests.parquet")
    assert req["request_id"].tolist() == [0, 1]                # the third had not arrived yet
    assert req["status"].tolist() == ["finished", "unfinished"]
    assert summary["num_finished"] == 1 and summary["num_unfinished"] == 1
    assert pd.read_parquet(tmp_path / "tokens.parquet")["output_token_ids"].map(len).tolist() == [3, 4]


def test_bad_configs_are_refused_with_the_reason(small):
    tr = trace([9], [2])
    with pytest.raises(ConfigError, match="preemption_mode=swap"):
        run_replay(config(**{"engine.num_gpu_blocks": 9, "engine.preemption_mode": "swap"}), model=small, trace=tr)
    with pytest.raises(ConfigError, match="num-gpu-blocks"):
        run_replay(config(), model=small, trace=tr)
    with pytest.raises(ConfigError, match="--weights smollm2 runs SmolLM2-135M"):
        run_replay(config(**{"model": "llama-3.1-8b", "engine.num_gpu_blocks": 9}), trace=tr)


@pytest.mark.parametrize("model, kind", [("mixtral-8x7b", "a mixture of experts"),
                                         ("deepseek-v3", "multi-head latent attention"),
                                         ("gpt-oss-20b", "sliding-window attention")])
def test_random_weights_refuse_an_architecture_the_backend_does_not_run(model, kind, tmp_path):
    """--weights random --model mixtral-8x7b (or DeepSeek-V3) built a dense Llama of the model's
    whole shape, every layer in fp32 on the host before --layers cut it: minutes and tens to hundreds
    of GB for a model the backend does not run. Refused before anything is built."""
    from kvsim.gpu.replay import ReplayOptions
    with pytest.raises(ConfigError, match=f"--weights random: .* uses .*{kind}.*dense Llama-architecture"):
        run_replay(config(**{"model": model, "engine.num_gpu_blocks": 9}), tmp_path / "out", trace=trace([9], [2]),
                   options=ReplayOptions(weights="random", layers=1))


def test_cli_replays_a_trace_file(tmp_path):
    from kvsim.sim.cli import app

    path = tmp_path / "t.jsonl"
    trace([12, 15], [3, 2], arrivals=[0.0, 0.3]).save(path)
    result = CliRunner().invoke(app, ["replay", "--trace", str(path), "--layers", "2", "--num-gpu-blocks", "16",
                                      "--block-size", "4", "--policy", "streaming", "--set", "kv.params.window=8",
                                      "--set", "kv.params.sink=2", "--layout", "per_head", "--check-invariants",
                                      "-q", "-o", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["num_finished"] == 2 and summary["model"] == "SmolLM2-135M (2 layers)"
    assert summary["gpu"] == "cpu-2core" and summary["device"] == "cpu"
    bad = CliRunner().invoke(app, ["replay", "--trace", str(path), "--layers", "2", "--device", "cuda:0",
                                   "--num-gpu-blocks", "16"])
    if not torch.cuda.is_available():
        assert bad.exit_code == 2 and "CUDA is not available" in bad.output


def test_cli_cpu_clock_needs_one_thread(tmp_path):
    from kvsim.sim.cli import app

    path = tmp_path / "t.jsonl"
    trace([12], [3]).save(path)
    args = ["replay", "--trace", str(path), "--layers", "2", "--num-gpu-blocks", "16", "--block-size", "4",
            "--clock", "cpu", "-q"]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        bad = CliRunner().invoke(app, [*args, "-o", str(tmp_path / "bad")])
        assert bad.exit_code == 2 and "1 torch thread" in bad.output
        ok = CliRunner().invoke(app, [*args, "--threads", "1", "-o", str(tmp_path / "out")])
    finally:
        torch.set_num_threads(threads)
    assert ok.exit_code == 0, ok.output
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["replay"]["clock"] == "cpu" and summary["num_finished"] == 1
    steps = pd.read_parquet(tmp_path / "out" / "steps.parquet")
    assert (steps.duration_s > 0).all()


def test_a_replay_starts_with_the_previous_replays_cache_freed(small, monkeypatch):
    """Each replay's timed steps start clean: the last replay's KV cache (kept alive by reference cycles)
    is collected before the next one allocates, not in the middle of its first steps."""
    import weakref
    import kvsim.gpu.replay as replay_mod
    caches, alive_at_build = [], []
    build = replay_mod.build_cache

    def recording_build(cfg, model, kv):
        alive_at_build.append([ref() is not None for ref in caches])
        cache = build(cfg, model, kv)
        caches.append(weakref.ref(cache))
        return cache

    monkeypatch.setattr(replay_mod, "build_cache", recording_build)
    gc_was = gc.isenabled()
    gc.disable()                                   # no automatic collection may hide a missing one
    try:
        for _ in range(2):
            run_replay(config(**{"engine.num_gpu_blocks": 40}), model=small, trace=trace([9, 9], [2, 2]))
    finally:
        if gc_was:
            gc.enable()
    assert alive_at_build == [[], [False]]


def test_replay_closed_loop_sends_the_next_request_when_one_finishes(small):
    """--max-concurrency drives the real backend as it drives the simulator (the shared engine core)."""
    tr = trace([30, 22, 40, 18, 25], [6, 3, 5, 4, 2])
    res = run_replay(config(**{"engine.num_gpu_blocks": 40, "trace_options.max_concurrency": 2}), model=small,
                     trace=tr)
    req = res.requests
    assert (req["status"] == "finished").all()
    sent = req["arrival_s"].to_numpy()
    assert not sent[:2].any()
    np.testing.assert_array_equal(sent[2:], np.sort(req["finish_s"].to_numpy())[:3])
    np.testing.assert_array_equal(req["client_queue_s"].to_numpy(), sent)


def test_cache_checks_are_not_timed_as_engine_work(small, monkeypatch):
    """`--check-invariants` compares the whole cache with the manager's state every step; that check
    must not enter the step times (or the replay's clock), or checked replays schedule differently."""
    from kvsim.gpu.executor import RealExecutor
    verify = RealExecutor.verify_cache
    calls = []

    def slow_verify(self, sched=()):
        calls.append(self.num_steps)
        time.sleep(0.3)
        verify(self, sched)

    monkeypatch.setattr(RealExecutor, "verify_cache", slow_verify)
    res = run_replay(config(**{"engine.num_gpu_blocks": 40}), model=small, trace=trace([9, 9], [2, 2]))
    assert len(calls) == len(res.steps) > 0
    assert (res.steps["duration_s"] < 0.3).all()
