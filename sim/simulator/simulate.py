"""The simulator's driver: build and run one simulation from a SimConfig; write requests/steps/summary/config."""
from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import pandas as pd

from ..results.bench_compare import bench_model_mismatch, compare
from ..engine.assembly import build_engine, load_workload, trace_to_requests
from ..config import ConfigError, SimConfig
from .client import Frontend, client_view, request_jitter, resolve_jitter
from ..model.cost_model import frontend_terms
from .executor import replica_parts
from ..model.memory import check_memory
from ..results.metrics import SPEC_STEP_COLUMNS, SUMMARY_STEP_COLUMNS, StepLog, add_client_queue, class_figures, request_table
from ..results.outputs import managed_pool_blocks, run_summary, write_outputs
from ..io.progress import ProgressTracker, TokenBar, ambient_callback
from ..results.request_log import (WHOLE_STEP_LOG_ROWS, RequestLog, read_request_columns, step_figures_from_file,
                          token_stats_from_file)
from ..io.result_dirs import ResultDir, check_out_dir, check_out_owner
from ..engine.resolved_run import ResolvedRun, resolve_run
from ..engine.step_noise import resolve_sigma

if TYPE_CHECKING:
    from ..model.spec_decode import ResolvedSpec


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
    stderr), or a callable given a `sim.io.progress.SimProgress` after every engine step, which may raise
    (e.g. `sim.io.progress.Cancelled`) to stop the run; without it, the callback of an enclosing
    `sim.io.progress.reporting_to` if any. `model` (a ModelSpec) replaces `cfg.model`'s catalog
    entry (the cross-check simulates the model a replay actually ran). `overwrite`: write into an
    existing non-empty `out_dir` kvsim did not create (sim/io/result_dirs.py).

    Results are staged beside `out_dir` and moved into it at the end (sim/io/result_dirs.py). A run that is
    interrupted (KeyboardInterrupt) or fails still writes what it has, with `partial: true` and
    `partial_reason` in summary.json, then raises again."""
    t0 = time.perf_counter()
    if out_dir:
        check_out_dir(Path(out_dir))
        check_out_owner(Path(out_dir), overwrite=overwrite)
        _check_not_reading_from(cfg.kv.params.get("path") if cfg.kv.policy == "recorded" else None, Path(out_dir))
    trace = load_workload(cfg) if trace is None else trace
    if cfg.fleet is not None:
        return _simulate_fleet(cfg, trace, out_dir, t0, overwrite)
    plan = resolve_run(with_bench_load(cfg, trace), trace=trace, model=model)
    check_memory(plan.memory)
    staging = ResultDir(out_dir, overwrite=overwrite) if out_dir else None
    try:
        return _simulate(plan, trace, staging, t0, RunOptions(progress, keep_steps, wrap_kv))
    finally:
        if staging:
            staging.discard()              # nothing left once published


def _simulate_fleet(cfg: SimConfig, trace, out_dir, t0: float, overwrite: bool) -> SimulationResult:
    """A disaggregated fleet's run (sim/simulator/fleet_run.py): resolved, checked, then staged as any run."""
    # imported here: a single engine's run starts without the fleet modules (bench/bench_startup.py)
    from .fleet_run import checked_plans, run_fleet

    plans = checked_plans(cfg, trace)                 # refused before anything is written
    staging = ResultDir(out_dir, overwrite=overwrite) if out_dir else None
    try:
        return SimulationResult(*run_fleet(cfg, plans, trace, staging, t0))
    finally:
        if staging:
            staging.discard()


class RunOptions(NamedTuple):
    progress: object                   # see run_simulation
    keep_steps: bool
    wrap_kv: object


