"""snapkv: one-shot selection after prefill — top-C pooled observation votes per row plus the window."""
import numpy as np
import pytest

from kvsim.sim.kv.policies.snapkv import pool_by_position
from kvsim.sim.kv.policy import PolicyContext, PolicyError, get_policy
from kvsim.sim.kv.state import TokenState


def ctx(layers=2, kv_heads=2, q_heads=4):
    return PolicyContext("per_head", layers, kv_heads, q_heads, 16, layers * kv_heads)


def kept_positions(state, decision, row):
    kept = state.live & ~decision.evict
    return sorted(state.pos[row][kept[row]].tolist())


def test_keeps_top_budget_by_votes_plus_window_per_row():
    p = get_policy("snapkv", budget=3, obs_window=4, kernel_size=1)
    st = TokenState.dense(2, 20)
    st.score[0, [2, 7, 11, 3]] = [9, 8, 7, 1]        # row 0's top 3: 2, 7, 11
    st.score[1, [0, 5, 15]] = [3, 2, 1]
    st.score[:, 16:] = 100                             # window tokens: kept regardless
    d = p.compress(st, ctx(1, 2, 2), "prefill", None)
    assert kept_positions(st, d, 0) == [2, 7, 11, 16, 17, 18, 19]
    assert kept_positions(st, d, 1) == [0, 5, 15, 16, 17, 18, 19]
    assert p.compress(st, ctx(1, 2, 2), "decode", None) is None      # once, after prefill only


def test_max_pooling_keeps_the_neighbours_of_a_heavy_hitter():
    p = get_policy("snapkv", budget=3, obs_window=2, kernel_size=3)
    st = TokenState.dense(1, 12)
    st.score[0] = 0
    st.score[0, 5] = 10.0                       # neighbours 4 and 6 inherit its pooled vote
    st.score[0, 9] = 4.0
    d = p.compress(st, PolicyContext("shared", 2, 2, 4, 16, 1), "prefill", None)
    assert kept_positions(st, d, 0) == [4, 5, 6, 10, 11]


def test_pooling_follows_positions_not_slots_and_ignores_non_candidates():
    values = np.array([[1., 5., 2., 0., 3.]], dtype=np.float32)
    pos = np.array([[4, 0, 2, 1, 3]])                      # slot order shuffled
    mask = np.array([[True, True, True, True, False]])     # position 3 is not a candidate
    # in position order: pos0=5, pos1=0, pos2=2, pos4=1 (pos 3 masked out)
    mx = pool_by_position(values, pos, mask, 3, "max")
    np.testing.assert_allclose(mx, [[2., 5., 2., 5., 0.]])
    avg = pool_by_position(values, pos, mask, 3, "avg")
    np.testing.assert_allclose(avg, [[1., 5 / 3, 1., 7 / 3, 0.]], rtol=1e-6)


def test_compression_rate_keeps_tokens_over_rate_including_window():
    p = get_policy("snapkv", compression_rate=4, obs_window=8)
    st = TokenState.dense(3, 100)
    st.score[:] = np.random.default_rng(0).random((3, 100))
    d = p.compress(st, ctx(1, 3, 3), "prefill", None)
    assert ((st.live & ~d.evict).sum(axis=1) == 25).all()          # ceil(100 / 4) per row


def test_short_prompt_keeps_everything():
    p = get_policy("snapkv", budget=16, obs_window=8)
    st = TokenState.dense(4, 20)
    assert p.compress(st, ctx(), "prefill", None) is None


def test_selection_uses_live_tokens_only_and_is_deterministic():
    p = get_policy("snapkv", budget=2, obs_window=1, kernel_size=1)
    st = TokenState.dense(1, 10)
    st.score[0] = 1.0                          # all ties: the same choice every time
    st.live[0, 3] = False
    d1 = p.compress(st, PolicyContext("shared", 1, 1, 1, 16, 1), "prefill", None)
    d2 = p.compress(st, PolicyContext("shared", 1, 1, 1, 16, 1), "prefill", None)
    np.testing.assert_array_equal(d1.evict, d2.evict)
    assert not d1.evict[0, 3] and (st.live & ~d1.evict).sum() == 3


@pytest.mark.parametrize("params, match", [
    ({"budget": 0}, "budget must be an integer >= 1"),
    ({"budget": 8, "compression_rate": 2}, "budget or compression_rate, not both"),
    ({"compression_rate": 0.5}, "compression_rate must be a number >= 1"),
    ({"kernel_size": 4}, "kernel_size must be odd"),
    ({"pooling": "median"}, "pooling must be 'max' or 'avg'"),
    ({"window": 8}, "no parameter.*'window'"),
])
def test_bad_parameters_name_policy_and_parameter(params, match):
    with pytest.raises(PolicyError, match=f"snapkv.*{match}|{match}.*snapkv"):
        get_policy("snapkv", **params)
