"""Triton decode attention over mixed-precision KV pages (under TRITON_INTERPRET=1) against its
torch twin and against fp32 attention over the unquantized K/V."""
import pytest
import torch

from kvsim.gpu.kernels.quant_attention import mixed_decode_attention
from kvsim.gpu.quant import MixedPrecisionKVCache

# Two page-table rows (sequence, KV head); LeanKV grows high-precision group pages from the left of a row and
# low-precision group pages from the right, so -1 holes sit in the middle.
TABLES = [[0, 1, -1, 2], [3, 6, 5, 4]]
PAGE_PRECISIONS = {0: "K8V4", 1: "K8V4", 2: "K4V2", 3: "K8V4", 4: "K4V2", 5: "K4V2", 6: "K8V8"}


def filled_cache(head_dim, seed=0):
    """Pages of PAGE_PRECISIONS filled (the last page of each row only partly), ~20% of slots evicted.
    Returns the cache and, per row, the fp32 K, V of its surviving tokens in page-table order."""
    gen = torch.Generator().manual_seed(seed)
    cache = MixedPrecisionKVCache(8, 32 * head_dim, head_dim, precisions=("K8V4", "K4V2", "K8V8"))
    for page, precision in PAGE_PRECISIONS.items():
        cache.assign(torch.tensor([page]), precision)
    survivors = []
    for row in TABLES:
        keys, values = [], []
        for i, page in enumerate(p for p in row if p >= 0):
            cap = cache.capacity[int(cache.page_precision[page])]
            n = cap if i == 0 else cap - 5
            slots = page * cache.max_tokens + torch.arange(n)
            k, v = torch.randn(n, head_dim, generator=gen) * 2, torch.randn(n, head_dim, generator=gen)
            cache.write(slots, k, v)
            evicted = torch.rand(n, generator=gen) < 0.2
            cache.live.view(-1)[slots[evicted]] = False
            keys.append(k[~evicted])
            values.append(v[~evicted])
        survivors.append((torch.cat(keys), torch.cat(values)))
    return cache, survivors


def queries(survivors, group, seed=1):
    """Each row's group of queries aims at a few of its tokens, so attention is peaked, as in decode."""
    gen = torch.Generator().manual_seed(seed)
    qs = []
    for keys, _ in survivors:
        targets = torch.randint(0, len(keys), (group,), generator=gen)
        qs.append(keys[targets] * 0.5 + torch.randn(group, keys.shape[1], generator=gen) * 0.3)
    return torch.stack(qs)


