"""Validated simulation configuration (YAML file and/or CLI options; CLI overrides win)."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator


class ConfigError(ValueError):
    """A configuration value is missing, unknown or out of range; the message names it."""


_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "min": 60.0}


_DURATION = re.compile(r"\s*([0-9]*\.?[0-9]+(?:e-?\d+)?)\s*(us|ms|s|min)\s*")


def parse_duration(text: str | float, what: str = "duration") -> float:
    """'100ms' -> 0.1. A bare number is refused: SLOs without units are ambiguous."""
    m = _DURATION.fullmatch(str(text))
    if not m:
        raise ConfigError(f"{what}: {text!r} is not a duration with a unit (e.g. 200ms, 2s, 500us)")
    return float(m.group(1)) * _UNITS[m.group(2)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class EngineConfig(_Strict):
    block_size: int = Field(16, gt=0)
    num_gpu_blocks: int | None = Field(None, gt=0, description="KV pool size; default: computed from GPU memory")
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    max_num_seqs: int | None = Field(None, gt=0, description="default: vLLM's for the GPU and entry point")
    max_num_batched_tokens: int | None = Field(None, gt=0,
                                               description="default: vLLM's for the GPU and entry point")
    entry_point: Literal["serve", "offline"] = Field(
        "serve", description="whose batch defaults apply: `vllm serve` (OpenAI server) or the offline LLM class")
    long_prefill_token_threshold: int = Field(0, ge=0)
    max_model_len: int | None = Field(None, gt=1)
    enable_prefix_caching: bool | None = Field(
        None, description="default: on (vLLM's default), off with KV eviction policies (they break shared blocks)")
    enable_chunked_prefill: bool = True
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    preemption_mode: Literal["recompute", "swap"] = "recompute"
    swap_space_gib: float = Field(4.0, ge=0)
    async_scheduling: bool | None = Field(
        None, description="schedule step k+1 while step k runs; default: on for GPUs, off for CPUs (as vLLM)")

    @field_validator("block_size")
    @classmethod
    def _power_of_two(cls, v: int) -> int:
        if v & (v - 1):
            raise ValueError(f"block_size must be a power of two, got {v}")
        return v


class TraceOptions(_Strict):
    rate_scale: float = Field(1.0, gt=0, description="arrival-rate multiplier (2 = twice as fast)")
    max_requests: int | None = Field(None, gt=0)
    start_s: float | None = Field(None, ge=0)
    end_s: float | None = Field(None, gt=0)
    rate: float | None = Field(None, gt=0, description="Poisson rate for length-only traces")
    arrival_unit: Literal["time", "step"] = Field(
        "time", description="step: arrival_time_s holds the engine step before which a request arrives")


class SLO(_Strict):
    ttft: str | None = None
    tpot: str | None = None

    @field_validator("ttft", "tpot", mode="before")
    @classmethod
    def _has_unit(cls, v):
        if v is None:
            return v
        if isinstance(v, bool) or not isinstance(v, (str, int, float)) or not _DURATION.fullmatch(str(v)):
            raise ValueError("not a duration with a unit; expected e.g. 2s, 200ms or 500us (a bare number is "
                             "ambiguous)")
        return str(v)

    @property
    def ttft_s(self) -> float | None:
        return None if self.ttft is None else parse_duration(self.ttft)

    @property
    def tpot_s(self) -> float | None:
        return None if self.tpot is None else parse_duration(self.tpot)


class KVConfig(_Strict):
    """KV eviction / compression / fragmentation (sim/kv). Defaults keep vLLM's full cache."""
    policy: Literal["none", "streaming", "h2o", "snapkv", "pyramidkv", "ada_snapkv", "kvcompress", "leankv",
                    "quest", "tokenselect", "recorded"] = "none"
    budget: int | None = Field(None, gt=0, description="tokens kept per head (policies with a budget)")
    params: dict[str, Any] = Field(default_factory=dict, description="extra policy parameters")
    layout: Literal["shared", "per_head"] = "shared"
    slot_strategy: Literal["noop", "free_block", "slot_reuse", "sparse_copy", "holed_copy", "compact",
                           "parallel_compact"] = "free_block"
    trigger: Literal["policy", "never", "every_step", "every_n", "after_prefill", "after_prefill+pressure",
                     "pressure", "threshold"] = "policy"
    trigger_interval: int = Field(1, gt=0, description="every_n: decode steps between compressions")
    trigger_threshold: int = Field(0, ge=0, description="threshold: tokens added between compressions")
    importance: str = Field("smollm2-135m", description="synthetic importance model (sim/data/importance) or YAML")
    mode: Literal["token", "fast"] = Field("token", description="token-level state or block-occupancy fast mode")
    fast_rows: int = Field(8, gt=0, description="fast mode: (layer, KV head) rows simulated, each standing for "
                                                "layers x KV heads / fast_rows rows (rounded down to a divisor)")
    high_tier: str = "K8V4"
    low_tier: str = "K4V2"

    @property
    def is_default(self) -> bool:
        """The plain vLLM path (base KVCacheManager, decode fast-forward) applies."""
        return self.policy == "none" and self.layout == "shared"


