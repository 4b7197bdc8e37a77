"""The simulator's driver: build and run one simulation from a SimConfig; write requests/steps/summary/config."""
from __future__ import annotations

import gc
import time
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import simpy

from .bench_compare import compare
from .assembly import load_workload, resolve_hardware, scheduler_config, trace_to_requests
from .config import ConfigError, SimConfig
from .core.scheduler import Scheduler
from .client import RequestEntry, client_view
from .cost_model import ClientLatency
from .defaults import resolve_defaults
from .engine import ArrivalProcess, ConcurrencyLimit, EngineReplica, Router, StepArrivals
from .executor import replica_executor
from .kv.build import build_kv_manager
from .memory import check_memory, estimate_run_memory
from .metrics import SUMMARY_STEP_COLUMNS, StepLog, add_client_queue, request_table
from .outputs import run_summary, write_outputs
from .progress import ProgressTracker, TokenBar, ambient_callback
from .request_log import (WHOLE_STEP_LOG_ROWS, RequestLog, read_request_columns, step_figures_from_file,
                          token_stats_from_file)
from .results import ResultDir, check_out_dir, check_out_owner


@dataclass
class SimulationResult:
    summary: dict
    requests: pd.DataFrame
    steps: pd.DataFrame | None
    out_dir: Path | None
    num_gpu_blocks: int
    wall_s: float


def run_simulation(cfg: SimConfig, out_dir: str | Path | None = None, *, progress=False,
                   keep_steps: bool = True, trace=None, wrap_kv=None, model=None,
                   overwrite: bool = False) -> SimulationResult:
    """Simulate `cfg` (or the given in-memory `trace` in place of `cfg.trace`). `wrap_kv(kv, executor)`,
    if given, returns the (kv, executor) pair each replica runs with (cross-check and calibration tools
    observe or replace them). `progress`: True for a bar over the tokens computed with an ETA (on
    stderr), or a callable given a `sim.progress.SimProgress` after every engine step, which may raise
    (e.g. `sim.progress.Cancelled`) to stop the run; without it, the callback of an enclosing
    `sim.progress.reporting_to` if any. `model` (a ModelSpec) replaces `cfg.model`'s catalog
    entry (the cross-check simulates the model a replay actually ran). `overwrite`: write into an
    existing non-empty `out_dir` kvsim did not create (sim/results.py).

    Results are staged beside `out_dir` and moved into it at the end (sim/results.py). A run that is
    interrupted (KeyboardInterrupt) or fails still writes what it has, with `partial: true` and
    `partial_reason` in summary.json, then raises again."""
    t0 = time.perf_counter()
    cfg = resolve_defaults(cfg)
    if out_dir:
        check_out_dir(Path(out_dir))
        check_out_owner(Path(out_dir), overwrite=overwrite)
        _check_not_reading_from(cfg, Path(out_dir))
    trace = load_workload(cfg) if trace is None else trace
    cfg = with_bench_load(cfg, trace)
    model, gpu, cost, num_blocks, max_model_len = resolve_hardware(cfg, model=model)
    check_memory(estimate_run_memory(cfg, model, cost, num_blocks, trace))
    staging = ResultDir(out_dir, overwrite=overwrite) if out_dir else None
    try:
        return _simulate(cfg, trace, staging, model, gpu, cost, num_blocks, max_model_len, t0,
                         progress=progress, keep_steps=keep_steps, wrap_kv=wrap_kv)
    finally:
        if staging:
            staging.discard()              # nothing left once published


