"""Validated simulation configuration (YAML file and/or CLI options; CLI overrides win)."""
from __future__ import annotations

import copy
import math
import os
import re
from pathlib import Path
from typing import Annotated, Any, Literal
from collections.abc import Callable

import yaml
from pydantic import (
    BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationError, ValidationInfo, field_validator, model_serializer,
    model_validator,
)

from kvsim.traces.durations import EXAMPLES as DURATION_EXAMPLES
from kvsim.traces.durations import duration_seconds
from kvsim.traces.formats import FORMATS as TRACE_FORMATS
from kvsim.traces.formats import GENERIC_FORMATS

from .model.catalog import get_gpu, get_model, normalize_dtype
from .model.links import link_names
from .kv.policy import PolicyError
from .kv.policy import policy_names as registered_policy_names
from .kv.slots import SLOT_STRATEGIES
from .io.safe_io import MAX_SET_VALUE_CHARS, InputError, load_yaml_file, safe_yaml_load, short_repr
from .io.yaml_errors import yaml_problem


class ConfigError(ValueError):
    """A configuration value is missing, unknown or out of range; the message names it."""


def parse_duration(text: str | float, what: str = "duration") -> float:
    """'100ms' -> 0.1 (kvsim.traces.durations, the one parser). A bare number is refused: SLOs without units
    are ambiguous."""
    seconds = duration_seconds(text, unit_required=True)
    if seconds is None:
        raise ConfigError(f"{what}: {text!r} is not a duration with a unit ({DURATION_EXAMPLES})")
    return seconds


def policy_names() -> list[str]:
    """Every KV policy registered so far (built-in ones and plug-ins registered with @register_policy)."""
    return registered_policy_names()


def slot_strategy_names() -> list[str]:
    return list(SLOT_STRATEGIES)


# config keys whose valid values come from a registry, not from the type: key -> names provider
REGISTRY_CHOICES: dict[str, Callable[[], list[str]]] = {"kv.policy": policy_names,
                                                        "kv.slot_strategy": slot_strategy_names}


def registry_choices(key: str) -> list[str] | None:
    """Valid values of a registry-backed dotted config key (kv.policy, ...), or None for other keys."""
    names = REGISTRY_CHOICES.get(key)
    return None if names is None else names()


def _one_of(value: str, names: list[str], what: str) -> str:
    if value not in names:
        raise ValueError(f"unknown {what} {value!r}; known: {', '.join(names)}")
    return value


class _Strict(BaseModel):
    # inf and nan are refused in every float field (a rate scale of inf, a nan memory fraction)
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


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
    enable_expert_parallel: bool = Field(
        False, description="MoE models: each MoE layer's experts split over the TP group's GPUs, all-to-all "
                           "instead of the MLP all-reduce (vLLM's --enable-expert-parallel)")

    @model_serializer(mode="wrap")
    def _dump(self, handler):
        data = handler(self)
        if not self.enable_expert_parallel:      # off: left out, so configs written before it stay as they were
            data.pop("enable_expert_parallel", None)
        return data

    @field_validator("block_size")
    @classmethod
    def _power_of_two(cls, v: int) -> int:
        if v & (v - 1):
            raise ValueError(f"block_size must be a power of two, got {v}")
        return v


class RandomDataset(_Strict):
    """`trace: random`: vllm bench serve's random dataset (--random-input-len, ...; its defaults)."""
    input_len: int = Field(1024, gt=0, description="--random-input-len")
    output_len: int = Field(128, gt=0, description="--random-output-len")
    range_ratio: float = Field(0.0, ge=0, lt=1, description="--random-range-ratio: lengths uniform in L(1 -+ r)")
    prefix_len: int = Field(0, ge=0, description="--random-prefix-len: tokens every prompt shares first")


# `trace: random` is vllm bench serve's random dataset, not a file; its request count without max_requests
RANDOM_TRACE = "random"
RANDOM_DEFAULT_NUM_PROMPTS = 1000      # vllm bench serve's --num-prompts default


class SessionOptions(_Strict):
    """Multi-turn sessions run as a closed loop per session (sim/engine/sessions.py, docs/kv-tiers.md#sessions):
    a session's later turns are released when the previous answer finished plus a think time."""
    # at most 1e9 s (~31 years, a trace's own limit on times, traces/loaders.py's MAX_TIME_S): beyond, a run's
    # makespan and throughputs are nonsense (1e300 s, 2e-300 req/s)
    think_time_s: float | None = Field(None, ge=0, le=1e9, description="seconds between an answer and the next "
                                       "turn; default: the trace's gap between the two turns")
    history: Literal["in_prompt", "append"] = Field(
        "in_prompt", description="in_prompt: a turn's prompt_tokens hold the conversation so far; append: they "
                                 "are the new message only (the conversation so far is added)")


class SyntheticSessions(_Strict):
    """`trace: synthetic-sessions`: seeded multi-turn sessions (traces/sessions.py); length specs as
    traces/synthetic.py's (fixed:L, uniform:LO,HI, lognormal:MEAN,CV[,MAX])."""
    sessions: int = Field(64, gt=0, description="number of sessions")
    turns: str = Field("uniform:2,8", description="turns per session (a length spec)")
    first_tokens: str = Field("lognormal:1000,1.0,8000", description="tokens of a session's first message")
    user_tokens: str = Field("lognormal:200,1.0,2000", description="tokens of every later user message")
    output_tokens: str = Field("lognormal:250,0.8,1000", description="tokens of each answer")
    think_time_s: float = Field(10.0, ge=0, le=1e9, description="mean think time between an answer and the next "
                                                                 "turn (exponential), s")
    session_rate: float | None = Field(1.0, gt=0, description="sessions started per second (Poisson); "
                                                              "null: all at t=0")


# `trace: synthetic-sessions` is a generated multi-turn workload (trace_options.synthetic_sessions), not a file
SESSIONS_TRACE = "synthetic-sessions"


