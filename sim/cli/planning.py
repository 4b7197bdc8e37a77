"""`kvsim sweep`, `kvsim capacity`, `kvsim report`: capacity-planning commands on the simulator."""
from __future__ import annotations


import math
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from kvsim.sim.config import ConfigError, build_config, load_config
from kvsim.traces.errors import TraceError

from .options import (KvOffload, RouterName, Sessions, SpeculativeConfigOpt, ThinkTime, parse_speculative_config,
                      tier_overrides)
from .options import (BlockSize, ConfigFile, Gpu, MaxNumBatchedTokens, MaxNumSeqs, MaxRequests, Model, NumGpuBlocks, Overwrite,
                      Sets, Tp, Trace, UsdPerHour, config_overrides, fail, output_path, table_console)

console = table_console()
err_console = Console(stderr=True)

Window = Annotated[str | None, typer.Option(help="the part of the trace to plan on: DUR@peak (its busiest DUR), "
                                               "DUR@peakK (K-th busiest), START:END, full; default: the whole trace "
                                               "up to 4,000 requests, else its busiest window of ~2,500")]
Repeats = Annotated[int, typer.Option(help="samples for the range: the answer plus the next busiest windows (peak "
                                           "windows) or arrival seeds (length-only traces); 1: none")]
Band = Annotated[bool, typer.Option("--band/--no-band", help="search again with step times x(1 +/- the GPU "
                                                             "profile's measured MAPE) for the range")]


def sweep(
    spec: Path = typer.Argument(..., help="sweep spec YAML (base / fixed / grid / runs / save_outputs)"),
    out: Path = typer.Option(..., "--out", "-o", parser=output_path(), help="results store directory (created; re-runs resume)"),
    executor: str = typer.Option("local", help="local (process pool) | dask (distributed cluster)"),
    scheduler: str | None = typer.Option(None, help="Dask scheduler address, e.g. tcp://host:8786"),
    jobs: int | None = typer.Option(None, "--jobs", "-j", help="local worker processes (default: all cores)"),
    max_runs: int | None = typer.Option(None, help="run at most N pending runs, then stop"),
    retry_failed: bool = typer.Option(False, "--retry-failed", help="run again the runs recorded as failed"),
    save_outputs: bool | None = typer.Option(None, "--save-outputs/--no-save-outputs",
                                                help="keep each run's requests/steps (default: the spec's)"),
    dry_run: bool = typer.Option(False, "--dry-run", help="validate and list the runs, run nothing"),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="no progress bar"),
    overwrite: Overwrite = False,
) -> None:
    """Run every configuration of a sweep spec; one row per run (config + summary metrics + cost)
    in OUT/runs/*.parquet. Re-running skips finished runs; a failed run is recorded and skipped."""
    from kvsim.sim.planning.sweep import SpecError, StoreState, SweepRunOptions, load_spec, run_sweep, store_state

    if executor not in ("local", "dask"):
        fail(f"--executor: expected local or dask, got {executor!r}")
    if executor == "dask" and not scheduler:
        fail("--executor dask needs --scheduler tcp://HOST:PORT (a running dask scheduler)")
    if jobs is not None and jobs < 1:
        fail(f"--jobs: expected a positive number, got {jobs}")
    if max_runs is not None and max_runs < 0:
        fail(f"--max-runs: expected a number of runs >= 0, got {max_runs}")
    _check_store(out, "--out", overwrite)
    try:
        plan = load_spec(spec)
    except SpecError as exc:
        fail(str(exc))
    state = store_state(out) if out.exists() else StoreState()
    console.print(_plan_line(plan, state, out, retry_failed, max_runs), highlight=False, soft_wrap=True)
    if dry_run:
        table = Table("#", "run id", *plan.axis_keys, "status")
        for r in plan.runs:
            table.add_row(str(r.index), r.run_id, *(str(r.axes.get(k, "")) for k in plan.axis_keys),
                          _run_status(r.run_id, state, retry_failed))
        console.print(table)
        return
    from kvsim.sim.planning.sweep import SchedulerUnreachable
    try:
        with store_errors(out, scheduler if executor == "dask" else None):
            options = SweepRunOptions(executor, jobs, scheduler, max_runs, retry_failed, save_outputs)
            result = run_sweep(plan, out, options, progress=not quiet, spec_text=spec.read_text(),
                               on_row=lambda row: _print_failed_run(plan, row))
    except SchedulerUnreachable as exc:
        fail(str(exc), code=1)
    again = [f"{n} {what}" for n, what in ((result.retried, "failed before"), (result.redone, "unreadable"))
             if n]
    console.print(f"ran {result.ran} runs in {result.wall_s:.1f}s ({result.failed} failed"
                  f"{'; run again: ' + ', '.join(again) if again else ''}), skipped {result.skipped}; "
                  f"store: {out}/runs/ (kvsim report {out})", highlight=False, soft_wrap=True)
    if result.failed:
        raise typer.Exit(1)


def _print_failed_run(plan, row: dict) -> None:
    """A failed run's line on stderr as it is recorded: which run (its axes) and why."""
    if row.get("status") == "ok":
        return
    run = next((r for r in plan.runs if r.run_id == row["run_id"]), None)
    axes = ", ".join(f"{k}={v!r}" for k, v in run.axes.items()) if run is not None and run.axes else "base config"
    where = f"run {run.index} ({axes})" if run is not None else f"run {row['run_id']}"
    err_console.print(f"[red]failed:[/red] {where}, id {row['run_id']}: {row.get('error')}",
                      highlight=False, soft_wrap=True)


def _plan_line(plan, state, out: Path, retry_failed: bool, max_runs: int | None) -> str:
    """What the sweep will do: runs finished, failed (kept or run again), unreadable, to run."""
    ids = [r.run_id for r in plan.runs]
    ok = sum(i in state.ok for i in ids)
    failed = sum(i in state.failed for i in ids)
    unreadable = sum(i in {p.stem for p in state.unreadable} for i in ids)
    todo = len(ids) - ok - (0 if retry_failed else failed)
    if max_runs is not None:
        todo = min(todo, max_runs)
    parts = [f"{ok} finished"]
    if failed:
        parts.append(f"{failed} failed ({'run again' if retry_failed else 'kept; --retry-failed runs them again'})")
    if unreadable:
        parts.append(f"{unreadable} unreadable (run again)")
    dup = f" ({plan.duplicates} duplicate points dropped)" if plan.duplicates else ""
    return (f"{len(ids)} runs{dup}; in {out}: {', '.join(parts)}; {todo} to run now; "
            f"axes: {', '.join(plan.axis_keys) or 'none'}")


