"""Options several commands share (one definition each, as typer Annotated aliases), the table that
maps them to config keys, and the one way a command reports a user mistake."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from . import EXTRAS, fail, needs_extras, table_console  # noqa: F401 (their home is the light package root)
from kvsim.sim.kv.names import BUILTIN_POLICIES, SLOT_STRATEGIES, may_have_plugins


# ---- what the run is: trace, model, hardware ---------------------------------------------------------
Trace = Annotated[str | None, typer.Option(help="shipped trace name (azure-conv-2023, ...) or trace file")]
Model = Annotated[str | None, typer.Option(help="catalog model (llama-3.1-8b, ...), model YAML file, or Hugging Face config.json (or its directory)")]
Gpu = Annotated[str | None, typer.Option(help="catalog GPU (h100, l4, a100, ...) or YAML file")]
Tp = Annotated[int | None, typer.Option(help="tensor parallel degree")]
Replicas = Annotated[int | None, typer.Option(help="engine replicas behind the router")]
Profile = Annotated[str | None, typer.Option(help="hardware profile name or file; default auto: the GPU's own "
                                                    "(fitted or derived; docs/gpu-profiles.md)")]
UsdPerHour = Annotated[str | None, typer.Option(
    help="your price in $ per GPU-hour instead of the catalog's: PRICE, or GPU=PRICE,... (h100=2.5,h200=3.9)")]
ConfigFile = Annotated[Path | None, typer.Option("--config", "-c", help="YAML config file; options override it")]


def output_path(option: str = "--out"):
    """Parser of an option or argument naming an output (--out, a trace file to write): an empty name is
    refused, since Path('') is the current directory (`--out ''` would write into it)."""
    def parse(value: str | Path) -> Path:
        if str(value).strip() == "":
            fail(f"{option} '': an empty name (it would mean the current directory); expected a directory or "
                 "file name, e.g. runs/NAME")
        return Path(value)
    return parse


Out = Annotated[Path, typer.Option("--out", "-o", parser=output_path(), help="output directory")]
Overwrite = Annotated[bool, typer.Option(
    "--overwrite", help="write into an existing non-empty --out that kvsim did not create (its kvsim result "
                        "files are replaced, other files kept)")]
Seed = Annotated[int | None, typer.Option(help="random seed (synthetic importance scores, arrivals of length-only traces)")]
Sets = Annotated[list[str], typer.Option("--set", help="any config key, dotted: engine.long_prefill_token_threshold=512")]
Quiet = Annotated[bool, typer.Option("--quiet", "-q", help="no progress bar or table")]

# ---- engine ------------------------------------------------------------------------------------------
BlockSize = Annotated[int | None, typer.Option(help="tokens per KV block")]
NumGpuBlocks = Annotated[int | None, typer.Option(help="KV pool size in blocks (default: from GPU memory)")]
MaxNumSeqs = Annotated[int | None, typer.Option(help="most sequences in one step (default: vLLM's)")]
MaxNumBatchedTokens = Annotated[int | None, typer.Option(help="token budget per step")]
PrefixCaching = Annotated[bool | None, typer.Option("--prefix-caching/--no-prefix-caching",
                                                       help="automatic prefix caching (default: vLLM's)")]
ExpertParallel = Annotated[bool | None, typer.Option(
    "--enable-expert-parallel", help="MoE models: experts split over the TP group's GPUs, all-to-all for the MoE "
                                     "layers (vLLM's --enable-expert-parallel)")]
PipelineParallel = Annotated[int | None, typer.Option(
    "--pp", "-pp", "--pipeline-parallel-size", help="pipeline stages per replica (vLLM's -pp): layers, weights and "
    "KV split by stage, pp batches in flight (docs/parallelism.md)")]
DataParallel = Annotated[int | None, typer.Option(
    "--dp", "-dp", "--data-parallel-size", help="MoE models: data-parallel attention ranks per replica (vLLM's -dp "
    "with a MoE model), each its own scheduler and KV cache, the MoE layers over all dp x tp GPUs in lockstep "
    "(docs/parallelism.md); dense models' DP ranks are replicas: --replicas")]
MaxModelLen = Annotated[int | None, typer.Option(help="longest prompt + output (default: the model's "
                                                         "max_position_embeddings, as vLLM; above it refused unless "
                                                         "VLLM_ALLOW_LONG_MAX_MODEL_LEN=1)")]
LongPrefillTokenThreshold = Annotated[int | None, typer.Option(
    help="most prompt tokens a long prefill computes per step (vLLM's --long-prefill-token-threshold; 0: off)")]
ChunkedPrefill = Annotated[bool | None, typer.Option("--chunked-prefill/--no-chunked-prefill",
                                                        help="chunked prefill (default: on, as vLLM V1)")]
StartS = Annotated[float | None, typer.Option(help="keep requests arriving at or after this time (s), re-based to 0")]
EndS = Annotated[float | None, typer.Option(help="keep requests arriving before this time (s)")]
SchedulingPolicy = Annotated[str | None, typer.Option(help="fcfs | priority")]
CheckInvariants = Annotated[bool | None, typer.Option("--check-invariants", help="check KV invariants every step")]

# ---- KV eviction / compression (names from the registries, plug-ins included) --------------------------
def policy_names_for_help() -> list[str]:
    """The policy names an option's help lists: the built-in ones (kvsim.sim.kv.names, no import), or the real
    registry's, plug-ins included, where plug-ins may exist (a broken plug-in raises its PolicyError)."""
    if not may_have_plugins():
        return sorted(BUILTIN_POLICIES)
    from kvsim.sim.kv.policy import policy_names    # numpy and every policy module: only with plug-ins about

    return policy_names()