@pytest.mark.parametrize("head_dim,group,num_splits", [(16, 3, None), (32, 2, None), (16, 3, 3)])
def test_triton_matches_torch_twin_on_mixed_precision_pages_with_evictions(head_dim, group, num_splits):
    """num_splits 3: each row's pages split over three programs (flash-decoding), merged by the
    reduction kernel; statistics from the merged log-sum-exp."""
    cache, survivors = filled_cache(head_dim)
    q = queries(survivors, group)
    tables = torch.tensor(TABLES, dtype=torch.int32)
    scale = head_dim ** -0.5
    out_t, (sum_t, sq_t) = mixed_decode_attention(cache, q, tables, scale, want_scores=True, backend="triton",
                                                  num_splits=num_splits)
    out_r, (sum_r, sq_r) = cache.paged_decode_attention(q, tables, scale, want_scores=True, backend="torch")
    torch.testing.assert_close(out_t, out_r, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(sum_t, sum_r, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(sq_t, sq_r, atol=1e-6, rtol=1e-5)

    slots = (tables.long().clamp(min=0)[..., None] * cache.max_tokens + torch.arange(cache.max_tokens)).reshape(2, -1)
    alive = (tables >= 0).repeat_interleave(cache.max_tokens, dim=1) & cache.live.view(-1)[slots]
    assert sum_t.shape == (2, len(TABLES[0]) * cache.max_tokens)
    assert sum_t[~alive].abs().max() == 0 and (sum_t[alive] > 0).all()     # evicted, empty, hole slots: none
    torch.testing.assert_close(sum_t.sum(-1), torch.full((2,), float(group)), atol=1e-5, rtol=0)
    out_plain, none = mixed_decode_attention(cache, q, tables, scale, backend="triton", num_splits=num_splits)
    assert none is None and torch.equal(out_plain, out_t)
    _, (_, max_t) = mixed_decode_attention(cache, q, tables, scale, True, "triton", group_max=True,
                                           num_splits=num_splits)
    _, (_, max_r) = cache.paged_decode_attention(q, tables, scale, want_scores=True, group_max=True, backend="torch")
    torch.testing.assert_close(max_t, max_r, atol=1e-6, rtol=1e-5)


def half_steps(x, bits):
    """Half a quantization step of each row of x at the given per-row bit widths."""
    return 0.5 * (x.max(-1).values - x.min(-1).values) / (2 ** bits - 1)


def test_triton_output_within_quantization_error_of_fp32_attention():
    head_dim, group = 32, 2
    cache, survivors = filled_cache(head_dim, seed=3)
    q = queries(survivors, group, seed=4)
    scale = head_dim ** -0.5
    out, _ = cache.paged_decode_attention(q, torch.tensor(TABLES), scale, backend="triton")
    for row, (keys, values) in enumerate(survivors):
        precisions = [cache.precisions[t] for t in cache.page_precision[cache.page_slots(torch.tensor(TABLES[row])) // cache.max_tokens]]
        half_k = half_steps(keys, torch.tensor([t.key_bits for t in precisions]))
        half_v = half_steps(values, torch.tensor([t.value_bits for t in precisions]))
        probs = torch.softmax(q[row] @ keys.T * scale, -1)                       # [G, S]
        exact = probs @ values                                                  # [G, D]
        # First-order error with rounding errors uniform in +-half a step: a score moves by
        # scale * q . dk (std scale * |q| * half_k / sqrt 3) and shifts mass between values;
        # each value's own rounding adds sum_i p_i dv_i.
        score_std = scale * q[row].norm(dim=-1, keepdim=True) * half_k / 3 ** 0.5
        var = (((probs * score_std) ** 2)[..., None] * (values[None] - exact[:, None]) ** 2).sum(1) \
            + ((probs * half_v) ** 2).sum(-1, keepdim=True) / 3
        z = (out[row] - exact).abs() / var.sqrt()
        assert z.max() < 4, float(z.max())                   # no element beyond 4 standard deviations
        assert z.square().mean().sqrt() > 0.3                 # and really quantized, not fp32


def test_higher_precisions_land_closer_to_fp32():
    head_dim = 32
    _, survivors = filled_cache(head_dim, seed=3)
    q = queries(survivors, 1, seed=4)
    scale = head_dim ** -0.5
    keys, values = survivors[0]
    errors = {}
    for precision in ("K8V8", "K8V4", "K4V2"):
        single = MixedPrecisionKVCache(8, 32 * head_dim, head_dim, precisions=(precision,))
        cap = single.capacity[0]
        pages = torch.arange((len(keys) + cap - 1) // cap)
        single.assign(pages, precision)
        single.write(torch.arange(len(keys)) // cap * single.max_tokens + torch.arange(len(keys)) % cap, keys, values)
        got, _ = single.paged_decode_attention(q[:1], pages[None], scale, backend="triton")
        exact = torch.softmax(q[0] @ keys.T * scale, -1) @ values
        errors[precision] = float((got[0] - exact).abs().max() / exact.abs().max())
    assert errors["K8V8"] < errors["K8V4"] < errors["K4V2"] < 0.5, errors
    assert errors["K8V8"] < 0.02 and errors["K8V4"] < 0.15, errors


def test_single_row_decode_attention_backends_agree_and_inputs_are_checked():
    cache, survivors = filled_cache(16)
    q = queries(survivors, 3)[1]
    table = torch.tensor(TABLES[1])
    out_t, probs_t = cache.decode_attention(q, table, 0.25, backend="triton")
    out_r, probs_r = cache.decode_attention(q, table, 0.25)                # CPU tensors: the torch twin
    assert probs_t.shape == probs_r.shape == (3, len(survivors[1][0]))
    torch.testing.assert_close(out_t, out_r, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(probs_t, probs_r, atol=1e-6, rtol=1e-5)
    with pytest.raises(ValueError, match="backend must be one of"):
        cache.decode_attention(q, table, 0.25, backend="cuda")
    with pytest.raises(ValueError, match=r"q must be \[rows, group, head_dim=16\]"):
        cache.paged_decode_attention(q, table[None], 0.25)
    with pytest.raises(ValueError, match=r"page_tables must be \[rows=1, max_pages\]"):
        cache.paged_decode_attention(q[None], table, 0.25)
    with pytest.raises(ValueError, match="the cache has 8 pages"):
        cache.paged_decode_attention(q[None], torch.tensor([[0, 8]]), 0.25)
