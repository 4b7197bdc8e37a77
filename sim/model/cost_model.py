"""Roofline step-time model: seconds for one engine step from its `BatchShape`.

Functional form (what `calibrate` fits). `features(shape)` returns these raw components, each
computed per GPU (tensor parallel degree `tp`) at the hardware's PEAK rates, before any
efficiency factor:

  linear_compute_prefill  2 * linear_params * num_prefill_tokens / tp / peak_w
  linear_compute_decode   (2 * linear_params * num_decode_tokens / peak_w
                           + 2 * hidden * vocab * num_seqs / peak_e) / tp      (LM head: last token
                           of every scheduled sequence, as vLLM computes logits for each request)
  linear_memory           [num_tokens > 0] * (weight_bytes_read / tp + activation bytes) / mem_bw
  attn_compute            4 * layers * heads * head_dim * (attn_pairs_prefill + kv_tokens_read)
                          / tp / peak_a       (a decode query pairs with each KV token it reads; a
                          prefill chunk's own kv_tokens_read adds ~1/chunk of its pairs: negligible)
  attn_memory             kv_tokens_read * kv_bytes_per_token_per_gpu / mem_bw
  attn_padded             kv_tokens_padded * kv_bytes_per_token_per_gpu / mem_bw   (decode attention that
                          gathers every decoding sequence padded to the step's widest block table,
                          holes included; when the shape leaves it None: kv_tokens_read in steps
                          without prefill tokens, else 0)
  attn_prefill_padded     4 * layers * heads * head_dim * attn_pairs_prefill_padded / tp / peak_a   (prefill
                          chunks attending over the step's widest block table plus themselves;
                          attn_pairs_prefill when the shape leaves it None)
  copy                    2 * bytes_moved * kv_split / mem_bw          (read + write)
  policy_ops              max(op_flops / peak_a, op_bytes / mem_bw) * kv_split   (a KV policy's own work:
                          metric aggregation, sort, block-table rewrite, quantization; docs/kv-policies.md)
  policy_kernels          op_kernels (small kernels a KV policy launches on each GPU: TokenSelect's
                          selection), each at p.gemm_latency_s, added to the copy part
  swap                    swap_bytes * kv_split / pcie_bw
  allreduce_bw            2 * layers * 2 * (tp - 1) / tp * num_tokens * hidden * act_bytes / link_bw
  allreduce_count         [tp > 1] * [num_tokens > 0] * 2 * layers   (two all-reduces per layer)
  step                    1
  seqs                    num_seqs
  block_entries           block_table_entries

with peak_w the matmul peak of the weight dtype on this GPU (fp8 weights use fp8 tensor cores where
the GPU has them, else run weight-only at 16-bit), peak_e that of the LM-head dtype, peak_a that
of the activation dtype, kv_split = KV heads held per GPU / KV heads (1/tp, or 1/kv_heads when KV
heads are replicated because kv_heads < tp). `kv_tokens_read` counts token-equivalents at the
cost model's KV dtype (a mixed-precision group counts as its bytes / full-precision bytes).

`predict(shape)` combines them with the profile's factors (p.*):

  time = device + overhead           (synchronous scheduling)
  time = max(device, overhead)       (async scheduling: the CPU prepares step k+1 while step k runs)

  device = max(linear_compute_prefill / p.mfu_prefill + linear_compute_decode / p.mfu_decode,
             linear_memory / p.mem_bw_eff)
       + max(attn_compute / p.attn_compute_eff, attn_memory / p.attn_bw_eff)
       + attn_padded * p.padded_attn_cost + attn_prefill_padded * p.padded_prefill_cost
       + (copy + policy_ops) / p.copy_bw_eff + swap / p.pcie_eff + allreduce_bw / p.allreduce_bw_eff
       + allreduce_count * p.allreduce_latency_s
  overhead = step * p.step_overhead_s + seqs * p.per_seq_overhead_s
             + block_entries * p.per_block_entry_overhead_s

A pure-decode step (no prefill tokens) of b sequences is then multiplied by
`p.decode_batch_factors` at b (linear interpolation between the listed batch sizes, the nearest
listed one beyond them; empty in every GPU profile): CPU GEMMs pick kernels by the number of rows,
so the per-sequence decode cost is not linear in the batch (4-sequence decodes run slower than 3- or
8-sequence ones on the 2-core VM). `calibrate` fits the table from the decode steps' residuals.

`padded_attn_cost` / `padded_prefill_cost` (time relative to peak bandwidth / peak FLOPs, i.e.
1/efficiency) are 0 for paged attention kernels, which read each sequence's own blocks: every shipped
GPU profile. The real backend's CPU attention gathers a dense [sequences, widest table] tensor per
layer, so on CPU attention cost follows the padded counts: a decode reads the widest table of the
step (unequal contexts cost the longest one's blocks each; slots emptied by eviction still cost until
their block is freed), and a prefill chunk attends over that width plus itself.

Every term is linear in one inverse efficiency (1/eff) or one overhead, except the two max()
rooflines. A least-squares fitter alternates: with the current factors pick the active branch of
each max per step (`active_branches`), which makes time linear in the unknowns (one column per
feature in `FEATURE_NAMES`, merged per `FACTOR_OF_FEATURE`), solve non-negative least squares,
repeat until the branches stop changing.

The operator form (profiles with a `gemm_efficiency` table: every shipped GPU profile, fitted to
measured kernel times by sim/calibration/operator_fit.py; docs/gpu-profiles.md) replaces the linear
and all-reduce terms (`_operator_breakdown`), tokens = prefill + decode tokens, [ran] = tokens > 0:

  linear    = max(tokens * flops_s / eff(tokens) + seqs * lm_head_s / eff(seqs),
                  ([ran] * weights_s + seqs * logits_s) / p.mem_bw_eff)
              + [ran] * ((4 * layers + 1) * p.gemm_latency_s + layers * p.layer_latency_s)
              + tokens * elementwise_s / p.elementwise_bw_eff
  allreduce = allreduce_bw / bw_eff(tp) + allreduce_count * latency(tp)     (p.allreduce_by_tp)

with eff() the table interpolated at this model's per-GPU layer weight size; attention, copy, swap,
overhead and async as above (decode_batch_factors and the padded terms are not used: GPU kernels).

Scalars and equal-length float64 arrays (a run of steps) go through the same numpy float64
operations in the same order, so the two paths agree bit for bit.
"""
from __future__ import annotations

import copy
import re
import warnings
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import yaml
from pydantic import (BaseModel, ConfigDict, Field, ValidationError, field_validator, model_serializer,
                      model_validator)

from kvsim.sim.model.catalog import (
    DATA_DIR, DTYPE_BYTES, CatalogError, GPUSpec, ModelSpec, format_validation_error, get_gpu, get_model,
    normalize_dtype, yaml_load_with_lines,
)
from kvsim.sim.core.step import BatchShape
from kvsim.sim.model.grouped_gemm import GroupedGemm, distinct_experts

PROFILES_DIR = DATA_DIR / "profiles"

FEATURE_NAMES: tuple[str, ...] = (
    "linear_compute_prefill", "linear_compute_decode", "linear_memory", "attn_compute", "attn_memory",
    "copy", "swap", "allreduce_bw", "allreduce_count", "step", "seqs", "block_entries", "attn_padded",
    "attn_prefill_padded", "policy_ops",
)
# feature -> (profile field, how it enters): "div" = feature / factor, "mul" = feature * factor
FACTOR_OF_FEATURE: dict[str, tuple[str, str]] = {
    "linear_compute_prefill": ("mfu_prefill", "div"),
    "linear_compute_decode": ("mfu_decode", "div"),
    "linear_memory": ("mem_bw_eff", "div"),
    "attn_compute": ("attn_compute_eff", "div"),
    "attn_memory": ("attn_bw_eff", "div"),
    "copy": ("copy_bw_eff", "div"),
    "swap": ("pcie_eff", "div"),
    "allreduce_bw": ("allreduce_bw_eff", "div"),
    "allreduce_count": ("allreduce_latency_s", "mul"),
    "step": ("step_overhead_s", "mul"),
    "seqs": ("per_seq_overhead_s", "mul"),
    "block_entries": ("per_block_entry_overhead_s", "mul"),
    "attn_padded": ("padded_attn_cost", "mul"),
    "attn_prefill_padded": ("padded_prefill_cost", "mul"),
    "policy_ops": ("copy_bw_eff", "div"),
}