def _request_frame(client, entry, run, labels: dict | None):
    """The function turning finished requests into requests.parquet rows (the client's view of them)."""
    def frame(reqs: list) -> pd.DataFrame:
        df = client_view(request_table(reqs), client, entry.sent if entry else {},
                         entry.delivered if entry is not None and entry.shared else None)
        if labels is not None:               # the source's own request ids (not integers), beside kvsim's
            df["request_label"] = df["request_id"].map(labels).astype(object)
        if run.limit is not None:
            add_client_queue(df, run.limit.client_arrival)
        if run.sessions is not None:         # multi-turn sessions: each turn's session and its place in it
            df["session"] = df["request_id"].map(run.sessions.session_of).astype("int64")
            df["turn"] = df["request_id"].map(run.sessions.turn_of).astype("int64")
        return df
    return frame


def _frontend_figures(cfg) -> dict:
    """The summary's frontend keys: its name when named, the jitter's sigma when on (unset: none, so
    summary.json stays as it was)."""
    out: dict = {}
    if cfg.frontend is not None:
        out["frontend"] = cfg.frontend
    if cfg.frontend_jitter != 0:
        out["frontend_jitter_sigma"] = resolve_jitter(cfg.frontend_jitter)
    return out


def _entered_requests(trace, entry: Frontend | None, sessions) -> list:
    """The trace's requests, entering the engine through `entry` when the simulation does not send them
    itself. A per-request frontend latency (`frontend_jitter`) can let a later send enter first: the
    arrival process then takes them in entry order (a stable sort: the order is unchanged without it)."""
    requests = trace_to_requests(trace, entry, sessions)
    if entry is not None and entry.jitter is not None:
        requests.sort(key=lambda r: r.arrival_time)
    return requests


def _simulate(plan: ResolvedRun, trace, staging: ResultDir | None, t0: float, opts: RunOptions) -> SimulationResult:
    cfg = plan.cfg
    client = frontend_terms(cfg.frontend_name, plan.cost.profile)
    # requests enter the engine through the frontend (the API server): after their trace time (open
    # loop) or when the closed loop sends them
    entry = Frontend(client, request_jitter(cfg.frontend_jitter, cfg.seed)) if client.enabled else None
    sessions = cfg.trace_options.sessions
    # the closed loops (a concurrency limit, sessions, a shared loop) send their requests through the
    # API server themselves, in the simulation
    online = cfg.trace_options.max_concurrency or sessions or (entry is not None and entry.shared)
    requests = _entered_requests(trace, None if online else entry, sessions)
    class_acceptance = _class_acceptance(plan.spec, trace, requests)
    out = staging.path if staging else None
    step_log = StepLog(out / "steps.parquet" if out else None, keep=SUMMARY_STEP_COLUMNS, keep_rows=WHOLE_STEP_LOG_ROWS,
                       extra_columns=SPEC_STEP_COLUMNS if plan.spec is not None else None)
    progress = opts.progress or ambient_callback()
    replicas: list = []
    tracker = ProgressTracker(requests, replicas, TokenBar() if progress is True else progress) if progress else None

    def parts(index: int):
        kv, executor = replica_parts(plan, index)
        return opts.wrap_kv(kv, executor) if opts.wrap_kv is not None else (kv, executor)

    offload = None if cfg.kv_offload is None else offload_of(plan)
    run = build_engine(plan, requests, step_log, parts, entry=entry, on_step=tracker, step_noise=True,
                       connector=offload)
    replicas.extend(run.replicas)

    frame = _request_frame(client, entry, run, getattr(trace, "request_labels", None))
    # rows go to requests.parquet as requests finish, unless the client view needs all token times at once
    # or the bench comparison the whole table
    streamable = not client.output_token_s > 0 and not trace.measured
    log = RequestLog(requests, out / "requests.parquet" if out else None, frame, stream=streamable)
    schedulers = [r.scheduler for r in replicas]
    stop = run.drive(collect=lambda: log.collect(schedulers))
    if tracker:
        tracker.finish()
    step_log.close()
    log.collect(schedulers)

    if stop:                               # requests that never arrived are not part of the result
        requests = run.arrived(requests)
    req_df = log.finish(requests)
    tokens = None
    if req_df is None:                     # streamed: the summary reads the file
        log.release(replicas)
        req_df = read_request_columns(out / "requests.parquet")
        done = req_df["arrival_s"][req_df["status"] == "finished"]
        tokens = token_stats_from_file(out / "requests.parquet", float(done.min()) if len(done) else 0.0)
    kvs = [r.kv for r in replicas]
    steps_df = step_log.to_pandas() if opts.keep_steps or out is None else None
    if steps_df is not None:
        steps_for_summary = steps_df
    elif step_log.num_rows > WHOLE_STEP_LOG_ROWS:
        steps_for_summary = step_figures_from_file(out / "steps.parquet", managed_pool_blocks(kvs, plan.num_blocks))
    else:                                  # the summary's columns as written (or read back)
        steps_for_summary = step_log.kept()
        if steps_for_summary is None:
            steps_for_summary = pd.read_parquet(out / "steps.parquet", columns=list(SUMMARY_STEP_COLUMNS))
    summary = run_summary(plan, req_df, steps_for_summary, kvs, client.enabled, tokens=tokens,
                          step_variance_sigma=resolve_sigma(cfg.step_variance, plan.gpu.name))
    summary.update(offload_figures(offload))
    summary.update(spec_decode_figures(plan, replicas, step_log if out is None else out / "steps.parquet",
                                       class_acceptance))
    if getattr(trace, "workload_classes", None) is not None:       # a workload spec's client classes
        summary["workload_classes"] = class_figures(trace.workload_classes, req_df)
    summary.update(_frontend_figures(cfg))
    summary["partial"] = stop is not None
    if stop:
        summary["partial_reason"] = stop[0]
        summary["num_trace_requests"] = len(trace)
    comparison = None
    if trace.measured and not stop:
        comparison, summary["bench_comparison"] = compare(trace.measured, req_df, summary)
    wall = time.perf_counter() - t0
    summary["wall_s"] = wall
    if staging:
        write_outputs(out, cfg, None if tokens is not None else req_df, summary)
        write_tier_occupancy(out, offload)
        if comparison is not None:
            comparison.to_parquet(out / "bench_comparison.parquet", index=False)
        published = staging.publish(partial=stop is not None)
    if stop:
        raise stop[1]
    return SimulationResult(summary, req_df, steps_df, published if staging else None, plan.num_blocks, wall)


