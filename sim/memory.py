"""KV-cache pool sizing, following vLLM's memory profiling.

    available = total_memory * gpu_memory_utilization
                - weights / tp - peak activations - non-torch overhead        (per GPU)
    num_blocks = available // (block_size * kv_bytes_per_token_per_gpu)

vLLM measures the activation peak with a dummy forward of `max_num_batched_tokens` tokens plus a
sampler run over `max_num_seqs` logits; `activation_peak_bytes` estimates that run (or pass the
figure your vLLM log prints as `activation_reserve_bytes`). KV heads split across TP ranks and are
replicated when there are fewer KV heads than ranks.

In the `per_head` layout (KV-Compress) a block holds `block_size` tokens of ONE layer and ONE KV
head, so the same bytes make `num_blocks * layers * kv_heads_per_gpu` blocks.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from sim.catalog import DTYPE_BYTES, GPUSpec, ModelSpec, get_gpu, get_model
from sim.cost_model import kv_heads_per_gpu

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


def activation_peak_bytes(model: ModelSpec, *, tp: int = 1, max_num_batched_tokens: int = 8192,
                          max_num_seqs: int = 256) -> int:
    """Estimate of vLLM's profiled activation peak: the widest live tensors of the MLP for a full
    token budget (gate_up output 2*I, activation output I, and a few hidden-sized buffers), plus
    the sampler's fp32 logits over max_num_seqs rows."""
    act = DTYPE_BYTES[model.activation_dtype]
    per_token = act * (4 * model.hidden_size + 3 * model.intermediate_size / tp)
    logits = SAMPLER_LOGIT_COPIES * 4 * max_num_seqs * model.vocab_size
    return int(max_num_batched_tokens * per_token + logits)


def num_gpu_blocks(model: ModelSpec | str, gpu: GPUSpec | str, *, tp: int = 1, block_size: int = 16,
                   gpu_memory_utilization: float = 0.9, activation_reserve_bytes: int | None = None,
                   max_num_batched_tokens: int = 8192, max_num_seqs: int = 256,
                   non_torch_overhead_bytes: int = NON_TORCH_OVERHEAD_BYTES, kv_dtype: str | None = None,
                   layout: Literal["shared", "per_head"] = "shared") -> KVPoolSize:
    """Size the KV block pool of one GPU (see module docstring)."""
    model, gpu = get_model(model), get_gpu(gpu)
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if layout not in ("shared", "per_head"):
        raise ValueError(f"layout must be 'shared' or 'per_head', got {layout!r}")
    heads = kv_heads_per_gpu(model, tp)
    usable = int(gpu.memory_bytes * gpu_memory_utilization)
    weights = model.weight_bytes // tp
    activations = (activation_peak_bytes(model, tp=tp, max_num_batched_tokens=max_num_batched_tokens,
                                         max_num_seqs=max_num_seqs)
                   if activation_reserve_bytes is None else int(activation_reserve_bytes))
    available = usable - weights - activations - non_torch_overhead_bytes
    kv_per_token = model.kv_bytes_per_token(kv_dtype) * heads / model.num_kv_heads
    bytes_per_block = int(block_size * kv_per_token)
    if available < bytes_per_block:
        need = weights + activations + non_torch_overhead_bytes + bytes_per_block
        raise ModelDoesNotFitError(
            f"{model.name} does not fit on {gpu.name} (tp={tp}): weights {weights / GiB:.2f} GiB + activations "
            f"{activations / GiB:.2f} GiB + overhead {non_torch_overhead_bytes / GiB:.2f} GiB + one KV block "
            f"need {need / GiB:.2f} GiB but {gpu.memory_gib:g} GiB x {gpu_memory_utilization:g} = "
            f"{usable / GiB:.2f} GiB is usable: {(need - usable) / GiB:.2f} GiB missing "
            f"(raise tp, gpu_memory_utilization, use a larger GPU or lower-precision weights)")
    num_blocks = available // bytes_per_block
    per_head_factor = model.num_layers * heads
    return KVPoolSize(
        layout=layout, block_size=block_size, num_blocks=num_blocks,
        num_blocks_per_head=num_blocks * per_head_factor, bytes_per_block=bytes_per_block,
        bytes_per_head_block=bytes_per_block // per_head_factor, kv_bytes_available=available,
        weight_bytes=weights, activation_bytes=activations, non_torch_bytes=non_torch_overhead_bytes,
        usable_bytes=usable,
    )
