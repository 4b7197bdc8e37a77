"""Decode fast-forward: advance a stretch of pure-decode steps in bulk, exactly as stepping would.

Between events nothing in a decode-only batch needs the scheduler's judgement: each running
request computes one token per step, grows a block every `block_size` tokens, and leaves when its
output is complete. `find_decode_run` finds how many steps can be taken that way (stopping at the step in
progress when the next request arrives, before an allocation that could fail, at a finish that
would let a waiting request in, or at a horizon) and computes their shapes; `apply_decode_run` then performs
the run's allocations and finishes through the KV manager in the order stepping would, so block
identities, request state and the step log come out bit-identical (tested).

Runs are short (a typical run: ~10 requests x ~20 steps, one per arrival gap), so the shapes are
built from per-request events (block allocations, finishes) and difference arrays in plain
Python, O(requests + allocations + steps), rather than (requests x steps) numpy matrices whose
per-call overhead dominates at these sizes; only the pricing is vectorized.
"""
from __future__ import annotations

from array import array
from bisect import bisect_left
from dataclasses import dataclass, field
from itertools import accumulate, repeat
from typing import NamedTuple

import numpy as np

from ...core.protocols import DecodeRunExecutor, DecodeRunKV
from ...core.request import RequestStatus
from ...core.scheduler import CONNECTOR_PENDING, Scheduler

F64 = np.float64


class ReplicaView(NamedTuple):
    """What a decode run's plan needs of the replica besides its scheduler, KV manager and executor
    (`EngineReplica.decode_run_view`)."""
    now: float                  # the replica's clock: the end of the step just taken
    next_arrival: float         # when the next request reaches the engine (inf: none)
    inbox_empty: bool           # no arrival waits for the next schedule (async scheduling)
    steps_to_step_arrival: float    # arrival_unit=step: engine steps before the next arrival (inf: none)
    last_step_s: float          # duration of the step just taken (the run's horizon is paced by it)
    last_step_start: float      # when it started (async: the next schedule sees the arrivals until then)
    max_steps: int              # longest run
    closed_loop: bool           # a finish sends the client's next request (the run stops at a finish)
    # when a KV connector's transfer next ends (inf: none): every step end polls for it, so the run
    # stops at the step in progress then (no async-scheduling extra step, as for arrivals)
    next_transfer: float = float("inf")
    step_index: int = 0         # the replica's next step (the first of the run)
    noise: object = None        # sim.engine.step_noise.StepNoise: the step-time factors, or None


# A block allocation is one int, step << ALLOC_SHIFT | request index: sorting ints is ~2x faster
# than sorting (step, request) tuples, and a run's allocations are sorted once per run.
ALLOC_SHIFT = 32
ALLOC_MASK = (1 << ALLOC_SHIFT) - 1


@dataclass
class DecodeRun:
    """A run of `num_steps` decode steps; per-step lists and arrays are indexed by step j = 0..num_steps-1."""
    requests: list        # running requests at the start, in scheduling order
    computed: list        # computed tokens of each request at the start
    last_step: list       # step (1-based) in which each request produces its last token
    num_steps: int
    allocs: list          # each block allocation, step << ALLOC_SHIFT | request index, sorted (step-major, then scheduling order)
    new_blocks: list      # blocks allocated in step j
    freed_blocks: list    # blocks freed by requests finishing in step j (no prefix caching)
    batch: np.ndarray     # sequences in step j (int64)
    kv_read: np.ndarray   # KV tokens read in step j (int64)
    entries: np.ndarray   # block-table entries in step j: blocks held by its requests after its allocations (int64)
    finished: list        # requests producing their last token in step j
    finished_computed: list   # their start token counts, summed
    finished_blocks: list     # their blocks, summed
    durations: np.ndarray     # float64
    starts: list
    ends: list
    # a run that admits arrivals (sim/engine/bulk/admitting_runs.py): each request's first step with a token in the
    # run (None: step 0 for every request), the admissions, and each step's prefill figures
    token_start: list | None = None
    admissions: list = field(default_factory=list)
    prefill: PrefillColumns | None = None
    arrivals: list = field(default_factory=list)    # (step whose schedule sees it, request): the run takes them
    waiting: list | None = None           # requests in WAITING after each step
    predicted: np.ndarray | None = None   # the cost model's prices when `durations` carry step noise


