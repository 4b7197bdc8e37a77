"""Fast mode by row sampling alone: the token-level manager on a stratified sample of the rows.

For policies whose state the count slab cannot express (LeanKV: three precision tiers with pages of
different capacities, placement and demotion by a significance that is not monotone in time), fast
mode runs the token-level manager (sim/kv/manager.py, every slot strategy, tier moves and page
accounting exactly as in token mode) on `sample_rows` of the layer x KV-head rows only, each standing
for `unit` = rows / sample_rows of them. The rows are a stratified sample of the importance model's
heads for the run's seed (by head type, then local decay, as the count slab samples them); their
attention comes from the same importance model restricted to those heads. Pool pages, block-table
entries, slot counts and the step's evictions, freed pages, moved bytes and policy work are the
sampled rows' times `unit`; per-row reads (kv_tokens) are the sampled rows' mean. What differs from
token level: only the sample's head mix (and the content draws, which are per sampled row).
"""
from __future__ import annotations

import dataclasses

import numpy as np

from ...base import EvictingManagerBase, FastOptions, sample_row_count
from ...importance import SyntheticImportance
from ...manager import EvictingKVManager, EvictingOptions
from ...policy import EvictionPolicy, PolicyContext

SCALED_PLAN_FIELDS = ("evicted_tokens", "blocks_freed_by_eviction", "bytes_moved", "op_bytes", "op_flops")


def stratified_rows(model: SyntheticImportance, count: int) -> np.ndarray:
    """`count` row indices, one from the middle of each equal stratum of the rows ordered by head
    type, then local decay."""
    unit = len(model.tau) // count
    order = np.lexsort((model.tau, model.head_type))
    return np.sort(order[unit // 2::unit][:count])


def restrict_importance(model: SyntheticImportance, rows: np.ndarray, ctx: PolicyContext) -> SyntheticImportance:
    """The importance model with only the heads at `rows` (their parameters, drawn for the full model)."""
    model.ctx = ctx
    model.head_type, model.s, model.l, model.tau, model.sigma = (
        a[rows] for a in (model.head_type, model.s, model.l, model.tau, model.sigma))
    return model


class ScaledPoolView:
    """The sampled rows' pool seen as the whole pool: every count times `unit`."""
    enable_caching = False
    num_cached_free_blocks = 0
    num_cache_evictions = 0

    def __init__(self, pool, unit: int):
        self._pool, self.unit = pool, unit

    @property
    def num_blocks(self) -> int:
        return self._pool.num_blocks * self.unit

    @property
    def num_free_blocks(self) -> int:
        return self._pool.num_free_blocks * self.unit

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def check_invariants(self) -> None:
        self._pool.check_invariants()


class SampledRowsKVManager(EvictingManagerBase):
    """Token-level manager on a stratified sample of the rows, scaled to all of them (module doc)."""

    def __init__(self, num_blocks: int, block_size: int, ctx: PolicyContext, policy: EvictionPolicy,
                 options: FastOptions = FastOptions(sample_rows=8), token: EvictingOptions = EvictingOptions()):
        """`options`: the row sample (its seed, sample_rows and importance model); `token`: the
        token-level manager's options (slot strategy, trigger, tiers) for the sampled rows."""
        self.ctx, self.policy, self.block_size = ctx, policy, block_size
        self.rows = sample_row_count(ctx.rows, options.sample_rows)
        self.unit = ctx.rows // self.rows
        model = SyntheticImportance(ctx, options.importance, options.seed)
        picked = stratified_rows(model, self.rows)
        sub_ctx = dataclasses.replace(ctx, rows=self.rows, row_layer=ctx.row_layer[picked],
                                      row_head=ctx.row_head[picked])
        self.inner = EvictingKVManager(num_blocks // self.unit, block_size, sub_ctx, policy,
                                       restrict_importance(model, picked, sub_ctx), token)
        self.pool = ScaledPoolView(self.inner.pool, self.unit)

    @property
    def req_blocks(self):
        return self.inner.req_blocks

    @property
    def logical_token_steps(self):
        return self.inner.logical_token_steps

    @property
    def stored_token_steps(self):
        return self.inner.stored_token_steps

    def kv_tokens(self, req) -> float:
        return self.inner.kv_tokens(req)

    def block_table_entries(self, req) -> int:
        return self.inner.block_table_entries(req) * self.unit

    def slot_stats(self) -> tuple[int, int]:
        live, allocated = self.inner.slot_stats()
        return live * self.unit, allocated * self.unit

    def blocks_needed(self, req, num_new_tokens: int, num_computed_blocks: int = 0) -> int:
        return self.inner.blocks_needed(req, num_new_tokens, num_computed_blocks) * self.unit

    def allocate_slots(self, req, num_new_tokens: int, computed_blocks=None) -> bool:
        return self.inner.allocate_slots(req, num_new_tokens, computed_blocks)

    def free(self, req) -> int:
        return self.inner.free(req) * self.unit

    def begin_step(self) -> None:
        self.inner.begin_step()

    def reclaim(self, num_blocks: int, running) -> int:
        return self.inner.reclaim(-(-num_blocks // self.unit), running) * self.unit

    def finish_step(self, scheduled):
        plan = self.inner.finish_step(scheduled)
        for name in SCALED_PLAN_FIELDS:
            setattr(plan, name, getattr(plan, name) * self.unit)
        return plan

    def check_invariants(self, live_requests) -> None:
        self.inner.check_invariants(live_requests)