def _run_status(run_id: str, state, retry_failed: bool) -> str:
    if run_id in state.ok:
        return "done"
    if run_id in state.failed:
        return "failed: pending" if retry_failed else "failed"
    if run_id in {p.stem for p in state.unreadable}:
        return "unreadable: pending"
    return "pending"


def capacity(
    slo: str = typer.Option(..., help='constraints, e.g. "ttft_p99<=2s,tpot_p99<=100ms,slo_attainment>=0.99"'),
    trace: Trace = None,
    config: ConfigFile = None,
    model: Model = None,
    gpu: Gpu = None,
    tp: Tp = None,
    replicas: Annotated[int | None, typer.Option(help="replicas (mode=rate); ignored in mode=replicas")] = None,
    router: RouterName = None,
    kv_offload: KvOffload = None,
    sessions: Sessions = False,
    think_time: ThinkTime = None,
    speculative_config: SpeculativeConfigOpt = None,
    block_size: BlockSize = None,
    num_gpu_blocks: NumGpuBlocks = None,
    max_num_seqs: MaxNumSeqs = None,
    max_num_batched_tokens: MaxNumBatchedTokens = None,
    max_requests: MaxRequests = None,
    rate_scale: Annotated[float | None, typer.Option(
        help="mode=rate: first scale tried; mode=replicas: the load")] = None,
    set_: Sets = [],
    mode: str = typer.Option("rate", help="rate: highest rate scale meeting the SLO; replicas: fewest replicas"),
    tol: float = typer.Option(0.02, help="mode=rate: stop when the bracket is within this relative width"),
    max_evals: int = typer.Option(24, help="most simulations for the search"),
    max_replicas: int = typer.Option(64, help="mode=replicas: give up above this"),
    window: Window = None,
    repeats: Repeats = 3,
    band: Band = True,
    step_variance: Annotated[str | None, typer.Option(
        help="step-time variance of the search: auto (default: the GPU's fitted sigma; the answer with "
             "deterministic steps is searched too, and how much it moved is printed), a sigma, or 0 (off)")] = None,
    out: Path | None = typer.Option(None, "--out", "--store", "-o", parser=output_path(),
                                       help="store for the runs + capacity.json (resumable; kvsim report reads it)"),
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="no progress lines")] = False,
    overwrite: Overwrite = False,
    usd_per_hour: UsdPerHour = None,
) -> None:
    """Find the highest arrival-rate scale (or the fewest replicas) meeting an SLO, by bracketing and
    bisection on simulated runs, on a representative sample of the trace (default: the whole trace if
    it has at most 4,000 requests, else its busiest window of about 2,500); prints the answer with its
    range (other busy windows or arrival seeds, the GPU profile's measured error), its cost, the curve
    measured and warnings where the answer is not to be trusted as is."""
    from kvsim.sim.planning.capacity import (CapacitySearch, RangeVariants, capacity_range, check_rate_search, choose_sample,
                                    find_capacity, parse_slo)

    overrides = config_overrides(trace=trace, model=model, gpu=gpu, tp=tp, replicas=replicas, block_size=block_size,
                                 num_gpu_blocks=num_gpu_blocks, max_num_seqs=max_num_seqs,
                                 max_num_batched_tokens=max_num_batched_tokens, max_requests=max_requests,
                                 rate_scale=rate_scale, usd_per_hour=usd_per_hour, router=router)
    if mode not in ("rate", "replicas"):
        fail(f"--mode: expected rate or replicas, got {mode!r}")
    if not 0 < tol < 1:
        fail(f"--tol: expected a fraction in (0, 1), got {tol}")
    if not 1 <= max_evals <= 10_000:
        fail(f"--max-evals: expected a number of simulations from 1 to 10000, got {max_evals}")
    if not 1 <= max_replicas <= 100_000:
        fail(f"--max-replicas: expected 1 to 100000, got {max_replicas}")
    if out is not None:
        _check_store(out, "--out", overwrite)
    _check_repeats(repeats)
    try:
        cfg = load_config(config, {**overrides, **tier_overrides(kv_offload, sessions, think_time),
                                   **parse_speculative_config(speculative_config)}, set_)
        cfg = build_config(cfg.model_dump(), {"step_variance": _search_variance(step_variance, cfg.step_variance)})
        constraints = parse_slo(slo)
        cfg, sample = choose_sample(cfg, window)
        if mode == "rate":
            check_rate_search(sample)
    except (ConfigError, TraceError) as exc:
        fail(str(exc))
    console.print(sample.describe(), highlight=False, soft_wrap=True)

    def show(row: dict) -> None:
        if not quiet:
            mark = "[green]meets[/green]" if row["meets_slo"] else f"[red]fails[/red] {row['violations']}"
            console.print(f"  {mode} {row['searched_value']:g}: {row['offered_rate_req_s']:.3f} req/s offered, "
                          f"goodput {row.get('goodput_req_s', math.nan):.3f} req/s -> {mark}", soft_wrap=True)

    def show_variant(label: str, row: dict) -> None:
        if not quiet:
            mark = "meets" if row["meets_slo"] else "fails"
            console.print(f"  [{label}] {mode} {row['searched_value']:g}: {mark}", markup=False, highlight=False,
                          soft_wrap=True)

    try:
        with store_errors(out, None):
            search = CapacitySearch(mode=mode, start=cfg.trace_options.rate_scale, rel_tol=tol,
                                    max_evals=max_evals, max_replicas=max_replicas)
            result = find_capacity(cfg, constraints, search, store=out, progress=show)
            spread = capacity_range(cfg, constraints, result, sample, search, RangeVariants(repeats, band), store=out,
                                    progress=show_variant)
    except typer.Exit:              # store_errors' own one-line exit (typer.Exit is a RuntimeError)
        raise
    except (ConfigError, RuntimeError, ValueError) as exc:
        fail(str(exc))
    _print_capacity(result, mode, spread)
    _print_warnings(sample, result, max_evals)
    if not result.feasible:
        raise typer.Exit(1)