def _class_acceptance(spec: ResolvedSpec | None, trace, requests: list) -> dict[str, list[float]] | None:
    """Workload classes with measured acceptance (traces/workload.py `spec_acceptance_rates`): their
    requests draw from it (`Request.spec_conditional`, SpecDecoder.accept). Returns class -> rates, or None."""
    classes = getattr(trace, "workload_classes", None)
    acceptance = getattr(classes, "acceptance", None)
    if spec is None or not acceptance:
        return None
    conditional = {name: spec.conditional_for(rates) for name, rates in acceptance.items()}
    for req in requests:
        name = classes.of_request.get(req.request_id)
        if name in conditional:
            req.spec_conditional = conditional[name]
    return {name: list(rates) for name, rates in acceptance.items()}


def spec_decode_figures(plan: ResolvedRun, replicas: list, steps,
                        class_acceptance: dict[str, list[float]] | None = None) -> dict:
    """summary.json's `spec_decode` (nothing with speculative decoding off: summary.json stays as it was);
    with workload classes of measured acceptance, their rates (`workload_class_acceptance_rate_per_pos`)."""
    if plan.spec is None:
        return {}
    figures = spec_decode_summary(plan.spec, [r.scheduler.spec for r in replicas], steps)
    if class_acceptance:
        figures["workload_class_acceptance_rate_per_pos"] = class_acceptance
    return {"spec_decode": figures}