class TraceOptions(_Strict):
    rate_scale: float = Field(1.0, gt=0, description="arrival-rate multiplier (2 = twice as fast)")
    max_requests: int | None = Field(None, gt=0)
    start_s: float | None = Field(None, ge=0)
    end_s: float | None = Field(None, gt=0)
    rate: float | None = Field(None, gt=0, description="Poisson rate for length-only traces")
    arrival_unit: Literal["time", "step"] = Field(
        "time", description="step: arrival_time_s holds the engine step before which a request arrives")
    # the load options of `vllm bench serve` (docs/traces.md, "Load as vllm bench serve applies it")
    # .inf is a value here, as in vllm bench serve (all at once; constant gaps): the only config floats that take it
    request_rate: float | None = Field(
        None, gt=0, allow_inf_nan=True, description="vllm bench serve --request-rate: req/s for a trace without arrival times "
                                "(.inf: all at t=0)")
    burstiness: float = Field(1.0, gt=0, allow_inf_nan=True, description="Gamma shape of the gaps with request_rate: 1 Poisson, "
                                                     "<1 burstier, >1 more regular")
    max_concurrency: int | None = Field(
        None, gt=0, description="vllm bench serve --max-concurrency: at most this many requests in flight; "
                                "the next one is sent when one finishes")
    # reading the trace file (traces/loaders.py, traces/user_formats.py)
    format: str | None = Field(None, description="trace file format; default: detected (csv, jsonl, parquet: "
                                                 "a log read through `columns`, never detected)")
    columns: dict[str, str] | str | None = Field(
        None, description="csv/jsonl/parquet: kvsim field -> source column, e.g. arrival=timestamp,"
                          "prompt_tokens=usage.prompt_tokens,output_tokens=usage.completion_tokens")
    time_unit: Literal["s", "ms", "us", "ns"] = Field("s", description="csv/jsonl/parquet: unit of epoch times")
    tokenizer: str | None = Field(None, description="ShareGPT: tokenizer.json (or its model directory) counting "
                                                    "tokens; default: the shipped SmolLM2 tokenizer")
    random: RandomDataset | None = Field(None, description="trace: random: the random dataset's lengths")
    request_timeout: float | None = Field(
        None, gt=0, description="seconds from a request's send after which the client gives up on it (aiohttp's "
                                "total timeout; vllm bench serve's is 6 h): it is aborted in the engine and "
                                "counted failed; default: none")
    sessions: SessionOptions | None = Field(
        None, description="multi-turn sessions as a closed loop per session (the trace's session_id); default: none")
    synthetic_sessions: SyntheticSessions | None = Field(
        None, description="trace: synthetic-sessions: the generated sessions' shape")

    @model_serializer(mode="wrap")
    def _dump(self, handler):
        data = handler(self)
        if self.random is None:          # left out unless set, so configs written before it stay as they were
            data.pop("random", None)
        if self.request_timeout is None:     # unset: left out, so configs and run ids stay as they were
            data.pop("request_timeout", None)
        for key in ("sessions", "synthetic_sessions"):      # unset: left out (configs and run ids as they were)
            if getattr(self, key) is None:
                data.pop(key, None)
        return data

    @model_validator(mode="after")
    def _load_options_agree(self) -> TraceOptions:
        if self.request_rate is not None and self.rate is not None:
            raise ValueError("request_rate and rate both set arrivals for a length-only trace; give one "
                             "(request_rate: vllm bench serve's arrivals, rate: Poisson from t=0)")
        if self.burstiness != 1.0 and self.request_rate is None:
            raise ValueError(f"burstiness {self.burstiness:g} has no effect without request_rate")
        if self.format is not None and self.format not in TRACE_FORMATS:
            raise ValueError(f"unknown trace format {self.format!r}; expected one of {', '.join(TRACE_FORMATS)}")
        if self.columns is not None and self.format not in GENERIC_FORMATS:
            raise ValueError(f"columns map a csv, jsonl or parquet log; give format: csv|jsonl|parquet "
                             f"(got format {self.format!r})")
        if self.time_unit != "s" and self.format not in GENERIC_FORMATS:
            # a detected format has its own unit (Mooncake: ms); the option would be ignored
            raise ValueError(f"time_unit {self.time_unit!r} applies to a csv, jsonl or parquet log's epoch times; "
                             f"give format: csv|jsonl|parquet (got format {self.format!r})")
        if self.max_concurrency is not None and self.arrival_unit == "step":
            raise ValueError("max_concurrency needs arrival_unit: time (arrivals by engine step are fixed)")
        if self.sessions is not None and self.arrival_unit == "step":
            raise ValueError("sessions need arrival_unit: time (a turn is released after an answer and a think time)")
        if self.request_timeout is not None and self.arrival_unit == "step":
            raise ValueError("request_timeout needs arrival_unit: time (a timeout counts seconds from a send)")
        return self

    def file_options(self) -> dict:
        """load_trace's format and reader options (only those given)."""
        out = {"format": self.format} if self.format else {}
        if self.format in GENERIC_FORMATS:
            out.update(columns=self.columns, time_unit=self.time_unit)
        if self.tokenizer is not None:
            out["tokenizer"] = self.tokenizer
        return out


class SLO(_Strict):
    ttft: str | None = None
    tpot: str | None = None

    @field_validator("ttft", "tpot", mode="before")
    @classmethod
    def _has_unit(cls, v):
        if v is None:
            return v
        if isinstance(v, bool) or not isinstance(v, (str, int, float)) or duration_seconds(v, unit_required=True) is None:
            raise ValueError(f"not a duration with a unit; expected {DURATION_EXAMPLES} (a bare number is ambiguous)")
        return str(v)

    @property
    def ttft_s(self) -> float | None:
        return None if self.ttft is None else parse_duration(self.ttft)

    @property
    def tpot_s(self) -> float | None:
        return None if self.tpot is None else parse_duration(self.tpot)


