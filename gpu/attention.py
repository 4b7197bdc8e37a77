"""Attention over the paged KV cache for one flattened engine step (prefill chunks + decodes).

Per layer: prefill sequences first gather their live cached context (before this step's writes),
then every new token's K/V is written to its slot (marking it live), decodes run the paged decode
kernel over live slots, and each prefill chunk runs SDPA over [live context, chunk (causal)].

The cache decides how K/V are stored: full precision (`PagedKVCache`) or LeanKV's mixed-precision
pages (`PrecisionGroupKVCache`, dequantized on read). A `decode_select` hook (Quest / TokenSelect) narrows
each decode's read to the slots the selection policy picked, layer by layer.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple
from collections.abc import Callable

import torch
import torch.nn.functional as F



@dataclass
class AttentionScores:
    """Attention statistics per cached slot, in block-table order: index j * block_size + o is
    offset o of entry j of the (sequence, layer, KV head) block table (the sequence's table in the
    shared layout). `sum` / `sq` are the sum / sum of squares of attention probabilities over the
    observed queries (last `score_window` of a prefill chunk, the one query of a decode) and the
    query heads of the KV head's GQA group. Slots not live are 0. Shape [B, layers, kv_heads, M*bs]."""
    sum: torch.Tensor
    sq: torch.Tensor
    num_queries: torch.Tensor  # [B] observed queries per sequence (to average)
    max: torch.Tensor | None = None   # with score_max: sum over observed queries of the max over the group


@dataclass
class AttentionMetadata:
    """What the engine core hands the model each step (all tensors on the model's device).

    query_start_loc [B+1] int: token offsets of each sequence's scheduled tokens in the flat batch.
    seq_lens [B] int: the sequence's length (tokens computed) after this step.
    slot_mapping: shared [T]; per_head [T, layers, kv_heads]. Slot of each new token (-1: not cached).
    block_tables: shared [B, M]; per_head [B, layers, kv_heads, M]; -1 padded. Every listed block
        is scanned; only live slots are attended.
    score_window: 0 = no statistics; w > 0 = fill `scores` from the last w queries of each
        prefill chunk (and the single query of each decode).
    score_max: also fill `scores.max` (max over each GQA group, summed over the observed queries:
        LeanKV's significance) instead of `scores.sq`.
    decode_select: None, or fn(layer, q [Bd, heads, D], tables [Bd, kv_heads, M], cache) -> bool
        [Bd, kv_heads, M * block_slots]: the slots each decode (in batch order) reads in that layer.
    """
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    score_window: int = 0
    score_max: bool = False
    decode_select: Callable | None = None
    scores: AttentionScores | None = None
    _prepared: dict = field(default_factory=dict, repr=False)

    @property
    def layout(self) -> str:
        return "shared" if self.block_tables.dim() == 2 else "per_head"

    @property
    def num_seqs(self) -> int:
        return self.query_start_loc.numel() - 1

    def prepare(self, cache) -> None:
        """Validate shapes against the cache, precompute host-side indices and snapshot the live
        mask prefill contexts read (this step's writes must not leak into other layers' context)."""
        num_layers, num_kv_heads, block_size = cache.num_layers, cache.num_kv_heads, cache.block_slots
        if self.layout != cache.layout:
            raise ValueError(f"metadata is for the {self.layout} layout but the cache is {cache.layout}")
        B, T = self.num_seqs, int(self.query_start_loc[-1])
        starts = self.query_start_loc.tolist()
        query_lens = [e - s for s, e in zip(starts, starts[1:], strict=False)]
        if starts[0] != 0 or min(query_lens, default=1) < 1:
            raise ValueError(f"query_start_loc must start at 0 and increase strictly, got {starts}")
        if self.seq_lens.shape != (B,):
            raise ValueError(f"seq_lens must be [{B}], got {tuple(self.seq_lens.shape)}")
        if self.layout == "shared":
            expected_slots, table_ok = (T,), self.block_tables.dim() == 2 and self.block_tables.shape[0] == B
        else:
            expected_slots = (T, num_layers, num_kv_heads)
            table_ok = self.block_tables.shape[:3] == (B, num_layers, num_kv_heads)
        if not table_ok:
            raise ValueError(f"block_tables must be [{B}, M] (shared) or [{B}, {num_layers}, {num_kv_heads}, M] "
                             f"(per_head), got {tuple(self.block_tables.shape)}")
        if tuple(self.slot_mapping.shape) != expected_slots:
            raise ValueError(f"slot_mapping must be {list(expected_slots)} for the {self.layout} layout, "
                             f"got {list(self.slot_mapping.shape)}")
        device = self.block_tables.device
        decode = [b for b, n in enumerate(query_lens) if n == 1]
        M = self.block_tables.shape[-1]
        prefill = [b for b, n in enumerate(query_lens) if n > 1]
        self._prepared = {
            "live_before": cache.live.clone() if prefill else None, "prefill": prefill,
            "starts": starts, "query_lens": query_lens, "num_kv_heads": num_kv_heads,
            "decode_seqs": torch.tensor(decode, dtype=torch.long, device=device),
            "decode_tokens": torch.tensor([starts[b] for b in decode], dtype=torch.long, device=device),
        }
        if self.score_window > 0:
            shape = (B, num_layers, num_kv_heads, M * block_size)
            observed = [1 if n == 1 else min(n, self.score_window) for n in query_lens]
            self.scores = AttentionScores(torch.zeros(shape, device=device), torch.zeros(shape, device=device),
                                          torch.tensor(observed, device=device),
                                          torch.zeros(shape, device=device) if self.score_max else None)

    def layer_tables(self, layer: int) -> torch.Tensor:
        """[B, kv_heads, M] block tables of one layer (a stride-0 expansion for shared)."""
        if self.layout == "shared":
            B, M = self.block_tables.shape
            return self.block_tables[:, None, :].expand(B, self._prepared["num_kv_heads"], M)
        return self.block_tables[:, layer]

    def layer_slots(self, layer: int) -> torch.Tensor:
        return self.slot_mapping if self.layout == "shared" else self.slot_mapping[:, layer]


