"""Decode fast-forward: advance a stretch of pure-decode steps in bulk, exactly as stepping would.

Between events nothing in a decode-only batch needs the scheduler's judgement: each running
request computes one token per step, grows a block every `block_size` tokens, and leaves when its
output is complete. `plan` finds how many steps can be taken that way (stopping at the step in
progress when the next request arrives, before an allocation that could fail, at a finish that
would let a waiting request in, or at a horizon) and computes their shapes; `apply` then performs
the run's allocations and finishes through the KV manager in the order stepping would, so block
identities, request state and the step log come out bit-identical (tested).

Runs are short (a typical run: ~10 requests x ~20 steps, one per arrival gap), so the shapes are
built from per-request events (block allocations, finishes) and difference arrays in plain
Python, O(requests + allocations + steps), rather than (requests x steps) numpy matrices whose
per-call overhead dominates at these sizes; only the pricing is vectorized.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from typing import TYPE_CHECKING

import numpy as np

from .core.protocols import FastForwardExecutor, FastForwardKV

if TYPE_CHECKING:
    from .engine import EngineReplica

F64 = np.float64


@dataclass
class DecodeRun:
    """A run of k decode steps; per-step lists are indexed by step j = 0..k-1."""
    reqs: list            # running requests at the start, in scheduling order
    c: list               # computed tokens of each request at the start
    last: list            # step (1-based) in which each request produces its last token
    k: int
    allocs: list          # (step, request index) of each block allocation, step-major, then scheduling order
    fills: list           # with prefix caching: (step, request index) where a block becomes full
    new: list             # blocks allocated in step j
    freed: list           # blocks freed by requests finishing in step j (no prefix caching)
    batch: list           # sequences in step j
    kv_read: list         # KV tokens read in step j
    entries: list         # block-table entries in step j: blocks held by its requests after its allocations
    finished: list        # requests producing their last token in step j
    finished_c: list      # their start token counts, summed
    finished_held: list   # their blocks, summed
    durations: list
    starts: list
    ends: list


def plan(replica: EngineReplica) -> DecodeRun | None:
    """The next decode run of `replica` (whose executor and KV manager support fast-forward), or None."""
    sched = replica.scheduler
    running = sched.running
    cfg = sched.config
    b = len(running)
    if not b or b > cfg.max_num_batched_tokens:
        return None
    admission_blocked = len(sched.waiting) > 0
    next_arrival = replica.next_arrival()
    if next_arrival <= replica.now or replica.inbox or sched.finishing:
        return None
    step_gap = replica.step_arrivals.steps_until_next(replica.num_steps) if replica.step_arrivals else float("inf")
    if step_gap < 1:
        return None
    c_list, last_list = [], []
    for r in running:
        n_out = r.num_output_tokens
        if n_out == 0 or r.num_computed_tokens != r.prompt_tokens + n_out - 1:
            return None
        c_list.append(r.num_computed_tokens)
        last_list.append(r.max_output_tokens - n_out)
    kv: FastForwardKV = replica.kv
    bs = kv.block_size
    if admission_blocked and b < cfg.max_num_seqs:
        # Only while the head of WAITING cannot get its blocks even before this run's allocations.
        first_step_blocks = sum(1 for x in c_list if x % bs == 0)
        if not sched.waiting_head_blocked(cfg.max_num_batched_tokens - b, kv.num_free_blocks - first_step_blocks):
            return None
    # async scheduling: a finish releases its blocks a step later, so a run ends at the first finish;
    # so it does when a finish sends the next request of a closed-loop client (replica.on_done)
    k = min(last_list) if admission_blocked or cfg.async_scheduling or replica.on_done else max(last_list)
    # Horizon: about twice the steps until the next arrival at the last step's pace (a shorter
    # run is still exact: stepping resumes where it stops).
    gap = (next_arrival - replica.now) / max(replica._last_duration, 1e-9)
    k = min(k, replica.max_run_steps, int(min(gap, 1e9)) * 2 + 16, int(min(step_gap, 1e9)))
    ev = _events(c_list, last_list, k, bs, kv.enable_caching)
    k = _steps_that_fit(ev, k, kv.num_free_blocks)
    if admission_blocked and kv.enable_caching:
        k = _steps_keeping_head_hits(sched, kv, ev["allocs"], k)
    if k < 1:
        return None
    batch = list(accumulate(ev["d_count"][:k]))
    c_sum = list(accumulate(ev["d_c"][:k]))
    held = list(accumulate(ev["d_held"][:k]))
    kv_read = [c + (j + 1) * n for j, (c, n) in enumerate(zip(c_sum, batch))]   # tokens after step j: c + j + 1
    executor: FastForwardExecutor = replica.executor
    durations = executor.predict_decode_run(
        np.array(batch, F64), np.array(kv_read, F64), np.array(held, F64)).tolist()
    # The clock advances step by step exactly as stepping adds durations; steps that start before
    # the next arrival are scheduled exactly as stepping would schedule them.
    starts, ends = [], []
    t = replica.now
    for d in durations:
        if t >= next_arrival:
            break
        starts.append(t)
        t += d
        ends.append(t)
    k = len(starts)
    if k < 1:
        return None
    allocs = [a for a in ev["allocs"] if a[0] < k]
    fills = [f for f in ev["fills"] if f[0] < k]
    return DecodeRun(list(running), c_list, last_list, k, allocs, fills, ev["new"][:k], ev["freed"][:k],
                     batch[:k], kv_read[:k], held[:k], ev["fin"][:k], ev["fin_c"][:k],
                     ev["fin_held"][:k], durations[:k], starts, ends)


def _events(c_list: list, last_list: list, k: int, bs: int, caching: bool) -> dict:
    """Per-request block allocations and finishes over steps 0..k-1, as difference arrays."""
    d_count, d_c, d_held = [0] * (k + 1), [0] * (k + 1), [0] * (k + 1)
    new, freed, fin, fin_c, fin_held = [0] * k, [0] * k, [0] * k, [0] * k, [0] * k
    allocs, fills = [], []
    for r, (c, e) in enumerate(zip(c_list, last_list)):
        n = e if e < k else k                   # steps this request takes part in: 0..n-1
        h = -(-c // bs)                         # blocks held at the start
        d_count[0] += 1
        d_c[0] += c
        d_held[0] += h
        j = -c % bs                             # first step whose token starts a new block
        while j < n:
            allocs.append((j, r))
            new[j] += 1
            d_held[j] += 1
            h += 1
            j += bs
        d_count[n] -= 1
        d_c[n] -= c
        d_held[n] -= h
        if e <= k:
            fin[e - 1] += 1
            fin_c[e - 1] += c
            fin_held[e - 1] += h
            if not caching:     # with prefix caching shared blocks may not return: count none
                freed[e - 1] += h
        if caching:             # a block fills when its last slot is written: hash it then
            fills.extend((j, r) for j in range(-(c + 1) % bs, n, bs))
    allocs.sort()
    if caching:
        fills = sorted(set(fills) | set(allocs))
    return {"d_count": d_count, "d_c": d_c, "d_held": d_held, "new": new, "freed": freed, "fin": fin,
            "fin_c": fin_c, "fin_held": fin_held, "allocs": allocs, "fills": fills}


def _steps_keeping_head_hits(sched, kv: FastForwardKV, allocs: list, k: int) -> int:
    """Of the first k steps, those before the first allocation that would evict a free cached block
    the blocked head of WAITING hits. Such an eviction can let the head in: it recomputes that block
    within its capped chunk instead, and the block no longer counts both as free and as a hit."""
    head = sched.waiting.peek()
    if head.swapped_tokens:                  # a swapped request comes back without prefix hits
        return k
    revivable = {b for b in kv.get_computed_blocks(head) if kv.pool.ref_cnt[b] == 0}
    if revivable:
        for block, (step, _) in zip(kv.pool.next_free_blocks(len(allocs)), allocs):
            if block in revivable:
                return min(k, step)
    return k


def _steps_that_fit(ev: dict, k: int, free_blocks: int) -> int:
    """Steps before the first whose allocations the free pool could not supply."""
    allocated = released = 0
    for j, (n_new, n_freed) in enumerate(zip(ev["new"], ev["freed"])):
        allocated += n_new
        if allocated - released > free_blocks:
            return j
        released += n_freed
    return k


def apply(replica: EngineReplica, run: DecodeRun) -> dict:
    """Allocate, finish and advance requests as the run's steps would (all but the last step's
    finishes, which happen when the clock reaches its end); returns the run's pool columns."""
    kv = replica.kv
    k = run.k
    if kv.enable_caching:
        used, cached = _replay_events(replica, run)
    else:
        used = _bulk_allocate(replica, run)
        cached = [0] * k
    ends = run.ends
    for req, c, e in zip(run.reqs, run.c, run.last):
        n = e if e < k else k
        req.num_computed_tokens = c + n
        req.num_output_tokens += n
        req.token_times.extend(ends[:n])
    bs = kv.block_size
    # async scheduling: the last step's finishers (the only ones) keep their blocks until the next schedule
    deferred = replica.scheduler.config.async_scheduling
    if deferred and not kv.enable_caching:
        used[k - 1] += run.freed[k - 1]
    live, allocated, fragmentation, running = [], [], [], []
    for j in range(k):
        gone = 0 if deferred else 1
        alive = run.batch[j] - gone * run.finished[j]           # still holding blocks after step j
        tokens = run.kv_read[j] - gone * (run.finished_c[j] + (j + 1) * run.finished[j])
        slots = used[j] * bs
        empty = (run.entries[j] - gone * run.finished_held[j]) * bs - tokens
        live.append(slots - empty)
        allocated.append(slots)
        fragmentation.append(1.0 - (slots - empty) / slots if slots else 0.0)
        running.append(alive)
    return {"blocks_used": used, "blocks_free": [kv.num_blocks - u for u in used], "blocks_cached": cached,
            "live_slots": live, "allocated_slots": allocated, "fragmentation": fragmentation,
            "num_running": running, "finished": run.finished}