def spec_decode_summary(spec, decoders: list, steps) -> dict:
    """The resolved config, vLLM's counters summed over replicas (and the rates they give), and the
    time the steps spent drafting and verifying (`steps`: the StepLog, or steps.parquet)."""
    counters = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0,
                "num_accepted_tokens_per_pos": [0] * spec.settings.num_speculative_tokens}
    for d in decoders:
        for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
            counters[key] += getattr(d, key)
        counters["num_accepted_tokens_per_pos"] = [a + b for a, b in zip(counters["num_accepted_tokens_per_pos"],
                                                                         d.accepted_per_pos, strict=True)]
    drafts, tokens = counters["num_drafts"], counters["num_draft_tokens"]
    accepted = counters["num_accepted_tokens"]
    cols = ["duration_s", "draft_s", "verify_s"]
    frame = steps.to_pandas(columns=cols) if isinstance(steps, StepLog) else pd.read_parquet(steps, columns=cols)
    busy = float(frame["duration_s"].sum())
    draft_s, verify_s = float(frame["draft_s"].sum()), float(frame["verify_s"].sum())
    out = {**spec.describe(), **counters,
           "acceptance_rate": accepted / tokens if tokens else None,
           "acceptance_rate_per_pos": [a / drafts for a in counters["num_accepted_tokens_per_pos"]] if drafts else None,
           "mean_acceptance_length": 1.0 + accepted / drafts if drafts else None,
           # the same counters under vLLM's Prometheus names (counters; per position: one series per position label)
           "vllm_metrics": {"vllm:spec_decode_num_drafts": drafts, "vllm:spec_decode_num_draft_tokens": tokens,
                            "vllm:spec_decode_num_accepted_tokens": accepted,
                            "vllm:spec_decode_num_accepted_tokens_per_pos": {
                                str(i): a for i, a in enumerate(counters["num_accepted_tokens_per_pos"])}},
           "draft_s": draft_s, "verify_s": verify_s,
           "draft_share": draft_s / busy if busy else None, "verify_share": verify_s / busy if busy else None}
    return out


def offload_of(plan: ResolvedRun):
    """build_engine's connector factory for the run's `kv_offload` section (given)."""
    # imported here (and below): a run without offload starts without the offload tiers' module
    from ..cluster.connectors.offload import (LMCacheCPUWork, cpu_tier_spec, lower_tier_specs, offload_connectors,
                                              offload_unit)

    off = plan.cfg.kv_offload
    lmcache = off.connector == "lmcache"
    work = LMCacheCPUWork(off.lmcache_hash_s_per_token, off.lmcache_put_s_per_chunk) if lmcache else None
    return offload_connectors(cpu_tier_spec(off, plan), offload_unit(off, plan), lower_tier_specs(off, plan),
                              lmcache=work)


def write_tier_occupancy(out: Path, offload) -> None:
    """tiers.parquet, the KV offload tiers' occupancy over time (docs/outputs.md#tiersparquet), with offload."""
    if offload is not None:
        from ..cluster.connectors.offload import tier_occupancy

        tier_occupancy(offload.made).to_parquet(out / "tiers.parquet", index=False)


def offload_figures(offload) -> dict:
    """summary.json's `kv_offload` (nothing without offload)."""
    if offload is None:
        return {}
    from ..cluster.connectors.offload import offload_summary

    return {"kv_offload": offload_summary(offload.made)}


def with_bench_load(cfg: SimConfig, trace) -> SimConfig:
    """A `vllm bench serve` result replayed as a trace runs under the load it was measured with: its
    --max-concurrency unless the config sets one (its send times are already on the trace)."""
    problem = bench_model_mismatch(cfg.model, trace.measured or {})
    if problem:
        warnings.warn(problem, UserWarning, stacklevel=3)
    load = trace.bench_load or {}
    if load.get("max_concurrency") and cfg.trace_options.max_concurrency is None:
        opts = cfg.trace_options.model_copy(update={"max_concurrency": int(load["max_concurrency"])})
        return cfg.model_copy(update={"trace_options": opts})
    return cfg


def _check_not_reading_from(source: str | None, out: Path) -> None:
    """The recorded policy reads a replay's decisions (at `source`): publishing into that directory would
    replace them."""
    if not source:
        return
    source = Path(source)
    folder = source if source.is_dir() else source.parent
    if out.exists() and folder.exists() and folder.resolve() == out.resolve():
        raise ConfigError(f"--out {out}: holds the recorded decisions this run reads (kv.params.path); its "
                          "results would replace them; expected another directory")

