"""Decode fast-forward with speculative decoding: a stretch of pure verification steps in bulk, exactly as
stepping would take them (docs/speculative-decoding.md, "Fast-forward").

Between events a batch of verifying requests needs none of the scheduler's judgement: each running request
schedules 1 + drafts tokens, its KV manager reserves blocks for them and the lookahead slots, the rejection
sampler accepts a prefix of the drafts from the replica's seeded generator, and the drafter proposes again.
What is random is the acceptance (and the n-gram drafter's match): `find_spec_run` draws it from the same
generator, in the same order and amounts as the steps would (`SpecDecoder.accept`, then
`SpecDecoder.proposals`), and takes the steps before the first one where anything else would happen:

- a request would produce its last token (the run stops before that step; stepping finishes it),
- the pool could not give a step's blocks (stepping preempts), a cap would trim the scheduled tokens
  (the token budget, `long_prefill_token_threshold`, `max_model_len`),
- the next arrival (or a connector's transfer, a step-unit arrival) and the run's horizon, as the
  plain fast-forward stops (`decode_runs._step_times`).

The run is then applied (`apply_spec_run`): the generator is advanced by exactly the draws the run's steps
used; the KV manager's own `allocate_spec_slots` is called at each step and request where it does
anything (a new block, or a block filled with known tokens: hashed with prefix caching), in stepping's
order, so block identities and the cache come out the same; the requests' tokens, token times, drafts and
vLLM's counters advance as `Scheduler._update_spec` advances them. Each step is priced by the executor's
pricing of the steps' shapes, built as `batch_shape` builds them (`SpecDecodeExecutor.price_spec_run`: a
short run step by step from the steps' numbers, a long one as arrays, element by element in the same
order), only as many steps as reach the next arrival. Bit-identical to stepping (tests/test_spec_fast_forward.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...core.request import RequestStatus
from ...core.scheduler import Scheduler
from ...core.step import BatchShape
from .decode_runs import ReplicaView, _before_transfer, _step_times


@dataclass
class SpecRun:
    """A run of `num_steps` verification steps of `requests` (lists over steps j, arrays [j, request])."""
    requests: list
    num_steps: int
    computed: np.ndarray        # [j, r] computed tokens before step j (j = 0..num_steps: after the last too)
    outputs: np.ndarray         # [j, r] output tokens before step j (j = 0..num_steps)
    drafts: np.ndarray          # [j, r] drafts scheduled in step j (j = 0..num_steps: the last proposal too)
    accepted: np.ndarray        # [j, r] drafts accepted in step j
    held: np.ndarray            # [j, r] blocks held after step j's allocation
    events: list                # (step, request index) where `allocate_spec_slots` does anything, in order
    draws: int                  # uniforms the run's steps draw from the replica's generator
    batch: np.ndarray           # per step: sequences, decode tokens, KV tokens read, block-table entries
    decode_tokens: np.ndarray
    kv_read: np.ndarray
    entries: np.ndarray
    attn_pairs: np.ndarray
    durations: np.ndarray
    predicted: np.ndarray
    draft_s: np.ndarray
    verify_s: np.ndarray
    starts: list
    ends: list


def find_spec_run(view: ReplicaView, sched: Scheduler, kv, executor) -> SpecRun | None:  # noqa: C901
    """The next run of verification steps of a replica with speculative decoding, or None (step)."""
    spec = sched.spec
    running = sched.running
    b = len(running)
    if (spec is None or not b or sched.waiting or sched.finishing or sched.connector is not None
            or sched.loading or sched.sending or not view.inbox_empty):
        return None
    if min(view.next_arrival, view.next_transfer) <= view.now or view.steps_to_step_arrival < 1:
        return None
    cfg = sched.config
    k, la, bs = spec.k, spec.lookahead, kv.block_size
    # every request schedules all its 1 + drafts tokens: no cap may trim them
    threshold = 0 if b <= 1 else cfg.long_prefill_token_threshold
    if b * (1 + k) > cfg.max_num_batched_tokens or sched.capped(1 + k, threshold) != 1 + k:
        return None
    for r in running:
        if (r.status != RequestStatus.RUNNING or r.num_output_tokens < 1
                or r.num_computed_tokens != r.num_tokens - 1 or r.spec_tokens not in (0, k)):
            return None
    remaining = min(r.max_output_tokens - r.num_output_tokens for r in running)
    gap = (min(view.next_arrival, view.next_transfer) - view.now) / max(view.last_step_s, 1e-9)
    horizon = min(view.max_steps, int(min(gap, 1e9)) * 2 + 16, int(min(view.steps_to_step_arrival, 1e9)),
                  remaining - 1)       # each step gives every request a token: one finishes by then
    # draws past the first finish are discarded: plan about as far as it is likely (a shorter run is still
    # exact, stepping goes on where it stops)
    expected = 1.0 + (spec.settings.mean_acceptance_length - 1.0) * spec.settings.propose_rate
    horizon = min(horizon, int(remaining / expected * 1.5) + 8)
    if horizon < 1:
        return None
    drafts, accepted, draws = _draw(spec, running, horizon)
    out0 = np.array([r.num_output_tokens for r in running], np.int64)
    prompt = np.array([r.prompt_tokens for r in running], np.int64)
    max_out = np.array([r.max_output_tokens for r in running], np.int64)
    gained = np.cumsum(1 + accepted, axis=0)
    outputs = np.vstack((out0[None, :], out0 + gained))            # [j, r], j = 0..horizon
    m = horizon
    finishing = (outputs[1:] >= max_out).any(axis=1)              # a request's last token in step j
    if finishing.any():
        m = int(finishing.argmax())
    computed = prompt + outputs - 1                                # before step j: all its tokens but the sampled one
    n = 1 + drafts[:horizon]
    over = (computed[:horizon] + n > cfg.max_model_len).any(axis=1)
    if over.any():
        m = min(m, int(over.argmax()))
    # blocks: each step reserves its tokens and the lookahead; nothing is freed within a run
    held0 = np.array([len(kv.req_blocks.get(r, ())) for r in running], np.int64)
    need = -(-(computed[:horizon] + n + la) // bs)
    held = np.maximum.accumulate(np.vstack((held0[None, :], need)), axis=0)[1:]
    new = np.diff(held, axis=0, prepend=held0[None, :])
    too_many = np.cumsum(new.sum(axis=1)) > kv.pool.num_free_blocks
    if too_many.any():
        m = min(m, int(too_many.argmax()))
    if m < 1:
        return None
    changed = new[:m] > 0
    if kv.enable_caching:
        # the blocks full of known tokens are hashed at each schedule (allocate_spec_slots)
        tokens = prompt + outputs[:m]
        full = np.minimum(tokens // bs, held[:m])
        cached0 = np.array([r.num_cached_blocks for r in running], np.int64)
        before = np.maximum.accumulate(np.vstack((cached0[None, :], full)), axis=0)[:-1]
        changed |= full > before
    steps, reqs = np.nonzero(changed)           # row-major: step by step, in scheduling order
    events = list(zip(steps.tolist(), reqs.tolist(), strict=True))
    # each step's shape, as `batch_shape` computes it (the attention pairs summed in scheduling order)
    c, nm = computed[:m], n[:m]
    verify = nm > 1
    pairs = np.where(verify, nm * (c + (nm + 1) / 2) - (c + nm), 0.0)
    attn_pairs = np.cumsum(pairs, axis=1)[:, -1] if b else np.zeros(m)
    decode_tokens, kv_read, entries = nm.sum(axis=1), (c + nm).sum(axis=1), held[:m].sum(axis=1)
    widest, num_drafts = held[:m].max(axis=1), drafts[:m].sum(axis=1)
    batch = np.full(m, b, np.int64)
    padded, rows = b * (widest * bs / kv.table_rows), np.where(num_drafts > 0, b + num_drafts, b)
    swap = 0 * executor.cost.kv_bytes_per_token

    def price(lo: int, hi: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Steps lo..hi - 1 priced, each as `batch_shape` would shape it."""
        shape = BatchShape(num_seqs=batch[lo:hi], num_prefill_tokens=0, num_decode_tokens=decode_tokens[lo:hi],
                           attn_pairs_prefill=attn_pairs[lo:hi], kv_tokens_read=kv_read[lo:hi], swap_bytes=swap,
                           block_table_entries=entries[lo:hi], kv_tokens_padded=padded[lo:hi],
                           attn_pairs_prefill_padded=0.0, num_logit_rows=rows[lo:hi])
        # every request samples each step: the drafter drafts for all of them, over contexts c + n
        return executor.price_spec_run(shape, batch[lo:hi], kv_read[lo:hi], num_drafts[lo:hi])

    # The steps past the next arrival are not taken: price about as many as reach it (paced by the last
    # step), then the rest only if the run gets that far. The steps taken are those starting before the
    # arrival (`_step_times`), which depend on the durations before them alone: the same either way.
    k = m if gap >= m else min(m, int(gap * 1.25) + 4)
    predicted, draft_s, verify_s = price(0, k)
    while True:
        durations = predicted if view.noise is None else predicted * view.noise.factors(view.step_index, k)
        starts, ends = _step_times(view.now, durations.tolist(), view.next_arrival, [0] * k, cfg.async_scheduling)
        if len(starts) < k or k == m:
            break
        rest = price(k, m)
        predicted, draft_s, verify_s = (np.concatenate((a, r)) for a, r in zip((predicted, draft_s, verify_s),
                                                                               rest, strict=True))
        k = m
    starts, ends = _before_transfer(starts, ends, view.next_transfer)
    m = len(starts)
    if m < 1:
        return None
    return SpecRun(list(running), m, computed[:m + 1], outputs[:m + 1], drafts[:m + 1], accepted[:m], held[:m],
                   [e for e in events if e[0] < m], draws[m], batch[:m], decode_tokens[:m], kv_read[:m], entries[:m],
                   attn_pairs[:m], durations[:m], predicted[:m], draft_s[:m], verify_s[:m], starts, ends)


