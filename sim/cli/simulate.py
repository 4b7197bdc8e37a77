"""`kvsim simulate`: run one simulation from a config file and/or options."""
from __future__ import annotations

import gc
import json
import math
import signal
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table

from kvsim.sim.config import ConfigError, KVConfig, load_config

from .options import (BlockSize, Budget, Burstiness, CheckInvariants, ChunkedPrefill, EndS, ExpertParallel,
                      LongPrefillTokenThreshold,
                      MaxModelLen, StartS, ConfigFile, Gpu, Layout, MaxConcurrency,
                      MetricPercentiles, MaxNumBatchedTokens, MaxNumSeqs, MaxRequests, Model, NumGpuBlocks, Out, Overwrite,
                      Policy, PrefixCaching,
                      Profile, Quiet, RateScale, Replicas, RequestRate, SchedulingPolicy, Seed, Sets, SloTpot, SloTtft,
                      SlotStrategy, TimeUnit, Tokenizer, TraceColumns, TraceFormat, Tp, Trace, config_overrides, fail)

console = Console()


def simulate(
    trace: Trace = None,
    model: Model = None,
    gpu: Gpu = None,
    config: ConfigFile = None,
    out: Out = Path("runs/latest"),
    overwrite: Overwrite = False,
    tp: Tp = None,
    replicas: Replicas = None,
    router: Annotated[Optional[str], typer.Option(help="round_robin | least_outstanding")] = None,
    profile: Profile = None,
    block_size: BlockSize = None,
    num_gpu_blocks: NumGpuBlocks = None,
    max_num_seqs: MaxNumSeqs = None,
    max_num_batched_tokens: MaxNumBatchedTokens = None,
    prefix_caching: PrefixCaching = None,
    max_model_len: MaxModelLen = None,
    long_prefill_token_threshold: LongPrefillTokenThreshold = None,
    chunked_prefill: ChunkedPrefill = None,
    expert_parallel: ExpertParallel = None,
    preemption_mode: Annotated[Optional[str], typer.Option(help="recompute | swap")] = None,
    scheduling_policy: SchedulingPolicy = None,
    policy: Policy = None,
    budget: Budget = None,
    layout: Layout = None,
    slot_strategy: SlotStrategy = None,
    kv_mode: Annotated[Optional[str], typer.Option(
        help="token (exact token-level state) | fast (block occupancy)")] = None,
    compression_rate: Annotated[Optional[float], typer.Option(
        help="KV compression rate r >= 1 (kvcompress, snapkv, pyramidkv, ada_snapkv: keep tokens / r); "
             "= kv.params.compression_rate")] = None,
    weight_dtype: Annotated[Optional[str], typer.Option(
        help="weight dtype of the decoder-layer linears (fp16, bf16, fp8, int8, int4); default: the catalog's")] = None,
    kv_dtype: Annotated[Optional[str], typer.Option(help="KV cache dtype (e.g. fp8); default: the model's")] = None,
    rate_scale: RateScale = None,
    max_requests: MaxRequests = None,
    start_s: StartS = None,
    end_s: EndS = None,
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
    seed: Seed = None,
    set_: Sets = [],
    fast_forward: Annotated[Optional[bool], typer.Option(
        "--fast-forward/--no-fast-forward", help="advance pure-decode runs in bulk (identical results)")] = None,
    check_invariants: CheckInvariants = None,
    client_latency: Annotated[Optional[bool], typer.Option(
        "--client-latency/--engine-only", help="add the profile's client-side terms (API server, tokenization, "
        "detokenization) to TTFT/TPOT/ITL/E2E, as `vllm bench serve` measures; default: engine time only")] = None,
    quiet: Quiet = False,
) -> None:
    """Simulate a trace on a model/GPU/engine config; writes requests.parquet, steps.parquet,
    summary.json and config.yaml into --out and prints a summary table."""
    overrides = config_overrides(
        trace=trace, model=model, gpu=gpu, tp=tp, replicas=replicas, router=router, profile=profile, seed=seed,
        weight_dtype=weight_dtype, kv_dtype=kv_dtype, fast_forward=fast_forward, check_invariants=check_invariants,
        client_latency=client_latency,
        block_size=block_size, num_gpu_blocks=num_gpu_blocks, max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens, prefix_caching=prefix_caching,
        max_model_len=max_model_len, long_prefill_token_threshold=long_prefill_token_threshold,
        chunked_prefill=chunked_prefill, expert_parallel=expert_parallel, start_s=start_s, end_s=end_s,
        preemption_mode=preemption_mode, scheduling_policy=scheduling_policy, policy=policy, budget=budget,
        layout=layout, slot_strategy=slot_strategy, kv_mode=kv_mode, compression_rate=compression_rate,
        rate_scale=rate_scale, max_requests=max_requests, request_rate=request_rate, burstiness=burstiness,
        max_concurrency=max_concurrency, metric_percentiles=metric_percentiles,
        trace_format=trace_format, trace_columns=trace_columns, time_unit=time_unit, tokenizer=tokenizer, slo_ttft=slo_ttft, slo_tpot=slo_tpot)
    try:
        cfg = load_config(config, overrides, set_)
        refuse_ineffective(cfg)
        from kvsim.sim.simulator.simulate import run_simulation
        gc.disable()      # a short-lived process of many long-lived objects: the cyclic collector only costs
        with interrupt_on_sigterm():
            result = run_simulation(cfg, out, progress=not quiet, keep_steps=False, overwrite=overwrite)
    except KeyboardInterrupt as exc:
        partial_exit(out, str(exc) or "interrupted (Ctrl-C)")
    except (ConfigError, ValueError, FileNotFoundError) as exc:
        fail(str(exc))
    except OSError as exc:          # writing the results (disk full, ...): the previous results are intact
        fail(f"--out {out}: cannot write the results: {exc.strerror or exc}", code=1)
    if not quiet:
        print_summary(result.summary)
    console.print(f"wrote {out}/requests.parquet, steps.parquet, summary.json, config.yaml")


