"""The simulated engine on the wall clock: `kvsim simulate`'s engine (same run plan, replicas, router, KV
manager and executor) whose simpy clock follows the wall clock scaled by --time-scale, fed with the
requests that reach the server as they come.

The engine runs in the server's event loop. Each request is stamped with the simulated time it reached
the server and submitted through the router at that time (a simpy timeout, as `kvsim simulate`'s
arrival process does). A tick processes every engine event due by the current simulated time, then
hands each request the tokens produced so far, and is scheduled again for the wall time of the next
event: tokens reach the client when the simulated clock passes their times.

Decode fast-forward stays on (when the run's config has it): the engine does not know the requests to
come, but none can arrive before the simulated time of the tick in progress, so the replicas are told
that time (or an earlier known arrival) as the next arrival. A decode run only takes steps that start
before it, which stepping one by one would take identically (sim/engine/bulk/decode_runs.py); the served token
times equal `kvsim simulate`'s on the recorded arrivals (tests/test_serve.py)."""
from __future__ import annotations

import asyncio
import json
import time
from bisect import bisect_right
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvsim.sim.engine.assembly import build_engine, build_live_engine
from kvsim.sim.core.kv_manager import KVCacheManager
from kvsim.sim.core.request import Request, RequestStatus
from kvsim.sim.simulator.executor import replica_parts
from kvsim.sim.engine.resolved_run import ResolvedRun
from kvsim.traces.trace import NATIVE_FORMAT_VERSION, NATIVE_METADATA_KEY

from .kv_events import KVEventPublisher
from .metrics import RequestMetrics, StepSink
from .protocol import ApiError, Generation
from .tokens import prefix_block_ids

TICK_BUDGET_S = 0.02        # wall time a tick may spend stepping a lagging engine before the server's I/O runs


class SimClock:
    """Simulated time = wall seconds since the start x time_scale (time.monotonic, asyncio's clock)."""

    def __init__(self, time_scale: float, start: float | None = None):
        if not time_scale > 0:
            raise ValueError(f"--time-scale must be > 0, got {time_scale}")
        self.scale = time_scale
        self.start = time.monotonic() if start is None else start

    def now(self) -> float:
        return (time.monotonic() - self.start) * self.scale

    def wall_at(self, t: float) -> float:
        return self.start + t / self.scale


@dataclass(eq=False)
class LiveRequest:
    """A request in flight: its engine request and how far the server has taken its tokens."""
    request: Request
    generation: Generation
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    produced: int = 0          # tokens the engine produced by the last tick (counted in the metrics)
    sent: int = 0              # tokens handed to the client
    done: bool = False
    aborting: bool = False     # its client went away: an abort is on its way to the engine


class EngineFailed(RuntimeError):
    """The simulated engine raised: the server answers 500 from then on."""


class TraceRecorder:
    """The requests the engine received, as a kvsim native JSONL trace (traces/trace.py's format), written
    as they arrive: `kvsim simulate --trace FILE` runs the same arrivals."""

    def __init__(self, path: Path, block_size: int):
        # line-buffered: each request is on disk once it arrived, whenever the server stops
        self.file = open(path, "w", encoding="utf-8", buffering=1)  # noqa: SIM115 - open for the server's lifetime
        meta = {"version": NATIVE_FORMAT_VERSION, "name": "kvsim serve", "prefix_block_tokens": block_size,
                "num_clipped": 0, "num_output_clamped": 0, "num_reordered": 0, "notices": []}
        self.file.write(json.dumps({NATIVE_METADATA_KEY: meta}) + "\n")

    def add(self, req: Request) -> None:
        record = {"request_id": req.request_id, "arrival_time_s": req.arrival_time,
                  "prompt_tokens": req.prompt_tokens, "output_tokens": req.max_output_tokens}
        if req.prefix_hash_ids is not None:
            record["prefix_hash_ids"] = list(req.prefix_hash_ids)
        self.file.write(json.dumps(record) + "\n")

    def close(self) -> None:
        self.file.close()


