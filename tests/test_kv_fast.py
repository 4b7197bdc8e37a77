"""Block-occupancy fast mode against token-level mode (same workload, same policy)."""
import numpy as np
import pytest

from kvsim.sim.kv.base import FastOptions
from kvsim.sim.kv.fast import FastKVManager
from kvsim.sim.kv.policy import PolicyContext, PolicyError, get_policy
from test_kv_manager import H2O, run

KW = dict(n=3, prompt=120, output=80, num_blocks=4000)


def rel(a, b):
    return abs(a - b) / max(abs(b), 1e-12)


@pytest.fixture(scope="module")
def token_level():
    return {st: run({**H2O, "slot_strategy": st}, **KW)[0]
            for st in ("noop", "free_block", "slot_reuse", "sparse_copy", "holed_copy", "compact", "parallel_compact")}


@pytest.mark.parametrize("strategy", ["noop", "sparse_copy", "holed_copy", "compact", "parallel_compact"])
def test_fast_mode_agrees_with_token_level_within_5_percent(token_level, strategy):
    tok = token_level[strategy]
    fast = run({**H2O, "slot_strategy": strategy, "mode": "fast"}, **KW, check=True)[0]
    for metric in ("fragmentation_mean", "kv_util_mean", "throughput_output_tok_s"):
        assert rel(fast[metric], tok[metric]) < 0.05, (metric, fast[metric], tok[metric])
    assert fast["evicted_token_rows"] == tok["evicted_token_rows"]
    if strategy != "noop":
        assert rel(fast["bytes_moved"], tok["bytes_moved"]) < 0.1


@pytest.mark.parametrize("strategy", ["free_block", "slot_reuse"])
def test_fast_mode_h2o_block_frees_agree_within_5_percent(token_level, strategy):
    # which blocks empty out depends on where heavy hitters sit: fast mode ranks them by the importance
    # model's closed-form accumulated attention on rows of its head types (was 10% with global draws)
    tok = token_level[strategy]
    fast = run({**H2O, "slot_strategy": strategy, "mode": "fast"}, **KW, check=True)[0]
    assert fast["evicted_token_rows"] == tok["evicted_token_rows"]
    for metric in ("fragmentation_mean", "kv_util_mean", "throughput_output_tok_s"):
        assert rel(fast[metric], tok[metric]) < 0.05, (metric, fast[metric], tok[metric])
    # and the ordering users compare strategies by holds
    assert fast["fragmentation_mean"] < run({**H2O, "slot_strategy": "noop", "mode": "fast"}, **KW)[0][
        "fragmentation_mean"]


def test_fast_rows_are_a_stratified_sample_of_the_importance_model_heads():
    from kvsim.sim.kv.importance import SyntheticImportance
    # fast mode simulates a few of the 90 SmolLM2 rows: their head types keep the model's proportions
    ctx = PolicyContext("per_head", 30, 3, 3, 16, 90)
    types = SyntheticImportance(ctx, "smollm2-135m", 0).head_type
    for rows in (90, 9):
        kv = FastKVManager(1000, 16, ctx, get_policy("h2o", budget=60), FastOptions(sample_rows=rows))
        want = np.bincount(types, minlength=4) * rows / 90
        assert np.abs(np.bincount(kv.heads.head_type, minlength=4) - want).max() < 1, (rows, kv.heads.head_type)


def test_fast_mode_warns_that_it_ignores_content_correlation():
    ctx = PolicyContext("per_head", 30, 3, 3, 16, 90)
    with pytest.warns(UserWarning, match=r"content_correlation [0-9.]+.*kv.mode=token"):
        FastKVManager(1000, 16, ctx, get_policy("h2o", budget=60), FastOptions(importance="smollm2-135m-fitted"))
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")                   # the uncorrelated default: no warning
        FastKVManager(1000, 16, ctx, get_policy("h2o", budget=60), FastOptions(importance="smollm2-135m"))


def test_prompt_under_the_budget_keeps_the_fast_state_consistent():
    # tokens leaving the window before a row reaches its budget join the heavy-hitter list (a fixed
    # bug: they were listed only once some row was over budget; check_invariants caught it)
    for strategy in ("free_block", "slot_reuse", "compact"):
        s = run({**H2O, "slot_strategy": strategy, "mode": "fast"}, n=4, prompt=48, output=120, check=True)[0]
        assert s["num_finished"] == 4 and s["evicted_token_rows"] > 0


def test_fast_mode_is_deterministic_and_seeded():
    cfg = {**H2O, "slot_strategy": "slot_reuse", "mode": "fast"}
    a, sa = run(cfg, **KW)[:2]
    b, sb = run(cfg, **KW)[:2]
    assert a == b
    assert np.array_equal(sa["allocated_slots"].to_numpy(), sb["allocated_slots"].to_numpy())
    c = run(cfg, **KW, seed=1)[1]
    assert not np.array_equal(sa["allocated_slots"].to_numpy(), c["allocated_slots"].to_numpy())


def test_streaming_window_pages_free_in_fast_mode_as_in_token_level():
    # StreamingLLM evicts exactly the token leaving the window: block frees are computed, not drawn
    win = {"policy": "streaming", "params": {"sink": 4, "window": 40}, "layout": "per_head",
           "slot_strategy": "free_block"}
    tok = run(win, n=2, prompt=100, output=120)[0]
    fast = run({**win, "mode": "fast"}, n=2, prompt=100, output=120, check=True)[0]
    assert fast["blocks_freed_by_eviction"] == tok["blocks_freed_by_eviction"] > 0
    assert rel(fast["fragmentation_mean"], tok["fragmentation_mean"]) < 0.02


