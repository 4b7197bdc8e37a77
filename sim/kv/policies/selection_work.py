"""TokenSelect's work (Wu et al. 2024, arXiv 2411.02886), priced from what its released code runs
(github.com/pzs19/TokenSelect, `patcher/token_retrieval.py`): one selection per layer scores every
cached key and attention then reads only the selected tokens.

One selection over a context of n keys, in one layer (`TokenRetriever.get_topk_tokens`):

- **Scoring (the Paged Dot Product Kernel, `paged_matmul_kernel`).** Each query head's query against
  every cached key, gathered through the int32 token-index table: it reads all K once (the programs
  of a GQA group read the same K tile back to back, so the group's re-reads hit L2) and the index
  table, i.e. n / 2 KV token-equivalents (K, not V) plus `INDEX_BYTES` a key. It is a memory-bound
  paged read like decode attention's, so its K read joins the step's attention reads
  (`kv_tokens_read`, priced at the profile's `attn_bw_eff`, its FLOPs at `attn_compute_eff`).
- **Soft vote and top-k.** The kernel writes bf16 scores [query heads, n]; `torch.softmax(dim=-1)`
  reads each row three times (max, sum of exp, normalize; one time when the row fits the 48 KiB of
  shared memory a block gets by default) and writes it; `.sum(dim=0)` reads them and writes n;
  `torch.topk` reads the n sums `TOPK_READS` times (two 8-bit radix-select passes over 16-bit keys
  and the gather). That is `score_bytes_per_key` a key, the policy's own work (`op_bytes`, priced
  by the cost model's `policy_ops` term, a memory-bound kernel at `copy_bw_eff`); the sort of the
  2,048 chosen indices is negligible.
- **The selected tokens.** Attention over the `budget` selected tokens (n_init + top_k + n_local =
  2,688 in the paper's Llama config), gathered by index (page size 1): their K and V.

Decode: one selection per layer and step, skipped on the Selection Cache's `reuse_rate` share of
steps (a query similar enough to the cached one reuses the cached selection).

Prefill (`patched_radix_attention_extend_forward_flashinfer`): the engine's prefill chunk (SGLang's
`chunked_prefill_size`, the config's `chunk_size: 8192`) is split into selection chunks of
`PREFILL_CHUNK_SIZE` = 512 queries (hard-coded in `patch()`); each selects once with the mean of
its queries and its queries attend causally to the selected tokens, the chunk's own tokens being the
last n_local of them (FlashInfer's causal mask aligns the queries with the end of the key list).
While the context is at most `budget` (`n_init + top_k + n_local >= current tokens`) the chunk
attends to everything and selects nothing.

So against full attention a selection chunk of c queries at context n costs c * budget pairs
(compute) plus a read of all K and the score passes (memory), where full attention costs c * n
pairs. The pairs shrink by n / budget, but the selection's read grows with n like full attention's
pairs do: the speedup saturates at the ratio of c query-key pairs of compute to one memory-bound
K read plus the score passes, per key (`bench/bench_papers.py --only tokenselect`).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

PREFILL_CHUNK_SIZE = 512        # token_retrieval.py patch(): queries per prefill selection
# Kernels one selection launches in one layer (`retrieval_indices` with the released settings:
# QUERY_ROTATE on, QUERY_CACHE off, no max-pool, no TP), each a small kernel whose fixed time the cost
# model prices at the profile's `gemm_latency_s` (docs/kv-policies.md section 4):
ROUTING_KERNELS = (1        # torch.arange: the query's position ids
                   + 11     # RotaryEmbedding: position_ids.max(), cos and sin gathers, x.float(), x * cos,
                   #          rotate_half's negation and cat, .float(), * sin, the sum, .to(dtype)
                   + 1      # torch.mean over the queries: the fingerprint
                   + 3      # retrieved_tokens: two torch.arange and the torch.cat
                   + 1      # final_indices: the token-index gather
                   + 1)     # the decode wrapper's index buffer copy_ (layer 0 re-plans instead)
SCORING_KERNELS = (1        # paged_matmul_kernel (Triton)
                   + 2      # torch.softmax, .sum(dim=0)
                   + 3      # torch.topk: two radix-select passes and the gather (TOPK_READS)
                   + 2      # torch.sort of the top-k indices and its index fill
                   + 1)     # + n_init
PREFILL_CHUNK_KERNELS = 6   # per selection chunk besides the selection: indptr clone and two indptr writes,
#                             FlashInfer begin_forward's index copy, the chunk's attention launch, the output copy
SCORE_BYTES = 2                 # the scores tensor is torch.bfloat16 (get_topk_tokens)
INDEX_BYTES = 4                 # int32 token_indices, read by paged_matmul_kernel for every scored key
SOFTMAX_SMEM_BYTES = 48 * 1024  # CUDA's default shared memory per block: PyTorch's softmax caches a row
#                                 that fits (one read), else reads it three times (cunn_SoftMaxForward)
TOPK_READS = 3                  # torch.topk of 16-bit values: two 8-bit radix-select passes + the gather
#                                 (read off PyTorch's radix select, not profiled: 6 of Llama's 396 bytes a key)


def softmax_reads(keys):
    """Global-memory reads of each score row by PyTorch's softmax over `keys` bf16 scores."""
    return np.where(np.asarray(keys, dtype=np.float64) * SCORE_BYTES <= SOFTMAX_SMEM_BYTES, 1.0, 3.0)


