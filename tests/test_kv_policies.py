"""Policy plug-ins (none, streaming, h2o), the registry and the synthetic importance model."""
import numpy as np
import pytest

from kvsim.sim.kv.importance import ImportanceError, ImportanceModelSpec, SyntheticImportance, attention_stats
from kvsim.sim.kv.policy import PolicyContext, PolicyError, get_policy, lowest_k_mask, policy_names
from kvsim.sim.kv.state import TokenState


def ctx(rows_layers=2, kv_heads=2, q_heads=4, layout="per_head"):
    rows = rows_layers * kv_heads if layout == "per_head" else 1
    return PolicyContext(layout, rows_layers, kv_heads, q_heads, 16, rows)


def test_registry_lists_builtins_and_rejects_unknown_names_and_params():
    assert {"none", "streaming", "h2o"} <= set(policy_names())
    with pytest.raises(PolicyError, match="unknown KV policy 'h20'"):
        get_policy("h20")
    with pytest.raises(PolicyError, match="no parameter.*'budgt'.*accepts"):
        get_policy("h2o", budgt=3)
    with pytest.raises(PolicyError, match="budget must be an integer"):
        get_policy("h2o", budget=-1)


def test_none_keeps_everything():
    p = get_policy("none")
    st = TokenState.dense(4, 50)
    assert p.compress(st, ctx(), "decode", None) is None and not p.evicts and not p.needs_scores


def test_streaming_keeps_sinks_and_window():
    p = get_policy("streaming", sink=4, window=10)
    st = TokenState.dense(4, 50)
    d = p.compress(st, ctx(), "decode", None)
    kept = ~d.evict & st.live
    assert (kept.sum(axis=1) == 14).all()
    assert set(st.pos[0][kept[0]]) == set(range(4)) | set(range(40, 50))


def test_h2o_keeps_budget_recent_and_heavy_hitters_per_row():
    p = get_policy("h2o", budget=8, recent=4)
    st = TokenState.dense(2, 20)
    st.score[0, [1, 5, 9, 13]] = [5, 4, 3, 2]     # row 0's heavy hitters
    st.score[1, [2, 3, 6, 7]] = [1, 2, 3, 4]
    d = p.compress(st, ctx(1, 2, 2), "prefill", None)
    kept = st.live & ~d.evict
    assert sorted(st.pos[0][kept[0]]) == [1, 5, 9, 13, 16, 17, 18, 19]
    assert sorted(st.pos[1][kept[1]]) == [2, 3, 6, 7, 16, 17, 18, 19]
    # at the budget plus one new token: exactly one eviction per row, never a recent one
    st.live &= ~d.evict
    st.resize(21)
    st.live[:, 20], st.pos[:, 20] = True, 20
    st.num_tokens = 21
    d = p.compress(st, ctx(1, 2, 2), "decode", None)
    assert (d.evict.sum(axis=1) == 1).all()
    assert (st.pos[d.evict] < 21 - 4).all()
    assert p.compress(TokenState.dense(2, 8), ctx(1, 2, 2), "decode", None) is None


def test_h2o_reclaim_goes_below_budget_on_pressure():
    p = get_policy("h2o", budget=8, recent=2)
    st = TokenState.dense(2, 8)
    d = p.reclaim(st, ctx(1, 2, 2), 6)
    assert (d.evict.sum(axis=1) == 3).all()


def test_lowest_k_mask_varies_k_per_row():
    v = np.array([[3., 1., 2., 0.], [0., 1., 2., 3.]])
    m = lowest_k_mask(v, np.array([2, 5]), np.array([[True] * 4, [False, True, True, True]]))
    assert m[0].tolist() == [False, True, False, True]
    assert m[1].tolist() == [False, True, True, True]


def test_gqa_reduce_sums_query_heads_onto_kv_head():
    c = ctx(2, 2, 4)
    x = np.arange(2 * 4 * 3, dtype=np.float32).reshape(8, 3)   # layers*q_heads rows
    r = c.gqa_reduce(x, "sum")
    assert r.shape == (4, 3)
    np.testing.assert_allclose(r[0], x[0] + x[1])
    np.testing.assert_allclose(c.gqa_reduce(x, "max")[3], x[7])


def test_synthetic_model_matches_measured_smollm2_statistics():
    c = PolicyContext("per_head", 30, 3, 9, 16, 90)
    st = attention_stats(c, num_requests=3)
    k = st["keys_95"]
    # measured on SmolLM2-135M: keys for 95% mass min 5, p10 39, median 138, p90 309, max 815 (of ~1000)
    assert 60 <= np.median(k) <= 250
    assert np.percentile(k, 10) < 100 and np.percentile(k, 90) > 250 and k.min() < 60
    assert k[st["layer"] < 2].mean() > 2.5 * k[st["layer"] >= 2].mean()     # dense first layers
    assert 0.2 <= np.median(st["sink_share"]) <= 0.4 and st["sink_share"].max() > 0.7
    assert 0.2 <= np.median(st["recent_share"]) <= 0.45


def test_synthetic_scores_are_deterministic_and_vary_across_requests():
    c = ctx(2, 2, 4)
    def k95_for(req, seed=0):
        m = SyntheticImportance(c, seed=seed)
        st = TokenState.dense(4, 300)
        m.on_write(req, st, np.arange(4), np.broadcast_to(np.arange(300), (4, 300)), np.arange(300))
        a, kept = m.decode_scores(req, st)
        assert kept == pytest.approx(1.0, rel=1e-5)        # nothing evicted: all mass retained
        np.testing.assert_allclose(a.sum(axis=1), 1, rtol=1e-5)
        return a
    np.testing.assert_array_equal(k95_for(3), k95_for(3))
    assert not np.array_equal(k95_for(3), k95_for(4))
    assert not np.array_equal(k95_for(3), k95_for(3, seed=1))


def test_bad_importance_file_names_file_and_field(tmp_path):
    f = tmp_path / "m.yaml"
    f.write_text("head_mix: {sink: 0.5, bogus: 0.5}\nhead_types: {}\n")
    with pytest.raises(ImportanceError, match=r"m.yaml: head_mix: unknown head type"):
        ImportanceModelSpec.load(f)
    f.write_text("head_mix: {sink: 1.0}\n")
    with pytest.raises(ImportanceError, match="missing field 'head_types'"):
        ImportanceModelSpec.load(f)