def test_fast_mode_refuses_policies_without_a_profile():
    ctx = PolicyContext("per_head", 2, 2, 4, 16, 4)
    pol = get_policy("h2o")
    pol.fast_mode_profile = lambda: None
    with pytest.raises(PolicyError, match="no fast-mode profile; use kv.mode=token"):
        FastKVManager(100, 16, ctx, pol)


def test_noop_fast_mode_equals_token_level_step_by_step(token_level):
    # noop never frees or moves a page: counts decide every metric, so fast mode is exact (no draws)
    tok_summary, tok_steps = run({**H2O, "slot_strategy": "noop"}, **KW)[:2]
    fast_summary, fast_steps = run({**H2O, "slot_strategy": "noop", "mode": "fast"}, **KW, check=True)[:2]
    for col in ("blocks_used", "live_slots", "allocated_slots", "fragmentation", "evicted_tokens",
                "block_table_entries", "duration_s"):
        assert np.array_equal(fast_steps[col].to_numpy(), tok_steps[col].to_numpy()), col
    assert fast_summary["throughput_output_tok_s"] == tok_summary["throughput_output_tok_s"]


@pytest.mark.parametrize("strategy", ["free_block", "compact"])
def test_fast_rows_sampling_keeps_the_metrics(strategy):
    # kv.fast_rows simulates a divisor of layers x KV heads: rows behave alike, so 2 rows and all 90
    # (SmolLM2: 30 layers x 3 KV heads) give the same fragmentation and throughput
    cfg = {**H2O, "slot_strategy": strategy, "mode": "fast"}
    few, _, _, kv_few = run({**cfg, "fast_rows": 2}, **KW, check=True)
    full, _, _, kv_full = run({**cfg, "fast_rows": 90}, **KW, check=True)
    assert (kv_few.rows, kv_full.rows) == (2, 90)
    for metric in ("fragmentation_mean", "kv_util_mean", "throughput_output_tok_s"):
        assert rel(few[metric], full[metric]) < 0.05, (metric, few[metric], full[metric])


@pytest.mark.parametrize("strategy", ["free_block", "slot_reuse", "sparse_copy", "compact"])
def test_fast_mode_state_stays_consistent_under_chunked_prefill(strategy):
    # prompts prefilled in 40-token chunks leave a half-written last page between steps (a fixed
    # bug: reuse strategies' first-free pointer ignored it until the prompt completed)
    s = run({**H2O, "slot_strategy": strategy, "mode": "fast"}, n=3, prompt=150, output=40, check=True,
            max_batched=40)[0]
    assert s["num_finished"] == 3 and s["evicted_token_rows"] > 0


def test_eviction_simulation_does_not_import_torch():
    # the simulator's page accounting needs the LeanKV tier table, not the real backend's tensors
    # (importing torch costs ~1.6 s per simulation on this machine)
    import subprocess
    import sys
    code = ("import sys\nfrom kvsim.sim.config import load_config\nfrom kvsim.sim.simulator.simulate import run_simulation\n"
            "cfg = load_config(None, {'trace': 'sharegpt-8k-filtered', 'trace_options.max_requests': 5, 'model': 'smollm2-135m',"
            " 'gpu': 'l4', 'kv.policy': 'h2o', 'kv.budget': 64, 'kv.layout': 'per_head', 'kv.mode': 'fast'})\n"
            "run_simulation(cfg)\nprint('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stderr


@pytest.mark.parametrize("strategy", ["free_block", "sparse_copy"])
def test_scheduler_decode_batch_path_schedules_as_the_per_request_loop(monkeypatch, strategy):
    # Scheduler._schedule_decodes reserves a pure-decode step's pages in one call; under memory
    # pressure (preemptions) it must fall back, leaving every step as the per-request loop makes it
    cfg = {**H2O, "slot_strategy": strategy, "mode": "fast"}
    kw = dict(n=10, prompt=200, output=150, num_blocks=60)
    batched = run(cfg, **kw)[1]
    monkeypatch.setattr(FastKVManager, "allocate_decodes", lambda self, reqs: None)   # no batch path
    looped = run(cfg, **kw)[1]
    assert batched["preemptions"].sum() > 0
    for col in ("batch_size", "blocks_used", "live_slots", "preemptions", "evicted_tokens", "duration_s"):
        assert np.array_equal(batched[col].to_numpy(), looped[col].to_numpy()), col


@pytest.mark.parametrize("trigger", ["pressure", "every_n", "after_prefill"])
def test_fast_mode_refuses_a_trigger_it_would_ignore(trigger):
    # fast mode evicts on the policy's own trigger: another kv.trigger once changed nothing, silently
    from kvsim.sim.config import ConfigError, KVConfig
    from kvsim.sim.model.cost_model import CostModel
    from kvsim.sim.simulator.executor import build_kv
    cost = CostModel("smollm2-135m", "h100")
    with pytest.raises(ConfigError, match=f"kv.trigger={trigger}: fast mode runs policy 'h2o' on its own trigger"):
        build_kv(KVConfig(policy="h2o", budget=32, layout="per_head", mode="fast", trigger=trigger),
                 cost.model, cost, 100, 16, 0)
    for same in ("policy", "every_step"):       # h2o's own trigger, named or not
        build_kv(KVConfig(policy="h2o", budget=32, layout="per_head", mode="fast", trigger=same),
                 cost.model, cost, 100, 16, 0)