def _policy_help() -> str:
    # a broken plug-in must not stop commands that never look a policy up (kvsim trace, --help):
    # the help says what is wrong, and the config check of a run fails with the same message
    try:
        return "KV eviction/compression policy: " + ", ".join(policy_names_for_help())
    except ValueError as exc:          # kvsim.sim.kv.policy.PolicyError (not imported unless plug-ins may exist)
        return f"KV eviction/compression policy ({exc})"


Policy = Annotated[str | None, typer.Option(help=_policy_help())]
Budget = Annotated[int | None, typer.Option(help="tokens kept per KV head (budgeted policies)")]
Layout = Annotated[str | None, typer.Option(help="KV layout: shared | per_head")]
SlotStrategy = Annotated[str | None, typer.Option(help=" | ".join(SLOT_STRATEGIES))]

# ---- the workload ------------------------------------------------------------------------------------
RateScale = Annotated[float | None, typer.Option(help="arrival-rate multiplier")]
MaxRequests = Annotated[int | None, typer.Option(help="first N requests of the trace")]
RequestRate = Annotated[float | None, typer.Option(
    help="as vllm bench serve: requests/s for a trace without arrival times (length-only, ShareGPT), Gamma "
         "gaps rescaled to end at N/rate; inf: all at t=0")]
Burstiness = Annotated[float | None, typer.Option(
    help="as vllm bench serve, with --request-rate: Gamma shape of the gaps (1 Poisson, <1 burstier)")]
MaxConcurrency = Annotated[int | None, typer.Option(
    help="as vllm bench serve: at most C requests in flight; the next is sent when one finishes (closed loop)")]
TraceFormat = Annotated[str | None, typer.Option(
    help="trace file format (default: detected); csv | jsonl | parquet read any log through --trace-columns")]
TraceColumns = Annotated[str | None, typer.Option(
    help="with --trace-format csv|jsonl|parquet: FIELD=COLUMN,... for arrival, prompt_tokens, output_tokens "
         "(optional request_id, session_id, priority); nested JSON keys dotted (usage.prompt_tokens)")]
TimeUnit = Annotated[str | None, typer.Option(help="with --trace-format csv|jsonl|parquet: unit of epoch "
                                                      "times: s | ms | us | ns (ISO-8601 times need none)")]
Tokenizer = Annotated[str | None, typer.Option(
    help="ShareGPT traces: tokenizer.json, its model directory or a Hugging Face model id (from the local cache, "
         "else fetched) counting tokens; default: the shipped SmolLM2 tokenizer (an approximation)")]
StepVariance = Annotated[str | None, typer.Option(
    help="step-time variance: 0 deterministic (default: today's results), auto (the GPU's fitted sigma), or a "
         "lognormal sigma such as 0.05 (seeded by --seed)")]
FrontendJitter = Annotated[str | None, typer.Option(
    help="per-request variation of the frontend's fixed latency: 0 none (default: today's results), auto (the "
         "sigma fitted to a published run, sim/data/frontends.yaml) or a lognormal sigma such as 0.3 (seeded by "
         "--seed; needs a frontend: --frontend or --client-latency)")]
Frontend = Annotated[str | None, typer.Option(
    help="the frontend (API server) between the client and the engine: none (engine time only), profile "
         "(= --client-latency: the GPU profile's fitted client terms) or a named set of sim/data/frontends.yaml "
         "(vllm-api: a datacenter host's vLLM API server, vllm-api-4vcpu: a 4-vCPU cloud VM's); default: none")]