class ProfileError(ValueError):
    """Unknown or invalid hardware profile."""


# a fixed time in a profile: far above any measured one (the largest shipped is 59 ms of a CPU step), and
# finite (an infinite or 1e300 s overhead gives null or absurd latencies, not an error)
MAX_OVERHEAD_S = 10.0
# a profile name's `NAME*K` step-time factor: a band around the profile's error, not a new machine
STEP_TIME_SCALE_RANGE = (1e-3, 1e3)
_Efficiency = Field(gt=0, le=1)
_Overhead = Field(ge=0, le=MAX_OVERHEAD_S)
_Overhead0 = Field(default=0.0, ge=0, le=MAX_OVERHEAD_S)


class AllReduceTerms(BaseModel):
    """One all-reduce at a TP degree: fixed latency plus bytes over the link at an efficiency."""
    model_config = ConfigDict(extra="forbid", frozen=True)

    latency_s: float = _Overhead
    bw_eff: float = Field(gt=0, le=1)


class GemmEfficiency(BaseModel):
    """Compute efficiency (fraction of peak) of a layer's matmuls by the step's tokens (rows) and the
    size of one layer's matmul weights on one GPU (MiB): small matmuls fill fewer SMs. Interpolated
    linearly in log tokens and log size; the nearest entry beyond the table."""
    model_config = ConfigDict(extra="forbid", frozen=True)

    tokens: list[int] = Field(min_length=1)
    weight_mib: list[float] = Field(min_length=1)
    efficiency: list[list[float]]        # [len(tokens)][len(weight_mib)]

    @model_validator(mode="after")
    def _check_table(self) -> GemmEfficiency:
        if sorted(set(self.tokens)) != self.tokens or self.tokens[0] < 1:
            raise ValueError("gemm_efficiency.tokens must be increasing and >= 1")
        if sorted(set(self.weight_mib)) != self.weight_mib or self.weight_mib[0] <= 0:
            raise ValueError("gemm_efficiency.weight_mib must be increasing and > 0")
        if len(self.efficiency) != len(self.tokens) or any(len(r) != len(self.weight_mib) for r in self.efficiency):
            raise ValueError(f"gemm_efficiency.efficiency must be {len(self.tokens)} rows of {len(self.weight_mib)}")
        if not all(0 < e <= 1 for r in self.efficiency for e in r):
            raise ValueError("gemm_efficiency.efficiency values must be in (0, 1]")
        return self

    def at_size(self, weight_mib: float) -> tuple[np.ndarray, np.ndarray]:
        """(log tokens, efficiency) for one matmul-weight size: the table the cost model interpolates."""
        x = np.log(np.array(self.weight_mib, dtype=np.float64))
        eff = np.array([np.interp(np.log(weight_mib), x, row) for row in self.efficiency], dtype=np.float64)
        return np.log(np.array(self.tokens, dtype=np.float64)), eff


class ClientLatency(BaseModel):
    """The frontend: time a `vllm bench serve` client sees beyond the engine's steps: vLLM's API server
    (HTTP, request parsing, tokenization, detokenization, streaming) and the client itself. Applied by
    sim/simulator/client.py's `Frontend` (entry) and `client_view` (output); a profile's `client` section
    (`--client-latency`) or a named set of `frontends.yaml` (`--frontend NAME`) gives the values.

    request_s: per request, a fixed latency from the client's send to the request entering the
    engine (HTTP, client and network: requests overlap in it); TTFT and E2E include it, TPOT/ITL not.
    request_serial_s: per request, the API server's serial work before the engine sees it
    (parsing, validation, building the engine request): one request at a time, so a burst of sends
    queues there.
    prompt_token_s: per prompt token, the API server's serial tokenization (in the same queue as
    request_serial_s: a long prompt delays every request behind it).
    output_token_s: per output token, the API server's serial work after the engine (detokenization,
    streaming): a step's tokens reach the client once the server has processed them and every token
    before them, so ITL grows with the batch when the server is the bottleneck.
    shared_loop: entry and output work share one serial queue, in time order (vLLM's API server runs
    both on one asyncio loop): a new request also waits behind the streaming of the requests in
    flight. Off: two queues (entry in the simulation, output applied to the token times afterwards).
    handler_yields (shared loop only): how many times a new request's handler gives the loop back
    before the request reaches the engine (1: once, today's single serial piece); each later resumption
    queues behind one engine step's streaming work, `stream_s` x the output tokens of the latest step
    told (the streams in flight). stream_s: the loop's work per stream and step (wake, chunk, write),
    measured by bench/measure_stream_cost.py."""
    model_config = ConfigDict(extra="forbid", frozen=True)

    request_s: float = _Overhead0
    request_serial_s: float = _Overhead0
    prompt_token_s: float = _Overhead0
    output_token_s: float = _Overhead0
    shared_loop: bool = False
    handler_yields: int = Field(default=1, ge=1, le=64)
    stream_s: float = _Overhead0

    @model_validator(mode="after")
    def _yields_need_the_loop(self) -> ClientLatency:
        if (self.handler_yields > 1 or self.stream_s > 0) and not self.shared_loop:
            raise ValueError("handler_yields and stream_s need shared_loop: true (the handler waits on the loop "
                             "that streams the outputs)")
        return self

    @model_serializer(mode="wrap")
    def _dump(self, handler):
        data = handler(self)
        if self.prompt_token_s == 0:        # left out, so the profiles written before it stay as they were
            data.pop("prompt_token_s", None)
        if not self.shared_loop:
            data.pop("shared_loop", None)
        if self.handler_yields == 1 and self.stream_s == 0:     # left out unless set (profiles stay as they were)
            data.pop("handler_yields", None)
            data.pop("stream_s", None)
        return data

    @property
    def enabled(self) -> bool:
        return self.request_s > 0 or self.request_serial_s > 0 or self.prompt_token_s > 0 or self.output_token_s > 0

    def serial_s(self, prompt_tokens: int) -> float:
        """The API server's serial work on one request of `prompt_tokens` before it enters the engine."""
        return self.request_serial_s + prompt_tokens * self.prompt_token_s


FRONTENDS_FILE = DATA_DIR / "frontends.yaml"
# --frontend's names besides frontends.yaml's: engine time only, and the GPU profile's fitted `client` terms
ENGINE_ONLY, PROFILE_FRONTEND = "none", "profile"


class FrontendPreset(BaseModel):
    """A named frontend of frontends.yaml: its terms, the host class they describe and their sources."""
    model_config = ConfigDict(extra="forbid", frozen=True)

    host: str
    terms: ClientLatency
    sources: dict[str, str] = Field(default_factory=dict)     # term -> where its value comes from


def frontend_presets() -> dict[str, FrontendPreset]:
    """frontends.yaml's named frontends (sim/data/frontends.yaml; docs/gpu-profiles.md)."""
    data = yaml.safe_load(FRONTENDS_FILE.read_text()) or {}
    return {name: FrontendPreset.model_validate(entry) for name, entry in data.get("frontends", {}).items()}


def frontend_names() -> list[str]:
    return [ENGINE_ONLY, PROFILE_FRONTEND, *frontend_presets()]


def frontend_terms(name: str, profile: HardwareProfile) -> ClientLatency:
    """The terms of frontend `name`: none (engine time only), profile (`profile.client`) or a preset."""
    if name == ENGINE_ONLY:
        return ClientLatency()
    if name == PROFILE_FRONTEND:
        return profile.client
    presets = frontend_presets()
    if name not in presets:
        raise ValueError(f"unknown frontend {name!r}; known: {', '.join(frontend_names())}")
    return presets[name].terms


