"""simpy engine: trace arrivals, a router, and replicas that loop schedule -> execute -> update.

Part of the engine core: both executors are driven by it. The executor (`Executor`,
sim/core/protocols.py) decides how long a step takes: the simulator's executor asks the cost
model, the real backend's executor runs it on tensors. Pure-decode stretches between events (an
arrival, a request finishing, a block allocation that could fail) may be advanced in bulk
("fast-forward", sim/engine/bulk/decode_runs.py) when the executor and the KV manager both support it,
producing exactly the rows and request state that stepping one by one would.
"""
from __future__ import annotations

import heapq
from array import array
from bisect import bisect_left
from collections import deque
from dataclasses import dataclass
from collections.abc import Callable
from operator import attrgetter

import numpy as np
import simpy

from ..core.connector import FinishAwareConnector, step_seconds_with_transfer
from .routers import build_router
from ..core.protocols import Executor
from ..core.request import Request, RequestStatus
from ..core.scheduler import Scheduler, SchedulerOutput
from ..core.step import BatchShape, StepResult, batch_shape
from ..results.metrics import StepLog
from .bulk import decode_runs, spec_runs
from .bulk.admitting_runs import plan_admitting

_IS_PREFILL = attrgetter("is_prefill")


class EngineClock(simpy.Environment):
    """simpy's environment: the run's only clock. A replica ending a step moves it forward without
    an event (`advance_to`) when nothing else is due before the step's end: what a timeout would do,
    minus the event (most steps of a run end so). `event_per_step=True` makes every step end with an
    event instead, for a caller that watches the engine step by step with `env.step()` (same results)."""

    def __init__(self, initial_time: float = 0.0, event_per_step: bool = False):
        super().__init__(initial_time)
        self.event_per_step = event_per_step
        self.steps = 0          # engine steps of all replicas so far (EngineReplica.num_steps summed)

    def retarget(self, event: simpy.Event, t: float, fresh: bool = False) -> None:
        """Move a scheduled, unprocessed event to time `t` (the arrival process's wait, when a decode
        run admitted the arrivals it waited for). `fresh`: it is ordered as an event made now (after
        those already due at `t`), as a run planned now would schedule its end."""
        queue = self._queue
        for i, (_, priority, eid, queued) in enumerate(queue):
            if queued is event:
                queue[i] = (t, priority, next(self._eid) if fresh else eid, event)
                heapq.heapify(queue)
                return
        raise ValueError("retarget: the event is not scheduled")

    def timeout_at(self, t: float) -> simpy.Event:
        """An event at time `t` exactly (a timeout's `now + delay` can round one ulp away from it)."""
        if t < self._now:
            raise ValueError(f"timeout_at({t}) is before now ({self._now})")
        event = simpy.Event(self)
        event._ok = True
        event._value = None
        heapq.heappush(self._queue, (t, 1, next(self._eid), event))      # simpy's NORMAL priority
        return event

    def advance_to(self, t: float) -> bool:
        """Move the clock to `t` if no event is due at or before it (then no process can tell the
        difference from a timeout); False, leaving the clock alone, otherwise."""
        if t < self.peek() and not self.event_per_step:
            self._now = t
            return True
        return False


@dataclass(frozen=True)
class ReplicaOptions:
    fast_forward: bool = True         # advance pure-decode stretches in bulk when executor and KV manager allow
    check_invariants: bool = False
    max_run_steps: int = 4096         # longest decode run
    # the simulator's step-time variance (sim/step_noise.StepNoise of this replica); None: deterministic
    step_noise: object = None
    # a data-parallel attention rank: a DPGroup steps it with the other ranks (no process of its own)
    grouped: bool = False


@dataclass(frozen=True)
class ReplicaFeed:
    """How a replica meets the rest of the run: arrivals, progress and the closed-loop client."""
    next_arrival: Callable[[], float] = lambda: float("inf")
    step_arrivals: StepArrivals | None = None
    on_step: Callable[[int], None] | None = None
    # told how many requests left the engine (finished or rejected) and when: the closed-loop client
    on_done: Callable[[int, float], None] | None = None
    # the arrival process, when this replica alone takes the trace's arrivals: its decode runs may
    # admit them (sim/engine/bulk/admitting_runs.py)
    arrivals: Callable[[], ArrivalProcess] | None = None
    # told which requests left this replica (finished or rejected) and when: the cluster layer
    # (sim/cluster/) hands a prefill leg's request on from there
    on_finished: Callable[[list[Request], float], None] | None = None
    # the earliest another replica can hand this one a request it already owns (a prefill leg's
    # decode side: it joins the next schedule, so decode runs stop at the step in progress then)
    next_handoff: Callable[[], float] = lambda: float("inf")
    # the client's timeout (`--request-timeout`): requests it gives up on are aborted in the engine
    timeout: ClientTimeout | None = None
    # told (replica, time, tokens, streams) at every step end that produced output tokens (streams: those
    # requests still streaming after it): a frontend whose API server streams them on the loop that also
    # takes new requests (sim.simulator.client.Frontend.outputs)
    on_tokens: Callable[[int, float, int, int], None] | None = None
    # a fleet whose router reads replica state lazily (sim.engine.loop.LazyRouting): decode runs are planned
    # up to the router's next read of every replica and applied when a read or a request reaches the replica
    lazy: LazyRouting | None = None


