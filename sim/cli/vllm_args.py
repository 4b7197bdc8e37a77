"""`vllm serve ...` and `vllm bench serve ...` command lines read with vLLM's own flag names and meanings,
translated into kvsim config overrides (dotted keys) plus one note for every flag kvsim does not model.

vLLM's parser conventions are followed: `--flag value` and `--flag=value`, underscores in flag names
read as dashes (FlexibleArgumentParser), `--no-X` for boolean flags (BooleanOptionalAction), dotted
sub-keys of a JSON flag (`--speculative-config.method ngram`), `-O3` for the compilation level, and
human-readable integers for `--max-model-len` (`32k` = 32,000, `32K` = 32,768). Flag tables follow
vLLM's EngineArgs (vllm/engine/arg_utils.py) and `vllm bench serve` (vllm/benchmarks/serve.py,
vllm/benchmarks/datasets). A flag in neither table is an error naming it.
"""
from __future__ import annotations

import math
import re
import shlex
from dataclasses import dataclass, field
from collections.abc import Callable
from typing import Any


class VllmArgsError(ValueError):
    """A pasted vLLM command line kvsim cannot read; the message names the flag."""


@dataclass
class Translation:
    """What a pasted command line sets: config overrides by dotted key, notes (flags read but not
    modelled, one line each) and warnings (flags whose effect on the figures kvsim leaves out)."""
    overrides: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    data_parallel: int = 1       # vllm serve --data-parallel-size (dense models: replicas)


# ---- value parsers ---------------------------------------------------------------------------------
def _int(text: str) -> int:
    return int(text)


