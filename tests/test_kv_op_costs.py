"""The KV policies' own work is charged from the operations performed (docs/kv-policies.md):
KV-Compress metric aggregation + sort + block-table rewrite, LeanKV quantization, Quest metadata."""

import numpy as np
import pytest

from kvsim.sim.core.step import BatchShape
from kvsim.sim.model.cost_model import CostModel
from kvsim.sim.simulator import executor as kv_executor
from kvsim.sim.kv.policy import PolicyContext, get_policy
from kvsim.sim.kv.state import TokenState
from test_kv_manager import run


def test_kvcompress_op_cost_follows_the_documented_formulas():
    c = PolicyContext("per_head", 2, 2, 8, 16, 4, head_dim=64, bytes_per_token_row=256.0)
    p = get_policy("kvcompress", compression_rate=4, obs_window=8)
    st = TokenState.dense(4, 100)
    st.live[3, 60:] = False                      # rows hold 100, 100, 100, 60 tokens
    n = np.array([100, 100, 100, 60.0])
    passes = np.array([7, 7, 7, 6])               # ceil(log2 n)
    entries = np.array([7, 7, 7, 4])
    sort_table = (16 * n * passes).sum() + (8 * entries).sum()
    b, f = p.op_cost(st, c, "reclaim")            # decode metrics come with attention: sort + table only
    assert b == pytest.approx(sort_table) and f == pytest.approx((n * passes).sum())
    b, f = p.op_cost(st, c, "prefill")            # + the window's scores recomputed over every key
    assert b == pytest.approx(sort_table + n.sum() * 256 / 2)
    assert f == pytest.approx((n * passes).sum() + 2 * 8 * (8 // 2) * 64 * 1 * n.sum())


def test_cost_model_prices_policy_operations_on_the_roofline():
    cm = CostModel("llama-3.1-8b", "h100")
    base = BatchShape(num_seqs=4, num_decode_tokens=4, kv_tokens_read=4000)
    t0 = cm.predict(base)
    mem = cm.predict(BatchShape(num_seqs=4, num_decode_tokens=4, kv_tokens_read=4000, op_bytes=1e8))
    assert mem - t0 == pytest.approx(1e8 / cm.gpu.mem_bw / cm.profile.copy_bw_eff, rel=1e-9)
    peak_a = cm.gpu.peak_flops(cm.model.activation_dtype)
    both = cm.predict(BatchShape(num_seqs=4, num_decode_tokens=4, kv_tokens_read=4000, op_bytes=1e8, op_flops=1e15))
    assert both - t0 == pytest.approx(1e15 / peak_a / cm.profile.copy_bw_eff, rel=1e-9)   # compute-bound side


def _plans(monkeypatch, kv_cfg, **kw):
    plans = []
    orig = kv_executor.KVPolicyExecutor.complete

    def complete(self, result, kv_plan):
        r = orig(self, result, kv_plan)
        plans.append((self.last_plan.op_bytes, self.last_plan.op_flops, r.duration_s))
        return r
    monkeypatch.setattr(kv_executor.KVPolicyExecutor, "complete", complete)
    s = run(kv_cfg, **kw)[0]
    return s, np.array(plans)


def test_kvcompress_compressions_cost_time(monkeypatch):
    cfg = {"policy": "kvcompress", "layout": "per_head", "slot_strategy": "compact", "params": {"compression_rate": 4}}
    s, plans = _plans(monkeypatch, cfg, n=3, prompt=200, output=20)
    charged = plans[:, 0] > 0
    assert charged.tolist() == [True] + [False] * (len(plans) - 1)   # the 3 prefills (and cuts) share step 0
    monkeypatch.setattr(type(get_policy("kvcompress")), "op_cost", lambda *a: None)
    s2, plans2 = _plans(monkeypatch, cfg, n=3, prompt=200, output=20)
    assert (plans2[:, 0] == 0).all()
    assert plans[:, 2].sum() > plans2[:, 2].sum()


def test_leankv_quantization_flops_follow_the_tokens_moved(monkeypatch):
    from kvsim.sim.kv.slots import QUANT_FLOPS
    cfg = {"policy": "leankv", "layout": "per_head", "slot_strategy": "slot_reuse"}
    s, plans = _plans(monkeypatch, cfg, n=2, prompt=120, output=30)
    assert plans[:, 1].sum() > 0
    # every FLOP charged is a quantized element: QUANT_FLOPS x 2 x head_dim per (token, row) moved
    per_token = QUANT_FLOPS * 2 * 64
    assert np.all(plans[:, 1] % per_token == 0)
