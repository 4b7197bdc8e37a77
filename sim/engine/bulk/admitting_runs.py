"""Decode runs that admit arrivals: a fast-forward run (sim/engine/bulk/decode_runs.py) that goes on through
the steps where arrivals are seen, wait, are admitted and compute their prompts, as long as each
step's schedule is one the run can plan exactly: the running requests decode, beside at most one
prompt computed in chunks; the arrivals a schedule sees join WAITING (FCFS; with priority
scheduling, one at a time) and its head is admitted while the token budget and the sequence slots
allow, whole or (the last one) cut to a chunk, its whole prompt fitting the free pool. Such a step
is a mixed step, priced as the engine prices any step. Quiet stretches between arrivals are priced
in bulk.

Without it every arrival ends a run and takes steps of its own through the scheduler. Here a run
spans thousands of steps. Everything stepping does still happens, in the same order: the arrivals
join WAITING through `Scheduler.add_request` and the admissions go through the scheduler's own
admission (`Scheduler.admit_waiting`, checked to admit what was planned) between the run's
bulk allocations, so block identities, the prefix cache, request state and the step log come out
bit-identical to stepping (tests/test_admitting_runs.py, and the decode fast-forward's property test).

What stepping would judge otherwise ends the run right before that step: a request the scheduler
would reject, a prompt with shared prefix ids (its prefix-cache hits), a head of WAITING short of
blocks, a chunk the pool cannot give, a step without decodes, two prompts part-way at once.
Only for one engine fed by the trace's arrivals (no router choice, no client in the loop) and a KV
manager whose pool is a function of token counts.
"""
from __future__ import annotations

from bisect import bisect_left
from collections import deque
from itertools import accumulate
from typing import Protocol

import numpy as np

from ...core.request import Request
from ...core.scheduler import Scheduler
from ...core.step import BatchShape
from .decode_runs import (ALLOC_SHIFT, Admitted, DecodeRun, PrefillColumns, ReplicaView, RunEvents, add_request_events,
                           empty_events)