def _human_int(text: str) -> int:
    """vLLM's human_readable_int: 1k = 1,000, 1K = 1,024 (m/M, g/G likewise); plain integers as they are."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMgG])", text.strip())
    if not m:
        return int(text)
    number, unit = float(m.group(1)), m.group(2)
    power = "kmg".index(unit.lower()) + 1
    return int(number * (1000 if unit.islower() else 1024) ** power)


def _float(text: str) -> float:
    return float(text)


def _rate(text: str) -> float:
    return math.inf if text.strip().lower() == "inf" else float(text)


def _kv_cache_dtype(text: str) -> str | None:
    """auto: the model's dtype (kvsim's default, None); fp8 variants are one byte."""
    value = text.strip().lower()
    if value == "auto":
        return None
    if value.startswith("fp8"):
        return "fp8" if value in ("fp8_inc", "fp8_ds_mla") else value
    return value


# vLLM's --quantization methods -> the decoder-layer weight dtype kvsim prices (None: the checkpoint's own,
# read from its config.json's quantization_config when --model is one)
_QUANTIZATION = {
    "fp8": "fp8", "fbgemm_fp8": "fp8", "ptpc_fp8": "fp8", "modelopt": None, "compressed-tensors": None,
    "awq": "int4", "awq_marlin": "int4", "gptq": "int4", "gptq_marlin": "int4", "marlin": "int4",
    "gptq_marlin_24": "int4", "bitsandbytes": "int4", "experts_int8": None, "mxfp4": None, "gguf": None,
}


@dataclass(frozen=True)
class Flag:
    """One vLLM flag: the config key it sets (with its value parser), or a note saying it is not modelled.
    `kind`: value (takes one value), many (nargs='+'), switch (store_true), boolean (--X / --no-X)."""
    names: tuple[str, ...]
    kind: str = "value"
    key: str | None = None
    parse: Callable[[str], Any] | None = None
    note: str | None = None
    warn: bool = False           # the note is a warning: the figures leave out an effect the flag has


def _flags(*entries: Flag) -> dict[str, Flag]:
    table = {}
    for flag in entries:
        for name in flag.names:
            table[name] = flag
    return table


def _ignored(*names: str, kind: str = "value", why: str = "no effect on the engine's schedule or step times") -> Flag:
    return Flag(names, kind=kind, note=f"not modelled ({why})")


# handled by functions below (they need other flags' values): names only
_SPECIAL = ("--model", "--dtype", "--quantization", "-q", "--data-parallel-size", "-dp", "--pipeline-parallel-size",
            "-pp", "--speculative-config", "--kv-cache-dtype", "-O", "--compilation-config")

SERVE_FLAGS = _flags(
    Flag(("--tensor-parallel-size", "-tp"), key="tp", parse=_int),
    Flag(("--gpu-memory-utilization",), key="engine.gpu_memory_utilization", parse=_float),
    Flag(("--enable-prefix-caching",), kind="boolean", key="engine.enable_prefix_caching"),
    Flag(("--enable-chunked-prefill",), kind="boolean", key="engine.enable_chunked_prefill"),
    Flag(("--max-num-seqs",), key="engine.max_num_seqs", parse=_int),
    Flag(("--max-num-batched-tokens",), key="engine.max_num_batched_tokens", parse=_human_int),
    Flag(("--max-model-len",), key="engine.max_model_len", parse=_human_int),
    Flag(("--block-size",), key="engine.block_size", parse=_int),
    Flag(("--num-gpu-blocks-override",), key="engine.num_gpu_blocks", parse=_int),
    Flag(("--long-prefill-token-threshold",), key="engine.long_prefill_token_threshold", parse=_int),
    Flag(("--scheduling-policy",), key="engine.scheduling_policy", parse=str),
    Flag(("--enable-expert-parallel",), kind="boolean", key="engine.enable_expert_parallel"),
    Flag(("--async-scheduling",), kind="boolean", key="engine.async_scheduling"),
    Flag(("--swap-space",), key="engine.swap_space_gib", parse=_float),
    Flag(("--seed",), note="not modelled (the sampling seed; output lengths come from the workload)"),
    Flag(("--enforce-eager",), kind="boolean", warn=True,
         note="not modelled: kvsim's profiles were fitted with CUDA graphs on; eager decode steps run slower"),
    Flag(("--cpu-offload-gb",), warn=True,
         note="not modelled: weights offloaded to CPU memory would leave more GPU memory for KV and slow every step"),
    Flag(("--kv-transfer-config",), warn=True, note="not modelled (KV transfer: disaggregated prefill, offloading)"),
    Flag(("--kv-cache-memory-bytes",), warn=True,
         note="not modelled: the KV pool is sized from --gpu-memory-utilization (or --num-gpu-blocks-override)"),
    Flag(("--disable-sliding-window",), kind="boolean", warn=True,
         note="not modelled: sliding-window layers keep their window"),
    Flag(("--max-num-partial-prefills", "--max-long-partial-prefills"), warn=True,
         note="not modelled (concurrent partial prefills): one long prefill at a time is scheduled as vLLM's default"),
    Flag(("--enable-eplb", "--enable-dbo"), kind="boolean", warn=True,
         note="not modelled (expert load balancing / dual-batch overlap)"),
    Flag(("--enable-lora",), kind="boolean", warn=True, note="not modelled (LoRA adapters' memory and compute)"),
    _ignored("--host", "--port", "--uds", "--api-key", "--root-path", "--ssl-keyfile", "--ssl-certfile",
             "--ssl-ca-certs", "--ssl-cert-reqs", "--allowed-origins", "--allowed-methods", "--allowed-headers",
             "--middleware", "--uvicorn-log-level", "--api-server-count", "--log-config-file",
             why="the API server's address and transport"),
    _ignored("--served-model-name", "--tokenizer", "--tokenizer-mode", "--revision", "--code-revision",
             "--tokenizer-revision", "--download-dir", "--load-format", "--config-format", "--hf-token",
             "--chat-template", "--chat-template-content-format", "--response-role", "--generation-config",
             "--override-generation-config", "--tool-call-parser", "--reasoning-parser", "--tool-parser-plugin",
             "--max-logprobs", "--logprobs-mode", "--guided-decoding-backend", "--structured-outputs-config",
             "--distributed-executor-backend", "--worker-extension-cls", "--task", "--runner", "--convert",
             "--hf-overrides", "--max-seq-len-to-capture", "--cuda-graph-sizes", "--limit-mm-per-prompt",
             "--mm-processor-kwargs", "--max-loras", "--max-lora-rank", "--lora-modules", "--max-cpu-loras",
             "--data-parallel-address", "--data-parallel-rpc-port", "--data-parallel-size-local",
             "--data-parallel-backend", "--data-parallel-rank", "-dpn", "--data-parallel-start-rank", "-dpr",
             "--otlp-traces-endpoint", "--collect-detailed-traces", "--kv-events-config", "--eplb-config",
             "--num-redundant-experts", "--all2all-backend", "--max-parallel-loading-workers", "--model-impl",
             "--rope-scaling", "--rope-theta", "--pooler-config", "--override-pooler-config", "--lora-dtype",
             "--prefix-caching-hash-algo", "--mm-encoder-tp-mode", "--allowed-local-media-path"),
    _ignored("--trust-remote-code", "--disable-log-requests", "--enable-log-requests", "--disable-log-stats",
             "--disable-fastapi-docs", "--enable-auto-tool-choice", "--disable-custom-all-reduce",
             "--enable-prompt-tokens-details", "--enable-force-include-usage", "--enable-server-load-tracking",
             "--enable-sleep-mode", "--calculate-kv-scales", "--skip-tokenizer-init", "--headless",
             "--disable-frontend-multiprocessing", "--enable-request-id-headers", "--disable-uvicorn-access-log",
             "--enable-log-outputs", "--return-tokens-as-token-ids", "--enable-chunked-prefill-for-mm",
             kind="boolean"),
)

BENCH_FLAGS = _flags(
    Flag(("--num-prompts",), key="trace_options.max_requests", parse=_int),
    Flag(("--request-rate",), key="trace_options.request_rate", parse=_rate),
    Flag(("--burstiness",), key="trace_options.burstiness", parse=_float),
    Flag(("--max-concurrency",), key="trace_options.max_concurrency", parse=_int),
    Flag(("--seed",), key="seed", parse=_int),
    Flag(("--metric-percentiles",), key="metric_percentiles", parse=str),
    Flag(("--random-input-len",), key="trace_options.random.input_len", parse=_int),
    Flag(("--random-output-len",), key="trace_options.random.output_len", parse=_int),
    Flag(("--random-range-ratio",), key="trace_options.random.range_ratio", parse=_float),
    Flag(("--random-prefix-len",), key="trace_options.random.prefix_len", parse=_int),
    Flag(("--percentile-metrics",), note="not modelled (kvsim reports TTFT, TPOT, ITL and E2EL percentiles all)"),
    Flag(("--sharegpt-output-len", "--custom-output-len"), warn=True,
         note="not modelled: outputs keep the dataset's lengths"),
    Flag(("--disable-shuffle",), kind="switch", warn=True, note="not modelled: ShareGPT entries are shuffled by --seed"),
    Flag(("--ramp-up-strategy", "--ramp-up-start-rps", "--ramp-up-end-rps"), warn=True,
         note="not modelled (a request rate that ramps): give a constant --request-rate"),
    Flag(("--num-warmups",), note="not modelled (warm-up requests are not part of the measured run)"),
    Flag(("--use-beam-search",), kind="switch", warn=True, note="not modelled (beam search): one sequence per request"),
    _ignored("--backend", "--endpoint", "--endpoint-type", "--base-url", "--host", "--port", "--header",
             "--result-dir", "--result-filename", "--metadata", "--label", "--tokenizer-mode",
             "--served-model-name", "--logprobs", "--ready-check-timeout-sec", "--request-id-prefix", "--top-p",
             "--top-k", "--min-p", "--temperature", "--extra-body", "--lora-modules", "--max-loras",
             "--goodput-config", "--plot-timeline", "--timeline-itl-thresholds",
             why="the client's transport, sampling or result files"),
    _ignored("--save-result", "--save-detailed", "--append-result", "--disable-tqdm", "--profile",
             "--trust-remote-code", "--no-stream", "--no-oversample", "--insecure", kind="switch",
             why="the client's transport, sampling or result files"),
)

# vllm bench serve's datasets kvsim reads: name -> what the dataset path is
BENCH_DATASETS = ("random", "sharegpt")


# ---- tokenizing a pasted line -------------------------------------------------------------------------
def _tokens(line: str, program: tuple[str, ...], what: str) -> list[str]:
    """The arguments after the program words (`vllm serve`); leading VAR=value assignments are skipped."""
    try:
        words = shlex.split(line.replace("\\\n", " "))
    except ValueError as exc:
        raise VllmArgsError(f"{what}: cannot split the command line ({exc})") from None
    while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0]):
        words = words[1:]
    n = len(program)
    if [w.lower() for w in words[:n]] != list(program):
        raise VllmArgsError(f"{what}: expected a line starting with '{' '.join(program)}', got {line.strip()[:60]!r}")
    return words[n:]


def _flag_name(token: str) -> tuple[str, str | None]:
    """('--max-num-seqs', '8') from '--max_num_seqs=8'; dotted JSON sub-keys read as their flag."""
    name, eq, value = token.partition("=")
    if name.startswith("--"):
        name = "--" + name[2:].replace("_", "-").split(".", 1)[0]
    elif name.startswith("-O") and name != "-O":
        return "-O", name[2:].lstrip(".") + (eq + value if eq else "")
    return name, (value if eq else None)


@dataclass
class _Parsed:
    positional: list[str] = field(default_factory=list)
    values: dict[str, Any] = field(default_factory=dict)       # canonical flag name -> raw value(s)
    seen: list[tuple[str, Flag | None]] = field(default_factory=list)


def _parse(args: list[str], table: dict[str, Flag], what: str) -> _Parsed:
    out = _Parsed()
    i = 0
    while i < len(args):
        token = args[i]
        i += 1
        if not token.startswith("-") or token == "-":
            out.positional.append(token)
            continue
        name, value = _flag_name(token)
        negated = name.startswith("--no-") and table.get("--" + name[5:], Flag(())).kind == "boolean"
        base = "--" + name[5:] if negated else name
        flag = table.get(base)
        if flag is None and base not in _SPECIAL:
            raise VllmArgsError(f"{what} {name}: not a flag kvsim knows for this command (unknown to kvsim's "
                                "table of vLLM's flags; check the spelling against the vLLM version's --help)")
        kind = flag.kind if flag is not None else "value"
        if kind in ("switch", "boolean"):
            if value is not None:
                raise VllmArgsError(f"{what} {name}: a switch takes no value (got {value!r})")
            out.values[base] = not negated
        elif kind == "many":
            items = [] if value is None else [value]
            while i < len(args) and not args[i].startswith("-"):
                items.append(args[i])
                i += 1
            out.values[base] = items
        else:
            if value is None:
                if i >= len(args):
                    raise VllmArgsError(f"{what} {name}: expected a value")
                value = args[i]
                i += 1
            if base == "--goodput":            # nargs='+': KEY:VALUE pairs until the next flag
                items = [value]
                while i < len(args) and not args[i].startswith("-"):
                    items.append(args[i])
                    i += 1
                value = items
            out.values[base] = value
        out.seen.append((base, flag))
    return out


def _apply_table(parsed: _Parsed, table_flags: dict[str, Flag], what: str, result: Translation) -> None:
    """Set every flag with a config key; note every flag kvsim does not model (once per flag)."""
    noted = set()
    for base, flag in parsed.seen:
        if flag is None or base in noted:
            continue
        noted.add(base)
        value = parsed.values[base]
        if flag.key is not None:
            try:
                result.overrides[flag.key] = flag.parse(value) if flag.parse else value
            except ValueError:
                raise VllmArgsError(f"{what} {base} {value!r}: expected {_expected(flag.parse)}") from None
        elif flag.note is not None:
            shown = "" if isinstance(value, bool) else f" {value}"
            (result.warnings if flag.warn else result.notes).append(f"{what} {base}{shown}: {flag.note}")


def _expected(parse) -> str:
    return {_int: "an integer", _human_int: "an integer (1k = 1000, 1K = 1024)", _float: "a number",
            _rate: "a number or inf"}.get(parse, "a value")


# ---- vllm serve ----------------------------------------------------------------------------------------
def parse_serve(line: str) -> Translation:
    """A `vllm serve MODEL [flags]` line (or `python -m vllm.entrypoints.openai.api_server --model M ...`)."""
    what = "--vllm: vllm serve"
    program = ("python", "-m", "vllm.entrypoints.openai.api_server") if "api_server" in line.split("--")[0] \
        else ("vllm", "serve")
    parsed = _parse(_tokens(line, program, "--vllm"), SERVE_FLAGS, what)
    result = Translation()
    model = parsed.values.get("--model")
    if len(parsed.positional) > 1 or (parsed.positional and model is not None and parsed.positional[0] != model):
        raise VllmArgsError(f"{what}: one model expected (positional or --model), got "
                            f"{', '.join(parsed.positional + ([model] if model else []))}")
    model = model or (parsed.positional[0] if parsed.positional else None)
    if model is not None:
        result.overrides["model"] = model
    _apply_table(parsed, SERVE_FLAGS, what, result)
    _serve_specials(parsed.values, what, result)
    return result


def _serve_specials(values: dict[str, Any], what: str, result: Translation) -> None:
    """The flags whose meaning depends on another's: dtype, quantization, parallelism, speculation."""
    if "--kv-cache-dtype" in values:
        kv = _kv_cache_dtype(values["--kv-cache-dtype"])
        if kv is not None:
            result.overrides["kv_dtype"] = kv
    dtype = values.get("--dtype", "auto").strip().lower()
    quant = values.get("--quantization", values.get("-q"))
    if quant is not None:
        _quantization(quant, what, result)
    if dtype != "auto":
        if quant is not None:
            result.notes.append(f"{what} --dtype {dtype}: activations only with --quantization {quant}; kvsim prices "
                                "activations at 16 bits")
        elif dtype in ("float", "float32"):
            result.overrides["weight_dtype"] = "fp32"
            result.warnings.append(f"{what} --dtype {dtype}: fp32 weights; activations are still priced at 16 bits")
        elif dtype in ("half", "float16", "bfloat16"):
            result.overrides["weight_dtype"] = "bf16" if dtype == "bfloat16" else "fp16"
        else:
            raise VllmArgsError(f"{what} --dtype {dtype}: expected auto, half, float16, bfloat16, float or float32")
    _parallelism(values, what, result)
    for name in ("-O", "--compilation-config"):
        if name in values:
            result.notes.append(f"{what} {name} {values[name]}: not modelled (torch.compile and CUDA-graph "
                                "settings; kvsim's profiles were fitted with vLLM's defaults)")
    if "--speculative-config" in values:
        _speculative(values["--speculative-config"], what, result)


