"""`kvsim reference`: real vLLM as the reference for kvsim's scheduler (see sim/reference/)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table

from kvsim.sim.config import ConfigError, load_config

from .options import (MaxNumBatchedTokens, MaxNumSeqs, MaxRequests, PrefixCaching, SchedulingPolicy, Sets,
                      config_overrides, fail, output_path)

app = typer.Typer(help="compare kvsim's schedule with a real vLLM engine's, step for step",
                  no_args_is_help=True)
console = Console()
# the recorded scenarios live in the source tree beside the package (sim/cli/ -> the repository root),
# not under the current directory: `kvsim reference check` is the same from any directory
DEFAULT_DATA = Path(__file__).resolve().parents[2] / "tests" / "data" / "vllm_reference"
DATA_HELP = "(default: tests/data/vllm_reference of the kvsim source tree)"
VLLM_PYTHON_HELP = "python of the virtualenv where vLLM is installed (default: $KVSIM_VLLM_PYTHON)"


def _vllm_python(value: str | None) -> str:
    python = value or os.environ.get("KVSIM_VLLM_PYTHON")
    if not python:
        fail("--vllm-python: not given and $KVSIM_VLLM_PYTHON is not set; expected the python of the "
              "virtualenv where vLLM is installed (see docs/vllm-reference.md)")
    return python


def _model_dir(value: Path | None, python: str) -> Path:
    from kvsim.sim.reference.harness import ReferenceError, convert_model, default_model_dir

    model_dir = value or default_model_dir()
    if not (model_dir / "config.json").exists():
        from kvsim.gpu.weights import find_gguf

        console.print(f"converting SmolLM2-135M to a Hugging Face checkpoint in {model_dir} (once, ~1 min)")
        try:
            convert_model(python, find_gguf(), model_dir)
        except (ReferenceError, OSError) as exc:
            fail(str(exc))
    return model_dir


@app.command("vllm")
def vllm_reference(
    trace: Optional[str] = typer.Option(None, help="trace file or shipped name"),
    config: Annotated[Optional[Path], typer.Option("--config", "-c",
                                                   help="kvsim config file (engine settings)")] = None,
    out: Path = typer.Option(Path("runs/vllm-reference"), "--out", "-o", parser=output_path(), help="output directory"),
    vllm_python: Optional[str] = typer.Option(None, help=VLLM_PYTHON_HELP),
    model_dir: Optional[Path] = typer.Option(None, help="SmolLM2 HF checkpoint (default: converted once into "
                                                         "$KVSIM_CACHE_DIR/smollm2-135m-hf)"),
    step_s: Optional[float] = typer.Option(None, help="time-based trace: arrival step = arrival_time_s // STEP_S "
                                                      "(default: the trace's arrivals are steps already)"),
    max_requests: MaxRequests = None,
    block_size: Optional[int] = typer.Option(
        None, help="tokens per block (a multiple of 32 on vLLM's CPU backend; default 32, or the --config file's)"),
    num_gpu_blocks: Optional[int] = typer.Option(
        None, help="KV blocks (vLLM's num_gpu_blocks, null block included); required, here or in --config"),
    max_num_seqs: MaxNumSeqs = None,
    max_num_batched_tokens: MaxNumBatchedTokens = None,
    max_model_len: Optional[int] = typer.Option(None, help="longest prompt + output (default 2048)"),
    long_prefill_token_threshold: Optional[int] = typer.Option(
        None, help="most prompt tokens a long prefill computes per step (vLLM's option; 0: off)"),
    prefix_caching: PrefixCaching = None,
    chunked_prefill: Optional[bool] = typer.Option(None, "--chunked-prefill/--no-chunked-prefill",
                                                  help="chunked prefill (default: on, as vLLM V1)"),
    scheduling_policy: SchedulingPolicy = None,
    set_: Sets = [],
    timeout: float = typer.Option(1800.0, help="seconds vLLM may run"),
) -> None:
    """Run TRACE on a real vLLM engine (CPU, in-process, step by step), simulate it in kvsim with the
    same settings, and report where the schedules agree and the first step and column that differ.
    Writes vllm_steps.parquet, kvsim_steps.parquet, agreement.json and config.yaml into --out."""
    from kvsim.sim.reference.harness import (ReferenceError, check_reference_memory, reference_run,
                                             steps_from_times)
    from kvsim.sim.simulator.simulate import load_workload

    overrides = {
        **config_overrides(
            trace=trace, max_requests=max_requests, block_size=block_size or (None if config else 32),
            num_gpu_blocks=num_gpu_blocks, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len, long_prefill_token_threshold=long_prefill_token_threshold,
            prefix_caching=prefix_caching, chunked_prefill=chunked_prefill, scheduling_policy=scheduling_policy),
        "model": "smollm2-135m", "gpu": "cpu-2core", "profile": "cpu-2core",
        "trace_options.arrival_unit": "time" if step_s else "step", "engine.async_scheduling": False,
    }
    python = _vllm_python(vllm_python)
    try:
        cfg = load_config(config, overrides, set_)
        eng = cfg.engine
        if eng.block_size % 32:
            raise ConfigError(f"engine.block_size: vLLM's CPU attention needs a multiple of 32, got {eng.block_size}")
        if eng.num_gpu_blocks is None:
            raise ConfigError("--num-gpu-blocks: required; vLLM's CPU KV cache is sized exactly from it")
        if eng.max_model_len is None:
            cfg = cfg.model_copy(update={"engine": eng.model_copy(update={"max_model_len": 2048})})
        t = load_workload(cfg)               # the trace with its trace_options (max_requests, ...)
        if step_s:
            t = steps_from_times(t, step_s)
            cfg = cfg.model_copy(update={"trace_options": cfg.trace_options.model_copy(
                update={"arrival_unit": "step"})})
        check_reference_memory(cfg, t)
        agreement = reference_run(cfg, t, out, python, _model_dir(model_dir, python), timeout)
    except (ConfigError, ReferenceError, ValueError) as exc:
        fail(str(exc))
    _print_agreement(agreement, out)
    raise typer.Exit(0 if agreement.identical else 1)


def _print_agreement(a, out: Path) -> None:
    table = Table("", "vLLM", "kvsim", title="schedule agreement")
    table.add_row("steps", str(a.reference_steps), str(a.kvsim_steps))
    table.add_row("preemptions", str(a.reference_preemptions), str(a.kvsim_preemptions))
    table.add_row("identical steps", str(a.matching_steps), "")
    console.print(table)
    if a.identical:
        console.print(f"[green]identical schedules[/green] ({a.reference_steps} steps); results in {out}")
    else:
        d = a.first_difference or {"step": "-", "column": "rejected requests"}
        console.print(f"[yellow]first difference at step {d['step']}, column {d['column']}:[/yellow] "
                      f"vLLM {d.get('reference')} vs kvsim {d.get('kvsim')}; results in {out}")


@app.command("check")
def check(directory: Optional[Path] = typer.Option(None, "--dir", help=f"recorded scenarios {DATA_HELP}")) -> None:
    """Replay every recorded vLLM scenario in kvsim (no vLLM needed) and report the agreement."""
    from kvsim.sim.reference.harness import check_scenario

    directory = directory or DEFAULT_DATA
    if not directory.is_dir():
        fail(f"--dir {directory}: no such directory (expected the recorded scenarios, one subdirectory each)")
    dirs = sorted(p for p in directory.iterdir() if (p / "vllm_steps.parquet").exists()) if directory.is_dir() else []
    if not dirs:
        fail(f"--dir {directory}: no recorded scenarios (expected subdirectories with vllm_steps.parquet)")
    table = Table("scenario", "steps vLLM/kvsim", "preemptions vLLM/kvsim", "agreement", title="vLLM reference")
    failed = 0
    for d in dirs:
        a = check_scenario(d)
        failed += not a.identical
        diff = "identical" if a.identical else f"differs at step {a.first_difference['step']} " \
                                                f"({a.first_difference['column']})"
        table.add_row(d.name, f"{a.reference_steps}/{a.kvsim_steps}",
                      f"{a.reference_preemptions}/{a.kvsim_preemptions}", diff)
    console.print(table)
    raise typer.Exit(1 if failed else 0)


@app.command("record-scenarios")
def record_scenarios(
    out: Optional[Path] = typer.Option(None, "--out", parser=output_path(),
                                       help=f"where the scenario directories go {DATA_HELP}"),
    vllm_python: Optional[str] = typer.Option(None, help=VLLM_PYTHON_HELP),
    model_dir: Optional[Path] = typer.Option(None, help="SmolLM2 HF checkpoint"),
    only: list[str] = typer.Option([], "--only", help="scenario names (default: all)"),
) -> None:
    """Regenerate the recorded references the test suite replays (writes scenario files and runs vLLM)."""
    from kvsim.sim.reference.harness import ReferenceError, record_scenario, write_scenario
    from kvsim.sim.reference.scenarios import SCENARIOS

    unknown = sorted(set(only) - {sc.name for sc in SCENARIOS})
    if unknown:
        fail(f"--only: unknown scenario {unknown[0]!r}; known: {', '.join(sc.name for sc in SCENARIOS)}")
    out = out or DEFAULT_DATA
    python = _vllm_python(vllm_python)
    model = _model_dir(model_dir, python)
    for scenario in SCENARIOS:
        if only and scenario.name not in only:
            continue
        write_scenario(scenario, out / scenario.name)
        try:
            meta = record_scenario(out / scenario.name, python, model)
        except ReferenceError as exc:
            fail(f"{scenario.name}: {exc}")
        console.print(f"{scenario.name}: {meta['steps']} steps, {meta['preemptions']} preemptions "
                      f"(vLLM {meta['vllm_version']}, {meta['wall_s']:.0f} s)")