@dataclass(frozen=True)
class ClientTimeout:
    """A benchmark client's total timeout per request (`--request-timeout`; aiohttp's `total`, the OpenAI
    client's `timeout`): a request not finished `timeout_s` after the client sent it fails, its connection
    closes and the API server aborts it in the engine. The engine sees the abort as it sees an arrival at
    the deadline: at the first schedule at or after it (with async scheduling, one schedule later), so a
    decode fast-forward stops there exactly as at an arrival. `sent(request)`: when the client sent it."""
    timeout_s: float
    sent: Callable[[Request], float]

    def deadline(self, req: Request) -> float:
        return self.sent(req) + self.timeout_s


class EngineReplica:
    def __init__(self, env: EngineClock, index: int, scheduler: Scheduler, executor: Executor,
                 step_log: StepLog, options: ReplicaOptions = ReplicaOptions(), feed: ReplicaFeed = ReplicaFeed()):
        self.env = env
        self.index = index
        self.scheduler = scheduler
        self.kv = scheduler.kv
        self.executor = executor
        self.step_log = step_log
        # only then are they a DecodeRunExecutor and a DecodeRunKV (sim/core/protocols.py)
        self.bulk_decode = options.fast_forward and executor.supports_decode_runs and self.kv.supports_decode_runs
        # speculative decoding: runs of verification steps in bulk (sim/engine/bulk/spec_runs.py)
        self.spec_runs = (options.fast_forward and getattr(executor, "supports_spec_runs", False)
                          and scheduler.spec is not None and self.kv.supports_decode_runs
                          and feed.on_tokens is None and feed.step_arrivals is None)
        self.check = options.check_invariants
        self.next_arrival = feed.next_arrival
        self.on_step = feed.on_step
        self.max_run_steps = options.max_run_steps
        self.num_steps = 0
        self.step_arrivals = feed.step_arrivals
        self.on_done = feed.on_done
        self.on_tokens = feed.on_tokens
        self.on_finished = feed.on_finished
        self.next_handoff = feed.next_handoff
        # a KV connector's transfers complete between steps: decode runs stop at each (and at finishes,
        # which may start a save or send), and do not admit arrivals
        self.connector = scheduler.connector
        # a connector that tells ahead which finishes keep their blocks: runs go on past the others
        self._finish_aware = self.connector if isinstance(self.connector, FinishAwareConnector) else None
        self.arrivals = feed.arrivals if self.bulk_decode and executor.supports_admitting_runs \
            and self.connector is None and feed.timeout is None else None
        self.timeout = feed.timeout
        self.noise = options.step_noise
        self._deadlines: list[tuple[float, int, Request]] = []     # (deadline, order, request): a heap
        self._abort_reasons: dict[int, str] = {}     # request id -> why the API server aborts it (abort_request)
        # async scheduling: requests that arrived while a step ran reach the scheduler one schedule later
        self.async_scheduling = scheduler.config.async_scheduling
        self.inbox: deque[Request] = deque()
        self._step_start = 0.0
        self.tokens_computed = 0    # prefill + decode tokens computed so far (the progress measure)
        self._last_duration = 0.0
        self.busy_until = 0.0       # when the step (or decode run) in flight ends: nothing leaves before
        self._wake: simpy.Event | None = None
        self.group: DPGroup | None = None       # set by the DPGroup that steps a grouped replica
        # a lazy fleet (feed.lazy): the decode run planned and not yet applied, its rows once applied, the
        # event at its end
        self.lazy = feed.lazy if self.bulk_decode and self.arrivals is None and feed.timeout is None else None
        self._planned: decode_runs.DecodeRun | None = None
        self._planned_rows: dict | None = None
        self._planned_end: simpy.Event | None = None
        self._planned_waiting: list[int] = []
        self.process = None if options.grouped else env.process(self.run())

    @property
    def now(self) -> float:
        return self.env.now

    @property
    def outstanding(self) -> int:
        return len(self.scheduler.running) + len(self.scheduler.waiting)

    def submit(self, req: Request) -> None:
        if self._planned is not None:
            self.sync()
        req.replica = self.index
        if self.timeout is not None:
            heapq.heappush(self._deadlines, (self.timeout.deadline(req), len(self._deadlines), req))
        if self.async_scheduling and self.scheduler.has_work:
            self.inbox.append(req)       # a step is in flight: the next schedule is already made
            self.wake()                  # (or it waits for a transfer: it may take this one now)
            return
        if self._add(req):
            self.wake()

    def _idle(self):
        """Wait for an arrival, or for the connector's next transfer to end."""
        self._wake = self.env.event()
        transfer_done = self.scheduler.next_transfer_completion()
        if transfer_done < float("inf"):
            yield self._wake | self.env.timeout(max(transfer_done - self.now, 0.0))
        else:
            yield self._wake
        self._wake = None

    def wake(self) -> None:
        """An idle replica re-checks its work now (a connector learnt when a transfer ends)."""
        if self.group is not None:
            self.group.wake()
        elif self._wake is not None and not self._wake.triggered:
            self._wake.succeed()

    def _add(self, req: Request) -> bool:
        """Hand `req` to the scheduler; False if it is rejected (it can never fit)."""
        if self.scheduler.add_request(req):
            return True
        if self.on_done is not None:
            self.on_done(1, self.now)
        if self.on_finished is not None:
            self.on_finished([req], self.now)
        return False

    def next_deadline(self) -> float:
        """When the client gives up on the next of this replica's requests still in the engine (inf: none)."""
        deadlines = self._deadlines
        while deadlines and deadlines[0][2].is_finished:
            req = heapq.heappop(deadlines)[2]
            if self._abort_reasons:          # an API server's abort that came too late: nothing to keep
                self._abort_reasons.pop(req.request_id, None)
        return deadlines[0][0] if deadlines else float("inf")

    def _abort_expired(self) -> None:
        """Abort the requests whose client gave up, as an arrival at the deadline is taken: before the
        first schedule at or after it (async scheduling: the deadline before the previous step started)."""
        horizon = self._step_start if self.async_scheduling and self.scheduler.has_work else self.now
        aborted, loading = 0, []
        while self.next_deadline() <= horizon:
            entry = heapq.heappop(self._deadlines)
            req = entry[2]
            if req.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                loading.append(entry)        # its connector load is in flight: aborted once it has landed
                continue
            if req in self.inbox:            # sent but not yet seen by a schedule
                self.inbox.remove(req)
                req.status = RequestStatus.ABORTED
                req.finish_time = self.now
                self.scheduler.aborted.append(req)
            elif not self.scheduler.abort(req, self.now):
                continue
            why = self._abort_reasons.pop(req.request_id, None) if self._abort_reasons else None
            req.reject_reason = why or f"client timeout: not finished {self.timeout.timeout_s:g} s after it was sent"
            aborted += 1
        for entry in loading:
            heapq.heappush(self._deadlines, entry)
        if aborted and self.on_done is not None:
            self.on_done(aborted, self.now)

    def abort_request(self, req: Request, reason: str) -> None:
        """The API server aborts `req` now (its client closed the connection, kvsim serve): taken as a client
        timeout's deadline is, at the first schedule at or after now (`_abort_expired`: out of the inbox, the
        waiting queue or the batch, its blocks freed); nothing if it has finished by then."""
        self._abort_reasons[req.request_id] = reason
        heapq.heappush(self._deadlines, (self.now, len(self._deadlines), req))

    def _take_arrivals(self) -> None:
        """Hand the scheduler what has arrived for the step about to be scheduled."""
        if self._deadlines:
            self._abort_expired()
        inbox = self.inbox
        idle = not self.scheduler.has_work
        while inbox and (idle or inbox[0].arrival_time <= self._step_start):
            self._add(inbox.popleft())
        if self.step_arrivals is not None:
            for req in self.step_arrivals.due(self.num_steps, idle=not self.scheduler.has_work):
                req.arrival_time = self.now
                req.replica = self.index
                self.scheduler.add_request(req)

    def _reach_run_end(self, run: decode_runs.DecodeRun):
        """Bring the clock to a decode run's end as stepping does: at once to the last step end before
        the next event, then one timeout per remaining step (a single timeout from further back can
        round one ulp away from the end: now + (end - now) is not always end)."""
        ends = run.ends
        due = bisect_left(ends, self.env.peek())          # steps ending at or after the next event
        if due and not self.env.advance_to(ends[due - 1]):
            due = 0                                       # an event per step (EngineClock.event_per_step)
        if due < len(ends) and not self.env.event_per_step:
            # nothing another process does before the run's end reaches this replica (the run stops before
            # anything that could: an arrival, a transfer, a hand-off), so one event at the end exactly
            # stands for the run's remaining steps (several replicas: another one's step ends are due)
            yield self.env.timeout_at(ends[-1])
            return
        for d in run.durations[due:].tolist():
            yield self.env.timeout(d)

    def run(self):
        while True:
            if self.connector is not None:
                self.scheduler.update_from_connector(self.now)
            self._take_arrivals()
            if not self.scheduler.has_work:
                self.scheduler.release_finishing()
                yield from self._idle()
                continue
            out = self.scheduler.schedule()
            if out.is_empty and self.scheduler.awaiting_transfers:
                yield from self._idle()         # the blocks it needs come back when a transfer ends
                continue
            if out.is_empty:
                raise RuntimeError(
                    f"replica {self.index}: nothing schedulable with {len(self.scheduler.waiting)} waiting "
                    f"and {len(self.scheduler.running)} running; the KV manager cannot make progress")
            start = self._step_start = self.now
            for s in out.scheduled:
                if s.request.first_scheduled_time is None:
                    s.request.first_scheduled_time = start
            result = self.executor.execute(out)
            # the KV manager's policies act on the step that ran (vLLM: the scheduler's update, not
            # the model runner); the executor charges (simulator) or applies (backend) what they did
            result = self.executor.complete(result, self.kv.finish_step(out.scheduled))
            if self.noise is not None:        # the step-time variance (sim/engine/step_noise.py) on its compute
                result.duration_s = result.duration_s * self.noise.factor(self.num_steps)
            if out.kv_transfer is not None:
                result.duration_s = step_seconds_with_transfer(result.duration_s, out.kv_transfer)
                result.predicted_s = step_seconds_with_transfer(result.predicted_s, out.kv_transfer)
            shape = result.shape or batch_shape(out, self.kv)     # before finishes free blocks
            self._last_duration = result.duration_s
            self.busy_until = start + result.duration_s
            if not self.env.advance_to(start + result.duration_s):
                yield self.env.timeout(result.duration_s)     # from start: the end exactly
            finished = self.scheduler.update(out, self.now)
            self._tell_step_end(out, finished)
            if not self.scheduler.has_work:
                self.scheduler.release_finishing()     # async: no next schedule to wait for
            self._log_step(start, out, result, len(finished), shape)
            if self.bulk_decode:
                yield from self._decode_run()
            elif self.spec_runs:
                yield from self._spec_run()

    def _tell_step_end(self, out: SchedulerOutput, finished: list[Request]) -> None:
        """Tell the run a step ended: its output tokens (requests whose last token time is now) to
        `on_tokens`, its finished requests to `on_done` and `on_finished`."""
        now = self.now
        if self.on_tokens is not None:
            tokens = sum(1 for s in out.scheduled if s.request.token_times and s.request.token_times[-1] == now)
            if tokens:
                self.on_tokens(self.index, now, tokens, max(tokens - len(finished), 0))
        if finished and self.on_done is not None:
            self.on_done(len(finished), now)
        if finished and self.on_finished is not None:
            self.on_finished(finished, now)

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
                  shape: BatchShape) -> None:
        num_prefill = sum(map(_IS_PREFILL, out.scheduled)) if out.decode_contexts is None else 0
        row = {
            "replica": self.index, "step": self.num_steps, "time_s": start,
            "duration_s": result.duration_s, "predicted_s": result.predicted_s,
            "batch_size": len(out.scheduled), "num_prefill_seqs": num_prefill,
            "num_decode_seqs": len(out.scheduled) - num_prefill,
            "prefill_tokens": shape.num_prefill_tokens, "decode_tokens": shape.num_decode_tokens,
            "kv_tokens_read": shape.kv_tokens_read,
            "preemptions": len(out.preempted), "finished": finished,
            "evicted_tokens": result.evicted_tokens,
            "blocks_freed_by_eviction": result.blocks_freed_by_eviction,
            "bytes_moved": result.bytes_moved,
            "attn_pairs_prefill": shape.attn_pairs_prefill,
            "block_table_entries": shape.block_table_entries,
        }
        row.update(self._pool_row())
        spec = self.scheduler.spec
        if spec is not None:          # speculative decoding's columns (SPEC_STEP_COLUMNS)
            row.update(num_drafts=spec.step_drafts, num_draft_tokens=spec.step_draft_tokens,
                       num_accepted_tokens=spec.step_accepted, draft_s=getattr(self.executor, "last_draft_s", 0.0),
                       verify_s=getattr(self.executor, "last_verify_s", 0.0))
        self.step_log.append(row)
        self.num_steps += 1
        self.env.steps += 1
        self.tokens_computed += int(shape.num_prefill_tokens) + int(shape.num_decode_tokens)
        if self.check:
            self.check_invariants()
        if self.on_step:
            self.on_step(1)

    def check_invariants(self) -> None:
        sched = self.scheduler
        live = set(sched.running) | set(sched.waiting) | set(sched.loading) | set(sched.sending)
        self.kv.check_invariants(live)
        connector_check = getattr(self.connector, "check_invariants", None)
        if connector_check is not None:
            connector_check()
        for r in sched.loading:
            assert r.status == RequestStatus.WAITING_FOR_REMOTE_KVS and r not in sched.running, (
                f"request {r.request_id} loads its KV while scheduled")
        for r in self.scheduler.running:
            assert 0 < r.num_computed_tokens <= r.num_tokens, f"request {r.request_id} token count broken"
            assert r.num_output_tokens <= r.max_output_tokens
        held = set(self.scheduler.finishing) | set(sched.sending)
        for r in self.scheduler.finished:
            assert r.num_output_tokens == r.max_output_tokens, f"request {r.request_id} lost tokens"
            assert r in held or r not in self.kv.req_blocks

    # ----- decode fast-forward ----------------------------------------------------------------
    def decode_run_view(self) -> decode_runs.ReplicaView:
        """What `find_decode_run` needs of this replica (sim/engine/bulk/decode_runs.py)."""
        arrival = self.next_arrival()
        if self._deadlines:                  # an abort ends a run as an arrival does
            arrival = min(arrival, self.next_deadline())
        max_steps = self.max_run_steps
        if self.lazy is not None and arrival > self.now:
            # a lazy fleet: the run goes on to the router's next read of every replica (an arrival or a
            # request sent here cuts it), planned over about the steps until this replica's share of arrivals
            fleet_gap = (arrival - self.now) / max(self._last_duration, 1e-9)
            arrival = self.lazy.next_read()
            max_steps = min(max_steps, int(min(fleet_gap, 1e9)) * 2 * len(self.lazy.replicas) + 16)
        return decode_runs.ReplicaView(
            now=self.now, next_arrival=arrival, inbox_empty=not self.inbox,
            steps_to_step_arrival=self.step_arrivals.steps_until_next(self.num_steps) if self.step_arrivals
            else float("inf"),
            last_step_s=self._last_duration, last_step_start=self._step_start, max_steps=max_steps,
            closed_loop=self.on_done is not None or self.on_finished is not None or self._finish_stops_runs(),
            next_transfer=min(self.scheduler.next_transfer_completion(), self.next_handoff()),
            step_index=self.num_steps, noise=self.noise)

    def _finish_stops_runs(self) -> bool:
        """A decode run stops at its first finish when a finish may start a connector's save or send: any
        finish for a connector that cannot tell ahead, else the finish of a running request whose blocks
        the connector would keep (FinishAwareConnector)."""
        if self.connector is None:
            return False
        aware = self._finish_aware
        return aware is None or any(aware.keeps_blocks_at_finish(r) for r in self.scheduler.running)

    def _decode_run(self):
        """Advance a stretch of pure-decode steps in bulk (see sim/engine/bulk/decode_runs.py)."""
        sched = self.scheduler
        if sched.sending:
            return          # when a connector's send ends is learnt between steps: step one by one
        run = decode_runs.find_decode_run(self.decode_run_view(), sched, self.kv, self.executor,
                                self._plan_admitting if self.arrivals is not None else None)
        if run is None:
            return
        if self.lazy is not None and run.waiting is None:
            yield from self._lazy_run(run)
            return
        k = run.num_steps
        if run.waiting is not None:
            waiting = run.waiting
            self._take_arrivals_of(run)
        else:
            waiting = [len(sched.waiting)] * k
        rows = self._apply_run(run)
        yield from self._reach_run_end(run)
        self._end_run(run, rows, waiting)

    def _apply_run(self, run: decode_runs.DecodeRun) -> dict:
        """The run's allocations, finishes (all but its last step's) and token counts, done now; its pool
        columns (and, a lazy run, its steps' waiting counts: those of now)."""
        if self.lazy is not None:
            self._planned_waiting = [len(self.scheduler.waiting)] * run.num_steps
        rows = decode_runs.apply_decode_run(self.scheduler, self.kv, run)
        if self.scheduler.loading:
            self._count_loading_slots(rows, run.num_steps)
        self._step_start = run.starts[-1]       # its schedule is the next one's arrival horizon
        self.busy_until = run.ends[-1]
        return rows

    def _lazy_run(self, run: decode_runs.DecodeRun):
        """A decode run of a lazy fleet's replica (sim.engine.loop.LazyRouting): planned now, applied when
        the router reads this replica or sends it a request (`sync`: cut at the step in progress then,
        the run the replica would have planned with that arrival as its next one), else at its end.
        Nothing else reads or changes the replica meanwhile, so the results are those of applying it
        now and cutting it at every arrival."""
        self._planned, self._planned_rows = run, None
        self.busy_until = run.ends[-1]
        if not self.env.advance_to(run.ends[-1]):       # something is due before its end: it may read us
            self._planned_end = self.env.timeout_at(run.ends[-1])
            yield self._planned_end
        run, rows = self._planned, self._planned_rows
        self._planned = self._planned_rows = self._planned_end = None
        if run.num_steps == 0:          # cut before its first step: stepping goes on from here
            return
        if rows is None:
            rows = self._apply_run(run)
        self._end_run(run, rows, self._planned_waiting)

    def sync(self) -> None:
        """Bring a planned decode run to now (a lazy fleet's replica): cut it after the step in progress
        (with async scheduling, one step more unless that step finishes requests: the rule of
        `decode_runs._step_times` for an arrival now) and apply it, as the run planned with an arrival now
        would have been; its end event moves to the cut run's end."""
        run = self._planned
        if run is None or self._planned_rows is not None:
            return
        m = decode_runs.steps_before(run, self.now, self.async_scheduling)
        if m < run.num_steps:
            run = self._planned = decode_runs.truncate_run(run, m)
            self.busy_until = run.ends[-1] if m else self._step_start + self._last_duration
            self.env.retarget(self._planned_end, run.ends[-1] if m else self.now, fresh=True)
        if m:
            self._planned_rows = self._apply_run(run)

    def outstanding_now(self) -> int:
        """Running + waiting requests as stepping would count them now (a router's read), without applying
        a lazy replica's planned run where that can be counted from its plan: the requests that left it
        in the steps it has taken by now."""
        run = self._planned
        if run is None or self._planned_rows is not None:
            return self.outstanding
        sched = self.scheduler
        m = decode_runs.steps_before(run, self.now, self.async_scheduling)
        if not m:
            return self.outstanding
        if decode_runs.replays_fills(self.kv, run):
            self.sync()
            return self.outstanding
        return self.outstanding - len(sched.finishing) - sum(1 for e in run.last_step if e < m)

    def computed_blocks_now(self, req: Request) -> list[int]:
        """The replica's prefix-cache hits for `req` now (a router's read), without applying a lazy
        replica's planned run where the plan cannot change them: no hit, or no hit among the blocks its
        allocations up to now may take off the free queue (a decode run hashes only blocks of its own
        requests' outputs, which no other prompt hits)."""
        hits = self.kv.get_computed_blocks(req)
        run = self._planned
        if not hits or run is None or self._planned_rows is not None:
            return hits
        m = decode_runs.steps_before(run, self.now, self.async_scheduling)
        popped = sum(run.new_blocks[:m])
        if popped and (popped > self.kv.pool.num_free_blocks
                       or not set(hits).isdisjoint(self.kv.pool.next_free_blocks(popped))):
            self.sync()
            return self.kv.get_computed_blocks(req)
        return hits

    def _end_run(self, run: decode_runs.DecodeRun, rows: dict, waiting: list) -> None:
        """A decode run reached its end: its last step's finishes, then its rows to the step log."""
        sched = self.scheduler
        k = run.num_steps
        done = [r for r, e in zip(run.requests, run.last_step, strict=False) if e == k]
        self.scheduler.finish(done, self.now)
        if done and self.on_done is not None:
            self.on_done(len(done), self.now)
        if done and self.on_finished is not None:
            self.on_finished(done, self.now)
        waiting[-1] = len(sched.waiting)       # arrivals during the last step
        released = self.async_scheduling and not sched.has_work and sched.finishing
        if released:
            sched.release_finishing()
        if not self.async_scheduling or released:
            # the last step's finishes return their blocks now
            last = self._pool_row()
            for name in ("blocks_used", "blocks_free", "blocks_cached", "live_slots", "allocated_slots",
                         "fragmentation", "num_running"):
                rows[name][-1] = last[name]
        prefill = run.prefill
        decodes = run.batch if prefill is None else run.batch - np.array(prefill.seqs, np.int64)
        rows.update({
            "replica": self.index, "step": range(self.num_steps, self.num_steps + k),
            "time_s": run.starts, "duration_s": run.durations,
            "predicted_s": run.durations if run.predicted is None else run.predicted,
            "batch_size": run.batch, "num_prefill_seqs": 0 if prefill is None else prefill.seqs,
            "num_decode_seqs": decodes, "prefill_tokens": 0 if prefill is None else prefill.tokens,
            "decode_tokens": decodes, "kv_tokens_read": run.kv_read,
            "attn_pairs_prefill": 0.0 if prefill is None else prefill.attn_pairs, "block_table_entries": run.entries,
            "preemptions": 0, "num_waiting": waiting,
        })
        self.step_log.append_columns(rows, k)
        self.num_steps += k
        self.env.steps += k
        self.tokens_computed += int(run.batch.sum()) + (0 if prefill is None else sum(prefill.tokens) - len(run.admissions))
        if self.check:
            self.check_invariants()
        if self.on_step:
            self.on_step(k)


    def _spec_run(self):
        """Advance a stretch of verification steps in bulk (see sim/engine/bulk/spec_runs.py)."""
        sched = self.scheduler
        run = spec_runs.find_spec_run(self.decode_run_view(), sched, self.kv, self.executor)
        if run is None:
            return
        k = run.num_steps
        rows = spec_runs.apply_spec_run(sched, self.kv, run)
        self._step_start = run.starts[-1]       # its schedule is the next one's arrival horizon
        self.busy_until = run.ends[-1]
        yield from self._reach_run_end(run)
        waiting = [0] * k
        waiting[-1] = len(sched.waiting)       # arrivals during the last step
        rows.update({
            "replica": self.index, "step": range(self.num_steps, self.num_steps + k),
            "time_s": run.starts, "duration_s": run.durations, "predicted_s": run.predicted,
            "batch_size": run.batch, "num_prefill_seqs": 0, "num_decode_seqs": run.batch, "prefill_tokens": 0,
            "decode_tokens": run.decode_tokens, "kv_tokens_read": run.kv_read, "attn_pairs_prefill": run.attn_pairs,
            "block_table_entries": run.entries, "preemptions": 0, "finished": 0, "num_waiting": waiting,
        })
        self.step_log.append_columns(rows, k)
        self.num_steps += k
        self.env.steps += k
        self.tokens_computed += int(run.decode_tokens.sum())
        if self.check:
            self.check_invariants()
        if self.on_step:
            self.on_step(k)

    def _count_loading_slots(self, rows: dict, k: int) -> None:
        """A decode run's slot columns count only its running requests; requests waiting for a
        connector's load hold blocks whose free tail slots are not live either (constant in the run,
        which stops when a load ends)."""
        kv = self.kv
        empty = sum(kv.block_table_entries(r) * kv.block_size - r.num_computed_tokens for r in self.scheduler.loading)
        live = rows["live_slots"] - empty
        allocated = rows["allocated_slots"]
        rows["live_slots"] = live
        rows["fragmentation"] = 1.0 - np.divide(live, allocated, out=np.ones(k), where=allocated != 0)

    def _plan_admitting(self, view, sched, kv, executor, start) -> decode_runs.DecodeRun | None:
        return plan_admitting(view, sched, kv, executor, Incoming(self.inbox, self.arrivals()), start)

    def _take_arrivals_of(self, run: decode_runs.DecodeRun) -> None:
        """The arrivals a run took leave the inbox and the arrival process for this replica."""
        for _, req in run.arrivals:
            req.replica = self.index
        Incoming(self.inbox, self.arrivals()).take(len(run.arrivals))