def _speculative(value: Any, what: str, result: Translation) -> None:
    """`--speculative-config '{...}'` -> speculative_config (docs/speculative-decoding.md); the dotted form
    (`--speculative-config.method ngram`) names one key per flag, which kvsim does not assemble."""
    import json
    raw = value[-1] if isinstance(value, list) else value
    try:
        data = json.loads(raw) if isinstance(raw, str) else None
    except ValueError:
        data = None
    if isinstance(data, dict):
        result.overrides["speculative_config"] = data
        return
    result.warnings.append(f"{what} --speculative-config: kvsim reads the JSON form ('{{\"method\": \"ngram\", "
                           "\"num_speculative_tokens\": 3}'), not dotted keys; the run prices plain decoding (one token "
                           "per request per step), so TPOT/ITL are upper bounds")


def _quantization(method: str, what: str, result: Translation) -> None:
    key = method.strip().lower()
    if key not in _QUANTIZATION:
        raise VllmArgsError(f"{what} --quantization {method}: kvsim reads {', '.join(sorted(_QUANTIZATION))} "
                            "(or give --weight-dtype)")
    dtype = _QUANTIZATION[key]
    if dtype is None:
        result.notes.append(f"{what} --quantization {method}: the weights' dtype is the checkpoint's (give its "
                            "config.json as --model, or --weight-dtype)")
        return
    result.overrides["weight_dtype"] = dtype
    if dtype == "int4":
        result.notes.append(f"{what} --quantization {method}: priced as 4-bit weights (a checkpoint's "
                            "quantization_config gives its bits when --model is its config.json)")


