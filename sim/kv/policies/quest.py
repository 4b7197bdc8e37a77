"""`quest` (Quest, Tang et al. 2024, "Quest: Query-Aware Sparsity for Efficient Long-Context LLM
Inference") and `tokenselect` (TokenSelect, Wu et al. 2024, token-level selection).

Selection, not eviction: the whole cache stays resident (memory is that of `none`), but each
decode step's attention reads only the `budget` most relevant tokens of every KV head. Quest
ranks pages of `page_size` tokens by an upper bound of the query's attention to them (from
per-page channel-wise key min/max) and reads the top ceil(budget / page_size) pages, the page
holding the newest token included; `tokenselect` is the same with `page_size` 1 (per-token
selection). The first `dense_layers` layers read everything, as in Quest. The saving is attention
bandwidth: `read_tokens` tells the KV manager (and so the cost model's KV bytes read) how many
tokens each row reads this step; `select` gives which ones, for a backend that has the bound.

Parameters: `budget` (tokens read per head, default 512), `page_size` (default 16; tokenselect: 1),
`dense_layers` (default 2); quest's `score_interval` (k, default 1: the page scores are recomputed
every k decode steps, the selection reused in between); tokenselect's Selection Cache:
`cache_threshold` (cosine similarity of a head's consecutive decode queries above which the previous
selection is reused, default 0.9, documentation of what `reuse_rate` was measured at) and
`reuse_rate` (share of decode steps that reuse the cached selection, default 0: no cache; measured on
SmolLM2-135M by `kvsim.gpu.attention_profile.selection_reuse`, docs/kv-policies.md section 4);
tokenselect's `prefill_chunk` (c, default 512: the selection chunk of the paper's code, see
sim/kv/policies/selection_work.py): prefill selects once per chunk of c queries (`prefill_cost`).

What a selective layer reads per decode, in full-token equivalents (one token = its K and V): the
selected pages, plus the selection's own input. Quest reads each page's channel-wise key min and max
(two key vectors = one token-equivalent) for every page of the sequence: ceil(n / page_size), on one
step in k; TokenSelect scores every key: n / 2, on the (1 - reuse_rate) share of steps whose query
is not similar enough to the cached one. (Only where selection is active: n > the pages read.) The
amortized figure is charged every step (expected cost; the simulator has no queries to compare).
TokenSelect's soft vote and top-k over the n scores (`decode_op_bytes`) and its prefill selection
(`prefill_cost`) are priced in sim/kv/policies/selection_work.py.
"""
from __future__ import annotations

import numpy as np

from ..policy import EvictionPolicy, FastModeProfile, SelectionStepCost, check_positive_int, register_policy
from . import selection_work


