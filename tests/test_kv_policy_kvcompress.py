"""kvcompress: whole-block eviction across heads by the smallest largest metric, to a rate target."""
import numpy as np
import pytest

from kvsim.sim.kv.policies.kvcompress import block_eviction_mask
from kvsim.sim.kv.policy import PolicyContext, PolicyError, get_policy
from kvsim.sim.kv.state import TokenState


def ctx(layers=1, kv_heads=2, q_heads=2, block=4):
    return PolicyContext("per_head", layers, kv_heads, q_heads, block, layers * kv_heads)


def test_blocks_with_the_smallest_max_metric_go_first_across_heads():
    metric = np.array([[1, 2, 3, 4, 50, 60, 70, 80],
                       [5, 6, 7, 8, 9, 10, 11, 12]], dtype=np.float32)
    cand = np.ones_like(metric, dtype=bool)
    # groups (block 4): row 0 -> max 4, 80; row 1 -> max 8, 12. Three blocks: 4, 8, 12.
    m = block_eviction_mask(metric, cand, 4, 3)
    assert m[0].tolist() == [True] * 4 + [False] * 4
    assert m[1].all()
    assert (m.sum(axis=1) % 4 == 0).all()


def test_incomplete_groups_are_never_evicted():
    metric = np.arange(10, dtype=np.float32)[None, :]
    cand = np.ones((1, 10), dtype=bool)
    m = block_eviction_mask(metric, cand, 4, 5)        # only 2 whole groups exist
    assert m.sum() == 8 and not m[0, 8:].any()


def test_compress_after_prefill_meets_the_rate_in_whole_blocks_and_protects_recent():
    c = ctx(2, 2, 4, block=4)
    p = get_policy("kvcompress", compression_rate=4, protect_recent=6)
    st = TokenState.dense(4, 64)
    attn = np.random.default_rng(0).random((8, 4, 64)).astype(np.float32)
    attn[:, 0, :] *= 0.01                      # row 0's attention is faint: it gives up most blocks
    p.observe(st, c, attn, "prefill")
    np.testing.assert_allclose(st.score, np.square(attn).sum(axis=0), rtol=1e-5)
    d = p.compress(st, c, "prefill", None)
    per_row = d.evict.sum(axis=1)
    assert (per_row % 4 == 0).all()
    assert st.live.sum() - d.evict.sum() <= 64 * 4 / 4                  # at the rate
    assert st.live.sum() - d.evict.sum() > 64 * 4 / 4 - 4               # by whole blocks, no more
    assert per_row[0] == per_row.max() and len(set(per_row.tolist())) > 1   # variable per head
    assert not (d.evict & (st.pos >= 58)).any()
    # within a row, the evicted tokens are the lowest-metric ones
    for r in range(4):
        ev, kept = st.score[r][d.evict[r]], st.score[r][~d.evict[r] & (st.pos[r] < 58)]
        if ev.size and kept.size:
            assert ev.max() <= kept.min()


def test_max_cache_tokens_and_reclaim_never_go_below_target():
    c = ctx(1, 2, 2, block=4)
    p = get_policy("kvcompress", max_cache_tokens=20, protect_recent=0)
    st = TokenState.dense(2, 40)
    st.score[:] = np.random.default_rng(1).random((2, 40))
    d = p.compress(st, c, "decode", None)
    assert st.live.sum() - d.evict.sum() == 40       # 2 rows x 20
    st.live &= ~d.evict
    assert p.compress(st, c, "decode", None) is None
    assert p.reclaim(st, c, 100) is None             # already at target: the scheduler must preempt
    st2 = TokenState.dense(2, 40)
    d = p.reclaim(st2, c, 8)                         # asked for 8 token-rows: two blocks, not more
    assert d.evict.sum() == 8


def test_gqa_query_heads_are_summed_onto_their_kv_head():
    c = ctx(1, 2, 4)
    per_q = np.zeros((4, 3), dtype=np.float32)
    per_q[0], per_q[1] = [0.2, 0.3, 0.5], [0.4, 0.4, 0.2]
    assert get_policy("kvcompress").gqa_reduce == "sum"
    np.testing.assert_allclose(c.gqa_reduce(per_q, "sum")[0], [0.6, 0.7, 0.7])


@pytest.mark.parametrize("params, match", [
    ({"compression_rate": 0}, "compression_rate must be a number >= 1"),
    ({"max_cache_tokens": 0}, "max_cache_tokens must be an integer >= 1"),
    ({"protect_recent": -1}, "protect_recent must be an integer >= 0"),
    ({"budget": 10}, "no parameter.*'budget'"),
])
def test_bad_parameters(params, match):
    with pytest.raises(PolicyError, match=f"kvcompress.*{match}|{match}.*kvcompress"):
        get_policy("kvcompress", **params)
