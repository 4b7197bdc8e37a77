"""`kvsim replay`: run a trace on the real backend through the shared engine core."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

console = Console()


def replay(
    trace: Optional[str] = typer.Option(None, help="shipped trace name or trace file"),
    model: Optional[str] = typer.Option(None, help="catalog model; smollm2-135m with --weights smollm2 (default)"),
    weights: str = typer.Option("smollm2", help="smollm2 (the real GGUF) | random (seeded, any catalog shape)"),
    device: str = typer.Option("cpu", help="cpu | cuda | cuda:N"),
    dtype: Optional[str] = typer.Option(None, help="float32 | float16 | bfloat16 (default: float32 on cpu, "
                                                   "bfloat16 on cuda)"),
    layers: Optional[int] = typer.Option(None, help="run only the first N layers (quick runs)"),
    threads: Optional[int] = typer.Option(None, help="torch CPU threads (default: torch's choice)"),
    clock: str = typer.Option("wall", help="step timer: wall | cpu (the thread's CPU time, so other processes' "
                                           "load does not count; device cpu with --threads 1)"),
    gpu: Optional[str] = typer.Option(None, help="hardware spec for predicted_s (default: cpu-2core on cpu, "
                                                 "the matching catalog GPU on cuda)"),
    profile: Optional[str] = typer.Option(None, help="cost-model profile for predicted_s (default: cpu-2core on "
                                                     "cpu, default on cuda)"),
    config: Optional[Path] = typer.Option(None, "--config", "-c", help="YAML config file; options override it"),
    out: Path = typer.Option(Path("runs/replay"), "--out", "-o", help="output directory"),
    block_size: Optional[int] = typer.Option(None, help="tokens per KV block"),
    num_gpu_blocks: Optional[int] = typer.Option(None, help="KV pool size in blocks (required on cpu; small pools "
                                                            "create memory pressure)"),
    max_num_seqs: Optional[int] = typer.Option(None),
    max_num_batched_tokens: Optional[int] = typer.Option(None, help="token budget per step"),
    scheduling_policy: Optional[str] = typer.Option(None, help="fcfs | priority"),
    policy: Optional[str] = typer.Option(None, help="KV policy: none, streaming, h2o, snapkv, pyramidkv, "
                                                    "ada_snapkv, kvcompress, leankv, quest, tokenselect"),
    budget: Optional[int] = typer.Option(None, help="tokens kept per head (policies with a budget)"),
    layout: Optional[str] = typer.Option(None, help="shared | per_head"),
    slot_strategy: Optional[str] = typer.Option(None, help="noop | free_block | slot_reuse | sparse_copy | holed_copy | "
                                                           "compact | parallel_compact"),
    rate_scale: Optional[float] = typer.Option(None, help="arrival-rate multiplier"),
    max_requests: Optional[int] = typer.Option(None, help="first N requests of the trace"),
    slo_ttft: Optional[str] = typer.Option(None, help="TTFT SLO for goodput, with unit (2s, 500ms)"),
    slo_tpot: Optional[str] = typer.Option(None, help="TPOT SLO for goodput, with unit (100ms)"),
    seed: Optional[int] = typer.Option(None, help="seeds prompts (per request id) and random weights"),
    set_: list[str] = typer.Option([], "--set", help="any config key, dotted: kv.params.window=64"),
    attention_stats: bool = typer.Option(True, "--attention-stats/--no-attention-stats",
                                         help="record per-head attention statistics at the end of each prefill"),
    check_invariants: bool = typer.Option(False, "--check-invariants",
                                          help="check KV invariants and the cache's live mask every step"),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="no progress bar or table"),
) -> None:
    """Replay a trace on the real model (SmolLM2-135M from its GGUF, or random weights at any catalog
    shape), executing and timing every engine step; writes requests.parquet, steps.parquet,
    summary.json, config.yaml (as `kvsim simulate`) plus tokens.parquet, decisions.parquet and
    attention_stats.parquet into --out. Ctrl-C writes a partial result."""
    from kvsim.sim.commands import print_summary
    from kvsim.sim.config import ConfigError, load_config

    overrides = {
        "trace": trace, "model": model, "gpu": gpu, "profile": profile, "seed": seed,
        "check_invariants": check_invariants or None,
        "engine.block_size": block_size, "engine.num_gpu_blocks": num_gpu_blocks,
        "engine.max_num_seqs": max_num_seqs, "engine.max_num_batched_tokens": max_num_batched_tokens,
        "engine.scheduling_policy": scheduling_policy,
        "kv.policy": policy, "kv.budget": budget, "kv.layout": layout, "kv.slot_strategy": slot_strategy,
        "trace_options.rate_scale": rate_scale, "trace_options.max_requests": max_requests,
        "slo.ttft": slo_ttft, "slo.tpot": slo_tpot,
    }
    try:
        cfg = load_config(config, overrides, set_)
        from kvsim.sim.results import check_out_dir
        check_out_dir(out)                  # before the model loads
        from kvsim.gpu.replay import ReplayOptions, resolve_device, run_replay
        dev = resolve_device(device)
        apply_device_defaults(cfg, dev, weights)
        if threads is not None:
            if threads < 1:
                raise ValueError(f"--threads must be at least 1, got {threads}")
            import torch
            torch.set_num_threads(threads)
        opts = ReplayOptions(device=device, weights=weights, dtype=dtype, layers=layers,
                             attention_stats=attention_stats, clock=clock)
        result = run_replay(cfg, out, options=opts, progress=not quiet)
    except (ConfigError, ValueError, FileNotFoundError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2)
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