class HardwareProfile(BaseModel):
    """Efficiency factors (fraction of peak, in (0, 1]) and overheads (seconds, >= 0)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = "custom"
    description: str = ""
    mfu_prefill: float = _Efficiency
    mfu_decode: float = _Efficiency
    mem_bw_eff: float = _Efficiency
    attn_compute_eff: float = _Efficiency
    attn_bw_eff: float = _Efficiency
    copy_bw_eff: float = _Efficiency
    pcie_eff: float = _Efficiency
    allreduce_bw_eff: float = _Efficiency
    allreduce_latency_s: float = _Overhead
    step_overhead_s: float = _Overhead
    per_seq_overhead_s: float = _Overhead
    per_block_entry_overhead_s: float = _Overhead
    padded_attn_cost: float = Field(default=0.0, ge=0, allow_inf_nan=False)     # 0: attention kernels do not pad (paged kernels)
    padded_prefill_cost: float = Field(default=0.0, ge=0, allow_inf_nan=False)  # 0: prefill attention does not pad
    # pure-decode steps of b sequences take decode_batch_factors[b] x the model's time (linear
    # interpolation between listed sizes, the nearest listed size beyond them; empty: 1 everywhere)
    decode_batch_factors: dict[int, float] = Field(default_factory=dict)
    # ---- operator-fitted form (sim/calibration/operator_fit.py; docs/gpu-profiles.md). An empty
    # gemm_efficiency keeps the plain roofline above (every CPU profile and the step-log fits).
    gemm_efficiency: GemmEfficiency | None = None   # compute efficiency of the linear layers
    gemm_latency_s: float = _Overhead0         # fixed time of one matmul kernel (4 per layer + LM head)
    layer_latency_s: float = _Overhead0        # fixed time per layer of its other kernels (norms, RoPE,
                                               # activation, residual adds, attention)
    elementwise_bw_eff: float = Field(default=1.0, gt=0, le=1)   # their bytes per token vs peak bandwidth
    # TP degree -> {latency_s, bw_eff} of one all-reduce (the nearest listed degree beyond the table);
    # empty: allreduce_latency_s / allreduce_bw_eff for every degree
    allreduce_by_tp: dict[int, AllReduceTerms] = Field(default_factory=dict)
    # what `vllm bench serve` measures beyond the engine (API server, tokenization, streaming); applied
    # with --client-latency (default: engine time only). See ClientLatency.
    client: ClientLatency = Field(default_factory=lambda: ClientLatency())
    # every step's time x this (1: as modelled); a profile name `NAME*1.04` loads NAME with it, for
    # the capacity band implied by the profile's measured error (sim.planning.capacity.profile_band)
    step_time_scale: float = Field(default=1.0, gt=0, exclude=True)   # a run-time factor: never written
    meta: dict[str, Any] = Field(default_factory=dict)   # free-form: what it was fitted on, errors

    @property
    def operator_form(self) -> bool:
        return self.gemm_efficiency is not None

    @field_validator("decode_batch_factors")
    @classmethod
    def _check_decode_batch_factors(cls, v: dict[int, float]) -> dict[int, float]:
        for b, f in v.items():
            if b < 1 or not 0 < f < float("inf"):
                raise ValueError(f"decode_batch_factors: batch sizes must be >= 1 and factors > 0, got {b}: {f}")
        return dict(sorted(v.items()))

    def to_yaml(self, path: str | Path) -> Path:
        """The profile as YAML; a step_time_scale other than 1 (kvsim calibrate --bench fits one) is written
        with it, so the file loads as the same profile (a run-time NAME*K stays out of files: it is never set
        on a profile that is written)."""
        path = Path(path)
        data = self.model_dump()
        if self.step_time_scale != 1.0:
            data["step_time_scale"] = self.step_time_scale
        path.write_text(yaml.safe_dump(data, sort_keys=False))
        return path


_SCALED = re.compile(r"(.+)\*(\d+(?:\.\d*)?(?:e-?\d+)?)")


def list_profiles() -> list[str]:
    return sorted(p.stem for p in PROFILES_DIR.glob("*.yaml"))


AUTO_PROFILE = "auto"


def profile_for_gpu(gpu: GPUSpec | str) -> str:
    """The shipped profile of a catalog GPU (fitted to measured kernel times, or derived from a fitted
    one: docs/gpu-profiles.md); `default` (hand-set, H100-class) for a GPU without one."""
    name = get_gpu(gpu).name.lower()
    if (PROFILES_DIR / f"{name}.yaml").is_file():
        return name
    if name not in _WARNED_DEFAULT:          # once per GPU and process: a silent fallback moved results
        _WARNED_DEFAULT.add(name)
        warnings.warn(f"GPU {get_gpu(gpu).name} has no profile of its own: its step times use the hand-set "
                      f"'default' profile (H100-class efficiencies on this GPU's peaks); give --profile the "
                      f"shipped profile of the closest catalog GPU ({', '.join(list_profiles())}) or your "
                      "own file (kvsim calibrate)", UserWarning, stacklevel=3)
    return "default"


_WARNED_DEFAULT: set[str] = set()


def _catalog_gpu_profile(name: str) -> Path | None:
    """The shipped profile of the catalog GPU `name` names (`h100` -> h100-sxm.yaml), or None."""
    from .catalog import CatalogError

    try:
        path = PROFILES_DIR / f"{get_gpu(name.strip()).name.lower()}.yaml"
    except CatalogError:
        return None
    return path if path.is_file() else None


def load_profile(name_or_path: str | Path | HardwareProfile = "default", gpu: GPUSpec | str | None = None
                 ) -> HardwareProfile:
    """A shipped profile by name (`default`, `cpu-2core`, `h100-sxm`, ...), a YAML file path, or `auto`:
    the shipped profile of `gpu`; `NAME*K` is that profile with every step time multiplied by K."""
    if isinstance(name_or_path, HardwareProfile):
        return name_or_path
    text = str(name_or_path)
    scaled = _SCALED.fullmatch(text)
    if scaled:
        low, high = STEP_TIME_SCALE_RANGE
        if "*" in scaled.group(1):
            raise ProfileError(f"profile {text!r}: one step-time factor after '*' (NAME*K), not several")
        factor = float(scaled.group(2))
        if not low <= factor <= high:
            raise ProfileError(f"profile {text!r}: the step-time factor after '*' must be in {low:g}..{high:g}")
        base = load_profile(scaled.group(1), gpu)
        return base.model_copy(update={"step_time_scale": base.step_time_scale * factor})
    if text.strip().lower() == AUTO_PROFILE:
        if gpu is None:
            raise ProfileError("profile 'auto' picks the GPU's own profile: give the GPU")
        return load_profile(profile_for_gpu(gpu))
    if text.endswith((".yaml", ".yml")) or Path(text).is_file():
        path = Path(text)
    else:
        path = PROFILES_DIR / f"{text.strip().lower()}.yaml"
        if not path.is_file():
            path = _catalog_gpu_profile(text) or path      # a catalog GPU's name or alias: its profile (h100)
        if not path.is_file():
            raise ProfileError(f"unknown hardware profile {text!r}; shipped profiles: "
                               f"{', '.join(list_profiles())}, or pass a path to a YAML file")
    try:
        data, lines = yaml_load_with_lines(path)
    except CatalogError as exc:
        raise ProfileError(str(exc)) from exc
    if not isinstance(data, dict):
        raise ProfileError(f"{path}: expected a mapping of profile fields")
    try:
        return HardwareProfile.model_validate(data)
    except ValidationError as exc:
        problems = format_validation_error(exc, str(path), lines)
        raise ProfileError(f"invalid hardware profile {path}:" + ("\n" if "\n" in problems else " ")
                           + problems) from exc


def profile_fit_error(profile: HardwareProfile) -> float | None:
    """The profile's measured step-time error (MAPE on rows its fit did not see, or of its step-log fit),
    None where it was not measured (hand-set profiles)."""
    errors = profile.meta.get("fit_errors") or {}
    for key in ("step", "all"):
        if isinstance(errors.get(key), dict) and errors[key].get("mape") is not None:
            return float(errors[key]["mape"])
    return None


def kv_heads_per_gpu(model: ModelSpec, tp: int) -> int:
    """vLLM's split: KV heads divided across TP ranks, replicated when there are fewer than ranks."""
    check_tp(model, tp)
    return max(1, model.num_kv_heads // tp)


def check_expert_parallel(model: ModelSpec, tp: int, expert_parallel: bool) -> None:
    """vLLM's --enable-expert-parallel splits each MoE layer's experts over the TP group's GPUs."""
    if not expert_parallel:
        return
    if not model.is_moe:
        raise ValueError(f"--enable-expert-parallel: {model.name} has no experts (a dense model)")
    if model.num_experts % tp:
        raise ValueError(f"--enable-expert-parallel: {model.num_experts} experts of {model.name} do not split "
                         f"evenly over tp={tp} GPUs")


def check_tp(model: ModelSpec, tp: int) -> None:
    if not isinstance(tp, (int, np.integer)) or tp < 1:
        raise ValueError(f"tp must be a positive integer, got {tp!r}")
    if model.num_heads % tp:
        raise ValueError(f"{model.name}: tp={tp} must divide num_heads={model.num_heads}")
    if model.num_kv_heads % tp and tp % model.num_kv_heads:
        raise ValueError(f"{model.name}: tp={tp} and num_kv_heads={model.num_kv_heads} must divide one another")


def expected_distinct_experts(num_experts: int, top_k: int, tokens, skew: float = 0.0):
    """Experts a MoE layer reads in a step of `tokens` tokens when each token picks `top_k` of
    `num_experts` uniformly (the uniform-routing assumption; docs/models.md):
    E * (1 - (1 - k/E)^T). 0 tokens read none; many tokens read all E. A router `skew` > 0 reads fewer
    (sim.model.grouped_gemm.distinct_experts)."""
    if skew:
        return distinct_experts(num_experts, top_k, tokens, skew)
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** _f64(tokens))


