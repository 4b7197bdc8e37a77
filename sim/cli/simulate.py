"""`kvsim simulate`: run one simulation from a config file and/or options."""
from __future__ import annotations

import gc
import json
import math
import signal
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from .vllm_args import VllmOptions

from .options import (DataParallel, KvOffload, PipelineParallel, RouterName, Sessions, SpeculativeConfigOpt, ThinkTime,
                      parse_speculative_config, tier_overrides)
from .options import (BlockSize, Budget, Burstiness, CheckInvariants, EndS, ExpertParallel, Frontend, FrontendJitter,
                      LongPrefillTokenThreshold,
                      MaxModelLen, StartS, ConfigFile, Gpu, Layout, MaxConcurrency,
                      MetricPercentiles, MaxNumBatchedTokens, MaxNumSeqs, RequestTimeout, StepVariance, Model, NumGpuBlocks, Out, Overwrite,
                      Policy, Profile, Quiet, RateScale, Replicas, RequestRate, SchedulingPolicy, Seed, Sets, SloTpot, SloTtft,
                      SlotStrategy, TimeUnit, Tokenizer, TraceColumns, TraceFormat, Trace, config_overrides, fail,
                      table_console)

console = Console()


def simulate(
    trace: Trace = None,
    workload: Annotated[str | None, typer.Option(
        help="a workload spec YAML (clients and load: arrival process, lengths, shared prefixes, client classes "
             "with their SLOs; docs/traces.md#workload-specs) or an inference-perf config, instead of --trace")] = None,
    model: Model = None,
    gpu: Gpu = None,
    config: ConfigFile = None,
    out: Out = Path("runs/latest"),
    overwrite: Overwrite = False,
    tp: Annotated[int | None, typer.Option("--tp", "-tp", "--tensor-parallel-size",
                                              help="tensor parallel degree (vLLM's -tp)")] = None,
    pp: PipelineParallel = None,
    dp: DataParallel = None,
    replicas: Replicas = None,
    router: RouterName = None,
    kv_offload: KvOffload = None,
    sessions: Sessions = False,
    think_time: ThinkTime = None,
    speculative_config: SpeculativeConfigOpt = None,
    profile: Profile = None,
    block_size: BlockSize = None,
    num_gpu_blocks: NumGpuBlocks = None,
    max_num_seqs: MaxNumSeqs = None,
    max_num_batched_tokens: MaxNumBatchedTokens = None,
    prefix_caching: Annotated[bool | None, typer.Option(
        "--prefix-caching/--no-prefix-caching", "--enable-prefix-caching/--no-enable-prefix-caching",
        help="automatic prefix caching (default: vLLM's)")] = None,
    max_model_len: MaxModelLen = None,
    long_prefill_token_threshold: LongPrefillTokenThreshold = None,
    chunked_prefill: Annotated[bool | None, typer.Option(
        "--chunked-prefill/--no-chunked-prefill", "--enable-chunked-prefill/--no-enable-chunked-prefill",
        help="chunked prefill (default: on, as vLLM V1)")] = None,
    gpu_memory_utilization: Annotated[float | None, typer.Option(
        help="share of GPU memory vLLM takes (weights, activations, KV pool); default 0.9")] = None,
    expert_parallel: ExpertParallel = None,
    preemption_mode: Annotated[str | None, typer.Option(help="recompute | swap")] = None,
    scheduling_policy: SchedulingPolicy = None,
    policy: Policy = None,
    budget: Budget = None,
    layout: Layout = None,
    slot_strategy: SlotStrategy = None,
    kv_mode: Annotated[str | None, typer.Option(
        help="token (exact token-level state) | fast (block occupancy)")] = None,
    compression_rate: Annotated[float | None, typer.Option(
        help="KV compression rate r >= 1 (kvcompress, snapkv, pyramidkv, ada_snapkv: keep tokens / r); "
             "= kv.params.compression_rate")] = None,
    weight_dtype: Annotated[str | None, typer.Option(
        help="weight dtype of the decoder-layer linears (fp16, bf16, fp8, int8, int4); default: the catalog's")] = None,
    kv_dtype: Annotated[str | None, typer.Option(
        "--kv-dtype", "--kv-cache-dtype", help="KV cache dtype (e.g. fp8; auto: the model's, the default)")] = None,
    dtype: Annotated[str | None, typer.Option(
        help="as vllm serve --dtype: auto, half, float16, bfloat16, float32 (the unquantized weights' dtype)")] = None,
    quantization: Annotated[str | None, typer.Option(
        "--quantization", "-q", help="as vllm serve --quantization: fp8 (FP8 weights), awq, gptq, ... (4-bit)")] = None,
    vllm: Annotated[str | None, typer.Option(
        "--vllm", help="a pasted `vllm serve MODEL ...` command line, read with vLLM's flags (docs/simulate.md)")] = None,
    bench: Annotated[str | None, typer.Option(
        "--bench", help="a pasted `vllm bench serve ...` command line: its dataset, load and goodput")] = None,
    rate_scale: RateScale = None,
    max_requests: Annotated[int | None, typer.Option(
        "--max-requests", "--num-prompts", help="first N requests of the trace (--trace random: how many; "
                                                "default 1000, as vllm bench serve)")] = None,
    dataset_name: Annotated[str | None, typer.Option(
        help="as vllm bench serve: random (--trace random) or sharegpt (with --dataset-path)")] = None,
    dataset_path: Annotated[str | None, typer.Option(help="as vllm bench serve: the dataset file (= --trace)")] = None,
    random_input_len: Annotated[int | None, typer.Option(
        help="--trace random: prompt tokens (default 1024), = trace_options.random.input_len")] = None,
    random_output_len: Annotated[int | None, typer.Option(
        help="--trace random: output tokens (default 128)")] = None,
    random_range_ratio: Annotated[float | None, typer.Option(
        help="--trace random: lengths uniform in L(1-r)..L(1+r), 0 <= r < 1 (default 0)")] = None,
    random_prefix_len: Annotated[int | None, typer.Option(
        help="--trace random: tokens every prompt shares before its own (default 0)")] = None,
    goodput: Annotated[list[str] | None, typer.Option(
        help="as vllm bench serve: ttft:MS or tpot:MS (repeat the option for both) = --slo-ttft/--slo-tpot")] = None,
    start_s: StartS = None,
    end_s: EndS = None,
    request_rate: RequestRate = None,
    burstiness: Burstiness = None,
    max_concurrency: MaxConcurrency = None,
    request_timeout: RequestTimeout = None,
    step_variance: StepVariance = None,
    metric_percentiles: MetricPercentiles = None,
    trace_format: TraceFormat = None,
    trace_columns: TraceColumns = None,
    time_unit: TimeUnit = None,
    tokenizer: Tokenizer = None,
    slo_ttft: SloTtft = None,
    slo_tpot: SloTpot = None,
    seed: Seed = None,
    set_: Sets = [],
    fast_forward: Annotated[bool | None, typer.Option(
        "--fast-forward/--no-fast-forward", help="advance pure-decode runs in bulk (identical results)")] = None,
    check_invariants: CheckInvariants = None,
    client_latency: Annotated[bool | None, typer.Option(
        "--client-latency/--engine-only", help="add the profile's client-side terms (API server, tokenization, "
        "detokenization) to TTFT/TPOT/ITL/E2E, as `vllm bench serve` measures (= --frontend profile); default: "
        "engine time only")] = None,
    frontend: Frontend = None,
    frontend_jitter: FrontendJitter = None,
    prefill_pool: Annotated[list[str] | None, typer.Option(
        help="disaggregated: the prefill pool as GPU[:tpN][:xN] (e.g. h100:tp1:x2: two H100 replicas of TP1); "
             "with --decode-pool (= fleet.prefill); repeat it for several prefill pools (prefill-0, prefill-1, ...)")] = None,
    decode_pool: Annotated[list[str] | None, typer.Option(
        help="disaggregated: the decode pool as GPU[:tpN][:xN] (e.g. h200:tp2:x2) (= fleet.decode); repeat it for "
             "several decode pools (decode-0, decode-1, ...)")] = None,
    pool_choice: Annotated[str | None, typer.Option(
        help="disaggregated, several pools of a role: least_work (the least outstanding work over the pool's "
             "speed; default) or round_robin (every instance in turn, as vLLM's toy proxy) (= fleet.pool_choice)")] = None,
    link: Annotated[str | None, typer.Option(
        help="disaggregated: the prefill-to-decode link type (kvsim catalog links: ib-ndr, ib-hdr, roce-400g, "
             "roce-200g, roce-100g, nvlink4, nvlink5, pcie-gen5, pcie-gen4) (= fleet.link)")] = None,
    local_prefill_tokens: Annotated[int | None, typer.Option(
        help="disaggregated: prefill on the decode pool when the uncached prompt is at most this many tokens "
             "(conditional disaggregation; = fleet.local_prefill_tokens)")] = None,
    layerwise_overlap: Annotated[bool | None, typer.Option(
        "--layerwise-overlap/--no-layerwise-overlap",
        help="disaggregated: push the hand-off layer by layer while the prefill runs (LMCache / Mooncake style; "
             "default off: the pull starts after the prefill leg, as vLLM's NIXL connector) "
             "(= fleet.layerwise_overlap)")] = None,
    quiet: Quiet = False,
) -> None:
    """Simulate a trace on a model/GPU/engine config; writes requests.parquet, steps.parquet,
    summary.json and config.yaml into --out and prints a summary table."""
    # the config schema (pydantic, the catalogs, the policy registry) is imported when the command runs,
    # not with this module: `kvsim simulate --help` starts without it (bench/bench_startup.py)
    from kvsim.sim.config import ConfigError, load_config

    kv_dtype = None if kv_dtype is not None and kv_dtype.strip().lower() == "auto" else kv_dtype
    if workload is not None:
        if trace is not None:
            fail(f"--workload {workload} and --trace {trace}: give one (a workload spec is the run's trace)")
        trace = workload
    overrides = config_overrides(
        trace=trace, model=model, gpu=gpu, tp=tp, pp=pp, dp=dp, replicas=replicas, router=router, profile=profile,
        seed=seed,
        weight_dtype=weight_dtype, kv_dtype=kv_dtype, fast_forward=fast_forward, check_invariants=check_invariants,
        client_latency=client_latency, frontend=frontend,
        frontend_jitter=parse_sigma(frontend_jitter, "--frontend-jitter", "every request alike"),
        block_size=block_size, num_gpu_blocks=num_gpu_blocks, max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens, prefix_caching=prefix_caching,
        max_model_len=max_model_len, long_prefill_token_threshold=long_prefill_token_threshold,
        chunked_prefill=chunked_prefill, expert_parallel=expert_parallel, start_s=start_s, end_s=end_s,
        preemption_mode=preemption_mode, scheduling_policy=scheduling_policy, policy=policy, budget=budget,
        layout=layout, slot_strategy=slot_strategy, kv_mode=kv_mode, compression_rate=compression_rate,
        rate_scale=rate_scale, max_requests=max_requests, request_rate=request_rate, burstiness=burstiness,
        max_concurrency=max_concurrency, request_timeout=request_timeout,
        step_variance=parse_step_variance(step_variance), metric_percentiles=metric_percentiles,
        trace_format=trace_format, trace_columns=trace_columns, time_unit=time_unit, tokenizer=tokenizer, slo_ttft=slo_ttft, slo_tpot=slo_tpot,
        gpu_memory_utilization=gpu_memory_utilization, random_input_len=random_input_len,
        random_output_len=random_output_len, random_range_ratio=random_range_ratio, random_prefix_len=random_prefix_len)
    try:
        overrides = with_vllm_options(overrides, VllmOptions(
            serve=vllm, bench=bench, dtype=dtype, quantization=quantization, dataset_name=dataset_name,
            dataset_path=dataset_path, goodput=goodput))
        overrides.update(tier_overrides(kv_offload, sessions, think_time))
        overrides.update(parse_speculative_config(speculative_config))
        overrides.update(fleet_overrides(prefill_pool, decode_pool, link, local_prefill_tokens, layerwise_overlap))
        if pool_choice is not None:
            overrides["fleet.pool_choice"] = pool_choice
        cfg = load_config(config, overrides, set_)
        refuse_ineffective(cfg.gpu, cfg.model, cfg.weight_dtype)
        refuse_ineffective_kv(cfg.kv)
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
    tiers = ", tiers.parquet" if cfg.kv_offload is not None else ""
    console.print(f"wrote {out}/requests.parquet, steps.parquet, summary.json, config.yaml{tiers}")