class DPGroup:
    """Data-parallel attention ranks of a MoE replica stepping in lockstep (vLLM's DP engines with expert
    parallelism; sim/model/parallel.py): every step, each rank with work schedules its own batch, the step of
    all ranks takes the synchronised time `pricing.step_seconds` gives (the slowest rank's; an idle rank runs a
    dummy batch), and every rank updates at its end. A rank whose requests arrive while the others step joins
    at the next step. No decode fast-forward (each step depends on every rank)."""

    def __init__(self, env: EngineClock, ranks: list[EngineReplica], pricing):
        self.env, self.ranks, self.pricing = env, ranks, pricing
        self._wake: simpy.Event | None = None
        for rank in ranks:
            rank.group = self
        self.num_steps = 0
        self.process = env.process(self.run())

    def wake(self) -> None:
        if self._wake is not None and not self._wake.triggered:
            self._wake.succeed()

    def run(self):
        env, ranks = self.env, self.ranks
        while True:
            for rank in ranks:
                rank._take_arrivals()
            active = [rank for rank in ranks if rank.scheduler.has_work]
            if not active:
                for rank in ranks:
                    rank.scheduler.release_finishing()
                self._wake = env.event()
                yield self._wake
                self._wake = None
                continue
            start = env.now
            steps = []
            for rank in active:
                out = rank.scheduler.schedule()
                if out.is_empty:
                    raise RuntimeError(f"replica {rank.index}: nothing schedulable with {len(rank.scheduler.waiting)} "
                                       f"waiting and {len(rank.scheduler.running)} running; the KV manager cannot "
                                       "make progress")
                for s in out.scheduled:
                    if s.request.first_scheduled_time is None:
                        s.request.first_scheduled_time = start
                result = rank.executor.execute(out)
                result = rank.executor.complete(result, rank.kv.finish_step(out.scheduled))
                if rank.noise is not None:
                    result.duration_s = result.duration_s * rank.noise.factor(rank.num_steps)
                shape = result.shape or batch_shape(out, rank.kv)
                steps.append((rank, out, result, shape))
            own = {id(rank): (result.duration_s, float(shape.num_prefill_tokens) + float(shape.num_decode_tokens))
                   for rank, _, result, shape in steps}
            times = [own[id(r)][0] if id(r) in own else None for r in ranks]
            tokens = [own[id(r)][1] if id(r) in own else 0.0 for r in ranks]
            duration = self.pricing.step_seconds(times, tokens)
            for rank in ranks:
                rank._step_start = start
                rank._last_duration = duration
                rank.busy_until = start + duration
            if not env.advance_to(start + duration):
                yield env.timeout(duration)
            self.num_steps += 1
            for rank, out, result, shape in steps:
                result.duration_s = result.predicted_s = duration
                finished = rank.scheduler.update(out, env.now)
                rank._tell_step_end(out, finished)
                if not rank.scheduler.has_work:
                    rank.scheduler.release_finishing()
                rank._log_step(start, out, result, len(finished), shape)


