"""Assemble a run's engine core: its workload and requests, the scheduler's settings, and the engine
(replicas, router, arrivals, client-side concurrency limit) built from a resolved run (sim/engine/resolved_run.py).

Shared by the two executors' drivers: the simulator (`sim.simulator.simulate`) and the real backend's replay
(`gpu.replay`) both call `build_engine` and `EngineRun.drive`; each passes its own replica parts
(a KV manager from `sim.engine.resolved_run.build_kv_manager` and its executor).
"""
from __future__ import annotations

import gc
import math
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING
from collections.abc import Callable

from kvsim.traces import TraceWarning, load_trace
from kvsim.traces.arrivals import vllm_bench_arrivals
from kvsim.traces.loaders import detect_format, resolve_trace_path
from kvsim.traces.sessions import num_sessions, sharegpt_sessions, synthetic_sessions, with_session_starts
from kvsim.traces.synthetic import vllm_random_dataset

from ..config import (RANDOM_DEFAULT_NUM_PROMPTS, RANDOM_TRACE, SESSIONS_TRACE, ConfigError, RandomDataset, SimConfig,
                      SyntheticSessions)
from ..core.request import Request
from ..core.connector import KVConnector
from ..core.protocols import Executor, KVManager
from ..core.scheduler import Scheduler, SchedulerConfig
from ..core.spec_decode import SpecDecoder
from .loop import (ArrivalProcess, ClientTimeout, ConcurrencyLimit, DPGroup, EngineClock, EngineReplica, ReplicaFeed,
                   LazyRouting, ReplicaOptions, RoutedAhead, Router, StepArrivals)
from .routers import routes_ahead
from ..model.parallel import DPAttentionPricing
from ..results.metrics import StepLog
from .sessions import SessionLoop, apply_sessions
from .step_noise import StepNoise, resolve_sigma

if TYPE_CHECKING:
    from .resolved_run import ResolvedRun


def load_workload(cfg: SimConfig):
    """The trace of `cfg` with its trace options (rate, window, rate scale, first N requests) applied."""
    opts = cfg.trace_options
    # without a time window the first N requests are the file's first N (only those rows are read)
    first = opts.max_requests if opts.start_s is None and opts.end_s is None else None
    if cfg.trace == RANDOM_TRACE:
        trace = random_dataset(cfg)
    elif cfg.trace == SESSIONS_TRACE:
        trace = synthetic_sessions_of(cfg)
        if opts.sessions is None:
            warnings.warn(f"trace: {SESSIONS_TRACE} without sessions (--sessions): its turns arrive at their trace "
                          "times as independent requests, sharing no blocks; --sessions runs each session as a "
                          "closed loop", TraceWarning, stacklevel=2)
    elif opts.sessions is not None and _is_sharegpt(cfg):     # whole conversations, a turn per answer
        trace = sharegpt_sessions(resolve_trace_path(cfg.trace)[0], tokenizer=opts.tokenizer, seed=cfg.seed)
    else:
        trace = load_trace(cfg.trace, max_rows=first, **({"rate": opts.rate} if opts.rate else {}), seed=cfg.seed,
                           **opts.file_options())
    if opts.start_s is not None or opts.end_s is not None:
        trace = _window(trace, opts.start_s or 0.0, opts.end_s if opts.end_s is not None else float("inf"))
    if opts.max_requests is not None:
        trace = trace.head(opts.max_requests)
    if opts.request_rate is not None and opts.sessions is not None:
        trace = with_session_rate(trace, opts.request_rate, opts.burstiness, cfg.seed)
    elif opts.request_rate is not None:
        trace = with_request_rate(trace, opts.request_rate, opts.burstiness, cfg.seed)
    elif opts.max_concurrency is None and opts.sessions is None and opts.rate is None and opts.arrival_unit == "time" \
            and len(trace) > 1 and not _has_arrival_times(trace):
        warnings.warn(f"all {len(trace)} requests arrive at t=0 (the trace has no arrival times): one batch, as "
                      "vllm bench serve's default --request-rate inf; --request-rate or --max-concurrency give "
                      "another load", TraceWarning, stacklevel=2)
    if opts.rate_scale != 1.0:
        trace = trace.scale_rate(opts.rate_scale)
    return trace