def _search_variance(option: str | None, configured):
    """capacity's step variance: the option, else the config's, else auto (a config's 0 counts as unset)."""
    from kvsim.sim.cli.simulate import parse_step_variance

    if option is not None:
        return parse_step_variance(option)
    return configured if configured != 0 else "auto"


def _check_repeats(repeats: int) -> None:
    if repeats < 1:
        fail(f"--repeats: expected a count >= 1 (1: no resampled range), got {repeats}")


def _print_warnings(sample, result, max_evals: int | None) -> None:
    from kvsim.sim.planning.capacity import result_warnings, sample_warnings

    for line in sample_warnings(sample) + (result_warnings(result, max_evals) if result is not None else []):
        err_console.print(f"[yellow]warning:[/yellow] {line}", highlight=False, soft_wrap=True)


def _print_variance(spread) -> None:
    """How much the step-time variance moved the answer (the search ran with it)."""
    v = spread.variance if spread is not None else None
    if not v:
        return
    if v["deterministic_answer"] is None:
        console.print(f"step-time variance (sigma {v['sigma']:.3g}): with deterministic steps no point met the SLO",
                      highlight=False)
        return
    console.print(f"step-time variance (sigma {v['sigma']:.3g}, {v['setting']}): the answer moved by "
                  f"{v['moved']:+.1%} from {v['deterministic_answer']:.4g} with deterministic steps", highlight=False)


def _print_capacity(result, mode: str, spread=None) -> None:
    cols = [("searched_value", "rate scale" if mode == "rate" else "replicas", "{:g}"),
            ("offered_rate_req_s", "offered req/s", "{:.3f}"), ("throughput_req_s", "req/s", "{:.3f}"),
            ("goodput_req_s", "goodput req/s", "{:.3f}"), ("ttft_p99_s", "TTFT p99 ms", "ms"),
            ("tpot_p99_s", "TPOT p99 ms", "ms"), ("num_gpus", "GPUs", "{:d}"),
            ("usd_per_m_output_tok", "$/M out tok", "{:.3f}"), ("meets_slo", "SLO", "{}")]
    table = Table(*[c[1] for c in cols], title=f"capacity curve ({', '.join(result.slo)})")
    for _, row in result.curve.iterrows():
        cells = []
        for key, _, fmt in cols:
            v = row.get(key)
            if v is None or (isinstance(v, float) and math.isnan(v)):
                cells.append("-")
            elif fmt == "ms":
                cells.append(f"{v * 1e3:.1f}")
            else:
                cells.append(fmt.format(int(v) if fmt == "{:d}" else v))
        table.add_row(*cells)
    console.print(table)
    m = result.answer_metrics
    if not result.feasible:
        console.print("[red]no configuration searched meets the SLO[/red]")
        return
    _print_variance(spread)
    value = spread.text("{:.4g}") if spread is not None and mode == "rate" else spread.text() if spread else f"{result.answer:g}"
    what = f"max rate scale {value}" if mode == "rate" else f"fewest replicas {value}"
    bound = "" if result.bounded else " (lower bound: the search limit was reached before the SLO failed)"
    console.print(f"[bold]{what}[/bold]{bound}: {result.answer_rate_req_s:.3f} req/s offered, "
                  f"{m.get('throughput_output_tok_s', math.nan):.1f} output tok/s, "
                  f"{m.get('num_gpus')} GPUs at ${m.get('usd_per_hour', math.nan):.2f}/h = "
                  f"${m.get('usd_per_m_output_tok', math.nan):.3f} per million output tokens", highlight=False, soft_wrap=True)
    if spread is not None:
        parts = [f"{k}: {'-' if v is None else f'{v:.4g}'}" for k, v in {**spread.samples, **spread.profile_band}.items()]
        console.print("range from " + ("; ".join(parts) if parts else "the answer alone"), highlight=False, soft_wrap=True)
        for note in spread.notes:
            console.print(f"note: {note}", highlight=False, soft_wrap=True)


def report(
    store: Path = typer.Argument(..., help="sweep or capacity store directory"),
    out: Path | None = typer.Option(None, "--out", "-o", parser=output_path(), help="HTML file (default: STORE/report.html)"),
    overwrite: bool = typer.Option(False, "--overwrite", help="replace an existing HTML file that kvsim report did "
                                                              "not write (one it wrote is replaced anyway)"),
) -> None:
    """Turn a sweep store into one HTML page of plotly charts: throughput/goodput vs load, latency
    percentiles, KV utilization and fragmentation, capacity curve, cost vs p99 latency Pareto view."""
    from kvsim.sim.planning.report import build_report, report_written_by_kvsim
    from kvsim.sim.io.safe_io import InputError, check_output_file

    if not store.is_dir():
        fail(f"{store}: not a directory (give the --out of `kvsim sweep` or `kvsim capacity`)")
    if out is not None and out.is_dir():
        fail(f"--out {out}: is a directory; expected the HTML file to write, e.g. {out / 'report.html'}")
    if out is not None:
        _check_parent(out, "--out")
    try:
        check_output_file(out or store / "report.html", what="HTML file", overwrite=overwrite,
                          written_by_kvsim=report_written_by_kvsim)
    except InputError as exc:
        fail(str(exc))
    try:
        path = build_report(store, out)
    except ValueError as exc:
        fail(str(exc))
    except OSError as exc:
        fail(f"--out {out or store / 'report.html'}: cannot be written ({exc.strerror or exc})")
    from kvsim.sim.planning.sweep import store_state
    unreadable = store_state(store).unreadable
    if unreadable:
        err_console.print(f"note: {len(unreadable)} unreadable run file(s) left out ({unreadable[0]}"
                          f"{', ...' if len(unreadable) > 1 else ''}); the next `kvsim sweep` runs them again",
                          highlight=False, soft_wrap=True)
    console.print(f"wrote {path}")


