"""leankv: tiers by significance against alpha/i after prefill, the window stays high, and the
demotion / pruning chain on decode."""
import numpy as np
import pytest

from kvsim.sim.kv.importance import SyntheticImportance
from kvsim.sim.kv.policies.leankv import OBSERVED, PLACED
from kvsim.sim.kv.policy import PolicyContext, PolicyError, get_policy
from kvsim.sim.kv.state import TIER_FULL, TIER_HIGH, TIER_LOW, TokenState
from test_kv_manager import run

SHARED = PolicyContext("shared", 1, 1, 1, 16, 1)


def admitted(policy, rows, tokens, ctx=SHARED):
    st = TokenState.dense(rows, tokens)
    policy.on_admit(st, ctx)
    st.field(OBSERVED)[:] = 1           # significance == score
    return st


def test_prefill_tiers_by_alpha_over_position_and_window_untouched():
    p = get_policy("leankv", alpha_h=1.0, alpha_l=0.5, window=4)
    st = admitted(p, 1, 20)
    st.score[0, 9] = 0.2     # i = 10: 0.2 > 1/10             -> high
    st.score[0, 4] = 0.15    # i = 5: 0.1 < 0.15 <= 1/5        -> low
    st.score[0, 1] = 0.2     # i = 2: 0.2 <= 0.5/2 = 0.25       -> pruned
    st.score[0, 0] = 1.5     # i = 1: > 1                        -> high
    d = p.compress(st, SHARED, "prefill", None)
    assert np.flatnonzero(d.tier[0] == TIER_HIGH).tolist() == [0, 9]
    assert np.flatnonzero(d.tier[0] == TIER_LOW).tolist() == [4]
    assert np.flatnonzero(d.evict[0]).tolist() == [1, 2, 3, 5, 6, 7, 8] + list(range(10, 16))
    assert not d.evict[0, 16:].any() and (d.tier[0, 16:] == -1).all()     # window: kept as written
    assert st.field(PLACED)[0, :16].tolist() == [True, False, False, False, True] + [False] * 4 + \
        [True] + [False] * 6


def decode_state(p, leaving_score):
    """N = 21 tokens, window 4: positions 0..15 placed, position 16 leaves the window now."""
    st = admitted(p, 1, 21)
    st.live[0, :16] = False
    st.field(PLACED)[0, :16] = True
    for pos, sig, tier in [(0, 0.5, TIER_HIGH), (3, 0.09, TIER_HIGH), (5, 0.06, TIER_LOW), (7, 0.01, TIER_LOW)]:
        st.live[0, pos], st.score[0, pos], st.tier[0, pos] = True, sig, tier
    st.score[0, 16] = leaving_score
    st.score[0, 17:] = 0.0
    return st


def test_decode_token_entering_high_demotes_least_significant_high_which_prunes_low():
    p = get_policy("leankv", alpha_h=2.0, alpha_l=1.0, window=4)     # thresholds 2/21 ~ .095, 1/21 ~ .048
    st = decode_state(p, 0.2)
    d = p.compress(st, SHARED, "decode", None)
    assert d.tier[0, 16] == TIER_HIGH
    assert d.tier[0, 3] == TIER_LOW and d.tier[0, 0] == -1           # 0.09 <= .095 demoted; 0.5 stays
    assert np.flatnonzero(d.evict[0]).tolist() == [7]               # low tier's least significant, <= .048
    assert st.field(PLACED)[0, 16] and not st.field(PLACED)[0, 17:].any()


def test_decode_token_entering_low_prunes_only_below_the_low_threshold():
    p = get_policy("leankv", alpha_h=2.0, alpha_l=1.0, window=4)
    st = decode_state(p, 0.07)
    d = p.compress(st, SHARED, "decode", None)
    assert d.tier[0, 16] == TIER_LOW and (d.tier[0, [0, 3]] == -1).all()
    assert np.flatnonzero(d.evict[0]).tolist() == [7]
    st = decode_state(p, 0.07)
    st.score[0, 7] = 0.05                                           # above 1/21: nothing to prune
    d = p.compress(st, SHARED, "decode", None)
    assert d.tier[0, 16] == TIER_LOW and not d.evict.any()


def test_decode_token_below_both_thresholds_is_pruned_without_a_chain():
    p = get_policy("leankv", alpha_h=2.0, alpha_l=1.0, window=4)
    st = decode_state(p, 0.01)
    d = p.compress(st, SHARED, "decode", None)
    assert np.flatnonzero(d.evict[0]).tolist() == [16] and (d.tier[0] == -1).all()


