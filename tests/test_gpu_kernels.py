"""Triton kernels (under TRITON_INTERPRET=1) against their torch twins and against dense attention."""
import pytest
import torch

from kvsim.gpu.cache import CacheGeometry, PagedKVCache
from kvsim.gpu.kernels.cache_ops import copy_slots, reshape_and_cache
from kvsim.gpu.kernels.paged_attention import PagedKV, paged_decode_attention

H, GROUP, D = 2, 3, 16


def random_cache(layout, num_blocks, block_size, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    cache = PagedKVCache(CacheGeometry(layout, 2, H, D, num_blocks), block_size, dtype=dtype)
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
    out_t, (sum_t, sq_t) = paged_decode_attention(q, PagedKV(kc, vc, cache.live), tables, 0.25, True, backend="triton")
    out_r, (sum_r, sq_r) = paged_decode_attention(q, PagedKV(kc, vc, cache.live), tables, 0.25, True, backend="torch")
    tol = dict(atol=2e-3, rtol=2e-3) if dtype == torch.float16 else dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out_t, out_r, **tol)
    torch.testing.assert_close(sum_t, sum_r, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(sq_t, sq_r, atol=1e-5, rtol=1e-5)
    # every KV head's group of GROUP queries distributes probability mass GROUP over live slots
    torch.testing.assert_close(sum_t.sum(-1), torch.full((3, H), float(GROUP)), atol=1e-4, rtol=0)
    out_plain, none = paged_decode_attention(q, PagedKV(kc, vc, cache.live), tables, 0.25, False, backend="triton")
    assert none is None and torch.equal(out_plain, out_t)


@pytest.mark.parametrize("layout", ["shared", "per_head"])
@pytest.mark.parametrize("num_splits", [1, 2, 3, 50])
def test_split_kv_decode_matches_torch_twin(layout, num_splits):
    """Flash-decoding: each (sequence, KV head) row's table split over programs (50: capped at one
    128-slot tile per split), merged by the reduction kernel; rows of unequal width, one with an
    empty table, a Quest-style slot mask; outputs and statistics as the unsplit torch twin."""
    block_size, width = 16, 40                     # 640 slots per row: 5 tiles at head dim 16
    num_blocks = 4 * H * width
    cache = random_cache(layout, num_blocks, block_size)
    tables = tables_for(layout, 3, width, num_blocks, seed=5).clone()
    tables[1, :, 7:] = -1                          # a short row: most of its splits have nothing to read
    tables[2, 0] = -1                              # a row with no block at all
    select = torch.rand(3, H, width * block_size, generator=torch.Generator().manual_seed(6)) > 0.2
    q = torch.randn(3, H * GROUP, D, generator=torch.Generator().manual_seed(7))
    kc, vc = cache.layer_view(0)
    for mask in (None, select):
        out_t, (sum_t, sq_t) = paged_decode_attention(q, PagedKV(kc, vc, cache.live), tables, 0.3, True, "triton", mask,
                                                      num_splits=num_splits)
        out_r, (sum_r, sq_r) = paged_decode_attention(q, PagedKV(kc, vc, cache.live), tables, 0.3, True, "torch", mask)
        torch.testing.assert_close(out_t, out_r, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(sum_t, sum_r, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(sq_t, sq_r, atol=1e-6, rtol=1e-5)
        assert out_t[2, :GROUP].abs().max() == 0 and sum_t[2, 0].abs().max() == 0    # nothing to attend: zeros


def test_split_plan_fills_the_gpu_only_when_rows_cannot():
    from kvsim.gpu.kernels.split_kv import plan_splits
    # Llama-3.1-8B at batch 1 on a 132-SM H100: 8 rows; 4,096-slot tables split into 16 x 256 slots
    assert plan_splits(8, 4096, 64, 132) == (16, 256)
    assert plan_splits(8 * 64, 4096, 64, 132) == (1, 4096)           # 512 rows keep 132 SMs 97% busy
    assert plan_splits(8 * 8, 4096, 64, 132) == (2, 2048)            # 64 rows: 128 programs, not 3 per SM on some
    assert plan_splits(8, 200, 64, 132) == (1, 256)                  # short tables: not worth a merge
    assert plan_splits(8, 4096, 64, 1) == (1, 4096)                  # off CUDA: one program per row
    assert plan_splits(1, 130, 64, 1, num_splits=9) == (3, 64)       # forced: at most one tile per split
    with pytest.raises(ValueError, match="num_splits must be >= 1"):
        plan_splits(1, 130, 64, 1, num_splits=0)


def test_split_reduction_kernel_matches_torch_twin():
    from kvsim.gpu.kernels.split_kv import combine, combine_ref
    gen = torch.Generator().manual_seed(8)
    part = torch.randn(5, 4, 3, D, generator=gen)
    lse = torch.randn(5, 4, 3, generator=gen) * 3
    lse[1, 2] = float("-inf")                      # a split that read nothing
    lse[3] = float("-inf")                         # a row with nothing anywhere
    out = torch.empty(5, 3, D)
    got_lse = combine(part, lse, out)
    ref_out, ref_lse = combine_ref(part, lse)
    torch.testing.assert_close(out, ref_out, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(got_lse, ref_lse, atol=1e-6, rtol=1e-5)
    assert out[3].abs().max() == 0 and got_lse[3].isinf().all()


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_masked_attention_equals_dense_attention_over_survivors(backend):
    cache = random_cache("shared", 8, 16)
    table = torch.tensor([[5, 2, 7]])
    kc, vc = cache.layer_view(0)
    q = torch.randn(1, H * GROUP, D)
    out, (p_sum, _) = paged_decode_attention(q, PagedKV(kc, vc, cache.live), table[:, None, :].expand(1, H, 3), 0.25, True,
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
    caches = [PagedKVCache(CacheGeometry(layout, 2, H, D, 40), block_size) for _ in range(2)]
    gen = torch.Generator().manual_seed(2)
    shape = (T,) if layout == "shared" else (T, H)
    slots = torch.randperm(160, generator=gen)[:T * (1 if layout == "shared" else H)].view(shape)
    slots.view(-1)[3] = -1                                          # a token that is not cached
    for cache, backend in zip(caches, ("torch", "triton"), strict=True):
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
