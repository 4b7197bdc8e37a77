"""Decode runs that admit arrivals: a fast-forward run (sim/fast_forward.py) that goes on through
the steps admitting new requests, as long as each admission is one stepping would make without
judgement: the request arrives alone at its step, is accepted, fits the step's token budget whole
(no chunk cap cuts it) and the free pool, beside requests that all decode. Its step is then a
mixed step (their decodes and its prefill), priced as the engine prices a step, and the request
decodes from the next step on.

Without it every arrival ends a run and takes a step of its own through the scheduler; a run per
arrival gap costs about as much as the steps it spans (a run covers ~20 steps of ~10 requests on
the Azure traces). Here a run spans many arrivals. Everything stepping does still happens, in the
same order: the admissions go through the scheduler's own admission (`Scheduler.admit_arrival`)
between the run's bulk allocations, so block identities, the prefix cache, request state and the
step log come out bit-identical to stepping (tested with the decode fast-forward's property test).

Only for one engine fed by the trace's arrivals (no router choice, no client in the loop), a KV
manager whose pool is a function of token counts, requests without shared prefix ids (with
prefix caching, a prompt's hits would have to be planned) and no request waiting.
"""
from __future__ import annotations

from bisect import bisect_left
from itertools import accumulate
from typing import Protocol

import numpy as np

from .core.request import Request
from .core.scheduler import Scheduler
from .core.step import BatchShape
from .fast_forward import (Admitted, DecodeRun, PrefillColumns, ReplicaView, RunEvents, add_request_events,
                           empty_events)


class ArrivalFeed(Protocol):
    """The requests not yet handed to the engine, in arrival order (sim.engine.ArrivalProcess)."""

    def upcoming(self, i: int) -> Request | None:
        """The i-th request still to arrive (0: the next), or None."""


class _Timeline:
    """The run's steps priced so far: clock, decode-only figures, and the admissions' mixed steps."""

    def __init__(self, view: ReplicaView, ev: RunEvents, leaving: int):
        self.ev = ev
        self.horizon = view.max_steps
        self.pace = max(view.last_step_s, 1e-9)     # the last decode step's duration: steps ahead of an arrival
        self.limit = view.max_steps         # no step at or past it (the horizon, or an empty batch)
        self.before = view.last_step_start  # start of the step before the run
        self.leaving = leaving              # (async) finishers of that step, leaving at step 0's schedule
        self.times = [view.now]             # start of step j; then the end of the last priced step
        self.durations: list[float] = []
        self.count: list[int] = []          # decoding sequences in step j
        self.computed: list[int] = []       # their start counts, summed (context before step j: + j each)
        self.blocks: list[int] = []         # blocks they hold after step j's allocations
        self.mixed: dict[int, list] = {}    # step -> its prefill chunks (`mix`)

    @property
    def priced(self) -> int:
        return len(self.durations)

    def start(self, j: int) -> float:
        """Start of step j (j = -1: the step before the run)."""
        return self.times[j] if j >= 0 else self.before

    def finished_before(self, j: int) -> int:
        """Requests finishing in the step before step j."""
        return self.ev.finished[j - 1] if j else self.leaving

    def seen_by(self, t: float, deferred: bool) -> int:
        """The step whose schedule first sees an arrival at `t` (async: the arrivals from before the
        previous step started), or `priced` (+ 1) if none priced does."""
        if deferred and t <= self.before:
            return 0
        return bisect_left(self.times, t, 0, self.priced) + deferred

    def price(self, steps: int, executor) -> None:
        """Price up to `steps` more decode steps (fewer at the limit)."""
        p = self.priced
        q = min(p + max(steps, 1), self.limit)
        if q <= p:
            return
        ev = self.ev
        rows = ev.d_count[p:q], ev.d_computed[p:q], ev.d_blocks[p:q]
        if p:                               # the sums so far, carried into the first step's differences
            for row, total in zip(rows, (self.count[-1], self.computed[-1], self.blocks[-1])):
                row[0] += total
        sums = np.array(rows, np.int64)
        np.cumsum(sums, axis=1, out=sums)
        count = sums[0]
        if not count.all():                 # every request has finished: the engine idles there
            q = p + int(np.argmin(count))
            self.limit = q
            sums = sums[:, :q - p]
            count = sums[0]
            if q <= p:
                return
        kv_read = sums[1] + np.arange(p + 1, q + 1) * count
        durations = executor.predict_decode_run(count, kv_read, sums[2]).tolist()
        self.pace = durations[-1]
        self.durations += durations
        self.times += accumulate(durations, initial=self.times[-1])
        del self.times[p + 1]               # accumulate repeats the start
        counts, computed, blocks = sums.tolist()
        self.count += counts
        self.computed += computed
        self.blocks += blocks

    def cover(self, t: float, deferred: bool, executor) -> None:
        """Price the steps up to the one whose schedule first sees an arrival at `t` (async: one step
        later), that one included, or up to the limit."""
        while self.priced < self.limit and self.priced <= bisect_left(self.times, t) + deferred:
            ahead = (t - self.times[-1]) / self.pace if self.times[-1] < t < float("inf") else 256
            self.price(int(min(ahead, 4096)) + 2 + deferred, executor)

    def truncate(self, steps: int) -> None:
        for column in (self.durations, self.count, self.computed, self.blocks):
            del column[steps:]
        del self.times[steps + 1:]
        self.limit = self.horizon           # an empty batch found past `steps` is priced again

    def cover_step(self, j: int, executor) -> None:
        """Price up to step j (decode-only), or to the limit."""
        if self.priced <= j:
            self.price(j + 3 - self.priced, executor)

    def mix(self, j: int, prefills: list, executor) -> None:
        """Step j gets prefill chunks beside its decodes, in scheduling order: (tokens, prompt tokens
        computed before, blocks its request holds after it) each."""
        self.truncate(j + 1)
        self.mixed[j] = prefills
        count = self.count[j]
        pairs, kv_read, held = 0.0, self.computed[j] + (j + 1) * count, self.blocks[j]
        for n, done, blocks in prefills:
            pairs += n * (done + (n + 1) / 2)
            kv_read += done + n
            held += blocks
        shape = BatchShape(num_seqs=count + len(prefills), num_prefill_tokens=sum(n for n, _, _ in prefills),
                           num_decode_tokens=count, attn_pairs_prefill=pairs, kv_tokens_read=kv_read,
                           block_table_entries=held)
        d = float(executor.predict_step(shape))
        self.durations[j] = d
        self.times[j + 1] = self.times[j] + d