def _parallelism(values: dict[str, Any], what: str, result: Translation) -> None:
    for names, label in ((("--pipeline-parallel-size", "-pp"), "pipeline"), (("--data-parallel-size", "-dp"), "data")):
        raw = next((values[n] for n in names if n in values), None)
        if raw is None:
            continue
        try:
            size = int(raw)
        except ValueError:
            raise VllmArgsError(f"{what} {names[0]} {raw!r}: expected an integer") from None
        if size < 1:
            raise VllmArgsError(f"{what} {names[0]} {size}: expected an integer >= 1")
        if size == 1:
            continue
        if label == "pipeline":
            result.overrides["pp"] = size
            continue
        result.overrides["replicas"] = result.data_parallel = size
        result.overrides["router"] = "least_outstanding"
        result.notes.append(f"{what} {names[0]} {size}: {size} engine replicas behind a least-loaded router "
                            "(vLLM's DP load balancer picks the engine with the fewest waiting and running requests)")


def _moe_data_parallel(result: Translation) -> None:
    """Data parallelism of a MoE model is DP attention with the MoE layers over every rank's GPUs (they step in
    lockstep: config `dp`, sim/model/parallel.py), not independent replicas; vLLM's DP load balancer routes."""
    from kvsim.sim.model.catalog import get_model

    model = result.overrides.get("model")
    if model is None or not get_model(model).is_moe:
        return
    size = result.data_parallel
    del result.overrides["replicas"]
    result.overrides.update(dp=size, router="dp_balance")
    result.notes[:] = [n for n in result.notes if "engine replicas behind a least-loaded router" not in n]
    result.notes.append(f"--vllm: vllm serve --data-parallel-size {size}: {model} is a mixture-of-experts model: {size} "
                        "data-parallel attention ranks (each its own scheduler and KV cache) running the MoE layers "
                        "together in lockstep, behind vLLM's DP load balancer (dp_balance)")