def with_vllm_options(overrides: dict, options: VllmOptions) -> dict:
    """The kvsim options' overrides merged with what pasted vLLM lines and vLLM-only flags set. A key both set,
    to different values, is refused (naming both); notes and warnings print one line each."""
    from .vllm_args import translate_options
    from kvsim.sim.config import ConfigError

    translation = translate_options(options)
    merged = dict(overrides)
    for key, value in translation.overrides.items():
        given = merged.get(key)
        if given is not None and given != value:
            raise ConfigError(f"{key}: {given!r} from kvsim's option but {value!r} from the vLLM flags; give one")
        merged[key] = value
    for line in translation.notes:
        typer.echo(f"note: {line}", err=True)
    for line in translation.warnings:
        typer.echo(f"warning: {line}", err=True)
    return merged


def parse_step_variance(text: str | None) -> float | str | None:
    """--step-variance: auto, or a number (the config validates its range)."""
    return parse_sigma(text, "--step-variance", "deterministic")


def parse_sigma(text: str | None, option: str, zero: str) -> float | str | None:
    """A lognormal sigma option (--step-variance, --frontend-jitter): auto, or a number (the config
    validates its range); `zero`: what 0 means, for the error."""
    if text is None or text.strip().lower() == "auto":
        return None if text is None else "auto"
    try:
        return float(text)
    except ValueError:
        fail(f"{option} {text!r}: expected auto or a number such as 0.05 (0: {zero})")


