"""Attention work of one selective layer (quest / tokenselect) against full attention, in decode and in
chunked prefill, in token-pair equivalents: a query attending to a key costs 1 (its K and V), a key
only scored costs 1/2 (its K).

Decode, context n: full attention n; selective `read + (1 - r) * meta(n)` (the policy's `mean_read`:
the pages read plus the selection's scoring on the share of steps that do not reuse the cached
selection). Speedup n / (read + (1 - r) n / 2) grows with n towards 2 / (1 - r) for tokenselect.

Chunked prefill (TokenSelect's chunk-level selection, the paper's `chunk_size`, 8,192 in its Llama
config): each chunk of c queries selects once with the chunk's mean query (one query vector scores
every earlier key: n / 2) and its c queries attend to the `budget` selected tokens only, so a chunk
costs `c * min(n, budget) + n / 2` (no selection while n <= budget: then it is full attention)
against full attention's causal `c * n - c (c - 1) / 2`. Over a prompt of N tokens the full cost
grows as N^2 / 2 and the selective one as N * budget + N^2 / (4 c): the speedup grows with N
towards 2c (bounded per chunk by `2 c`).
"""
from __future__ import annotations

import numpy as np


def decode_speedup(policy, context: np.ndarray, ctx) -> np.ndarray:
    """Full over selective decode attention of one selective layer at each context length."""
    n = np.asarray(context, dtype=np.int64)
    return n / policy.mean_read(n, ctx)


def prefill_pairs(prompt: int, chunk: int, budget: int | None) -> float:
    """Token-pair equivalents of one layer's chunked prefill of `prompt` tokens: full attention when
    `budget` is None, else chunk-level selection (see the module doc)."""
    return range_pairs(0, prompt, chunk, budget)


def range_pairs(start: int, end: int, chunk: int, budget: int | None) -> float:
    """`prefill_pairs` of the prompt positions start..end-1 only (an engine's prefill chunk), in
    selection chunks of `chunk` queries counted from `start`."""
    if end <= start:
        return 0.0
    ends = np.minimum(np.arange(start + chunk, end + chunk, chunk, dtype=np.float64), end)
    sizes = np.diff(np.concatenate([[float(start)], ends]))
    full = sizes * ends - sizes * (sizes - 1) / 2
    if budget is None:
        return float(full.sum())
    selective = np.where(ends > budget, sizes * budget + ends / 2, full)
    return float(selective.sum())


def prefill_speedup(prompt: int, chunk: int, budget: int) -> float:
    """Full over chunk-selective prefill attention of one selective layer."""
    return prefill_pairs(prompt, chunk, None) / prefill_pairs(prompt, chunk, budget)
