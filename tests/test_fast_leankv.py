"""LeanKV in fast mode: the token-level manager on a stratified sample of the rows (sim/kv/fast/sampled/rows.py),
its decode steps compiled (sim/kv/fast/sampled/leankv.py), against token-level mode on the same workloads:
fragmentation, KV utilization and throughput within 5%; the compiled steps against the token-level
manager on the same rows: the same run."""
import math

import numpy as np

import pytest

from kvsim.sim.config import KVConfig
from kvsim.sim.simulator.executor import build_kv
from kvsim.sim.kv.base import sample_row_count
from kvsim.sim.kv.fast.sampled import leankv_kernel
from kvsim.sim.kv.fast.sampled.leankv import BatchedLeanKVManager
from kvsim.sim.kv.fast.sampled.rows import SampledRowsKVManager
from test_kv_manager import MODEL, run

METRICS = ("fragmentation_mean", "kv_util_mean", "throughput_output_tok_s")
LEANKV = {"policy": "leankv", "layout": "per_head"}


def rel(a, b):
    return abs(a - b) / max(abs(b), 1e-12)


def assert_agrees(cfg, **kw):
    tok, tok_steps = run({k: v for k, v in cfg.items() if k != "fast_rows"}, **kw)[:2]
    fast, fast_steps = run({**cfg, "mode": "fast"}, **kw, check=True)[:2]
    assert fast["evicted_token_rows"] > 0
    assert rel(fast["evicted_token_rows"], tok["evicted_token_rows"]) < 0.02
    for metric in METRICS:
        assert rel(fast[metric], tok[metric]) < 0.05, (metric, fast[metric], tok[metric])
    return tok_steps, fast_steps


@pytest.mark.parametrize("strategy", ["noop", "free_block", "slot_reuse", "compact", "sparse_copy"])
def test_leankv_fast_mode_agrees_with_token_level_within_5_percent(strategy):
    assert_agrees({**LEANKV, "slot_strategy": strategy}, n=6, prompt=300, output=60)


@pytest.mark.parametrize("strategy", ["free_block", "slot_reuse"])
def test_leankv_fast_mode_agrees_with_long_outputs(strategy):
    # 200 decode steps: most tokens are placed (or demoted) after the prompt cut
    assert_agrees({**LEANKV, "slot_strategy": strategy}, n=6, prompt=300, output=200)


@pytest.mark.parametrize("num_blocks, fast_rows", [(40, 15), (60, 10)])
def test_leankv_fast_mode_preempts_as_token_level_under_memory_pressure(num_blocks, fast_rows):
    # 10 or 15 sampled rows of 90 (with the default 6 the pool's coarser steps preempt 1-2 more times;
    # with 10 at 40 blocks, once more)
    cfg = {**LEANKV, "slot_strategy": "free_block", "fast_rows": fast_rows}
    tok_steps, fast_steps = assert_agrees(cfg, n=10, prompt=300, output=200, num_blocks=num_blocks)
    assert fast_steps["preemptions"].sum() == tok_steps["preemptions"].sum() > 0


def sampled_rows_uncompiled(monkeypatch):
    """Fast mode as the sampled-row manager alone (as where numba is absent)."""
    monkeypatch.setattr(leankv_kernel, "njit", None)


def same_run(a, b, loose=()):
    assert a.keys() == b.keys()
    for key, value in b.items():
        if key in loose:
            assert math.isclose(a[key], value, rel_tol=1e-6), key
        else:
            assert a[key] == value or (math.isnan(value) and math.isnan(a[key])), key


def test_all_rows_sampled_is_token_level_exactly(monkeypatch):
    # fast_rows = every row: the same heads, draws and pages, so the same run bit for bit
    sampled_rows_uncompiled(monkeypatch)
    cfg = {**LEANKV, "slot_strategy": "slot_reuse"}
    tok = run(cfg, n=3, prompt=120, output=40)[0]
    fast = run({**cfg, "mode": "fast", "fast_rows": 90}, n=3, prompt=120, output=40, check=True)[0]
    same_run(fast, tok)


# the compiled step sums float32 attention in another order (the attention mass, and the stored-token
# total behind compression_ratio, differ in the last digits); everything else is the same run
LOOSE = ("attention_mass_retained_mean", "attention_mass_retained_p10", "compression_ratio")


@pytest.mark.parametrize("strategy, output, num_blocks", [
    ("noop", 60, 400), ("free_block", 60, 400), ("slot_reuse", 200, 400), ("compact", 60, 400),
    ("free_block", 200, 40), ("compact", 200, 40)])
def test_compiled_decode_steps_are_the_token_level_manager_on_the_same_rows(monkeypatch, strategy, output,
                                                                              num_blocks):
    cfg = {**LEANKV, "slot_strategy": strategy, "mode": "fast"}
    compiled, steps, _, kv = run(cfg, n=6, prompt=300, output=output, num_blocks=num_blocks, check=True)
    assert isinstance(kv, BatchedLeanKVManager)
    sampled_rows_uncompiled(monkeypatch)
    plain, plain_steps, _, plain_kv = run(cfg, n=6, prompt=300, output=output, num_blocks=num_blocks, check=True)
    assert type(plain_kv) is SampledRowsKVManager
    same_run(compiled, plain, LOOSE)
    for column in ("batch_size", "kv_tokens_read", "blocks_used", "live_slots", "allocated_slots", "evicted_tokens",
                   "blocks_freed_by_eviction", "bytes_moved", "block_table_entries", "preemptions", "duration_s"):
        assert (steps[column].to_numpy() == plain_steps[column].to_numpy()).all(), column
    if num_blocks == 40:
        assert compiled["preemptions"] > 0


