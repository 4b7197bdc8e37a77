"""pyramidkv: snapkv selection with per-layer budgets shrinking with depth, same total."""
import numpy as np
import pytest

from kvsim.sim.kv.policies.pyramidkv import pyramid_budgets
from kvsim.sim.kv.policy import PolicyContext, PolicyError, get_policy
from kvsim.sim.kv.state import TokenState


@pytest.mark.parametrize("mean, layers, beta", [(64, 4, 20), (100, 30, 20), (7, 5, 2), (10, 1, 20), (33, 7, 3.5)])
def test_budgets_decrease_with_depth_and_sum_to_the_total(mean, layers, beta):
    b = pyramid_budgets(mean, layers, beta)
    assert b.sum() == mean * layers
    assert (np.diff(b) <= 0).all()
    if layers > 1:
        assert b[0] > mean > b[-1]
        assert abs(b[-1] - mean / beta) <= 1 and abs(b[0] - (2 * mean - mean / beta)) <= 1


def test_rows_keep_their_layer_budget_plus_window():
    layers, heads = 4, 2
    c = PolicyContext("per_head", layers, heads, 4, 16, layers * heads)
    p = get_policy("pyramidkv", budget=40, obs_window=8, beta=4)
    st = TokenState.dense(layers * heads, 200)
    st.score[:] = np.random.default_rng(1).random(st.score.shape)
    p.on_admit(st, c)
    d = p.compress(st, c, "prefill", None)
    kept = (st.live & ~d.evict).sum(axis=1)
    expected = pyramid_budgets(40, layers, 4)[c.row_layer] + 8
    np.testing.assert_array_equal(kept, expected)
    assert kept.sum() == (40 + 8) * layers * heads            # same memory as snapkv at budget 40
    window = st.pos >= 192
    assert not (d.evict & window).any()


def test_top_votes_win_within_a_layer_budget():
    c = PolicyContext("per_head", 2, 1, 1, 16, 2)
    p = get_policy("pyramidkv", budget=4, obs_window=2, kernel_size=1, beta=4)   # layer budgets 7, 1
    st = TokenState.dense(2, 30)
    st.score[1, 17] = 5.0
    d = p.compress(st, c, "prefill", None)
    assert sorted(st.pos[1][(st.live & ~d.evict)[1]].tolist()) == [17, 28, 29]


def test_needs_per_head_layout_and_validates_beta():
    p = get_policy("pyramidkv", budget=8)
    with pytest.raises(PolicyError, match="pyramidkv.*per_head"):
        p.on_admit(TokenState(1, 0), PolicyContext("shared", 2, 2, 4, 16, 1))
    with pytest.raises(PolicyError, match="pyramidkv.*beta must be a number > 1"):
        get_policy("pyramidkv", beta=1)