def fleet_overrides(prefill_pool: str | list[str] | None, decode_pool: str | list[str] | None, link: str | None,
                    local_prefill_tokens: int | None, layerwise_overlap: bool | None = None) -> dict:
    """--prefill-pool/--decode-pool/--link/--local-prefill-tokens/--layerwise-overlap as dotted fleet.* overrides;
    a pool option given more than once is a list of pools of that role."""
    out: dict = {}
    for option, role, value in (("--prefill-pool", "prefill", prefill_pool), ("--decode-pool", "decode", decode_pool)):
        values = [value] if isinstance(value, str) else list(value or [])
        if len(values) == 1:
            out.update({f"fleet.{role}.{key}": v for key, v in parse_pool(values[0], option).items()})
        elif values:
            out[f"fleet.{role}"] = [parse_pool(v, option) for v in values]
    if link is not None:
        out["fleet.link"] = link
    if local_prefill_tokens is not None:
        out["fleet.local_prefill_tokens"] = local_prefill_tokens
    if layerwise_overlap is not None:
        out["fleet.layerwise_overlap"] = layerwise_overlap
    return out


def parse_pool(value: str, option: str) -> dict:
    """'h100:tp2:x3' -> {'gpu': 'h100', 'tp': 2, 'replicas': 3} (tp and x optional, any order after the GPU)."""
    from kvsim.sim.config import ConfigError
    gpu, *rest = value.split(":")
    out: dict = {"gpu": gpu}
    for part in rest:
        key, num = ("tp", part[2:]) if part.startswith("tp") else ("replicas", part[1:]) if part.startswith("x") else ("", "")
        if not key or not num.isdigit() or int(num) < 1 or key in out:
            raise ConfigError(f"{option} {value!r}: expected GPU[:tpN][:xN] with N a positive integer, e.g. h100:tp1:x2")
        out[key] = int(num)
    if not gpu:
        raise ConfigError(f"{option} {value!r}: expected a GPU name first, e.g. h100:tp1:x2")
    return out