@contextmanager
def store_errors(store: Path | None, scheduler: str | None):
    """Ctrl-C or SIGTERM: exit 130 saying the store keeps the finished runs; a full disk or an unreachable
    Dask scheduler: one line, exit 1."""
    import errno

    from .simulate import interrupt_on_sigterm

    kept = f"; the store {store} keeps the finished runs (run again to resume)" if store else ""
    from kvsim.sim.io.result_dirs import StoreBusyError
    from kvsim.sim.planning.sweep import MissingExtra, SchedulerUnreachable

    try:
        with interrupt_on_sigterm():
            yield
    except (StoreBusyError, MissingExtra) as exc:
        fail(str(exc))
    except KeyboardInterrupt as exc:
        typer.echo(f"{str(exc) or 'interrupted (Ctrl-C)'}{kept}", err=True)
        raise typer.Exit(130) from None
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            fail(f"--out {store}: disk full ({exc.strerror}){kept}", code=1)
        if isinstance(exc, SchedulerUnreachable):          # names the address already
            fail(str(exc), code=1)
        if scheduler is not None and (exc.errno is None or isinstance(exc, (ConnectionError, TimeoutError))):
            fail(f"--scheduler {scheduler}: cannot reach the Dask scheduler ({exc}); expected a running "
                 "`dask scheduler` at that address", code=1)
        fail(f"--out {store}: cannot write the store ({exc.strerror or exc})", code=1)


def _check_store(store: Path, option: str, overwrite: bool = False) -> None:
    """A results store must be a directory (existing or to be created) that can be written, and kvsim's
    (a store written before stores were marked has plan.json or runs/)."""
    from kvsim.sim.io.result_dirs import OutputDirError, check_out_dir, check_out_owner

    try:
        check_out_dir(store, option)
        check_out_owner(store, option, overwrite, legacy=("plan.json", "capacity.json", "runs"))
    except OutputDirError as exc:
        fail(str(exc))


def _check_parent(path: Path, option: str) -> None:
    """A file to write: its folder must be (or become) a writable directory."""
    from kvsim.sim.io.result_dirs import OutputDirError, check_out_dir

    try:
        check_out_dir(path.parent, option)
    except OutputDirError:
        fail(f"{option} {path}: its folder {path.parent} is not a writable directory (nor can it be created)")


def _names(text: str, option: str) -> list[str]:
    items = [p.strip() for p in text.split(",") if p.strip()]
    if not items:
        fail(f"{option}: expected a comma-separated list, got {text!r}")
    return list(dict.fromkeys(items))


def _ints(text: str, option: str) -> list[int]:
    try:
        values = [int(v) for v in _names(text, option)]
    except ValueError:
        fail(f"{option}: expected comma-separated positive integers (e.g. 1,2,4,8), got {text!r}")
    if any(v < 1 for v in values):
        fail(f"{option}: expected positive integers, got {text!r}")
    return values


def _catalog_names(names: list[str], option: str, get) -> list[str]:
    """The names as given, each checked against its catalog; a second spelling of one entry
    (h100, H100-SXM) is dropped so it is not planned twice."""
    from kvsim.sim.model.catalog import CatalogError
    kept: dict[str, str] = {}
    for name in names:
        try:
            kept.setdefault(get(name).name, name)
        except CatalogError as exc:
            raise CatalogError(f"{option}: {exc}") from None
    return list(kept.values())