class ArrivalFeed(Protocol):
    """The requests not yet handed to the engine, in arrival order (sim.engine.loop.ArrivalProcess)."""

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
        self.predicted: list[float] = []    # the prices before the step noise (sim/engine/step_noise.py)
        self.noise, self.first = view.noise, view.step_index
        self.count: list[int] = []          # decoding sequences in step j
        self.computed: list[int] = []       # their start counts, summed (context before step j: + j each)
        self.blocks: list[int] = []         # blocks they hold after step j's allocations
        self.mixed: dict[int, list] = {}    # step -> its prefill chunks (`mix`)

    @property
    def priced(self) -> int:
        return len(self.durations)

    def finished_before(self, j: int) -> int:
        """Requests finishing in the step before step j."""
        return self.ev.finished[j - 1] if j else self.leaving

    def seen_by(self, t: float, deferred: bool) -> int:
        """The step whose schedule first sees an arrival at `t` (async: the arrivals from before the
        previous step started), or `priced` (+ 1) if none priced does."""
        if deferred and t <= self.before:
            return 0
        return bisect_left(self.times, t) + deferred

    def price(self, steps: int, executor) -> None:
        """Price up to `steps` more decode steps (fewer at the limit)."""
        p = self.priced
        q = min(p + max(steps, 1), self.limit)
        if q <= p:
            return
        ev = self.ev
        start = (self.count[-1], self.computed[-1], self.blocks[-1]) if p else (0, 0, 0)
        # the sums so far, carried on over the steps' differences (in Python: 2x numpy's time at any length)
        counts, computed, blocks = [list(accumulate(row[p:q], initial=total))[1:]
                                    for row, total in zip((ev.d_count, ev.d_computed, ev.d_blocks), start, strict=True)]
        if 0 in counts:                     # every request has finished: the engine idles there
            q = p + counts.index(0)
            self.limit = q
            if q <= p:
                return
            del counts[q - p:], computed[q - p:], blocks[q - p:]
        kv_read = [c + j * n for j, c, n in zip(range(p + 1, q + 1), computed, counts, strict=True)]
        durations = executor.predict_decode_steps(counts, kv_read, blocks)
        self.predicted += durations
        if self.noise is not None:
            durations = [d * f for d, f in zip(durations, self.noise.factors(self.first + p, len(durations)).tolist(), strict=True)]
        self.pace = durations[-1]
        self.durations += durations
        self.times += accumulate(durations, initial=self.times[-1])
        del self.times[p + 1]               # accumulate repeats the start
        self.count += counts
        self.computed += computed
        self.blocks += blocks

    def cover(self, t: float, deferred: bool, executor) -> None:
        """Price the steps up to the one whose schedule first sees an arrival at `t` (async: one step
        later), that one included, or up to the limit."""
        while self.priced < self.limit and self.priced <= bisect_left(self.times, t) + deferred:
            if t == float("inf"):  # noqa: SIM108  (a comment per branch)
                ahead = 256
            else:                           # steps until `t`; none when the steps priced reach it
                ahead = max((t - self.times[-1]) / self.pace, 0)
            self.price(int(min(ahead, 4096)) + 2 + deferred, executor)

    def truncate(self, steps: int) -> None:
        for column in (self.durations, self.predicted, self.count, self.computed, self.blocks):
            del column[steps:]
        del self.times[steps + 1:]
        self.limit = self.horizon           # an empty batch found past `steps` is priced again

    def counts_at(self, j: int) -> tuple[int, int, int]:
        """Step j's decoding sequences, their start counts summed and the blocks they hold after its
        allocations (j = the steps priced)."""
        ev = self.ev
        count, computed, blocks = (self.count[-1], self.computed[-1], self.blocks[-1]) if j else (0, 0, 0)
        return count + ev.d_count[j], computed + ev.d_computed[j], blocks + ev.d_blocks[j]

    def append_step(self, counts: tuple[int, int, int], prefills: list, executor) -> None:
        """Price step j = the steps priced, with its decodes (`counts_at`) and prefill chunks in
        scheduling order, (tokens, prompt tokens computed before, blocks its request holds after)
        each, as the engine prices a step (a mixed one is priced alone)."""
        j = self.priced
        count, computed, held = counts
        pairs, kv_read, blocks = 0.0, computed + (j + 1) * count, held
        for n, done, after in prefills:
            pairs += n * (done + (n + 1) / 2)
            kv_read += done + n
            blocks += after
        if prefills:
            self.mixed[j] = prefills
        shape = BatchShape(num_seqs=count + len(prefills), num_prefill_tokens=sum(n for n, _, _ in prefills),
                           num_decode_tokens=count, attn_pairs_prefill=pairs, kv_tokens_read=kv_read,
                           block_table_entries=blocks)
        d = float(executor.predict_step(shape))
        self.predicted.append(d)
        if self.noise is not None:
            d = d * self.noise.factor(self.first + j)
        self.durations.append(d)
        self.times.append(self.times[-1] + d)
        self.count.append(count)
        self.computed.append(computed)
        self.blocks.append(held)


