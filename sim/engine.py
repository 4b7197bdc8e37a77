"""simpy engine: trace arrivals, a router, and replicas that loop schedule -> execute -> update.

The executor decides how long a step takes: the simulator's executor asks the cost model, the
real backend's executor runs it on tensors. Pure-decode stretches between events (an arrival, a
request finishing, a block allocation that could fail) may be advanced in bulk ("fast-forward"),
producing exactly the rows and request state that stepping one by one would.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import numpy as np
import simpy

from .core.request import Request, RequestStatus
from .core.scheduler import Scheduler, SchedulerOutput
from .core.step import BatchShape
from .metrics import StepLog


@dataclass
class StepResult:
    duration_s: float
    predicted_s: float = float("nan")
    evicted_tokens: int = 0
    blocks_freed_by_eviction: int = 0
    bytes_moved: int = 0


class Executor(Protocol):
    def execute(self, out: SchedulerOutput) -> StepResult: ...


class EngineReplica:
    def __init__(self, env: simpy.Environment, index: int, scheduler: Scheduler, executor: Executor,
                 step_log: StepLog, *, fast_forward: bool = True, check_invariants: bool = False,
                 next_arrival: Callable[[], float] = lambda: float("inf"),
                 on_step: Callable[[int], None] | None = None, max_run_steps: int = 4096):
        self.env = env
        self.index = index
        self.scheduler = scheduler
        self.kv = scheduler.kv
        self.executor = executor
        self.step_log = step_log
        self.fast_forward = fast_forward and getattr(executor, "supports_fast_forward", False) \
            and getattr(self.kv, "supports_fast_forward", False)
        self.check = check_invariants
        self.next_arrival = next_arrival
        self.on_step = on_step
        self.max_run_steps = max_run_steps
        self.now = 0.0              # authoritative clock (simpy time tracks it)
        self.num_steps = 0
        self._last_duration = 0.0
        self._wake: simpy.Event | None = None
        self.process = env.process(self.run())

    @property
    def outstanding(self) -> int:
        return len(self.scheduler.running) + len(self.scheduler.waiting)

    def submit(self, req: Request) -> None:
        req.replica = self.index
        if self.scheduler.add_request(req) and self._wake is not None and not self._wake.triggered:
            self._wake.succeed()

    def _sleep_until(self, t: float):
        return self.env.timeout(max(t - self.env.now, 0.0))

    def run(self):
        while True:
            if not self.scheduler.has_work:
                self._wake = self.env.event()
                yield self._wake
                self._wake = None
                self.now = self.env.now
                continue
            out = self.scheduler.schedule()
            if out.is_empty:
                raise RuntimeError(
                    f"replica {self.index}: nothing schedulable with {len(self.scheduler.waiting)} waiting "
                    f"and {len(self.scheduler.running)} running; the KV manager cannot make progress")
            start = self.now
            for s in out.scheduled:
                if s.request.first_scheduled_time is None:
                    s.request.first_scheduled_time = start
            result = self.executor.execute(out)
            entries = sum(self.kv.block_table_entries(s.request) for s in out.scheduled)   # before finishes free them
            self._last_duration = result.duration_s
            self.now = start + result.duration_s
            yield self._sleep_until(self.now)
            finished = self.scheduler.update(out, self.now)
            self._log_step(start, out, result, len(finished), entries)
            if self.fast_forward:
                yield from self._decode_run()

    # ----- logging ----------------------------------------------------------------------------
    def _pool_row(self) -> dict:
        live, allocated = self.kv.slot_stats()
        pool = self.kv.pool
        return {
            "blocks_used": pool.num_used_blocks, "blocks_free": pool.num_free_blocks,
            "blocks_cached": pool.num_cached_free_blocks,
            "live_slots": live, "allocated_slots": allocated,
            "fragmentation": 1.0 - live / allocated if allocated else 0.0,
            "num_running": len(self.scheduler.running), "num_waiting": len(self.scheduler.waiting),
        }

    def _log_step(self, start: float, out: SchedulerOutput, result: StepResult, finished: int,
                  block_table_entries: int = 0) -> None:
        prefill = [s for s in out.scheduled if s.is_prefill]
        prefill_tokens = sum(s.num_new_tokens for s in prefill)
        row = {
            "replica": self.index, "step": self.num_steps, "time_s": start,
            "duration_s": result.duration_s, "predicted_s": result.predicted_s,
            "batch_size": len(out.scheduled), "num_prefill_seqs": len(prefill),
            "num_decode_seqs": len(out.scheduled) - len(prefill),
            "prefill_tokens": prefill_tokens, "decode_tokens": out.num_tokens - prefill_tokens,
            "kv_tokens_read": sum(s.context_before + s.num_new_tokens for s in out.scheduled),
            "preemptions": len(out.preempted), "finished": finished,
            "evicted_tokens": result.evicted_tokens,
            "blocks_freed_by_eviction": result.blocks_freed_by_eviction,
            "bytes_moved": result.bytes_moved,
            "attn_pairs_prefill": sum(s.num_new_tokens * (s.context_before + (s.num_new_tokens + 1) / 2)
                                      for s in prefill),
            "block_table_entries": block_table_entries,
        }
        row.update(self._pool_row())
        self.step_log.append(row)
        self.num_steps += 1
        if self.check:
            self.check_invariants()
        if self.on_step:
            self.on_step(1)

    def check_invariants(self) -> None:
        live = set(self.scheduler.running) | set(self.scheduler.waiting)
        self.kv.check_invariants(live)
        for r in self.scheduler.running:
            assert 0 < r.num_computed_tokens <= r.num_tokens, f"request {r.request_id} token count broken"
            assert r.num_output_tokens <= r.max_output_tokens
        for r in self.scheduler.finished:
            assert r.num_output_tokens == r.max_output_tokens, f"request {r.request_id} lost tokens"
            assert r not in self.kv.req_blocks

    # ----- decode fast-forward ----------------------------------------------------------------
    def _decode_run(self):
        """Advance a stretch of pure-decode steps in bulk, exactly as stepping one by one would.

        The stretch ends at the step in progress when the next request arrives, before a block
        allocation that could fail, when a waiting request could be admitted (a finish while at
        max_num_seqs), or after `max_run_steps`. Requests finishing inside it leave the batch.
        """
        sched = self.scheduler
        running = sched.running
        cfg = sched.config
        if not running or len(running) > cfg.max_num_batched_tokens:
            return
        admission_blocked = len(sched.waiting) > 0
        if admission_blocked and len(running) < cfg.max_num_seqs:
            return
        for r in running:
            if r.num_output_tokens == 0 or r.num_computed_tokens != r.num_tokens - 1:
                return
        if self.next_arrival() <= self.now:
            return
        bs = self.kv.block_size
        c = np.fromiter((r.num_computed_tokens for r in running), dtype=np.int64, count=len(running))
        last = np.fromiter((r.remaining_output for r in running), dtype=np.int64, count=len(running))
        k = int(last.min() if admission_blocked else last.max())
        # Horizon: about twice the steps until the next arrival at the last step's pace (a shorter
        # run is still exact; stepping resumes where it stops).
        gap = (self.next_arrival() - self.now) / max(self._last_duration, 1e-9)
        k = min(k, self.max_run_steps, int(min(gap, 1e9)) * 2 + 16)
        steps = np.arange(1, k + 1, dtype=np.int64)
        active = steps[None, :] <= last[:, None]          # request computes a token in step i
        tokens = c[:, None] + steps[None, :]               # tokens resident after step i
        held = -(-tokens // bs)
        new = (held - (-(-(tokens - 1) // bs))) * active   # blocks allocated in step i
        alloc = new.sum(axis=0)
        freed = np.zeros(k, dtype=np.int64)
        ending = last <= k
        if not self.kv.enable_caching:   # shared prefix blocks would not return; be conservative
            np.add.at(freed, last[ending] - 1, held[ending, last[ending] - 1])
        cum_alloc = np.cumsum(alloc)
        fits = cum_alloc - np.concatenate(([0], np.cumsum(freed)[:-1])) <= self.kv.num_free_blocks
        if not fits.all():
            k = int(np.argmin(fits))
            if k < 1:
                return
        batch = active[:, :k].sum(axis=0)
        kv_read = (tokens[:, :k] * active[:, :k]).sum(axis=0)
        entries = (held[:, :k] * active[:, :k]).sum(axis=0)
        f64 = np.float64
        shape = BatchShape(num_seqs=batch.astype(f64), num_prefill_tokens=np.zeros(k),
                           num_decode_tokens=batch.astype(f64), attn_pairs_prefill=np.zeros(k),
                           kv_tokens_read=kv_read.astype(f64), bytes_moved=np.zeros(k),
                           swap_bytes=np.zeros(k), block_table_entries=entries.astype(f64))
        durations = np.asarray(self.executor.predict_run(shape), dtype=f64)
        clock = np.add.accumulate(np.concatenate(([self.now], durations)))
        # Steps that start before the next arrival are scheduled exactly as stepping would.
        k = min(k, int(np.searchsorted(clock[:-1], self.next_arrival(), side="left")))
        if k < 1:
            return
        starts, ends = clock[:k], clock[1:k + 1]
        batch_reqs = list(running)
        waiting = np.full(k, len(sched.waiting))
        rows = self._apply_decode_run(batch_reqs, c, last, k, new[:, :k], held[:, :k], tokens[:, :k], ends)
        self.now = float(ends[-1])
        yield self._sleep_until(self.now)
        self._finish([r for r, e in zip(batch_reqs, last.tolist()) if e == k], self.now)
        used = self.kv.pool.num_used_blocks
        waiting[-1] = len(sched.waiting)       # arrivals during the last step
        rows["blocks_used"][-1] = used
        rows["blocks_free"][-1] = self.kv.pool.num_free_blocks
        rows["blocks_cached"][-1] = self.kv.pool.num_cached_free_blocks
        rows["live_slots"][-1] += (used - rows["allocated_slots"][-1] // bs) * bs
        rows["allocated_slots"][-1] = used * bs
        live, allocated = rows["live_slots"][-1], rows["allocated_slots"][-1]
        rows["fragmentation"][-1] = 1.0 - live / allocated if allocated else 0.0
        rows.update({
            "replica": self.index, "step": np.arange(self.num_steps, self.num_steps + k),
            "time_s": starts, "duration_s": durations[:k], "predicted_s": durations[:k],
            "batch_size": batch[:k], "num_prefill_seqs": 0, "num_decode_seqs": batch[:k],
            "prefill_tokens": 0, "decode_tokens": batch[:k], "kv_tokens_read": kv_read[:k],
            "attn_pairs_prefill": 0.0, "block_table_entries": entries[:k],
            "preemptions": 0, "num_waiting": waiting,
        })
        self.step_log.append_columns(rows, k)
        self.num_steps += k
        if self.check:
            self.check_invariants()
        if self.on_step:
            self.on_step(k)

    def _apply_decode_run(self, reqs: list[Request], c, last, k: int, new, held, tokens, ends) -> dict:
        """Replay the run's allocations, prefix-cache fills and finishes in step order."""
        bs = self.kv.block_size
        if not self.kv.enable_caching:
            return self._apply_decode_run_uncached(reqs, c, last, k, new, held, tokens, ends)
        events = new.astype(bool)
        if self.kv.enable_caching:
            events |= (tokens % bs == 0) & (np.arange(1, k + 1)[None, :] <= last[:, None])
        req_idx, step_idx = np.nonzero(events)
        order = np.lexsort((req_idx, step_idx))
        ends_at = last.tolist()
        finishing = sorted((e - 1, r) for r, e in enumerate(ends_at) if e < k)
        pool = self.kv.pool
        used = np.empty(k, dtype=np.int64)
        cached = np.empty(k, dtype=np.int64)
        done = 0
        f = 0
        end_times = ends.tolist()

        def record(upto: int) -> None:
            nonlocal done, f
            for i in range(done, upto):
                while f < len(finishing) and finishing[f][0] == i:   # finishes end their step
                    self._finish([reqs[finishing[f][1]]], end_times[i])
                    f += 1
                used[i] = pool.num_used_blocks
                cached[i] = pool.num_cached_free_blocks
            done = upto

        for j in order.tolist():
            r, i = int(req_idx[j]), int(step_idx[j])
            record(i)
            req = reqs[r]
            req.num_computed_tokens = int(c[r] + i)
            if not self.kv.allocate_slots(req, 1):
                raise AssertionError("fast-forward planned an allocation that failed")
        record(k)
        for r, req in enumerate(reqs):
            n = min(ends_at[r], k)
            req.num_computed_tokens = int(c[r]) + n
            req.num_output_tokens += n
            req.token_times.extend(end_times[:n])
        alive = np.arange(1, k + 1)[None, :] < last[:, None]    # still holding blocks after step i
        empty = ((held * bs - tokens) * alive).sum(axis=0)
        allocated = used * bs
        live = allocated - empty
        finished_per_step = np.bincount(np.minimum(last, k + 1) - 1, minlength=k + 1)[:k]
        with np.errstate(divide="ignore", invalid="ignore"):
            frag = np.where(allocated > 0, 1.0 - live / np.maximum(allocated, 1), 0.0)
        return {"blocks_used": used, "blocks_free": pool.num_blocks - used, "blocks_cached": cached,
                "live_slots": live, "allocated_slots": allocated, "fragmentation": frag,
                "num_running": alive.sum(axis=0), "finished": finished_per_step}

    def _apply_decode_run_uncached(self, reqs, c, last, k: int, new, held, tokens, ends) -> dict:
        """Same as the event replay, but blocks are popped in bulk between finishes (no sharing)."""
        bs = self.kv.block_size
        pool = self.kv.pool
        used0 = pool.num_used_blocks
        req_idx, step_idx = np.nonzero(new)
        order = np.lexsort((req_idx, step_idx))
        req_idx, step_idx = req_idx[order], step_idx[order]
        ends_at = last.tolist()
        end_times = ends.tolist()
        finish_steps = sorted({e - 1 for e in ends_at if e < k})
        start = 0
        for s in finish_steps + [k]:
            stop = int(np.searchsorted(step_idx, s, side="right"))
            self.kv.append_one_block_each([reqs[r] for r in req_idx[start:stop].tolist()])
            start = stop
            if s < k:
                self._finish([req for req, e in zip(reqs, ends_at) if e - 1 == s], end_times[s])
        for r, req in enumerate(reqs):
            n = min(ends_at[r], k)
            req.num_computed_tokens = int(c[r]) + n
            req.num_output_tokens += n
            req.token_times.extend(end_times[:n])
        steps = np.arange(1, k + 1)
        alive = steps[None, :] < last[:, None]
        freed = np.zeros(k, dtype=np.int64)
        ending = last < k
        np.add.at(freed, last[ending] - 1, held[ending, last[ending] - 1])
        used = used0 + np.cumsum(new.sum(axis=0)) - np.cumsum(freed)
        allocated = used * bs
        live = allocated - ((held * bs - tokens) * alive).sum(axis=0)
        frag = np.where(allocated > 0, 1.0 - live / np.maximum(allocated, 1), 0.0)
        return {"blocks_used": used, "blocks_free": pool.num_blocks - used, "blocks_cached": np.zeros(k),
                "live_slots": live, "allocated_slots": allocated, "fragmentation": frag,
                "num_running": alive.sum(axis=0),
                "finished": np.bincount(np.minimum(last, k + 1) - 1, minlength=k + 1)[:k]}

    def _finish(self, reqs: list[Request], when: float) -> None:
        for req in reqs:
            self.scheduler.running.remove(req)
            self.kv.free(req)
            req.status = RequestStatus.FINISHED
            req.finish_time = when
            self.scheduler.finished.append(req)


