"""Decode fast-forward: advance a stretch of pure-decode steps in bulk, exactly as stepping would.

Between events nothing in a decode-only batch needs the scheduler's judgement: each running
request computes one token per step, grows a block every `block_size` tokens, and leaves when its
output is complete. `plan` finds how many steps can be taken that way (stopping at the step in
progress when the next request arrives, before an allocation that could fail, at a finish that
would let a waiting request in, or at a horizon) and computes their shapes with numpy; `apply`
then performs the run's allocations and finishes through the KV manager in the order stepping
would, so block identities, request state and the step log come out bit-identical (tested).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

F64 = np.float64


@dataclass
class DecodeRun:
    reqs: list            # running requests at the start, in scheduling order
    c: np.ndarray         # computed tokens at the start [B]
    last: np.ndarray      # step (1-based) in which each request produces its last token [B]
    k: int                # steps in the run
    tokens: np.ndarray    # tokens resident after step i [B, k]
    held: np.ndarray      # blocks held after step i (while active) [B, k]
    new: np.ndarray       # blocks allocated in step i [B, k]
    freed: np.ndarray     # blocks freed by requests finishing in step i [k] (no prefix caching)
    batch: np.ndarray     # sequences per step [k]
    kv_read: np.ndarray   # KV tokens read per step [k]
    entries: np.ndarray   # block-table entries per step [k]
    durations: np.ndarray
    starts: np.ndarray
    ends: np.ndarray


def plan(replica) -> DecodeRun | None:
    sched = replica.scheduler
    running = sched.running
    cfg = sched.config
    b = len(running)
    if not b or b > cfg.max_num_batched_tokens:
        return None
    admission_blocked = len(sched.waiting) > 0
    next_arrival = replica.next_arrival()
    if next_arrival <= replica.now:
        return None
    c_list, last_list = [], []
    for r in running:
        n_out = r.num_output_tokens
        if n_out == 0 or r.num_computed_tokens != r.prompt_tokens + n_out - 1:
            return None
        c_list.append(r.num_computed_tokens)
        last_list.append(r.max_output_tokens - n_out)
    kv = replica.kv
    bs = kv.block_size
    if admission_blocked and b < cfg.max_num_seqs:
        # Only while the head of WAITING cannot get its blocks even before this run's allocations.
        first_step_blocks = sum(1 for x in c_list if x % bs == 0)
        if not sched.waiting_head_blocked(cfg.max_num_batched_tokens - b, kv.num_free_blocks - first_step_blocks):
            return None
    c = np.array(c_list, dtype=np.int64)
    last = np.array(last_list, dtype=np.int64)
    k = min(last_list) if admission_blocked else max(last_list)
    # Horizon: about twice the steps until the next arrival at the last step's pace (a shorter
    # run is still exact: stepping resumes where it stops).
    gap = (next_arrival - replica.now) / max(replica._last_duration, 1e-9)
    k = min(k, replica.max_run_steps, int(min(gap, 1e9)) * 2 + 16)
    steps = np.arange(1, k + 1, dtype=np.int64)
    active = steps <= last[:, None]
    tokens = c[:, None] + steps
    held = (tokens + (bs - 1)) // bs
    new = (held - (tokens + (bs - 2)) // bs) * active
    ending = np.flatnonzero(last <= k)
    if kv.enable_caching or not ending.size:   # shared prefix blocks may not return: count none
        freed = np.zeros(k, dtype=np.int64)
    else:
        at = last[ending] - 1
        freed = np.bincount(at, weights=held[ending, at], minlength=k).astype(np.int64)
    need = np.cumsum(new.sum(axis=0))
    need[1:] -= np.cumsum(freed)[:-1]
    fits = need <= kv.num_free_blocks
    if not fits.all():
        k = int(np.argmin(fits))
        if k < 1:
            return None
    act = active[:, :k]
    batch = act.sum(axis=0)
    kv_read = (tokens[:, :k] * act).sum(axis=0)
    entries = (held[:, :k] * act).sum(axis=0)
    durations = replica.executor.predict_decode_run(batch.astype(F64), kv_read.astype(F64), entries.astype(F64))
    clock = np.add.accumulate(np.concatenate(([replica.now], durations)))
    # Steps that start before the next arrival are scheduled exactly as stepping would schedule them.
    k = min(k, int(np.searchsorted(clock[:-1], next_arrival, side="left")))
    if k < 1:
        return None
    return DecodeRun(list(running), c, last, k, tokens[:, :k], held[:, :k], new[:, :k], freed[:k],
                     batch[:k], kv_read[:k], entries[:k], durations[:k], clock[:k], clock[1:k + 1])


def apply(replica, run: DecodeRun) -> dict:
    """Allocate, finish and advance requests as the run's steps would (all but the last step's
    finishes, which happen when the clock reaches its end); returns the run's pool columns."""
    kv = replica.kv
    if kv.enable_caching:
        used, cached = _replay_events(replica, run)
    else:
        used = _bulk_allocate(replica, run)
        cached = np.zeros(run.k, dtype=np.int64)
    k, last = run.k, run.last
    end_times = run.ends.tolist()
    for r, req in enumerate(run.reqs):
        n = min(int(last[r]), k)
        req.num_computed_tokens = int(run.c[r]) + n
        req.num_output_tokens += n
        req.token_times.extend(end_times[:n])
    alive = np.arange(1, k + 1) < last[:, None]      # still holding blocks after step i
    bs = kv.block_size
    allocated = used * bs
    live = allocated - ((run.held * bs - run.tokens) * alive).sum(axis=0)
    return {"blocks_used": used, "blocks_free": kv.num_blocks - used, "blocks_cached": cached,
            "live_slots": live, "allocated_slots": allocated,
            "fragmentation": np.where(allocated > 0, 1.0 - live / np.maximum(allocated, 1), 0.0),
            "num_running": alive.sum(axis=0),
            "finished": np.bincount(np.minimum(last, k + 1) - 1, minlength=k + 1)[:k]}