class _Pool:
    """Free blocks as the run's steps allocate and release them (conservative where a finished
    request's blocks may not all return, prefix hits shared: `_Planner.blocks_return`); `leaving`:
    blocks returning after step 0's allocations (async: the finishers of the step before the run)."""

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
    counts and last steps, as `find_decode_run` found them."""
    planner = _Planner(view, sched, kv, executor, arrivals)
    run = _Admissions(*map(list, start))
    for r, span in enumerate(zip(run.computed, [0] * len(run.requests), run.last_step, strict=True)):
        add_request_events(planner.ev, r, span, (planner.horizon, kv.block_size), planner.blocks_return)
    k = planner.end(planner.plan(run), run)
    if not run.admissions:
        return None
    return _run(planner.line, k, run, planner.ev, planner.taken_columns(k))


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


class _Planner:
    """Steps a run's schedules: quiet stretches of decodes between arrivals, priced in bulk, and the
    steps where arrivals wait, are admitted or compute their prompts, one at a time."""

    def __init__(self, view: ReplicaView, sched: Scheduler, kv, executor, arrivals: ArrivalFeed):
        self.sched, self.kv, self.executor, self.arrivals = sched, kv, executor, arrivals
        self.cfg, self.deferred = sched.config, sched.config.async_scheduling
        self.horizon = view.max_steps
        self.ev = empty_events(self.horizon)
        self.line = _Timeline(view, self.ev, len(sched.finishing))
        # (async) the finishers of the step just taken leave after step 0's allocations
        # a finished request's blocks all return to the free pool unless one is shared (a prefix hit):
        # none is, nor will be, when no block is shared now and no request has shared prefix ids
        self.blocks_return = not kv.enable_caching or (
            not kv.pool.num_shared_refs and all(r.prefix_hash_ids is None for r in sched.running))
        leaving = sum(len(kv.req_blocks.get(r, ())) for r in sched.finishing) if self.blocks_return else 0
        self.pool = _Pool(kv.pool.num_free_blocks, self.ev, self.deferred, leaving)
        self.taken = 0                      # arrivals a schedule has seen (the run takes them)
        self.seen: list[int] = []           # the step whose schedule saw each of them
        self.waiting: deque = deque()       # seen, not admitted
        self.prefilling: list | None = None     # [admission, prompt tokens done]: part-way through its prompt
        self.admitted_by: list[int] = []    # admissions in steps up to j, at j

    def plan(self, run: _Admissions) -> int:
        """Plan the run; returns its steps."""
        line = self.line
        j = None
        while True:
            if not self.waiting and self.prefilling is None:
                req = self.arrivals.upcoming(self.taken)
                t = req.arrival_time if req is not None else float("inf")
                line.cover(t, self.deferred, self.executor)
                j = line.seen_by(t, self.deferred)      # the next step with something to schedule
                if req is None or j >= line.priced:
                    return self.pool.fits_until(_end(line, t, self.deferred, self.ev.finished))
                line.truncate(j)            # from here steps are planned one at a time
            if j >= self.horizon:
                return j
            counts = line.counts_at(j)
            if counts[0] < 1:
                return j
            fit = self.pool.fits_until(j)
            if fit < j:
                return fit
            if not self._see(j) or not self._schedule(j, counts, run):
                return j
            j += 1

    def _see(self, j: int) -> bool:
        """The arrivals step j's schedule sees join WAITING; False, taking none, if one of them is
        not for a run to plan (the scheduler would reject it, or its prompt may hit the prefix cache)."""
        seen = []
        while (req := self.arrivals.upcoming(self.taken + len(seen))) is not None and \
                self.line.seen_by(req.arrival_time, self.deferred) <= j:
            if req.prompt_tokens < 1 or req.prefix_hash_ids is not None or self.sched.never_fits(req):
                return False
            seen.append(req)
        self.waiting.extend(seen)
        self.seen.extend([j] * len(seen))
        self.taken += len(seen)
        return True

    def _schedule(self, j: int, counts: tuple, run: _Admissions) -> bool:
        """Plan step j's schedule beyond its decodes (the prompt part-way, then WAITING's head while
        budget, sequence slots and the pool allow, as `Scheduler.schedule` would); False, planning
        nothing, where stepping would judge something the run does not plan."""
        sched, cfg, bs, line = self.sched, self.cfg, self.kv.block_size, self.line
        decodes, threshold = counts[0], cfg.long_prefill_token_threshold
        budget, free = cfg.max_num_batched_tokens - decodes, self.pool.free_in(j)
        # async: the finishers of the step before still hold their sequence slots at this schedule
        running = decodes + (line.finished_before(j) if self.deferred else 0) + (self.prefilling is not None)
        if len(self.waiting) > 1 and cfg.policy != "fcfs":
            return False                    # WAITING in priority order: not planned
        chunks, admitted, partial = [], [], 0
        if self.prefilling is not None:
            adm, done = self.prefilling
            n = sched.new_tokens(adm.request.prompt_tokens - done, budget, done, threshold)
            held = -(-(done + n) // bs)
            if n < 1 or free < held - -(-done // bs):
                return False
            chunks.append((n, done, held))
            budget, free = budget - n, free - (held - -(-done // bs))
            partial = done + n < adm.request.prompt_tokens
        for req in self.waiting:
            if budget < 1 or running >= cfg.max_num_seqs:
                break
            prompt = req.prompt_tokens
            if free < -(-prompt // bs):
                return False                # the head waits for blocks: the pool's judgement, not planned
            if not cfg.enable_chunked_prefill and sched.capped(prompt, threshold) > budget:
                break                       # it waits for a step with budget enough
            n = sched.new_tokens(prompt, budget, 0, threshold)
            partial += n < prompt
            if partial > 1:
                return False                # two prompts part-way at once (a chunk cap): not planned
            admitted.append((req, n, budget))
            chunks.append((n, 0, -(-n // bs)))
            running, budget, free = running + 1, budget - n, free - -(-n // bs)
        self._commit(j, run, (counts, chunks), admitted)
        return True

    def _commit(self, j: int, run: _Admissions, step: tuple, admitted: list) -> None:
        line, ev, bs = self.line, self.ev, self.kv.block_size
        counts, chunks = step
        for _n, done, held in chunks:
            ev.new_blocks[j] += held - -(-done // bs)
        line.append_step(counts, chunks, self.executor)
        if self.prefilling is not None:
            adm, done = self.prefilling
            n = chunks[0][0]
            adm.chunks.append((j, n))
            self.prefilling = None
            if done + n < adm.request.prompt_tokens:
                self.prefilling = [adm, done + n]
            else:
                _decode_after(self.sched, self.kv, (run, line, self.blocks_return), adm.index, j)
        for req, n, budget in admitted:
            self.waiting.popleft()
            adm = Admitted(j, req, budget, [(j, n)], len(run.requests))
            run.add(adm)
            if n < req.prompt_tokens:
                self.prefilling = [adm, n]
            else:
                _decode_after(self.sched, self.kv, (run, line, self.blocks_return), adm.index, j)
        self.admitted_by.extend([j] * len(admitted))

    def end(self, k: int, run: _Admissions) -> int:
        """The run's steps, from the `k` planned: fewer where the pool or the next arrival not taken
        says so (async: it must not arrive in a step with finishes right before the run's last one,
        sim/engine/bulk/decode_runs.py `_step_times`); the admissions past them are dropped."""
        while True:
            nxt = self.arrivals.upcoming(bisect_left(self.seen, k))
            end = k if nxt is None else min(k, _end(self.line, nxt.arrival_time, self.deferred, self.ev.finished))
            end = self.pool.fits_until(end)
            if end == k:
                break
            k = end
        while run.admissions and run.admissions[-1].step >= k:
            adm = run.admissions.pop()
            for column in (run.requests, run.computed, run.last_step, run.first_token):
                del column[adm.index:]
        return k

    def taken_columns(self, k: int) -> tuple[list, list[int]]:
        """The arrivals the run's k steps take, (step whose schedule saw it, request) each, and the
        requests in WAITING after each step (without async scheduling an arrival waits there from
        the step it arrives in, the one before the schedule that sees it)."""
        taken = bisect_left(self.seen, k)
        arrived = [0] * (k + 1)
        for j in self.seen[:taken]:
            arrived[j - (not self.deferred)] += 1
        admitted = [0] * (k + 1)
        for j in self.admitted_by:
            if j < k:
                admitted[j] += 1
        waiting = list(accumulate(a - b for a, b in zip(arrived[:k], admitted[:k], strict=True)))
        return [(j, self.arrivals.upcoming(i)) for i, j in enumerate(self.seen[:taken])], waiting


def _decode_after(sched: Scheduler, kv, state: tuple, r: int, j: int) -> None:
    """Request r computed its prompt in step j: it decodes from the next step on."""
    run, line, blocks_return = state
    run.decode_from(r, j, sched.capped_output(run.requests[r]))
    add_request_events(line.ev, r, (run.computed[r], j + 1, run.last_step[r]), (line.horizon, kv.block_size),
                       blocks_return)


def _end(line: _Timeline, t: float, deferred: bool, finished: list) -> int:
    """Steps the run takes before the next arrival's schedule (sim/engine/bulk/decode_runs.py `_step_times`)."""
    limit = min(line.limit, line.priced)
    m = bisect_left(line.times, t, 0, limit)
    if deferred and m < limit and (not m or not finished[m - 1]):     # m = 0: in the inbox, seen by step 1
        m += 1
    return m


def _run(line: _Timeline, k: int, run: _Admissions, ev: RunEvents, taken: tuple) -> DecodeRun:
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
    allocs = allocs[:bisect_left(allocs, k << ALLOC_SHIFT)]
    return DecodeRun(run.requests, run.computed, run.last_step, k, allocs, ev.new_blocks[:k], ev.freed_blocks[:k],
                     batch, kv_read, blocks, ev.finished[:k], ev.finished_computed[:k], ev.finished_blocks[:k],
                     np.array(line.durations[:k]), line.times[:k], line.times[1:k + 1],
                     token_start=run.first_token, admissions=run.admissions,
                     prefill=PrefillColumns(seqs, tokens, pairs), arrivals=taken[0], waiting=taken[1],
                     predicted=None if line.noise is None else np.array(line.predicted[:k]))
