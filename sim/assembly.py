"""Assemble a run's engine core from a SimConfig: its requests, hardware, KV pool and scheduler config.

Shared by the two executors' drivers: the simulator (`sim.simulate`) and the real backend's replay
(`gpu.replay`); the KV manager of a replica comes from `sim.kv.build.build_kv_manager`.
"""
from __future__ import annotations

import warnings

from kvsim.traces import TraceWarning, load_trace
from kvsim.traces.arrivals import vllm_bench_arrivals

from .catalog import get_gpu, get_model
from .config import ConfigError, SimConfig
from .core.request import Request
from .core.scheduler import SchedulerConfig
from .cost_model import CostModel, load_profile
from .defaults import resolve_engine
from .memory import RunMemoryEstimate, check_memory, check_pool_fits_gpu, estimate_run_memory, num_gpu_blocks


def load_workload(cfg: SimConfig):
    """The trace of `cfg` with its trace options (rate, window, rate scale, first N requests) applied."""
    opts = cfg.trace_options
    # without a time window the first N requests are the file's first N (only those rows are read)
    first = opts.max_requests if opts.start_s is None and opts.end_s is None else None
    trace = load_trace(cfg.trace, max_rows=first, **({"rate": opts.rate} if opts.rate else {}), seed=cfg.seed,
                       **trace_file_options(opts))
    if opts.start_s is not None or opts.end_s is not None:
        trace = trace.window(opts.start_s or 0.0, opts.end_s if opts.end_s is not None else float("inf"))
    if opts.max_requests is not None:
        trace = trace.head(opts.max_requests)
    if opts.request_rate is not None:
        trace = with_request_rate(trace, opts.request_rate, opts.burstiness, cfg.seed)
    elif opts.max_concurrency is None and opts.rate is None and opts.arrival_unit == "time" and len(trace) > 1 and not _has_arrival_times(trace):
        warnings.warn(f"all {len(trace)} requests arrive at t=0 (the trace has no arrival times): one batch, as "
                      "vllm bench serve's default --request-rate inf; --request-rate or --max-concurrency give "
                      "another load", TraceWarning, stacklevel=2)
    if opts.rate_scale != 1.0:
        trace = trace.scale_rate(opts.rate_scale)
    return trace


def trace_file_options(opts) -> dict:
    """load_trace's format and reader options from `trace_options` (only those given)."""
    out = {"format": opts.format} if opts.format else {}
    if opts.format in ("csv", "jsonl", "parquet"):
        out.update(columns=opts.columns, time_unit=opts.time_unit)
    if opts.tokenizer is not None:
        out["tokenizer"] = opts.tokenizer
    return out


def with_request_rate(trace, request_rate: float, burstiness: float, seed: int):
    """`trace`'s requests sent as `vllm bench serve --request-rate --burstiness` sends them. Only for a
    trace without arrival times of its own (every request at t=0: length-only files, ShareGPT)."""
    if _has_arrival_times(trace):
        raise ConfigError(f"trace_options.request_rate: the trace {trace.name or trace.source!r} has its own "
                          "arrival times; request_rate applies to traces without them (length-only, ShareGPT); "
                          "use rate_scale (--rate-scale) to speed this one up")
    return trace.with_arrivals(vllm_bench_arrivals(len(trace), request_rate, burstiness, seed))


def _has_arrival_times(trace) -> bool:
    arrivals = trace.df["arrival_time_s"].to_numpy()
    return len(arrivals) > 0 and arrivals.max() > arrivals.min()


def trace_to_requests(trace, entry=None) -> list[Request]:
    """The trace's requests; with `entry` (sim.client.RequestEntry) each enters the engine when the
    client-side API server lets it, after its arrival (the client's send)."""
    df = trace.df
    ids = df["prefix_hash_ids"].tolist() if "prefix_hash_ids" in df else [None] * len(df)
    prio = df["priority"].tolist() if "priority" in df else [0] * len(df)
    span = trace.prefix_block_tokens
    return [
        Request(request_id=int(rid), arrival_time=float(t) if entry is None else entry.enter(int(rid), float(t)),
                prompt_tokens=int(p), max_output_tokens=int(o),
                priority=int(pr) if pr == pr and pr is not None else 0,
                prefix_hash_ids=tuple(int(x) for x in h) if h is not None and len(h) else None,
                prefix_block_tokens=span)
        for rid, t, p, o, h, pr in zip(df["request_id"].tolist(), df["arrival_time_s"].tolist(),
                                       df["prompt_tokens"].tolist(), df["output_tokens"].tolist(), ids, prio)
    ]


def resolve_hardware(cfg: SimConfig, model=None):
    """(model spec, GPU spec, cost model, KV pool blocks, max_model_len); `model` overrides `cfg.model`
    (the real backend passes the spec of the model it actually runs)."""
    model = get_model(cfg.model) if model is None else model
    if cfg.kv_dtype or cfg.weight_dtype:
        model = model.with_dtypes(kv_dtype=cfg.kv_dtype, weight_dtype=cfg.weight_dtype)
    gpu = get_gpu(cfg.gpu)
    eng = resolve_engine(cfg)
    try:
        cost = CostModel(model, gpu, load_profile(cfg.profile, gpu=gpu), tp=cfg.tp,
                         async_scheduling=bool(eng.async_scheduling), expert_parallel=eng.enable_expert_parallel)
    except ValueError as exc:
        if "--enable-expert-parallel" not in str(exc):
            raise
        raise ConfigError(str(exc).replace("--enable-expert-parallel", "engine.enable_expert_parallel")) from None
    if eng.num_gpu_blocks is not None:
        blocks = eng.num_gpu_blocks
        check_pool_fits_gpu(model, gpu, tp=cfg.tp, num_blocks=blocks, block_size=eng.block_size)
    else:
        blocks = num_gpu_blocks(model, gpu, tp=cfg.tp, block_size=eng.block_size,
                                gpu_memory_utilization=eng.gpu_memory_utilization,
                                max_num_batched_tokens=eng.max_num_batched_tokens,
                                max_num_seqs=eng.max_num_seqs).num_blocks
    max_model_len = eng.max_model_len or model.max_position
    return model, gpu, cost, blocks, max_model_len


def scheduler_config(cfg: SimConfig, cost, max_model_len: int) -> SchedulerConfig:
    eng = cfg.engine
    return SchedulerConfig(
        max_num_seqs=eng.max_num_seqs, max_num_batched_tokens=eng.max_num_batched_tokens,
        long_prefill_token_threshold=eng.long_prefill_token_threshold, max_model_len=max_model_len,
        enable_chunked_prefill=eng.enable_chunked_prefill, policy=eng.scheduling_policy,
        preemption_mode=eng.preemption_mode, async_scheduling=bool(eng.async_scheduling),
        swap_space_tokens=int(eng.swap_space_gib * 2**30 // max(cost.kv_bytes_per_token, 1)))


def check_config_memory(cfg, trace=None) -> RunMemoryEstimate:
    """Estimate and check the host memory of a simulation of `cfg` (resolving its model, GPU and pool
    size) before running it: the bound `kvsim simulate` applies, for other front ends (the
    dashboard). Raises HostMemoryError (a ValueError) when it does not fit; returns the estimate."""
    model, _, cost, num_blocks, _ = resolve_hardware(cfg)
    estimate = estimate_run_memory(cfg, model, cost, num_blocks, trace)
    check_memory(estimate)
    return estimate