class Incoming:
    """A replica's requests still to schedule, in arrival order: those waiting in its inbox for the
    next schedule (async scheduling), then those still to arrive."""

    def __init__(self, inbox: deque, arrivals: ArrivalProcess):
        self.inbox, self.arrivals = inbox, arrivals

    def upcoming(self, i: int) -> Request | None:
        inbox = self.inbox
        return inbox[i] if i < len(inbox) else self.arrivals.upcoming(i - len(inbox))

    def take(self, n: int) -> None:
        inbox = self.inbox
        while n and inbox:
            inbox.popleft()
            n -= 1
        if n:
            self.arrivals.take(n)


def Router(replicas: list[EngineReplica], policy: str = "round_robin", options=None):
    """The router named `policy` over `replicas` (the registry of sim/engine/routers)."""
    return build_router(policy, replicas, options)


class RoutedAhead:
    """A router that reads no replica state (`RouterBase.reads_replicas` False: round-robin) asked before the
    run, in arrival order, where each request goes: the decisions it takes at the arrivals. The arrival process
    is unchanged (same requests, same times, same events); `route` hands each request to the replica decided
    for it, and `next_arrival(i)` is replica i's own next arrival, so its decode runs stop at its arrivals
    only, not at every arrival of the fleet. On an open loop nothing else reaches a replica from outside
    (the router reads none of them), so each replica runs exactly as it did; only its runs are longer."""

    def __init__(self, requests: list[Request], router, replicas: list[EngineReplica]):
        self.requests = requests
        self.replicas = replicas
        self.targets = array("l", (router.route(req).index for req in requests))
        own: list[list[float]] = [[] for _ in replicas]
        for req, i in zip(requests, self.targets, strict=True):
            own[i].append(req.arrival_time)
        self._own = [array("d", times) for times in own]
        self._sent = [0] * len(replicas)        # requests routed to each replica so far
        self._n = 0                             # requests routed so far

    def route(self, req: Request) -> EngineReplica:
        n = self._n
        if self.requests[n] is not req:
            raise RuntimeError(f"routed ahead: request {req.request_id} arrived out of the trace's order")
        i = self.targets[n]
        self._n = n + 1
        self._sent[i] += 1
        return self.replicas[i]

    def next_arrival(self, index: int) -> float:
        """When the next request routed to replica `index` arrives (inf: none is left)."""
        times, k = self._own[index], self._sent[index]
        return times[k] if k < len(times) else float("inf")