def _draw(spec, running: list, horizon: int) -> tuple[np.ndarray, np.ndarray, list]:
    """Drafts scheduled in steps 0..horizon ([horizon + 1, b]), drafts accepted in steps 0..horizon - 1,
    and the uniforms drawn before each step j = 0..horizon, drawn as stepping draws them: per step one
    row of k per verified request (`SpecDecoder.accept`), then one per proposing request when the drafter
    proposes with a rate (`SpecDecoder.proposals`). The generator is left as it was."""
    k = spec.k
    settings = spec.settings
    rng = spec.rng
    b = len(running)
    cond = np.array([settings.conditional if r.spec_conditional is None else r.spec_conditional for r in running],
                    np.float64)
    d0 = np.array([r.spec_tokens for r in running], np.int64)
    state = rng.bit_generator.state
    try:
        if settings.propose_rate >= 1.0 and (d0 == k).all():
            # every step verifies k drafts of every request: the steps' draws are one block
            u = rng.random((horizon, b, k))
            rejected = ~(u < cond)
            first = np.where(rejected.any(axis=2), rejected.argmax(axis=2), k)
            drafts = np.full((horizon + 1, b), k, np.int64)
            return drafts, first.astype(np.int64), [j * b * k for j in range(horizon + 1)]
        drafts = np.zeros((horizon + 1, b), np.int64)
        accepted = np.zeros((horizon, b), np.int64)
        drafts[0] = d0
        draws, used = [0], 0
        for j in range(horizon):
            d = drafts[j]
            verified = np.nonzero(d)[0]
            if len(verified):
                u = rng.random((len(verified), k))
                rejected = ~(u < cond[verified])
                first = np.where(rejected.any(axis=1), rejected.argmax(axis=1), k)
                accepted[j, verified] = np.minimum(first, d[verified])
                used += len(verified) * k
            if settings.propose_rate >= 1.0:
                drafts[j + 1] = k
            else:
                drafts[j + 1] = np.where(rng.random(b) < settings.propose_rate, k, 0)
                used += b
            draws.append(used)
        return drafts, accepted, draws
    finally:
        rng.bit_generator.state = state