class KVConfig(_Strict):
    """KV eviction / compression / fragmentation (sim/kv). Defaults keep vLLM's full cache."""
    policy: str = Field("none", description="a registered KV policy (sim.kv.policy.register_policy)")
    budget: int | None = Field(None, gt=0, description="tokens kept per head (policies with a budget)")
    params: dict[str, Any] = Field(default_factory=dict, description="extra policy parameters")
    layout: Literal["shared", "per_head"] = "shared"
    slot_strategy: str = Field("free_block", description="how freed token slots are handled (sim.kv.manager)")
    trigger: Literal["policy", "never", "every_step", "every_n", "after_prefill", "after_prefill+pressure",
                     "pressure", "threshold"] = "policy"
    trigger_interval: int = Field(1, gt=0, description="every_n: decode steps between compressions")
    trigger_threshold: int = Field(0, ge=0, description="threshold: tokens added between compressions")
    copy_threshold: int = Field(0, ge=0, description="sparse_copy / holed_copy: rewrite a row only once "
                                                     "it holds more than this many holes (0: after every eviction)")
    importance: str = Field("smollm2-135m", description="synthetic importance model (sim/data/importance) or YAML")
    mode: Literal["token", "fast"] = Field("token", description="token-level state or block-occupancy fast mode")
    fast_rows: int = Field(8, gt=0, description="fast mode: (layer, KV head) rows simulated, each standing for "
                                                "layers x KV heads / fast_rows rows (rounded down to a divisor)")
    high_tier: str = "K8V4"
    low_tier: str = "K4V2"

    @field_validator("policy")
    @classmethod
    def _registered_policy(cls, v: str) -> str:
        return _one_of(v, policy_names(), "KV policy")

    @field_validator("slot_strategy")
    @classmethod
    def _known_slot_strategy(cls, v: str) -> str:
        return _one_of(v, slot_strategy_names(), "slot strategy")

    @property
    def is_default(self) -> bool:
        """The plain vLLM path (base KVCacheManager, decode fast-forward) applies."""
        return self.policy == "none" and self.layout == "shared"

    def policy_params(self) -> dict:
        """The policy's constructor parameters: `params`, with `budget` when given."""
        params = dict(self.params)
        if self.budget is not None:
            params.setdefault("budget", self.budget)
        return params


# config keys whose value may name a user file (dotted: section.key): run ids hash their content
# (sweep.input_file_digests), config.yaml keeps them absolute (outputs.portable_config)
FILE_KEYS = ("trace", "model", "gpu", "profile", "kv.importance", "trace_options.tokenizer")
# a FILE_KEYS value names a file (not a catalog entry, shipped trace or profile name) when it holds a
# '/' or ends in one of these
FILE_SUFFIXES = (".yaml", ".yml", ".json", ".jsonl", ".csv", ".parquet")


def split_file_value(value: str) -> tuple[str, str, str]:
    """A FILE_KEYS value as (path or name, separator, rest): a catalog file's entry (`file.yaml#Name`)
    and a profile's factor (`file.yaml*1.2`) are not part of the path."""
    head, sep, tail = value.partition("#")
    if not sep:
        stem, star, factor = value.rpartition("*")
        if star and re.fullmatch(r"\s*[0-9.eE+-]+\s*", factor):
            head, sep, tail = stem, star, factor
    return head, sep, tail


def names_a_file(head: str) -> bool:
    """Whether a FILE_KEYS value's path part names a file (a shipped name or catalog entry does not)."""
    return "/" in head or Path(head).suffix.lower() in FILE_SUFFIXES


def file_value_under(value: Any, root: Path) -> Any:
    """A FILE_KEYS value naming a relative file, as the path under `root` (absolute); any other value
    unchanged. A catalog file's entry (`file.yaml#Name`) and a profile's factor (`file.yaml*1.2`) stay."""
    if not isinstance(value, str):
        return value
    head, sep, tail = split_file_value(value)
    if Path(head).is_absolute() or not names_a_file(head):
        return value
    return os.path.normpath(root.absolute() / head) + sep + tail


def files_under(data: dict, root: Path) -> dict:
    """A copy of a config mapping (nested, dotted keys or both) whose relative file paths (FILE_KEYS) are
    read under `root`: a sweep spec's directory, for the paths written in the spec."""
    out = copy.deepcopy(data)
    for dotted in FILE_KEYS:
        *sections, key = dotted.split(".")
        parent = out if dotted in out else config_section(out, sections)
        target = dotted if dotted in out else key
        if isinstance(parent, dict) and target in parent:
            parent[target] = file_value_under(parent[target], root)
    return out


def config_section(data: dict, sections: list[str]):
    """The nested mapping at `sections` (e.g. ['kv'] for kv.importance), or None where one is missing."""
    for name in sections:
        data = data.get(name) if isinstance(data, dict) else None
    return data


class RouterOptions(_Strict):
    """Settings of the KV-aware routers (sim/engine/routers). Absent: exact load signals, defaults."""
    refresh_s: float = Field(0.0, ge=0, description="load signals refreshed every this many seconds (0: exact)")
    weights: dict[str, float] | None = Field(None, description="weighted router: scorer -> weight "
                                             "(queue, kv_usage, prefix, approx_prefix)")
    prefix_block_tokens: int = Field(64, gt=0, description="prefix_affinity: tokens per hashed prompt block")
    prefix_table_size: int = Field(100_000, gt=0, description="prefix_affinity: block chains remembered (LRU)")


SPEC_METHODS = ("ngram", "eagle", "eagle3", "mtp", "draft_model")
# vLLM's other names for a method: the "[ngram]" model string and the per-architecture MTP names
SPEC_METHOD_ALIASES = {"[ngram]": "ngram", "deepseek_mtp": "mtp", "mimo_mtp": "mtp", "qwen3_next_mtp": "mtp",
                       "glm4_moe_mtp": "mtp", "ernie_mtp": "mtp", "longcat_flash_mtp": "mtp"}