class LazyRouting:
    """A fleet's router that reads replica state (`RouterBase.reads_replicas`), on an open loop, with lazy
    replica state: each replica's decode runs are planned past the fleet's arrivals and applied only when
    the router reads that replica or sends it a request (`EngineReplica.sync`: the run cut where the
    arrival would have cut it). Before each decision the router says whether it reads every replica's
    exact state now (`RouterBase.reads_state_now`: then every replica is brought to now first, as the
    engine did at every arrival); a router whose signals are refreshed at an interval reads them only at
    refresh instants, and reads of the outstanding requests and prefix-cache hits are answered from a
    replica's plan where it can (`EngineReplica.outstanding_now`, `computed_blocks_now`). Same decisions,
    same results; replicas' runs stop at the router's reads and their own arrivals only."""

    def __init__(self, router, replicas: list[EngineReplica], requests: list[Request]):
        self.router = router
        self.replicas = replicas
        self._times = array("d", (r.arrival_time for r in requests))
        self._arrivals: ArrivalProcess | None = None

    def attach(self, arrivals: ArrivalProcess) -> None:
        self._arrivals = arrivals

    def route(self, req: Request) -> EngineReplica:
        if self.router.reads_state_now():
            for replica in self.replicas:
                replica.sync()
        return self.router.route(req)

    def next_read(self) -> float:
        """When the router next brings every replica to its exact state: the first arrival still to come
        at or after the earliest time it may (inf: none)."""
        arrivals = self._arrivals
        i = arrivals.index if arrivals is not None else 0
        times = self._times
        if i >= len(times):
            return float("inf")
        earliest = self.router.next_state_read()
        if earliest <= times[i]:
            return times[i]
        if earliest == float("inf"):
            return earliest
        j = bisect_left(times, earliest, i)
        return times[j] if j < len(times) else float("inf")


