"""Build and run one simulation from a SimConfig; write requests/steps/summary/config."""
from __future__ import annotations

import gc
import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import simpy
import yaml

from .config import ConfigError, SimConfig
from .core.kv_manager import KVCacheManager
from .core.request import Request
from .core.scheduler import Scheduler, SchedulerConfig
from .defaults import resolve_defaults
from .engine import ArrivalProcess, EngineReplica, Router, StepArrivals
from .executor import CostModelExecutor
from .memory import check_memory, estimate_run_memory
from .metrics import SUMMARY_STEP_COLUMNS, StepLog, flat_token_times, request_table, summarize
from .results import ResultDir, check_out_dir
from .progress import ProgressTracker, TokenBar, ambient_callback


@dataclass
class SimulationResult:
    summary: dict
    requests: pd.DataFrame
    steps: pd.DataFrame | None
    out_dir: Path | None
    num_gpu_blocks: int
    wall_s: float


def load_workload(cfg: SimConfig):
    from kvsim.traces import load_trace

    opts = cfg.trace_options
    trace = load_trace(cfg.trace, **({"rate": opts.rate, "seed": cfg.seed} if opts.rate else {}))
    if opts.start_s is not None or opts.end_s is not None:
        trace = trace.window(opts.start_s or 0.0, opts.end_s if opts.end_s is not None else float("inf"))
    if opts.rate_scale != 1.0:
        trace = trace.scale_rate(opts.rate_scale)
    if opts.max_requests is not None:
        trace = trace.head(opts.max_requests)
    return trace


def trace_to_requests(trace) -> list[Request]:
    df = trace.df
    ids = df["prefix_hash_ids"].tolist() if "prefix_hash_ids" in df else [None] * len(df)
    prio = df["priority"].tolist() if "priority" in df else [0] * len(df)
    span = getattr(trace, "prefix_block_tokens", None)
    return [
        Request(request_id=int(rid), arrival_time=float(t), prompt_tokens=int(p), max_output_tokens=int(o),
                priority=int(pr) if pr == pr and pr is not None else 0,
                prefix_hash_ids=tuple(int(x) for x in h) if h is not None and len(h) else None,
                prefix_block_tokens=span)
        for rid, t, p, o, h, pr in zip(df["request_id"].tolist(), df["arrival_time_s"].tolist(),
                                       df["prompt_tokens"].tolist(), df["output_tokens"].tolist(), ids, prio)
    ]


def resolve_hardware(cfg: SimConfig, model=None):
    """(model spec, GPU spec, cost model, KV pool blocks, max_model_len); `model` overrides `cfg.model`
    (the real backend passes the spec of the model it actually runs)."""
    from .catalog import get_gpu, get_model
    from .cost_model import CostModel, load_profile
    from .defaults import resolve_engine

    model = get_model(cfg.model) if model is None else model
    if cfg.kv_dtype or cfg.weight_dtype:
        model = model.with_dtypes(kv_dtype=cfg.kv_dtype, weight_dtype=cfg.weight_dtype)
    gpu = get_gpu(cfg.gpu)
    eng = resolve_engine(cfg)
    cost = CostModel(model, gpu, load_profile(cfg.profile), tp=cfg.tp,
                     async_scheduling=bool(eng.async_scheduling))
    if eng.num_gpu_blocks is not None:
        blocks = eng.num_gpu_blocks
    else:
        from .memory import num_gpu_blocks
        blocks = num_gpu_blocks(model, gpu, tp=cfg.tp, block_size=eng.block_size,
                                gpu_memory_utilization=eng.gpu_memory_utilization,
                                max_num_batched_tokens=eng.max_num_batched_tokens,
                                max_num_seqs=eng.max_num_seqs).num_blocks
    max_model_len = eng.max_model_len or model.max_position
    return model, gpu, cost, blocks, max_model_len