class Admitted(NamedTuple):
    """An arrival a run admits in step `step`, with `budget` tokens of the step left; its prompt is
    computed in `chunks`, (step, tokens) one a step from `step` on; it is the run's request `index`."""
    step: int
    request: object
    budget: int
    chunks: list
    index: int


class PrefillColumns(NamedTuple):
    """Per-step prefill figures of a run that admits arrivals (lists over its steps)."""
    seqs: list
    tokens: list
    attn_pairs: list


class RunEvents(NamedTuple):
    """Block allocations and finishes of a candidate run: difference arrays over steps 0..k (their
    prefix sums are per-step figures) and per-step counts over steps 0..k-1."""
    d_count: list         # sequences in the batch
    d_computed: list      # their start token counts
    d_blocks: list        # blocks they hold
    new_blocks: list      # blocks allocated in step j
    freed_blocks: list    # blocks freed by finishes in step j (none with prefix caching)
    finished: list        # requests finishing in step j
    finished_computed: list
    finished_blocks: list
    allocs: list          # step << ALLOC_SHIFT | request index of each allocation, sorted


def find_decode_run(view: ReplicaView, sched: Scheduler, kv: DecodeRunKV, executor: DecodeRunExecutor,  # noqa: C901
         admitting=None) -> DecodeRun | None:
    """The next decode run of a replica (whose executor and KV manager support fast-forward), or None.
    `admitting(view, sched, kv, executor, (computed, last_step))`, if given, plans a run that admits
    arrivals (sim/engine/bulk/admitting_runs.py) where one may; None from it: a run up to the next arrival."""
    running = sched.running
    cfg = sched.config
    b = len(running)
    if not b or b > cfg.max_num_batched_tokens:
        return None
    admission_blocked = len(sched.waiting) > 0
    next_arrival = view.next_arrival
    # an arrival waiting for the next schedule, or finishers releasing their slots at it (async):
    # only a run that admits arrivals goes on from there
    finishing = sched.finishing
    if min(next_arrival, view.next_transfer) <= view.now or not ((view.inbox_empty and not finishing) or admitting):
        return None
    if admission_blocked and (finishing or not view.inbox_empty):
        return None         # no run that admits arrivals while WAITING holds requests (below): none at all
    step_gap = view.steps_to_step_arrival
    if step_gap < 1:
        return None
    computed, last_step = [], []
    if finishing:
        running = [r for r in running if r.status != RequestStatus.FINISHED]
    for r in running:
        n_out = r.num_output_tokens
        if n_out == 0 or r.num_computed_tokens != r.prompt_tokens + n_out - 1:
            return None
        computed.append(r.num_computed_tokens)
        last_step.append(r.max_output_tokens - n_out)
    bs = kv.block_size
    if admission_blocked and b < cfg.max_num_seqs:
        # Only while the head of WAITING cannot get its blocks even before this run's allocations.
        first_step_blocks = sum(1 for x in computed if x % bs == 0)
        if first_step_blocks > kv.pool.num_free_blocks:
            return None         # the run's first step cannot get its blocks (`_steps_that_fit` would say 0)
        if not waiting_head_blocked(sched, kv, cfg.max_num_batched_tokens - b, kv.pool.num_free_blocks - first_step_blocks):
            return None
    # A finish may let the blocked head of WAITING in, or send a closed-loop client's next request
    # (view.closed_loop): the run ends there. Async scheduling releases a finish's blocks after the
    # next step's allocations, modelled within a run unless fills must be replayed one by one
    # (`_must_replay`).
    deferred = cfg.async_scheduling
    replay = _must_replay(kv, running)
    if admitting is not None and not (admission_blocked or view.closed_loop or replay) and step_gap == float("inf"):
        run = admitting(view, sched, kv, executor, (running, computed, last_step))
        if run is not None or not view.inbox_empty or finishing:
            return run
    if not view.inbox_empty or finishing:
        return None
    until_first = admission_blocked or view.closed_loop or (deferred and replay)
    k = min(last_step) if until_first else max(last_step)
    # Horizon: about twice the steps until the next arrival at the last step's pace (a shorter
    # run is still exact: stepping resumes where it stops).
    gap = (min(next_arrival, view.next_transfer) - view.now) / max(view.last_step_s, 1e-9)
    k = min(k, view.max_steps, int(min(gap, 1e9)) * 2 + 16, int(min(step_gap, 1e9)))
    if admission_blocked and kv.enable_caching and _first_step_evicts_head_hit(
            sched, kv, sum(1 for x in computed if x % bs == 0)):
        return None     # `_steps_keeping_head_hits` below would cut the run to 0 steps: no need to plan it
    ev = _events(computed, last_step, k, bs, kv.enable_caching)
    k = _steps_that_fit(ev, k, kv.pool.num_free_blocks, deferred)
    if admission_blocked and kv.enable_caching:
        k = _steps_keeping_head_hits(sched, kv, ev.allocs, k)
    if k < 1:
        return None
    # the per-step figures as int64 arrays (priced, then logged, without a conversion per value)
    sums = np.array((ev.d_count[:k], ev.d_computed[:k], ev.d_blocks[:k]), np.int64)
    batch, c_sum, held = np.cumsum(sums, axis=1, out=sums)
    kv_read = c_sum + np.arange(1, k + 1) * batch        # tokens after step j: c + j + 1 per request
    grouped = getattr(executor, "decode_run_groups", None)     # in-flight batches of a pipeline (sim/model/parallel.py)
    prices = (executor.predict_decode_run(batch, kv_read, held) if grouped is None
              else _grouped_prices(executor, grouped(running), (computed, last_step), (k, bs), kv.enable_caching))
    durations, predicted = _priced(view, prices)
    starts, ends = _step_times(view.now, durations.tolist(), next_arrival, ev.finished, deferred)
    starts, ends = _before_transfer(starts, ends, view.next_transfer)
    k = len(starts)
    if k < 1:
        return None
    allocs = ev.allocs[:bisect_left(ev.allocs, k << ALLOC_SHIFT)]     # sorted: those before step k
    return DecodeRun(list(running), computed, last_step, k, allocs, ev.new_blocks[:k], ev.freed_blocks[:k],
                     batch[:k], kv_read[:k], held[:k], ev.finished[:k], ev.finished_computed[:k],
                     ev.finished_blocks[:k], durations[:k], starts, ends,
                     predicted=None if predicted is None else predicted[:k])


