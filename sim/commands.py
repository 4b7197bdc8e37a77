"""`kvsim simulate`: run one simulation from a config file and/or options."""
from __future__ import annotations

import gc
import json
import math
import signal
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from .config import ConfigError, load_config

console = Console()


def simulate(
    trace: Optional[str] = typer.Option(None, help="shipped trace name (azure-conv-2023, ...) or trace file"),
    model: Optional[str] = typer.Option(None, help="catalog model (llama-3.1-8b, ...) or YAML file"),
    gpu: Optional[str] = typer.Option(None, help="catalog GPU (h100, l4, a100, ...) or YAML file"),
    config: Optional[Path] = typer.Option(None, "--config", "-c", help="YAML config file; options override it"),
    out: Path = typer.Option(Path("runs/latest"), "--out", "-o", help="output directory"),
    tp: Optional[int] = typer.Option(None, help="tensor parallel degree"),
    replicas: Optional[int] = typer.Option(None, help="engine replicas behind the router"),
    router: Optional[str] = typer.Option(None, help="round_robin | least_outstanding"),
    profile: Optional[str] = typer.Option(None, help="hardware profile name or file (efficiency factors)"),
    block_size: Optional[int] = typer.Option(None, help="tokens per KV block"),
    num_gpu_blocks: Optional[int] = typer.Option(None, help="KV pool size in blocks (default: from GPU memory)"),
    max_num_seqs: Optional[int] = typer.Option(None),
    max_num_batched_tokens: Optional[int] = typer.Option(None, help="token budget per step"),
    prefix_caching: Optional[bool] = typer.Option(None, "--prefix-caching/--no-prefix-caching"),
    preemption_mode: Optional[str] = typer.Option(None, help="recompute | swap"),
    scheduling_policy: Optional[str] = typer.Option(None, help="fcfs | priority"),
    policy: Optional[str] = typer.Option(None, help="KV eviction/compression policy (none, streaming, h2o, snapkv, "
                                         "pyramidkv, ada_snapkv, kvcompress, leankv, quest, tokenselect, recorded)"),
    budget: Optional[int] = typer.Option(None, help="tokens kept per KV head (budgeted policies)"),
    layout: Optional[str] = typer.Option(None, help="KV layout: shared | per_head"),
    slot_strategy: Optional[str] = typer.Option(None, help="noop | free_block | slot_reuse | sparse_copy | holed_copy | compact "
                                                "| parallel_compact"),
    kv_mode: Optional[str] = typer.Option(None, help="token (exact token-level state) | fast (block occupancy)"),
    compression_rate: Optional[float] = typer.Option(None, help="KV compression rate r >= 1 (kvcompress, snapkv, "
                                                     "pyramidkv, ada_snapkv: keep tokens / r); = kv.params.compression_rate"),
    weight_dtype: Optional[str] = typer.Option(None, help="weight dtype of the decoder-layer linears (fp16, bf16, "
                                               "fp8, int8, int4); default: the catalog's"),
    kv_dtype: Optional[str] = typer.Option(None, help="KV cache dtype (e.g. fp8); default: the model's"),
    rate_scale: Optional[float] = typer.Option(None, help="arrival-rate multiplier"),
    max_requests: Optional[int] = typer.Option(None, help="first N requests of the trace"),
    slo_ttft: Optional[str] = typer.Option(None, help="TTFT SLO for goodput, with unit (2s, 500ms)"),
    slo_tpot: Optional[str] = typer.Option(None, help="TPOT SLO for goodput, with unit (100ms)"),
    seed: Optional[int] = typer.Option(None),
    set_: list[str] = typer.Option([], "--set", help="any config key, dotted: engine.long_prefill_token_threshold=512"),
    fast_forward: Optional[bool] = typer.Option(None, "--fast-forward/--no-fast-forward",
                                                help="advance pure-decode runs in bulk (identical results)"),
    check_invariants: Optional[bool] = typer.Option(None, "--check-invariants", help="check KV invariants every step"),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="no progress bar or table"),
) -> None:
    """Simulate a trace on a model/GPU/engine config; writes requests.parquet, steps.parquet,
    summary.json and config.yaml into --out and prints a summary table."""
    overrides = {
        "trace": trace, "model": model, "gpu": gpu, "tp": tp, "replicas": replicas, "router": router,
        "profile": profile, "seed": seed, "weight_dtype": weight_dtype, "kv_dtype": kv_dtype, "fast_forward": fast_forward, "check_invariants": check_invariants,
        "engine.block_size": block_size, "engine.num_gpu_blocks": num_gpu_blocks,
        "engine.max_num_seqs": max_num_seqs, "engine.max_num_batched_tokens": max_num_batched_tokens,
        "engine.enable_prefix_caching": prefix_caching, "engine.preemption_mode": preemption_mode,
        "engine.scheduling_policy": scheduling_policy,
        "kv.policy": policy, "kv.budget": budget, "kv.layout": layout, "kv.slot_strategy": slot_strategy,
        "kv.mode": kv_mode, "kv.params.compression_rate": compression_rate,
        "trace_options.rate_scale": rate_scale, "trace_options.max_requests": max_requests,
        "slo.ttft": slo_ttft, "slo.tpot": slo_tpot,
    }
    try:
        cfg = load_config(config, overrides, set_)
        from .simulate import run_simulation
        gc.disable()      # a short-lived process of many long-lived objects: the cyclic collector only costs
        with interrupt_on_sigterm():
            result = run_simulation(cfg, out, progress=not quiet, keep_steps=False)
    except KeyboardInterrupt as exc:
        partial_exit(out, str(exc) or "interrupted (Ctrl-C)")
    except (ConfigError, ValueError, FileNotFoundError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2)
    except OSError as exc:          # writing the results (disk full, ...): the previous results are intact
        typer.echo(f"error: --out {out}: cannot write the results: {exc.strerror or exc}", err=True)
        raise typer.Exit(1)
    if not quiet:
        print_summary(result.summary)
    console.print(f"wrote {out}/requests.parquet, steps.parquet, summary.json, config.yaml")