def refuse_ineffective(gpu_name: str, model: str, weight_dtype: str | None) -> None:
    """Hardware options vLLM cannot run are a mistake to say, not to ignore (the KV options:
    `refuse_ineffective_kv`)."""
    from kvsim.sim.model.catalog import get_gpu, get_model, normalize_dtype
    from kvsim.sim.config import ConfigError

    gpu = get_gpu(gpu_name)
    weights = normalize_dtype(weight_dtype) if weight_dtype else get_model(model).weight_dtype
    if weights == "fp8" and gpu.kind == "gpu" and not {"fp8", "bf16"} & set(gpu.tflops):
        raise ConfigError(f"--weight-dtype fp8: {gpu.name} predates Ampere; vLLM runs FP8 weights only on compute "
                          "capability 8.0+ (Marlin weight-only on Ampere, native FP8 on Ada/Hopper); expected "
                          "int8, int4 or fp16 weights on it")


def refuse_ineffective_kv(kv) -> None:
    """KV options that the run's policy would silently ignore (simulate and replay, before the run)."""
    from kvsim.sim.config import ConfigError, KVConfig
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
    """Exit 130 saying where the interrupted run's partial result went: into --out, or beside a complete
    result it keeps (sim/results.py: OUT.partial)."""
    from kvsim.sim.io.result_dirs import PARTIAL_SUFFIX

    aside = Path(f"{out}{PARTIAL_SUFFIX}")
    if _is_partial(out):
        typer.echo(f"{reason}: partial results in {out} (summary.json: partial: true)", err=True)
    elif _is_partial(aside):
        typer.echo(f"{reason}: partial results in {aside} (summary.json: partial: true); {out} keeps the previous "
                   "complete result", err=True)
    else:
        typer.echo(f"{reason}: no results written", err=True)
    raise typer.Exit(130)


