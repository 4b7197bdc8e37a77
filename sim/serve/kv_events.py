"""vLLM's KV events from the simulated engine: the blocks its prefix cache stores and evicts, published as
vLLM publishes them (vllm/distributed/kv_events.py), for consumers such as llm-d's precise prefix-cache
scorer.

Wire format (vLLM's ZMQ publisher): a PUB socket bound to the endpoint (a wildcard, ipc or inproc one;
connected to any other, as vLLM does); each message is a multipart
[topic, sequence number (8 bytes, big-endian, from 0), payload], the payload a msgpack-encoded
`KVEventBatch(ts, events, data_parallel_rank)`: msgspec structs encoded as arrays, each event tagged with
its class name: `BlockStored(block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium)`,
`BlockRemoved(block_hashes, medium)`. One batch per replica and server tick that changed its cache (vLLM:
one per engine step); `data_parallel_rank` is the replica.

The events come from the engine's one KV manager (sim/core/kv_manager.py, `attach_events`): a block is
stored when it is full and hashed (at the schedule that fills it), removed when the allocator evicts it.
The hashes are kvsim's chained block hashes (64-bit signed ints: a prefix shared by two prompts has the
same hashes in both). Token ids: the prompt's, then the filler words' ids for output tokens."""
from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvsim.sim.core.request import Request

MEDIUM = "GPU"
EXTRA = "pip install 'kvsim[serve]' (pyzmq, msgspec)"
# vLLM's KVEventsConfig fields this server reads; the others vLLM has are accepted and change nothing here
CONFIG_FIELDS = {"enable_kv_cache_events", "publisher", "endpoint", "topic", "hwm"}
IGNORED_FIELDS = {"replay_endpoint", "buffer_steps", "max_queue_size"}


@dataclass(frozen=True)
class KVEventsConfig:
    endpoint: str = "tcp://*:5557"
    topic: str = ""
    hwm: int = 100_000             # messages the socket queues for a slow subscriber before it drops (ZMQ's SNDHWM)
    encoding: str = "array"        # "array": vLLM's array-like structs; "map": vLLM main's newer map form


ENCODINGS = ("array", "map")


def parse_kv_events_config(text: str | None, endpoint: str | None, encoding: str = "array") -> KVEventsConfig | None:
    """The publisher's settings from --kv-events-config (vLLM's JSON), --kv-events-endpoint and
    --kv-events-encoding; None: off. A ValueError names the bad field."""
    if encoding not in ENCODINGS:
        raise ValueError(f"--kv-events-encoding {encoding}: expected one of {', '.join(ENCODINGS)}")
    config = _parse(text, endpoint)
    return None if config is None else KVEventsConfig(config.endpoint, config.topic, config.hwm, encoding)


def _parse(text: str | None, endpoint: str | None) -> KVEventsConfig | None:
    if text is None:
        return KVEventsConfig(endpoint=endpoint) if endpoint else None
    try:
        raw = json.loads(text)
    except ValueError:
        raise ValueError(f"--kv-events-config: not JSON: {text!r}; expected an object such as "
                         '\'{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557"}\'') from None
    if not isinstance(raw, dict):
        raise ValueError("--kv-events-config: expected a JSON object")
    unknown = sorted(set(raw) - CONFIG_FIELDS - IGNORED_FIELDS)
    if unknown:
        raise ValueError(f"--kv-events-config: unknown field {unknown[0]!r}; expected one of "
                         f"{', '.join(sorted(CONFIG_FIELDS | IGNORED_FIELDS))}")
    if not raw.get("enable_kv_cache_events", False) or raw.get("publisher", "zmq") == "null":
        return KVEventsConfig(endpoint=endpoint) if endpoint else None
    if raw.get("publisher", "zmq") != "zmq":
        raise ValueError(f"--kv-events-config: publisher {raw['publisher']!r}; expected \"zmq\" or \"null\"")
    for name, kind in (("endpoint", str), ("topic", str), ("hwm", int)):
        if name in raw and not isinstance(raw[name], kind):
            raise ValueError(f"--kv-events-config: {name} must be a {kind.__name__}, got {raw[name]!r}")
    defaults = KVEventsConfig()
    return KVEventsConfig(endpoint=endpoint or raw.get("endpoint", defaults.endpoint),
                          topic=raw.get("topic", defaults.topic), hwm=raw.get("hwm", defaults.hwm))


