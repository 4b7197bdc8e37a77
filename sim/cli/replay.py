"""`kvsim replay`: run a trace on the real backend through the shared engine core (torch imported only
inside the command)."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console

from .options import (BlockSize, Budget, Burstiness, CheckInvariants, ConfigFile, Layout, MaxConcurrency,
                      MetricPercentiles, MaxNumBatchedTokens, MaxNumSeqs, MaxRequests, Out, Overwrite, Policy, Quiet,
                      RateScale, RequestRate, SchedulingPolicy, Sets, SloTpot, SloTtft, SlotStrategy, TimeUnit, Tokenizer,
                      TraceColumns, TraceFormat, Trace, config_overrides, fail)

console = Console()


def replay(
    trace: Trace = None,
    model: Annotated[Optional[str], typer.Option(
        help="catalog model; smollm2-135m with --weights smollm2 (default)")] = None,
    weights: Annotated[str, typer.Option(
        help="smollm2 (the real GGUF) | random (seeded, any dense catalog shape)")] = "smollm2",
    device: Annotated[str, typer.Option(help="cpu | cuda | cuda:N")] = "cpu",
    dtype: Annotated[Optional[str], typer.Option(
        help="float32 | float16 | bfloat16 (default: float32 on cpu, bfloat16 on cuda)")] = None,
    layers: Annotated[Optional[int], typer.Option(help="run only the first N layers (quick runs)")] = None,
    threads: Annotated[Optional[int], typer.Option(help="torch CPU threads (default: torch's choice)")] = None,
    clock: Annotated[str, typer.Option(
        help="step timer: wall | cpu (the thread's CPU time, so other processes' load does not count; device "
             "cpu with --threads 1)")] = "wall",
    gpu: Annotated[Optional[str], typer.Option(
        help="hardware spec for predicted_s (default: cpu-2core on cpu, the matching catalog GPU on cuda)")] = None,
    profile: Annotated[Optional[str], typer.Option(
        help="cost-model profile for predicted_s (default: cpu-2core on cpu, default on cuda)")] = None,
    config: ConfigFile = None,
    out: Out = Path("runs/replay"),
    overwrite: Overwrite = False,
    block_size: BlockSize = None,
    num_gpu_blocks: Annotated[Optional[int], typer.Option(
        help="KV pool size in blocks (required on cpu; small pools create memory pressure)")] = None,
    max_num_seqs: MaxNumSeqs = None,
    max_num_batched_tokens: MaxNumBatchedTokens = None,
    scheduling_policy: SchedulingPolicy = None,
    policy: Policy = None,
    budget: Budget = None,
    layout: Layout = None,
    slot_strategy: SlotStrategy = None,
    rate_scale: RateScale = None,
    max_requests: MaxRequests = None,
    request_rate: RequestRate = None,
    burstiness: Burstiness = None,
    max_concurrency: MaxConcurrency = None,
    metric_percentiles: MetricPercentiles = None,
    trace_format: TraceFormat = None,
    trace_columns: TraceColumns = None,
    time_unit: TimeUnit = None,
    tokenizer: Tokenizer = None,
    slo_ttft: SloTtft = None,
    slo_tpot: SloTpot = None,
    seed: Annotated[Optional[int], typer.Option(help="seeds prompts (per request id) and random weights")] = None,
    set_: Sets = [],
    attention_stats: Annotated[bool, typer.Option(
        "--attention-stats/--no-attention-stats",
        help="record per-head attention statistics at the end of each prefill")] = True,
    check_invariants: CheckInvariants = None,
    quiet: Quiet = False,
) -> None:
    """Replay a trace on the real model (SmolLM2-135M from its GGUF, or random weights at any catalog
    shape), executing and timing every engine step; writes requests.parquet, steps.parquet,
    summary.json, config.yaml (as `kvsim simulate`) plus tokens.parquet, decisions.parquet and
    attention_stats.parquet into --out. Ctrl-C writes a partial result."""
    from kvsim.sim.config import ConfigError, load_config

    from .simulate import print_summary, refuse_ineffective_kv

    overrides = config_overrides(
        trace=trace, model=model, gpu=gpu, profile=profile, seed=seed, check_invariants=check_invariants,
        block_size=block_size, num_gpu_blocks=num_gpu_blocks, max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens, scheduling_policy=scheduling_policy, policy=policy,
        budget=budget, layout=layout, slot_strategy=slot_strategy, rate_scale=rate_scale,
        max_requests=max_requests, request_rate=request_rate, burstiness=burstiness,
        max_concurrency=max_concurrency, metric_percentiles=metric_percentiles,
        trace_format=trace_format, trace_columns=trace_columns, time_unit=time_unit, tokenizer=tokenizer, slo_ttft=slo_ttft, slo_tpot=slo_tpot)
    try:
        cfg = load_config(config, overrides, set_)
        refuse_ineffective_kv(cfg.kv)
        from kvsim.sim.io.result_dirs import check_out_dir, check_out_owner
        check_out_dir(out)                  # before the model loads
        check_out_owner(out, overwrite=overwrite)
        from kvsim.gpu.replay import ReplayOptions, resolve_device, run_replay
        dev = resolve_device(device)
        apply_device_defaults(cfg, dev, weights)
        if cfg.engine.max_model_len is not None:        # before the model loads (the run plan checks it too)
            from kvsim.sim.model.catalog import get_model
            from kvsim.sim.model.defaults import check_max_model_len
            check_max_model_len(cfg.engine.max_model_len, get_model(cfg.model))
        if threads is not None:
            if threads < 1:
                raise ValueError(f"--threads must be at least 1, got {threads}")
            import torch
            torch.set_num_threads(threads)
        opts = ReplayOptions(device=device, weights=weights, dtype=dtype, layers=layers,
                             attention_stats=attention_stats, clock=clock, overwrite=overwrite)
        from .simulate import interrupt_on_sigterm
        with interrupt_on_sigterm():    # SIGTERM ends the replay like Ctrl-C: a partial result, exit 130
            result = run_replay(cfg, out, options=opts, progress=not quiet)
    except KeyboardInterrupt as exc:    # before the engine ran (loading the model): nothing to keep
        from .simulate import partial_exit
        partial_exit(out, str(exc) or "interrupted (Ctrl-C)")
    except (ConfigError, ValueError, FileNotFoundError) as exc:
        fail(str(exc))
    s = result.summary
    if not quiet:
        print_summary(s)
        console.print(f"measured step time {s['measured_step_time_s']:.3f} s, predicted "
                      f"{s['predicted_step_time_s']:.3f} s ({s['gpu']}, profile {cfg.profile}); "
                      f"{s['device']} {s['dtype']}, load average {s['load_avg_1m']:.2f}")
    if result.partial:
        console.print(f"[yellow]interrupted: partial result ({s['num_finished']} of {s['num_trace_requests']} "
                      f"requests finished, {s.get('num_steps', 0)} steps)[/yellow]")
    console.print(f"wrote {out}/requests.parquet, steps.parquet, summary.json, config.yaml, tokens.parquet, "
                  f"decisions.parquet, attention_stats.parquet")
    if result.partial:
        raise typer.Exit(130)


_CUDA_NAMES = (("H200", "h200"), ("H100", "h100"), ("A100", "a100-80gb"), ("L40", "l40"), ("L4", "l4"), ("T4", "t4"))


def apply_device_defaults(cfg, device, weights: str) -> None:
    """Model, hardware spec and profile the user did not set follow the device and weights."""
    explicit = cfg.model_fields_set
    if "model" not in explicit and weights == "smollm2":
        cfg.model = "smollm2-135m"
    if device.type == "cpu":
        if "gpu" not in explicit:
            cfg.gpu = "cpu-2core"
        if "profile" not in explicit:
            cfg.profile = "cpu-2core"
    elif "gpu" not in explicit:
        import torch
        name = torch.cuda.get_device_name(device)
        cfg.gpu = next((key for label, key in _CUDA_NAMES if label in name), "h100")