def _simulate(cfg: SimConfig, trace, staging: ResultDir | None, model, gpu, cost, num_blocks: int,
              max_model_len: int, t0: float, *, progress, keep_steps: bool, wrap_kv) -> SimulationResult:
    client = cost.profile.client if cfg.client_latency else ClientLatency()
    # requests enter the engine through the client-side API server: at their trace time (open loop) or
    # when the closed loop sends them
    entry = RequestEntry(client) if client.enabled else None
    requests = trace_to_requests(trace, None if cfg.trace_options.max_concurrency else entry)
    out = staging.path if staging else None
    step_log = StepLog(out / "steps.parquet" if out else None)
    sched_cfg = scheduler_config(cfg, cost, max_model_len)

    env = simpy.Environment()
    replicas: list[EngineReplica] = []
    progress = progress or ambient_callback()
    tracker = ProgressTracker(requests, replicas, TokenBar() if progress is True else progress) if progress else None
    arrivals_holder: list[ArrivalProcess] = []
    by_step = cfg.trace_options.arrival_unit == "step"
    if by_step and cfg.replicas != 1:
        raise ConfigError(f"trace_options.arrival_unit: step feeds one engine step by step; replicas must be 1, "
                          f"got {cfg.replicas}")
    step_arrivals = StepArrivals(requests) if by_step else None
    limit_n = cfg.trace_options.max_concurrency
    limit_holder: list[ConcurrencyLimit] = []
    # a closed loop lets one replica's finish send a request to another: with several replicas each
    # one must stop at every step end for it to land in time (no decode fast-forward across it)
    cross_replica = limit_n is not None and cfg.replicas > 1
    for i in range(cfg.replicas):
        kv = build_kv_manager(cfg, model, cost, num_blocks)
        executor = replica_executor(cfg, cost, kv)
        if wrap_kv is not None:
            kv, executor = wrap_kv(kv, executor)
        scheduler = Scheduler(sched_cfg, kv)
        replicas.append(EngineReplica(
            env, i, scheduler, executor, step_log,
            fast_forward=cfg.fast_forward and not cross_replica, check_invariants=cfg.check_invariants,
            next_arrival=(lambda: float("inf")) if by_step else (lambda: arrivals_holder[0].next_arrival()),
            yield_every_step=cross_replica, step_arrivals=step_arrivals, on_step=tracker,
            on_done=None if limit_n is None else (lambda n, t: limit_holder[0].done(n, t))))
    arrivals = None
    limit = None
    if not by_step:
        router = Router(replicas, cfg.router)
        limit = ConcurrencyLimit(limit_n, router, env, entry) if limit_n is not None else None
        limit_holder.append(limit)
        arrivals = ArrivalProcess(env, requests, router, limit)
        arrivals_holder.append(arrivals)

    def frame(reqs: list) -> pd.DataFrame:
        df = client_view(request_table(reqs), client, entry.sent if entry else {})
        if limit is not None:
            add_client_queue(df, limit.client_arrival)
        return df
    # rows go to requests.parquet as requests finish, unless the client view needs all token times at once
    # or the bench comparison the whole table
    streamable = not client.output_token_s > 0 and not getattr(trace, "measured", None)
    log = RequestLog(requests, out / "requests.parquet" if out else None, frame, stream=streamable)
    schedulers = [r.scheduler for r in replicas]
    stop = _drive(env, arrivals, replicas, step_arrivals, limit, collect=lambda: log.collect(schedulers))
    if tracker:
        tracker.finish()
    step_log.close()
    log.collect(schedulers)

    if stop:                               # requests that never arrived are not part of the result
        if arrivals is not None:
            unsent = set(map(id, limit.queue)) if limit is not None else set()
            requests = [r for r in requests[:arrivals.index] if id(r) not in unsent]
        else:
            unsent = set(map(id, step_arrivals.pending))
            requests = [r for r in requests if id(r) not in unsent]
    req_df = log.finish(requests)
    tokens = None
    if req_df is None:                     # streamed: the summary reads the file
        log.release(replicas)
        req_df = read_request_columns(out / "requests.parquet")
        done = req_df["arrival_s"][req_df["status"] == "finished"]
        tokens = token_stats_from_file(out / "requests.parquet", float(done.min()) if len(done) else 0.0)
    steps_df = step_log.to_pandas() if keep_steps or out is None else None
    if steps_df is not None:
        steps_for_summary = steps_df
    elif step_log.num_rows > WHOLE_STEP_LOG_ROWS:
        steps_for_summary = step_figures_from_file(out / "steps.parquet", _pool_blocks(replicas, num_blocks))
    else:
        steps_for_summary = pd.read_parquet(out / "steps.parquet", columns=list(SUMMARY_STEP_COLUMNS))
    summary = run_summary(cfg, req_df, steps_for_summary, [r.kv for r in replicas], num_blocks,
                          max_model_len, model, gpu, cost.profile, client.enabled, tokens=tokens)
    summary["partial"] = stop is not None
    if stop:
        summary["partial_reason"] = stop[0]
        summary["num_trace_requests"] = len(trace)
    comparison = None
    if getattr(trace, "measured", None) and not stop:
        comparison, summary["bench_comparison"] = compare(trace.measured, req_df, summary)
    wall = time.perf_counter() - t0
    summary["wall_s"] = wall
    if staging:
        write_outputs(out, cfg, None if tokens is not None else req_df, summary)
        if comparison is not None:
            comparison.to_parquet(out / "bench_comparison.parquet", index=False)
        staging.publish()
    if stop:
        raise stop[1]
    return SimulationResult(summary, req_df, steps_df, staging.shown if staging else None, num_blocks, wall)


