"""quest / tokenselect: selection, not eviction — reads budget tokens per sparse row, never evicts."""
import numpy as np
import pytest

from kvsim.sim.kv.policy import PolicyContext, PolicyError, get_policy
from kvsim.sim.kv.state import TokenState


def test_reads_budget_pages_per_sparse_row_dense_layers_read_everything_never_evicts():
    c = PolicyContext("per_head", 4, 2, 4, 16, 8)
    p = get_policy("quest", budget=40, page_size=16, dense_layers=2)     # 3 pages = 48 tokens
    st = TokenState.dense(8, 500)
    st.live[7, 100:] = False                                             # a row with only 100 live
    # sparse rows: 3 pages plus every page's min/max metadata (one token-equivalent per page)
    np.testing.assert_array_equal(p.read_tokens(st, c), [500] * 4 + [48 + 32, 48 + 32, 48 + 32, 48 + 7])
    short = TokenState.dense(8, 30)
    np.testing.assert_array_equal(p.read_tokens(short, c), [30] * 8)
    assert not p.evicts and p.compress(st, c, "decode", None) is None and p.reclaim(st, c, 100) is None
    assert p.default_trigger == "never" and not p.needs_scores


def test_shared_layout_reads_the_mean_over_layers():
    c = PolicyContext("shared", 4, 2, 4, 16, 1)
    p = get_policy("quest", budget=64, page_size=16, dense_layers=1)
    st = TokenState.dense(1, 1000)
    assert p.read_tokens(st, c).tolist() == [(1000 + 3 * (64 + 63)) // 4]      # 63 pages of metadata


def test_tokenselect_is_token_level():
    c = PolicyContext("per_head", 4, 1, 1, 16, 4)
    p = get_policy("tokenselect", budget=10, dense_layers=0)
    assert p.page_size == 1
    # TokenSelect scores every key (half a token-equivalent each) and reads the 10 it picks
    np.testing.assert_array_equal(p.read_tokens(TokenState.dense(4, 100), c), [10 + 50] * 4)


def test_select_takes_top_pages_by_bound_plus_the_current_page():
    c = PolicyContext("per_head", 1, 1, 1, 16, 1)
    p = get_policy("quest", budget=8, page_size=4, dense_layers=0)       # 2 pages
    st = TokenState.dense(1, 22)                                          # pages 0..5, page 5 current
    bound = np.zeros((1, 22), dtype=np.float32)
    bound[0, 9] = 1.0                                                     # page 2
    bound[0, 13] = 0.5                                                    # page 3 (loses to the current page)
    sel = p.select(st, c, bound)
    assert np.flatnonzero(sel[0]).tolist() == [8, 9, 10, 11, 20, 21]
    perm = np.random.default_rng(0).permutation(22)                        # slot order does not matter
    st2 = TokenState.dense(1, 22)
    st2.pos[0] = st.pos[0, perm]
    sel2 = p.select(st2, c, bound[:, perm])
    assert sorted(st2.pos[0][sel2[0]].tolist()) == [8, 9, 10, 11, 20, 21]


@pytest.mark.parametrize("name, params, match", [
    ("quest", {"budget": 0}, "budget must be an integer >= 1"),
    ("quest", {"page_size": -2}, "page_size must be an integer >= 1"),
    ("tokenselect", {"page_size": 16}, "no parameter.*'page_size'"),
])
def test_bad_parameters(name, params, match):
    with pytest.raises(PolicyError, match=f"{name}.*{match}|{match}.*{name}"):
        get_policy(name, **params)