def _bulk_allocate(replica: EngineReplica, run: DecodeRun) -> list:
    """No prefix caching: blocks are popped in bulk between finishes (freed blocks are reused)."""
    kv, reqs, k = replica.kv, run.reqs, run.k
    used0 = kv.pool.num_used_blocks
    finishing: dict[int, list] = {}
    for req, e in zip(reqs, run.last):
        if e < k:
            finishing.setdefault(e - 1, []).append(req)
    allocs, a = run.allocs, 0
    for j in sorted(finishing):
        start = a
        while a < len(allocs) and allocs[a][0] <= j:
            a += 1
        kv.append_one_block_each([reqs[r] for _, r in allocs[start:a]])
        replica.scheduler.finish(finishing[j], run.ends[j])
    kv.append_one_block_each([reqs[r] for _, r in allocs[a:]])
    return list(accumulate((n - f for n, f in zip(run.new, run.freed)), initial=used0))[1:]


def _replay_events(replica: EngineReplica, run: DecodeRun) -> tuple[list, list]:
    """Prefix caching: replay each allocation / block fill / finish through the manager in order."""
    kv, pool, k = replica.kv, replica.kv.pool, run.k
    finishing = sorted((e - 1, r) for r, e in enumerate(run.last) if e < k)
    used, cached = [0] * k, [0] * k
    done = f = 0

    def record(upto: int) -> None:
        nonlocal done, f
        for i in range(done, upto):
            while f < len(finishing) and finishing[f][0] == i:     # finishes end their step
                replica.scheduler.finish([run.reqs[finishing[f][1]]], run.ends[i])
                f += 1
            used[i] = pool.num_used_blocks
            cached[i] = pool.num_cached_free_blocks
        done = upto

    for i, r in run.fills:
        record(i)
        req = run.reqs[r]
        req.num_computed_tokens = run.c[r] + i
        if not kv.allocate_slots(req, 1):
            raise AssertionError("fast-forward planned an allocation that failed")
    record(k)
    return used, cached