class Router:
    """Sends each arriving request to a replica: round_robin or least_outstanding."""

    def __init__(self, replicas: list[EngineReplica], policy: str = "round_robin"):
        if policy not in ("round_robin", "least_outstanding"):
            raise ValueError(f"router must be round_robin or least_outstanding, got {policy!r}")
        self.replicas = replicas
        self.policy = policy
        self._next = 0

    def route(self, req: Request) -> EngineReplica:
        if self.policy == "round_robin":
            replica = self.replicas[self._next % len(self.replicas)]
            self._next += 1
            return replica
        return min(self.replicas, key=lambda rep: (rep.outstanding, rep.index))


class ArrivalProcess:
    """Feeds trace requests (sorted by arrival) to the router at their arrival times."""

    def __init__(self, env: simpy.Environment, requests: list[Request], router: Router):
        self.env = env
        self.requests = requests
        self.router = router
        self.index = 0
        self.process = env.process(self.run())

    def next_arrival(self) -> float:
        return self.requests[self.index].arrival_time if self.index < len(self.requests) else float("inf")

    def run(self):
        while self.index < len(self.requests):
            req = self.requests[self.index]
            if req.arrival_time > self.env.now:
                yield self.env.timeout(req.arrival_time - self.env.now)
            self.index += 1
            self.router.route(req).submit(req)
