"""KV-cache pool sizing, following vLLM's memory profiling.

    available = total_memory * gpu_memory_utilization
                - weights / tp - peak activations - non-torch overhead        (per GPU)
    num_blocks = available // (block_size * kv_bytes_per_token_per_gpu)

vLLM measures the activation peak with a dummy forward of `max_num_batched_tokens` tokens plus a
sampler run over `max_num_seqs` logits; `activation_peak_bytes` estimates that run (or pass the
figure your vLLM log prints as `activation_reserve_bytes`). KV heads split across TP ranks and are
replicated when there are fewer KV heads than ranks.

With sliding-window layers a block holds one KV cache group's layers (`block_bytes_per_token`).

In the `per_head` layout (KV-Compress) a block holds `block_size` tokens of ONE layer and ONE KV
head, so the same bytes make `num_blocks * layers * kv_heads_per_gpu` blocks.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from .catalog import DTYPE_BYTES, GPUSpec, ModelSpec, get_gpu, get_model
from .cost_model import kv_heads_per_gpu
from ..kv.base import sample_row_count
from ..kv.policy import FastModeProfile
from ..io.safe_io import host_memory_room

if TYPE_CHECKING:
    from ..config import EngineConfig

GiB = 2**30
NON_TORCH_OVERHEAD_BYTES = GiB // 2   # CUDA context extras, cuBLAS/NCCL workspaces, CUDA graph pool
SAMPLER_LOGIT_COPIES = 2              # fp32 logits + probabilities in the sampler's dummy run


class ModelDoesNotFitError(ValueError):
    """Weights plus activations leave no room for even one KV block."""


@dataclass(frozen=True)
class KVPoolSize:
    layout: str
    block_size: int
    num_blocks: int                 # shared layout: blocks of block_size tokens x all layers x KV heads/GPU
    num_blocks_per_head: int        # per_head layout: blocks of block_size tokens x one layer x one KV head
    bytes_per_block: int            # one shared-layout block on one GPU
    bytes_per_head_block: int       # one per_head-layout block
    kv_bytes_available: int         # per GPU, before rounding down to whole blocks
    weight_bytes: int               # per GPU
    activation_bytes: int
    non_torch_bytes: int
    usable_bytes: int               # total memory x utilization

    @property
    def pool_blocks(self) -> int:
        """Blocks in the pool of the configured layout."""
        return self.num_blocks_per_head if self.layout == "per_head" else self.num_blocks

    @property
    def token_capacity(self) -> int:
        """Tokens of KV (all layers and heads) the pool holds when every block is full."""
        return self.num_blocks * self.block_size


def block_bytes_per_token(model: ModelSpec, tp: int, kv_dtype: str | None = None) -> float:
    """KV bytes of one token in one pool block on one GPU: every layer, this GPU's KV heads; with
    sliding-window layers one KV cache group's layers (vLLM's hybrid allocator: a block holds one group;
    ModelSpec.kv_cache_groups). MLA's one latent per token is held whole on every GPU."""
    per_token = model.kv_bytes_per_token(kv_dtype) * kv_heads_per_gpu(model, tp) / model.num_kv_heads
    if model.num_sliding_layers:
        per_token = per_token * model.kv_cache_groups()[0] / model.num_layers
    return per_token


def activation_peak_bytes(model: ModelSpec, *, tp: int = 1, max_num_batched_tokens: int = 8192,
                          max_num_seqs: int = 256) -> int:
    """Estimate of vLLM's profiled activation peak: the widest live tensors of the MLP for a full
    token budget (gate_up output 2*I, activation output I, and a few hidden-sized buffers), plus
    the sampler's fp32 logits over max_num_seqs rows."""
    act = DTYPE_BYTES[model.activation_dtype]
    per_token = act * (4 * model.hidden_size + 3 * model.intermediate_size / tp)
    logits = SAMPLER_LOGIT_COPIES * 4 * max_num_seqs * model.vocab_size
    return int(max_num_batched_tokens * per_token + logits)


