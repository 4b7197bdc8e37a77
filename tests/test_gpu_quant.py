"""LeanKV-style mixed-precision pages: capacity arithmetic, quantization error, attention vs fp32."""
import pytest
import torch

from kvsim.gpu.quant import PRECISION_FORMATS, MixedPrecisionKVCache, pack, unpack

D = 64


def test_tokens_per_page_follow_bytes_per_token_with_metadata():
    assert PRECISION_FORMATS["K8V4"].bytes_per_token(D) == 64 + 32 + 8
    assert PRECISION_FORMATS["K4V2"].bytes_per_token(D) == 32 + 16 + 8
    cache = MixedPrecisionKVCache(4, 4096, D)
    assert cache.capacity == [4096 // 104, 4096 // 56] == [39, 73]
    with pytest.raises(ValueError, match="unknown precision format"):
        MixedPrecisionKVCache(4, 4096, D, precisions=("K3V1",))


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_pack_unpack_round_trip(bits):
    codes = torch.randint(0, 2 ** bits, (5, D), dtype=torch.uint8)
    assert pack(codes, bits).shape == (5, D * bits // 8)
    assert torch.equal(unpack(pack(codes, bits), bits), codes)


def test_pages_dequantize_within_half_a_quantization_step():
    gen = torch.Generator().manual_seed(0)
    cache = MixedPrecisionKVCache(6, 4096, D)
    cache.assign(torch.tensor([1, 4]), "K8V4")
    cache.assign(torch.tensor([2]), "K4V2")
    key, value = torch.randn(30, D, generator=gen), torch.randn(30, D, generator=gen)
    slots = torch.cat([1 * cache.max_tokens + torch.arange(10), 4 * cache.max_tokens + torch.arange(5, 15),
                       2 * cache.max_tokens + torch.arange(60, 70)])
    cache.write(slots, key, value)
    got_k, got_v = cache.read(slots)
    for x, got, bits in ((key, got_k, [8] * 20 + [4] * 10), (value, got_v, [4] * 20 + [2] * 10)):
        steps = (x.max(-1).values - x.min(-1).values) / (2 ** torch.tensor(bits) - 1)
        err = (got - x).abs().max(-1).values
        assert (err <= 0.5 * steps * 1.01 + 2e-3).all()
        assert (err > 0).any()                        # really quantized, not stored at full precision
    assert int(cache.live.sum()) == 30
    with pytest.raises(ValueError, match="no precision group assigned"):
        cache.write(torch.tensor([0]), key[:1], value[:1])


def test_mixed_precision_attention_close_to_fp32_and_high_precision_closer():
    gen = torch.Generator().manual_seed(1)
    key, value = torch.randn(100, D, generator=gen), torch.randn(100, D, generator=gen)
    q = torch.randn(3, D, generator=gen)
    exact = torch.softmax(q @ key.T / 8, -1) @ value
    errors = {}
    for precision in ("K8V4", "K4V2"):
        cache = MixedPrecisionKVCache(8, 4096, D)
        pages = torch.arange(0, 100 // cache.capacity[cache.precision_index(precision)] + 1)
        cache.assign(pages, precision)
        cap = cache.capacity[cache.precision_index(precision)]
        slots = torch.arange(100) // cap * cache.max_tokens + torch.arange(100) % cap
        cache.write(slots, key, value)
        out, probs = cache.decode_attention(q, torch.cat([pages, torch.tensor([-1])]), 1 / 8)
        assert probs.shape == (3, 100)
        errors[precision] = float((out - exact).abs().max() / exact.abs().max())
    assert errors["K8V4"] < 0.15 and errors["K4V2"] < 0.6
    assert errors["K8V4"] < errors["K4V2"]