def _f64(x: Any) -> float | np.ndarray:
    # Scalars stay Python floats (IEEE doubles, like float64 array elements, so the scalar and the
    # array path give identical bits) because numpy scalar arithmetic is an order of magnitude slower.
    if isinstance(x, np.ndarray):
        return x.astype(np.float64, copy=False)
    return float(x)


def _max(a, b):
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return np.maximum(a, b)
    return a if a >= b else b


class StepCounts(NamedTuple):
    """A step's numbers `CostModel.flat_step_total` prices (a step without copies, swaps or KV-policy work)."""
    seqs: Any
    rows: Any            # LM-head rows
    tokens: Any          # query tokens
    pairs: Any           # prefill query-key pairs
    kv_read: Any         # KV tokens read
    entries: Any         # block-table entries


class CostModel:
    """Step time of `model` on `gpu` x `tp` under `profile` (see module docstring for the form)."""

    def __init__(self, model: ModelSpec | str, gpu: GPUSpec | str, profile: HardwareProfile | str = AUTO_PROFILE,
                 tp: int = 1, *, kv_dtype: str | None = None, weight_dtype: str | None = None,
                 async_scheduling: bool = False, expert_parallel: bool = False):
        model = get_model(model)
        if weight_dtype or kv_dtype:
            model = model.with_dtypes(weight_dtype=weight_dtype, kv_dtype=kv_dtype)
        self.model, self.gpu, self.tp = model, get_gpu(gpu), tp
        check_expert_parallel(model, tp, expert_parallel)
        self.expert_parallel = expert_parallel and tp > 1
        # async scheduling: the CPU's per-step work (the overhead terms) overlaps the device's
        self.async_scheduling = async_scheduling
        self.profile = load_profile(profile, gpu=self.gpu)
        # the routed experts' fused kernels priced by their own model (sim/model/grouped_gemm.py): MoE models
        # under an operator-form profile; off, or a dense model: the experts are part of the linear roofline
        self.moe_kernels = bool(model.is_moe and self.profile.gemm_efficiency is not None)
        self.kv_heads_per_gpu = kv_heads_per_gpu(model, tp)
        self.kv_split = self.kv_heads_per_gpu / model.num_kv_heads
        self.kv_bytes_per_token = model.kv_bytes_per_token()
        self.kv_bytes_per_token_per_gpu = self.kv_bytes_per_token * self.kv_split
        self._set_coefficients()
        # the padded-attention features are skipped when pricing steps under a profile that gives them no cost
        self._pads = self.profile.padded_attn_cost > 0 or self.profile.padded_prefill_cost > 0
        self._set_operator_terms()
        table = sorted(self.profile.decode_batch_factors.items())     # model_copy(update=) skips the validator
        self._batch_table = (np.array([b for b, _ in table], dtype=np.float64),
                             np.array([f for _, f in table], dtype=np.float64)) if table else None

    def with_experts_on_the_roofline(self) -> CostModel:
        """A copy that prices the routed experts on the linear roofline instead of their fused kernels
        (the pricing before the expert-kernel model; a dense model prices the same)."""
        other = copy.copy(self)
        other.moe_kernels = False
        other._set_operator_terms()
        return other

    def _set_coefficients(self) -> None:
        m, g, tp = self.model, self.gpu, self.tp
        act_bytes = DTYPE_BYTES[m.activation_dtype]
        peak_w = g.peak_flops(m.weight_dtype)
        peak_e = g.peak_flops(m.embedding_dtype_resolved)
        peak_a = g.peak_flops(m.activation_dtype)
        # Activation traffic per token and layer: each linear reads its input and writes its
        # output, attention reads q/k/v and writes o, SwiGLU reads gate/up and writes its product,
        # norms and residual adds (~8 hidden-sized passes, replicated across TP ranks).
        split_elems = (2 * (m.q_size + 2 * m.kv_size) + 2 * m.q_size + 4 * m.active_mlp_width
                       + 2 * m.active_mlp_width)
        act_per_token = m.num_layers * act_bytes * (8 * m.hidden_size + split_elems / tp)
        c = {
            "prefill_flops_s": m.linear_flops_per_token / tp / peak_w,
            "decode_flops_s": m.linear_flops_per_token / tp / peak_w,
            "lm_head_s": m.lm_head_flops_per_seq / tp / peak_e,
            "weights_s": (m.dense_weight_bytes_read_per_step if m.is_moe else m.weight_bytes_read_per_step)
                         / tp / g.mem_bw,
            "act_token_s": act_per_token / g.mem_bw,
            "logits_seq_s": 4 * m.vocab_size / tp / g.mem_bw,
            "attn_pair_s": m.attention_flops_per_pair() / tp / peak_a,
            "attn_read_s": m.attention_flops_per_kv_read() / tp / peak_a,
            "kv_token_s": self.kv_bytes_per_token_per_gpu / g.mem_bw,
            "copy_byte_s": 2 * self.kv_split / g.mem_bw,
            "op_byte_s": self.kv_split / g.mem_bw,
            "op_flop_s": self.kv_split / peak_a,
            "swap_byte_s": self.kv_split / g.pcie_bw,
            "allreduce_token_s": (2 * m.num_layers * 2 * (tp - 1) / tp * m.hidden_size * act_bytes / g.link_bw),
            "allreduce_count": float(2 * m.num_layers if tp > 1 else 0),
            # one routed expert of every MoE layer on this GPU, at peak bandwidth (x distinct experts)
            "expert_s": m.num_moe_layers * m.expert_bytes / tp / g.mem_bw,
        }
        if self.expert_parallel:
            # MoE layers: all-to-all dispatch and combine of each token's k expert inputs (each GPU sends its
            # 1/tp share of the tokens, (tp-1)/tp of them to other GPUs) instead of the MLP's all-reduce
            ar_layers = 2 * m.num_layers - m.num_moe_layers
            a2a = 2 * m.experts_per_token * (tp - 1) / tp / tp
            c["allreduce_token_s"] = ((ar_layers * 2 * (tp - 1) / tp + m.num_moe_layers * a2a)
                                      * m.hidden_size * act_bytes / g.link_bw)
            c["allreduce_count"] = float(ar_layers + 2 * m.num_moe_layers)
        self._c = {k: float(v) for k, v in c.items()}
        self._moe = (m.num_experts, m.experts_per_token) if m.is_moe else None
        self._mla = m.is_mla

    def expert_read_time(self, tokens):
        """Seconds at peak bandwidth to read the routed experts a step of `tokens` tokens touches on
        one GPU (0 for a dense model)."""
        if self._moe is None:
            return 0.0
        return expected_distinct_experts(*self._moe, tokens, skew=self.model.expert_skew) * self._c["expert_s"]

    def _set_operator_terms(self) -> None:
        """The operator form's constants: efficiency table in log tokens, per-step latency counts, and
        the all-reduce terms at this TP degree."""
        p, m, tp = self.profile, self.model, self.tp
        self._gemm_table = None
        self._grouped = None
        self._op_flops_s = self._c["prefill_flops_s"]      # the linear FLOPs the dense GEMM table prices
        if p.gemm_efficiency is not None:
            self._gemm_table = p.gemm_efficiency.at_size(self.layer_weight_mib)
            if self.moe_kernels:
                self._grouped = GroupedGemm(m, self.gpu, p.gemm_efficiency, tp, expert_parallel=self.expert_parallel)
                self._op_flops_s = float(self._routed_free_flops_per_token() / tp / self.gpu.peak_flops(m.weight_dtype))
        self._eff_memo: dict[float, float] = {}     # gemm_efficiency of scalar token counts (steps repeat them)
        self._flat_memo: dict[tuple, tuple[float, float]] = {}     # see flat_step_total
        self._decode_terms = None                   # see _decode_seq_terms
        self._decode_lists = None                   # see _decode_seq_lists
        # 4 matmul kernels per layer (fused QKV, O, fused gate/up or fc1, down or fc2) and the LM head; a MoE
        # layer's two expert GEMMs are inside its fused-experts call when that is priced on its own
        self._gemm_launches = float(4 * m.num_layers + 1 - (2 * m.num_moe_layers if self._grouped is not None else 0))
        self._layers = float(m.num_layers)
        ar_lat, ar_eff = p.allreduce_latency_s, p.allreduce_bw_eff
        if p.allreduce_by_tp and tp > 1:
            degrees = sorted(p.allreduce_by_tp)
            terms = p.allreduce_by_tp[min((d for d in degrees if d >= tp), default=degrees[-1])]
            ar_lat, ar_eff = terms.latency_s, terms.bw_eff
        self._allreduce_latency_s, self._allreduce_bw_eff = float(ar_lat), float(ar_eff)
        act_bytes = DTYPE_BYTES[m.activation_dtype]
        # norms, residual adds and RoPE read and write hidden-sized rows; the activation reads gate
        # and up and writes their product (this GPU's shard of the TP-split ones)
        elem = m.num_layers * act_bytes * (7 * m.hidden_size + 2 * (m.q_size + m.kv_size) / tp
                                           + 3 * m.active_mlp_width / tp)
        self._elementwise_token_s = float(elem / self.gpu.mem_bw)

    def _routed_free_flops_per_token(self) -> float:
        """linear_flops_per_token without the routed experts (attention, dense MLPs, shared experts)."""
        m = self.model
        return float(m.linear_flops_per_token - 2 * m.num_moe_layers * m.experts_per_token * m.expert_params)

    def moe_kernel_time(self, tokens):
        """Seconds of the routed experts' fused kernels in a step of `tokens` tokens on one GPU (0 when they
        are not priced on their own: a dense model, moe_kernels off, or a plain-roofline profile)."""
        if self._grouped is None:
            return 0.0 if not isinstance(tokens, np.ndarray) else np.zeros(np.shape(tokens))
        return self._grouped.seconds(tokens)

    @property
    def matmul_time_per_token(self) -> float:
        """Seconds at peak of the decoder-layer matmuls for one token on one GPU (LM head excluded)."""
        return self._c["prefill_flops_s"]

    @property
    def elementwise_time_per_token(self) -> float:
        """Seconds at peak bandwidth of one token's elementwise kernels (norms, RoPE, activation, adds)."""
        return self._elementwise_token_s

    @property
    def layer_weight_mib(self) -> float:
        """One layer's matmul weights on one GPU, MiB (what sets how well a matmul fills the GPU); without
        the routed experts when their kernels are priced on their own."""
        m = self.model
        if self.moe_kernels:
            return self._routed_free_flops_per_token() / 2 / m.num_layers * DTYPE_BYTES[m.weight_dtype] / self.tp / 2**20
        return m.active_linear_params_per_layer * DTYPE_BYTES[m.weight_dtype] / self.tp / 2**20

    def gemm_efficiency(self, tokens):
        """The profile's linear-layer compute efficiency at `tokens` rows (scalar or array): linear in
        log tokens between entries, the nearest entry beyond them (below the first entry matmuls are
        bound by weight streaming, where the compute side does not bind)."""
        if not isinstance(tokens, np.ndarray):
            memo = self._eff_memo
            e = memo.get(tokens)
            if e is None:
                log_t, eff = self._gemm_table
                e = memo[tokens] = float(np.interp(np.log(np.maximum(float(tokens), 1.0)), log_t, eff))
            return e
        log_t, eff = self._gemm_table
        return np.interp(np.log(np.maximum(_f64(tokens), 1.0)), log_t, eff)

    # ---- model ---------------------------------------------------------------------------
    def features(self, shape: BatchShape, *, padded: bool = True) -> dict[str, np.float64 | np.ndarray]:
        """Raw time components (seconds at peak, or counts for overhead terms), per FEATURE_NAMES
        (without `padded`: all but the two padded-attention ones)."""
        c = self._c
        num_seqs = _f64(shape.num_seqs)
        rows = num_seqs if shape.num_logit_rows is None else _f64(shape.num_logit_rows)    # LM-head rows
        prefill = _f64(shape.num_prefill_tokens)
        decode = _f64(shape.num_decode_tokens)
        tokens = prefill + decode
        kv_read = _f64(shape.kv_tokens_read)
        ran = (tokens > 0).astype(np.float64) if isinstance(tokens, np.ndarray) else float(tokens > 0)
        zero = tokens * 0.0
        f = {
            "linear_compute_prefill": prefill * c["prefill_flops_s"],
            "linear_compute_decode": decode * c["decode_flops_s"] + rows * c["lm_head_s"],
            "linear_memory": ran * c["weights_s"] + tokens * c["act_token_s"] + rows * c["logits_seq_s"],
            "attn_compute": (_f64(shape.attn_pairs_prefill) * c["attn_pair_s"] + kv_read * c["attn_read_s"]
                             if self._mla else (_f64(shape.attn_pairs_prefill) + kv_read) * c["attn_pair_s"]),
            "attn_memory": kv_read * c["kv_token_s"],
            "copy": _f64(shape.bytes_moved) * c["copy_byte_s"],
            "policy_ops": _max(_f64(shape.op_flops) * c["op_flop_s"], _f64(shape.op_bytes) * c["op_byte_s"]) + zero,
            "swap": _f64(shape.swap_bytes) * c["swap_byte_s"],
            "allreduce_bw": tokens * c["allreduce_token_s"],
            "allreduce_count": ran * c["allreduce_count"],
            "step": zero + 1.0,
            "seqs": num_seqs + zero,
            "block_entries": _f64(shape.block_table_entries) + zero,
        }
        if self._moe is not None:
            f["linear_memory"] = f["linear_memory"] + self.expert_read_time(tokens)
        if padded:
            if shape.kv_tokens_padded is not None:
                kv_padded = _f64(shape.kv_tokens_padded)
            elif isinstance(prefill, np.ndarray):
                kv_padded = np.where(prefill > 0, 0.0, kv_read)
            else:
                kv_padded = 0.0 if prefill > 0 else kv_read
            pairs = shape.attn_pairs_prefill if shape.attn_pairs_prefill_padded is None else shape.attn_pairs_prefill_padded
            f["attn_padded"] = kv_padded * c["kv_token_s"]
            f["attn_prefill_padded"] = _f64(pairs) * c["attn_pair_s"] + zero
        return f

    def breakdown(self, shape: BatchShape) -> dict[str, np.float64 | np.ndarray]:
        """Seconds per part after the profile's factors; `total` equals `predict(shape)`."""
        if self._gemm_table is not None:
            return self._operator_breakdown(shape)
        f, p = self.features(shape, padded=self._pads), self.profile
        linear = _max(f["linear_compute_prefill"] / p.mfu_prefill + f["linear_compute_decode"] / p.mfu_decode,
                            f["linear_memory"] / p.mem_bw_eff)
        attention = _max(f["attn_compute"] / p.attn_compute_eff, f["attn_memory"] / p.attn_bw_eff)
        if self._pads:
            attention = attention + f["attn_padded"] * p.padded_attn_cost + f["attn_prefill_padded"] * p.padded_prefill_cost
        copy = (f["copy"] + f["policy_ops"]) / p.copy_bw_eff + _f64(shape.op_kernels) * p.gemm_latency_s
        swap = f["swap"] / p.pcie_eff
        allreduce = f["allreduce_bw"] / p.allreduce_bw_eff + f["allreduce_count"] * p.allreduce_latency_s
        scales = [p.step_time_scale]
        if self._batch_table is not None:
            scales.insert(0, self.decode_batch_factor(shape.num_seqs, shape.num_prefill_tokens))
        return self._step_parts(linear, attention, copy, swap, allreduce, self._overhead(f), scales)

    def _overhead(self, f) -> float | np.ndarray:
        p = self.profile
        return (f["step"] * p.step_overhead_s + f["seqs"] * p.per_seq_overhead_s
                + f["block_entries"] * p.per_block_entry_overhead_s)

    def _step_parts(self, linear, attention, copy, swap, allreduce, overhead, scales) -> dict:
        """The parts, each scaled by every factor of `scales` (a factor of exactly 1 is skipped), and the
        step total: device + overhead, or their max under async scheduling."""
        for k in scales:
            if not (np.ndim(k) == 0 and k == 1.0):
                linear, attention, copy, swap, allreduce, overhead = (
                    linear * k, attention * k, copy * k, swap * k, allreduce * k, overhead * k)
        device = linear + attention + copy + swap + allreduce
        total = _max(device, overhead) if self.async_scheduling else device + overhead
        return {"linear": linear, "attention": attention, "copy": copy, "swap": swap,
                "allreduce": allreduce, "overhead": overhead, "total": total}

    def _operator_breakdown(self, shape: BatchShape) -> dict[str, np.float64 | np.ndarray]:
        """The operator-fitted form (docs/gpu-profiles.md):

          linear    = max(tokens * flops_s / eff(tokens) + seqs * lm_head_s / eff(seqs),
                          (weights_s + seqs * logits_s) / mem_bw_eff) + [ran] * matmuls * gemm_latency_s
          elementwise = [ran] * layers * layer_latency_s + tokens * elementwise_s / elementwise_bw_eff
          attention = max(attn_compute / attn_compute_eff, attn_memory / attn_bw_eff)
          allreduce = tokens * allreduce_token_s / bw_eff(tp) + [ran] * 2 * layers * latency(tp)

        (elementwise is reported inside `linear`); copy, swap, overhead and async as the plain form."""
        c, p = self._c, self.profile
        f = self.features(shape, padded=False)
        seqs = _f64(shape.num_seqs)
        rows = seqs if shape.num_logit_rows is None else _f64(shape.num_logit_rows)
        tokens = _f64(shape.num_prefill_tokens) + _f64(shape.num_decode_tokens)
        ran = (tokens > 0).astype(np.float64) if isinstance(tokens, np.ndarray) else float(tokens > 0)
        compute = (tokens * self._op_flops_s / self.gemm_efficiency(tokens)
                   + rows * c["lm_head_s"] / self.gemm_efficiency(rows))
        memory = (ran * c["weights_s"] + rows * c["logits_seq_s"]) / p.mem_bw_eff
        if self._grouped is not None:
            compute = _max(compute, memory) + self._grouped.seconds(tokens)
            memory = compute
        elif self._moe is not None:
            memory = memory + self.expert_read_time(tokens) / p.mem_bw_eff
        linear = (_max(compute, memory) + ran * (self._gemm_launches * p.gemm_latency_s
                                                 + self._layers * p.layer_latency_s)
                  + tokens * self._elementwise_token_s / p.elementwise_bw_eff)
        attention = _max(f["attn_compute"] / p.attn_compute_eff, f["attn_memory"] / p.attn_bw_eff)
        copy = (f["copy"] + f["policy_ops"]) / p.copy_bw_eff + _f64(shape.op_kernels) * p.gemm_latency_s
        swap = f["swap"] / p.pcie_eff
        allreduce = (f["allreduce_bw"] / self._allreduce_bw_eff
                     + f["allreduce_count"] * self._allreduce_latency_s)
        return self._step_parts(linear, attention, copy, swap, allreduce, self._overhead(f), [p.step_time_scale])

    def _operator_step_total(self, shape: BatchShape) -> float:
        """`_operator_breakdown(shape)["total"]` of one step (every field a scalar), the same IEEE
        operations in the same order without the per-part dicts (the engine prices every step)."""
        c, p = self._c, self.profile
        seqs = float(shape.num_seqs)
        rows = seqs if shape.num_logit_rows is None else float(shape.num_logit_rows)
        tokens = float(shape.num_prefill_tokens) + float(shape.num_decode_tokens)
        kv_read = float(shape.kv_tokens_read)
        zero = tokens * 0.0
        pairs = float(shape.attn_pairs_prefill)
        attn_compute = (pairs * c["attn_pair_s"] + kv_read * c["attn_read_s"] if self._mla
                        else (pairs + kv_read) * c["attn_pair_s"])
        a = float(shape.op_flops) * c["op_flop_s"]
        b = float(shape.op_bytes) * c["op_byte_s"]
        policy_ops = (a if a >= b else b) + zero
        linear, allreduce = self._flat_parts(tokens, rows)      # scaled by step_time_scale
        a, b = attn_compute / p.attn_compute_eff, kv_read * c["kv_token_s"] / p.attn_bw_eff
        attention = a if a >= b else b
        copy = ((float(shape.bytes_moved) * c["copy_byte_s"] + policy_ops) / p.copy_bw_eff
                + float(shape.op_kernels) * p.gemm_latency_s)
        swap = float(shape.swap_bytes) * c["swap_byte_s"] / p.pcie_eff
        overhead = ((zero + 1.0) * p.step_overhead_s + (seqs + zero) * p.per_seq_overhead_s
                    + (float(shape.block_table_entries) + zero) * p.per_block_entry_overhead_s)
        k = p.step_time_scale
        if k != 1.0:
            attention, copy, swap, overhead = attention * k, copy * k, swap * k, overhead * k
        device = linear + attention + copy + swap + allreduce
        if self.async_scheduling:
            return device if device >= overhead else overhead
        return device + overhead

    def flat_step_total(self, seqs: int, rows: int, tokens: int, pairs: float, kv_read: float, entries: int) -> float:
        """`predict` of one step with no copies, swaps or KV-policy work (a decode, verification or mixed step:
        `seqs` sequences, `tokens` query tokens in all, `rows` LM-head rows, `pairs` prefill query-key pairs),
        bit for bit as `_operator_step_total` (the same IEEE operations on the same values; the zero copy,
        swap and policy terms are added as x + 0.0 == x, these parts being non-negative), without a
        BatchShape: the parts that depend on (tokens, rows) alone, linear and all-reduce, come from a memo
        (a speculative-decoding step prices the target and each of the drafter's passes: sim/model/
        spec_decode.py). Operator-form profiles only (None otherwise: use `predict`)."""
        if self._gemm_table is None:
            return None  # type: ignore[return-value]
        key = (tokens, rows)
        parts = self._flat_memo.get(key)
        if parts is None:
            if len(self._flat_memo) > 65536:
                self._flat_memo.clear()
            parts = self._flat_memo[key] = self._flat_parts(float(tokens), float(rows))
        linear, allreduce = parts
        c, p = self._c, self.profile
        kv_read = float(kv_read)
        attn_compute = (pairs * c["attn_pair_s"] + kv_read * c["attn_read_s"] if self._mla
                        else (pairs + kv_read) * c["attn_pair_s"])
        a, b = attn_compute / p.attn_compute_eff, kv_read * c["kv_token_s"] / p.attn_bw_eff
        attention = a if a >= b else b
        overhead = (p.step_overhead_s + float(seqs) * p.per_seq_overhead_s
                    + float(entries) * p.per_block_entry_overhead_s)
        k = p.step_time_scale
        if k != 1.0:
            attention, overhead = attention * k, overhead * k
        device = linear + attention + allreduce
        if self.async_scheduling:
            return device if device >= overhead else overhead
        return device + overhead

    def flat_passes(self, total: float, m: int, kv: int, passes: int, extra: float) -> float:
        """`total` plus, for j = 1..passes, `flat_step_total(m, m, m, 0.0, kv + m * j, 0)` and then `extra`,
        added in that order, bit for bit (pairs 0.0 and entries 0 enter as x + 0.0 == x): a drafter's
        one-token passes over m sequences whose contexts sum to kv + m * j (sim/model/spec_decode.py)."""
        key = (m, m)
        parts = self._flat_memo.get(key)
        if parts is None:
            parts = self._flat_memo[key] = self._flat_parts(float(m), float(m))
        linear, allreduce = parts
        c, p = self._c, self.profile
        pair = c["attn_read_s"] if self._mla else c["attn_pair_s"]
        compute_eff, token, bw_eff = p.attn_compute_eff, c["kv_token_s"], p.attn_bw_eff
        overhead = p.step_overhead_s + float(m) * p.per_seq_overhead_s
        k = p.step_time_scale
        if k != 1.0:
            overhead = overhead * k
        overlap = self.async_scheduling
        for j in range(1, passes + 1):
            kv_read = float(kv + m * j)
            a, b = kv_read * pair / compute_eff, kv_read * token / bw_eff
            attention = a if a >= b else b
            if k != 1.0:
                attention = attention * k
            device = linear + attention + allreduce
            if overlap:
                total = total + (device if device >= overhead else overhead) + extra
            else:
                total = total + (device + overhead) + extra
        return total

    def _flat_parts(self, tokens: float, rows: float) -> tuple[float, float]:
        """(linear, all-reduce) of `_operator_step_total` for a step of `tokens` tokens and `rows` LM-head
        rows, scaled by step_time_scale as there."""
        c, p = self._c, self.profile
        ran = float(tokens > 0)
        eff = self.gemm_efficiency
        compute = tokens * self._op_flops_s / eff(tokens) + rows * c["lm_head_s"] / eff(rows)
        memory = (ran * c["weights_s"] + rows * c["logits_seq_s"]) / p.mem_bw_eff
        if self._grouped is not None:
            compute = (compute if compute >= memory else memory) + self._grouped.seconds(tokens)
            memory = compute
        elif self._moe is not None:
            memory = memory + self.expert_read_time(tokens) / p.mem_bw_eff
        linear = ((compute if compute >= memory else memory)
                  + ran * (self._gemm_launches * p.gemm_latency_s + self._layers * p.layer_latency_s)
                  + tokens * self._elementwise_token_s / p.elementwise_bw_eff)
        allreduce = (tokens * c["allreduce_token_s"] / self._allreduce_bw_eff
                     + ran * c["allreduce_count"] * self._allreduce_latency_s)
        k = p.step_time_scale
        if k != 1.0:
            linear, allreduce = linear * k, allreduce * k
        return float(linear), float(allreduce)

    def _operator_decode_total(self, seqs: np.ndarray, kv_read: np.ndarray, entries: np.ndarray) -> np.ndarray:
        """`_operator_breakdown(...)["total"]` of a run of pure-decode steps (tokens = seqs, no prefill,
        copy or swap) with fewer array operations, bit for bit: the exact-zero terms are left out
        (x + 0.0 == x for these non-negative parts: copy, swap, and the all-reduce at TP 1), `[ran]`
        factors of 1.0 are dropped when every step computes a token, and the terms that depend on the
        sequence count alone come from a table over counts (`_decode_seq_terms`: the same operations
        on the same values give the same bits)."""
        c, p = self._c, self.profile
        kv_read = kv_read.astype(np.float64, copy=False)
        n = seqs.astype(np.intp, copy=False)
        counts = n.ravel().tolist()         # a run's few counts: min and max in Python, not two numpy reductions
        if not counts or min(counts) < 0 or (seqs.dtype.kind == "f" and not (n == seqs).all()):
            return self._operator_decode_priced(seqs.astype(np.float64, copy=False), kv_read, entries)
        linear, base, allreduce = self._decode_seq_terms(max(counts))
        attn_compute = kv_read * c["attn_read_s"] if self._mla else kv_read * c["attn_pair_s"]
        attention = np.maximum(attn_compute / p.attn_compute_eff, kv_read * c["kv_token_s"] / p.attn_bw_eff)
        overhead = base[n] + entries.astype(np.float64, copy=False) * p.per_block_entry_overhead_s
        k = p.step_time_scale
        if k != 1.0:
            attention, overhead = attention * k, overhead * k
        device = linear[n] + attention
        if allreduce is not None:
            device = device + allreduce[n]
        return np.maximum(device, overhead) if self.async_scheduling else device + overhead

    def decode_prices(self, seqs: list[int], kv_read: list[int], entries: list[int]) -> list[float] | None:
        """`predict_decode` of a few pure-decode steps as Python floats, bit for bit (the same IEEE
        operations on the same values, in the same order, as `_operator_decode_total`), without
        numpy's fixed cost per call: an admitting run prices a stretch of ~10 steps between arrivals.
        Integer counts, sequences >= 0; None where the profile has no GEMM table (use predict_decode).
        The terms `_operator_decode_total` leaves out are applied as exact identities: x * 1.0 == x
        (step_time_scale 1) and x + 0.0 == x (no all-reduce: these parts are non-negative)."""
        if self._gemm_table is None:
            return None
        linear, base, allreduce = self._decode_seq_lists(max(seqs))
        c, p = self._c, self.profile
        pair, compute_eff = (c["attn_read_s"] if self._mla else c["attn_pair_s"]), p.attn_compute_eff
        token, bw_eff, entry, k = c["kv_token_s"], p.attn_bw_eff, p.per_block_entry_overhead_s, p.step_time_scale
        overlap = self.async_scheduling
        out = []
        for n, r, e in zip(seqs, kv_read, entries, strict=False):
            a, b = float(r) * pair / compute_eff, float(r) * token / bw_eff
            device = linear[n] + (a if a >= b else b) * k + allreduce[n]
            overhead = (base[n] + float(e) * entry) * k
            out.append((device if device >= overhead else overhead) if overlap else device + overhead)
        return out

    def _decode_seq_lists(self, top: int) -> tuple[list, list, list]:
        """`_decode_seq_terms` as Python lists (exact: float64 to float), zeros for no all-reduce."""
        terms = self._decode_seq_terms(top)
        if self._decode_lists is None or self._decode_lists[0] is not terms:
            linear, base = terms[0].tolist(), terms[1].tolist()
            allreduce = [0.0] * len(linear) if terms[2] is None else terms[2].tolist()
            self._decode_lists = (terms, (linear, base, allreduce))
        return self._decode_lists[1]

    def _decode_seq_terms(self, top: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """(linear part, overhead before the block-table term, all-reduce part or None) of a decode
        step of each sequence count 0..top or more, each scaled by step_time_scale where
        `_operator_decode_priced` scales it; tabulated once (the fast-forward prices every run)."""
        terms = self._decode_terms
        if terms is None or terms[0].size <= top:
            p = self.profile
            seqs = np.arange(max(top + 1, 1025, 2 * terms[0].size if terms else 0), dtype=np.float64)
            linear, allreduce = self._decode_seq_parts(seqs, (seqs > 0).astype(np.float64))
            base = p.step_overhead_s + seqs * p.per_seq_overhead_s
            k = p.step_time_scale
            if k != 1.0:
                linear = linear * k
                allreduce = allreduce * k if allreduce is not None else None
            terms = self._decode_terms = (linear, base, allreduce)
        return terms

    def _decode_seq_parts(self, seqs: np.ndarray, ran) -> tuple[np.ndarray, np.ndarray | None]:
        """(linear part, all-reduce part or None) of decode steps of `seqs` sequences, unscaled; `ran` is
        1 where a step ran (seqs > 0), as an array or the scalar 1.0 when all did."""
        c, p = self._c, self.profile
        e = self.gemm_efficiency(seqs)
        compute = seqs * self._op_flops_s / e + seqs * c["lm_head_s"] / e
        memory = (ran * c["weights_s"] + seqs * c["logits_seq_s"]) / p.mem_bw_eff
        if self._grouped is not None:
            compute = np.maximum(compute, memory) + self._grouped.seconds(seqs)
            memory = compute
        elif self._moe is not None:
            memory = memory + self.expert_read_time(seqs) / p.mem_bw_eff
        linear = (np.maximum(compute, memory)
                  + ran * (self._gemm_launches * p.gemm_latency_s + self._layers * p.layer_latency_s)
                  + seqs * self._elementwise_token_s / p.elementwise_bw_eff)
        if not (c["allreduce_token_s"] or c["allreduce_count"]):
            return linear, None
        return linear, (seqs * c["allreduce_token_s"] / self._allreduce_bw_eff
                        + ran * c["allreduce_count"] * self._allreduce_latency_s)

    def _operator_decode_priced(self, seqs: np.ndarray, kv_read: np.ndarray, entries: np.ndarray) -> np.ndarray:
        """`_operator_decode_total` of any sequence counts (not whole, or negative), term by term."""
        c, p = self._c, self.profile
        linear, allreduce = self._decode_seq_parts(seqs, 1.0 if seqs.all() else (seqs > 0).astype(np.float64))
        attn_compute = kv_read * c["attn_read_s"] if self._mla else kv_read * c["attn_pair_s"]
        attention = np.maximum(attn_compute / p.attn_compute_eff, kv_read * c["kv_token_s"] / p.attn_bw_eff)
        overhead = (p.step_overhead_s + seqs * p.per_seq_overhead_s
                    + entries.astype(np.float64, copy=False) * p.per_block_entry_overhead_s)
        k = p.step_time_scale
        if k != 1.0:
            linear, attention, overhead = linear * k, attention * k, overhead * k
        device = linear + attention
        if allreduce is not None:
            device = device + (allreduce * k if k != 1.0 else allreduce)
        return np.maximum(device, overhead) if self.async_scheduling else device + overhead

    def decode_batch_factor(self, num_seqs, num_prefill_tokens=0.0):
        """The profile's decode_batch_factors at each step (1 for steps with prefill tokens, or without
        a table)."""
        if self._batch_table is None:
            return 1.0 if np.ndim(num_seqs) == 0 else np.ones(np.shape(num_seqs))
        k = self._interp_batch(_f64(num_seqs))
        if isinstance(k, np.ndarray):
            return np.where(_f64(num_prefill_tokens) > 0, 1.0, k)
        return 1.0 if num_prefill_tokens > 0 else float(k)

    def _interp_batch(self, num_seqs):
        sizes, factors = self._batch_table
        return np.interp(num_seqs, sizes, factors)

    def predict(self, shape: BatchShape) -> float | np.ndarray:
        """Seconds for the step (float), or for each step of a run (float64 array)."""
        if self._gemm_table is not None and not isinstance(shape.num_seqs, np.ndarray):
            return self._operator_step_total(shape)
        total = self.breakdown(shape)["total"]
        return float(total) if np.ndim(total) == 0 else total

    def predict_decode(self, num_seqs: np.ndarray, kv_tokens_read: np.ndarray,
                       block_table_entries: np.ndarray, kv_tokens_padded: np.ndarray | None = None) -> np.ndarray:
        """`predict` for a run of pure-decode steps (float64 or integer arrays; one new token per
        sequence, no prefill, copy or swap), with the zero terms left out. Bit-identical to `predict` on the same
        BatchShape: every dropped term is an exact 0.0, and x + 0.0 == x. The decode fast-forward
        prices each run with it (tested against `predict`)."""
        if self._gemm_table is not None:
            return self._operator_decode_total(num_seqs, kv_tokens_read, block_table_entries)
        num_seqs, kv_tokens_read, block_table_entries = _f64(num_seqs), _f64(kv_tokens_read), _f64(block_table_entries)
        c, p = self._c, self.profile
        weights = c["weights_s"] if self._moe is None else c["weights_s"] + self.expert_read_time(num_seqs)
        linear = np.maximum((num_seqs * c["decode_flops_s"] + num_seqs * c["lm_head_s"]) / p.mfu_decode,
                            (weights + num_seqs * c["act_token_s"] + num_seqs * c["logits_seq_s"])
                            / p.mem_bw_eff)
        attention = np.maximum(kv_tokens_read * c["attn_read_s"] / p.attn_compute_eff,
                               kv_tokens_read * c["kv_token_s"] / p.attn_bw_eff)
        if p.padded_attn_cost:
            padded = kv_tokens_read if kv_tokens_padded is None else kv_tokens_padded
            attention = attention + padded * c["kv_token_s"] * p.padded_attn_cost
        overhead = (p.step_overhead_s + num_seqs * p.per_seq_overhead_s
                    + block_table_entries * p.per_block_entry_overhead_s)
        allreduce = None
        if self.tp > 1:
            allreduce = (num_seqs * c["allreduce_token_s"] / p.allreduce_bw_eff
                         + c["allreduce_count"] * p.allreduce_latency_s)
        if self._batch_table is not None:
            k = self._interp_batch(num_seqs)
            linear, attention, overhead = linear * k, attention * k, overhead * k
            allreduce = None if allreduce is None else allreduce * k
        total = linear + attention
        if allreduce is not None:
            total = total + allreduce
        if p.step_time_scale != 1.0:
            total, overhead = total * p.step_time_scale, overhead * p.step_time_scale
        return np.maximum(total, overhead) if self.async_scheduling else total + overhead

    def active_branches(self, shape: BatchShape) -> dict[str, np.ndarray | np.bool_]:
        """Which side of each roofline max() is active (True = compute side) under the profile."""
        f, p = self.features(shape), self.profile
        return {
            "linear_compute_bound": (f["linear_compute_prefill"] / p.mfu_prefill
                                     + f["linear_compute_decode"] / p.mfu_decode) >= f["linear_memory"] / p.mem_bw_eff,
            "attn_compute_bound": f["attn_compute"] / p.attn_compute_eff >= f["attn_memory"] / p.attn_bw_eff,
        }

    def feature_matrix(self, shape: BatchShape) -> np.ndarray:
        """Features as columns in FEATURE_NAMES order: shape (steps, len(FEATURE_NAMES))."""
        f = self.features(shape)
        return np.column_stack([np.atleast_1d(f[name]) for name in FEATURE_NAMES])

    def __repr__(self) -> str:
        return (f"CostModel({self.model.name}, {self.gpu.name}, tp={self.tp}, profile={self.profile.name}, "
                f"weights={self.model.weight_dtype}, kv={normalize_dtype(self.model.kv_dtype)})")
