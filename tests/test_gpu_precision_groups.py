"""LeanKV mixed-precision groups and Quest selection on real tensors: the caches and kernels (CPU,
Triton under TRITON_INTERPRET=1 on tiny shapes) and end-to-end replays of truncated SmolLM2."""
import numpy as np
import pytest
import torch

from kvsim.gpu.attention import quest_bound
from kvsim.gpu.cache import CacheGeometry, PagedKVCache, PrecisionGroupKVCache
from kvsim.gpu.kernels.paged_attention import PagedKV, paged_decode_attention
from kvsim.gpu.quant import PRECISION_FORMATS
from kvsim.gpu.replay import run_replay
from kvsim.sim.config import load_config
from kvsim.sim.kv.state import PRECISION_HIGH, PRECISION_LOW
from test_gpu_replay import masked_last_query
from kvsim.traces.trace import Trace

BASE = {"model": "smollm2-135m", "gpu": "cpu-2core", "profile": "cpu-2core", "engine.block_size": 4,
        "check_invariants": True}
L, H, G, D = 2, 2, 3, 16


pytestmark = pytest.mark.usefixtures("one_thread")


def dense(q, keys, values, scale):
    """q [G, D] over keys/values [S, D] (fp32)."""
    p = torch.softmax(q.float() @ keys.T * scale, -1)
    return p @ values, p


def mixed_precision_cache(layout, seed=0):
    """A PrecisionGroupKVCache with two sequences whose rows hold a high page and a low page (in table order
    low first for row 1) with ~25% evicted slots, then a precision group move (demotion) of three high tokens into
    the low page. Returns the cache, tables [B, H, M] for layer 1, and per (b, h) the fp32 K, V the
    surviving slots were written from, slot ids in table order."""
    gen = torch.Generator().manual_seed(seed)
    nb = 12
    cache = PrecisionGroupKVCache(CacheGeometry(layout, L, H, D, nb), page_bytes=8 * 2 * D * 4, block_size=8)
    high, low = cache.capacity
    rng = np.random.default_rng(seed)
    tables = torch.full((2, H, 2), -1, dtype=torch.long)
    written = {}
    next_block = 0
    for b in range(2):
        for h in range(H if layout == "per_head" else 1):
            hp, lp = next_block, next_block + 1
            next_block += 2
            cache.set_page_precisions(torch.tensor([hp, lp]), np.array([PRECISION_HIGH, PRECISION_LOW]))
            table = [hp, lp] if b == 0 else [lp, hp]
            if layout == "per_head":
                tables[b, h] = torch.tensor(table)
            else:
                tables[b, :] = torch.tensor(table)
            n_high, n_low = high - 2, low - 5
            slots = torch.cat([hp * cache.block_slots + torch.arange(n_high), lp * cache.block_slots + torch.arange(n_low)])
            k = torch.randn(len(slots), H, D, generator=gen) * 2
            v = torch.randn(len(slots), H, D, generator=gen)
            sm = slots if layout == "shared" else torch.where(torch.arange(H)[None, :] == h, slots[:, None], -1)
            cache.write(1, k, v, sm)
            evict = slots[torch.from_numpy(rng.random(len(slots)) < 0.25)]
            cache.evict(evict)
            # demote three live high tokens into free low slots
            live_high = [int(s) for s in slots[:n_high] if s not in set(evict.tolist())][:3]
            dst = [lp * cache.block_slots + n_low + i for i in range(3)]
            cache.move_slots(torch.tensor(live_high), torch.tensor(dst), [PRECISION_HIGH] * 3, [PRECISION_LOW] * 3)
            heads = range(H) if layout == "shared" else [h]
            for hh in heads:
                written[(b, hh)] = {int(s): (k[i, hh], v[i, hh]) for i, s in enumerate(slots.tolist())}
                for s, d in zip(live_high, dst, strict=True):
                    written[(b, hh)][d] = written[(b, hh)].pop(s)
    return cache, tables, written