class SimConfig(_Strict):
    trace: str = "azure-conv-2023"
    trace_options: TraceOptions = TraceOptions()
    model: str = "llama-3.1-8b"
    gpu: str = "h100"
    tp: int = Field(1, gt=0)
    replicas: int = Field(1, gt=0)
    router: Literal["round_robin", "least_outstanding"] = "round_robin"
    profile: str = "default"
    kv_dtype: str | None = None
    weight_dtype: str | None = None      # decoder-layer weight dtype (fp16, bf16, fp8, int8, int4); None: the catalog's
    engine: EngineConfig = EngineConfig()
    kv: KVConfig = KVConfig()
    slo: SLO = SLO(ttft="2s", tpot="100ms")
    seed: int = 0
    fast_forward: bool = True
    check_invariants: bool = False


def _format_errors(exc: ValidationError, source: str) -> str:
    lines = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "(root)"
        msg = err["msg"].removeprefix("Value error, ")
        lines.append(f"{source}: {loc}: {msg} (got {err.get('input')!r})")
    return "\n".join(lines)


def _set_dotted(data: dict, key: str, value: Any) -> None:
    parts = key.split(".")
    node = data
    for p in parts[:-1]:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ConfigError(f"--set {key}: {p} is not a section")
    node[parts[-1]] = value


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None,
                sets: list[str] | tuple[str, ...] = ()) -> SimConfig:
    """Read an optional YAML file, apply dotted overrides (`{"engine.block_size": 32}`), then the
    command line's `--set KEY=VALUE` items, and validate."""
    overrides = dict(overrides or {})
    for item in sets:
        key, value = parse_set_option(item)
        overrides[key] = value
    data: dict = {}
    source = "config"
    if path is not None:
        source = str(path)
        try:
            data = yaml.safe_load(Path(path).read_text()) or {}
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {path}") from None
        except IsADirectoryError:
            raise ConfigError(f"--config {path}: is a directory; expected a YAML config file "
                              f"(e.g. {Path(path) / 'config.yaml'})") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"--config {path}: cannot be read ({getattr(exc, 'strerror', None) or exc.reason}); "
                              "expected a YAML config file") from None
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path}: not valid YAML: {yaml_problem(exc)}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: expected a mapping of options at the top level")
    for key, value in (overrides or {}).items():
        if value is not None:
            _set_dotted(data, key, value)
    try:
        return SimConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_format_errors(exc, source)) from None


def parse_set_option(item: str) -> tuple[str, Any]:
    """'engine.block_size=32' -> ('engine.block_size', 32), values parsed as YAML scalars."""
    key, sep, raw = item.partition("=")
    if not sep or not key:
        raise ConfigError(f"--set {item!r}: expected KEY=VALUE, e.g. engine.block_size=32")
    try:
        return key.strip(), yaml.safe_load(raw)
    except yaml.YAMLError as exc:
        raise ConfigError(f"--set {item!r}: the value is not valid YAML ({yaml_problem(exc)}); expected a "
                          "number, true/false, a word, [a, list] or {a: mapping}") from None


def yaml_problem(exc: yaml.YAMLError) -> str:
    """A YAML error in one line, without the quoted source lines PyYAML appends."""
    problem = getattr(exc, "problem", None) or "parse error"
    mark = getattr(exc, "problem_mark", None)
    return f"{problem} at line {mark.line + 1}, column {mark.column + 1}" if mark else problem
