"""Triton kernels (under TRITON_INTERPRET=1) against their torch twins and against dense attention."""
import pytest
import torch

from kvsim.gpu.cache import PagedKVCache
from kvsim.gpu.kernels.cache_ops import copy_slots, reshape_and_cache
from kvsim.gpu.kernels.paged_attention import paged_decode_attention

H, GROUP, D = 2, 3, 16


def random_cache(layout, num_blocks, block_size, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    cache = PagedKVCache(layout, 2, H, D, num_blocks, block_size, dtype=dtype)
    cache.k.copy_(torch.randn(cache.k.shape, generator=gen))
    cache.v.copy_(torch.randn(cache.v.shape, generator=gen))
    cache.live.copy_(torch.rand(cache.live.shape, generator=gen) > 0.3)
    return cache


def tables_for(layout, num_seqs, max_blocks, num_blocks, seed=0):
    gen = torch.Generator().manual_seed(seed)
    if layout == "shared":
        t = torch.stack([torch.randperm(num_blocks, generator=gen)[:max_blocks] for _ in range(num_seqs)])
        t[0, max_blocks // 2:] = -1
        return t[:, None, :].expand(num_seqs, H, max_blocks)
    t = torch.randperm(num_blocks, generator=gen)[:num_seqs * H * max_blocks].view(num_seqs, H, max_blocks).clone()
    t[0, 1, 1:] = -1
    return t.int()


@pytest.mark.parametrize("layout", ["shared", "per_head"])
@pytest.mark.parametrize("block_size,dtype", [(1, torch.float32), (16, torch.float32), (16, torch.float16)])
def test_paged_decode_attention_triton_matches_torch(layout, block_size, dtype):
    num_blocks = 512 // block_size
    cache = random_cache(layout, num_blocks, block_size, dtype)
    tables = tables_for(layout, 3, 80 // block_size, num_blocks)
    q = torch.randn(3, H * GROUP, D, generator=torch.Generator().manual_seed(1)).to(dtype)
    kc, vc = cache.layer_view(1)
    out_t, (sum_t, sq_t) = paged_decode_attention(q, kc, vc, tables, cache.live, 0.25, True, backend="triton")
    out_r, (sum_r, sq_r) = paged_decode_attention(q, kc, vc, tables, cache.live, 0.25, True, backend="torch")
    tol = dict(atol=2e-3, rtol=2e-3) if dtype == torch.float16 else dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out_t, out_r, **tol)
    torch.testing.assert_close(sum_t, sum_r, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(sq_t, sq_r, atol=1e-5, rtol=1e-5)
    # every KV head's group of GROUP queries distributes probability mass GROUP over live slots
    torch.testing.assert_close(sum_t.sum(-1), torch.full((3, H), float(GROUP)), atol=1e-4, rtol=0)
    out_plain, none = paged_decode_attention(q, kc, vc, tables, cache.live, 0.25, False, backend="triton")
    assert none is None and torch.equal(out_plain, out_t)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_masked_attention_equals_dense_attention_over_survivors(backend):
    cache = random_cache("shared", 8, 16)
    table = torch.tensor([[5, 2, 7]])
    kc, vc = cache.layer_view(0)
    q = torch.randn(1, H * GROUP, D)
    out, (p_sum, _) = paged_decode_attention(q, kc, vc, table[:, None, :].expand(1, H, 3), cache.live, 0.25, True,
                                             backend=backend)
    slots = (table[0][:, None] * 16 + torch.arange(16)).reshape(-1)
    survivors = slots[cache.live.view(-1)[slots]]
    keys = kc.reshape(-1, H, D)[survivors]                      # [S, H, D], only surviving tokens
    values = vc.reshape(-1, H, D)[survivors]
    for h in range(H):
        qh = q[0, h * GROUP:(h + 1) * GROUP]
        probs = torch.softmax(qh @ keys[:, h].T * 0.25, dim=-1)
        torch.testing.assert_close(out[0, h * GROUP:(h + 1) * GROUP], probs @ values[:, h], atol=1e-5, rtol=1e-5)
        live_order = cache.live.view(-1)[slots]
        torch.testing.assert_close(p_sum[0, h][live_order], probs.sum(0), atol=1e-6, rtol=1e-5)
        assert p_sum[0, h][~live_order].abs().max() == 0


@pytest.mark.parametrize("layout", ["shared", "per_head"])
def test_reshape_and_cache_triton_matches_torch(layout):
    T, block_size = 7, 4
    key, value = torch.randn(T, H, D), torch.randn(T, H, D)
    caches = [PagedKVCache(layout, 2, H, D, 40, block_size) for _ in range(2)]
    gen = torch.Generator().manual_seed(2)
    shape = (T,) if layout == "shared" else (T, H)
    slots = torch.randperm(160, generator=gen)[:T * (1 if layout == "shared" else H)].view(shape)
    slots.view(-1)[3] = -1                                          # a token that is not cached
    for cache, backend in zip(caches, ("torch", "triton")):
        kc, vc = (cache.k[1], cache.v[1]) if layout == "shared" else (cache.k, cache.v)
        reshape_and_cache(key, value, kc, vc, slots, cache.live, backend=backend)
    assert torch.equal(caches[0].k, caches[1].k) and torch.equal(caches[0].v, caches[1].v)
    assert torch.equal(caches[0].live, caches[1].live)
    assert int(caches[1].live.sum()) == slots.numel() - 1
    kc = caches[1].k[1].reshape(-1, H, D) if layout == "shared" else caches[1].k.reshape(-1, D)
    if layout == "shared":
        assert torch.equal(kc[slots[0]], key[0])
    else:
        assert torch.equal(kc[slots[0, 1]], key[0, 1])


@pytest.mark.parametrize("layout", ["shared", "per_head"])
@pytest.mark.parametrize("move", [False, True])
def test_copy_and_move_slots_triton_matches_torch_and_relocates_bit_exact(layout, move):
    original = random_cache(layout, 12, 8, seed=4)
    src = torch.tensor([3, 17, 40, 41, 90])
    dst = torch.tensor([0, 5, 60, 61, 7])
    results = []
    for backend in ("torch", "triton"):
        cache = random_cache(layout, 12, 8, seed=4)
        copy_slots(cache.k, cache.v, cache.live, src, dst, move=move, backend=backend)
        results.append(cache)
    ref, tri = results
    assert torch.equal(ref.k, tri.k) and torch.equal(ref.v, tri.v) and torch.equal(ref.live, tri.live)
    rows = (lambda t: t.view(t.shape[0], 96, -1)) if layout == "shared" else (lambda t: t.view(1, 96, -1))
    assert torch.equal(rows(tri.k)[:, dst], rows(original.k)[:, src])
    assert torch.equal(rows(tri.v)[:, dst], rows(original.v)[:, src])
    assert torch.equal(tri.live.view(-1)[dst], original.live.view(-1)[src])
    untouched = torch.ones(96, dtype=torch.bool)
    untouched[torch.cat([src, dst])] = False
    assert torch.equal(rows(tri.k)[:, untouched], rows(original.k)[:, untouched])
    if move:
        assert not tri.live.view(-1)[src].any()
    else:
        assert torch.equal(tri.live.view(-1)[src], original.live.view(-1)[src])


def test_copy_slots_rejects_overlapping_or_out_of_range_slots():
    cache = random_cache("per_head", 4, 4)
    with pytest.raises(ValueError, match="disjoint"):
        cache.move_slots(torch.tensor([1, 2]), torch.tensor([2, 3]))
    with pytest.raises(ValueError, match=r"slot ids must lie in \[0, 16\)"):
        cache.copy_slots(torch.tensor([1]), torch.tensor([16]))