@pytest.mark.parametrize("layout", ["shared", "per_head"])
def test_mixed_precision_decode_attention_equals_dense_over_the_dequantized_kept_tokens(layout):
    cache, tables, written = mixed_precision_cache(layout)
    q = torch.randn(2, H * G, D, generator=torch.Generator().manual_seed(5))
    scale = D ** -0.5
    out, (p_sum, p_max) = cache.decode_attention(1, q, tables, scale, want_scores=True, group_max=True)
    _, _, live = cache.gather(1, tables)
    slots_in_order = (tables[..., None] * cache.block_slots + torch.arange(cache.block_slots)).reshape(2, H, -1)
    low_bytes, high_bytes = (PRECISION_FORMATS[t].bytes_per_token(D) for t in ("K4V2", "K8V4"))
    for b in range(2):
        for h in range(H):
            kept = slots_in_order[b, h][live[b, h]]
            assert kept.numel() > 10 and set(kept.tolist()) <= set(written[(b, h)])
            page_slots = kept + (0 if layout == "per_head" else (h + H) * cache.num_blocks * cache.block_slots)
            kd, vd = cache.pages.read(page_slots)                      # dequantized, each at its page's precision group
            qg = q[b, h * G:(h + 1) * G]
            want, p = dense(qg, kd, vd, scale)
            torch.testing.assert_close(out[b, h * G:(h + 1) * G], want, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(p_sum[b, h][live[b, h]], p.sum(0), atol=1e-6, rtol=1e-5)
            torch.testing.assert_close(p_max[b, h][live[b, h]], p.amax(0), atol=1e-6, rtol=1e-5)
            # every kept token (demoted ones re-quantized K8 -> K4) within a quantization step of its
            # page precision group of what was written, and attention within quantization error of fp32's
            kf = torch.stack([written[(b, h)][s][0] for s in kept.tolist()])
            vf = torch.stack([written[(b, h)][s][1] for s in kept.tolist()])
            precisions = [cache.pages.precisions[t] for t in cache.pages.page_precision[page_slots // cache.block_slots].tolist()]
            for x, got, bits in ((kf, kd, [t.key_bits for t in precisions]), (vf, vd, [t.value_bits for t in precisions])):
                step = (x.amax(1) - x.amin(1)) / (2 ** torch.tensor(bits) - 1)
                assert ((got - x).abs().amax(1) <= step * 1.01).all()
            assert {t.name for t in precisions} == {"K8V4", "K4V2"}
            exact, _ = dense(qg, kf, vf, scale)
            err = float((out[b, h * G:(h + 1) * G] - exact).abs().max() / exact.abs().max())
            assert 1e-4 < err < 0.5, err          # K4V2 tokens: ~0.3 (tests/test_gpu_quant_kernel.py)
    tok_bytes, page_bytes = cache.stored_bytes()
    n_live = int(cache.live.sum())                              # live (page, slot) pairs
    assert low_bytes * n_live < tok_bytes < high_bytes * n_live and tok_bytes <= page_bytes


def test_mixed_precision_triton_kernel_reports_the_group_max():
    cache, tables, _ = mixed_precision_cache("per_head", seed=2)
    q = torch.randn(2, H * G, D, generator=torch.Generator().manual_seed(3))
    ref = cache.decode_attention(1, q, tables, 0.25, want_scores=True, group_max=True)
    cache.backend = "triton"
    tri = cache.decode_attention(1, q, tables, 0.25, want_scores=True, group_max=True)
    torch.testing.assert_close(tri[0], ref[0], atol=1e-5, rtol=1e-5)
    for a, b in zip(tri[1], ref[1], strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_selective_decode_attention_equals_dense_over_exactly_the_selected_slots(backend):
    gen = torch.Generator().manual_seed(0)
    bs, nb = 4, 10
    cache = PagedKVCache(CacheGeometry("shared", 1, H, D, nb), bs, backend=backend)
    tables = torch.tensor([[0, 3, 5], [7, 2, -1]])
    slots = (tables.clamp(min=0)[..., None] * bs + torch.arange(bs)).reshape(2, -1)
    for b in range(2):
        s = slots[b][(tables[b] >= 0).repeat_interleave(bs)]
        cache.write(0, torch.randn(len(s), H, D, generator=gen), torch.randn(len(s), H, D, generator=gen), s)
    cache.evict(torch.tensor([1, 13]))
    select = torch.rand(2, H, 3 * bs, generator=gen) < 0.5
    q = torch.randn(2, H * G, D, generator=gen)
    tbl = tables[:, None, :].expand(2, H, 3)
    out, (p_sum, _) = cache.decode_attention(0, q, tbl, 0.3, want_scores=True, slot_mask=select)
    keys, values, live = cache.gather(0, tbl)
    for b in range(2):
        for h in range(H):
            m = live[b, h] & select[b, h]
            want, p = dense(q[b, h * G:(h + 1) * G], keys[b, h][m], values[b, h][m], 0.3)
            torch.testing.assert_close(out[b, h * G:(h + 1) * G], want, atol=1e-5, rtol=1e-5)
            assert (p_sum[b, h][~m] == 0).all()
            torch.testing.assert_close(p_sum[b, h][m], p.sum(0), atol=1e-6, rtol=1e-5)
    with pytest.raises(ValueError, match="slot_mask must be bool"):
        paged_decode_attention(q, PagedKV(*cache.layer_view(0), cache.live), tbl, 0.3, slot_mask=select[:, :, :5])


def test_quest_bound_bounds_every_score_of_its_page_and_is_exact_per_token():
    gen = torch.Generator().manual_seed(1)
    keys = torch.randn(1, H, 12, D, generator=gen)
    q = torch.randn(1, H * G, D, generator=gen)
    valid = torch.ones(1, H, 12, dtype=torch.bool)
    valid[0, 0, 5] = False
    pos = torch.arange(12).expand(1, H, 12)
    scores = torch.einsum("hgd,hsd->hgs", q.view(H, G, D), keys[0]).amax(1)        # [H, S] max over the group
    per_token = quest_bound(q, keys, valid, pos)
    torch.testing.assert_close(per_token[valid], scores[valid[0]].reshape(-1), atol=1e-5, rtol=1e-5)
    assert per_token[0, 0, 5] == float("-inf")
    paged = quest_bound(q, keys, valid, pos // 4)
    page_max = torch.where(valid[0], scores, float("-inf")).view(H, 3, 4).amax(-1)
    assert (paged[0].view(H, 3, 4)[valid[0].view(H, 3, 4)] >= page_max.repeat_interleave(4, 1).view(H, 3, 4)[
        valid[0].view(H, 3, 4)] - 1e-5).all()
    assert (paged[0].view(H, 3, 4) == paged[0].view(H, 3, 4)[..., :1]).logical_or(~valid[0].view(H, 3, 4)).all()


def config(**overrides):
    return load_config(None, {**BASE, **overrides})


def trace(prompts, outputs):
    return Trace.from_columns(arrival_time_s=[0.0] * len(prompts), prompt_tokens=prompts, output_tokens=outputs,
                              name="tiny")


LEANKV = {"kv.policy": "leankv", "kv.params": {"window": 16, "alpha_h": 2.0, "alpha_l": 0.5}}


@pytest.mark.parametrize("layout,strategy", [("shared", "free_block"), ("per_head", "compact")])
def test_leankv_replays_with_real_precisions_and_the_cache_follows_the_manager(small, layout, strategy):
    """Every step (check_invariants): the cache's live slots and page precision groups equal the manager's. Both precision groups
    hold tokens, demotions re-quantize into low pages, and the cache stores less than fp16 per token."""
    seen = {"low": 0, "high": 0}

    def hook(replica):
        cache = replica.executor.cache
        precision = cache.pages.page_precision.long()
        live = cache.live.sum(1)
        seen["high"] = max(seen["high"], int(live[precision == 0].sum()))
        seen["low"] = max(seen["low"], int(live[precision == 1].sum()))
        if replica.num_steps == 3:
            tok_bytes, page_bytes = cache.stored_bytes()
            n = int(live.sum())
            seen["bytes_per_token"] = tok_bytes / n
            logical = sum(r.num_computed_tokens for r in replica.scheduler.running) * L * 3   # token-rows
            seen["page_bytes_per_logical"] = page_bytes / logical

    cfg = config(**{"engine.num_gpu_blocks": 60 if layout == "shared" else 360, "kv.layout": layout,
                    "kv.slot_strategy": strategy, **LEANKV})
    res = run_replay(cfg, model=small, trace=trace([90, 70], [8, 6]), on_step=hook)
    assert res.summary["num_finished"] == 2
    assert res.tokens["output_token_ids"].map(len).tolist() == [8, 6]
    assert seen["high"] > 0 and seen["low"] > 0
    assert res.steps["bytes_moved"].sum() > 0 and res.steps["evicted_tokens"].sum() > 0
    assert len(res.decisions) == res.steps["evicted_tokens"].sum()
    fp16 = 2 * 64 * 2
    low, high = (PRECISION_FORMATS[t].bytes_per_token(64) for t in ("K4V2", "K8V4"))
    assert low < seen["bytes_per_token"] < high < fp16        # kept tokens: between pruning-only and fp16
    assert seen["page_bytes_per_logical"] < fp16              # pages held per logical token


@pytest.mark.parametrize("layout", ["shared", "per_head"])
@pytest.mark.parametrize("page_size", [4, 1])          # 1: TokenSelect's per-token selection
def test_quest_decodes_over_exactly_the_selected_tokens(small, layout, page_size):
    budget = 12
    checked = []

    def hook(replica):
        ex = replica.executor
        if replica.num_steps < 2:
            return
        for rid, logits in zip(ex.last_request_ids, ex.last_logits, strict=True):
            req = next(r for r in list(replica.scheduler.running) + replica.scheduler.finished if r.request_id == rid)
            toks = req.gpu_tokens[:req.num_computed_tokens]
            sel = ex.last_selection[rid]
            keep = np.stack([sel[layer] for layer in range(L)])                 # [L, kv_heads, T]
            assert keep.shape == (L, 3, len(toks))
            assert keep[0].all()                                              # dense layer reads everything
            counts = keep[1].sum(axis=1)
            assert (counts <= budget + page_size).all() and (counts < len(toks)).all()
            assert keep[1][:, -1].all()                                       # the current token's page
            torch.testing.assert_close(logits, masked_last_query(small, toks, keep)[0], atol=2e-4, rtol=1e-4)
            checked.append(rid)

    cfg = config(**{"engine.num_gpu_blocks": 64 if layout == "shared" else 384, "kv.layout": layout,
                    "kv.policy": "quest", "kv.params": {"budget": budget, "page_size": page_size, "dense_layers": 1}})
    res = run_replay(cfg, model=small, trace=trace([41, 30], [4, 3]), on_step=hook)
    assert res.summary["num_finished"] == 2 and res.steps["evicted_tokens"].sum() == 0
    assert sorted(set(checked)) == [0, 1] and len(checked) == 3 + 2