def random_dataset(cfg: SimConfig):
    """`trace: random`: vllm bench serve's random dataset, max_requests (--num-prompts) requests (default 1000)."""
    opts = cfg.trace_options
    if opts.format or opts.tokenizer or opts.rate:
        raise ConfigError(f"trace: {RANDOM_TRACE} is vllm bench serve's random dataset (no file): trace_options.format, "
                          "tokenizer and rate do not apply (use request_rate for its arrivals)")
    spec = opts.random or RandomDataset()
    n = opts.max_requests or RANDOM_DEFAULT_NUM_PROMPTS
    return vllm_random_dataset(n, input_len=spec.input_len, output_len=spec.output_len,
                               range_ratio=spec.range_ratio, prefix_len=spec.prefix_len, seed=cfg.seed)


def synthetic_sessions_of(cfg: SimConfig):
    """`trace: synthetic-sessions`: seeded multi-turn sessions (traces/sessions.py) of
    `trace_options.synthetic_sessions` (its defaults when absent), the run's seed."""
    opts = cfg.trace_options
    if opts.format or opts.tokenizer or opts.rate:
        raise ConfigError(f"trace: {SESSIONS_TRACE} is generated (no file): trace_options.format, tokenizer and rate "
                          "do not apply (trace_options.synthetic_sessions.session_rate sets when sessions start)")
    spec = opts.synthetic_sessions or SyntheticSessions()
    return synthetic_sessions(spec.sessions, turns=spec.turns, first_tokens=spec.first_tokens,
                              user_tokens=spec.user_tokens, output_tokens=spec.output_tokens,
                              think_time_s=spec.think_time_s, session_rate=spec.session_rate, seed=cfg.seed)


def _is_sharegpt(cfg: SimConfig) -> bool:
    if cfg.trace_options.format is not None:
        return cfg.trace_options.format == "sharegpt"
    return detect_format(resolve_trace_path(cfg.trace)[0]) == "sharegpt"


def with_session_rate(trace, request_rate: float, burstiness: float, seed: int):
    """Sessions started as `vllm bench serve --request-rate --burstiness` sends requests (each session's
    turns keep their gaps): for session traces whose sessions all start at t=0 (ShareGPT conversations)."""
    first = trace.df.drop_duplicates("session_id")["arrival_time_s"].to_numpy()
    if len(first) > 1 and first.max() > first.min():
        raise ConfigError(f"trace_options.request_rate: the sessions of {trace.name or trace.source!r} have their own "
                          "start times; request_rate applies to sessions that all start at t=0 (ShareGPT)")
    n = num_sessions(trace)
    return with_session_starts(trace, vllm_bench_arrivals(n, request_rate, burstiness, seed))


def _window(trace, start_s: float, end_s: float):
    """The requests arriving in [start_s, end_s); an empty window is refused (a run of nothing is no answer)."""
    if len(trace) and end_s <= start_s:
        raise ConfigError(f"trace_options.end_s ({end_s:g}) must be greater than trace_options.start_s ({start_s:g})")
    last = float(trace.df["arrival_time_s"].max()) if len(trace) else 0.0
    window = trace.window(start_s, end_s)
    if not len(window):
        raise ConfigError(f"trace_options.start_s/end_s: no request of {trace.name or trace.source!r} arrives in "
                          f"[{start_s:g}, {end_s:g}) s; its arrivals span 0 to {last:g} s")
    return window


def with_request_rate(trace, request_rate: float, burstiness: float, seed: int):
    """`trace`'s requests sent as `vllm bench serve --request-rate --burstiness` sends them. Only for a
    trace without arrival times of its own (every request at t=0: length-only files, ShareGPT)."""
    if _has_arrival_times(trace):
        raise ConfigError(f"trace_options.request_rate: the trace {trace.name or trace.source!r} has its own "
                          "arrival times; request_rate applies to traces without them (length-only, ShareGPT); "
                          "use rate_scale (--rate-scale) to speed this one up")
    return trace.with_arrivals(vllm_bench_arrivals(len(trace), request_rate, burstiness, seed))


def _has_arrival_times(trace) -> bool:
    arrivals = trace.df["arrival_time_s"].to_numpy()
    return len(arrivals) > 0 and arrivals.max() > arrivals.min()


def trace_to_requests(trace, entry=None, sessions=None) -> list[Request]:
    """The trace's requests; with `entry` (sim.simulator.client.Frontend) each enters the engine when the
    client-side API server lets it, after its arrival (the client's send). `sessions` (trace_options.sessions):
    each request gets its session and its conversation's prefix ids (sim/engine/sessions.py)."""
    requests = _requests(trace, entry)
    if sessions is not None:
        apply_sessions(trace, requests, sessions)
    return requests


