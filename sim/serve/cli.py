"""`kvsim serve`: an OpenAI-compatible endpoint in front of the simulated engine (docs/serve.md)."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated

import typer

from kvsim.sim.config import ConfigError, TraceOptions, load_config

from kvsim.sim.cli.options import (BlockSize, Budget, ChunkedPrefill, ConfigFile, Gpu, MaxModelLen, MaxNumBatchedTokens,
                      MaxNumSeqs, Model, NumGpuBlocks, Policy, PrefixCaching, Profile, Replicas, Seed, Sets, Tp,
                      config_overrides, fail, output_path)


def serve(
    model: Model = None,
    gpu: Gpu = None,
    config: ConfigFile = None,
    tp: Tp = None,
    replicas: Replicas = None,
    router: Annotated[str | None, typer.Option(help="round_robin | least_outstanding")] = None,
    profile: Profile = None,
    block_size: BlockSize = None,
    num_gpu_blocks: NumGpuBlocks = None,
    max_num_seqs: MaxNumSeqs = None,
    max_num_batched_tokens: MaxNumBatchedTokens = None,
    prefix_caching: PrefixCaching = None,
    max_model_len: MaxModelLen = None,
    chunked_prefill: ChunkedPrefill = None,
    policy: Policy = None,
    budget: Budget = None,
    seed: Seed = None,
    set_: Sets = [],
    fast_forward: Annotated[bool | None, typer.Option(
        "--fast-forward/--no-fast-forward", help="advance pure-decode runs in bulk (identical token times)")] = None,
    host: Annotated[str, typer.Option(help="address to listen on")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port")] = 8000,
    time_scale: Annotated[float, typer.Option(
        help="simulated seconds per wall second (10: a run 10x faster than real time)")] = 1.0,
    served_model_name: Annotated[str | None, typer.Option(
        help="the model name clients send and /v1/models lists (default: --model)")] = None,
    tokenizer: Annotated[str | None, typer.Option(
        help="tokenizer.json (or its model directory) counting prompt tokens; default: the shipped SmolLM2 "
             "tokenizer (an approximation)")] = None,
    eos_tokens: Annotated[int, typer.Option(
        help="output tokens of a request without ignore_eos (the simulated model's end of sequence); "
             "max_tokens caps it")] = 128,
    stream_interval: Annotated[int, typer.Option(
        help="tokens gathered before a stream sends them (vLLM's --stream-interval; larger: less server CPU per "
             "token, coarser times)")] = 1,
    record_trace: Annotated[Path | None, typer.Option(
        parser=output_path("--record-trace"),
        help="write the requests received as a kvsim JSONL trace (kvsim simulate --trace FILE replays them)")] = None,
    kv_events_endpoint: Annotated[str | None, typer.Option(
        help="publish the prefix cache's KV events (block stored/removed) as vLLM does, on a ZMQ PUB socket: bound "
             "to tcp://*:PORT (or ipc://, inproc://), connected to tcp://HOST:PORT (needs the serve extra: pyzmq, "
             "msgspec)")] = None,
    kv_events_encoding: Annotated[str, typer.Option(
        help="array: the array-like msgpack structs of vLLM's example subscriber; map: vLLM main's newer form "
             "(maps, a \"type\" tag field, lora_name)")] = "array",
    kv_events_config: Annotated[str | None, typer.Option(
        help="vLLM's KV-events JSON: '{\"enable_kv_cache_events\": true, \"publisher\": \"zmq\", "
             "\"endpoint\": \"tcp://*:5557\", \"topic\": \"\"}' (--kv-events-endpoint overrides its endpoint)")] = None,
    overwrite: Annotated[bool, typer.Option(
        "--overwrite", help="replace an existing --record-trace file that is not a trace kvsim wrote (one it wrote "
                            "is replaced anyway)")] = False,
) -> None:
    """Serve the simulated engine behind an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions
    with streaming, /v1/models, /health, /version) and vLLM's Prometheus /metrics; the engine's clock runs
    with the wall clock (x --time-scale)."""
    overrides = config_overrides(
        model=model, gpu=gpu, tp=tp, replicas=replicas, router=router, profile=profile, seed=seed,
        fast_forward=fast_forward, block_size=block_size, num_gpu_blocks=num_gpu_blocks, max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens, prefix_caching=prefix_caching, max_model_len=max_model_len,
        chunked_prefill=chunked_prefill, policy=policy, budget=budget)
    if not 0 < time_scale < math.inf:
        fail(f"--time-scale {time_scale}: expected a finite number > 0 (simulated seconds per wall second)")
    if not 0 <= port <= 65535:
        fail(f"--port {port}: expected a TCP port 0..65535")
    if record_trace is not None:
        from kvsim.sim.io.safe_io import InputError, check_output_file
        from kvsim.traces.trace import written_by_kvsim
        try:       # before the server starts: a folder, a pipe or a user's own file (it would be emptied)
            check_output_file(record_trace, option="--record-trace", what="trace file", overwrite=overwrite,
                              written_by_kvsim=written_by_kvsim)
        except InputError as exc:
            fail(str(exc))
    if eos_tokens < 1:
        fail(f"--eos-tokens {eos_tokens}: expected at least 1")
    if stream_interval < 1:
        fail(f"--stream-interval {stream_interval}: expected at least 1 token")
    try:
        import uvicorn

        from kvsim.sim.serve.app import ServeOptions, Server, build_app
    except ImportError as exc:
        fail(f"kvsim serve needs {exc.name or 'its HTTP packages'}: pip install 'kvsim[serve]' (starlette, uvicorn, "
             "prometheus_client)")
    try:
        from kvsim.sim.serve.kv_events import check_installed, parse_kv_events_config
        kv_events = parse_kv_events_config(kv_events_config, kv_events_endpoint, kv_events_encoding)
        if kv_events is not None:
            check_installed()
    except ValueError as exc:
        fail(str(exc))
    except ImportError as exc:
        fail(f"{'--kv-events-config' if kv_events_config else '--kv-events-endpoint'}: {exc}")
    try:
        cfg = load_config(config, overrides, set_)
        check_serve_config(cfg)
        from kvsim.sim.engine.resolved_run import resolve_run
        plan = resolve_run(cfg)
        server = Server(plan, ServeOptions(served_model_name or cfg.model, time_scale, eos_tokens, tokenizer,
                                           record_trace, stream_interval, kv_events))
    except (ConfigError, ValueError, FileNotFoundError) as exc:
        fail(str(exc))
    typer.echo(f"kvsim serve: {cfg.model} on {cfg.tp}x {cfg.gpu} ({cfg.replicas} replica(s)), {plan.num_blocks} KV "
               f"blocks, max_model_len {plan.max_model_len}; http://{host}:{port}/v1 at {time_scale:g}x real time",
               err=True)
    uvicorn.run(build_app(server), host=host, port=port, log_level="warning", access_log=False)


def check_serve_config(cfg) -> None:
    """A served engine takes its requests from clients: a config's trace options would change nothing."""
    if cfg.trace_options != TraceOptions():
        raise ConfigError("trace_options: kvsim serve takes its requests from HTTP clients; remove the trace "
                          "options from the config (a load generator sets the arrivals)")
    if cfg.fleet is not None:
        raise ConfigError("fleet: kvsim serve runs one pool of replicas (--replicas); a disaggregated fleet is not "
                          "served yet: drop fleet (kvsim simulate runs it)")
    if cfg.kv_offload is not None:
        raise ConfigError("kv_offload: kvsim serve's engine has no CPU KV tier yet; drop kv_offload (kvsim simulate "
                          "runs it)")
    if cfg.speculative_config is not None:
        raise ConfigError("speculative_config: kvsim serve does not run speculative decoding yet; drop it (kvsim "
                          "simulate runs it)")
    if cfg.frontend_name != "none":
        raise ConfigError("client_latency / frontend: kvsim serve is a real HTTP server (its own latency is real); "
                          "set client_latency: false and drop frontend")