@contextmanager
def interrupt_on_sigterm():
    """SIGTERM (kill) ends the run like Ctrl-C: with a partial result instead of nothing."""
    def stop(signum, frame):
        raise KeyboardInterrupt("terminated (SIGTERM)")
    try:
        previous = signal.signal(signal.SIGTERM, stop)
    except ValueError:              # not the main thread: leave the handler alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def partial_exit(out: Path, reason: str) -> None:
    try:
        partial = json.loads((out / "summary.json").read_text()).get("partial")
    except (OSError, ValueError, AttributeError):
        partial = False
    if partial:
        typer.echo(f"{reason}: partial results in {out} (summary.json: partial: true)", err=True)
    else:
        typer.echo(f"{reason}: no results written", err=True)
    raise typer.Exit(130)


def print_summary(s: dict) -> None:
    table = Table(title=f"{s.get('trace')} on {s.get('model')} / {s.get('tp')}x {s.get('gpu')}")
    table.add_column("metric")
    table.add_column("value", justify="right")

    def add(name, value, fmt="{:.3f}"):
        if value is None or (isinstance(value, float) and math.isnan(value)):
            return
        table.add_row(name, fmt.format(value) if isinstance(value, float) else str(value))

    add("requests (finished / rejected)", f"{s['num_finished']} / {s['num_rejected']}")
    add("KV pool", f"{s['num_gpu_blocks']} blocks x {s['block_size']} tokens")
    add("makespan (s)", s["makespan_s"], "{:.1f}")
    add("throughput (req/s)", s["throughput_req_s"])
    add("output tok/s", s["throughput_output_tok_s"], "{:.1f}")
    add("total tok/s", s["throughput_total_tok_s"], "{:.1f}")
    for m in ("ttft", "tpot", "e2e", "itl"):
        add(f"{m.upper()} p50 / p90 / p99 (ms)",
            " / ".join(f"{1e3 * s[f'{m}_p{q}_s']:.1f}" for q in (50, 90, 99)))
    add("goodput (req/s)", s.get("goodput_req_s"))
    add("SLO attainment", s.get("slo_attainment"))
    add("KV utilization mean / max", f"{s.get('kv_util_mean', 0):.3f} / {s.get('kv_util_max', 0):.3f}")
    add("fragmentation mean / p99", f"{s.get('fragmentation_mean', 0):.3f} / {s.get('fragmentation_p99', 0):.3f}")
    add("preemptions", s.get("preemptions"))
    add("compression ratio", s.get("compression_ratio"))
    add("attention mass retained (mean)", s.get("attention_mass_retained_mean"))
    add("tokens evicted (token x head)", s.get("evicted_tokens"), "{:.0f}")
    add("MB copied/moved", s["bytes_moved"] / 1e6 if s.get("bytes_moved") is not None else None, "{:.1f}")
    add("prefix hit rate", s.get("prefix_hit_rate"))
    add("engine steps", s.get("num_steps"))
    add("wall time (s)", s.get("wall_s"), "{:.2f}")
    console.print(table)