@register_policy("quest")
class Quest(EvictionPolicy):
    needs_scores = False
    evicts = False
    default_trigger = "never"

    def __init__(self, budget: int = 512, page_size: int = 16, dense_layers: int = 2, score_interval: int = 1):
        self.budget = check_positive_int("budget", budget)
        self.page_size = check_positive_int("page_size", page_size)
        self.dense_layers = check_positive_int("dense_layers", dense_layers, minimum=0)
        self.score_interval = check_positive_int("score_interval", score_interval)
        self._meta_share = 1.0 / self.score_interval      # share of decode steps that score


    def _pages(self) -> int:
        return -(-self.budget // self.page_size)

    def read_tokens(self, state, ctx) -> np.ndarray:
        """[rows]: token-equivalents each row's attention reads this step: whole pages (never more than
        live) plus, where the selection is active (more live tokens than the pages read), its metadata."""
        live = state.live_counts()
        sparse = self._sparse_read(live)
        if ctx.layout == "per_head":
            return np.where(ctx.row_layer < self.dense_layers, live, sparse)
        return self._shared_read(live, sparse, ctx)

    def _sparse_read(self, live: np.ndarray) -> np.ndarray:
        meta = -(-live // self.page_size) if self.page_size > 1 else live / 2
        meta = np.where(live > self._pages() * self.page_size, meta, 0)
        if self._meta_share != 1.0:
            meta = meta * self._meta_share
        return np.minimum(live, self._pages() * self.page_size) + meta

    def _shared_read(self, live, sparse, ctx):
        dense = min(self.dense_layers, ctx.num_layers)            # shared layout: mean over layers
        return (live * dense + sparse * (ctx.num_layers - dense) + ctx.num_layers // 2) // ctx.num_layers

    def mean_read(self, live: np.ndarray, ctx) -> np.ndarray:
        """Fast mode (every row holds the same `live` tokens, [requests]): the mean over rows of
        `read_tokens`, as token-level mode charges it."""
        live = np.asarray(live, dtype=np.int64)
        sparse = self._sparse_read(live)
        if ctx.layout == "per_head":
            dense = float(np.mean(ctx.row_layer < self.dense_layers))
            return dense * live + (1.0 - dense) * sparse
        return self._shared_read(live, sparse, ctx)

    def prefill_pairs(self, start: int, num_new: int, ctx) -> float:
        """Query-key pairs of a prefill chunk of `num_new` tokens at positions start..: full causal
        attention (Quest selects in decode only)."""
        return num_new * (start + (num_new + 1) / 2)

    def _dense_share(self, ctx) -> float:
        """Share of rows that attend in full (the first `dense_layers` layers)."""
        if ctx.layout == "per_head":
            return float(np.mean(ctx.row_layer < self.dense_layers))
        return min(self.dense_layers, ctx.num_layers) / ctx.num_layers

    def fast_mode_profile(self) -> FastModeProfile:
        # selection evicts nothing: pages fill as without a policy; fast mode charges mean_read
        return FastModeProfile()

    def select(self, state, ctx, bound: np.ndarray) -> np.ndarray:
        """bool [rows, S]: the live slots read this step, given a per-slot upper bound of the query's
        attention `bound` [rows, S] (a page's bound is its largest slot's). Pages are position ranges
        [k * page_size, (k + 1) * page_size); the newest token's page is always read."""
        dense = ctx.row_layer < self.dense_layers if ctx.layout == "per_head" else np.zeros(state.rows, bool)
        return self._select(state.live, state.pos, state.num_tokens, bound, dense)

    def select_layer(self, state, ctx, layer: int, bound: np.ndarray) -> np.ndarray:
        """bool [kv_heads, S]: the live slots each KV head of `layer` reads this decode step, given the
        bound [kv_heads, S] of that layer's heads (a backend selects layer by layer, as each layer's query
        exists only once the previous layer ran). per_head: the layer's rows; shared: the one row, per
        head. The first `dense_layers` layers read every live slot, in both layouts."""
        H = bound.shape[0]
        rows = layer * H + np.arange(H) if ctx.layout == "per_head" else np.zeros(H, dtype=np.int64)
        live, pos = state.live[rows], state.pos[rows]
        if layer < self.dense_layers:
            return live.copy()
        return self._select(live, pos, state.num_tokens, bound, np.zeros(H, dtype=bool))

    def _select(self, live, pos, num_tokens: int, bound: np.ndarray, dense: np.ndarray) -> np.ndarray:
        rows, S = live.shape
        page = np.where(live, pos // self.page_size, -1)
        num_pages = max(1, -(-num_tokens // self.page_size))
        page_bound = np.full((rows, num_pages), -np.inf, dtype=np.float64)
        r = np.broadcast_to(np.arange(rows)[:, None], page.shape)
        np.maximum.at(page_bound, (r[live], page[live]), bound[live])
        page_bound[:, num_pages - 1] = np.inf                       # the current page
        keep = min(self._pages(), num_pages)
        top = np.argsort(-page_bound, axis=1, kind="stable")[:, :keep]
        chosen = np.zeros((rows, num_pages), dtype=bool)
        np.put_along_axis(chosen, top, True, axis=1)
        chosen[dense] = True
        return live & np.take_along_axis(chosen, np.maximum(page, 0), axis=1)


@register_policy("tokenselect")
class TokenSelect(Quest):
    def __init__(self, budget: int = 512, dense_layers: int = 2, cache_threshold: float = 0.9,
                 reuse_rate: float = 0.0, prefill_chunk: int = selection_work.PREFILL_CHUNK_SIZE):
        super().__init__(budget, page_size=1, dense_layers=dense_layers)
        self.cache_threshold = _fraction("cache_threshold", cache_threshold, upper_open=False)
        self.reuse_rate = _fraction("reuse_rate", reuse_rate, upper_open=True)
        self._meta_share = 1.0 - self.reuse_rate
        self.prefill_chunk = check_positive_int("prefill_chunk", prefill_chunk)

    def prefill_cost(self, start: int, num_new: int, ctx) -> SelectionStepCost:
        """A prefill chunk of `num_new` tokens at positions start..: full attention in the dense layers;
        in the others selection chunks of `prefill_chunk` queries, each scoring every key (its K read
        joins the attention reads, its soft vote and top-k are op bytes) and attending to the `budget`
        selected tokens (selection_work.prefill_selection). Mean over rows, as the step cost charges."""
        dense = self._dense_share(ctx)
        w = selection_work.prefill_selection(start, start + num_new, self.prefill_chunk, self.budget,
                                             ctx.num_query_heads)
        full = num_new * (start + (num_new + 1) / 2)
        selective_layers = (1.0 - dense) * ctx.num_layers
        return SelectionStepCost(pairs=dense * full + (1.0 - dense) * w.pairs,
                                 kv_read=dense * (start + num_new) + (1.0 - dense) * w.kv_read,
                                 op_bytes=selective_layers * w.score_bytes / ctx.kv_split,
                                 kernels=selective_layers * w.kernels)

    def decode_op_bytes(self, context: int, ctx) -> float:
        """The soft vote and top-k of a decode step's selection over `context` keys in every selective
        layer, on the (1 - reuse_rate) share of steps that select (the scoring's K read is in
        `read_tokens`)."""
        selective_layers = (1.0 - self._dense_share(ctx)) * ctx.num_layers
        per_layer = float(selection_work.decode_score_bytes(context, ctx.num_query_heads, self.budget))
        return self._meta_share * selective_layers * per_layer / ctx.kv_split

    def decode_op_kernels(self, context: int, ctx) -> float:
        """The small kernels of a decode step's selection over `context` keys in every selective layer
        (selection_work.decode_selection_kernels; the scoring ones on the steps that select)."""
        selective_layers = (1.0 - self._dense_share(ctx)) * ctx.num_layers
        return selective_layers * float(selection_work.decode_selection_kernels(context, self.budget, self._meta_share))

    def prefill_pairs(self, start: int, num_new: int, ctx) -> float:
        """The query-key pairs of `prefill_cost`."""
        return self.prefill_cost(start, num_new, ctx).pairs

    def prompt_pairs(self, prompt: int) -> float:
        """Query-key pairs of a selective layer's chunk-level prefill selection of `prompt` tokens
        (selection_work.prefill_pairs); full attention's: `selection_work.prefill_pairs(prompt, chunk, None)`."""
        return selection_work.prefill_pairs(prompt, self.prefill_chunk, self.budget)


def _fraction(name: str, value, *, upper_open: bool) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            0.0 <= value < 1.0 if upper_open else -1.0 <= value <= 1.0):
        want = "in [0, 1)" if upper_open else "in [-1, 1]"
        raise ValueError(f"{name} must be a number {want}, got {value!r}")
    return float(value)
