"""TokenSelect's selection work as its released code runs it (sim/kv/policies/selection_work.py): the
scoring's read of every key, the soft vote and top-k over the scores, chunk-level prefill selection
(chunks of 512 queries) and the Selection Cache's reuse."""
import numpy as np
import pytest

from kvsim.sim.kv.policies import selection_work as sw
from kvsim.sim.kv.policy import PolicyContext, PolicyError, get_policy

READ = 2688                                     # the paper's Llama config: 128 + 2,048 + 512 read
# Llama-3.1-8B on one GPU: 32 layers, 8 KV heads, 32 query heads, head_dim 128, bf16 KV (128 KiB a token)
LLAMA = PolicyContext("per_head", 32, 8, 32, 16, 256, head_dim=128, bytes_per_token_row=512.0)


def test_chunked_prefill_counts_each_selection_chunk_once():
    # 10 tokens in selection chunks of 4 (4, 4, 2), budget 5. Chunk 1 (context 4 <= 5): full causal
    # attention 4 * 4 - 6 = 10 pairs, reads its 4 keys, no selection. Chunk 2 (context 8): 4 queries over
    # the 5 selected keys, its own 4 the last of them: 4 * 5 - 6 = 14 pairs; reads 5 + 8 / 2 (all K).
    # Chunk 3 (context 10): 2 * 5 - 1 = 9 pairs; reads 5 + 10 / 2.
    w = sw.prefill_selection(0, 10, 4, 5)
    assert (w.pairs, w.kv_read, w.scored_keys, w.selections) == (10 + 14 + 9, 4 + 9 + 10, 18, 2)
    assert sw.prefill_pairs(10, 4, None) == 10 * 11 / 2             # full causal attention
    assert sw.prefill_selection(0, 10, 4, 100) == sw.prefill_selection(0, 10, 4, None)     # nothing to select
    # an engine chunk starting mid-prompt splits from its own start
    assert sw.prefill_selection(6, 10, 4, 5).pairs == float(sw.causal_pairs(4, 5))


def test_causal_pairs_align_the_queries_with_the_end_of_the_keys():
    assert sw.causal_pairs(3, 3) == 6 and sw.causal_pairs(2, 5) == 4 + 5
    assert sw.causal_pairs(4, 2) == 3              # fewer keys than queries: the first queries see none


def test_score_bytes_per_key_follow_the_code_passes():
    # bf16 scores of 32 query heads: written (1), softmax read 3 times and written (4), summed over heads
    # (read 1, write one row), top-k reads the sums 3 times, the kernel reads a 4-byte index per key
    long_rows = 32 * 2 * (1 + 3 + 1 + 1) + 2 * (1 + 3) + 4
    assert sw.score_bytes_per_key(32, 1 << 20) == long_rows == 396
    # a row of at most 48 KiB of scores fits a block's shared memory: PyTorch's softmax reads it once
    assert sw.score_bytes_per_key(32, 24576) == 32 * 2 * 4 + 12 and sw.score_bytes_per_key(32, 24577) == 396


@pytest.mark.parametrize("n", [1 << 15, 1 << 17, 1 << 19])
def test_selection_cost_grows_linearly_with_context(n):
    p = get_policy("tokenselect", budget=READ, dense_layers=0)
    one, two = p.prefill_cost(n - 512, 512, LLAMA), p.prefill_cost(2 * n - 512, 512, LLAMA)
    # one selection chunk: the selected tokens' pairs and reads stay, the K read (n / 2) and score bytes double
    assert one.pairs == two.pairs == float(sw.causal_pairs(512, READ))
    assert two.kv_read - READ == 2 * (one.kv_read - READ) == n          # K only: half a token-equivalent
    assert two.op_bytes == 2 * one.op_bytes == 2 * 32 * n * 396
    assert p.decode_op_bytes(2 * n, LLAMA) == 2 * p.decode_op_bytes(n, LLAMA) == 2 * 32 * n * 396
    assert p.mean_read([2 * n], LLAMA)[0] - READ == 2 * (p.mean_read([n], LLAMA)[0] - READ)


def test_no_selection_within_the_budget():
    p = get_policy("tokenselect", budget=READ, dense_layers=0)
    assert p.decode_op_bytes(READ, LLAMA) == 0.0 and p.decode_op_bytes(READ + 1, LLAMA) > 0
    c = p.prefill_cost(0, 2048, LLAMA)
    assert c.op_bytes == 0.0 and c.pairs == 2048 * 2049 / 2


def test_selection_cache_skips_the_selection_on_its_reuse_share():
    plain = get_policy("tokenselect", budget=READ, dense_layers=0)
    cached = get_policy("tokenselect", budget=READ, dense_layers=0, reuse_rate=0.25)
    n = 1 << 17
    assert cached.decode_op_bytes(n, LLAMA) == 0.75 * plain.decode_op_bytes(n, LLAMA)
    assert cached.mean_read([n], LLAMA)[0] == READ + 0.75 * n / 2
    # the reuse rate was measured on decode queries: prefill selects in every chunk
    assert cached.prefill_cost(n, 8192, LLAMA) == plain.prefill_cost(n, 8192, LLAMA)


def test_dense_layers_attend_in_full_and_tensor_parallel_splits_nothing_twice():
    n, k = 1 << 17, 8192
    sel = get_policy("tokenselect", budget=READ, dense_layers=0).prefill_cost(n, k, LLAMA)
    dense = get_policy("tokenselect", budget=READ, dense_layers=2).prefill_cost(n, k, LLAMA)
    share, full = 2 / 32, k * (n + (k + 1) / 2)
    assert dense.pairs == pytest.approx(share * full + (1 - share) * sel.pairs)
    assert dense.kv_read == pytest.approx(share * (n + k) + (1 - share) * sel.kv_read)
    assert dense.op_bytes == pytest.approx((1 - share) * sel.op_bytes)
    # TP 2: each GPU holds 4 KV heads and 16 query heads; op_bytes stay whole-model bytes (the cost model
    # takes the GPU's kv_split share): the per-GPU score bytes / kv_split
    tp2 = PolicyContext("per_head", 32, 4, 16, 16, 128, head_dim=128, bytes_per_token_row=512.0, kv_split=0.5)
    p = get_policy("tokenselect", budget=READ, dense_layers=0)
    assert p.decode_op_bytes(n, tp2) == 32 * n * (16 * 12 + 12) / 0.5


def test_policy_selection_chunk_is_the_codes():
    p = get_policy("tokenselect", budget=READ)
    assert p.prefill_chunk == sw.PREFILL_CHUNK_SIZE == 512
    assert p.prompt_pairs(1 << 17) == sw.prefill_pairs(1 << 17, 512, READ)
    with pytest.raises((PolicyError, ValueError), match="prefill_chunk"):
        get_policy("tokenselect", prefill_chunk=0)
    assert np.isfinite(p.prompt_pairs(3))