def _bulk_allocate(replica, run: DecodeRun) -> np.ndarray:
    """No prefix caching: blocks are popped in bulk between finishes (freed blocks are reused)."""
    kv = replica.kv
    used0 = kv.pool.num_used_blocks
    step_idx, req_idx = np.nonzero(run.new.T)          # step-major, then scheduling order
    last = run.last.tolist()
    finish_steps = sorted({e - 1 for e in last if e < run.k})
    start = 0
    reqs = run.reqs
    for s in finish_steps:
        stop = int(np.searchsorted(step_idx, s, side="right"))
        kv.append_one_block_each([reqs[r] for r in req_idx[start:stop].tolist()])
        start = stop
        replica.scheduler.finish([req for req, e in zip(reqs, last) if e - 1 == s], float(run.ends[s]))
    kv.append_one_block_each([reqs[r] for r in req_idx[start:].tolist()])
    return used0 + np.cumsum(run.new.sum(axis=0)) - np.cumsum(run.freed)


def _replay_events(replica, run: DecodeRun) -> tuple[np.ndarray, np.ndarray]:
    """Prefix caching: replay each allocation / block fill / finish through the manager in order."""
    kv, pool, k = replica.kv, replica.kv.pool, run.k
    bs = kv.block_size
    events = run.new.astype(bool) | ((run.tokens % bs == 0) & (np.arange(1, k + 1) <= run.last[:, None]))
    step_idx, req_idx = np.nonzero(events.T)
    finishing = sorted((e - 1, r) for r, e in enumerate(run.last.tolist()) if e < k)
    used = np.empty(k, dtype=np.int64)
    cached = np.empty(k, dtype=np.int64)
    done = f = 0

    def record(upto: int) -> None:
        nonlocal done, f
        for i in range(done, upto):
            while f < len(finishing) and finishing[f][0] == i:     # finishes end their step
                replica.scheduler.finish([run.reqs[finishing[f][1]]], float(run.ends[i]))
                f += 1
            used[i] = pool.num_used_blocks
            cached[i] = pool.num_cached_free_blocks
        done = upto

    for i, r in zip(step_idx.tolist(), req_idx.tolist()):
        record(i)
        req = run.reqs[r]
        req.num_computed_tokens = int(run.c[r]) + i
        if not kv.allocate_slots(req, 1):
            raise AssertionError("fast-forward planned an allocation that failed")
    record(k)
    return used, cached