@dataclass(frozen=True)
class PoolSizing:
    """The engine settings that size the KV pool of one GPU (vLLM's names; see the module docstring)."""
    tp: int = 1                             # tensor-parallel degree: weights and KV heads split over it
    block_size: int = 16                    # tokens per block
    gpu_memory_utilization: float = 0.9     # share of the GPU's memory vLLM may use
    max_num_batched_tokens: int = 8192      # token budget of the profiled dummy forward (activation peak)
    max_num_seqs: int = 256                 # rows of the profiled sampler run (activation peak)
    activation_reserve_bytes: int | None = None   # the activation peak your vLLM log prints (None: estimated)
    non_torch_overhead_bytes: int = NON_TORCH_OVERHEAD_BYTES   # CUDA context, workspaces, graph pool
    kv_dtype: str | None = None             # KV cache dtype (None: the model's)
    layout: Literal["shared", "per_head"] = "shared"   # per_head: blocks of one layer and one KV head
    # speculative decoding's drafter (sim/model/spec_decode.py): its weights on each GPU, and its KV per
    # token on each GPU, held in the target's blocks (vLLM allocates the drafter's layers with the target's)
    drafter_weight_bytes: int = 0
    drafter_kv_bytes_per_token: float = 0.0
    pp: int = 1                             # pipeline stages: each GPU holds one stage's layers (weights, KV)
    dp: int = 1                             # data-parallel attention ranks sharing the routed experts (MoE)

    @classmethod
    def of_engine(cls, eng: EngineConfig, *, tp: int, kv_dtype: str | None = None, pp: int = 1,
                  dp: int = 1) -> PoolSizing:
        """The sizing of a run's resolved engine settings (`resolve_engine`: no field left None)."""
        return cls(tp=tp, block_size=eng.block_size, gpu_memory_utilization=eng.gpu_memory_utilization,
                   max_num_batched_tokens=eng.max_num_batched_tokens, max_num_seqs=eng.max_num_seqs,
                   kv_dtype=kv_dtype, pp=pp, dp=dp)


def num_gpu_blocks(model: ModelSpec | str, gpu: GPUSpec | str, sizing: PoolSizing = PoolSizing()) -> KVPoolSize:
    """Size the KV block pool of one GPU (see module docstring)."""
    model, gpu = get_model(model), get_gpu(gpu)
    tp, block_size, layout = sizing.tp, sizing.block_size, sizing.layout
    gpu_memory_utilization = sizing.gpu_memory_utilization
    non_torch_overhead_bytes = sizing.non_torch_overhead_bytes
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if layout not in ("shared", "per_head"):
        raise ValueError(f"layout must be 'shared' or 'per_head', got {layout!r}")
    heads = kv_heads_per_gpu(model, tp)
    usable = int(gpu.memory_bytes * gpu_memory_utilization)
    weights = model.weight_bytes // tp
    if sizing.drafter_weight_bytes:
        weights += sizing.drafter_weight_bytes
    activations = (activation_peak_bytes(model, tp=tp, max_num_batched_tokens=sizing.max_num_batched_tokens,
                                         max_num_seqs=sizing.max_num_seqs)
                   if sizing.activation_reserve_bytes is None else int(sizing.activation_reserve_bytes))
    available = usable - weights - activations - non_torch_overhead_bytes
    kv_per_token = block_bytes_per_token(model, tp, sizing.kv_dtype)
    if sizing.pp > 1 or sizing.dp > 1:       # the stage (or expert share) that leaves the fewest blocks
        weights, available, kv_per_token = _parallel_stage(model, sizing, usable - activations - non_torch_overhead_bytes)
    if sizing.drafter_kv_bytes_per_token:   # speculative decoding's drafter (refused with pp / dp: sim/config.py)
        kv_per_token += sizing.drafter_kv_bytes_per_token
    bytes_per_block = int(block_size * kv_per_token)
    if available < bytes_per_block:
        need = weights + activations + non_torch_overhead_bytes + bytes_per_block
        raise ModelDoesNotFitError(
            f"{model.name} does not fit on {gpu.name} ({_layout(sizing)}): weights {weights / GiB:.2f} GiB + activations "
            f"{activations / GiB:.2f} GiB + overhead {non_torch_overhead_bytes / GiB:.2f} GiB + one KV block "
            f"need {need / GiB:.2f} GiB but {gpu.memory_gib:g} GiB x {gpu_memory_utilization:g} = "
            f"{usable / GiB:.2f} GiB is usable: {(need - usable) / GiB:.2f} GiB missing "
            f"(raise tp{', pp' if sizing.pp > 1 else ''}, gpu_memory_utilization, use a larger GPU or lower-precision weights)")
    num_blocks = available // bytes_per_block
    per_head_factor = model.num_layers * heads
    return KVPoolSize(
        layout=layout, block_size=block_size, num_blocks=num_blocks,
        num_blocks_per_head=num_blocks * per_head_factor, bytes_per_block=bytes_per_block,
        bytes_per_head_block=bytes_per_block // per_head_factor, kv_bytes_available=available,
        weight_bytes=weights, activation_bytes=activations, non_torch_bytes=non_torch_overhead_bytes,
        usable_bytes=usable,
    )


def _layout(sizing: PoolSizing) -> str:
    return f"tp={sizing.tp}" + (f", pp={sizing.pp}" if sizing.pp > 1 else "") + (f", dp={sizing.dp}" if sizing.dp > 1 else "")