def _grouped_prices(executor, groups: list[list[int]], spans: tuple[list, list], shape: tuple[int, int],
                    caching: bool) -> np.ndarray:
    """A run's step prices when the executor prices each of its batches apart (`groups`: the indices of
    the run's requests in each batch, in the executor's order): every batch's per-step counts as the
    run's own are made (`_events` of its requests alone), priced together by `predict_decode_groups`."""
    computed, last_step = spans
    k, bs = shape
    steps = np.arange(1, k + 1)
    parts = []
    for members in groups:
        ev = _events([computed[i] for i in members], [last_step[i] for i in members], k, bs, caching)
        sums = np.array((ev.d_count[:k], ev.d_computed[:k], ev.d_blocks[:k]), np.int64)
        batch, c_sum, held = np.cumsum(sums, axis=1, out=sums)
        parts.append((batch, c_sum + steps * batch, held))
    return executor.predict_decode_groups(parts)


def _priced(view: ReplicaView, prices: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """(durations, the model's prices or None): the run's prices times the step-time factors stepping
    applies to the same steps (sim/engine/step_noise.py), or the prices themselves without step noise."""
    if view.noise is None:
        return prices, None
    return prices * view.noise.factors(view.step_index, len(prices)), prices


def waiting_head_blocked(sched: Scheduler, kv: DecodeRunKV, budget: int, free_blocks: int) -> bool:
    """Whether the scheduler's admission would stop at the head of WAITING for lack of KV blocks (or,
    without chunked prefill, of budget) with `budget` tokens left and `free_blocks` free (the
    scheduler's own rule, `Scheduler.admission`). Changes nothing.

    While free blocks only shrink (a decode run), a blocked head stays blocked.
    """
    req = sched.waiting.peek()
    bs = kv.block_size
    swapped = req.swapped_tokens
    if sched.loading or (sched.connector is not None and any(
            r.num_computed_tokens and not r.swapped_tokens for r in sched.waiting)):
        return False            # a loaded request may go ahead of the head (`Scheduler._loaded_first`): step
    if swapped and -(-swapped // bs) > free_blocks:
        return True
    # a decode run has requests running and this one waiting: the chunk cap applies
    admission = sched.admission(req, budget, sched.config.long_prefill_token_threshold, free_blocks)
    if admission is None:
        return True
    if admission is CONNECTOR_PENDING:
        return False            # skipped: the requests behind it may be admitted
    hits, n, computed = admission[:3]
    # a request whose KV a connector loaded holds its blocks already
    held = len(kv.req_blocks.get(req, ())) if req.num_computed_tokens and not swapped else 0
    need = -(-(computed + n) // bs) - len(hits) - held
    return need > free_blocks - kv.num_revivable(hits)


def admit_planned(sched: Scheduler, budget: int, planned: list) -> None:
    """The scheduler's admission with `budget` tokens left, checked to admit exactly `planned`,
    (request, tokens) in order: a decode run that admits arrivals (sim/engine/bulk/admitting_runs.py)
    planned them."""
    got = [(s.request, s.num_new_tokens) for s in sched.admit_waiting(budget)]
    if got != planned:
        raise AssertionError(f"a decode run planned to admit {[(r.request_id, n) for r, n in planned]}; the "
                             f"scheduler admitted {[(r.request_id, n) for r, n in got]}")


def _before_transfer(starts: list, ends: list, next_transfer: float) -> tuple[list, list]:
    """The steps starting before a connector's next transfer ends: the step end after it polls it."""
    if not ends or next_transfer >= ends[-1]:
        return starts, ends
    m = bisect_left(starts, next_transfer)
    return starts[:m], ends[:m]


def steps_before(run: DecodeRun, t: float, deferred: bool) -> int:
    """How many of `run`'s steps a run planned with an arrival at `t` takes (`_step_times`' rule): those
    starting before `t`, and with async scheduling (`deferred`) one more unless the last of them finishes
    requests. A run is the same over those steps whatever its next arrival (its events, prices and
    times do not depend on it), so cutting a longer run there gives that run."""
    k = run.num_steps
    m = bisect_left(run.starts, t)
    if deferred and 0 < m < k and not run.finished[m - 1]:
        m += 1
    return m


def truncate_run(run: DecodeRun, m: int) -> DecodeRun:
    """`run`'s first `m` steps (a plain decode run: no admissions), as `find_decode_run` plans a run
    that stops there."""
    assert not run.admissions and run.waiting is None, "only a run that admits no arrivals is cut"
    return DecodeRun(run.requests, run.computed, run.last_step, m,
                     run.allocs[:bisect_left(run.allocs, m << ALLOC_SHIFT)], run.new_blocks[:m], run.freed_blocks[:m],
                     run.batch[:m], run.kv_read[:m], run.entries[:m], run.finished[:m], run.finished_computed[:m],
                     run.finished_blocks[:m], run.durations[:m], run.starts[:m], run.ends[:m],
                     predicted=None if run.predicted is None else run.predicted[:m])


def replays_fills(kv, run: DecodeRun) -> bool:
    """Whether applying `run` replays its fills one by one (`_must_replay`)."""
    return _must_replay(kv, run.requests)


def _step_times(now: float, durations: list, next_arrival: float, finished: list, deferred: bool) -> tuple[list, list]:
    """(starts, ends) of the steps the run takes. The clock advances step by step exactly as stepping
    adds durations (non-negative, so the starts are sorted); steps that start before the next arrival
    are scheduled exactly as stepping would schedule them. With async scheduling a step's schedule
    sees only the arrivals from before the previous step started, so the run may go on one step more
    (the step before the run saw none: the inbox is empty)."""
    times = list(accumulate(durations, initial=now))       # the clock before each step, then after the last
    k = len(durations)
    m = bisect_left(times, next_arrival, 0, k)              # steps starting before the arrival
    # That extra step's schedule releases the previous step's finishers, which at the arrival are
    # still running (a router counting outstanding requests sees them): none may finish there.
    if deferred and m < k and not finished[m - 1]:
        m += 1
    return times[:m], times[1:m + 1]


def _events(computed: list, last_step: list, k: int, bs: int, caching: bool) -> RunEvents:
    """Per-request block allocations and finishes over steps 0..k-1, as difference arrays (with
    prefix caching a finish's blocks are not counted back: shared ones may not return)."""
    ev = empty_events(k)
    # requests with neither a block allocation nor their finish in the k steps only join the batch at
    # step 0 and leave it after step k - 1: summed here rather than one call each
    quiet = quiet_computed = quiet_blocks = 0
    count_freed, shape = not caching, (k, bs)
    for r, (c, last) in enumerate(zip(computed, last_step, strict=True)):
        if last > k and -c % bs >= k >= 1:
            quiet += 1
            quiet_computed += c
            quiet_blocks += -(-c // bs)
        else:
            add_request_events(ev, r, (c, 0, last), shape, count_freed)
    if quiet:
        ev.d_count[0] += quiet
        ev.d_computed[0] += quiet_computed
        ev.d_blocks[0] += quiet_blocks
        ev.d_count[k] -= quiet
        ev.d_computed[k] -= quiet_computed
        ev.d_blocks[k] -= quiet_blocks
    ev.allocs.sort()
    return ev


def empty_events(k: int) -> RunEvents:
    return RunEvents([0] * (k + 1), [0] * (k + 1), [0] * (k + 1), [0] * k, [0] * k, [0] * k, [0] * k, [0] * k, [])


def add_request_events(ev: RunEvents, r: int, span: tuple[int, int, int], shape: tuple[int, int],
                       count_freed: bool) -> None:
    """The events of request index `r` joining a run of `k` steps (`shape` = (k, block size)) at step
    `start` to decode until its last token in step `last` - 1 (`span` = (c, start, last)), with
    `c + j` tokens computed before step j (a request admitted in the run has a negative `c`: its
    prompt minus the steps before it). `count_freed`: its blocks return to the pool when it finishes."""
    c, start, last = span
    k, bs = shape
    n = last if last < k else k
    h = -(-(c + start) // bs)                   # blocks held when it joins
    if start < n:
        ev.d_count[start] += 1
        ev.d_computed[start] += c
        ev.d_blocks[start] += h
        j = start + -(c + start) % bs           # first step whose token starts a new block
        new, d_held, allocs = ev.new_blocks, ev.d_blocks, ev.allocs
        while j < n:
            allocs.append(j << ALLOC_SHIFT | r)
            new[j] += 1
            d_held[j] += 1
            h += 1
            j += bs
        ev.d_count[n] -= 1
        ev.d_computed[n] -= c
        d_held[n] -= h
    if last <= k:
        j = last - 1
        ev.finished[j] += 1
        ev.finished_computed[j] += c
        ev.finished_blocks[j] += h
        if count_freed:
            ev.freed_blocks[j] += h


def _steps_keeping_head_hits(sched, kv: DecodeRunKV, allocs: list, k: int) -> int:
    """Of the first k steps, those before the first allocation that would evict a free cached block
    the blocked head of WAITING hits. Such an eviction can let the head in: it recomputes that block
    within its capped chunk instead, and the block no longer counts both as free and as a hit."""
    head = sched.waiting.peek()
    if head.swapped_tokens:                  # a swapped request comes back without prefix hits
        return k
    revivable = {b for b in kv.get_computed_blocks(head) if kv.pool.ref_cnt[b] == 0}
    if revivable:
        for block, key in zip(kv.pool.next_free_blocks(len(allocs)), allocs, strict=False):
            if block in revivable:
                return min(k, key >> ALLOC_SHIFT)
    return k


def _first_step_evicts_head_hit(sched, kv: DecodeRunKV, first_step_blocks: int) -> bool:
    """Whether a run's first step, allocating `first_step_blocks` blocks (the first ones of the free queue),
    evicts a free cached block the blocked head of WAITING hits: `_steps_keeping_head_hits` of any plan
    of the run is 0 then (its step-0 allocations are those blocks)."""
    return _steps_keeping_head_hits(sched, kv, [0] * first_step_blocks, 1) < 1


def _steps_that_fit(ev: RunEvents, k: int, free_blocks: int, deferred: bool = False) -> int:
    """Steps before the first whose allocations the free pool could not supply (`deferred`: a
    finish's blocks return after the next step's allocations)."""
    if sum(ev.new_blocks) <= free_blocks:       # every allocation fits, whatever returns (the common case)
        return k
    allocated = released = 0
    freed = ev.freed_blocks
    for j, n_new in enumerate(ev.new_blocks):
        allocated += n_new
        if allocated - released > free_blocks:
            return j
        if j >= deferred:
            released += freed[j - deferred]
    return k


def apply_decode_run(sched: Scheduler, kv: DecodeRunKV, run: DecodeRun) -> dict:
    """Allocate, finish and advance requests as the run's steps would (all but the last step's
    finishes, which happen when the clock reaches its end); returns the run's pool columns."""
    k = run.num_steps
    if _must_replay(kv, run.requests):
        assert not run.admissions, "a run that admits arrivals replays no fills"
        used, cached = _replay_events(sched, kv, run)
    else:
        used, cached = _bulk_allocate(sched, kv, run)
    ends = array("d", run.ends)             # token times go to float64 arrays: copied, not converted
    first = run.token_start or repeat(0)
    for req, c, e, t0 in zip(run.requests, run.computed, run.last_step, first, strict=False):
        n = e if e < k else k
        req.num_computed_tokens = c + n
        req.num_output_tokens += n - t0
        req.token_times.extend(ends if n == k and not t0 else ends[t0:n])
    bs = kv.block_size
    used = np.array(used, np.int64)
    allocated = used * bs
    if sched.config.async_scheduling:
        # a step's finishers keep their blocks until the next step has been scheduled
        running = run.batch.copy()
        live = allocated - (run.entries * bs - run.kv_read)
    else:
        # what is still held after step j: its finishers' sequences, tokens and blocks are gone
        fin, fin_c, fin_blocks = np.array((run.finished, run.finished_computed, run.finished_blocks), np.int64)
        running = run.batch - fin
        live = allocated - ((run.entries - fin_blocks) * bs - (run.kv_read - (fin_c + np.arange(1, k + 1) * fin)))
    # 1 - live / allocated (an exact quotient of exact int64 values, as Python's), 0 without slots
    fragmentation = 1.0 - np.divide(live, allocated, out=np.ones(k), where=allocated != 0)
    return {"blocks_used": used, "blocks_free": kv.pool.num_blocks - used, "blocks_cached": cached,
            "live_slots": live, "allocated_slots": allocated, "fragmentation": fragmentation,
            "num_running": running, "finished": run.finished}


def _must_replay(kv, reqs: list) -> bool:
    """Prefix caching with a request resumed after a preemption: it may find its own older copy of
    a block cached (the hash stays with that copy), so its fills must be replayed in stepping order."""
    return kv.enable_caching and any(r.num_preemptions for r in reqs)


def _bulk_allocate(sched: Scheduler, kv: DecodeRunKV, run: DecodeRun) -> tuple[list, list]:  # noqa: C901  one pass over the run's allocations and finishes in stepping's order; split, the order is harder to see
    """Blocks popped in bulk between the steps that release finished requests' blocks (the step
    they finish in; with async scheduling the next one, after its allocations). With prefix
    caching each decode fill's hash is its request's own and new (no request here resumed after a
    preemption), so a request's filled blocks are hashed when it finishes or the run ends. The
    free queue's unhashed part goes first, so pops evict hashed blocks only once it is empty: the
    cached-free count follows from the counts. Returns each step's (used, cached-free) blocks."""
    pool, k, reqs = kv.pool, run.num_steps, run.requests
    deferred = sched.config.async_scheduling
    releases: dict[int, list] = {}
    for r, e in enumerate(run.last_step):
        if e < k:
            releases.setdefault(e - 1 + deferred, []).append(r)
    finishing = bool(sched.finishing)       # (async) finishers of the step before the run: they leave in step 0
    admits: dict[int, list] = {}         # step -> (arrivals it sees, its prefill chunks in scheduling order)
    for j, req in run.arrivals:
        admits.setdefault(j, ([], []))[0].append(req)
    for adm in run.admissions:
        for i, (j, n) in enumerate(adm.chunks):
            if j < k:
                admits.setdefault(j, ([], []))[1].append((adm, n, not i))
    used, cached = [0] * k, [0] * k
    allocs, a, first = run.allocs, 0, 0
    req_blocks, caching = kv.req_blocks, kv.enable_caching
    for j in sorted({*releases, *admits, k - 1, *((0,) if finishing else ())}):
        unhashed, hashed, used0 = pool.num_unhashed_free_blocks, pool.num_cached_free_blocks, pool.num_used_blocks
        start, a = a, bisect_left(allocs, (j + 1) << ALLOC_SHIFT, a)      # the decode allocations of steps up to j
        for key, block in zip(allocs[start:a], pool.get_new_blocks(a - start), strict=False):
            req_blocks[reqs[key & ALLOC_MASK]].append(block)
        counted = j if j in admits else j + 1       # steps whose pool figures follow from the counts
        pops = list(accumulate(run.new_blocks[first:counted]))
        used[first:counted] = [used0 + p for p in pops]
        cached[first:counted] = [hashed if p <= unhashed else hashed - (p - unhashed) for p in pops]
        first = j + 1
        if j in admits:             # after the step's decode allocations, before its releases (async)
            _schedule_arrivals(sched, kv, admits[j], run.starts[j])
            used[j], cached[j] = pool.num_used_blocks, pool.num_cached_free_blocks
        if j == 0 and finishing:
            sched.release_finishing()
            used[j], cached[j] = pool.num_used_blocks, pool.num_cached_free_blocks
        if j in releases:
            done = [reqs[r] for r in releases[j]]
            if caching:
                for r in releases[j]:
                    kv.cache_full_blocks(reqs[r], run.computed[r] + run.last_step[r])
            sched.finish(done, run.ends[j - deferred])
            if deferred:
                sched.release_finishing()
            used[j], cached[j] = pool.num_used_blocks, pool.num_cached_free_blocks
    if caching:
        for req, c, e in zip(reqs, run.computed, run.last_step, strict=False):
            if e >= k:
                kv.cache_full_blocks(req, c + k)
    return used, cached


def _schedule_arrivals(sched: Scheduler, kv: DecodeRunKV, planned: tuple, start: float) -> None:
    """A step's schedule beyond its decodes, as planned (sim/engine/bulk/admitting_runs.py): the arrivals it sees
    join WAITING, the prompt part-way gets its next chunk (the slots the scheduler's running loop
    would allocate), then the scheduler's own admission takes what the plan says it takes."""
    arriving, chunks = planned
    for req in arriving:
        if not sched.add_request(req):
            raise AssertionError(f"a decode run took request {req.request_id}, which the scheduler rejects")
    admitted = []
    for adm, n, first in chunks:
        req = adm.request
        if first:
            admitted.append((req, n))
        elif not kv.allocate_slots(req, n):
            raise AssertionError(f"a decode run planned slots for request {req.request_id} the pool could not give")
        else:
            req.num_computed_tokens += n
    if admitted:
        admit_planned(sched, chunks[-len(admitted)][0].budget, admitted)
        for req, n in admitted:
            req.first_scheduled_time = start
            req.num_computed_tokens += n


def _fills(run: DecodeRun, bs: int) -> list:
    """(step, request index) of each allocation and each step where a block becomes full (its last
    slot written: hashed then), in stepping order."""
    fills = {(key >> ALLOC_SHIFT, key & ALLOC_MASK) for key in run.allocs}
    for r, (c, e) in enumerate(zip(run.computed, run.last_step, strict=False)):
        fills.update((j, r) for j in range(-(c + 1) % bs, min(e, run.num_steps), bs))
    return sorted(fills)


def _replay_events(sched: Scheduler, kv: DecodeRunKV, run: DecodeRun) -> tuple[list, list]:
    """Prefix caching: replay each allocation / block fill / finish through the manager in order."""
    pool, k = kv.pool, run.num_steps
    finishing = sorted((e - 1, r) for r, e in enumerate(run.last_step) if e < k)
    used, cached = [0] * k, [0] * k
    done = f = 0

    def record(upto: int) -> None:
        nonlocal done, f
        for i in range(done, upto):
            while f < len(finishing) and finishing[f][0] == i:     # finishes end their step
                sched.finish([run.requests[finishing[f][1]]], run.ends[i])
                f += 1
            used[i] = pool.num_used_blocks
            cached[i] = pool.num_cached_free_blocks
        done = upto

    for i, r in _fills(run, kv.block_size):
        record(i)
        req = run.requests[r]
        req.num_computed_tokens = run.computed[r] + i
        if not kv.allocate_slots(req, 1):
            raise AssertionError("fast-forward planned an allocation that failed")
    record(k)
    return used, cached