def plan(
    slo: str = typer.Option(..., help='constraints, e.g. "ttft_p99<=2s,tpot_p99<=100ms"'),
    models: str = typer.Option(..., "--models", help="comma-separated catalog models, e.g. llama-3.1-8b,llama-3.1-70b"),
    gpus: str = typer.Option(..., "--gpus", help="comma-separated catalog GPUs, e.g. h100,h200"),
    tps: str = typer.Option("1,2,4,8", "--tps", help="comma-separated tensor-parallel degrees"),
    policies: str | None = typer.Option(None, "--policies", help="comma-separated KV policies to compare "
                                           "(default: the config's); budgets via --set kv.budget=..."),
    trace: Trace = None,
    config: ConfigFile = None,
    rate_scale: Annotated[float | None, typer.Option(help="the load: arrival-rate multiplier of the trace")] = None,
    router: RouterName = None,
    kv_offload: KvOffload = None,
    sessions: Sessions = False,
    think_time: ThinkTime = None,
    speculative_config: SpeculativeConfigOpt = None,
    speculative_variants: Annotated[list[str] | None, typer.Option(
        "--speculative-variant", help="repeatable: a speculative-decoding variant to plan as a configuration of its "
        "own, vLLM's --speculative-config JSON or `none` (without), e.g. --speculative-variant none "
        "--speculative-variant '{\"method\": \"eagle3\", \"num_speculative_tokens\": 3}'")] = None,
    window: Window = None,
    set_: Sets = [],
    max_replicas: int = typer.Option(64, help="give a configuration up above this many replicas"),
    repeats: Repeats = 3,
    band: Band = True,
    scheduler: str | None = typer.Option(None, help="Dask scheduler address (default: a local Dask cluster)"),
    jobs: int | None = typer.Option(None, "--jobs", "-j", help="local cluster workers (default: all cores; "
                                                                  "1: in this process, no cluster)"),
    out: Path | None = typer.Option(None, "--out", "--store", "-o", parser=output_path(),
                                       help="store for the runs + plan-result.json (resumable; kvsim report reads it)"),
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="no progress lines")] = False,
    usd_per_hour: UsdPerHour = None,
    disaggregated: bool = typer.Option(False, "--disaggregated", help="also search prefill/decode fleets (pool "
                                       "GPU, TP, replicas) and print both forms side by side"),
    prefill_gpus: str | None = typer.Option(None, "--prefill-gpus", help="prefill pool GPUs (default: --gpus)"),
    decode_gpus: str | None = typer.Option(None, "--decode-gpus", help="decode pool GPUs (default: --gpus)"),
    prefill_tps: str | None = typer.Option(None, "--prefill-tps", help="prefill pool TP degrees (default: --tps)"),
    decode_tps: str | None = typer.Option(None, "--decode-tps", help="decode pool TP degrees (default: --tps)"),
    link: str = typer.Option("ib-ndr", "--link", help="link between the pools (sim/data/links.yaml)"),
    max_pool_replicas: int = typer.Option(16, "--max-pool-replicas", help="give a disaggregated fleet up above "
                                          "this many replicas in a pool"),
    local_prefill_tokens: str = typer.Option("0", "--local-prefill-tokens", help="conditional disaggregation "
                                             "thresholds to search, comma-separated (0: always disaggregate)"),
    mixed_pools: int = typer.Option(1, "--mixed-pools", help="disaggregated fleets whose prefill (and decode) role "
                                    "mixes up to this many pool types (GPU x TP), each with its own replicas; 1: one "
                                    "pool type a role"),
    objective: str = typer.Option("usd", "--objective", help="what the plan minimises: usd (dollars an hour) or "
                                  "gpus (the fewest GPUs, then dollars)"),
    exhaustive: bool = typer.Option(False, "--exhaustive", help="simulate every configuration at every replica "
                                    "count (and every disaggregated fleet): no capacity bound, no pruning"),
    low_fi: float = typer.Option(0.0, "--low-fi", help="first run each configuration at its capacity bound on "
                                 "the busiest window of this share of the sample (e.g. 0.125) to order and start "
                                 "the full search; 0: off"),
) -> None:
    """The cheapest configuration meeting an SLO at a given load, for each model: every GPU x TP degree
    (x KV policy) that fits, its fewest replicas, searched in rounds on a Dask cluster (configurations
    that cannot be cheaper than an answer already found are dropped); prints each configuration's
    answer, the Pareto table (cost vs p99 TTFT/TPOT) and the cheapest with its range. With
    option --disaggregated, also the cheapest prefill/decode fleet (docs/disaggregation.md), both forms side
    by side and the Pareto front of output tokens/s per GPU vs per user."""
    from kvsim.sim.planning.capacity import choose_sample, parse_slo, profile_configs, variant_configs
    from kvsim.sim.model.catalog import CatalogError, get_gpu, get_model
    from kvsim.sim.planning.plan import PlanSpace, executor, plan_capacity

    model_list, gpu_list, tp_list = _names(models, "--models"), _names(gpus, "--gpus"), _ints(tps, "--tps")
    policy_list = _names(policies, "--policies") if policies else None
    _check_repeats(repeats)
    if jobs is not None and jobs < 1:
        fail(f"--jobs: expected a positive number, got {jobs}")
    if max_replicas < 1:
        fail(f"--max-replicas: expected a positive number, got {max_replicas}")
    if out is not None:
        _check_store(out, "--out")
    if objective not in ("usd", "gpus"):
        fail(f"--objective: expected usd or gpus, got {objective!r}")
    _check_search_options(exhaustive, low_fi)
    _check_disaggregated_options(disaggregated, {"--prefill-gpus": prefill_gpus, "--decode-gpus": decode_gpus,
                                                 "--prefill-tps": prefill_tps, "--decode-tps": decode_tps},
                                 link, max_pool_replicas, local_prefill_tokens, mixed_pools)
    try:
        model_list, gpu_list = _catalog_names(model_list, "--models", get_model), _catalog_names(gpu_list, "--gpus", get_gpu)
        pools = {role: _pool_types(gtext, ttext, gpu_list, tp_list, role)
                 for role, gtext, ttext in (("prefill", prefill_gpus, prefill_tps), ("decode", decode_gpus, decode_tps))
                 } if disaggregated else {}
        priced = list(dict.fromkeys(gpu_list + [g for r in pools.values() for g, _ in r]))
        cfg = load_config(config, {**config_overrides(trace=trace, rate_scale=rate_scale, model=model_list[0],
                                                      gpu=gpu_list[0], usd_per_hour=usd_per_hour, router=router),
                                   **tier_overrides(kv_offload, sessions, think_time),
                                   **parse_speculative_config(speculative_config)}, set_)
        if isinstance(cfg.usd_per_hour, float) and len(priced) > 1:
            raise ConfigError(f"--usd-per-hour {cfg.usd_per_hour:g}: one price for {len(priced)} GPUs; give "
                              "GPU=PRICE for each one to price (h100=2.5,h200=3.9)")
        for p in policy_list or []:
            load_config(None, {"kv.policy": p})
        spec_list = _speculative_variants(speculative_variants)
        constraints = parse_slo(slo)
        cfg, sample = choose_sample(cfg, window)
    except (ConfigError, CatalogError, TraceError) as exc:
        fail(str(exc).replace("\n", " "))
    _check_low_fi_window(cfg, low_fi)
    console.print(sample.describe(), highlight=False, soft_wrap=True)
    notes: list[str] = []

    def variants(c):
        found, why = variant_configs(c, sample, repeats)
        more, why2 = profile_configs(c) if band else ({}, ["no profile band (--no-band)"])
        notes.extend(n for n in why + why2 if n not in notes)
        return {**found, **more}

    def show(s, n, row) -> None:
        if not quiet:
            mark = ("[green]meets[/green]" if row.get("meets_slo") else f"[red]fails[/red] {row.get('violations', '')}"
                    if row["status"] == "ok" else f"[red]failed[/red] {row.get('error')}")
            console.print(f"  {s.cand.label} x{n}: {mark}", soft_wrap=True)

    dspace = _disaggregated_space(cfg, pools, models=model_list, link=link, max_pool_replicas=max_pool_replicas,
                                  local_prefill_tokens=_thresholds(local_prefill_tokens), objective=objective,
                                  exhaustive=exhaustive, mixed_pools=mixed_pools)
    try:
        with store_errors(out, scheduler), executor(scheduler, jobs) as (run_batch, width):
            space = PlanSpace(model_list, gpu_list, tp_list, policy_list, max_replicas, objective, spec_list,
                              exhaustive=exhaustive, low_fi=low_fi)
            result = plan_capacity(cfg, constraints, space, run_batch=run_batch, width=width, store=out,
                                   variants=variants, progress=show)
            dis = _plan_disaggregated(cfg, constraints, dspace, run_batch, width, out, variants, quiet)
    except typer.Exit:              # store_errors' own one-line exit (typer.Exit is a RuntimeError)
        raise
    except ConfigError as exc:
        fail(str(exc))
    result.range_notes = notes
    _print_plan(result)
    if dis is not None:
        _print_disaggregated(result, dis)
    _print_warnings(sample, None, None)
    if not result.cheapest and not (dis is not None and dis.cheapest):
        raise typer.Exit(1)