def _parallel_stage(model: ModelSpec, sizing: PoolSizing, room: int) -> tuple[int, int, float]:
    """(weights, KV bytes available, KV bytes per token) of the GPU of a TP x PP (x DP ranks sharing the routed
    experts) layout whose pool is the smallest: vLLM sizes every worker's pool and takes the fewest blocks
    (sim/model/parallel.py). `room`: usable memory less activations and overhead."""
    from .parallel import ParallelismError, pp_layer_split, stage_weight_bytes

    if model.num_sliding_layers and sizing.pp > 1:
        raise ParallelismError(f"pipeline parallelism of {model.name}: models with sliding-window layers "
                               "(vLLM's hybrid KV groups) are not modelled with pp > 1")
    tp, pp = sizing.tp, sizing.pp
    layers = pp_layer_split(model.num_layers, pp)
    experts = model.routed_expert_params * DTYPE_BYTES[model.expert_dtype or model.weight_dtype] if model.is_moe else 0
    per_token = block_bytes_per_token(model, tp, sizing.kv_dtype) / model.num_layers
    best = None
    for s, n in enumerate(layers):
        stage = stage_weight_bytes(model, n, s == 0, s == pp - 1)
        # routed experts: this stage's share, split over the DP ranks' GPUs too
        stage_experts = experts * n / model.num_layers
        weights = int((stage - stage_experts) // tp + stage_experts // (tp * sizing.dp))
        kv = per_token * n
        blocks = (room - weights) // max(int(sizing.block_size * kv), 1)
        if best is None or blocks < best[0]:
            best = (blocks, weights, room - weights, kv)
    assert best is not None
    return best[1], best[2], best[3]


# ---- host memory of a simulation run ---------------------------------------------------------------
# Bytes per pool block of the simulator's own structures (measured with tracemalloc, 10^6 blocks):
# the plain pool (a list of block ids), with prefix caching (free-queue OrderedDict, ref counts,
# hashes), the eviction-aware managers' array pool; invariant checks build block-sized arrays.
POOL_BYTES_PER_BLOCK = {"plain": 48, "prefix_caching": 139, "array": 17}
INVARIANT_CHECK_BYTES_PER_BLOCK = 32
REQUEST_BYTES = 1024                  # a request's objects and its rows in the trace and result tables
TOKEN_TIME_BYTES = 16                 # each output token's time: in the request, then in the result table
FAST_SLAB_GROWTH = 1.5                # the slab doubles: old and new arrays coexist while it grows


def check_pool_fits_gpu(model: ModelSpec, gpu: GPUSpec, *, tp: int, num_blocks: int, block_size: int,
                        kv_dtype: str | None = None) -> None:
    """A KV pool given by hand (engine.num_gpu_blocks) must fit the GPU beside the weights: vLLM could not
    allocate it. Raises ModelDoesNotFitError naming the option and the most that fits."""
    per_token = block_bytes_per_token(model, tp, kv_dtype)
    pool = num_blocks * block_size * per_token
    room = gpu.memory_bytes - model.weight_bytes // tp
    if pool > room:
        most = max(int(room // (block_size * per_token)), 0)
        raise ModelDoesNotFitError(
            f"engine.num_gpu_blocks: {num_blocks} blocks x {block_size} tokens x {per_token / 1024:g} KiB = "
            f"{pool / GiB:.1f} GiB of KV cache per GPU, but {gpu.name} has {gpu.memory_gib:g} GiB and the weights "
            f"take {model.weight_bytes / tp / GiB:.1f} GiB of it; expected at most {most} blocks")


class HostMemoryError(ValueError):
    """A run would need more host memory than is available; the message says what and how much."""


@dataclass(frozen=True)
class RunMemoryEstimate:
    parts: tuple[tuple[str, str, str, int], ...]     # (what, how it is sized, option that sizes it, bytes)

    @property
    def total_bytes(self) -> int:
        return sum(p[3] for p in self.parts)

    def describe(self) -> str:
        return "; ".join(f"{what} {b / GiB:.2f} GiB ({how})" for what, how, _, b in self.parts if b >= GiB / 100)


def estimate_run_memory(cfg, model: ModelSpec, cost, num_blocks: int, trace=None,
                        fast_profile: FastModeProfile | None = None) -> RunMemoryEstimate:
    """Host memory a simulation of `cfg` (its engine defaults resolved: sim.engine.resolved_run builds it)
    needs, before anything is allocated: the KV block pool of every replica, fast mode's
    per-request slabs at their peak (sized from the policy's `fast_profile`), and the requests of
    `trace`."""
    eng, kv = cfg.engine, cfg.kv
    rows = model.num_layers * kv_heads_per_gpu(model, cfg.tp) if kv.layout == "per_head" else 1
    pool_blocks = num_blocks * rows
    kind = "array" if not kv.is_default else "prefix_caching" if eng.enable_prefix_caching else "plain"
    per_block = POOL_BYTES_PER_BLOCK[kind] + (INVARIANT_CHECK_BYTES_PER_BLOCK if cfg.check_invariants else 0)
    engines = cfg.engine_ranks
    parts = [("KV block pool", f"{engines} replica(s) x {pool_blocks} blocks x {per_block} B",
              "--num-gpu-blocks", engines * pool_blocks * per_block)]
    if kv.mode == "fast" and fast_profile is not None:
        slab, budget, window = _fast_slab_bytes(cfg, fast_profile, rows, trace, eng.max_num_seqs)
        option = "--budget" if kv.budget is not None else f"kv.params of {kv.policy} (its window)"
        parts.append(("fast-mode slabs", f"{budget} budget and {window} window tokens a row, "
                      f"{engines} replica(s)", option, engines * slab))
    if trace is not None:
        outputs = int(trace.df["output_tokens"].sum())
        parts.append(("requests", f"{len(trace)} requests, {outputs} output tokens", "--max-requests",
                      len(trace) * REQUEST_BYTES + outputs * TOKEN_TIME_BYTES))
    return RunMemoryEstimate(tuple(parts))


def _fast_slab_bytes(cfg, profile: FastModeProfile, rows: int, trace, max_seqs: int) -> tuple[int, int, int]:
    """(bytes, budget, window): fast mode keeps, per request slot and simulated row, page columns, the
    recent-window ring and the budget-sized survivor list (with H2O, its score terms): see
    sim/kv/fast/slab.py FastSlab.alloc."""
    if profile.sampled_rows:         # token-level state on sampled rows (sim/kv/fast/sampled/rows.py), no slab
        return 0, 0, 0
    budget = int(profile.budget or 0)
    window = max(int(profile.protect_recent), 1)
    scored = profile.age_weight == "young" and profile.budget is not None
    sim_rows = sample_row_count(rows, cfg.kv.fast_rows)
    longest = int((trace.df["prompt_tokens"] + trace.df["output_tokens"]).max()) if trace is not None else 0
    cols = max(8, -(-longest // cfg.engine.block_size))
    per_row = cols * 9 + window * 4 + (budget + 2) * 4 + 64
    if scored:
        per_row += (budget + 2) * 24 + window * 16 + 256
    concurrent = min(max_seqs, len(trace)) if trace is not None else max_seqs
    slots = 4
    while slots < concurrent:
        slots *= 2
    return int(slots * sim_rows * per_row * FAST_SLAB_GROWTH), budget, window


def available_memory_bytes() -> tuple[int, str]:
    """(bytes this process can still allocate, where the figure comes from): see
    safe_io.host_memory_room (system memory, a cgroup limit, an address-space limit)."""
    return host_memory_room()


def check_memory(estimate: RunMemoryEstimate, available: tuple[int, str] | None = None) -> None:
    """Raise HostMemoryError when the estimate does not fit the memory available (default: measured now)."""
    free, source = available or available_memory_bytes()
    need = estimate.total_bytes
    if need <= free:
        return
    what, _, option, _ = max(estimate.parts, key=lambda p: p[3])
    raise HostMemoryError(
        f"this run needs about {need / GiB:.1f} GiB of host memory: {estimate.describe()}; but "
        f"{free / GiB:.1f} GiB is available ({source}); lower {option} (largest part: {what})")


def vllm_kv_cache_report(model: ModelSpec, num_blocks: int, block_size: int, max_model_len: int,
                         max_num_batched_tokens: int) -> tuple[int, float]:
    """(tokens, concurrency) as vLLM's engine logs them at start-up (`_report_kv_cache_config`, vLLM
    0.10-0.11): "GPU KV cache size: N tokens" = num_blocks // KV cache groups x block_size, and "Maximum
    concurrency for max_model_len tokens per request: Cx" = num_blocks / the blocks one request of
    max_model_len takes in every group: cdiv(max_model_len, block_size) for a full-attention group, and for a
    sliding-window group cdiv(min(window - 1 + max_num_batched_tokens, max_model_len), block_size) + 1."""
    layers_per_group, full_groups, sliding_groups = model.kv_cache_groups()
    groups = full_groups + sliding_groups
    tokens = num_blocks // max(groups, 1) * block_size
    per_request = full_groups * -(-max_model_len // block_size)
    if sliding_groups:
        window_tokens = min(model.sliding_window - 1 + max_num_batched_tokens, max_model_len)
        per_request += sliding_groups * (-(-window_tokens // block_size) + 1)
    return tokens, num_blocks / max(per_request, 1)