RequestTimeout = Annotated[float | None, typer.Option(
    help="seconds after its send at which the client gives up on a request (a benchmark client's total "
         "timeout): aborted in the engine, its KV freed, counted failed; default: none")]
MetricPercentiles = Annotated[str | None, typer.Option(
    help="as vllm bench serve: comma-separated percentiles of TTFT, TPOT, ITL and E2EL to report (default 99)")]
SloTtft = Annotated[str | None, typer.Option(help="TTFT SLO for goodput, with unit (2s, 500ms)")]
SloTpot = Annotated[str | None, typer.Option(help="TPOT SLO for goodput, with unit (100ms)")]

RouterName = Annotated[str | None, typer.Option(
    help="round_robin | least_outstanding | queue_depth | kv_usage | prefix_affinity | precise_prefix | "
         "session_affinity | weighted (llm-d's scorer sum), or a registered plug-in; options: --set "
         "router_options.KEY=V (docs/kv-tiers.md)")]
KvOffload = Annotated[str | None, typer.Option(
    help="KV offload tiers: cpu:SIZE per replica as vLLM's OffloadingConnector (cpu:64GiB; cpu:0 = none), then "
         "LMCache's disk:SIZE per replica and remote:SIZE shared, e.g. cpu:64GiB,disk:1TiB,remote:10TiB "
         "(= kv_offload.cpu_gib / disk_gib / remote_gib; docs/kv-tiers.md)")]
Sessions = Annotated[bool, typer.Option(
    "--sessions", help="multi-turn sessions: the trace's session_id turns run as a closed loop per session, a turn "
                       "sent when the previous answer finished plus a think time (= trace_options.sessions; "
                       "docs/kv-tiers.md#sessions)")]
ThinkTime = Annotated[float | None, typer.Option(
    help="sessions: seconds between an answer and the next turn (default: the trace's gap between the turns); "
         "implies --sessions (= trace_options.sessions.think_time_s)")]


SpeculativeConfigOpt = Annotated[str | None, typer.Option(
    "--speculative-config", help="speculative decoding as vLLM's --speculative-config JSON, e.g. "
    "'{\"method\": \"eagle3\", \"num_speculative_tokens\": 3}' (methods: ngram, eagle, eagle3, mtp, draft_model; "
    "docs/speculative-decoding.md); = speculative_config")]


def parse_speculative_config(value: str | None) -> dict[str, Any]:
    """`--speculative-config JSON` as a config override (a JSON object, as vLLM reads the flag)."""
    from kvsim.sim.config import ConfigError   # the config schema: not at start-up (kvsim simulate --help)
    if value is None:
        return {}
    import json
    try:
        data = json.loads(value)
    except ValueError as exc:
        raise ConfigError(f"--speculative-config: invalid JSON ({exc.msg} at character {exc.pos}); expected an object "
                          "such as {\"method\": \"eagle3\", \"num_speculative_tokens\": 3}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--speculative-config: expected a JSON object such as {{\"method\": \"ngram\", "
                          f"\"num_speculative_tokens\": 3}}, got {type(data).__name__}")
    return {"speculative_config": data}


_SIZE_UNITS = {"gib": 1.0, "gb": 1e9 / 2**30, "mib": 1 / 1024, "tib": 1024.0}


OFFLOAD_TIERS = {"cpu": "kv_offload.cpu_gib", "disk": "kv_offload.disk_gib", "remote": "kv_offload.remote_gib"}


def parse_offload(value: str) -> dict[str, float]:
    """`--kv-offload cpu:64GiB[,disk:1TiB][,remote:10TiB]` -> GiB per tier (GiB, GB, MiB, TiB): the CPU per
    replica, a disk per replica, a remote store for the fleet (`cpu:0`: no offload)."""
    from kvsim.sim.config import ConfigError   # the config schema: not at start-up (kvsim simulate --help)
    sizes: dict[str, float] = {}
    for item in value.split(","):
        tier, _, size = item.strip().partition(":")
        if tier not in OFFLOAD_TIERS or not size or tier in sizes:
            raise ConfigError(f"--kv-offload {value!r}: expected cpu:SIZE, optionally followed by ,disk:SIZE and "
                              ",remote:SIZE, e.g. cpu:64GiB,disk:1TiB (each tier once)")
        sizes[tier] = _gib(value, size)
    if "cpu" not in sizes:
        raise ConfigError(f"--kv-offload {value!r}: the disk and remote tiers sit behind a CPU tier (LMCache's local "
                          "CPU backend): give cpu:SIZE first")
    if not sizes["cpu"] and len(sizes) > 1:
        raise ConfigError(f"--kv-offload {value!r}: cpu:0 means no offload; a disk or remote tier needs a CPU tier")
    return sizes