def check_installed() -> None:
    """An ImportError naming the extra when pyzmq or msgspec is missing."""
    try:
        import msgspec  # noqa: F401, I001 - both modules, whichever is missing
        import zmq  # noqa: F401
    except ImportError as exc:
        raise ImportError(f"KV events need {exc.name}: {EXTRA}", name=exc.name) from None


try:
    import msgspec
except ImportError:          # the serve extra is not installed: KV events are refused (check_installed)
    msgspec = None

if msgspec is not None:
    # vLLM's event structs: the same fields, order and encoding options (arrays; events tagged by class name)
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

    # vLLM main's newer form (--kv-events-encoding map): maps, the tag in a "type" field, more fields (omitted
    # when at their defaults)
    class MapEventBatch(msgspec.Struct, omit_defaults=True, gc=False):
        ts: float
        events: list
        data_parallel_rank: int | None = None

    class MapBlockStored(msgspec.Struct, omit_defaults=True, gc=False, tag="BlockStored"):
        block_hashes: list[int]
        parent_block_hash: int | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None
        lora_name: str | None
        extra_keys: list | None = None
        group_idx: int | None = None

    class MapBlockRemoved(msgspec.Struct, omit_defaults=True, gc=False, tag="BlockRemoved"):
        block_hashes: list[int]
        medium: str | None
        group_idx: int | None = None


class ReplicaEvents:
    """One replica's KVEventSink (sim/core/protocols.py): the events of its KV manager, gathered until the
    next publish."""

    def __init__(self, publisher: KVEventPublisher):
        self.publisher = publisher
        self.events: list = []
        self.maps = publisher.config.encoding == "map"

    def stored(self, req: Request, first_block: int, block_hashes: list, parent_hash) -> None:
        bs = self.publisher.block_size
        tokens = self.publisher.token_ids(req, first_block * bs, (first_block + len(block_hashes)) * bs)
        if self.maps:
            self.events.append(MapBlockStored(list(block_hashes), parent_hash, tokens, bs, None, MEDIUM, None))
        else:
            self.events.append(BlockStored(list(block_hashes), parent_hash, tokens, bs, None, MEDIUM))

    def removed(self, block_hashes: list) -> None:
        self.events.append((MapBlockRemoved if self.maps else BlockRemoved)(list(block_hashes), MEDIUM))


class KVEventPublisher:
    """vLLM's ZMQ KV-event publisher: `sinks` go to the replicas' KV managers, `publish` sends what they
    gathered (called by the live engine after each tick)."""

    def __init__(self, config: KVEventsConfig, block_size: int, num_replicas: int,
                 token_ids: Callable[[Request, int, int], Sequence[int]]):
        check_installed()
        import zmq
        self.config, self.block_size, self.token_ids = config, block_size, token_ids
        self.topic = config.topic.encode()
        self.encoder = msgspec.msgpack.Encoder()
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.PUB)
        self.socket.setsockopt(zmq.SNDHWM, config.hwm)
        # vLLM's rule: bind a wildcard, ipc or inproc endpoint (subscribers connect to the server), connect to any
        # other (a subscriber that binds, such as llm-d's KV-cache indexer at tcp://*:5557)
        ep = config.endpoint
        self.binds = "*" in ep or "::" in ep or ep.startswith(("ipc://", "inproc://"))
        try:
            if self.binds:
                self.socket.bind(ep)
            else:
                self.socket.connect(ep)
        except zmq.ZMQError as exc:
            self.close()
            raise ValueError(f"--kv-events-endpoint {ep}: cannot {'bind' if self.binds else 'connect'} ({exc}); "
                             "expected a ZMQ endpoint such as tcp://*:5557 (bound) or tcp://HOST:PORT") from None
        self._noblock, self._again = zmq.NOBLOCK, zmq.Again
        self.batch = MapEventBatch if config.encoding == "map" else KVEventBatch
        self.sinks = [ReplicaEvents(self) for _ in range(num_replicas)]
        self.seq = 0
        self.num_events = 0

    def publish(self) -> None:
        for rank, sink in enumerate(self.sinks):
            if not sink.events:
                continue
            payload = self.encoder.encode(self.batch(time.time(), sink.events, rank))
            self.num_events += len(sink.events)
            sink.events = []
            # no room left for a slow subscriber: the batch is dropped, as vLLM's publisher drops it
            with contextlib.suppress(self._again):
                self.socket.send_multipart([self.topic, self.seq.to_bytes(8, "big"), payload], flags=self._noblock)
            self.seq += 1

    def close(self) -> None:
        self.socket.close(linger=500)     # at most 0.5 s to send the last batches to a connected subscriber
        self.context.term()
