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

    def __init__(self, now: float, ev: RunEvents, limit: int, pace: float):
        self.ev = ev
        self.horizon = limit
        self.pace = pace                    # the last decode step's duration: steps ahead of an arrival
        self.limit = limit                  # no step at or past it (the horizon, or an empty batch)
        self.times = [now]                  # start of step j; then the end of the last priced step
        self.durations: list[float] = []
        self.count: list[int] = []          # decoding sequences in step j
        self.computed: list[int] = []       # their start counts, summed (context before step j: + j each)
        self.blocks: list[int] = []         # blocks they hold after step j's allocations
        self.mixed: dict[int, tuple[int, int]] = {}   # admission step -> (prompt tokens, prompt blocks)

    @property
    def priced(self) -> int:
        return len(self.durations)

    def price(self, steps: int, executor) -> None:
        """Price up to `steps` more decode steps (fewer at the limit)."""
        p = self.priced
        q = min(p + max(steps, 1), self.limit)
        if q <= p:
            return
        ev = self.ev
        sums = np.array((ev.d_count[p:q], ev.d_computed[p:q], ev.d_blocks[p:q]), np.int64)
        np.cumsum(sums, axis=1, out=sums)
        if p:
            sums += np.array((self.count[-1], self.computed[-1], self.blocks[-1]), np.int64)[:, None]
        count = sums[0]
        empty = np.flatnonzero(count == 0)
        if empty.size:                      # every request has finished: the engine idles there
            q = p + int(empty[0])
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
        self.count += sums[0].tolist()
        self.computed += sums[1].tolist()
        self.blocks += sums[2].tolist()

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

    def admit(self, s: int, prompt: int, blocks: int, executor) -> None:
        """Step s becomes a mixed step with a `prompt`-token prefill holding `blocks` blocks."""
        self.truncate(s + 1)
        self.mixed[s] = (prompt, blocks)
        count = self.count[s]
        shape = BatchShape(num_seqs=count + 1, num_prefill_tokens=prompt, num_decode_tokens=count,
                           attn_pairs_prefill=0.0 + prompt * (0 + (prompt + 1) / 2),
                           kv_tokens_read=self.computed[s] + (s + 1) * count + prompt,
                           block_table_entries=self.blocks[s] + blocks)
        d = float(executor.predict_step(shape))
        self.durations[s] = d
        self.times[s + 1] = self.times[s] + d


class _Pool:
    """Free blocks as the run's steps allocate and release them (conservative with prefix caching,
    whose finished blocks are not counted back: sim/fast_forward.py `_events`)."""

    def __init__(self, free: int, ev: RunEvents, deferred: bool):
        self.free, self.ev, self.deferred = free, ev, deferred
        self.allocated = self.released = 0
        self.step = 0                       # steps accounted

    def fits_until(self, end: int) -> int:
        """Account steps up to `end`; the first whose allocations the pool cannot supply, or `end`."""
        ev, deferred = self.ev, self.deferred
        for j in range(self.step, end):
            if self.allocated + ev.new_blocks[j] - self.released > self.free:
                return j
            self.allocated += ev.new_blocks[j]
            if j >= deferred:
                self.released += ev.freed_blocks[j - deferred]
            self.step = j + 1
        return end

    def free_in(self, s: int) -> int:
        """Free blocks in step s after its decode allocations (steps before s accounted)."""
        return self.free - (self.allocated + self.ev.new_blocks[s] - self.released)


