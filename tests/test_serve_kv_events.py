"""kvsim serve's KV events and client aborts, over real sockets: an in-process server (uvicorn on this test's
event loop) with vLLM's ZMQ KV-event publisher on, a real ZMQ SUB client decoding the events with msgspec into
vLLM's structs, and raw HTTP clients (one of them hangs up mid-stream).

- The events replayed in order rebuild exactly the engine's prefix-cache index (hash -> stored), a second
  request sharing a prompt prefix stores only its own blocks, chained to the first one's (its parent is the
  first request's last shared block), the token ids are the prompts', and under a tiny KV pool the evicted
  blocks arrive as BlockRemoved.
- A client that closes its connection after a few tokens aborts its request as vLLM does: it leaves the
  engine long before its max_tokens, its KV blocks are freed, /metrics counts it under finished_reason="abort"."""
from __future__ import annotations

import asyncio
import json
import random
import sys

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
zmq = pytest.importorskip("zmq")
msgspec = pytest.importorskip("msgspec")
import uvicorn  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from kvsim.sim.cli import app as cli_app  # noqa: E402
from kvsim.sim.config import load_config  # noqa: E402
from kvsim.sim.core.request import RequestStatus  # noqa: E402
from kvsim.sim.engine.resolved_run import resolve_run  # noqa: E402
from kvsim.sim.serve.app import ServeOptions, Server, build_app  # noqa: E402
from kvsim.sim.serve.kv_events import KVEventsConfig  # noqa: E402
from kvsim.sim.serve.client import free_port  # noqa: E402

MODEL = "llama-3.1-8b"
BLOCK = 16


# vLLM's structs as its example subscriber (examples/online_serving/kv_events_subscriber.py) declares them
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


# vLLM main's newer form (maps, a "type" tag field), as vllm/distributed/kv_events.py declares it there
class MapBatch(msgspec.Struct, omit_defaults=True, gc=False):
    ts: float
    events: list
    data_parallel_rank: int | None = None


class MapEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class MapStored(MapEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class MapRemoved(MapEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


class MapCleared(MapEvent, tag="AllBlocksCleared"):
    pass


class MapKVEventBatch(MapBatch):
    events: list[MapStored | MapRemoved | MapCleared]


async def _start(sets: dict, kv_events: KVEventsConfig | None = None, time_scale: float = 20.0):
    plan = resolve_run(load_config(None, {"model": MODEL, **sets}))
    server = Server(plan, ServeOptions(MODEL, time_scale, eos_tokens=4, kv_events=kv_events))
    port = free_port()
    uv = uvicorn.Server(uvicorn.Config(build_app(server), host="127.0.0.1", port=port, log_level="warning",
                                       access_log=False, lifespan="on"))
    task = asyncio.create_task(uv.serve())
    for _ in range(600):
        if uv.started:
            break
        await asyncio.sleep(0.01)
    assert uv.started, "the server did not start"
    return server, uv, task, port


async def _stop(uv, task) -> None:
    uv.should_exit = True
    await asyncio.wait_for(task, 30)


async def _post(port: int, body: dict) -> tuple[int, bytes]:
    """A whole HTTP/1.1 exchange over a raw socket: (status, body)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    data = json.dumps(body).encode()
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Connection: close\r\nContent-Length: " + str(len(data)).encode() + b"\r\n\r\n" + data)
    await writer.drain()
    raw = await reader.read()
    writer.close()
    head, _, rest = raw.partition(b"\r\n\r\n")
    return int(head.split()[1]), rest


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 40000) for _ in range(n)]


@pytest.mark.parametrize("publisher_binds, encoding", [(True, "array"), (False, "array"), (True, "map")])
def test_kv_events_rebuild_the_engines_prefix_cache(publisher_binds, encoding):
    endpoint_port = free_port()
    rng = random.Random(11)
    shared = _prompt(rng, 10 * BLOCK)                  # ten full blocks of a shared system prompt
    first = shared + _prompt(rng, 3 * BLOCK + 5)
    second = shared + _prompt(rng, 2 * BLOCK + 7)
    fillers = [_prompt(rng, 28 * BLOCK) for _ in range(3)]     # each nearly fills the pool: evictions

    async def run():
        # 40 blocks (39 usable): a filler's 28 blocks evict what earlier requests left cached
        # subscribed before the server starts (ZMQ connects when it can): the handshake overlaps its start-up. A
        # wildcard endpoint: the server binds, the subscriber connects; a host's: the server connects to it (vLLM's rule)
        ctx = zmq.Context()
        if publisher_binds:
            sub = ctx.socket(zmq.SUB)
            sub.connect(f"tcp://127.0.0.1:{endpoint_port}")
            sub.setsockopt(zmq.SUBSCRIBE, b"kv")
            endpoint = f"tcp://*:{endpoint_port}"
        else:
            # a bound subscriber (llm-d's indexer binds): an XSUB that subscribes once the server has connected
            # (this machine's libzmq 4.3.5 does not pass a bound SUB's subscription to a PUB that connects later)
            sub = ctx.socket(zmq.XSUB)
            sub.bind(f"tcp://127.0.0.1:{endpoint_port}")
            endpoint = f"tcp://127.0.0.1:{endpoint_port}"
        server, uv, task, port = await _start({"engine.num_gpu_blocks": 40, "engine.enable_prefix_caching": True},
                                              KVEventsConfig(endpoint=endpoint, topic="kv", encoding=encoding))
        assert server.kv_publisher.binds == publisher_binds
        if not publisher_binds:
            await asyncio.sleep(0.3)
            sub.send(b"\x01kv")
        await asyncio.sleep(0.5)                       # ZMQ's slow joiner: the subscription reaches the publisher
        try:
            for prompt in (first, second, *fillers):
                status, body = await _post(port, {"model": MODEL, "prompt": prompt, "max_tokens": 3,
                                                  "ignore_eos": True})
                assert status == 200, body
            engine = server.engine
            kv = engine.replicas[0].kv
            index = dict(kv.pool.cached)               # the engine's prefix-cache index: hash -> block
            hits = kv.prefix_lookups
        finally:
            await _stop(uv, task)                      # publishes what is left, closes the socket
        frames = []
        while sub.poll(200):
            frames.append(sub.recv_multipart())
        sub.close(linger=0)
        ctx.term()
        return frames, index, hits

    frames, index, hits = asyncio.run(run())
    assert frames, "no KV event received"
    decoder = msgspec.msgpack.Decoder(KVEventBatch if encoding == "array" else MapKVEventBatch)
    stored_type = BlockStored if encoding == "array" else MapStored
    removed_type = BlockRemoved if encoding == "array" else MapRemoved
    raw = msgspec.msgpack.decode(frames[0][2])
    assert isinstance(raw, list if encoding == "array" else dict)
    seqs = [int.from_bytes(f[1], "big") for f in frames]
    assert all(f[0] == b"kv" and len(f) == 3 and len(f[1]) == 8 for f in frames)
    assert seqs == list(range(len(frames))), "sequence numbers count batches from 0, without gaps"
    stored_runs, removed, live = [], [], {}
    for f in frames:
        batch = decoder.decode(f[2])
        assert batch.data_parallel_rank == 0 and batch.ts > 0
        for ev in batch.events:
            if isinstance(ev, stored_type):
                assert ev.block_size == BLOCK and ev.medium == "GPU" and ev.lora_id is None
                assert len(ev.token_ids) == BLOCK * len(ev.block_hashes)
                stored_runs.append(ev)
                for h in ev.block_hashes:
                    assert h not in live, "a hash stored twice without a removal"
                    live[h] = True
            else:
                assert isinstance(ev, removed_type)
                removed += ev.block_hashes
                for h in ev.block_hashes:
                    assert live.pop(h, None), "a hash removed that was not stored"
    # the events replayed rebuild the engine's prefix-cache index exactly
    assert set(live) == set(index)
    assert removed, "the tiny pool evicted cached blocks: BlockRemoved expected"

    a, b = stored_runs[0], stored_runs[1]
    assert a.parent_block_hash is None
    assert a.token_ids[:len(first) // BLOCK * BLOCK] == first[:len(first) // BLOCK * BLOCK]
    # the second prompt hit the ten shared blocks: it stored only its own, chained to the first's tenth block
    assert b.parent_block_hash == a.block_hashes[9]
    assert b.token_ids[:2 * BLOCK] == second[10 * BLOCK:12 * BLOCK]
    assert not set(b.block_hashes) & set(a.block_hashes)
    assert hits.hits > 0
    # the first request's blocks were all evicted by the fillers, and their hashes removed
    assert set(a.block_hashes) <= set(removed)


def test_clients_that_hang_up_abort_their_requests():
    async def run():
        server, uv, task, port = await _start({"engine.num_gpu_blocks": 2000}, time_scale=10.0)
        done = []
        server.engine.on_finished = done.append
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            data = json.dumps({"model": MODEL, "prompt": list(range(1000, 1400)), "max_tokens": 3000,
                               "ignore_eos": True, "stream": True}).encode()
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: " + str(len(data)).encode() + b"\r\n\r\n" + data)
            await writer.drain()
            got = b""
            while got.count(b"data: ") < 3:             # a few tokens, then hang up
                chunk = await asyncio.wait_for(reader.read(4096), 10)
                assert chunk, "the stream ended early"
                got += chunk
            writer.close()
            engine = server.engine
            for _ in range(500):
                if not engine.live:
                    break
                await asyncio.sleep(0.01)
            rep = engine.replicas[0]
            first = (dict(engine.live), dict(rep.kv.req_blocks), list(rep.scheduler.running),
                     rep.kv.pool.num_used_blocks, {k: list(v) for k, v in server.metrics.success.items()})
            # a non-streaming request whose client hangs up while it waits for the whole answer
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            data = json.dumps({"model": MODEL, "prompt": list(range(2000, 2300)), "max_tokens": 3000,
                               "ignore_eos": True}).encode()
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: " + str(len(data)).encode() + b"\r\n\r\n" + data)
            await writer.drain()
            await asyncio.sleep(0.3)
            writer.close()
            for _ in range(500):
                if len(done) == 2 and not engine.live:
                    break
                await asyncio.sleep(0.01)
            status, metrics = await _post_get(port, "/metrics")
            state = (first, (dict(engine.live), dict(rep.kv.req_blocks), rep.kv.pool.num_used_blocks,
                             dict(server.metrics.success)))
        finally:
            await _stop(uv, task)
        return done, state, metrics

    done, ((live, req_blocks, running, used, success), after), metrics = asyncio.run(run())
    assert not live
    req = done[0]
    assert req.status == RequestStatus.ABORTED and req.reject_reason == "client disconnected"
    # 3,000 tokens take ~20 simulated s (2 s wall): it left the engine long before
    assert 3 <= req.num_output_tokens < 3000
    assert not req_blocks and not running and used == 0, "its KV blocks were freed"
    assert success["abort"] == [1] and success["length"] == [0] and success["stop"] == [0]
    # the non-streaming one: aborted too, a few hundred ms (a few simulated s) in
    live, req_blocks, used, success = after
    assert len(done) == 2 and not live and not req_blocks and used == 0
    assert done[1].status == RequestStatus.ABORTED and 0 < done[1].num_output_tokens < 3000
    assert success["abort"] == [2] and success["length"] == [0]
    assert 'vllm:request_success_total{engine="0",finished_reason="abort",model_name="llama-3.1-8b"} 2.0' in metrics


async def _post_get(port: int, path: str) -> tuple[int, str]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
    await writer.drain()
    raw = await reader.read()
    writer.close()
    head, _, rest = raw.partition(b"\r\n\r\n")
    return int(head.split()[1]), rest.decode()


@pytest.mark.parametrize("args, message", [
    (["--kv-events-config", "{not json"], "--kv-events-config: not JSON"),
    (["--kv-events-config", '{"enable_kv_cache_events": true, "publisher": "nats"}'], "publisher 'nats'"),
    (["--kv-events-config", '{"enable_kv_cache_events": true, "endpont": "x"}'], "unknown field 'endpont'"),
    (["--kv-events-endpoint", "tcp://*:5557", "--kv-events-encoding", "json"], "--kv-events-encoding json"),
])
def test_bad_kv_events_options_fail_in_one_line(args, message):
    result = CliRunner().invoke(cli_app, ["serve", "--model", MODEL, *args])
    assert result.exit_code == 2 and message in result.output, result.output


def test_kv_events_without_the_extra_name_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "zmq", None)      # as if pyzmq were not installed
    result = CliRunner().invoke(cli_app, ["serve", "--model", MODEL, "--kv-events-endpoint", "tcp://*:5557"])
    assert result.exit_code == 2 and "kvsim[serve]" in result.output and "zmq" in result.output, result.output
    assert len(result.output.strip().splitlines()) == 1


@pytest.mark.parametrize("sets, message", [
    ({"engine.enable_prefix_caching": False}, "enable prefix caching"),
    ({"kv.policy": "h2o", "kv.budget": 256}, "expected KVCacheManager"),
])
def test_kv_events_need_the_prefix_cache_manager(sets, message):
    plan = resolve_run(load_config(None, {"model": MODEL, **sets}))
    with pytest.raises(ValueError, match=message):
        Server(plan, ServeOptions(MODEL, kv_events=KVEventsConfig(endpoint=f"tcp://127.0.0.1:{free_port()}")))