def score_bytes_per_key(query_heads: int, keys):
    """Bytes one selection's soft vote and top-k move per scored key in one layer with `query_heads`
    query heads, over `keys` keys: write the scores, softmax (reads + write), sum over heads (read,
    write one), top-k reads, and the index table the scoring kernel reads."""
    per_head = SCORE_BYTES * (1 + softmax_reads(keys) + 1 + 1)
    return query_heads * per_head + SCORE_BYTES * (1 + TOPK_READS) + INDEX_BYTES


def score_bytes(query_heads: int, keys):
    """Bytes of one selection's soft vote and top-k over `keys` keys in one layer (`keys` x
    score_bytes_per_key)."""
    k = np.asarray(keys, dtype=np.float64)
    return k * score_bytes_per_key(query_heads, k)


def causal_pairs(queries: np.ndarray | float, keys: np.ndarray | float) -> np.ndarray | float:
    """Query-key pairs of `queries` queries attending causally to `keys` keys whose last `queries`
    are the queries' own tokens (query i sees keys up to keys - queries + i; with fewer keys than
    queries, the first queries see none)."""
    q, k = np.asarray(queries, dtype=np.float64), np.asarray(keys, dtype=np.float64)
    return np.where(k >= q, q * k - q * (q - 1) / 2, k * (k + 1) / 2)


@dataclass(frozen=True)
class PrefillSelection:
    """One selective layer's work for prompt positions start..end-1 (an engine prefill chunk)."""
    pairs: float          # query-key pairs attended (the selected tokens; all tokens where nothing is selected)
    kv_read: float        # KV token-equivalents read: selected tokens (K and V), all K once per selection (1/2 a
    #                       key), or the whole context where nothing is selected
    scored_keys: float    # keys scored, summed over the selections
    score_bytes: float    # bytes of the selections' soft vote and top-k (score_bytes_per_key), one layer
    selections: int       # selection chunks that selected

    @property
    def kernels(self) -> float:
        """Small kernels these selections launch in one layer (ROUTING + SCORING + PREFILL_CHUNK each)."""
        return float(self.selections * (ROUTING_KERNELS + SCORING_KERNELS + PREFILL_CHUNK_KERNELS))


def prefill_selection(start: int, end: int, chunk: int, budget: int | None, query_heads: int = 1) -> PrefillSelection:
    """The prompt positions start..end-1 in selection chunks of `chunk` queries counted from `start`
    (the code splits each engine chunk), each selecting among every key up to its end when there are
    more than `budget` (None: full attention, never selects)."""
    if end <= start:
        return PrefillSelection(0.0, 0.0, 0.0, 0.0, 0)
    ends = np.minimum(np.arange(start + chunk, end + chunk, chunk, dtype=np.float64), end)
    sizes = np.diff(np.concatenate([[float(start)], ends]))
    full = causal_pairs(sizes, ends)
    if budget is None:
        return PrefillSelection(float(full.sum()), float(ends.sum()), 0.0, 0.0, 0)
    sel = ends > budget
    pairs = np.where(sel, causal_pairs(sizes, float(budget)), full)
    read = np.where(sel, budget + ends / 2, ends)
    scored = ends[sel]
    return PrefillSelection(float(pairs.sum()), float(read.sum()), float(scored.sum()),
                            float(score_bytes(query_heads, scored).sum()), int(sel.sum()))


def prefill_pairs(prompt: int, chunk: int, budget: int | None) -> float:
    """Query-key pairs of one layer's prefill of `prompt` tokens in selection chunks of `chunk`:
    full causal attention when `budget` is None, else chunk-level selection."""
    return prefill_selection(0, prompt, chunk, budget).pairs


def decode_score_bytes(context, query_heads: int, budget: int):
    """Bytes one decode selection's soft vote and top-k move in one layer at `context` keys (0 where
    nothing is selected: context <= budget)."""
    n = np.asarray(context, dtype=np.float64)
    return np.where(n > budget, score_bytes(query_heads, n), 0.0)


def decode_selection_kernels(context, budget: int, scoring_share: float = 1.0):
    """Small kernels one decode selection launches in one layer at `context` keys: the routing kernels,
    and the scoring ones on the `scoring_share` of steps that score (the rest reuse a cached selection);
    none where nothing is selected (`retrieval_indices` returns before any launch when context <= budget)."""
    n = np.asarray(context, dtype=np.float64)
    return np.where(n > budget, ROUTING_KERNELS + scoring_share * SCORING_KERNELS, 0.0)