def with_bench_load(cfg: SimConfig, trace) -> SimConfig:
    """A `vllm bench serve` result replayed as a trace runs under the load it was measured with: its
    --max-concurrency unless the config sets one (its send times are already on the trace)."""
    load = getattr(trace, "bench_load", None) or {}
    if load.get("max_concurrency") and cfg.trace_options.max_concurrency is None:
        opts = cfg.trace_options.model_copy(update={"max_concurrency": int(load["max_concurrency"])})
        return cfg.model_copy(update={"trace_options": opts})
    return cfg


def _check_not_reading_from(cfg: SimConfig, out: Path) -> None:
    """The recorded policy reads a replay's decisions: publishing into that directory would replace them."""
    source = cfg.kv.params.get("path") if cfg.kv.policy == "recorded" else None
    if not source:
        return
    source = Path(source)
    folder = source if source.is_dir() else source.parent
    if out.exists() and folder.exists() and folder.resolve() == out.resolve():
        raise ConfigError(f"--out {out}: holds the recorded decisions this run reads (kv.params.path); its "
                          "results would replace them; expected another directory")


def _pool_blocks(replicas: list[EngineReplica], num_blocks: int) -> int:
    """Blocks of the pool actually managed (as sim.outputs.run_summary counts them)."""
    return replicas[0].kv.num_blocks if replicas else num_blocks


COLLECT_EVERY = 1024          # simpy events between two collections of finished requests


def _drive(env: simpy.Environment, arrivals: ArrivalProcess | None, replicas: list[EngineReplica],
           step_arrivals: StepArrivals | None = None, limit: ConcurrencyLimit | None = None,
           collect=lambda: None):
    """Run the engine to the end, calling `collect` every COLLECT_EVERY events; None, or (reason,
    exception) when it was interrupted or failed."""
    # The engine allocates many small, long-lived objects (token times, step rows) and no reference
    # cycles of note: the cyclic collector would rescan them over and over (~20% of the run).
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        events = 0
        if arrivals is not None:
            submitted = arrivals.process       # as env.run(until=it): stepping until it is processed
            while not submitted.processed:
                env.step()
                events += 1
                if events % COLLECT_EVERY == 0:
                    collect()
        while (any(r.scheduler.has_work for r in replicas) or (step_arrivals and step_arrivals.pending)
               or (limit is not None and limit.in_transit)):
            env.step()
            events += 1
            if events % COLLECT_EVERY == 0:
                collect()
        if limit is not None and limit.pending:
            raise RuntimeError(f"{limit.pending} requests still wait for a concurrency slot with no request "
                               "in flight")
    except KeyboardInterrupt as exc:
        return (str(exc) or "interrupted (Ctrl-C)"), exc
    except Exception as exc:  # noqa: BLE001 - written as a partial result, then raised again
        return f"failed: {type(exc).__name__}: {exc}", exc
    finally:
        if gc_was_enabled:
            gc.enable()
    return None
