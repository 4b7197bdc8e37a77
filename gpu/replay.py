"""Replay a trace on the real backend through the shared engine core; write simulate's outputs.

The trace runs in (simulated) time order through the same simpy engine, scheduler, KV manager and
policies as `kvsim simulate`; only the executor differs (`gpu.executor.RealExecutor`). Time is
*simulated from measurements*: each step advances the clock by its measured duration, and when the
engine is idle the clock jumps to the next arrival (idle gaps cost no wall time). Arrivals that
fall inside a step wait for it to end, exactly as in the simulator.

Outputs (in `out`): `requests.parquet`, `steps.parquet` (duration_s measured, predicted_s from
the cost model with the configured profile), `summary.json`, `config.yaml` — the schemas of
`kvsim simulate` — plus `tokens.parquet` (prompt and greedy output ids per request),
`decisions.parquet` and `attention_stats.parquet` (the recorded format of `sim.kv.importance`).
Ctrl-C stops the replay and still writes all of them for what ran so far (`summary["partial"]`).

torch and the gpu modules that load it are imported inside the functions that need them: importing
this module (for its options and errors) stays cheap.
"""
from __future__ import annotations

import gc
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import NamedTuple
from collections.abc import Callable

import numpy as np
import pandas as pd

from kvsim.sim.engine.assembly import build_engine, load_workload, trace_to_requests
from kvsim.sim.model.catalog import get_model, normalize_dtype
from kvsim.sim.config import ConfigError, SimConfig
from kvsim.sim.core.request import Request
from kvsim.sim.engine.loop import EngineReplica
from kvsim.sim.kv.manager import EvictingKVManager
from kvsim.sim.kv.state import PRECISION_FULL
from kvsim.sim.model.memory import HostMemoryError, RunMemoryEstimate, check_memory
from kvsim.sim.results.metrics import StepLog, add_client_queue, request_table
from kvsim.sim.results.outputs import run_summary, write_outputs
from kvsim.sim.io.result_dirs import ResultDir
from kvsim.sim.engine.resolved_run import build_kv_manager, resolve_run

DTYPES = ("float32", "float16", "bfloat16")
WEIGHTS = ("smollm2", "random")


@dataclass
class ReplayOptions:
    device: str = "cpu"                  # cpu | cuda | cuda:N
    weights: str = "smollm2"             # smollm2 (the real GGUF) | random (any catalog shape)
    dtype: str | None = None             # weights and KV cache; default float32 on cpu, bfloat16 on cuda
    layers: int | None = None            # keep only the first N layers (quick runs)
    attention_stats: bool = True         # record attention statistics at the end of every prefill
    stats_window: int = 32               # queries observed for them (the policy's obs_window if it needs scores)
    clock: str = "wall"                  # step timer: wall | cpu (the thread's CPU time; device cpu, 1 torch thread)
    overwrite: bool = False              # write into a non-empty --out kvsim did not create (sim/io/result_dirs.py)


@dataclass
class ReplayResult:
    summary: dict
    requests: pd.DataFrame
    steps: pd.DataFrame
    tokens: pd.DataFrame
    decisions: pd.DataFrame
    attention_stats: pd.DataFrame
    out_dir: Path | None
    partial: bool
    executor: object = field(repr=False, default=None)