def apply_spec_run(sched: Scheduler, kv, run: SpecRun) -> dict:
    """Take the run's steps: the generator's draws, the KV manager's allocations and hashes in stepping's
    order, the requests' tokens and drafts, vLLM's counters. Returns the run's pool columns."""
    spec = sched.spec
    m, reqs = run.num_steps, run.requests
    if run.draws:
        spec.rng.random(run.draws)
    pool = kv.pool
    used, free, cached = [0] * m, [0] * m, [0] * m
    la = spec.lookahead
    computed, outputs, drafts = run.computed, run.outputs, run.drafts
    done = 0

    def record(upto: int) -> None:
        nonlocal done
        if upto == done:
            return
        figures = (pool.num_used_blocks, pool.num_free_blocks, pool.num_cached_free_blocks)
        for i in range(done, upto):
            used[i], free[i], cached[i] = figures
        done = upto

    for j, r in run.events:
        record(j)
        req = reqs[r]
        req.num_computed_tokens = int(computed[j, r])
        req.num_output_tokens = int(outputs[j, r])
        if not kv.allocate_spec_slots(req, 1 + int(drafts[j, r]), la):
            raise AssertionError("a speculative decode run planned slots the pool could not give")
    record(m)
    ends = run.ends
    acc = run.accepted
    for r, req in enumerate(reqs):
        req.num_computed_tokens = int(computed[m, r])
        req.num_output_tokens = int(outputs[m, r])
        times = req.token_times
        for e, a in zip(ends, acc[:, r].tolist(), strict=True):
            times.extend((e,) * (1 + a))
        req.spec_tokens = int(drafts[m, r])
        req.spec_rejected = int(drafts[m - 1, r] - acc[m - 1, r])
    verified = drafts[:m] > 0
    spec.num_drafts += int(verified.sum())
    spec.num_draft_tokens += int(drafts[:m].sum())
    spec.num_accepted_tokens += int(acc.sum())
    per_pos = spec.accepted_per_pos
    for i in range(spec.k):
        per_pos[i] += int((acc > i).sum())
    spec.step_drafts = int(verified[m - 1].sum())
    spec.step_draft_tokens = int(drafts[m - 1].sum())
    spec.step_accepted = int(acc[m - 1].sum())
    bs = kv.block_size
    used_a = np.array(used, np.int64)
    allocated = used_a * bs
    live = allocated - (run.entries * bs - computed[1:m + 1].sum(axis=1))
    fragmentation = 1.0 - np.divide(live, allocated, out=np.ones(m), where=allocated != 0)
    return {"blocks_used": used_a, "blocks_free": np.array(free, np.int64), "blocks_cached": cached,
            "live_slots": live, "allocated_slots": allocated, "fragmentation": fragmentation,
            "num_running": len(reqs),
            "num_drafts": verified.sum(axis=1), "num_draft_tokens": drafts[:m].sum(axis=1),
            "num_accepted_tokens": acc.sum(axis=1), "draft_s": run.draft_s, "verify_s": run.verify_s}