def test_significance_is_mean_attention_of_later_queries_max_over_gqa_group():
    p = get_policy("leankv")
    assert p.gqa_reduce == "max"
    st = TokenState.dense(1, 10)
    p.on_admit(st, SHARED)
    attn = np.full((4, 1, 10), 0.1, dtype=np.float32)
    p.observe(st, SHARED, attn, "prefill")              # queries at positions 6..9
    assert st.field(OBSERVED)[0].tolist() == [4] * 7 + [3, 2, 1]
    p.observe(st, SHARED, np.full((1, 10), 0.3, dtype=np.float32), "decode")
    np.testing.assert_allclose(p.significance(st)[0, 0], (0.4 + 0.3) / 5)


def test_heads_keep_what_their_sparsity_needs_on_the_synthetic_model():
    c = PolicyContext("per_head", 4, 3, 9, 16, 12)
    model = SyntheticImportance(c)
    T = 600
    st = TokenState.dense(12, T)
    p = get_policy("leankv", window=64)
    p.on_admit(st, c)
    model.on_write(0, st, np.arange(12), np.broadcast_to(np.arange(T), (12, T)), np.arange(T))
    scores = model.prefill_scores(0, st, p.obs_window)
    p.observe(st, c, scores, "prefill")
    d = p.compress(st, c, "prefill", scores)
    kept = (st.live & ~d.evict).sum(axis=1)
    assert kept.min() >= 64 and kept.max() > 2 * kept.min()           # no fixed budget
    assert (kept < T).all()
    assert ((d.tier == TIER_LOW).sum(axis=1) > 0).any() and ((d.tier == TIER_HIGH).sum(axis=1) > 0).all()
    assert not d.evict[:, T - 64:].any()
    assert (st.tier == TIER_FULL).all()                                # the policy only decides


@pytest.mark.parametrize("params, match", [
    ({"alpha_h": 0.1, "alpha_l": 0.2}, "alpha_l .* must be smaller than alpha_h"),
    ({"alpha_h": -1}, "alpha_h must be a number >= 0"),
    ({"window": 0}, "window must be an integer >= 1"),
    ({"budget": 10}, "no parameter.*'budget'"),
])
def test_bad_parameters(params, match):
    with pytest.raises(PolicyError, match=f"leankv.*{match}|{match}.*leankv"):
        get_policy("leankv", **params)


@pytest.mark.parametrize("strategy", ["free_block", "slot_reuse", "sparse_copy", "compact"])
def test_high_and_low_precision_pages_grow_from_opposite_ends_of_the_page_table(strategy):
    # (check_invariants also pins a fixed bug: demoted tokens were counted against the append tail's
    # free slots, so with append strategies a full low-precision tier got no new page)
    from kvsim.sim.config import KVConfig
    from kvsim.sim.core.request import Request
    from kvsim.sim.core.scheduler import Scheduler, SchedulerConfig
    from kvsim.sim.model.cost_model import CostModel
    from kvsim.sim.engine.loop import EngineClock, EngineReplica, ReplicaOptions
    from kvsim.sim.simulator.executor import build_kv
    from kvsim.sim.results.metrics import StepLog
    cost = CostModel("smollm2-135m", "l4")
    kv, executor = build_kv(KVConfig(policy="leankv", layout="per_head", slot_strategy=strategy),
                            cost.model, cost, 400, 16, 0)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=2048, max_model_len=2048), kv)
    env = EngineClock(event_per_step=True)
    rep = EngineReplica(env, 0, sched, executor, StepLog(None), ReplicaOptions(check_invariants=True))
    rep.submit(Request(0, 0.0, 400, 60))
    while rep.num_steps < 40:
        env.step()
    rk = next(iter(kv.req_kv.values()))
    high = (rk.table >= 0) & (rk.page_tier == TIER_HIGH)
    low = (rk.table >= 0) & (rk.page_tier == TIER_LOW)
    assert high.any() and low.any()
    entries = np.arange(rk.num_entries)
    last_high = np.where(high, entries, -1).max(axis=1)
    first_low = np.where(low, entries, rk.num_entries).min(axis=1)
    assert (last_high < first_low).all()                 # high pages from the front, low from the back


@pytest.mark.parametrize("strategy", ["noop", "free_block", "holed_copy"])
def test_append_strategies_never_write_over_a_live_token_after_tier_moves(strategy):
    # A tier move empties a slot in an older high page (pos -1, like a never-written slot). Appending
    # the next token there used to move the append tail into that full page, so the following tokens
    # overwrote live ones; a new token now goes to the tail page or a fresh page (check_invariants:
    # the tail's next slots are unwritten), and live tokens leave only by eviction.
    s = run({"policy": "leankv", "layout": "per_head", "slot_strategy": strategy},
            n=3, prompt=200, output=80, check=True)[0]
    assert s["evicted_token_rows"] > 0
