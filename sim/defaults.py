"""vLLM's engine defaults for settings a config leaves unset (null).

Batch limits follow vLLM's `EngineArgs.get_batch_defaults` (0.32/0.33): they depend on the device
and on the entry point. `serve` is `vllm serve` (the OpenAI-compatible server), `offline` the
`LLM` class. CPU devices use vLLM's CPU-backend values. Prefix caching is on, as in vLLM, except
with KV eviction policies or per-head layouts, whose evicted tokens break shared prefix blocks.
Async scheduling is on for GPUs and off for CPUs (vLLM's CPU engine forces it off).
"""
from __future__ import annotations

from .catalog import get_gpu, get_model
from .config import ConfigError, EngineConfig, SimConfig

GiB = 2**30


def batch_defaults(gpu, entry_point: str = "serve", world_size: int = 1) -> tuple[int, int]:
    """(max_num_batched_tokens, max_num_seqs) vLLM picks when neither is given."""
    if gpu.kind == "cpu":
        tokens, seqs = (2048, 128) if entry_point == "serve" else (4096, 256)
        return tokens * world_size, seqs * world_size
    memory = gpu.memory_gib * GiB
    if memory >= 160 * GiB:
        return 16384, 1024
    if memory >= 70 * GiB and "a100" not in gpu.name.lower():
        return (8192, 1024) if entry_point == "serve" else (16384, 1024)
    return (2048, 256) if entry_point == "serve" else (8192, 256)


def resolve_engine(cfg: SimConfig) -> EngineConfig:
    """`cfg.engine` with every null default filled in (see module docstring)."""
    eng = cfg.engine
    gpu = get_gpu(cfg.gpu)
    tokens, seqs = batch_defaults(gpu, eng.entry_point, cfg.tp)
    if not eng.enable_chunked_prefill and eng.max_num_batched_tokens is None:
        max_model_len = eng.max_model_len or get_model(cfg.model).max_position
        tokens = max(tokens, max_model_len)              # vLLM: a whole prompt must fit one step
    updates = {
        "max_num_batched_tokens": eng.max_num_batched_tokens or tokens,
        "max_num_seqs": eng.max_num_seqs or seqs,
        "enable_prefix_caching": cfg.kv.is_default if eng.enable_prefix_caching is None
        else eng.enable_prefix_caching,
        "async_scheduling": gpu.kind != "cpu" if eng.async_scheduling is None else eng.async_scheduling,
    }
    if updates["max_num_batched_tokens"] < updates["max_num_seqs"]:
        # vLLM's SchedulerConfig refuses it too: every running sequence takes a token of the step's budget
        given = "" if eng.max_num_seqs else f", vLLM's default for {gpu.name}"
        raise ConfigError(f"engine.max_num_batched_tokens ({updates['max_num_batched_tokens']}) must be at least "
                          f"engine.max_num_seqs ({updates['max_num_seqs']}{given}), as vLLM requires; raise "
                          f"--max-num-batched-tokens or lower --max-num-seqs")
    return eng.model_copy(update=updates)