def _is_partial(out: Path) -> bool:
    try:
        return json.loads((out / "summary.json").read_text()).get("partial") is True
    except (OSError, ValueError, AttributeError):
        return False


def print_summary(s: dict) -> None:
    """vllm bench serve's report (its names and units), then kvsim's own figures (KV memory, the engine)."""
    from kvsim.sim.results.vllm_metrics import report_lines

    if "completed" in s:
        console.print("\n".join(report_lines(s)), markup=False, highlight=False)
    hardware = s.get("fleet") or f"{s.get('tp')}x {s.get('gpu')}"
    if s.get("gpus_per_replica"):        # pipeline stages or data-parallel attention ranks (docs/parallelism.md)
        hardware += f" x pp {s['pp']} x dp {s['dp']} = {s['gpus_per_replica']} GPUs per replica"
    table = Table(title=f"{s.get('trace')} on {s.get('model')} / {hardware}")
    table.add_column("kvsim")
    table.add_column("value", justify="right")

    def add(name, value, fmt="{:.3f}"):
        if value is None or (isinstance(value, float) and math.isnan(value)):
            return
        table.add_row(name, fmt.format(value) if isinstance(value, float) else str(value))

    add("requests (finished / rejected / aborted)",
        f"{s['num_finished']} / {s['num_rejected']} / {s.get('num_aborted', 0)}")
    add("load", saturation_line(s))
    add("KV pool", f"{s['num_gpu_blocks']} blocks x {s['block_size']} tokens")
    if s.get("kv_cache_tokens") is not None:         # the two lines vLLM logs at start-up
        add("GPU KV cache size", f"{s['kv_cache_tokens']:,} tokens")
        add(f"Maximum concurrency for {s['max_model_len']:,} tokens per request", f"{s['kv_max_concurrency']:.2f}x")
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
    spec = s.get("spec_decode")
    if spec:
        rates = spec.get("acceptance_rate_per_pos") or []
        add(f"spec decode: {spec['method']} k={spec['num_speculative_tokens']} mean acceptance length",
            spec.get("mean_acceptance_length"), "{:.2f}")
        add("spec decode: acceptance rate per position", " ".join(f"{r:.3f}" for r in rates) or None)
        add("spec decode: drafting / verifying share of busy time",
            f"{spec['draft_share'] or 0:.1%} / {spec['verify_share'] or 0:.1%}")
    add("engine steps", s.get("num_steps"))
    add("wall time (s)", s.get("wall_s"), "{:.2f}")
    console.print(table)
    if s.get("pools"):
        print_pools(s["pools"], s["handoff"])
    if s.get("bench_comparison"):
        print_comparison(s["bench_comparison"])
    if s.get("workload_classes"):
        print_classes(s["workload_classes"])