# ---- vllm bench serve -------------------------------------------------------------------------------------
def parse_bench(line: str) -> Translation:
    """A `vllm bench serve [flags]` line (or the older `python benchmarks/benchmark_serving.py ...`)."""
    what = "--bench: vllm bench serve"
    first = line.split("--")[0]
    program = ("python", first.split()[1]) if "benchmark_serving" in first and len(first.split()) > 1 \
        else ("vllm", "bench", "serve")
    parsed = _parse(_tokens(line, program, "--bench"), BENCH_FLAGS | _BENCH_SPECIAL, what)
    if parsed.positional:
        raise VllmArgsError(f"{what}: unexpected argument {parsed.positional[0]!r} (vllm bench serve takes flags only)")
    result = Translation()
    _apply_table(parsed, BENCH_FLAGS, what, result)
    values = parsed.values
    if "--model" in values:
        result.overrides["model"] = values["--model"]
    _dataset(values, what, result)
    if "--goodput" in values:
        _goodput(values["--goodput"], what, result)
    if "--burstiness" in values and "--request-rate" not in values:
        result.overrides.pop("trace_options.burstiness")
        result.notes.append(f"{what} --burstiness: no effect at the default --request-rate inf (all sent at once)")
    if not values.get("--ignore-eos"):
        result.notes.append(f"{what}: without --ignore-eos a real run may stop a request at EOS; kvsim generates "
                            "every output to its full length (as --ignore-eos)")
    return result


