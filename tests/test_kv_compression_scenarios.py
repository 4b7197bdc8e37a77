"""End-to-end scenarios for kvcompress, quest and leankv through the real scheduler, KV manager and
cost model (SmolLM2-135M on an L4, small closed batches)."""
import numpy as np
import pytest

from kvsim.sim.config import KVConfig, load_config
from kvsim.sim.core.request import Request
from kvsim.sim.core.scheduler import Scheduler, SchedulerConfig
from kvsim.sim.model.cost_model import CostModel
from kvsim.sim.engine.loop import EngineClock, EngineReplica, ReplicaOptions
from kvsim.sim.simulator.executor import build_kv
from kvsim.sim.results.metrics import StepLog
from kvsim.sim.simulator.simulate import run_simulation
from kvsim.sim.kv.state import TIER_LOW
from kvsim.traces.synthetic import closed_batch

N, PROMPT, OUTPUT, BLOCKS = 32, 256, 32, 160       # 32 prompts of 256 tokens, 16 per block: 10 fit uncompressed


def simulate(kv: dict):
    # prefix caching off for every run: eviction policies cannot share blocks, and the baseline
    # must differ from them only in the policy
    cfg = load_config(None, {"model": "smollm2-135m", "gpu": "l4", "kv": kv,
                             "engine": {"num_gpu_blocks": BLOCKS, "max_num_seqs": 256,
                                        "enable_prefix_caching": False}})
    r = run_simulation(cfg, trace=closed_batch(N, PROMPT, OUTPUT))
    assert r.summary["num_finished"] == N
    return r.summary, r.steps


@pytest.fixture(scope="module")
def rate_sweep():
    runs = {"none": simulate({"policy": "none", "layout": "shared", "slot_strategy": "free_block"})}
    for rate in (1, 2, 4, 8, 16):
        runs[rate] = simulate({"policy": "kvcompress", "slot_strategy": "compact",
                               "params": {"compression_rate": rate}})
    return runs


def test_kvcompress_rate_grows_the_decode_batch_and_throughput_until_saturation(rate_sweep):
    peak = {k: int(v[1]["num_decode_seqs"].max()) for k, v in rate_sweep.items()}
    tput = {k: v[0]["throughput_output_tok_s"] for k, v in rate_sweep.items()}
    assert peak[1] == peak["none"] and tput[1] == pytest.approx(tput["none"], rel=0.02)   # rate 1: no change
    assert peak[1] < peak[2] < peak[4] < peak[8] == N == peak[16]        # the whole batch fits at 8x
    assert tput[2] > 1.4 * tput[1] and tput[8] > 2 * tput[1]
    assert tput[1] < tput[2] <= tput[4] * 1.02 and tput[4] < tput[8]
    assert tput[16] / tput[8] < tput[2] / tput[1]                          # diminishing once the batch is full
    ratio = {k: rate_sweep[k][0]["compression_ratio"] for k in (2, 4, 8)}
    assert ratio[2] < ratio[4] < ratio[8] and 1.5 < ratio[2] <= 2.0
    mass = {k: rate_sweep[k][0]["attention_mass_retained_mean"] for k in (1, 2, 4, 8, 16)}
    assert mass[1] == pytest.approx(1.0) and mass[1] > mass[2] > mass[4] > mass[8] > mass[16] > 0.5
    assert (rate_sweep[4][1]["blocks_freed_by_eviction"].sum() > 0
            and rate_sweep[4][0]["bytes_moved"] > 0)                      # compaction frees whole blocks


def test_quest_reads_fewer_tokens_but_leaves_memory_and_batch_unchanged(rate_sweep):
    none_s, none_steps = rate_sweep["none"]
    s, steps = simulate({"policy": "quest", "layout": "shared", "params": {"budget": 64, "dense_layers": 0}})
    assert steps["num_decode_seqs"].max() == none_steps["num_decode_seqs"].max()
    assert s["preemptions"] == none_s["preemptions"] and s.get("evicted_tokens", 0) == 0
    assert steps["blocks_used"].max() == none_steps["blocks_used"].max()
    decode = steps[steps["num_prefill_seqs"] == 0]
    # 4 selected pages + the page min/max metadata of up to 288 tokens (18 pages, one token-equivalent each)
    assert (decode["kv_tokens_read"] <= decode["num_decode_seqs"] * (64 + 1 + 18)).all()
    assert (decode["kv_tokens_read"] >= decode["num_decode_seqs"] * (64 + 17)).all()
    assert s["throughput_output_tok_s"] > none_s["throughput_output_tok_s"]


def test_kvcompress_per_head_layout_keeps_different_counts_per_head():
    cost = CostModel("smollm2-135m", "l4")
    kv, executor = build_kv(KVConfig(policy="kvcompress", layout="per_head", slot_strategy="compact",
                                     params={"compression_rate": 4}), cost.model, cost, 40, 16, 0)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=2048, max_model_len=1024), kv)
    env = EngineClock(event_per_step=True)
    rep = EngineReplica(env, 0, sched, executor, StepLog(None), ReplicaOptions(check_invariants=True))
    rep.submit(Request(0, 0.0, 320, 2))
    while not kv.req_kv:
        env.step()
    while kv.req_kv and next(iter(kv.req_kv.values())).state.num_tokens < 321:
        env.step()
    (rk,) = kv.req_kv.values()
    live = rk.state.live.sum(axis=1)
    rows = rk.state.rows
    assert (80 - 16) * rows < live.sum() <= (80 + 1) * rows     # prompt at 320 / 4 per row (whole blocks) + 1 new
    assert live.max() - live.min() >= 32 and (live % 16 == 1).all()   # rows give up different block counts
    pages = (rk.table >= 0).sum(axis=1)
    np.testing.assert_array_equal(pages, -(-live // 16))                   # compacted: no holed pages


def run_leankv(layout: str):
    """4 requests on the real engine loop; per step, tokens kept and stored fp16-equivalents per row."""
    cost = CostModel("smollm2-135m", "l4")
    kv, executor = build_kv(KVConfig(policy="leankv", layout=layout, slot_strategy="compact",
                                     params={"window": 32}), cost.model, cost, 400, 16, 0)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=2048, max_model_len=1024), kv)
    env = EngineClock(event_per_step=True)
    rep = EngineReplica(env, 0, sched, executor, StepLog(None), ReplicaOptions(check_invariants=True))
    for i in range(4):
        rep.submit(Request(i, 0.0, 256, 48))
    tier_bytes = np.asarray(kv.ctx.tier_bytes)
    logical = kept = stored = 0.0
    while sched.has_work:
        env.step()
        for rk in kv.req_kv.values():
            st = rk.state
            logical += st.num_tokens
            kept += st.live.sum() / st.rows
            stored += tier_bytes[st.tier[st.live]].sum() / st.rows
    return logical, kept, stored, tier_bytes


@pytest.mark.parametrize("layout", ["shared", "per_head"])
def test_leankv_tiers_store_less_than_fp16_and_more_than_pruning_alone(layout):
    logical, kept, stored, tier_bytes = run_leankv(layout)
    assert kept < 0.7 * logical                      # pruning happened
    assert tier_bytes[TIER_LOW] * kept < stored < tier_bytes[1] * kept < kept
    assert logical / stored > 2 * logical / kept     # quantized tiers: more than pruning alone at equal kept tokens