class SpeculativeConfig(_Strict):
    """vLLM's `--speculative-config` JSON (its keys and meanings; docs/speculative-decoding.md). kvsim
    resolves it once per run (sim/model/spec_decode.py): method, drafter cost, acceptance, KV memory."""
    method: str | None = Field(None, description="ngram | eagle | eagle3 | mtp | draft_model (vLLM's names; "
                               "default: from `model` as vLLM infers it)")
    model: str | None = Field(None, description="the drafter: a catalog model (draft_model), an EAGLE head's "
                              "name (recorded), or ngram")
    num_speculative_tokens: int | None = Field(None, gt=0, le=64, description="k: draft tokens per step")
    draft_tensor_parallel_size: int | None = Field(None, gt=0, description="the drafter's TP (1 or the target's)")
    prompt_lookup_min: int | None = Field(None, description="ngram: shortest n-gram matched (vLLM default 5)")
    prompt_lookup_max: int | None = Field(None, description="ngram: longest n-gram matched (vLLM default 5)")
    synthetic_acceptance_rates: list[float] | None = Field(
        None, min_length=1, description="per-position acceptance rates (vLLM's metric: accepted at position i / "
                                        "drafts), non-increasing in [0, 1]; default: sim/data/spec_decode.yaml")
    # vLLM keys that change nothing kvsim prices (accepted so a vLLM config reads unchanged)
    quantization: str | None = None
    max_model_len: int | None = None
    revision: str | None = None
    code_revision: str | None = None
    disable_padded_drafter_batch: bool | None = None
    enforce_eager: bool | None = None

    @field_validator("method")
    @classmethod
    def _method(cls, v: str | None) -> str | None:
        if v is None:
            return v
        v = SPEC_METHOD_ALIASES.get(v, v)
        if v not in SPEC_METHODS:
            raise ValueError(f"unknown method {v!r}; expected one of {', '.join(SPEC_METHODS)}")
        return v

    @field_validator("synthetic_acceptance_rates")
    @classmethod
    def _rates(cls, v: list[float] | None) -> list[float] | None:
        if v is not None:
            if not all(0.0 <= r <= 1.0 for r in v):
                raise ValueError(f"expected rates in [0, 1], got {v}")
            if any(b > a for a, b in zip(v, v[1:], strict=False)):
                raise ValueError(f"expected non-increasing rates (position i+1 is accepted only after i), got {v}")
        return v

    @model_validator(mode="before")
    @classmethod
    def _resolve_method(cls, data: Any) -> Any:
        """vLLM's rules: ngram from `model: ngram`; else eagle3 / eagle from the head's name; else
        draft_model; n-gram lookups default to 5 and 5, one given sets the other."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        method, model = data.get("method"), data.get("model")
        if method is None:
            if model is None:
                return data          # refused when the run is resolved (a sweep's grid may set the method later)
            name = str(model).lower()
            data["method"] = method = ("ngram" if name in ("ngram", "[ngram]") else "eagle3" if "eagle3" in name
                                       else "eagle" if "eagle" in name else "draft_model")
        method = SPEC_METHOD_ALIASES.get(method, method) if isinstance(method, str) else method
        if method == "ngram":
            lo, hi = data.get("prompt_lookup_min"), data.get("prompt_lookup_max")
            lo, hi = (5, 5) if lo is None and hi is None else (lo if lo is not None else hi, hi if hi is not None else lo)
            if isinstance(lo, int) and isinstance(hi, int) and (lo < 1 or hi < 1 or lo > hi):
                raise ValueError(f"prompt_lookup_min={lo} must be >= 1 and <= prompt_lookup_max={hi}")
            data["prompt_lookup_min"], data["prompt_lookup_max"] = lo, hi
        if method == "draft_model" and model is None:
            raise ValueError("method draft_model needs model: the draft model (a catalog name or a config.json)")
        return data


class KVOffloadConfig(_Strict):
    """vLLM's OffloadingConnector: a CPU tier per replica (sim/cluster/connectors/offload.py,
    docs/kv-tiers.md). Absent: no offload (vLLM without --kv-transfer-config)."""
    # at most 1 PiB a replica: a host holds tens of TiB at most; a larger figure is a typo, and its CPU memory
    # would be what plan and capacity price the answer's GPUs with
    cpu_gib: float = Field(gt=0, le=2**20, description="CPU memory per replica for KV blocks, GiB (vLLM's "
                           "cpu_bytes_to_use), at most 1 PiB")
    bandwidth_gb_s: float | None = Field(None, gt=0, description="host link GB/s per direction per replica; "
                                         "default: the GPU's PCIe x the profile's pcie_eff x tp")
    latency_s: float = Field(1e-5, ge=0, description="per-transfer latency on the host link, s")
    eviction: Literal["lru"] = "lru"
    connector: Literal["offloading", "lmcache"] = Field(
        "offloading", description="offloading: vLLM's OffloadingConnector (loads and stores beside the steps); "
        "lmcache: LMCache's connector (a hit loaded and new chunks saved inside the step, 256-token chunks)")
    # LMCache's CPU work in the step (connector lmcache; docs/kv-tiers.md#lmcaches-cpu-work): its token database
    # hashes a request's 256-token chunks from the first token at every lookup and every save (the chained prefix
    # hash), and each saved chunk is allocated in and put to the CPU backend
    lmcache_hash_s_per_token: float = Field(3.2e-8, ge=0, le=1.0, description="connector lmcache: CPU seconds to "
                                            "hash one token (LMCache's chunk hash; measured: bench/lmcache_cpu_cost.py)")
    lmcache_put_s_per_chunk: float = Field(1.8e-5, ge=0, le=1.0, description="connector lmcache: CPU seconds to "
                                           "allocate and put one saved chunk (LMCache's logged put_time)")
    chunk_tokens: int | None = Field(None, gt=0, le=2**20, description="tokens per offloaded block, a multiple of "
                                     "engine.block_size; default: 256 with connector lmcache (LMCache's "
                                     "chunk_size), else the GPU block")
    # LMCache's local disk backend, one per replica (docs/kv-tiers.md#disk-and-remote-tiers); the bandwidths
    # default to one PCIe 4.0 NVMe drive's sequential figures (Samsung 990 PRO datasheet: 7,450 / 6,900 MB/s)
    disk_gib: float | None = Field(None, gt=0, le=2**20, description="local disk per replica for KV, GiB "
                                   "(LMCache's max_local_disk_size); absent: no disk tier")
    disk_read_gb_s: float = Field(7.45, gt=0, description="disk read bandwidth per replica, GB/s")
    disk_write_gb_s: float = Field(6.9, gt=0, description="disk write bandwidth per replica, GB/s")
    disk_latency_s: float = Field(1e-4, ge=0, description="per-transfer disk latency, s")
    # LMCache's remote backend (a store the fleet shares: Redis, Mooncake, ...), over each GPU's NIC
    remote_gib: float | None = Field(None, gt=0, le=2**30, description="the remote store's capacity for KV, GiB, "
                                     "shared by all replicas; absent: no remote tier")
    remote_link: str = Field("roce-100g", description="the NIC a replica reaches the store over (sim/data/links.yaml)")
    remote_bandwidth_gb_s: float | None = Field(None, gt=0, description="GB/s per direction per GPU; default: the link's")
    remote_latency_s: float | None = Field(None, ge=0, description="per-transfer latency, s; default: the link's")

    @field_validator("remote_link")
    @classmethod
    def _known_link(cls, v: str) -> str:
        from .model.links import link_names
        if v not in link_names():
            raise ValueError(f"unknown link {v!r}; known: {', '.join(link_names())}")
        return v


class PoolConfig(_Strict):
    """One pool of a disaggregated fleet (`fleet.prefill`, `fleet.decode`); unset fields take the run's."""
    gpu: str | None = Field(None, description="GPU catalog name; default: the run's gpu")
    tp: int | None = Field(None, gt=0, description="tensor parallel size of each replica; default: the run's tp")
    replicas: int = Field(1, gt=0)
    profile: str | None = Field(None, description="step-time profile; default: the run's (auto: the GPU's)")
    router: Literal["round_robin", "least_outstanding"] | None = None
    engine: dict[str, Any] = Field(default_factory=dict,
                                   description="engine settings of this pool over the run's engine section")

    @field_validator("gpu")
    @classmethod
    def _catalog_gpu(cls, v: str | None) -> str | None:
        if v is not None:
            get_gpu(v)
        return v

    @field_validator("engine")
    @classmethod
    def _engine_fields(cls, v: dict[str, Any]) -> dict[str, Any]:
        try:
            EngineConfig.model_validate(v)
        except ValidationError as exc:
            raise ValueError("; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())) from None
        return v


# a role's pools: one mapping (one pool, named after its role) or a list of them (named ROLE-0, ROLE-1, ...);
# the tags are left out of error locations (validation_message), so errors read fleet.prefill.gpu / fleet.prefill.1.gpu
POOL_TAGS = ("<one pool>", "<pools>")
PoolsOfRole = Annotated[Annotated[PoolConfig, Tag(POOL_TAGS[0])]
                        | Annotated[list[PoolConfig], Field(min_length=1), Tag(POOL_TAGS[1])],
                        Discriminator(lambda v: POOL_TAGS[1] if isinstance(v, list) else POOL_TAGS[0])]


def pool_names(role: str, pools: PoolConfig | list[PoolConfig]) -> list[str]:
    """The names of a role's pools: the role for one pool (a mapping), ROLE-0, ROLE-1, ... for a list."""
    return [role] if isinstance(pools, PoolConfig) else [f"{role}-{i}" for i in range(len(pools))]


class FleetConfig(_Strict):
    """Prefill/decode disaggregation (docs/disaggregation.md): prefill pools and decode pools joined by
    links, behind vLLM's disaggregated-serving proxy. The model and KV dtype are the run's (the KV must match)."""
    prefill: PoolsOfRole
    decode: PoolsOfRole
    pool_choice: str = Field(
        "least_work", description="with several pools of a role: how the proxy picks one (least_work: the least "
                                  "outstanding work over the pool's speed, then the pool's router; round_robin: "
                                  "over every instance of the role, as vLLM's toy proxy); a registered choice "
                                  "(sim/cluster/pool_choice.py), checked when the fleet is built")
    pair_links: dict[str, str] = Field(default_factory=dict, description="link type per pool pair, "
                                       "'PREFILL_POOL>DECODE_POOL: link' (default: link)")
    link: str = Field("ib-ndr", description="link type from sim/data/links.yaml (one GPU's link)")
    link_bandwidth_gb_s: float | None = Field(None, gt=0, description="replaces the link type's bandwidth (GB/s)")
    link_latency_s: float | None = Field(None, ge=0, description="replaces the link type's latency (s)")
    local_prefill_tokens: int = Field(0, ge=0, description="conditional disaggregation: prefill on the decode pool "
                                                           "when the uncached prompt is at most this; 0: never")
    abort_timeout_s: float = Field(480.0, gt=0, description="prefill side frees unpulled KV after this "
                                                            "(VLLM_NIXL_ABORT_REQUEST_TIMEOUT)")
    layerwise_overlap: bool = Field(False, description="layer-wise push of the hand-off (LMCache / Mooncake style): "
                                                       "layer l's KV moves while layer l+1 is prefilled; false: the "
                                                       "pull starts after the prefill leg (vLLM's NIXL connector)")

    @model_serializer(mode="wrap")
    def _dump(self, handler):
        data = handler(self)
        if not self.layerwise_overlap:      # off (the default): left out, so configs and run ids stay as they were
            data.pop("layerwise_overlap", None)
        if self.pool_choice == "least_work":       # the default: left out, as above
            data.pop("pool_choice", None)
        if not self.pair_links:
            data.pop("pair_links", None)
        return data

    def pools(self, role: str) -> list[tuple[str, PoolConfig]]:
        """(name, pool) of each pool of `role` (prefill or decode), in order."""
        given = getattr(self, role)
        return list(zip(pool_names(role, given), [given] if isinstance(given, PoolConfig) else given, strict=True))

    def all_pools(self) -> list[tuple[str, str, PoolConfig]]:
        """(role, name, pool) of every pool: the prefill pools, then the decode pools."""
        return [(role, name, pool) for role in ("prefill", "decode") for name, pool in self.pools(role)]

    @model_validator(mode="after")
    def _known_pairs(self) -> FleetConfig:
        prefill, decode = [n for n, _ in self.pools("prefill")], [n for n, _ in self.pools("decode")]
        for key, link in self.pair_links.items():
            p, sep, d = key.partition(">")
            if not sep or p not in prefill or d not in decode:
                raise ValueError(f"pair_links: expected keys 'PREFILL_POOL>DECODE_POOL' of pools {', '.join(prefill)} "
                                 f"and {', '.join(decode)} (e.g. {prefill[0]}>{decode[0]}), got {key!r}")
            if link not in link_names():
                raise ValueError(f"pair_links.{key}: expected a link of {', '.join(link_names())}, got {link!r}")
        return self

    @field_validator("link")
    @classmethod
    def _catalog_link(cls, v: str) -> str:
        if v not in link_names():
            raise ValueError(f"unknown link {v!r}; known: {', '.join(link_names())}")
        return v


class SimConfig(_Strict):
    trace: str = "azure-conv-2023"
    trace_options: TraceOptions = TraceOptions()
    model: str = "llama-3.1-8b"
    gpu: str = "h100"
    tp: int = Field(1, gt=0)
    # pipeline stages of a replica (vLLM's --pipeline-parallel-size): GPUs per replica = tp x pp x dp
    pp: int = Field(1, gt=0)
    # data-parallel attention ranks of a MoE replica (vLLM's --data-parallel-size with a MoE model): each rank its
    # own scheduler and KV cache, the MoE layers over all dp x tp GPUs, every step synchronised (docs/parallelism.md)
    dp: int = Field(1, gt=0)
    replicas: int = Field(1, gt=0)
    router: str = Field("round_robin", description="a registered router (sim/engine/routers; docs/kv-tiers.md)")
    router_options: RouterOptions | None = None
    profile: str = "auto"                # the GPU's shipped profile (sim/data/profiles; docs/gpu-profiles.md)
    kv_dtype: str | None = None
    weight_dtype: str | None = None      # decoder-layer weight dtype (fp16, bf16, fp8, int8, int4); None: the catalog's
    engine: EngineConfig = EngineConfig()
    kv: KVConfig = KVConfig()
    kv_offload: KVOffloadConfig | None = None
    slo: SLO = SLO(ttft="2s", tpot="100ms")
    seed: int = Field(0, ge=0, lt=2**63)
    metric_percentiles: list[float] = Field(
        [99.0], description="percentiles of TTFT/TPOT/ITL/E2EL in summary.json (vllm bench serve --metric-percentiles)")
    fast_forward: bool = True
    check_invariants: bool = False
    # the profile's client-side terms (API server, tokenization: what `vllm bench serve` measures beyond
    # the engine) in TTFT/TPOT/ITL/E2E; off: engine time only
    client_latency: bool = False
    # the frontend between the client and the engine (sim/simulator/client.py; docs/gpu-profiles.md#the-frontend):
    # none (engine time only), profile (the profile's client terms: client_latency: true) or a named set of
    # sim/data/frontends.yaml (vllm-api, ...); unset: as client_latency says
    frontend: str | None = None
    # $ per GPU-hour instead of the catalog's: one price (the run's GPU) or {gpu: price} (plans over GPUs)
    usd_per_hour: float | dict[str, float] | None = Field(None, description="your price per GPU-hour")
    # step-time variance (sim/engine/step_noise.py): 0 deterministic (the default), a lognormal sigma, or auto
    step_variance: float | Literal["auto"] = 0.0
    # per-request variation of the frontend's fixed latency (sim/simulator/client.py RequestJitter): 0 none
    # (the default), a lognormal sigma, or auto (sim/data/frontends.yaml's fitted one); needs a frontend
    frontend_jitter: float | Literal["auto"] = 0.0
    fleet: FleetConfig | None = None     # prefill/decode disaggregation; None: one pool of `replicas`
    # speculative decoding (vLLM's --speculative-config; docs/speculative-decoding.md); None: off
    speculative_config: SpeculativeConfig | None = None

    @model_serializer(mode="wrap")
    def _dump(self, handler):
        data = handler(self)
        if self.usd_per_hour is None:          # left out unless set, so configs written before it stay as they were
            data.pop("usd_per_hour", None)
        if self.step_variance == 0:          # the default: left out, so configs and run ids stay as they were
            data.pop("step_variance", None)
        if self.frontend is None:            # unset: left out, so configs and run ids stay as they were
            data.pop("frontend", None)
        if self.frontend_jitter == 0:        # the default: left out, so configs and run ids stay as they were
            data.pop("frontend_jitter", None)
        if self.fleet is None:          # aggregated: left out, so config.yaml stays as it was
            data.pop("fleet", None)
        if self.speculative_config is None:      # off: left out, so configs and run ids stay as they were
            data.pop("speculative_config", None)
        for key in ("pp", "dp"):        # 1: left out, so configs and run ids stay as they were
            if getattr(self, key) == 1:
                data.pop(key, None)
        return data

    @property
    def engine_ranks(self) -> int:
        """Engines the run steps: one per replica, dp per replica with data-parallel attention."""
        return self.replicas * self.dp

    @property
    def gpus_per_replica(self) -> int:
        return self.tp * self.pp * self.dp

    @field_validator("usd_per_hour", mode="before")
    @classmethod
    def _prices(cls, v):
        if isinstance(v, str):             # the command line's spelling: 2.5 or h100=2.5,h200=3.9
            v = v.strip()
            if "=" not in v:
                try:
                    return float(v)
                except ValueError:
                    raise ValueError("expected a price ($ per GPU-hour) or GPU=PRICE,... (h100=2.5,h200=3.9)") from None
            pairs = [item.partition("=") for item in v.split(",")]
            try:
                v = {key.strip(): float(value) for key, _, value in pairs}
            except ValueError:
                raise ValueError("expected GPU=PRICE,... with prices in $ per GPU-hour (h100=2.5,h200=3.9)") from None
        prices = v.values() if isinstance(v, dict) else [] if v is None else [v]
        if any(isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p < float("inf") for p in prices):
            raise ValueError("prices must be positive numbers ($ per GPU-hour)")
        if isinstance(v, dict):
            for key in v:
                get_gpu(key)               # CatalogError (a ValueError) names the known GPUs
        return v

    def gpu_usd_per_hour(self, gpu: str | None = None) -> float:
        """$ per hour of one `gpu` (default: the run's): usd_per_hour when it prices it, else the catalog's."""
        spec = get_gpu(gpu or self.gpu)
        price = self.usd_per_hour
        if isinstance(price, dict):
            given = {get_gpu(name).name: value for name, value in price.items()}
            return float(given.get(spec.name, spec.usd_per_hour))
        return float(price) if price is not None else spec.usd_per_hour

    @field_validator("frontend")
    @classmethod
    def _frontend(cls, v: str | None, info: ValidationInfo) -> str | None:
        from .model.cost_model import frontend_names
        if v is not None and v not in frontend_names():
            raise ValueError(f"unknown frontend {v!r}; expected one of {', '.join(frontend_names())}")
        if info.data.get("client_latency") and v not in (None, "profile"):
            raise ValueError(f"{v} contradicts client_latency: true (= frontend: profile); drop client_latency "
                             "(--client-latency)")
        options = info.data.get("trace_options")
        if v not in (None, "none") and options is not None and options.arrival_unit == "step":
            raise ValueError(f"{v} needs trace_options.arrival_unit: time (a frontend counts seconds from a send)")
        return v

    @property
    def frontend_name(self) -> str:
        """The run's frontend: `frontend`, else `profile` with client_latency, else `none` (engine only)."""
        if self.frontend is not None:
            return self.frontend
        return "profile" if self.client_latency else "none"

    @field_validator("step_variance")
    @classmethod
    def _sigma(cls, v):
        if v != "auto" and not 0 <= v <= 2:
            raise ValueError(f"expected auto or a lognormal sigma between 0 and 2 (0: deterministic), got {v!r}")
        return v

    @field_validator("step_variance", "frontend_jitter", mode="before")
    @classmethod
    def _sigma_spelling(cls, v, info: ValidationInfo):
        """A sigma setting: auto or a finite number (a string from --set or YAML), one line when not."""
        zero = "deterministic" if info.field_name == "step_variance" else "every request alike"
        bad = ValueError(f"expected auto or a lognormal sigma between 0 and 2 (0: {zero}), got {v!r}")
        if isinstance(v, bool):
            raise bad
        if isinstance(v, str) and v.strip().lower() != "auto":
            try:
                v = float(v)
            except ValueError:
                raise bad from None
        elif isinstance(v, str):
            return "auto"
        if isinstance(v, (int, float)) and not math.isfinite(v):
            raise bad
        return v

    @field_validator("frontend_jitter")
    @classmethod
    def _jitter(cls, v):
        if v != "auto" and not 0 <= v <= 2:
            raise ValueError(f"expected auto or a lognormal sigma between 0 and 2 (0: every request alike), got {v!r}")
        return v

    @model_validator(mode="after")
    def _jitter_needs_frontend(self):
        if self.frontend_jitter != 0 and self.frontend_name == "none":
            raise ValueError(f"frontend_jitter {self.frontend_jitter!r} varies the frontend's per-request latency: it "
                             "needs a frontend (--frontend NAME, --frontend profile or --client-latency)")
        return self

    @field_validator("metric_percentiles", mode="before")
    @classmethod
    def _comma_separated(cls, v):
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return [v]
        if isinstance(v, str):           # vLLM's spelling: "25,50,99"
            try:
                return [float(x) for x in v.split(",")]
            except ValueError:
                raise ValueError("expected comma-separated numbers such as 50,90,99") from None
        return v

    @field_validator("metric_percentiles")
    @classmethod
    def _percentiles(cls, v: list[float]) -> list[float]:
        bad = [p for p in v if not 0 <= p <= 100]
        if bad or not v:
            raise ValueError(f"expected percentiles between 0 and 100, got {bad or 'none'}")
        return v

    @model_validator(mode="after")
    def _random_options_need_random_trace(self) -> SimConfig:
        if self.trace_options.random is not None and self.trace != RANDOM_TRACE:
            raise ValueError(f"trace_options.random (--random-input-len, ...) sets the lengths of trace: {RANDOM_TRACE} "
                             f"(vllm bench serve's random dataset); the trace is {self.trace!r}")
        if self.trace_options.sessions is not None and self.fleet is not None:
            raise ValueError("trace_options.sessions: multi-turn sessions run on one pool of replicas (replicas, "
                             "router); a disaggregated fleet does not take them yet")
        if self.speculative_config is not None:
            if self.fleet is not None:
                raise ValueError("speculative_config: speculative decoding runs on one pool of replicas; a "
                                 "disaggregated fleet does not take it yet")
            if not self.kv.is_default:
                raise ValueError(f"speculative_config: speculative decoding runs with vLLM's KV cache manager; "
                                 f"not with the KV policy {self.kv.policy!r} (kv:) yet")
            if self.kv_offload is not None:
                raise ValueError("speculative_config: not with kv_offload (a CPU KV tier) yet")
            if self.pp > 1 or self.dp > 1:
                raise ValueError("speculative_config: not with pp or dp (pipeline stages, data-parallel attention) yet")
        if (self.pp > 1 or self.dp > 1) and self.fleet is not None:
            raise ValueError("pp and dp shape one pool of replicas; a disaggregated fleet (fleet:) does not take them yet")
        if self.dp > 1 and self.kv_offload is not None:
            raise ValueError(f"kv_offload with dp {self.dp}: a CPU KV tier on data-parallel attention ranks is not "
                             "modelled (the ranks step in lockstep without the connector's transfers); drop one")
        if self.dp > 1 and not get_model(self.model).is_moe:
            raise ValueError(f"dp (data-parallel attention) needs a mixture-of-experts model, got dp {self.dp} with "
                             f"the dense {self.model}, whose DP ranks are independent replicas: give replicas {self.dp} "
                             "(--replicas) and router least_outstanding")
        self._check_offload()
        if self.trace_options.synthetic_sessions is not None and self.trace != SESSIONS_TRACE:
            raise ValueError(f"trace_options.synthetic_sessions sets the shape of trace: {SESSIONS_TRACE}; the trace "
                             f"is {self.trace!r}")
        return self

    def _check_offload(self) -> None:
        """kv_offload against the engine: no v0 swap beside it, offloaded blocks of whole GPU blocks."""
        if self.kv_offload is not None and self.engine.preemption_mode == "swap":
            raise ValueError("engine.preemption_mode with kv_offload: vLLM v1 has no swap (vLLM v0's CPU swap space); a "
                             "preempted request's stored blocks come back from the CPU tier instead "
                             "(docs/kv-tiers.md#preemption-and-the-cpu-tier); expected recompute, got swap")
        off = self.kv_offload
        if off is not None and off.connector != "lmcache":
            fields = KVOffloadConfig.model_fields
            for name in ("lmcache_hash_s_per_token", "lmcache_put_s_per_chunk"):
                if getattr(off, name) != fields[name].default:
                    raise ValueError(f"kv_offload.{name}: only kv_offload.connector lmcache reads it (LMCache's CPU "
                                     f"work), and the connector is {off.connector!r}; set connector lmcache or drop it")
        chunk = self.kv_offload.chunk_tokens if self.kv_offload is not None else None
        if chunk is not None and chunk % self.engine.block_size:
            raise ValueError(f"kv_offload.chunk_tokens: {chunk} is not a multiple of engine.block_size "
                             f"({self.engine.block_size}); expected a whole number of GPU blocks per offloaded block")

    @field_validator("model")
    @classmethod
    def _catalog_model(cls, v: str) -> str:
        get_model(v)            # CatalogError (a ValueError) names the known models
        return v

    @field_validator("gpu")
    @classmethod
    def _catalog_gpu(cls, v: str) -> str:
        get_gpu(v)
        return v

    @field_validator("kv_dtype", "weight_dtype")
    @classmethod
    def _known_dtype(cls, v: str | None) -> str | None:
        if v is not None:
            normalize_dtype(v)      # CatalogError (a ValueError) names the known dtypes
        return v


def validation_message(exc: ValidationError, source: str | None = None) -> str:
    """Each problem as `field: message (got value)`: one line each prefixed by `source` when given, else
    all on one line separated by '; '."""
    problems = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"] if p not in POOL_TAGS) or "(root)"
        msg = err["msg"].removeprefix("Value error, ")
        got = "" if ", got " in msg else f" (got {short_repr(err.get('input'))})"     # the check said it
        problems.append(f"{loc}: {msg}{got}")
    if source is None:
        return "; ".join(problems)
    return "\n".join(f"{source}: {problem}" for problem in problems)


def flatten(data: dict, prefix: str = "") -> dict[str, Any]:
    """{'engine': {'block_size': 16}} -> {'engine.block_size': 16} (dotted keys pass through)."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flatten(value, name + "."))
        else:
            out[name] = value
    return out


def set_dotted(data: dict, key: str, value: Any) -> None:
    """data['engine']['block_size'] = value for key 'engine.block_size', creating sections."""
    parts = key.split(".")
    node = data
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{key}: {'.'.join(parts[:i + 1])} is a value, not a section")
        node = child
    node[parts[-1]] = value


def build_config(base: dict, overrides: dict[str, Any], source: str | None = None) -> SimConfig:
    """SimConfig from a base mapping (left unchanged) plus dotted overrides (None is a value here, not
    'unset'). Errors name the field; `source` (a file) prefixes each one on its own line."""
    data = copy.deepcopy(base)
    for key, value in overrides.items():
        set_dotted(data, key, value)
    try:
        policy_names()       # load the plug-ins: a broken one fails every run, even one that names no policy
    except PolicyError as exc:
        raise ConfigError(f"kv.policy: {exc}") from None
    try:
        return SimConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(validation_message(exc, source)) from None


def read_yaml_file(path: str | Path, *, what: str = "config file", expected: str = "a YAML config file",
                   option: str = "", example: str | None = None) -> Any:
    """Parse a YAML file; a missing, unreadable or invalid file raises ConfigError naming it (`option`,
    e.g. '--config ', before the path) and what was `expected` there."""
    path = Path(path)
    try:
        return load_yaml_file(path, what=expected.removeprefix("a "), option=option)
    except InputError as exc:
        raise ConfigError(str(exc)) from None
    except FileNotFoundError:
        raise ConfigError(f"{what} not found: {path}") from None
    except ValueError as exc:        # a value YAML parses but Python cannot hold (a 5,000-digit integer)
        raise ConfigError(f"{option}{path}: {exc}; expected values of ordinary size") from None
    except IsADirectoryError:
        hint = f" (e.g. {path / example})" if example else ""
        raise ConfigError(f"{option}{path}: is a directory; expected {expected}{hint}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{option}{path}: cannot be read ({getattr(exc, 'strerror', None) or exc.reason}); "
                          f"expected {expected}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {yaml_problem(exc)}") from None


def read_config_file(path: str | Path, option: str = "--config ") -> dict:
    """A YAML config file's mapping of options (an empty file is an empty mapping)."""
    data = read_yaml_file(path, option=option, example="config.yaml") or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of options at the top level")
    return data


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None,
                sets: list[str] | tuple[str, ...] = ()) -> SimConfig:
    """Read an optional YAML file, apply dotted overrides (`{"engine.block_size": 32}`; None = not
    given), then the command line's `--set KEY=VALUE` items (`KEY=null`: the key set to null, as in a
    YAML file), and validate."""
    overrides = {key: value for key, value in (overrides or {}).items() if value is not None}
    for item in sets:
        key, value = parse_set_option(item)
        overrides[key] = value
    data = {} if path is None else read_config_file(path)
    return build_config(data, overrides, source="config" if path is None else str(path))


def parse_set_option(item: str) -> tuple[str, Any]:
    """'engine.block_size=32' -> ('engine.block_size', 32), values parsed as YAML scalars."""
    key, sep, raw = item.partition("=")
    if not sep or not key:
        raise ConfigError(f"--set {item!r}: expected KEY=VALUE, e.g. engine.block_size=32")
    if len(raw) > MAX_SET_VALUE_CHARS:
        raise ConfigError(f"--set {key}: the value is {len(raw)} characters; at most {MAX_SET_VALUE_CHARS}")
    try:
        return key.strip(), safe_yaml_load(raw, f"--set {key}")
    except InputError as exc:
        raise ConfigError(str(exc)) from None
    except ValueError as exc:        # e.g. an integer of more than 4,300 digits
        raise ConfigError(f"--set {key}: {exc}; expected a number of ordinary size") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"--set {item!r}: the value is not valid YAML ({yaml_problem(exc)}); expected a "
                          "number, true/false, a word, [a, list] or {a: mapping}") from None