class StepArrivals:
    """Arrivals by engine step (`trace_options.arrival_unit: step`): a request whose
    `arrival_time` holds k joins before the engine's k-th step (counted from 0); when the engine
    runs out of work first, the next arrivals join at once. Real-engine references are fed so."""

    def __init__(self, requests: list[Request]):
        self.pending = deque(sorted(requests, key=lambda r: r.arrival_time))

    def due(self, step: int, idle: bool) -> list[Request]:
        pending, out = self.pending, []
        while pending and pending[0].arrival_time <= step:
            out.append(pending.popleft())
        if idle and not out and pending:
            first = pending[0].arrival_time
            while pending and pending[0].arrival_time == first:
                out.append(pending.popleft())
        return out

    def steps_until_next(self, step: int) -> float:
        return self.pending[0].arrival_time - step if self.pending else float("inf")


class ConcurrencyLimit:
    """`vllm bench serve --max-concurrency C` on the client side: a request that arrives (at its trace
    time, or all at t=0 without a rate) while C requests are in flight waits in a FIFO queue, like the
    benchmark's asyncio semaphore, and is sent the moment one of them finishes (or is rejected). A
    request's `arrival_time` becomes the time it is sent, so TTFT and E2E latency are measured from there,
    as vLLM measures them; `client_arrival` keeps when it reached the client (its queue time is the
    difference: vLLM's client_queue_time). With an `entry` (sim.simulator.client.Frontend: the
    client-side API server) a sent request enters the engine when the server lets it; `next_entry`
    tells the engines when."""

    def __init__(self, limit: float, router: Router, env: simpy.Environment | None = None, entry=None):
        self.limit = limit
        self.router = router
        self.env = env
        self.entry = entry
        self.in_flight = 0
        self.queue: deque[Request] = deque()
        self.in_transit: deque[Request] = deque()       # sent, entering the engine at their arrival_time
        self.releasing = 0          # finishes whose slots free once the client has their last tokens
        self.client_arrival: dict[int, float] = {}      # request_id -> time it reached the client
        self._sending = False

    def next_entry(self) -> float:
        # sends are in time order, but with a per-request frontend latency (frontend_jitter) a later send
        # can enter first: the earliest entry, not the first sent
        return min(r.arrival_time for r in self.in_transit) if self.in_transit else float("inf")

    @property
    def pending(self) -> int:
        return len(self.queue)

    def arrive(self, req: Request, now: float) -> None:
        self.client_arrival[req.request_id] = now
        self.queue.append(req)
        self._send(now)

    def done(self, count: int, now: float) -> None:
        """`count` requests left the engine at `now` (EngineReplica.on_done). Their slots free when the
        client has their last tokens: at `now`, or once a shared-loop frontend has streamed them
        (`entry.received_by`)."""
        received = self.entry.received_by(now) if self.entry is not None else now
        if received > now:
            self.releasing += 1
            self.env.process(self._done_later(count, received))
            return
        self.in_flight -= count
        self._send(now)

    def _done_later(self, count: int, at: float):
        yield self.env.timeout(at - self.env.now)
        self.releasing -= 1
        self.in_flight -= count
        self._send(self.env.now)

    def _send(self, now: float) -> None:
        if self._sending:           # a rejection inside submit() calls done(): the outer loop goes on
            return
        self._sending = True
        try:
            while self.queue and self.in_flight < self.limit:
                req = self.queue.popleft()
                req.arrival_time = now if self.entry is None else self.entry.enter(req.request_id, now, req.prompt_tokens)
                self.in_flight += 1
                if req.arrival_time > now:
                    self.in_transit.append(req)          # in send order (entries may overtake: next_entry)
                    self.env.process(self._enter(req))
                else:
                    self.router.route(req).submit(req)
        finally:
            self._sending = False

    def _enter(self, req: Request):
        yield self.env.timeout(max(req.arrival_time - self.env.now, 0.0))
        self.in_transit.remove(req)
        self.router.route(req).submit(req)