def resolve_device(device: str):
    import torch
    try:
        dev = torch.device(device)
    except RuntimeError:            # torch lists its own two dozen device types: only two run a replay
        raise ConfigError(f"--device must be cpu or cuda[:N], got {device!r}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"--device {device}: CUDA is not available on this machine (torch {torch.__version__})")
    if dev.type not in ("cpu", "cuda"):
        raise ConfigError(f"--device must be cpu or cuda[:N], got {device!r}")
    return dev


def torch_dtype(name: str | None, device):
    import torch
    name = name or ("float32" if device.type == "cpu" else "bfloat16")
    if name not in DTYPES:
        raise ConfigError(f"--dtype must be one of {DTYPES}, got {name!r}")
    return getattr(torch, name)


def model_spec_for(config, base, dtype):
    """The catalog spec of the model actually run: shape from the real model, weight/activation/KV dtypes
    from the real tensors (so predicted_s prices the bytes the replay really moves)."""
    dt = normalize_dtype(str(dtype).removeprefix("torch."))
    return base.model_copy(update={
        "num_layers": config.layers, "hidden_size": config.hidden, "num_heads": config.heads,
        "num_kv_heads": config.kv_heads, "head_dim": config.head_dim, "intermediate_size": config.intermediate,
        "vocab_size": config.vocab, "weight_dtype": dt, "activation_dtype": dt, "kv_dtype": dt,
        "embedding_dtype": None,
        "name": base.name if config.layers == base.num_layers else f"{base.name} ({config.layers} layers)"})


def build_model(cfg: SimConfig, opts: ReplayOptions):
    """The real model: SmolLM2 from the GGUF, or seeded random weights at the catalog shape of cfg.model."""
    from kvsim.gpu.model import LlamaModel, ModelConfig

    device = resolve_device(opts.device)
    dtype = torch_dtype(opts.dtype, device)
    if opts.weights not in WEIGHTS:
        raise ConfigError(f"--weights must be one of {WEIGHTS}, got {opts.weights!r}")
    if opts.weights == "smollm2":
        spec = get_model(cfg.model)
        if spec.name != get_model("smollm2-135m").name:
            raise ConfigError(f"--weights smollm2 runs SmolLM2-135M but --model is {cfg.model!r}; use "
                              f"--model smollm2-135m, or --weights random for other shapes")
        from kvsim.gpu.weights import load_smollm2
        model = load_smollm2(device=str(device), dtype=dtype)
    else:
        spec = get_model(cfg.model)
        check_dense(spec)
        check_layers(opts.layers, spec.num_layers)
        config = ModelConfig(layers=opts.layers or spec.num_layers, hidden=spec.hidden_size, heads=spec.num_heads,
                             kv_heads=spec.num_kv_heads, head_dim=spec.head_dim,
                             intermediate=spec.intermediate_size, vocab=spec.vocab_size,
                             tied=spec.tied_embeddings, name=spec.name)
        check_random_weights_fit(config, device, dtype)
        # only the layers it runs (the full model's first ones): the whole of a 70B was built for --layers 2
        return LlamaModel.random(config, seed=cfg.seed, device=str(device), dtype=dtype)
    if opts.layers is not None:
        check_layers(opts.layers, model.config.layers)
        model = model.truncated(opts.layers)
    return model


def check_random_weights_fit(config, device, dtype) -> None:
    """Refuse random weights that do not fit before drawing them: they are drawn in host memory (one
    float32 tensor at a time, then kept at `dtype`), then moved to `device`."""
    import torch
    from kvsim.gpu.model import random_weight_params

    params = random_weight_params(config)
    size = params * torch.empty(0, dtype=dtype).element_size()
    largest = 4 * max(config.vocab, config.intermediate, config.heads * config.head_dim) * config.hidden
    check_memory(RunMemoryEstimate((("random weights", f"{params / 1e9:.2f} B parameters of {config.name}, "
                                     f"{config.layers} layers", "--layers", size + largest),)))
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        if size > free:
            raise HostMemoryError(f"--weights random: {config.name}'s {config.layers} layers need {size / 2**30:.1f} "
                                  f"GiB on {device} but {free / 2**30:.1f} GiB is free; lower --layers")


def check_layers(layers: int | None, total: int) -> None:
    if layers is not None and not 1 <= layers <= total:
        raise ConfigError(f"--layers must be between 1 and {total}, got {layers}")


def check_dense(spec) -> None:
    """Random weights build a dense Llama-architecture decoder: refuse a shape it would misrepresent."""
    kinds = [what for what, present in (
        (f"a mixture of experts ({spec.num_experts} experts)", spec.num_experts),
        ("multi-head latent attention", spec.kv_lora_rank),
        (f"sliding-window attention ({spec.sliding_window} tokens)", spec.sliding_window)) if present]
    if kinds:
        raise ConfigError(f"--weights random: {spec.name} uses {' and '.join(kinds)}; the real backend runs dense "
                          "Llama-architecture decoders only (docs/models.md: the simulator models these)")


def replay_config(cfg: SimConfig) -> SimConfig:
    """`cfg` with the engine settings a replay runs with (resolve_run resolves the other defaults):
    the real backend steps synchronously, and its per-request prompts share no prefixes, so prefix
    caching is off unless asked for."""
    eng = cfg.engine.model_copy(update={
        "async_scheduling": False,
        "enable_prefix_caching": bool(cfg.engine.enable_prefix_caching)})
    return cfg.model_copy(deep=True, update={"engine": eng})


def check_replayable(cfg: SimConfig) -> None:
    eng = cfg.engine
    problems = []
    if cfg.replicas != 1:
        problems.append(f"replicas={cfg.replicas}: the real backend runs one engine replica")
    if cfg.tp != 1:
        problems.append(f"tp={cfg.tp}: the real backend runs on one device")
    if cfg.speculative_config is not None:
        problems.append("speculative_config: the real backend has no drafter; speculative decoding is simulated only")
    if eng.preemption_mode != "recompute":
        problems.append("engine.preemption_mode=swap: swapping KV to host memory is not implemented; use recompute")
    if eng.enable_prefix_caching:
        problems.append("engine.enable_prefix_caching: replay prompts are generated per request, so shared "
                        "prefixes hold no shared tokens")
    if cfg.kv.mode != "token":
        problems.append("kv.mode=fast: the real backend needs token-level KV state")
    if problems:
        raise ConfigError("cannot replay this config: " + "; ".join(problems))


def prompt_ids_for(seed: int, vocab: int) -> Callable[[Request], list[int]]:
    """Real-text prompt ids (gpu.prompts) of the trace's length, seeded by (seed, request id)."""
    from kvsim.gpu.prompts import corpus_token_ids, prompt_token_ids

    corpus_token_ids()       # tokenize the corpus once, up front

    def ids(req: Request) -> list[int]:
        s = int(np.random.SeedSequence([seed, req.request_id]).generate_state(1)[0])
        toks = prompt_token_ids(req.prompt_tokens, s)
        return [t % vocab for t in toks] if max(toks) >= vocab else toks
    return ids


def default_num_blocks(cfg: SimConfig, model, layout: str, device, dtype) -> int:
    """KV pool that fits the free device memory (CUDA) times gpu_memory_utilization."""
    import torch
    from kvsim.gpu.cache import PagedKVCache

    if device.type != "cuda":
        raise ConfigError("--num-gpu-blocks (engine.num_gpu_blocks) is required on cpu: say how many KV blocks "
                          "the replay may use (small pools create memory pressure)")
    free, total = torch.cuda.mem_get_info(device)
    budget = free - (1 - cfg.engine.gpu_memory_utilization) * total
    c = model.config
    per_block = PagedKVCache.bytes_per_block("shared", c.layers, c.kv_heads, c.head_dim, cfg.engine.block_size, dtype)
    blocks = int(budget // per_block)
    if blocks < 1:
        raise ConfigError(f"no room for a KV cache on {device}: {free / 2**30:.1f} GiB free")
    return blocks


def check_replay_memory(plan, model) -> None:
    """Refuse a pool that does not fit before anything of its size is allocated: the KV manager's
    host structures plus the cache tensor (host memory on cpu, device memory on cuda)."""
    import torch
    from kvsim.gpu.cache import PagedKVCache

    c, num_blocks = model.config, plan.num_blocks
    cache = num_blocks * PagedKVCache.bytes_per_block("shared", c.layers, c.kv_heads, c.head_dim,
                                                      plan.cfg.engine.block_size, model.dtype)
    estimate = plan.memory
    if model.device.type == "cpu":
        estimate = RunMemoryEstimate(estimate.parts + (
            ("KV cache tensor", f"{num_blocks} blocks x {cache // max(num_blocks, 1)} B", "--num-gpu-blocks",
             cache),))
    check_memory(estimate)
    if model.device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(model.device)
        if cache > free:
            raise HostMemoryError(f"--num-gpu-blocks {num_blocks}: the KV cache needs {cache / 2**30:.1f} GiB "
                                  f"but {free / 2**30:.1f} GiB is free on {model.device}; lower --num-gpu-blocks")


def build_cache(cfg: SimConfig, model, kv):
    """The paged KV cache the manager's pages describe: full precision, or LeanKV's mixed-precision
    pages when the policy writes tokens at a precision group (pages of one full-precision block's bytes)."""
    import torch
    from kvsim.gpu.cache import PagedKVCache, PrecisionGroupKVCache

    c, bs = model.config, cfg.engine.block_size
    if not (isinstance(kv, EvictingKVManager) and kv.new_token_precision != PRECISION_FULL):
        return PagedKVCache.for_model(c, cfg.kv.layout, kv.pool.num_blocks, bs, dtype=model.dtype, device=model.device)
    full_bytes = 2 * c.head_dim * torch.empty(0, dtype=model.dtype).element_size()
    return PrecisionGroupKVCache.for_model(c, cfg.kv.layout, kv.pool.num_blocks, bs, full_bytes,
                                   precisions=(cfg.kv.high_tier, cfg.kv.low_tier), device=model.device)


def run_replay(cfg: SimConfig, out_dir: str | Path | None = None, *, options: ReplayOptions | None = None,
               model=None, trace=None, progress: bool = False, on_step: Callable[[EngineReplica], None] | None = None,
               check_cache: bool | None = None) -> ReplayResult:
    """Replay `cfg.trace` (or `trace`) on the real model (built from `options`, or the given `model`).

    `on_step(replica)` runs after every engine step (the progress hook; a KeyboardInterrupt raised
    anywhere during the replay ends it with a partial result). `check_cache` (default:
    `cfg.check_invariants`) asserts every step that the cache's live mask equals the KV manager's state.
    """
    from kvsim.gpu.executor import ExecutorOptions, RealExecutor, ReplayRecorder

    t0 = time.perf_counter()
    opts = options or ReplayOptions()
    cfg = replay_config(cfg)
    check_replayable(cfg)
    trace = load_workload(cfg) if trace is None else trace
    model = build_model(cfg, opts) if model is None else model
    spec = model_spec_for(model.config, get_model(cfg.model), model.dtype)
    cfg.kv_dtype = None           # the cache holds the model's dtype
    if cfg.engine.num_gpu_blocks is None:
        cfg.engine.num_gpu_blocks = default_num_blocks(cfg, model, cfg.kv.layout, model.device, model.dtype)
    plan = resolve_run(cfg, trace=trace, model=spec)
    check_replay_memory(plan, model)
    kv = build_kv_manager(plan)
    # A previous replay's KV cache sits in reference cycles (engine, simpy generators) until a full
    # collection: collect it now, or that collection lands inside this replay's first steps, frees
    # ~1 GB there and the allocator faults in fresh pages (measured: 515k page faults, +15-30% on the
    # first prefill of every second replay in a process).
    gc.collect()
    cache = build_cache(plan.cfg, model, kv)
    recorder = ReplayRecorder()
    executor = RealExecutor(model, cache, kv, plan.cost, prompt_ids=prompt_ids_for(cfg.seed, model.config.vocab),
                            recorder=recorder, options=ExecutorOptions(
                                stats_window=opts.stats_window if opts.attention_stats else 0,
                                check_cache=cfg.check_invariants if check_cache is None else check_cache,
                                clock=opts.clock))
    requests = trace_to_requests(trace)
    executor.warm_up(_largest_chunk(plan, requests))
    staging = ResultDir(out_dir, overwrite=opts.overwrite) if out_dir else None    # published at the end
    try:
        return _replay(plan, ReplayRun(opts, staging, requests, trace, model, executor, recorder, t0),
                       progress, on_step)
    finally:
        if staging:
            staging.discard()


def _largest_chunk(plan, requests: list[Request]) -> int:
    """The largest prefill chunk the replay can schedule (the warm-up's size)."""
    eng = plan.cfg.engine
    chunk = min(max((r.prompt_tokens for r in requests), default=2), eng.max_num_batched_tokens, plan.max_model_len)
    return min(chunk, eng.long_prefill_token_threshold) if eng.long_prefill_token_threshold > 0 else chunk


class ReplayRun(NamedTuple):
    """What a replay runs besides its plan: the workload, the real model and its executor."""
    opts: ReplayOptions
    staging: ResultDir | None
    requests: list
    trace: object
    model: object
    executor: object
    recorder: object
    t0: float


def _replay(plan, run: ReplayRun, progress, on_step) -> ReplayResult:
    cfg, opts, staging, requests, executor = plan.cfg, run.opts, run.staging, run.requests, run.executor
    out = staging.path if staging else None
    step_log = StepLog(out / "steps.parquet" if out else None)
    bar = _progress_bar(len(requests)) if progress else None
    replicas: list[EngineReplica] = []

    def stepped(n: int) -> None:
        replica = replicas[0]
        if bar is not None:
            done = len(replica.scheduler.finished) + len(replica.scheduler.rejected)
            bar.update(done - bar.n)
            bar.set_postfix_str(f"step {replica.num_steps}, sim {replica.now:.2f}s", refresh=False)
        if on_step is not None:
            on_step(replica)

    engine = build_engine(plan, requests, step_log, lambda i: (executor.kv, executor), on_step=stepped)
    replicas.extend(engine.replicas)
    try:
        stop = engine.drive(catch=(KeyboardInterrupt,))
    finally:
        if bar is not None:
            bar.close()
        step_log.close()
    partial = stop is not None
    arrived = engine.arrived(requests)
    req_df = request_table(arrived)
    if engine.limit is not None:
        add_client_queue(req_df, engine.limit.client_arrival)
    steps_df = step_log.to_pandas()
    summary = run_summary(plan, req_df, steps_df, [executor.kv])
    summary.update(_replay_summary(cfg, opts, run.model, steps_df, executor, partial, replicas[0].now,
                                   len(requests)))
    if partial:
        summary["partial_reason"] = stop[0]          # "interrupted (Ctrl-C)" or "terminated (SIGTERM)"
    summary["wall_s"] = time.perf_counter() - run.t0
    tokens = _tokens_table(arrived)
    decisions, stats = run.recorder.decisions_table(), run.recorder.stats_table()
    if out:
        write_outputs(out, cfg, req_df, summary)
        tokens.to_parquet(out / "tokens.parquet", index=False)
        decisions.to_parquet(out / "decisions.parquet", index=False)
        stats.to_parquet(out / "attention_stats.parquet", index=False)
        published = staging.publish(partial=partial)
    return ReplayResult(summary, req_df, steps_df, tokens, decisions, stats, published if out else None,
                        partial, executor)


def _replay_summary(cfg, opts: ReplayOptions, model, steps: pd.DataFrame, executor, partial: bool, now: float,
                    num_trace_requests: int) -> dict:
    import torch
    measured = float(steps["duration_s"].sum()) if len(steps) else 0.0
    predicted = float(steps["predicted_s"].sum()) if len(steps) else 0.0
    s = {
        "backend": "real", "partial": partial, "simulated_time_s": now,
        "num_trace_requests": num_trace_requests,
        "measured_step_time_s": measured, "predicted_step_time_s": predicted,
        "prediction_error": (predicted - measured) / measured if measured > 0 else float("nan"),
        "device": str(model.device), "dtype": str(model.dtype).removeprefix("torch."),
        "device_name": torch.cuda.get_device_name(model.device) if model.device.type == "cuda" else "cpu",
        "model_layers": model.config.layers, "weights": opts.weights,
        "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
        "load_avg_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan"),
        "replay": asdict(opts),
    }
    s.update({f"time_{k}": v for k, v in executor.times.items()})
    return s


def _tokens_table(requests: list[Request]) -> pd.DataFrame:
    rows = []
    for r in requests:
        toks = r.gpu_tokens or []
        rows.append({"request_id": r.request_id, "prompt_token_ids": toks[:r.prompt_tokens],
                     "output_token_ids": toks[r.prompt_tokens:]})
    df = pd.DataFrame(rows, columns=["request_id", "prompt_token_ids", "output_token_ids"])
    return df.sort_values("request_id", kind="stable").reset_index(drop=True)


def _progress_bar(total: int):
    from tqdm import tqdm
    return tqdm(total=total, unit="req", desc="replaying", mininterval=0.5)