def plan_admitting(view: ReplicaView, sched: Scheduler, kv, executor, arrivals: ArrivalFeed,
                   start: tuple[list, list]) -> DecodeRun | None:
    """The next run of a replica whose running requests all decode (`start`: their computed counts
    and last steps, as `fast_forward.plan` found them), admitting the arrivals it can."""
    cfg, bs = sched.config, kv.block_size
    deferred = cfg.async_scheduling
    horizon = view.max_steps
    ev = empty_events(horizon)
    reqs, computed, last_step = list(sched.running), list(start[0]), list(start[1])
    for r, span in enumerate(zip(computed, [0] * len(reqs), last_step)):
        add_request_events(ev, r, span, horizon, bs, kv.enable_caching)
    line = _Timeline(view.now, ev, horizon, max(view.last_step_s, 1e-9))
    pool = _Pool(kv.pool.num_free_blocks, ev, deferred)
    first_token = [0] * len(reqs)
    admissions: list[Admitted] = []
    i = 0
    while True:
        req = arrivals.upcoming(i)
        t = req.arrival_time if req is not None else float("inf")
        line.cover(t, deferred, executor)
        s = bisect_left(line.times, t, 0, line.priced) + deferred       # the step whose schedule sees it
        if req is None or s >= line.priced or pool.fits_until(s) < s:
            break
        prompt, output = req.prompt_tokens, sched.capped_output(req)
        blocks = -(-prompt // bs)
        if not _admissible(sched, kv, req, (s, prompt, blocks), line, pool, arrivals.upcoming(i + 1)):
            break
        line.admit(s, prompt, blocks, executor)
        r = len(reqs)
        reqs.append(req)
        computed.append(prompt - s - 1)         # as if it had decoded from step 0: c + j before step j
        last_step.append(s + output)
        first_token.append(s)
        ev.new_blocks[s] += blocks
        add_request_events(ev, r, (prompt - s - 1, s + 1, s + output), horizon, bs, kv.enable_caching)
        admissions.append(Admitted(s, req, line.count[s]))
        i += 1
    if not admissions:
        return None
    k = pool.fits_until(_end(line, t, deferred, ev.finished))
    assert k > admissions[-1].step, "a run ends after its last admission"
    return _run(line, k, (reqs, computed, last_step, first_token), admissions, ev)


def _admissible(sched: Scheduler, kv, req: Request, step: tuple[int, int, int], line: _Timeline,
                pool: _Pool, following: Request | None) -> bool:
    """Whether stepping would admit `req` whole in step s (`step`: s, its prompt tokens and blocks),
    beside that step's decodes, with nothing else arriving for that step."""
    s, prompt, blocks = step
    cfg, deferred = sched.config, sched.config.async_scheduling
    decodes = line.count[s]
    # async: the finishers of the step before still hold their sequence slots at this schedule
    running = decodes + (line.ev.finished[s - 1] if deferred else 0)
    threshold = cfg.long_prefill_token_threshold
    if (decodes < 1 or running >= cfg.max_num_seqs or not 0 < prompt <= cfg.max_num_batched_tokens - decodes
            or (threshold > 0 and prompt > threshold) or req.prefix_hash_ids is not None
            or sched.never_fits(req) or pool.free_in(s) < blocks):
        return False
    if following is None:
        return True
    # the next arrival must come later than this step's schedule, and (async) the run must be able
    # to end after this step should it stop at that arrival (`_end`)
    seen_by_s = line.times[s - deferred]
    return following.arrival_time > seen_by_s and not (
        deferred and following.arrival_time <= line.times[s] and line.ev.finished[s - 1])


def _end(line: _Timeline, t: float, deferred: bool, finished: list) -> int:
    """Steps the run takes before the next arrival's schedule (sim/fast_forward.py `_step_times`)."""
    m = bisect_left(line.times, t, 0, line.priced)
    if deferred and m < line.priced and m and not finished[m - 1]:
        m += 1
    return m


def _run(line: _Timeline, k: int, requests: tuple, admissions: list, ev: RunEvents) -> DecodeRun:
    reqs, computed, last_step, first_token = requests
    count = np.array(line.count[:k], np.int64)
    kv_read = np.array(line.computed[:k], np.int64) + np.arange(1, k + 1) * count
    blocks = np.array(line.blocks[:k], np.int64)
    seqs, tokens, pairs = [0] * k, [0] * k, [0.0] * k
    for s, (prompt, held) in line.mixed.items():
        seqs[s], tokens[s] = 1, prompt
        pairs[s] = 0.0 + prompt * (0 + (prompt + 1) / 2)
        kv_read[s] += prompt
        blocks[s] += held
    batch = count + np.array(seqs, np.int64)
    allocs = sorted(ev.allocs)
    allocs = allocs[:bisect_left(allocs, (k,))]
    return DecodeRun(reqs, computed, last_step, k, allocs, ev.new_blocks[:k], ev.freed_blocks[:k], batch, kv_read,
                     blocks, ev.finished[:k], ev.finished_computed[:k], ev.finished_blocks[:k],
                     np.array(line.durations[:k]), line.times[:k], line.times[1:k + 1],
                     token_start=first_token, admissions=admissions, prefill=PrefillColumns(seqs, tokens, pairs))