class ArrivalProcess:
    """Feeds trace requests (sorted by arrival) to the router at their arrival times (through a
    `ConcurrencyLimit` when one is given)."""

    def __init__(self, env: simpy.Environment, requests: list[Request], router: Router,
                 limit: ConcurrencyLimit | None = None):
        self.env = env
        self.requests = requests
        self.router = router
        self.limit = limit
        self.index = 0
        self.process = env.process(self.run())

    def next_arrival(self) -> float:
        nxt = self.requests[self.index].arrival_time if self.index < len(self.requests) else float("inf")
        return min(nxt, self.limit.next_entry()) if self.limit is not None else nxt

    def upcoming(self, i: int) -> Request | None:
        """The i-th request still to arrive (0: the next), or None."""
        j = self.index + i
        return self.requests[j] if j < len(self.requests) else None

    def take(self, n: int) -> None:
        """A decode run admitted the next `n` requests (sim/engine/bulk/admitting_runs.py): wait for the one after."""
        self.index += n
        wake = self.requests[self.index].arrival_time if self.index < len(self.requests) else self.env.now
        self.env.retarget(self.process.target, wake)

    def run(self):
        while self.index < len(self.requests):
            req = self.requests[self.index]
            if req.arrival_time > self.env.now:
                yield self.env.timeout(req.arrival_time - self.env.now)
                if self.index >= len(self.requests) or self.requests[self.index] is not req:
                    continue            # a decode run admitted it meanwhile
            self.index += 1
            if self.limit is not None:
                self.limit.arrive(req, self.env.now)
            else:
                self.router.route(req).submit(req)