def print_classes(classes: dict) -> None:
    """A workload spec's client classes: each one's latencies and SLO attainment."""
    table = Table(title="client classes (workload spec)")
    for col in ("class", "requests", "finished", "TTFT p50 / p99 (ms)", "TPOT p50 / p99 (ms)", "SLO", "within SLO"):
        table.add_column(col, justify="left" if col in ("class", "SLO") else "right")
    for name, c in classes.items():
        slo = " ".join(f"{k} {1e3 * c[f'slo_{k}_s']:g}ms" for k in ("ttft", "tpot") if c.get(f"slo_{k}_s") is not None)
        table.add_row(name, str(c["requests"]), str(c["finished"]),
                      f"{1e3 * c['ttft_p50_s']:.1f} / {1e3 * c['ttft_p99_s']:.1f}",
                      f"{1e3 * c['tpot_p50_s']:.1f} / {1e3 * c['tpot_p99_s']:.1f}", slo,
                      "" if "slo_attainment" not in c else f"{c['slo_attainment']:.1%}")
    console.print(table)


def saturation_line(s: dict) -> str | None:
    """Over capacity or not, with the offered and the sustainable rate (sim/results/saturation.py)."""
    if s.get("overloaded") is None:
        return None
    offered = f"{s['offered_rate_req_s']:.2f} req/s offered"
    if not s["overloaded"]:
        return f"within capacity ({offered})"
    sustained = s.get("sustainable_rate_req_s")
    return f"OVER CAPACITY: {offered}, ~{sustained:.2f} req/s sustainable" if sustained else f"OVER CAPACITY: {offered}"


def print_pools(pools: dict, handoff: dict) -> None:
    """A disaggregated run's pools and its hand-off (summary.json's `pools` and `handoff`)."""
    table = Table("pool", "GPUs", "KV blocks", "utilization", "waiting mean / max", "KV use mean / max",
                  "prefill tok", "decode tok", title="pools")
    for name, p in pools.items():
        table.add_row(f"{name} ({p['role']})", f"{p['replicas']}x {p['gpu']} TP{p['tp']}", str(p["num_gpu_blocks"]),
                      f"{p['utilization']:.3f}", f"{p['mean_waiting']:.2f} / {p['max_waiting']}",
                      f"{p['mean_kv_use']:.3f} / {p['max_kv_use']:.3f}", str(p["prefill_tokens"]), str(p["decode_tokens"]))
    table_console().print(table)

    def ms(key):
        v = handoff.get(key)
        return "-" if v is None else f"{1e3 * v:.2f}"
    each = "per pool pair below" if handoff.get("link_bandwidth_gb_s") is None else \
        f"{handoff['link_bandwidth_gb_s']:g} GB/s each"
    console.print(f"hand-off over {handoff['links']}x {handoff['link']} ({each}): "
                  f"{handoff['transfers']} transfers, {handoff['transfer_bytes'] / 1e9:.2f} GB, link utilization "
                  f"{handoff['link_utilization']:.4f}, {handoff['local_prefills']} prefilled locally", highlight=False)
    for pair, f in (handoff.get("pairs") or {}).items():
        mean = "-" if f["mean_transfer_s"] is None else f"{1e3 * f['mean_transfer_s']:.2f} ms"
        console.print(f"  {pair}: {f['link']} {f['link_bandwidth_gb_s']:g} GB/s, {f['transfers']} transfers, "
                      f"{f['transfer_bytes'] / 1e9:.2f} GB, mean pull {mean}", highlight=False)
    console.print("TTFT split, mean / p99 (ms): " + ", ".join(
        f"{name} {ms('mean_' + key)} / {ms('p99_' + key)}" for name, key in (
            ("prefill queue", "prefill_queue_s"), ("prefill", "prefill_s"), ("KV wait", "kv_wait_s"),
            ("transfer", "transfer_s"), ("first decode", "first_decode_s"))), highlight=False)


def print_comparison(agg: dict) -> None:
    from kvsim.sim.results.bench_compare import report_rows

    table = Table(title=f"predicted vs measured (vllm bench serve result, {agg['num_requests']} requests)")
    for name in ("figure", "measured", "kvsim", "error"):
        table.add_column(name, justify="left" if name == "figure" else "right")
    for row in report_rows(agg):
        table.add_row(*row)
    console.print(table)
    if agg.get("note"):
        console.print(f"note: {agg['note']}", highlight=False)