class _Pool:
    """Free blocks as the run's steps allocate and release them (conservative with prefix caching,
    whose finished blocks are not counted back: sim/fast_forward.py `_events`); `leaving`: blocks
    returning after step 0's allocations (async: the finishers of the step before the run)."""

    def __init__(self, free: int, ev: RunEvents, deferred: bool, leaving: int = 0):
        self.free, self.ev, self.deferred, self.leaving = free, ev, deferred, leaving
        self.allocated = self.released = 0
        self.step = 0                       # steps accounted

    def fits_until(self, end: int) -> int:
        """Account steps up to `end`; the first whose allocations the pool cannot supply, or `end`."""
        ev, deferred, step = self.ev, self.deferred, self.step
        if step >= end:
            return end
        grown = sum(ev.new_blocks[step:end])
        if self.allocated + grown - self.released <= self.free:     # fits even with nothing released
            self.allocated += grown
            first = step - deferred
            if first < 0:
                self.released += self.leaving
                first = 0
            self.released += sum(ev.freed_blocks[first:end - deferred])
            self.step = end
            return end
        for j in range(step, end):
            if self.allocated + ev.new_blocks[j] - self.released > self.free:
                return j
            self.allocated += ev.new_blocks[j]
            self.released += ev.freed_blocks[j - deferred] if j >= deferred else self.leaving
            self.step = j + 1
        return end

    def free_in(self, s: int) -> int:
        """Free blocks in step s after its decode allocations (steps before s accounted)."""
        return self.free - (self.allocated + self.ev.new_blocks[s] - self.released)