@pytest.mark.parametrize("kv, compiled", [
    ({"slot_strategy": "slot_reuse"}, True), ({"slot_strategy": "noop"}, True), ({"slot_strategy": "compact"}, True),
    ({"slot_strategy": "sparse_copy"}, False), ({"slot_strategy": "parallel_compact"}, False),
    ({"slot_strategy": "free_block", "trigger": "every_n", "trigger_interval": 4}, False)])
def test_leankv_decode_steps_are_compiled_where_the_kernel_covers_them(kv, compiled):
    from kvsim.sim.model.cost_model import CostModel
    cost = CostModel(MODEL, "l4")
    manager = build_kv(KVConfig(**LEANKV, **kv, mode="fast"), cost.model, cost, 100, 16, 0)[0]
    assert isinstance(manager, BatchedLeanKVManager) is compiled
    assert isinstance(manager, SampledRowsKVManager)


def test_sampled_rows_scale_pool_and_slots_to_all_rows():
    from kvsim.sim.model.cost_model import CostModel
    cost = CostModel(MODEL, "l4")
    kv = build_kv(KVConfig(**LEANKV, mode="fast", fast_rows=8), cost.model, cost, 100, 16, 0)[0]
    assert isinstance(kv, SampledRowsKVManager)
    assert (kv.rows, kv.unit) == (6, 15)                  # SmolLM2: 30 layers x 3 KV heads = 90 rows
    assert kv.pool.num_blocks == 100 * 90 and kv.pool.num_free_blocks == kv.pool.num_blocks
    assert kv.inner.pool.num_blocks == 100 * 6


def test_sample_row_count_is_the_largest_divisor_not_above_the_wish():
    assert sample_row_count(90, 8) == 6
    assert sample_row_count(256, 8) == 8
    assert sample_row_count(7, 100) == 7


def test_the_memory_estimate_has_no_slab_for_sampled_rows():
    from kvsim.sim.config import load_config
    from kvsim.sim.engine.run_plan import build_run_plan
    from kvsim.sim.simulator.simulate import load_workload
    parts = {}
    for policy in ("leankv", "h2o"):
        cfg = load_config(None, {"kv.policy": policy, "kv.layout": "per_head", "kv.mode": "fast",
                                 "trace_options.max_requests": 20})
        estimate = build_run_plan(cfg, trace=load_workload(cfg)).memory
        parts[policy] = dict((p[0], p[3]) for p in estimate.parts)
    assert parts["leankv"]["fast-mode slabs"] == 0 < parts["h2o"]["fast-mode slabs"]


@pytest.mark.skipif(leankv_kernel.njit is None, reason="numba absent: the step is not compiled")
def test_candidates_are_kept_by_significance_then_slot_in_any_offering_order():
    # the attention walks a row's active list in any order; its KMAX lowest candidates must be those a
    # walk in slot order keeps (ties: the earlier slot)
    rng = np.random.default_rng(0)
    values = rng.choice([0.5, 1.0, 1.5, 2.0], size=40)          # many ties
    slots = np.arange(40)

    def keep(order):
        vals, idx = np.zeros(leankv_kernel.KMAX), np.zeros(leankv_kernel.KMAX, dtype=np.int64)
        count = 0
        for i in order:
            count = leankv_kernel._insert(vals, idx, count, values[i], slots[i])
        return vals[:count].tolist(), idx[:count].tolist()

    expected = keep(range(40))
    assert expected[1] == sorted(slots, key=lambda s: (values[s], s))[:leankv_kernel.KMAX]
    for _ in range(5):
        assert keep(rng.permutation(40)) == expected


@pytest.mark.skipif(leankv_kernel.njit is None, reason="numba absent: the step is not compiled")
def test_invariant_check_catches_an_active_list_that_drifted(monkeypatch):
    # the kernel's packed lists of active tokens must stay the live, unsettled tokens of each row
    decode, calls = BatchedLeanKVManager._decode, []

    def drift(self, batch, reserved):
        decode(self, batch, reserved)
        calls.append(1)
        if len(calls) == 20:
            active = batch[0].arrays.active
            active.count[0] -= 1                      # a token drops out of row 0's list
    monkeypatch.setattr(BatchedLeanKVManager, "_decode", drift)
    with pytest.raises(AssertionError, match="active list drifted"):
        run({**LEANKV, "slot_strategy": "slot_reuse", "mode": "fast"}, n=4, prompt=300, output=60, check=True)


def test_compiled_decode_steps_cross_a_chunk_of_content_weights(monkeypatch):
    # decode tokens past position 512 take the request's next chunk of content weights (256 positions
    # a draw) while it decodes compiled: the same run as the sampled-row manager's
    cfg = {**LEANKV, "slot_strategy": "slot_reuse", "mode": "fast"}
    compiled, steps = run(cfg, n=3, prompt=480, output=80, check=True)[:2]
    sampled_rows_uncompiled(monkeypatch)
    plain, plain_steps = run(cfg, n=3, prompt=480, output=80, check=True)[:2]
    same_run(compiled, plain, LOOSE)
    assert (steps["evicted_tokens"].to_numpy() == plain_steps["evicted_tokens"].to_numpy()).all()