def _gib(value: str, size: str) -> float:
    from kvsim.sim.config import ConfigError   # the config schema: not at start-up (kvsim simulate --help)
    number = size.rstrip("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
    unit = size[len(number):].lower() or "gib"
    try:
        gib = float(number) * _SIZE_UNITS[unit]
    except (ValueError, KeyError):
        raise ConfigError(f"--kv-offload {value!r}: expected a size such as 64GiB, 500GB or 512MiB") from None
    if not gib >= 0:
        raise ConfigError(f"--kv-offload {value!r}: the size must be 0 (no offload) or positive")
    if gib > 2**20:
        raise ConfigError(f"--kv-offload {value!r}: expected at most 1 PiB (1,048,576 GiB) a tier, got {gib:.3g} GiB")
    return gib


def tier_overrides(kv_offload: str | None, sessions: bool = False, think_time: float | None = None) -> dict[str, Any]:
    """--kv-offload, --sessions and --think-time as config overrides (`cpu:0`: no offload, as leaving it out)."""
    from kvsim.sim.config import ConfigError   # the config schema: not at start-up (kvsim simulate --help)
    out: dict[str, Any] = {}
    sizes = parse_offload(kv_offload) if kv_offload is not None else {}
    if sizes.get("cpu"):
        out.update({OFFLOAD_TIERS[tier]: gib for tier, gib in sizes.items() if gib})
    if think_time is not None:
        if not 0 <= think_time <= 1e9:
            raise ConfigError(f"--think-time {think_time:g}: expected seconds in 0..1e9")
        out["trace_options.sessions.think_time_s"] = think_time
    elif sessions:
        out["trace_options.sessions"] = {}
    return out


# command-line option (parameter name) -> the config key it sets
CONFIG_KEYS = {
    "trace": "trace", "model": "model", "gpu": "gpu", "tp": "tp", "pp": "pp", "dp": "dp", "replicas": "replicas",
    "router": "router",
    "profile": "profile", "seed": "seed", "weight_dtype": "weight_dtype", "kv_dtype": "kv_dtype",
    "fast_forward": "fast_forward", "check_invariants": "check_invariants", "client_latency": "client_latency",
    "frontend": "frontend",
    "block_size": "engine.block_size", "num_gpu_blocks": "engine.num_gpu_blocks",
    "max_num_seqs": "engine.max_num_seqs", "max_num_batched_tokens": "engine.max_num_batched_tokens",
    "max_model_len": "engine.max_model_len", "long_prefill_token_threshold": "engine.long_prefill_token_threshold",
    "prefix_caching": "engine.enable_prefix_caching", "chunked_prefill": "engine.enable_chunked_prefill",
    "expert_parallel": "engine.enable_expert_parallel",
    "preemption_mode": "engine.preemption_mode", "scheduling_policy": "engine.scheduling_policy",
    "policy": "kv.policy", "budget": "kv.budget", "layout": "kv.layout", "slot_strategy": "kv.slot_strategy",
    "kv_mode": "kv.mode", "compression_rate": "kv.params.compression_rate",
    "rate_scale": "trace_options.rate_scale", "max_requests": "trace_options.max_requests",
    "start_s": "trace_options.start_s", "end_s": "trace_options.end_s",
    "slo_ttft": "slo.ttft", "slo_tpot": "slo.tpot",
    "request_rate": "trace_options.request_rate", "burstiness": "trace_options.burstiness",
    "max_concurrency": "trace_options.max_concurrency", "metric_percentiles": "metric_percentiles",
    "request_timeout": "trace_options.request_timeout", "step_variance": "step_variance",
    "frontend_jitter": "frontend_jitter",
    "trace_format": "trace_options.format", "trace_columns": "trace_options.columns",
    "time_unit": "trace_options.time_unit", "tokenizer": "trace_options.tokenizer",
    "gpu_memory_utilization": "engine.gpu_memory_utilization", "usd_per_hour": "usd_per_hour",
    "random_input_len": "trace_options.random.input_len", "random_output_len": "trace_options.random.output_len",
    "random_range_ratio": "trace_options.random.range_ratio", "random_prefix_len": "trace_options.random.prefix_len",
}

def config_overrides(**options: Any) -> dict[str, Any]:
    """Command options by parameter name -> dotted config overrides (None = not given, left out later)."""
    return {CONFIG_KEYS[name]: value for name, value in options.items()}