def _speculative_variants(values: list[str] | None) -> list[dict | None] | None:
    """`--speculative-variant` values: `none` or vLLM's JSON, each checked as speculative_config (one line)."""
    if not values:
        return None
    out: list[dict | None] = []
    for value in values:
        if value.strip().lower() == "none":
            out.append(None)
            continue
        data = parse_speculative_config(value.replace("--speculative-config", ""))["speculative_config"]
        load_config(None, {"speculative_config": data})          # the schema's one-line refusals
        out.append(data)
    return out


def _check_search_options(exhaustive: bool, low_fi: float) -> None:
    if not 0 <= low_fi < 1:
        fail(f"--low-fi: expected a share of the sample from 0 (off) to below 1, e.g. 0.125, got {low_fi:g}")
    if exhaustive and low_fi:
        fail("--low-fi: the exhaustive search simulates everything in full; drop --low-fi or --exhaustive")


def _check_low_fi_window(cfg, low_fi: float) -> None:
    """--low-fi needs a sample with arrival times to cut a window from (not the first N requests)."""
    from kvsim.sim.planning.plan import low_fi_window

    if low_fi and low_fi_window(cfg, low_fi) is None:
        fail(f"--low-fi {low_fi:g}: the sample has no busiest window to cut (the first N requests, synthesized "
             "arrivals, or fewer than 2 requests in the window); use --window (e.g. 8m@peak) or drop --low-fi")


def _check_disaggregated_options(disaggregated: bool, pool_options: dict, link: str, max_pool_replicas: int,
                                 local_prefill_tokens: str, mixed_pools: int = 1) -> None:
    """`kvsim plan`'s disaggregated options: refused in one line where they cannot apply or are wrong."""
    from kvsim.sim.model.links import link_names

    if not disaggregated:
        given = [k for k, v in pool_options.items() if v is not None] + (["--link"] if link != "ib-ndr" else []) + \
            (["--max-pool-replicas"] if max_pool_replicas != 16 else []) + \
            (["--local-prefill-tokens"] if local_prefill_tokens != "0" else []) + \
            (["--mixed-pools"] if mixed_pools != 1 else [])
        if given:
            fail(f"{given[0]}: applies to disaggregated fleets; add --disaggregated")
    if max_pool_replicas < 1:
        fail(f"--max-pool-replicas: expected a positive number, got {max_pool_replicas}")
    if mixed_pools < 1:
        fail(f"--mixed-pools: expected the most pool types a role may mix, 1 or more (1: one type), got {mixed_pools}")
    _thresholds(local_prefill_tokens)
    if link not in link_names():
        fail(f"--link: unknown link {link!r}; known: {', '.join(link_names())}")


def _thresholds(text: str) -> tuple[int, ...]:
    """--local-prefill-tokens: comma-separated token counts, 0 or more each."""
    try:
        values = tuple(int(v) for v in _names(text, "--local-prefill-tokens"))
    except ValueError:
        values = (-1,)
    if not values or any(v < 0 for v in values):
        fail(f"--local-prefill-tokens: expected comma-separated token counts of 0 or more (e.g. 0,1024), got {text!r}")
    return values


def _disaggregated_space(cfg, pools: dict, **search):
    """The DisaggSpace of `kvsim plan --disaggregated` (None without it: no `pools`), `search` its other
    fields; what a fleet does not model is refused here, in one line, before the aggregated search runs."""
    if not pools:
        return None
    from kvsim.sim.planning.disaggregated import DisaggSpace, refuse_unmodelled

    space = DisaggSpace(prefill=pools["prefill"], decode=pools["decode"], **search)
    try:
        refuse_unmodelled(cfg, space)
    except ConfigError as exc:
        fail(f"--disaggregated: {exc}")
    return space


def _plan_disaggregated(cfg, constraints, space, run_batch, width: int, out, variants, quiet: bool):
    """The disaggregated search on the plan's executor and store (None without --disaggregated)."""
    if space is None:
        return None
    from kvsim.sim.planning.disaggregated import plan_disaggregated
    from kvsim.sim.planning.plan import _Runner

    return plan_disaggregated(cfg, constraints, space, _Runner(constraints, run_batch, out), width=width,
                              variants=variants, progress=None if quiet else _show_fleet)


def _pool_types(gpus: str | None, tps: str | None, gpu_list: list[str], tp_list: list[int], role: str) -> list:
    """(GPU, TP) of a pool's types: --{role}-gpus x --{role}-tps, each defaulting to --gpus / --tps."""
    from kvsim.sim.model.catalog import get_gpu

    g = _catalog_names(_names(gpus, f"--{role}-gpus"), f"--{role}-gpus", get_gpu) if gpus else gpu_list
    t = _ints(tps, f"--{role}-tps") if tps else tp_list
    return [(gpu, tp) for gpu in g for tp in t]


def _show_fleet(p) -> None:
    row = p.row or {}
    mark = ("[green]meets[/green]" if p.meets else f"[red]fails[/red] {row.get('violations', '')}"
            if row.get("status") == "ok" else f"[red]failed[/red] {row.get('error')}")
    console.print(f"  {p.model} {p.label}: {mark}", soft_wrap=True)


def _count(n: int, word: str) -> str:
    """'1 replica', '3 replicas'."""
    return f"{n} {word}" + ("" if n == 1 else "s")


def _ms(v) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v * 1e3:.0f}"