def refuse_ineffective(cfg) -> None:
    """Options that would change nothing in this run, or that vLLM cannot run, are a mistake to say, not to
    ignore."""
    from kvsim.sim.model.catalog import get_gpu, get_model, normalize_dtype

    gpu = get_gpu(cfg.gpu)
    weights = normalize_dtype(cfg.weight_dtype) if cfg.weight_dtype else get_model(cfg.model).weight_dtype
    if weights == "fp8" and gpu.kind == "gpu" and not {"fp8", "bf16"} & set(gpu.tflops):
        raise ConfigError(f"--weight-dtype fp8: {gpu.name} predates Ampere; vLLM runs FP8 weights only on compute "
                          "capability 8.0+ (Marlin weight-only on Ampere, native FP8 on Ada/Hopper); expected "
                          "int8, int4 or fp16 weights on it")
    refuse_ineffective_kv(cfg.kv)


def refuse_ineffective_kv(kv) -> None:
    """KV options that the run's policy would silently ignore (simulate and replay, before the run)."""
    from kvsim.sim.kv.build import build_policy, refuse_ignored_kv_options

    if kv.policy == "none":
        if kv.budget is not None:
            raise ConfigError("--budget (kv.budget): policy none keeps every token; a budget needs an eviction "
                              "policy (--policy h2o, snapkv, ...)")
        if "compression_rate" in kv.params:
            raise ConfigError("--compression-rate (kv.params.compression_rate): policy none compresses nothing; "
                              "give --policy kvcompress, snapkv, pyramidkv or ada_snapkv")
        if kv.mode == "fast" and kv.layout == "shared":
            raise ConfigError("--kv-mode fast (kv.mode): with policy none and the shared layout the plain vLLM "
                              "KV manager runs, which has no fast mode; drop it or give an eviction policy")
        if kv.slot_strategy != KVConfig.model_fields["slot_strategy"].default:
            raise ConfigError(f"--slot-strategy {kv.slot_strategy} (kv.slot_strategy): policy none evicts nothing, "
                              "so no slot strategy applies; drop it or give an eviction policy (--policy h2o, ...)")
    refuse_ignored_kv_options(kv, build_policy(kv))


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
    """vllm bench serve's report (its names and units), then kvsim's own figures (KV memory, the engine)."""
    from kvsim.sim.results.vllm_metrics import report_lines

    if "completed" in s:
        console.print("\n".join(report_lines(s)), markup=False, highlight=False)
    table = Table(title=f"{s.get('trace')} on {s.get('model')} / {s.get('tp')}x {s.get('gpu')}")
    table.add_column("kvsim")
    table.add_column("value", justify="right")

    def add(name, value, fmt="{:.3f}"):
        if value is None or (isinstance(value, float) and math.isnan(value)):
            return
        table.add_row(name, fmt.format(value) if isinstance(value, float) else str(value))

    add("requests (finished / rejected)", f"{s['num_finished']} / {s['num_rejected']}")
    add("KV pool", f"{s['num_gpu_blocks']} blocks x {s['block_size']} tokens")
    add("makespan, first arrival to last token (s)", s["makespan_s"], "{:.1f}")
    add("queueing p50 / p99 (ms)", " / ".join(f"{1e3 * s[f'queueing_p{q}_s']:.1f}" for q in (50, 99)))
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
    if s.get("bench_comparison"):
        print_comparison(s["bench_comparison"])


def print_comparison(agg: dict) -> None:
    from kvsim.sim.results.bench_compare import report_rows

    table = Table(title=f"predicted vs measured (vllm bench serve result, {agg['num_requests']} requests)")
    for name in ("figure", "measured", "kvsim", "error"):
        table.add_column(name, justify="left" if name == "figure" else "right")
    for row in report_rows(agg):
        table.add_row(*row)
    console.print(table)
