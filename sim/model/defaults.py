"""vLLM's engine defaults for settings a config leaves unset (null).

Batch limits follow vLLM's `EngineArgs.get_batch_defaults` (0.32/0.33): they depend on the device
and on the entry point. `serve` is `vllm serve` (the OpenAI-compatible server), `offline` the
`LLM` class. CPU devices use vLLM's CPU-backend values. Prefix caching is on, as in vLLM, except
with KV eviction policies or per-head layouts, whose evicted tokens break shared prefix blocks.
Async scheduling is on for GPUs and off for CPUs (vLLM's CPU engine forces it off).
"""
from __future__ import annotations

import os
import warnings

from .catalog import get_gpu, get_model
from ..config import ConfigError, EngineConfig, SimConfig

GiB = 2**30
# vLLM's switch (vllm/envs.py) that lets max_model_len exceed the model's max_position_embeddings
ALLOW_LONG_MAX_MODEL_LEN = "VLLM_ALLOW_LONG_MAX_MODEL_LEN"


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
    if eng.max_model_len is not None:
        check_max_model_len(eng.max_model_len, get_model(cfg.model))
    tokens, seqs = batch_defaults(gpu, eng.entry_point, cfg.tp)
    if not eng.enable_chunked_prefill and eng.max_num_batched_tokens is None:
        max_model_len = eng.max_model_len or get_model(cfg.model).max_model_len
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


def check_max_model_len(max_model_len: int, model) -> None:
    """As vLLM: a max_model_len above the model's max_position_embeddings is refused unless
    VLLM_ALLOW_LONG_MAX_MODEL_LEN is 1 or true, and then only warned about (positions past the trained
    ones give wrong outputs on a real model; the simulation prices them as any other)."""
    if max_model_len <= model.max_position:
        return
    what = (f"engine.max_model_len (--max-model-len) {max_model_len} is above {model.name}'s max_position_embeddings "
            f"({model.max_position})")
    if os.environ.get(ALLOW_LONG_MAX_MODEL_LEN, "0").strip().lower() in ("1", "true"):
        warnings.warn(f"{what}, allowed by {ALLOW_LONG_MAX_MODEL_LEN}=1 as in vLLM: a real model's outputs past "
                      f"position {model.max_position} are not to be trusted", UserWarning, stacklevel=2)
        return
    raise ConfigError(f"{what}; vLLM refuses it (wrong outputs past the trained positions) unless "
                      f"{ALLOW_LONG_MAX_MODEL_LEN}=1 is set: lower it to at most {model.max_position} or set the variable")
