"""The simulator's executors: a step takes as long as the cost model predicts.

`CostModelExecutor` prices the plain vLLM path (and runs of decode steps, for the fast-forward);
`KVPolicyExecutor` also charges the effects of the eviction-aware manager's policies (which the
engine runs after the step's attention, `KVManager.finish_step`): the bytes copied/moved by the slot
strategy, the per-head block-table entries, and the KV reads the policies leave (evicted tokens are not read, quantized precision groups read
fewer bytes — `kv_tokens_read` is in fp16 token-equivalents — and selection policies read only
what they select). A selection policy's `prefill_pairs` hook also sets the step's prefill
query-key pairs (Quest's prefill is full attention over the prompt positions); one with a
`prefill_cost` (TokenSelect) prices its selection kernels itself: each prefill chunk's pairs and
reads, and the op bytes of every selection's soft vote and top-k (`_selection_step`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..core.protocols import Executor, KVManager
from ..core.scheduler import SchedulerOutput
from ..core.step import BatchShape, StepResult, batch_shape
from ..kv.base import EvictingManagerBase
from ..kv.slots import KVStepEffects
from ..kv.build import build_evicting_manager
from ..engine.resolved_run import ResolvedRun, build_kv_manager
from ..model.cost_model import StepCounts
from ..model.spec_decode import DraftCost


SCALAR_STEPS = 48       # decode steps priced one by one in Python up to this many (numpy's fixed cost is more)
FLAT_STEPS = 96         # verification steps priced from their numbers up to this many (SpecDecodeExecutor.price_spec_run)


class CostModelExecutor:
    supports_decode_runs = True
    supports_admitting_runs = True

    def __init__(self, cost_model, kv: KVManager):
        self.cost = cost_model
        self.kv = kv
        # A profile that prices padded decode attention needs each step's widest block table, which
        # the decode fast-forward does not compute: such runs step one at a time (same results).
        self.supports_decode_runs = not cost_model.profile.padded_attn_cost
        # a run's mixed steps are priced from their counts alone: no padded prefill term either
        self.supports_admitting_runs = self.supports_decode_runs and not cost_model.profile.padded_prefill_cost

    def execute(self, out: SchedulerOutput) -> StepResult:
        shape = batch_shape(out, self.kv, self.cost.kv_bytes_per_token)
        seconds = float(self.cost.predict(shape))
        return StepResult(duration_s=seconds, predicted_s=seconds, shape=shape)

    def complete(self, result: StepResult, kv_effects: None) -> StepResult:
        return result                       # the plain manager has no per-step policies


    def predict_run(self, shape: BatchShape):
        return self.cost.predict(shape)

    def predict_step(self, shape: BatchShape) -> float:
        """Seconds for one step of this shape, as `execute` prices it."""
        return float(self.cost.predict(shape))

    def predict_decode_run(self, num_seqs, kv_tokens_read, block_table_entries):
        """Durations of a run of pure-decode steps (int64 or float64 count arrays), as `execute` would price them."""
        return self.cost.predict_decode(num_seqs, kv_tokens_read, block_table_entries)

    def predict_decode_steps(self, num_seqs: list[int], kv_tokens_read: list[int],
                             block_table_entries: list[int]) -> list[float]:
        """`predict_decode_run` of integer lists, as a list: in Python for a few steps where the cost
        model can (bit-identical), else in numpy."""
        if len(num_seqs) <= SCALAR_STEPS and (prices := self.cost.decode_prices(
                num_seqs, kv_tokens_read, block_table_entries)) is not None:
            return prices
        return self.cost.predict_decode(np.array(num_seqs, np.int64), np.array(kv_tokens_read, np.int64),
                                        np.array(block_table_entries, np.int64)).tolist()


class SpecDecodeExecutor(CostModelExecutor):
    """`CostModelExecutor` with speculative decoding: the target's step (verifications included, priced
    by `batch_shape`) plus the drafter's time (`DraftCost`: after sampling, for every request that
    sampled a token this step, as vLLM drafts for the whole batch). The plain decode runs are off (each
    step's tokens are random draws); runs of verification steps are fast-forwarded by
    sim/engine/bulk/spec_runs.py, priced here (`price_spec_run`: step by step as `execute`, or as arrays)."""
    supports_decode_runs = False
    supports_admitting_runs = False
    supports_spec_runs = True

    def __init__(self, cost_model, kv: KVManager, draft: DraftCost):
        super().__init__(cost_model, kv)
        self.supports_decode_runs = self.supports_admitting_runs = False
        self.draft = draft
        # steps priced from their numbers, without BatchShapes (operator-form profiles: `price_spec_flat`)
        self.flat = cost_model.profile.operator_form and draft.flat
        self.last_draft_s = 0.0
        self.last_verify_s = 0.0

    def execute(self, out: SchedulerOutput) -> StepResult:
        shape = batch_shape(out, self.kv, self.cost.kv_bytes_per_token)
        # requests that sample this step: their computed tokens reach their known tokens
        contexts = [s.context_before + s.num_new_tokens for s in out.scheduled
                    if s.request.num_computed_tokens + s.num_new_tokens >= s.request.num_tokens]
        draft_tokens = sum(s.num_spec_tokens for s in out.scheduled)
        if self.flat and not (shape.swap_bytes or shape.bytes_moved or shape.op_bytes or shape.op_flops
                              or shape.op_kernels):
            seconds, self.last_draft_s, self.last_verify_s = self.price_spec_flat(StepCounts(
                shape.num_seqs, shape.num_seqs if shape.num_logit_rows is None else shape.num_logit_rows,
                shape.num_prefill_tokens + shape.num_decode_tokens, shape.attn_pairs_prefill, shape.kv_tokens_read,
                shape.block_table_entries), len(contexts), sum(contexts), draft_tokens)
        else:
            seconds, self.last_draft_s, self.last_verify_s = self.price_spec_shape(
                shape, len(contexts), sum(contexts), draft_tokens)
        return StepResult(duration_s=seconds, predicted_s=seconds, shape=shape)

    def price_spec_flat(self, step: StepCounts, drafting_seqs: int, contexts: Any,
                        draft_tokens: int) -> tuple[float, float, float]:
        """`price_spec_shape` of a step without copies, swaps or KV-policy work, from its numbers (`step`:
        sequences, LM-head rows, query tokens, prefill query-key pairs, KV tokens read, block-table entries):
        bit for bit (`CostModel.flat_step_total`, `DraftCost.seconds_flat`; tests/test_spec_fast_forward.py).
        Needs `flat`."""
        target = self.cost.flat_step_total(*step)
        drafting = self.draft.seconds_flat(step.seqs, step.tokens, step.pairs, step.kv_read, step.entries,
                                           drafting_seqs, contexts)
        if draft_tokens:
            loop = self.draft.loop
            target += loop.sampler_kernels * loop.kernel_s + draft_tokens * loop.sampler_row_s
            return target + drafting, drafting, target
        return target + drafting, drafting, 0.0

    def price_spec_shape(self, shape: BatchShape, drafting_seqs: int, contexts: int,
                         draft_tokens: int) -> tuple[float, float, float]:
        """(seconds, drafting seconds, verifying seconds) of a step of `shape` whose `drafting_seqs` sampling
        requests' contexts after the step sum to `contexts`, verifying `draft_tokens` drafts."""
        target = float(self.cost.predict(shape))
        drafting = float(self.draft.seconds_of(shape, drafting_seqs, contexts))
        # the rejection sampler verifies the step's drafts on the target's side (DraftCost.loop)
        if draft_tokens:
            target += self.draft.loop.sampler_seconds(draft_tokens)
        return target + drafting, drafting, target if draft_tokens else 0.0

    def price_spec_run(self, shape: BatchShape, drafting_seqs: np.ndarray, contexts: np.ndarray,
                       draft_tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """`price_spec_shape` for each step of a run of verification steps (arrays over its steps: the
        shape's fields, the requests that draft, the sum of their contexts, the drafts verified), element
        by element in the same order: bit-identical to pricing each step (tests/test_spec_fast_forward.py)."""
        if (self.flat and len(draft_tokens) <= FLAT_STEPS and not np.any(shape.num_prefill_tokens)
                and not np.any(shape.swap_bytes)):
            # each step from its numbers: ~3 us a step, less than numpy's arrays below ~100 steps
            return _flat_prices(self, shape, drafting_seqs, contexts, draft_tokens)
        if len(draft_tokens) <= SCALAR_STEPS:
            # a short run: each step priced as stepping prices it (numpy's fixed cost per call is more)
            return _scalar_prices(self, shape, drafting_seqs, contexts, draft_tokens)
        target = self.cost.predict(shape)
        drafting = self.draft.seconds_run(shape, drafting_seqs, contexts)
        loop = self.draft.loop
        verifying = draft_tokens > 0
        target = np.where(verifying, target + (loop.sampler_kernels * loop.kernel_s + draft_tokens * loop.sampler_row_s),
                          target)
        return target + drafting, drafting, np.where(verifying, target, 0.0)


def _flat_prices(executor: SpecDecodeExecutor, shape: BatchShape, drafting_seqs: np.ndarray, contexts: np.ndarray,
                 draft_tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`price_spec_run` one step at a time from the steps' numbers (`price_spec_flat`; a run's shape has no
    prefill tokens, copies or swaps)."""
    price = executor.price_spec_flat
    cols = [shape.num_seqs, shape.num_logit_rows, shape.num_decode_tokens, shape.attn_pairs_prefill,
            shape.kv_tokens_read, shape.block_table_entries, drafting_seqs, contexts, draft_tokens]
    out = [price(StepCounts(*step[:6]), *step[6:]) for step in zip(*(np.asarray(c).tolist() for c in cols), strict=True)]
    seconds, drafting, verifying = zip(*out, strict=True)
    return np.array(seconds), np.array(drafting), np.array(verifying)


def _scalar_prices(executor: SpecDecodeExecutor, shape: BatchShape, drafting_seqs: np.ndarray, contexts: np.ndarray,
                   draft_tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`price_spec_run` one step at a time: each step's shape as `batch_shape` makes it (plain numbers)."""
    cols = [shape.num_seqs, shape.num_decode_tokens, shape.attn_pairs_prefill, shape.kv_tokens_read,
            shape.block_table_entries, shape.kv_tokens_padded, drafting_seqs, contexts, draft_tokens]
    out = []
    for b, dec, pairs, kv_read, entries, padded, m, ctx, d in zip(*(np.asarray(c).tolist() for c in cols), strict=True):
        step = BatchShape(num_seqs=b, num_prefill_tokens=0, num_decode_tokens=dec, attn_pairs_prefill=pairs,
                          kv_tokens_read=kv_read, swap_bytes=shape.swap_bytes, block_table_entries=entries,
                          kv_tokens_padded=padded, attn_pairs_prefill_padded=shape.attn_pairs_prefill_padded,
                          num_logit_rows=b + d if d else None)
        out.append(executor.price_spec_shape(step, m, ctx, d))
    seconds, drafting, verifying = zip(*out, strict=True)
    return np.array(seconds), np.array(drafting), np.array(verifying)


class KVPolicyExecutor:
    supports_decode_runs = False       # eviction changes memory every step
    supports_admitting_runs = False

    def __init__(self, cost_model, kv: EvictingManagerBase):
        self.cost = cost_model
        self.kv = kv
        self.last_effects = None
        # a policy that prices its own selection kernels (TokenSelect): prefill_cost / decode_op_bytes
        self._selection = kv.policy.prefill_cost(0, 1, kv.ctx) is not None

    def execute(self, out: SchedulerOutput) -> StepResult:
        """The step's shape (before the policies act); `complete` prices it with their effects."""
        shape = batch_shape(out, self.kv, self.cost.kv_bytes_per_token)
        if self._selection:
            _selection_step(self.kv, out, shape)
        else:
            pairs = _policy_prefill_pairs(self.kv, out)
            if pairs is not None:
                shape.attn_pairs_prefill = pairs
        return StepResult(duration_s=float("nan"), predicted_s=float("nan"), shape=shape)

    def complete(self, result: StepResult, kv_effects: KVStepEffects) -> StepResult:
        shape = result.shape
        shape.bytes_moved = kv_effects.bytes_moved
        shape.op_bytes = shape.op_bytes + kv_effects.op_bytes if self._selection else kv_effects.op_bytes
        shape.op_flops = kv_effects.op_flops
        seconds = float(self.cost.predict(shape))
        self.last_effects = kv_effects
        return StepResult(duration_s=seconds, predicted_s=seconds, evicted_tokens=kv_effects.evicted_tokens,
                          blocks_freed_by_eviction=kv_effects.blocks_freed_by_eviction,
                          bytes_moved=kv_effects.bytes_moved, shape=shape)

    def predict_run(self, shape: BatchShape):
        return self.cost.predict(shape)


def _selection_step(kv: EvictingManagerBase, out: SchedulerOutput, shape: BatchShape) -> None:
    """A selection policy's own pricing of the step (TokenSelect, sim/kv/policies/selection_work.py):
    each prefill chunk's pairs and reads from `prefill_cost` (the selected tokens and the scoring's read
    of all K, in place of the engine's count), decodes read what `kv_tokens` says (the policy's
    `read_tokens`), and the soft vote and top-k of every selection as op bytes."""
    policy, ctx = kv.policy, kv.ctx
    pairs = 0.0
    kv_read = 0.0
    op_bytes = 0.0
    kernels = 0.0
    for s in out.scheduled:
        if s.is_prefill:
            c = policy.prefill_cost(s.request.num_computed_tokens, s.num_new_tokens, ctx)
            pairs += c.pairs
            kv_read += c.kv_read
            op_bytes += c.op_bytes
            kernels += c.kernels
        else:
            context = s.request.num_computed_tokens + s.num_new_tokens
            kv_read += s.context_before + s.num_new_tokens
            op_bytes += policy.decode_op_bytes(context, ctx)
            kernels += policy.decode_op_kernels(context, ctx)
    shape.attn_pairs_prefill = pairs
    shape.kv_tokens_read = kv_read
    shape.op_bytes = op_bytes
    shape.op_kernels = kernels


def _policy_prefill_pairs(kv: EvictingManagerBase, out: SchedulerOutput) -> float | None:
    """The step's prefill query-key pairs as the policy counts them (None: the engine's count)."""
    policy, ctx = kv.policy, kv.ctx
    if policy.prefill_pairs(0, 1, ctx) is None:
        return None
    return float(sum(policy.prefill_pairs(s.request.num_computed_tokens, s.num_new_tokens, ctx)
                     for s in out.scheduled if s.is_prefill))


@dataclass
class _Batch:
    """The part of a step's schedule that rides one in-flight batch (what `batch_shape` reads of it)."""
    scheduled: list
    swap_out_tokens: int = 0
    swap_in_tokens: int = 0
    decode_contexts: list | None = None     # None: batch_shape's general path (a batch is part of a step)


class PipelineExecutor(CostModelExecutor):
    """A replica of pipeline stages (sim/model/parallel.py): each step is a round of its in-flight batches. A
    request keeps the batch it was first scheduled into (vLLM: its tokens come back with that batch, which is
    scheduled again with them); the requests a step admits fill the batches in formation order from one that
    advances at every step that admits (the next batch formed after they arrived), each up to
    max_num_batched_tokens, so a burst that fits one batch rides one batch as in vLLM and lone arrivals take
    the batches in turn. The round is priced from the batches' own shapes
    (`PipelineCostModel.round_seconds`). A decode fast-forward prices each batch of the run apart
    (`decode_run_groups`, `predict_decode_groups`: bit for bit what stepping prices); no run admits arrivals
    (where they join depends on the batch formed next)."""
    supports_admitting_runs = False

    def __init__(self, cost_model, kv: KVManager):
        super().__init__(cost_model, kv)
        self.supports_admitting_runs = False
        self.batch_of: dict = {}         # request -> its in-flight batch (0..pp-1)
        self.next_batch = 0

    def decode_run_groups(self, running: list) -> list[list[int]]:
        """The indices of `running` in each in-flight batch, batch 0 first (a request never scheduled: batch 0)."""
        groups: list[list[int]] = [[] for _ in range(self.cost.pp)]
        for i, r in enumerate(running):
            groups[self.batch_of.get(r, 0)].append(i)
        return groups

    def predict_decode_groups(self, batches: list) -> np.ndarray:
        return self.cost.round_decode_run(batches)

    def execute(self, out: SchedulerOutput) -> StepResult:
        cost, kv = self.cost, self.kv
        shape = batch_shape(out, kv, cost.kv_bytes_per_token)
        pp, room = cost.pp, cost.batch_tokens
        parts: list[list] = [[] for _ in range(pp)]
        tokens = [0] * pp
        admitted = []
        batch_of = self.batch_of
        for s in out.scheduled:
            b = batch_of.get(s.request)
            if b is None:
                admitted.append(s)
            else:
                parts[b].append(s)
                tokens[b] += s.num_new_tokens
        first = self.next_batch
        if admitted:                 # each admitting step starts from the next batch (decode runs admit none)
            self.next_batch = (first + 1) % pp
        for s in admitted:
            n = s.num_new_tokens
            b = next((c % pp for c in range(first, first + pp) if tokens[c % pp] + n <= room),
                     min(range(pp), key=tokens.__getitem__))
            batch_of[s.request] = b
            parts[b].append(s)
            tokens[b] += n
        if len(batch_of) > 4 * len(out.scheduled) + 4096:       # forget finished requests now and then
            self.batch_of = {r: b for r, b in batch_of.items() if not r.is_finished}
        shapes = [batch_shape(_Batch(p), kv, cost.kv_bytes_per_token) for p in parts]
        shapes[0].swap_bytes = shape.swap_bytes
        seconds = float(cost.round_seconds(shapes))
        return StepResult(duration_s=seconds, predicted_s=seconds, shape=shape)

    def predict_step(self, shape: BatchShape) -> float:
        return float(self.cost.predict(shape))


EXECUTORS = {"cost_model": CostModelExecutor, "kv_policy": KVPolicyExecutor, "pipeline": PipelineExecutor}


def replica_parts(plan: ResolvedRun, index: int) -> tuple[KVManager, Executor]:
    """The KV manager and executor of replica `index` of a simulation."""
    kv = build_kv_manager(plan, index)
    if plan.spec is not None:              # speculative decoding: the plain manager (sim/config.py refuses policies)
        kv.use_eagle = plan.spec.method in ("eagle", "eagle3", "mtp")      # vLLM's SpeculativeConfig.use_eagle()
        return kv, SpecDecodeExecutor(plan.cost, kv, plan.spec.draft)
    # the simulator's executor of the kind the resolved run chose for its KV manager
    return kv, EXECUTORS[plan.executor_kind](plan.cost, kv)


def build_kv(kv, model, cost, num_blocks: int, block_size: int, seed: int) -> tuple[EvictingManagerBase, KVPolicyExecutor]:
    """The eviction-aware manager of a `KVConfig` and its executor (see `build_evicting_manager`)."""
    manager = build_evicting_manager(kv, model, cost, num_blocks, block_size, seed)
    return manager, KVPolicyExecutor(cost, manager)