def warm_up(plan: ResolvedRun, metrics: RequestMetrics) -> None:
    """Run a throwaway engine of `plan` over a few requests before serving: the first steps of a process
    pay one-time costs (imports, caches, compiled kernels) that would otherwise delay the first clients
    by a few hundred milliseconds."""
    probe = RequestMetrics(metrics.model_name, plan.max_model_len, plan.cfg.engine_ranks)
    requests = [Request(request_id=i, arrival_time=0.001 * i, prompt_tokens=min(512, plan.max_model_len // 2),
                        max_output_tokens=8) for i in range(4)]
    build_engine(plan, requests, StepSink(probe), lambda i: replica_parts(plan, i)).drive(catch=())


def check_kv_events_manager(kv) -> None:
    """A ValueError unless `kv` is the shared-layout KV manager with prefix caching: the one whose blocks vLLM's
    KV events describe (a KV policy's manager evicts tokens, not cached blocks)."""
    if not isinstance(kv, KVCacheManager):
        raise ValueError(f"--kv-events-endpoint: KV events come from vLLM's prefix cache (the shared KV layout); "
                         f"this engine's KV manager is {type(kv).__name__}; expected KVCacheManager (a model without "
                         f"sliding-window layers, no KV policy)")
    if not kv.enable_caching:
        raise ValueError("--kv-events-endpoint: KV events are the prefix cache's; enable prefix caching "
                         "(--prefix-caching)")


class LiveEngine:
    def __init__(self, plan: ResolvedRun, clock: SimClock, metrics: RequestMetrics, loop: asyncio.AbstractEventLoop,
                 recorder: TraceRecorder | None = None, stream_interval: int = 1):
        self.clock, self.metrics, self.loop, self.recorder = clock, metrics, loop, recorder
        self.stream_interval = stream_interval     # tokens a stream gathers before it is woken (vLLM's --stream-interval)
        self.block_size = plan.cfg.engine.block_size
        self.run = build_live_engine(plan, [], StepSink(metrics), lambda i: replica_parts(plan, i),
                                     self._next_arrival)
        self.env = self.run.env
        self.replicas = self.run.replicas
        self.horizon = 0.0                       # the simulated time of the tick in progress
        self.arriving: deque[float] = deque()    # times of submitted requests not yet in the engine
        self.live: dict[int, LiveRequest] = {}
        self.num_submitted = 0
        self.failure: str | None = None
        self.on_finished: Callable[[Request], None] | None = None     # observers (tests, logs)
        self._timer: asyncio.TimerHandle | None = None
        self.kv_events: KVEventPublisher | None = None
        self.filler_ids: Sequence[int] = ()      # token ids of the filler words (KV events' output tokens)

    def publish_kv_events(self, publisher: KVEventPublisher, filler_ids: Sequence[int]) -> None:
        """Hand each replica's KV manager a sink of its prefix cache's events; `publisher` sends them after
        every tick. A ValueError when the engine's KV manager is not the shared-layout one with prefix caching
        (a KV policy's manager has no vLLM block events)."""
        for rep in self.replicas:
            check_kv_events_manager(rep.kv)
        for rep, sink in zip(self.replicas, publisher.sinks, strict=True):
            rep.kv.attach_events(sink)
        self.kv_events, self.filler_ids = publisher, filler_ids

    def token_ids(self, req: Request, start: int, end: int) -> list[int]:
        """The token ids at positions start..end-1 of `req`: its prompt's, then the filler words' of its output."""
        live = self.live.get(req.request_id)
        if live is None:
            return []
        prompt = live.generation.prompt_ids
        out = list(prompt[start:end])
        fill, n = self.filler_ids, len(self.filler_ids)
        if n:
            out += [fill[(j - len(prompt)) % n] for j in range(max(start, len(prompt)), end)]
        return out

    @property
    def lag_s(self) -> float:
        """How far the engine is behind the clock: the age of its oldest due event (0 when none is due)."""
        return max(0.0, self.clock.now() - self.env.peek())

    def _next_arrival(self) -> float:
        """The earliest time a request not yet in the engine can arrive: a known one, or one that reaches
        the server after the tick in progress began."""
        return min(self.arriving[0], self.horizon) if self.arriving else self.horizon

    # ----- requests in ----------------------------------------------------------------------------
    def submit(self, gen: Generation) -> LiveRequest:
        """Stamp a request with the current simulated time and send it into the engine; a 400 when it can
        never fit (the KV pool is smaller than its prompt and output)."""
        if self.failure:
            raise ApiError(500, f"the simulated engine failed: {self.failure}", "InternalServerError")
        env = self.env
        t = max(self.clock.now(), env.now)
        ids = prefix_block_ids(gen.prompt_ids, self.block_size)
        req = Request(request_id=self.num_submitted, arrival_time=t, prompt_tokens=len(gen.prompt_ids),
                      max_output_tokens=gen.output_tokens, prefix_hash_ids=ids or None,
                      prefix_block_tokens=self.block_size)
        reason = self.replicas[0].scheduler.reject_reason(req)
        if reason:
            raise ApiError(400, f"The request can never be scheduled: {reason}.")
        self.num_submitted += 1
        if self.recorder is not None:
            self.recorder.add(req)
        live = self.live[req.request_id] = LiveRequest(req, gen)
        self.arriving.append(t)
        env.timeout(t - env.now).callbacks.append(lambda _event: self._arrive(req))
        self._schedule_tick()
        return live

    def _arrive(self, req: Request) -> None:
        self.arriving.popleft()
        self.run.router.route(req).submit(req)

    def abort(self, live: LiveRequest) -> None:
        """The client closed its connection before its request finished: abort it in the engine at the current
        simulated time, as vLLM's API server aborts a request whose client went away. The replica takes the
        abort as it takes a client timeout's (EngineReplica.abort_request): at its next schedule the request
        leaves the queue or the batch and its blocks are freed; the metrics count it as `abort`."""
        if live.done or live.aborting or self.failure:
            return
        live.aborting = True
        env, req = self.env, live.request
        t = max(self.clock.now(), env.now)
        self.arriving.append(t)          # an abort bounds decode runs as an arrival does
        env.timeout(t - env.now).callbacks.append(lambda _event: self._abort(req))
        self._schedule_tick()

    def _abort(self, req: Request) -> None:
        self.arriving.popleft()
        self.replicas[req.replica].abort_request(req, "client disconnected")

    # ----- the clock --------------------------------------------------------------------------
    def _schedule_tick(self) -> None:
        nxt = self.env.peek()
        if nxt == float("inf"):
            return
        when = self.clock.wall_at(nxt)
        if self._timer is not None:
            if self._timer.when() <= when:
                return
            self._timer.cancel()
        self._timer = self.loop.call_at(when, self._tick)

    def _tick(self) -> None:
        self._timer = None
        now = self.horizon = self.clock.now()
        env = self.env
        deadline = time.monotonic() + TICK_BUDGET_S
        events = 0
        try:
            while env.peek() <= now:
                env.step()
                events += 1
                if events % 16 == 0 and time.monotonic() > deadline:
                    break
        except Exception as exc:  # noqa: BLE001 - any engine error ends the service, reported to every client
            self._fail(f"{type(exc).__name__}: {exc}")
            return
        if self.kv_events is not None:
            self.kv_events.publish()
        self._hand_out(now)
        self._schedule_tick()

    def _fail(self, reason: str) -> None:
        self.failure = reason
        for live in self.live.values():
            live.wake.set()

    # ----- tokens out -------------------------------------------------------------------------
    def _hand_out(self, now: float) -> None:
        """Count the tokens each request produced by `now` and wake its stream."""
        for rep in self.replicas:
            sched = rep.scheduler
            for req in sched.running:
                self._progress(req, now)
            if sched.finished:
                for req in sched.finished:
                    self._progress(req, now)
                sched.finished.clear()       # the server keeps no finished request
            if sched.aborted:
                for req in sched.aborted:
                    self._aborted(req, now)
                sched.aborted.clear()

    def _progress(self, req: Request, now: float) -> None:
        live = self.live.get(req.request_id)
        if live is None:
            return
        times = req.token_times
        n = bisect_right(times, now, live.produced)
        if n > live.produced:
            self.metrics.tokens(req, live.produced, n)
            live.produced = n
            if n - live.sent >= self.stream_interval:
                live.wake.set()
        if req.status == RequestStatus.FINISHED and n == len(times):
            self.metrics.finished(req, live.generation.finish_reason, live.generation.max_tokens)
            del self.live[req.request_id]
            live.done = True
            live.wake.set()
            if self.on_finished is not None:
                self.on_finished(req)

    def _aborted(self, req: Request, now: float) -> None:
        live = self.live.pop(req.request_id, None)
        if live is None:
            return
        n = bisect_right(req.token_times, now, live.produced)
        if n > live.produced:
            self.metrics.tokens(req, live.produced, n)
            live.produced = n
        self.metrics.aborted(req)
        live.done = True
        live.wake.set()
        if self.on_finished is not None:
            self.on_finished(req)

    async def tokens(self, live: LiveRequest):
        """Yield (start, end): output tokens start..end-1 of `live` are due, as the clock passes them."""
        while True:
            if self.failure:
                raise EngineFailed(self.failure)
            live.wake.clear()
            if live.produced > live.sent:
                start, live.sent = live.sent, live.produced
                yield start, live.sent
            if live.done and live.sent == live.produced:
                return
            if not live.wake.is_set():
                await live.wake.wait()

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if self.kv_events is not None:
            self.kv_events.publish()
            self.kv_events.close()
        if self.recorder is not None:
            self.recorder.close()