def _print_plan(result) -> None:
    table = Table("model", "GPU", "TP", "result", "replicas", "GPUs", "$/h", "$/M out tok", "TTFT p99 ms",
                  "TPOT p99 ms", title=f"fewest replicas per configuration ({', '.join(result.slo)})")
    for s in result.searches:
        row = s.answer_row or {}
        n = s.hi_ok if s.status == "answer" else None
        cost = row.get("usd_per_m_output_tok")
        table.add_row(s.cand.model, s.cand.gpu + (f" {s.cand.policy}" if s.cand.policy else "")
                      + (f" {s.cand.spec}" if s.cand.spec else ""), str(s.cand.tp),
                      s.status + (f" ({s.note})" if s.note else ""), "-" if n is None else str(n),
                      "-" if n is None else str(n * s.cand.tp),
                      "-" if n is None else f"{n * s.cand.usd_per_replica_hour:.2f}",
                      "-" if cost is None or math.isnan(cost) else f"{cost:.3f}",
                      _ms(row.get("ttft_p99_s")), _ms(row.get("tpot_p99_s")))
    for c, why in result.unfit:
        table.add_row(c.model, c.gpu + (f" {c.policy}" if c.policy else "") + (f" {c.spec}" if c.spec else ""),
                      str(c.tp), f"cannot run: {why}",
                      *["-"] * 6)
    console.print(table)
    front = result.pareto()
    if len(front):
        pt = Table("model", "configuration", "replicas", "$/h", "TTFT p99 ms", "TPOT p99 ms", "E2E p99 ms",
                   title="Pareto table: meets the SLO, no other point cheaper and faster (points simulated)")
        for _, r in front.iterrows():
            pt.add_row(r["model_key"], r["candidate"], str(int(r["replicas"])), f"{r['usd_per_hour']:.2f}",
                       _ms(r.get("ttft_p99_s")), _ms(r.get("tpot_p99_s")), _ms(r.get("e2e_p99_s")))
        console.print(pt)
    for model, s in result.cheapest.items():
        price = s.cand.usd_per_replica_hour
        rng = result.ranges.get(model, {})
        values = [s.hi_ok] + [v for v in rng.values() if v is not None]
        lo, hi = min(values), max(values)
        cost = s.answer_row.get("usd_per_m_output_tok", math.nan)
        span = _count(lo, "replica") if lo == hi else f"{lo}-{hi} replicas"
        console.print(f"[bold]{model}: cheapest {s.cand.gpu} TP{s.cand.tp}"
                      f"{' ' + s.cand.policy if s.cand.policy else ''} x {_count(s.hi_ok, 'replica')}[/bold] = "
                      f"{_count(s.hi_ok * s.cand.tp, 'GPU')}, ${s.hi_ok * price:.2f}/h, ${cost:.3f} per million output "
                      f"tokens; range {span} (${lo * price:.2f}-{hi * price:.2f}/h)", highlight=False, soft_wrap=True)
        if rng:
            console.print("  range from " + "; ".join(f"{k}: {'-' if v is None else v}" for k, v in rng.items()),
                          highlight=False, soft_wrap=True)
    for note in result.range_notes:
        console.print(f"note: {note}", highlight=False, soft_wrap=True)
    searched = {s.cand.model for s in result.searches}
    for model in dict.fromkeys([s.cand.model for s in result.searches] + [c.model for c, _ in result.unfit]):
        if model not in searched:
            console.print(f"[red]{model}: no configuration can run (every GPU x TP above: cannot run)[/red]",
                          soft_wrap=True)
        elif model not in result.cheapest:
            console.print(f"[red]{model}: no configuration searched meets the SLO[/red]", soft_wrap=True)
    console.print(f"{result.simulations} simulations, {result.wall_s:.1f} s", highlight=False)
    if result.counts is not None:
        console.print(space_line(result.counts), highlight=False, soft_wrap=True)


def space_line(c) -> str:
    """'space: 512 configurations (...): 64 cannot run, 300 below a capacity bound, ...' (SpaceCounts)."""
    return (f"space: {c.configurations:,} configurations (model x GPU x TP x replica count): {c.cannot_run:,} cannot "
            f"run, {c.below_bound:,} below a capacity bound, {c.low_fi_runs} low-fidelity runs, {c.full_runs} full "
            f"simulations ({c.reused} more reused from the store), the rest dominated or past an answer")


def _print_disaggregated(agg, dis) -> None:
    """The disaggregated search (bounds, points), both forms side by side, and the Pareto front."""
    _print_bounds(dis)
    _print_fleet_points(dis)
    _print_side_by_side(agg, dis)
    _print_front(agg, dis)
    for model in dis.bounds:
        a, p = agg.cheapest.get(model), dis.cheapest.get(model)
        if a is not None and p is not None:
            a_usd = a.hi_ok * a.cand.usd_per_replica_hour
            a_rank = (a.hi_ok * a.cand.tp, a_usd) if a.cand.objective == "gpus" else (a_usd, a.hi_ok * a.cand.tp)
            p_rank = p.rank(a.cand.objective)
            better = "disaggregated" if p_rank < a_rank else "aggregated" if a_rank < p_rank else "neither"
            word = "form with fewer GPUs" if a.cand.objective == "gpus" else "cheaper form"
            console.print(f"[bold]{model}: {word} {better}[/bold]: aggregated ${a_usd:.2f}/h "
                          f"({a.hi_ok * a.cand.tp} GPUs), disaggregated ${p.usd_per_hour:.2f}/h ({p.gpus} GPUs)",
                          highlight=False, soft_wrap=True)
        elif p is None:
            console.print(f"[red]{model}: no disaggregated fleet searched meets the SLO[/red]", soft_wrap=True)
        if p is not None and dis.mixed_pools > 1:
            console.print(f"{model}: the cheapest disaggregated fleet's pools (as kvsim simulate names them): "
                          f"{p.pool_names()}", highlight=False, soft_wrap=True)
    console.print(f"disaggregated: {dis.simulations} simulations, {dis.wall_s:.1f} s", highlight=False)