_BENCH_SPECIAL = _flags(Flag(("--model",)), Flag(("--dataset-name",)), Flag(("--dataset-path",)), Flag(("--tokenizer",)),
                        Flag(("--goodput",)), Flag(("--ignore-eos",), kind="switch"))


def _dataset(values: dict[str, Any], what: str, result: Translation) -> None:
    """--dataset-name random (vLLM's default), sharegpt or custom (a file: --dataset-path) -> the trace."""
    name = values.get("--dataset-name", "random").strip().lower()
    path = values.get("--dataset-path")
    if name not in BENCH_DATASETS:
        raise VllmArgsError(f"{what} --dataset-name {name}: kvsim reads {', '.join(BENCH_DATASETS)} (or give the "
                            "file as kvsim's --trace)")
    random_keys = [k for k in result.overrides if k.startswith("trace_options.random.")]
    if name == "random":
        result.overrides["trace"] = "random"
        if path is not None:
            result.notes.append(f"{what} --dataset-path {path}: not read by the random dataset")
        if "--tokenizer" in values:
            result.notes.append(f"{what} --tokenizer: not needed (the random dataset draws token counts)")
    else:
        if path is None:
            raise VllmArgsError(f"{what} --dataset-name {name}: expected --dataset-path FILE")
        result.overrides["trace"] = path
        for key in random_keys:
            result.overrides.pop(key)
            result.notes.append(f"{what} --{key.rsplit('.', 1)[1].replace('_', '-').join(['random-', ''])}: "
                                f"applies to --dataset-name random only (ignored, as vLLM ignores it)")
        if "--tokenizer" in values:          # counts the dataset's text, as vLLM's client does
            result.overrides["trace_options.tokenizer"] = values["--tokenizer"]
        if name == "custom":
            raise VllmArgsError(f"{what} --dataset-name custom: prompts as text are not read yet; give their token "
                                "counts as a lengths CSV (num_prefill_tokens,num_decode_tokens) to kvsim's --trace")
    # vLLM sends --num-prompts requests (default 1000) whatever the dataset holds
    result.overrides.setdefault("trace_options.max_requests", 1000)