def plan_admitting(view: ReplicaView, sched: Scheduler, kv, executor, arrivals: ArrivalFeed,
                   start: tuple[list, list, list]) -> DecodeRun | None:
    """The next run of a replica whose running requests all decode, or finished in the step just
    taken (async), admitting the arrivals it can. `start`: the decoding requests, their computed
    counts and last steps, as `fast_forward.plan` found them."""
    cfg, bs = sched.config, kv.block_size
    deferred = cfg.async_scheduling
    horizon = view.max_steps
    ev = empty_events(horizon)
    run = _Admissions(*map(list, start))
    for r, span in enumerate(zip(run.computed, [0] * len(run.requests), run.last_step)):
        add_request_events(ev, r, span, horizon, bs, kv.enable_caching)
    line = _Timeline(view, ev, len(sched.finishing))
    # (async) the finishers of the step just taken leave after step 0's allocations
    leaving = 0 if kv.enable_caching else sum(len(kv.req_blocks.get(r, ())) for r in sched.finishing)
    pool = _Pool(kv.pool.num_free_blocks, ev, deferred, leaving)
    i = 0
    while True:
        req = arrivals.upcoming(i)
        t = req.arrival_time if req is not None else float("inf")
        line.cover(t, deferred, executor)
        s = line.seen_by(t, deferred)       # the step whose schedule sees it
        if req is None or s >= line.priced or pool.fits_until(s) < s:
            break
        group = [req]                       # every arrival this step's schedule sees
        while (nxt := arrivals.upcoming(i + len(group))) is not None and line.seen_by(nxt.arrival_time, deferred) <= s:
            group.append(nxt)
        following = arrivals.upcoming(i + len(group))
        firsts = _first_chunks(sched, kv, (group, s), (line, pool), following)
        if firsts is None:
            break
        i += len(group)
        t = following.arrival_time if following is not None else float("inf")
        if not _prefill(sched, kv, (group, s, firsts), (line, pool, run), t, executor):
            break
    if not run.admissions:
        return None
    k = pool.fits_until(_end(line, t, deferred, ev.finished))
    assert k > run.admissions[-1].step, "a run ends after its last admission"
    return _run(line, k, run, ev)


class _Admissions:
    """The run's requests (running ones, then those it admits) and its admissions."""

    def __init__(self, requests: list, computed: list, last_step: list):
        self.requests, self.computed, self.last_step = requests, computed, last_step
        self.first_token = [0] * len(requests)
        self.admissions: list[Admitted] = []

    def add(self, adm: Admitted) -> None:
        self.admissions.append(adm)
        for column, value in ((self.requests, adm.request), (self.computed, 0), (self.last_step, 0),
                              (self.first_token, 0)):
            column.append(value)            # set once its prompt is done (by `_run` if it is not)

    def decode_from(self, r: int, j: int, output: int) -> None:
        """Request r computed its prompt in step j: it decodes from the next step on."""
        self.computed[r] = self.requests[r].prompt_tokens - j - 1      # as if decoding from step 0: c + i before step i
        self.last_step[r], self.first_token[r] = j + output, j