def run_simulation(cfg: SimConfig, out_dir: str | Path | None = None, *, progress=False,
                   keep_steps: bool = True, trace=None, wrap_kv=None, model=None) -> SimulationResult:
    """Simulate `cfg` (or the given in-memory `trace` in place of `cfg.trace`). `wrap_kv(kv, executor)`,
    if given, returns the (kv, executor) pair each replica runs with (cross-check and calibration tools
    observe or replace them). `progress`: True for a bar over the tokens computed with an ETA (on
    stderr), or a callable given a `sim.progress.SimProgress` after every engine step, which may raise
    (e.g. `sim.progress.Cancelled`) to stop the run; without it, the callback of an enclosing
    `sim.progress.reporting_to` if any. `model` (a ModelSpec) replaces `cfg.model`'s catalog
    entry (the cross-check simulates the model a replay actually ran).

    Results are staged beside `out_dir` and moved into it at the end (sim/results.py). A run that is
    interrupted (KeyboardInterrupt) or fails still writes what it has, with `partial: true` and
    `partial_reason` in summary.json, then raises again."""
    t0 = time.perf_counter()
    cfg = resolve_defaults(cfg)
    if out_dir:
        check_out_dir(Path(out_dir))
        _check_not_reading_from(cfg, Path(out_dir))
    trace = load_workload(cfg) if trace is None else trace
    model, gpu, cost, num_blocks, max_model_len = resolve_hardware(cfg, model=model)
    check_memory(estimate_run_memory(cfg, model, cost, num_blocks, trace))
    staging = ResultDir(out_dir) if out_dir else None
    try:
        return _simulate(cfg, trace, staging, model, gpu, cost, num_blocks, max_model_len, t0,
                         progress=progress, keep_steps=keep_steps, wrap_kv=wrap_kv)
    finally:
        if staging:
            staging.discard()              # nothing left once published


def _simulate(cfg: SimConfig, trace, staging: ResultDir | None, model, gpu, cost, num_blocks: int,
              max_model_len: int, t0: float, *, progress, keep_steps: bool, wrap_kv) -> SimulationResult:
    requests = trace_to_requests(trace)
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
    for i in range(cfg.replicas):
        kv, executor = _build_kv(cfg, model, cost, num_blocks)
        if wrap_kv is not None:
            kv, executor = wrap_kv(kv, executor)
        scheduler = Scheduler(sched_cfg, kv)
        replicas.append(EngineReplica(
            env, i, scheduler, executor, step_log,
            fast_forward=cfg.fast_forward, check_invariants=cfg.check_invariants,
            next_arrival=(lambda: float("inf")) if by_step else (lambda: arrivals_holder[0].next_arrival()),
            yield_every_step=False, step_arrivals=step_arrivals, on_step=tracker))
    arrivals = None
    if not by_step:
        arrivals = ArrivalProcess(env, requests, Router(replicas, cfg.router))
        arrivals_holder.append(arrivals)
    stop = _drive(env, arrivals, replicas, step_arrivals)
    if tracker:
        tracker.finish()
    step_log.close()

    if stop:                               # requests that never arrived are not part of the result
        if arrivals is not None:
            requests = requests[:arrivals.index]
        else:
            unsent = set(map(id, step_arrivals.pending))
            requests = [r for r in requests if id(r) not in unsent]
    req_df = request_table(requests)
    steps_df = step_log.to_pandas() if keep_steps or out is None else None
    steps_for_summary = steps_df if steps_df is not None else pd.read_parquet(
        out / "steps.parquet", columns=list(SUMMARY_STEP_COLUMNS))
    summary = run_summary(cfg, req_df, steps_for_summary, [r.kv for r in replicas], num_blocks,
                          max_model_len, model, gpu)
    summary["partial"] = stop is not None
    if stop:
        summary["partial_reason"] = stop[0]
        summary["num_trace_requests"] = len(trace)
    wall = time.perf_counter() - t0
    summary["wall_s"] = wall
    if staging:
        write_outputs(out, cfg, req_df, summary)
        staging.publish()
    if stop:
        raise stop[1]
    return SimulationResult(summary, req_df, steps_df, staging.shown if staging else None, num_blocks, wall)


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


def _drive(env: simpy.Environment, arrivals: ArrivalProcess | None, replicas: list[EngineReplica],
           step_arrivals: StepArrivals | None = None):
    """Run the engine to the end; None, or (reason, exception) when it was interrupted or failed."""
    # The engine allocates many small, long-lived objects (token times, step rows) and no reference
    # cycles of note: the cyclic collector would rescan them over and over (~20% of the run).
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        if arrivals is not None:
            env.run(until=arrivals.process)    # all requests submitted
        while any(r.scheduler.has_work for r in replicas) or (step_arrivals and step_arrivals.pending):
            env.step()
    except KeyboardInterrupt as exc:
        return (str(exc) or "interrupted (Ctrl-C)"), exc
    except Exception as exc:  # noqa: BLE001 - written as a partial result, then raised again
        return f"failed: {type(exc).__name__}: {exc}", exc
    finally:
        if gc_was_enabled:
            gc.enable()
    return None


