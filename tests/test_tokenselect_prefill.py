"""TokenSelect's attention work against full attention: decode with the Selection Cache and chunked
prefill with chunk-level selection (sim/kv/policies/selection_work.py)."""
import numpy as np
import pytest

from kvsim.sim.kv.policies.selection_work import decode_speedup, prefill_pairs, prefill_speedup
from kvsim.sim.kv.policy import PolicyContext, PolicyError, get_policy

CTX = PolicyContext("per_head", 1, 1, 1, 16, 1)
READ, CHUNK = 2688, 8192                        # the paper's Llama config: 128 + 2,048 + 512 read, chunk 8,192
CONTEXTS = [1 << k for k in range(13, 21)]      # 8K .. 1M


def test_chunked_prefill_counts_each_chunk_once():
    # 3 chunks of 4 over 10 tokens (4, 4, 2), budget 5: the first chunk (context 4 <= 5) is full causal
    # attention 4 * 4 - 6 = 10; then 4 queries x 5 selected + 8 / 2 scored = 24, 2 x 5 + 10 / 2 = 15
    assert prefill_pairs(10, 4, None) == 10 * 11 / 2
    assert prefill_pairs(10, 4, 5) == 10 + 24 + 15
    assert prefill_pairs(10, 4, 100) == prefill_pairs(10, 4, None)      # nothing to select: full


def test_prefill_speedup_grows_with_context_past_2x_at_128k_and_stays_below_2c():
    s = np.array([prefill_speedup(n, CHUNK, READ) for n in CONTEXTS])
    assert (np.diff(s) > 0).all()
    assert s[CONTEXTS.index(1 << 17)] > 2
    assert (s < 2 * CHUNK).all()
    # full ~ N^2 / 2, selective ~ N * read + N^2 / (4c): doubling a long context nearly doubles the speedup
    assert 1.9 < s[-1] / s[-2] < 2.0


@pytest.mark.parametrize("reuse", [0.0, 0.21, 0.5])
def test_decode_speedup_grows_with_context_bounded_by_the_reuse_rate(reuse):
    p = get_policy("tokenselect", budget=READ, dense_layers=0, reuse_rate=reuse)
    s = decode_speedup(p, CONTEXTS, CTX)
    bound = 2 / (1 - reuse)                      # every key's K scored on the (1 - r) share of steps
    assert (np.diff(s) > 0).all() and (s < bound).all() and s[-1] > 0.98 * bound
    if reuse > 0:
        assert s[CONTEXTS.index(1 << 17)] > 2


def test_policy_exposes_its_prefill_chunk():
    p = get_policy("tokenselect", budget=READ, prefill_chunk=CHUNK)
    assert p.prompt_pairs(1 << 17) == prefill_pairs(1 << 17, CHUNK, READ)
    assert get_policy("tokenselect").prefill_chunk == 8192
    with pytest.raises((PolicyError, ValueError), match="prefill_chunk"):
        get_policy("tokenselect", prefill_chunk=0)