def _requests(trace, entry) -> list[Request]:
    df = trace.df
    ids = df["prefix_hash_ids"].tolist() if "prefix_hash_ids" in df else [None] * len(df)
    prio = df["priority"].tolist() if "priority" in df else [0] * len(df)
    span = trace.prefix_block_tokens
    return [
        Request(request_id=int(rid), arrival_time=float(t) if entry is None else entry.enter(int(rid), float(t), int(p)),
                prompt_tokens=int(p), max_output_tokens=int(o),
                priority=int(pr) if pr == pr and pr is not None else 0,
                prefix_hash_ids=tuple(int(x) for x in h) if h is not None and len(h) else None,
                prefix_block_tokens=span)
        for rid, t, p, o, h, pr in zip(df["request_id"].tolist(), df["arrival_time_s"].tolist(),
                                       df["prompt_tokens"].tolist(), df["output_tokens"].tolist(), ids, prio, strict=False)
    ]


def scheduler_config(cfg: SimConfig, cost, max_model_len: int) -> SchedulerConfig:
    eng = cfg.engine
    return SchedulerConfig(
        # pipeline parallelism: a step is a round of pp in-flight batches, each with its own token budget
        max_num_seqs=eng.max_num_seqs, max_num_batched_tokens=eng.max_num_batched_tokens * cfg.pp,
        long_prefill_token_threshold=eng.long_prefill_token_threshold, max_model_len=max_model_len,
        enable_chunked_prefill=eng.enable_chunked_prefill, policy=eng.scheduling_policy,
        preemption_mode=eng.preemption_mode, async_scheduling=bool(eng.async_scheduling),
        swap_space_tokens=int(eng.swap_space_gib * 2**30 // max(cost.kv_bytes_per_token, 1)))


COLLECT_EVERY = 1024          # simpy events between two collections of finished requests,
COLLECT_STEPS = 8192          # or engine steps (a decode run takes thousands of steps in one event)


@dataclass
class EngineRun:
    """A run's engine: its replicas and what feeds them (trace-time arrivals through the router and
    an optional client-side concurrency limit, or arrivals by engine step)."""
    env: EngineClock
    replicas: list[EngineReplica]
    arrivals: ArrivalProcess | None
    limit: ConcurrencyLimit | None
    step_arrivals: StepArrivals | None
    router: Router | None = None
    sessions: SessionLoop | None = None

    def drive(self, catch: tuple[type[BaseException], ...] = (KeyboardInterrupt, Exception),
              collect: Callable[[], None] = lambda: None):
        """Run the engine to the end, calling `collect` every COLLECT_EVERY simpy events or COLLECT_STEPS
        engine steps; None, or
        (reason, exception) when it was interrupted or failed with one of `catch` (the driver writes
        a partial result)."""
        # The engine allocates many small, long-lived objects (token times, step rows) and no reference
        # cycles of note: the cyclic collector would rescan them over and over (~20% of the run).
        gc_was_enabled = gc.isenabled()
        gc.disable()
        try:
            self._run(collect)
        except catch as exc:
            if isinstance(exc, KeyboardInterrupt):
                return (str(exc) or "interrupted (Ctrl-C)"), exc
            return f"failed: {type(exc).__name__}: {exc}", exc
        finally:
            if gc_was_enabled:
                gc.enable()
        return None

    def _run(self, collect: Callable[[], None]) -> None:
        env, limit = self.env, self.limit
        # as env.run(until=the arrival process) and then on while any work is left
        submitted = self.arrivals.process if self.arrivals is not None else None
        events = collected_at = 0
        while (submitted is not None and not submitted.processed) or self._has_work():
            env.step()
            events += 1
            steps = env.steps                       # sum(r.num_steps for r in self.replicas)
            if events % COLLECT_EVERY == 0 or steps - collected_at >= COLLECT_STEPS:
                collect()
                collected_at = steps
        if limit is not None and limit.pending:
            raise RuntimeError(f"{limit.pending} requests still wait for a concurrency slot with no request "
                               "in flight")

    def _has_work(self) -> bool:
        step_arrivals, limit = self.step_arrivals, self.limit
        return (any(r.scheduler.has_work or r.scheduler.awaiting_transfers for r in self.replicas)
                or bool(step_arrivals and step_arrivals.pending)
                or (limit is not None and (bool(limit.in_transit) or limit.releasing > 0))
                or (self.sessions is not None and self.sessions.in_transit))

    def arrived(self, requests: list[Request]) -> list[Request]:
        """Of `requests`, those that reached the engine (all of them once the run ended)."""
        if self.arrivals is not None:
            unsent = set(map(id, self.limit.queue)) if self.limit is not None else set()
            if self.sessions is not None:           # first turns as they arrived, later turns as released
                sent = set(map(id, self.arrivals.requests[:self.arrivals.index] + self.sessions.released))
                return [r for r in requests if id(r) in sent and id(r) not in unsent]
            return [r for r in requests[:self.arrivals.index] if id(r) not in unsent]
        unsent = set(map(id, self.step_arrivals.pending))
        return [r for r in requests if id(r) not in unsent]


def build_engine(plan: ResolvedRun, requests: list[Request], step_log: StepLog,
                 replica_parts: Callable[[int], tuple[KVManager, Executor]], *, entry=None,
                 on_step: Callable[[int], None] | None = None, step_noise: bool = False,
                 connector: Callable[[int, EngineClock], KVConnector] | None = None) -> EngineRun:
    """The engine of `plan` over `requests`: `plan.cfg.replicas` replicas, each running the KV manager
    and executor `replica_parts(index)` returns, logging steps into `step_log`. `entry` (sim.simulator.client.
    Frontend) delays requests sent by the concurrency limit until the API server lets them in.
    `step_noise`: the simulator's step-time variance (`step_variance`, sim/engine/step_noise.py) applies (a
    real backend's steps take the time they take). `connector(index, clock)`: each replica's KV connector
    (CPU offload: sim.cluster); None: none."""
    cfg = plan.cfg
    env = EngineClock()
    by_step = cfg.trace_options.arrival_unit == "step"
    ranks = cfg.engine_ranks             # replicas, x dp data-parallel attention ranks each
    if by_step and ranks != 1:
        raise ConfigError(f"trace_options.arrival_unit: step feeds one engine step by step; replicas (and dp) must "
                          f"be 1, got {ranks}")
    step_arrivals = StepArrivals(requests) if by_step else None
    limit_n = cfg.trace_options.max_concurrency
    # a frontend whose API server takes entries and streams outputs on one loop (Frontend.shared): every
    # request enters through it in the simulation (the open loop too: a limit of no limit), each step's
    # tokens are told to it at the step's end, and no decode run skips a step end it must hear of
    shared = entry is not None and entry.shared
    sends = limit_n if limit_n is not None else (math.inf if shared else None)
    feed: list = []            # the arrival process and the limit, made once the replicas exist
    sessions = None
    if cfg.trace_options.sessions is not None:        # a closed loop per session (sim/engine/sessions.py)
        sessions = SessionLoop(env, requests, cfg.trace_options.sessions, entry if sends is None else None)
    closed = sends is not None or sessions is not None
    # a closed loop lets one replica's finish send a request to another: with several replicas each
    # one must stop at every step end for it to land in time (no decode fast-forward across it)
    cross_replica = closed and ranks > 1
    # one replica fed by the trace alone may admit its arrivals inside decode runs
    own_arrivals = (lambda: feed[0]) if ranks == 1 and not closed and not by_step else None
    next_arrival = ((lambda: min(feed[0].next_arrival(), sessions.next_release())) if sessions is not None
                    else (lambda: feed[0].next_arrival()))
    # a fleet on an open loop whose router reads no replica state (round-robin) is routed ahead: each
    # replica's next arrival is its own (sim.engine.loop.RoutedAhead), not the fleet's next one
    # (not data-parallel ranks: they step in lockstep, each step waiting for the group's)
    ahead: list = ([] if cfg.replicas > 1 and cfg.dp == 1 and not closed and not by_step and routes_ahead(cfg.router)
                   else None)
    # one whose router reads replica state reads it lazily (sim.engine.loop.LazyRouting): each replica's decode
    # runs go on past the fleet's arrivals until the router reads it or sends it a request
    replicas: list[EngineReplica] = []
    lazy = (LazyRouting(None, replicas, requests) if ahead is None and reads_lazily(cfg.replicas, cfg.dp, cfg.fast_forward) and not closed and not by_step
            else None)
    timeout = client_timeout(cfg.trace_options.request_timeout, entry)
    sigma = resolve_sigma(cfg.step_variance, plan.gpu.name) if step_noise else 0.0
    noises = [replica_noise(sigma, cfg.seed, i) for i in range(ranks)]
    grouped = cfg.dp > 1
    for i in range(ranks):
        kv, executor = replica_parts(i)
        replicas.append(EngineReplica(
            env, i, Scheduler(plan.scheduler, kv, connector(i, env) if connector else None,
                              SpecDecoder(plan.spec.settings, cfg.seed, i) if plan.spec is not None else None),
            executor, step_log,
            ReplicaOptions(fast_forward=cfg.fast_forward and not cross_replica and not shared and not grouped,
                           check_invariants=cfg.check_invariants,
                           step_noise=noises[i], grouped=grouped),
            ReplicaFeed(next_arrival=(lambda: float("inf")) if by_step else
                        (lambda i=i: ahead[0].next_arrival(i)) if ahead is not None else next_arrival,
                        step_arrivals=step_arrivals, on_step=on_step,
                        on_done=None if sends is None else (lambda n, t: feed[1].done(n, t)),
                        arrivals=own_arrivals, timeout=timeout, on_tokens=entry.outputs if shared else None,
                        on_finished=None if sessions is None else sessions.finished, lazy=lazy)))
    if grouped:
        group_ranks(env, plan, replicas)
    if by_step:
        return EngineRun(env, replicas, None, None, step_arrivals)
    router = Router(replicas, cfg.router, cfg.router_options)
    limit = ConcurrencyLimit(sends, router, env, entry) if sends is not None else None
    if sessions is not None:        # later turns go out as their predecessors finish: through the limit if any
        sessions.send = limit.arrive if limit is not None else (lambda req, now: router.route(req).submit(req))
    if ahead is not None:
        ahead.append(RoutedAhead(requests, router, replicas))
    if lazy is not None:
        lazy.router = router
    arrivals = ArrivalProcess(env, requests if sessions is None else sessions.first_turns,
                              router if ahead is None and lazy is None else ahead[0] if ahead is not None else lazy,
                              limit)
    if lazy is not None:
        lazy.attach(arrivals)
    feed.extend((arrivals, limit))
    return EngineRun(env, replicas, arrivals, limit, None, router, sessions)


def reads_lazily(replicas: int, dp: int, fast_forward: bool) -> bool:
    """Whether a fleet reads its replicas' state lazily (sim.engine.loop.LazyRouting): several replicas, no
    data-parallel ranks, decode fast-forward on (the lazy part is a planned decode run)."""
    return replicas > 1 and dp == 1 and fast_forward


def group_ranks(env: EngineClock, plan: ResolvedRun, replicas: list[EngineReplica]) -> list[DPGroup]:
    """With data-parallel attention (dp > 1), each replica's dp consecutive engine ranks step together
    (sim/engine/loop.py DPGroup) at the synchronised step time of sim/model/parallel.py."""
    dp = plan.cfg.dp
    if dp == 1:
        return []
    pricing = DPAttentionPricing(plan.cost, dp)
    return [DPGroup(env, replicas[i:i + dp], pricing) for i in range(0, len(replicas), dp)]


def replica_noise(sigma: float, seed: int, index: int) -> StepNoise | None:
    """Replica `index`'s step-time factors of lognormal `sigma` (the run's `step_variance` resolved once),
    or None in the deterministic mode (sigma 0)."""
    return StepNoise(sigma, seed, index) if sigma > 0 else None


def client_timeout(timeout_s: float | None, entry=None) -> ClientTimeout | None:
    """The client's timeout (`trace_options.request_timeout`), counted from each request's send: its
    trace time, or when the closed loop or the API server's entry (sim.simulator.client.Frontend) sent it."""
    if timeout_s is None:
        return None
    if entry is None:
        return ClientTimeout(timeout_s, lambda req: req.arrival_time)
    sent = entry.sent
    return ClientTimeout(timeout_s, lambda req: sent.get(req.request_id, req.arrival_time))


def build_live_engine(plan: ResolvedRun, requests: list[Request], step_log: StepLog,
                      replica_parts: Callable[[int], tuple[KVManager, Executor]],
                      live_arrival: Callable[[], float]) -> EngineRun:
    """The engine of `plan` fed live (`kvsim serve`): requests not known in advance. `live_arrival` returns the
    earliest time the next one can reach the engine (a lower bound keeps decode runs exact: a run only takes
    steps that start before it). The caller submits each request through the run's router at its arrival
    time and watches the engine with `env.step()` (an event at every step end)."""
    cfg = plan.cfg
    if requests or cfg.trace_options.arrival_unit == "step" or cfg.trace_options.max_concurrency is not None:
        raise ConfigError("a live engine takes its requests as they come: no trace requests, arrival_unit time "
                          "and no max_concurrency")
    env = EngineClock(event_per_step=True)
    replicas = []
    for i in range(cfg.engine_ranks):
        kv, executor = replica_parts(i)
        replicas.append(EngineReplica(
            env, i, Scheduler(plan.scheduler, kv), executor, step_log,
            ReplicaOptions(fast_forward=cfg.fast_forward and cfg.dp == 1, check_invariants=cfg.check_invariants,
                           grouped=cfg.dp > 1),
            ReplicaFeed(next_arrival=live_arrival)))
    group_ranks(env, plan, replicas)
    return EngineRun(env, replicas, None, None, None, Router(replicas, cfg.router, cfg.router_options))