def scheduler_config(cfg: SimConfig, cost, max_model_len: int) -> SchedulerConfig:
    eng = cfg.engine
    return SchedulerConfig(
        max_num_seqs=eng.max_num_seqs, max_num_batched_tokens=eng.max_num_batched_tokens,
        long_prefill_token_threshold=eng.long_prefill_token_threshold, max_model_len=max_model_len,
        enable_chunked_prefill=eng.enable_chunked_prefill, policy=eng.scheduling_policy,
        preemption_mode=eng.preemption_mode, async_scheduling=bool(eng.async_scheduling),
        swap_space_tokens=int(eng.swap_space_gib * 2**30 // max(cost.kv_bytes_per_token, 1)))


def run_summary(cfg: SimConfig, req_df: pd.DataFrame, steps_df: pd.DataFrame, kvs: list, num_blocks: int,
                max_model_len: int, model, gpu) -> dict:
    """summary.json of a run (simulated or replayed) from its request and step tables."""
    # blocks of the pool actually managed (per_head pools count one-head blocks)
    pool_blocks = kvs[0].num_blocks if kvs else num_blocks
    summary = summarize(req_df, steps_df, num_blocks_total=pool_blocks,
                        slo_ttft_s=cfg.slo.ttft_s, slo_tpot_s=cfg.slo.tpot_s,
                        prefix_queries=sum(kv.num_prefix_queries for kv in kvs),
                        prefix_hits=sum(kv.num_prefix_hits for kv in kvs))
    preempted_queries = sum(kv.num_prefix_queries_preempted for kv in kvs)
    preempted_hits = sum(kv.num_prefix_hits_preempted for kv in kvs)
    summary["prefix_hit_rate_preempted"] = preempted_hits / preempted_queries if preempted_queries else 0.0
    if not cfg.kv.is_default:
        from .kv.metrics import kv_summary
        summary.update(kv_summary(kvs, req_df, steps_df))
    summary.update({"num_gpu_blocks": num_blocks, "block_size": cfg.engine.block_size,
                    "max_model_len": max_model_len, "model": model.name, "gpu": gpu.name,
                    "tp": cfg.tp, "replicas": cfg.replicas, "trace": cfg.trace})
    return summary


def write_outputs(out: Path, cfg: SimConfig, req_df: pd.DataFrame, summary: dict) -> None:
    """requests.parquet, summary.json and config.yaml (steps.parquet is written by the StepLog)."""
    pq.write_table(requests_arrow(req_df), out / "requests.parquet", use_dictionary=False)
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=float))
    (out / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))


def requests_arrow(req_df: pd.DataFrame) -> pa.Table:
    """The request table as Arrow; token times become a list<double> column built from one
    concatenated buffer (pandas' object-column conversion of 10^4-10^5 arrays is several x slower)."""
    offsets, values = flat_token_times(req_df["token_times_s"])
    table = pa.Table.from_pandas(req_df.drop(columns="token_times_s"), preserve_index=False)
    lists = pa.ListArray if offsets[-1] < 2**31 else pa.LargeListArray      # int32 offsets while they fit
    offsets = offsets.astype(np.int32) if lists is pa.ListArray else offsets
    return table.append_column("token_times_s", lists.from_arrays(pa.array(offsets), pa.array(values)))


def _build_kv(cfg: SimConfig, model, cost, num_blocks: int):
    """The KV manager and executor of one replica: the plain vLLM path unless `kv:` asks for more."""
    eng = cfg.engine
    if cfg.kv.is_default:
        kv = KVCacheManager(num_blocks, eng.block_size, enable_caching=bool(eng.enable_prefix_caching))
        return kv, CostModelExecutor(cost, kv)
    if eng.enable_prefix_caching:
        raise ConfigError("engine.enable_prefix_caching: not supported with kv.policy/kv.layout other than "
                          "none/shared (evicted tokens break shared prefix blocks)")
    from .kv.build import build_kv
    # like vLLM's pool, one block of the memory is the null block
    return build_kv(cfg.kv, model, cost, num_blocks - 1, eng.block_size, cfg.seed)