def _print_bounds(dis) -> None:
    bt = Table("model", "pool", "GPU", "TP", "$/h per replica", "best rate per replica", "fewest replicas",
               title="disaggregated: per-pool capacity bounds (the load over each pool type's best rate)")
    for model, bounds in dis.bounds.items():
        for b in bounds:
            bt.add_row(model, b.role, b.pool.gpu, str(b.pool.tp), f"{b.pool.usd_per_replica_hour:.2f}", b.why,
                       "cannot" if b.min_replicas is None else str(b.min_replicas))
    for model, role, pool, why in dis.unfit:
        bt.add_row(model, role, pool.gpu, str(pool.tp), "-", f"cannot run: {why}", "-")
    console.print(bt)


def _print_fleet_points(dis) -> None:
    pt = Table("model", "fleet", "GPUs", "$/h", "result", "TTFT p99 ms", "TPOT p99 ms", "prefill queue p99 ms",
               "transfer p99 ms", title="disaggregated fleets simulated (cheapest first)")
    for p in dis.points:
        row = p.row or {}
        h = row.get("handoff") if isinstance(row.get("handoff"), dict) else {}
        res = ("meets" if p.meets else "fails " + str(row.get("violations", ""))) if row.get("status") == "ok" \
            else f"failed: {row.get('error')}"
        pt.add_row(p.model, p.label, str(p.gpus), f"{p.usd_per_hour:.2f}", res, _ms(row.get("ttft_p99_s")),
                   _ms(row.get("tpot_p99_s")), _ms(h.get("p99_prefill_queue_s")), _ms(h.get("p99_transfer_s")))
    console.print(pt)
    for model in dis.bounds:
        console.print(f"{model}: {dis.grid.get(model, 0):,} disaggregated fleets within the replica limit; "
                      f"{dis.below_bound.get(model, 0):,} below a pool's capacity bound, "
                      f"{sum(1 for p in dis.points if p.model == model)} simulated, {dis.implied_fail.get(model, 0):,} "
                      "cheaper ones implied to fail by a simulated failure, the rest dearer than the answer",
                      highlight=False, soft_wrap=True)


def _per_gpu_per_user(row: dict) -> tuple[float, float]:
    """(output tok/s per GPU, tok/s per user = 1 / mean TPOT) of a run's row."""
    gpus, tok, tpot = row.get("num_gpus") or 0, row.get("throughput_output_tok_s") or 0.0, row.get("tpot_mean_s")
    per_user = 1.0 / tpot if tpot and not math.isnan(tpot) and tpot > 0 else math.nan
    return (tok / gpus if gpus else math.nan), per_user


def _print_side_by_side(agg, dis) -> None:
    side = Table("model", "form", "configuration", "GPUs", "$/h", "$/M out tok", "TTFT p99 ms", "TPOT p99 ms",
                 "tok/s/GPU", "tok/s/user", "range", title="aggregated vs disaggregated: the cheapest of each")
    for model in dict.fromkeys(list(agg.cheapest) + list(dis.cheapest) + list(dis.bounds)):
        s = agg.cheapest.get(model)
        if s is not None:
            row = s.answer_row
            g, u = _per_gpu_per_user(row)
            values = [s.hi_ok] + [v for v in agg.ranges.get(model, {}).values() if v is not None]
            side.add_row(model, "aggregated", f"{s.hi_ok}x {s.cand.gpu} TP{s.cand.tp}", str(s.hi_ok * s.cand.tp),
                         f"{s.hi_ok * s.cand.usd_per_replica_hour:.2f}", f"{row.get('usd_per_m_output_tok', math.nan):.3f}",
                         _ms(row.get("ttft_p99_s")), _ms(row.get("tpot_p99_s")), f"{g:,.0f}", f"{u:.1f}",
                         f"{min(values)}-{max(values)} replicas")
        else:
            side.add_row(model, "aggregated", "none meets the SLO", *["-"] * 8)
        p = dis.cheapest.get(model)
        if p is not None:
            g, u = _per_gpu_per_user(p.row)
            held = ", ".join(f"{k}: {'meets' if v else 'fails' if v is not None else 'failed'}"
                             for k, v in dis.ranges.get(model, {}).items())
            side.add_row(model, "disaggregated", p.label, str(p.gpus), f"{p.usd_per_hour:.2f}",
                         f"{p.row.get('usd_per_m_output_tok', math.nan):.3f}", _ms(p.row.get("ttft_p99_s")),
                         _ms(p.row.get("tpot_p99_s")), f"{g:,.0f}", f"{u:.1f}", held or "-")
        else:
            side.add_row(model, "disaggregated", "none searched meets the SLO", *["-"] * 8)
    console.print(side)


def front_points(agg, dis) -> dict[str, list[dict]]:
    """Every simulated point meeting the SLO, of both forms, per model, with its tok/s per GPU and per user."""
    out: dict[str, list[dict]] = {}
    for s in agg.searches:
        for n, row in s.rows.items():
            if row.get("status") == "ok" and row.get("meets_slo"):
                g, u = _per_gpu_per_user(row)
                out.setdefault(s.cand.model, []).append(
                    {"form": "aggregated", "label": f"{n}x {s.cand.gpu} TP{s.cand.tp}", "gpus": n * s.cand.tp,
                     "usd": n * s.cand.usd_per_replica_hour, "per_gpu": g, "per_user": u})
    for p in dis.points:
        if p.meets:
            g, u = _per_gpu_per_user(p.row)
            out.setdefault(p.model, []).append({"form": "disaggregated", "label": p.label, "gpus": p.gpus,
                                                "usd": p.usd_per_hour, "per_gpu": g, "per_user": u})
    return out


def _print_front(agg, dis) -> None:
    from kvsim.sim.planning.disaggregated import pareto_front

    ft = Table("model", "form", "configuration", "GPUs", "$/h", "output tok/s per GPU", "tok/s per user",
               title="Pareto front: tok/s per GPU vs tok/s per user (1 / mean TPOT), points meeting the SLO")
    for model, pts in front_points(agg, dis).items():
        for f in pareto_front([q for q in pts if not math.isnan(q["per_gpu"]) and not math.isnan(q["per_user"])]):
            ft.add_row(model, f["form"], f["label"], str(f["gpus"]), f"{f['usd']:.2f}", f"{f['per_gpu']:,.0f}",
                       f"{f['per_user']:.1f}")
    console.print(ft)