def _goodput(items: list[str], what: str, result: Translation) -> None:
    """--goodput ttft:500 tpot:50 (milliseconds, vLLM's unit) -> slo.ttft / slo.tpot."""
    for item in items:
        key, sep, value = item.partition(":")
        key = key.strip().lower()
        try:
            ms = float(value)
        except ValueError:
            ms = None
        if not sep or ms is None or ms <= 0 or key not in ("ttft", "tpot", "e2el"):
            raise VllmArgsError(f"{what} --goodput {item!r}: expected KEY:MILLISECONDS with KEY ttft, tpot or e2el")
        if key == "e2el":
            result.warnings.append(f"{what} --goodput e2el:{value}: not modelled (kvsim's goodput counts requests "
                                   "within the TTFT and TPOT SLOs)")
            continue
        result.overrides[f"slo.{key}"] = f"{ms:g}ms"


# ---- both lines together ------------------------------------------------------------------------------------
def translate(serve: str | None, bench: str | None) -> Translation:
    """The config overrides of a pasted `vllm serve` line and/or `vllm bench serve` line; a model named in both
    must be the same."""
    result = Translation()
    parts = [parse_serve(serve) if serve else None, parse_bench(bench) if bench else None]
    serve_part, bench_part = parts
    if serve_part and bench_part and "model" in bench_part.overrides and "model" in serve_part.overrides \
            and bench_part.overrides["model"] != serve_part.overrides["model"]:
        raise VllmArgsError(f"--bench --model {bench_part.overrides['model']} differs from the served model "
                            f"{serve_part.overrides['model']} (--vllm); the benchmark must target the served model")
    for part in (serve_part, bench_part):
        if part is not None:
            result.overrides.update(part.overrides)
            result.data_parallel = max(result.data_parallel, part.data_parallel)
            result.notes += part.notes
            result.warnings += part.warnings
    return result


@dataclass(frozen=True)
class VllmOptions:
    """vLLM's flags given to a kvsim command: pasted lines (`--vllm`, `--bench`) and the vLLM-only options
    that need vLLM's meaning (the rest are plain aliases of kvsim options)."""
    serve: str | None = None
    bench: str | None = None
    dtype: str | None = None
    quantization: str | None = None
    dataset_name: str | None = None
    dataset_path: str | None = None
    goodput: list[str] | None = None


def translate_options(options: VllmOptions) -> Translation:
    """The config overrides of `options`: the pasted lines first, then the single flags (a flag given both
    ways to different values is refused)."""
    result = translate(options.serve, options.bench)
    if result.data_parallel > 1:
        _moe_data_parallel(result)
    single = Translation()
    values = {name: value for name, value in (("--dtype", options.dtype), ("--quantization", options.quantization))
              if value is not None}
    if values:
        _serve_specials(values, "", single)
    if options.dataset_name is not None or options.dataset_path is not None:
        bench = {"--dataset-name": options.dataset_name or "random"}
        if options.dataset_path is not None:
            bench["--dataset-path"] = options.dataset_path
        _dataset(bench, "", single)
        single.overrides.pop("trace_options.max_requests")     # kvsim's own default count applies
    if options.goodput:
        _goodput(options.goodput, "", single)
    for key, value in single.overrides.items():
        if key in result.overrides and result.overrides[key] != value:
            raise VllmArgsError(f"{key}: {result.overrides[key]!r} from the pasted line but {value!r} from an option")
        result.overrides[key] = value
    result.notes += [n.lstrip() for n in single.notes]
    result.warnings += [w.lstrip() for w in single.warnings]
    return result