def paged_attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
                    cache, scale: float) -> torch.Tensor:
    """q [T, heads, D], k/v [T, kv_heads, D] (RoPE applied) -> attention output [T, heads, D]."""
    prep = meta._prepared
    tables = meta.layer_tables(layer)
    contexts = {b: cache.gather(layer, tables[b:b + 1], live=prep["live_before"]) for b in prep["prefill"]}
    cache.write(layer, k, v, meta.layer_slots(layer))
    out = torch.empty_like(q)
    want_scores = meta.scores is not None
    if prep["decode_seqs"].numel():
        tokens, seqs = prep["decode_tokens"], prep["decode_seqs"]
        q_dec, dec_tables = q[tokens], tables[seqs]
        selected = meta.decode_select(layer, q_dec, dec_tables, cache) if meta.decode_select is not None else None
        out[tokens], stats = cache.decode_attention(layer, q_dec, dec_tables, scale, want_scores=want_scores,
                                                    group_max=meta.score_max, slot_mask=selected)
        if want_scores:
            second = meta.scores.max if meta.score_max else meta.scores.sq
            meta.scores.sum[seqs, layer], second[seqs, layer] = stats
    for b in prep["prefill"]:
        s, e = prep["starts"][b], prep["starts"][b + 1]
        context = GatheredContext(*(t[0] for t in contexts[b]))
        out[s:e], stats = prefill_attention(q[s:e], k[s:e], v[s:e], context, scale,
                                            meta.score_window if want_scores else 0, group_max=meta.score_max)
        if want_scores:
            index = _table_index(meta.layer_slots(layer)[s:e], tables[b], cache.block_slots)
            second = meta.scores.max if meta.score_max else meta.scores.sq
            for dst, (ctx_part, chunk_part) in zip((meta.scores.sum, second), stats, strict=True):
                dst[b, layer] = ctx_part.scatter(1, index, chunk_part)
    return out


