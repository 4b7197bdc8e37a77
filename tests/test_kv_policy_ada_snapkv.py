"""ada_snapkv: heads of a layer compete for the layer's budget (C x heads), with a per-head floor."""
import numpy as np
import pytest

from kvsim.sim.kv.policy import PolicyContext, PolicyError, get_policy
from kvsim.sim.kv.state import TokenState


def test_concentrated_heads_give_tokens_to_spread_heads_total_per_layer_fixed():
    layers, heads, T, C, w = 2, 3, 100, 10, 4
    c = PolicyContext("per_head", layers, heads, 6, 16, layers * heads)
    st = TokenState.dense(layers * heads, T)
    rng = np.random.default_rng(0)
    st.score[:] = rng.random(st.score.shape) * 1e-3
    st.score[0, :3] = 1.0                      # layer 0 head 0: 3 heavy tokens
    st.score[1, :40] = 0.5 + rng.random(40)    # head 1: 40 strong tokens, spread
    p = get_policy("ada_snapkv", budget=C, obs_window=w, kernel_size=1, floor=0.2)
    p.on_admit(st, c)
    d = p.compress(st, c, "prefill", None)
    kept = (st.live & ~d.evict).sum(axis=1) - w
    np.testing.assert_array_equal(kept.reshape(layers, heads).sum(axis=1), [C * heads] * layers)
    assert kept[1] > C > kept[0] and kept[2] == 2          # head 2 keeps only its floor (0.2 * C)
    assert len(set(kept[:3].tolist())) == 3


def test_floor_one_is_plain_snapkv():
    layers, heads = 2, 2
    c = PolicyContext("per_head", layers, heads, 4, 16, layers * heads)
    st = TokenState.dense(layers * heads, 80)
    st.score[:] = np.random.default_rng(3).random(st.score.shape)
    st.score[0] *= 10
    ada = get_policy("ada_snapkv", budget=12, floor=1.0).compress(st, c, "prefill", None)
    snap = get_policy("snapkv", budget=12).compress(st, c, "prefill", None)
    np.testing.assert_array_equal(ada.evict, snap.evict)


def test_validation_and_layout():
    with pytest.raises(PolicyError, match="ada_snapkv.*floor must be a fraction"):
        get_policy("ada_snapkv", floor=1.5)
    with pytest.raises(PolicyError, match="ada_snapkv.*per_head"):
        get_policy("ada_snapkv").on_admit(TokenState(1, 0), PolicyContext("shared", 2, 2, 4, 16, 1))