def _first_chunks(sched: Scheduler, kv, arriving: tuple, state: tuple, following: Request | None) -> list | None:
    """The prompt tokens stepping would admit each of `group` with in step s (`arriving` = (group, s)),
    in order, beside that step's decodes; None unless it would admit them all so, only the last one
    possibly cut to a chunk, with the next arrival coming for a later step."""
    (group, s), (line, pool) = arriving, state
    cfg, deferred, bs = sched.config, sched.config.async_scheduling, kv.block_size
    decodes = line.count[s]
    # async: the finishers of the step before still hold their sequence slots at this schedule
    running = decodes + (line.finished_before(s) if deferred else 0)
    budget, free, threshold = cfg.max_num_batched_tokens - decodes, pool.free_in(s), cfg.long_prefill_token_threshold
    firsts = []
    for req in group:
        prompt = req.prompt_tokens
        if (decodes < 1 or running >= cfg.max_num_seqs or budget < 1 or prompt < 1 or req.prefix_hash_ids is not None
                or sched.never_fits(req) or free < -(-prompt // bs)
                or (not cfg.enable_chunked_prefill and sched._capped(prompt, threshold) > budget)):
            return None
        n = sched._chunk(prompt, budget, 0, threshold)
        if n < prompt and req is not group[-1]:
            return None                     # the budget is spent: the next one would wait
        firsts.append(n)
        running += 1
        budget -= n
        free -= -(-n // bs)
    if following is not None and not (following.arrival_time > line.start(s - deferred) and not (
            deferred and following.arrival_time <= line.times[s] and line.finished_before(s))):
        return None                         # (async) the run could not end right after this step
    return firsts


def _prefill(sched: Scheduler, kv, arriving: tuple, state: tuple, following: float, executor) -> bool:
    """Admit `group` in step s with their first chunks (`arriving` = (group, s, first chunks)), then
    plan the last one's further chunks, one a step beside the decodes, until its prompt is computed
    (each request decodes from the step after its prompt) or something stepping would judge comes
    first: an arrival, a short pool, a step without decodes. Then the run ends there (returns False)
    with that request part-way through its prompt."""
    (group, s, firsts), (line, pool, run) = arriving, state
    cfg, bs, deferred, ev = sched.config, kv.block_size, sched.config.async_scheduling, line.ev
    budget, chunks = cfg.max_num_batched_tokens - line.count[s], []
    for req, n in zip(group, firsts):
        run.add(Admitted(s, req, budget, [(s, n)], len(run.requests)))
        budget -= n
        blocks = -(-n // bs)
        ev.new_blocks[s] += blocks
        chunks.append((n, 0, blocks))
    line.mix(s, chunks, executor)
    last, (j, done) = run.admissions[-1], (s, firsts[-1])
    for adm in run.admissions[-len(group):-1]:
        _decode_after(sched, kv, (run, line), adm.index, s)
    req, prompt = last.request, last.request.prompt_tokens
    while done < prompt:
        j += 1
        line.cover_step(j, executor)
        if (j >= line.priced or pool.fits_until(j) < j or line.count[j] < 1
                or following <= line.times[j - deferred]
                or (deferred and following <= line.times[j] and ev.finished[j - 1])):
            line.limit = min(line.limit, j)
            return False
        n = sched._chunk(prompt - done, cfg.max_num_batched_tokens - line.count[j], done,
                         cfg.long_prefill_token_threshold)
        blocks = -(-(done + n) // bs)
        if n < 1 or pool.free_in(j) < blocks - -(-done // bs):
            line.limit = min(line.limit, j)
            return False
        ev.new_blocks[j] += blocks - -(-done // bs)
        line.mix(j, [(n, done, blocks)], executor)
        last.chunks.append((j, n))
        done += n
    _decode_after(sched, kv, (run, line), last.index, j)
    return True


def _decode_after(sched: Scheduler, kv, state: tuple, r: int, j: int) -> None:
    """Request r computed its prompt in step j: it decodes from the next step on."""
    run, line = state
    run.decode_from(r, j, sched.capped_output(run.requests[r]))
    add_request_events(line.ev, r, (run.computed[r], j + 1, run.last_step[r]), line.horizon, kv.block_size,
                       kv.enable_caching)


def _end(line: _Timeline, t: float, deferred: bool, finished: list) -> int:
    """Steps the run takes before the next arrival's schedule (sim/fast_forward.py `_step_times`)."""
    limit = min(line.limit, line.priced)
    m = bisect_left(line.times, t, 0, limit)
    if deferred and m < limit and (not m or not finished[m - 1]):     # m = 0: in the inbox, seen by step 1
        m += 1
    return m


def _run(line: _Timeline, k: int, run: _Admissions, ev: RunEvents) -> DecodeRun:
    count = np.array(line.count[:k], np.int64)
    kv_read = np.array(line.computed[:k], np.int64) + np.arange(1, k + 1) * count
    blocks = np.array(line.blocks[:k], np.int64)
    seqs, tokens, pairs = [0] * k, [0] * k, [0.0] * k
    for j, prefills in line.mixed.items():
        if j < k:
            seqs[j] = len(prefills)
            for n, done, held in prefills:
                tokens[j] += n
                pairs[j] += n * (done + (n + 1) / 2)
                kv_read[j] += done + n
                blocks[j] += held
    for adm in run.admissions:          # part-way through its prompt when the run ends: no token yet
        done = sum(n for j, n in adm.chunks if j < k)
        if done < adm.request.prompt_tokens:
            r = adm.index
            run.computed[r], run.last_step[r], run.first_token[r] = done - k, k + 1, k
    batch = count + np.array(seqs, np.int64)
    allocs = sorted(ev.allocs)
    allocs = allocs[:bisect_left(allocs, (k,))]
    return DecodeRun(run.requests, run.computed, run.last_step, k, allocs, ev.new_blocks[:k], ev.freed_blocks[:k],
                     batch, kv_read, blocks, ev.finished[:k], ev.finished_computed[:k], ev.finished_blocks[:k],
                     np.array(line.durations[:k]), line.times[:k], line.times[1:k + 1],
                     token_start=run.first_token, admissions=run.admissions,
                     prefill=PrefillColumns(seqs, tokens, pairs))