def quest_bound(q: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, page: torch.Tensor) -> torch.Tensor:
    """Quest's criticality estimate per slot: for the page (`page` [B, H, S], a position range) of each
    valid slot, the upper bound sum_d max(q_d * max_d, q_d * min_d) of the query's score over the
    page's channel-wise key min/max, max over the GQA group's query heads.

    q [B, heads, D]; keys [B, H, S, D]; valid [B, H, S] bool. Returns [B, H, S] fp32 (-inf where not valid)."""
    B, H, S, D = keys.shape
    keys = keys.float()
    num_pages = int(page[valid].max()) + 2 if valid.any() else 1      # the last one collects invalid slots
    pg = torch.where(valid, page, num_pages - 1).long()
    idx = pg[..., None].expand(B, H, S, D)
    kmax = torch.full((B, H, num_pages, D), float("-inf"), device=keys.device).scatter_reduce(2, idx, keys, "amax")
    kmin = torch.full((B, H, num_pages, D), float("inf"), device=keys.device).scatter_reduce(2, idx, keys, "amin")
    kmax, kmin = kmax.nan_to_num(0.0, posinf=0.0, neginf=0.0), kmin.nan_to_num(0.0, posinf=0.0, neginf=0.0)
    qg = q.float().view(B, H, -1, 1, D)
    bound = torch.maximum(qg * kmax[:, :, None], qg * kmin[:, :, None]).sum(-1).amax(2)    # [B, H, pages]
    return torch.gather(bound, 2, pg).masked_fill(~valid, float("-inf"))


def _table_index(slots: torch.Tensor, table: torch.Tensor, block_size: int) -> torch.Tensor:
    """Block-table-order index [H, c] of chunk tokens given their slots ([c] or [c, H]) and table [H, M]."""
    H = table.shape[0]
    slots = (slots[:, None].expand(-1, H) if slots.dim() == 1 else slots).T.long()   # [H, c]
    entry = (table[:, None, :] == (slots // block_size)[:, :, None]).int().argmax(-1)
    return entry * block_size + slots % block_size


class GatheredContext(NamedTuple):
    """A sequence's cached context gathered from its block table: K, V [H, S, D] and live [H, S]."""
    k: torch.Tensor
    v: torch.Tensor
    live: torch.Tensor


def prefill_attention(q, k, v, context: GatheredContext, scale: float, score_window: int = 0,
                      group_max: bool = False):
    """A prefill chunk of c tokens over its live cached context (S slots) plus itself, causally.

    q [c, heads, D]; k, v [c, H, D]; context: K, V [H, S, D] and live [H, S].
    Returns out [c, heads, D] and, with score_window w, ((ctx_sum [H, S], chunk_sum [H, c]),
    (ctx_sq, chunk_sq)) over the last min(w, c) queries (with `group_max`: the max over the GQA group
    summed over those queries in place of the sum of squares).
    """
    c, nh, D = q.shape
    ctx_k, ctx_v, ctx_live = context
    H, S = ctx_live.shape
    group = nh // H
    keys = torch.cat([ctx_k.to(q.dtype), k.transpose(0, 1)], dim=1).repeat_interleave(group, 0)   # [heads, S+c, D]
    values = torch.cat([ctx_v.to(q.dtype), v.transpose(0, 1)], dim=1).repeat_interleave(group, 0)
    causal = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    mask = torch.cat([ctx_live[:, None, :].expand(H, c, S), causal.expand(H, c, c)], dim=-1)
    mask = mask.repeat_interleave(group, 0)                                                      # [heads, c, S+c]
    qh = q.transpose(0, 1)
    out = F.scaled_dot_product_attention(qh, keys, values, attn_mask=mask, scale=scale).transpose(0, 1)
    if not score_window:
        return out, None
    w = min(score_window, c)
    s = (qh[:, -w:].float() @ keys.float().transpose(1, 2)) * scale
    p = torch.softmax(s.masked_fill(~mask[:, -w:], float("-inf")), dim=-1)
    if group_max:
        p_sq = p.view(H, group, w, S + c).amax(1).sum(1)
    p = p.view(H, group * w, S + c)
    p_sum = p.sum(1)
    if not group_max:
        p_sq = (p * p).sum(1)
    return out, ((p_sum[:, :S], p_sum[:, S:]), (p_sq[:, :S], p_sq[:, S:]))
