"""A KV store shared by replicas, reached over a link: LMCache's remote backend or Mooncake's pool,
seen from vLLM's connector interface.

What the store holds is keyed by prompt content in chunks (LMCache: 256 tokens by default): chunk c
of a prompt is identified by the trace's prefix ids that cover its tokens (Mooncake `hash_ids`),
so two requests with the same leading ids share the chunks. A request finishing saves the full
chunks of its prompt the store lacks (asynchronously: its blocks are kept until the save ends, and
the chunks become visible to lookups then). At admission the connector offers the stored chunks
beyond the local prefix-cache hits; they load asynchronously (the request waits in
WAITING_FOR_REMOTE_KVS) or synchronously inside the step that computes the rest of the prompt,
optionally pipelined layer by layer with that step's compute.
"""
from __future__ import annotations

from collections.abc import Callable

from ...core.connector import NO_TRANSFERS, FinishedTransfers, KVTransferStep

from ..links import Link
from ..route import Transfer, route_of
from .in_flight import InFlight


class KVStore:
    """Prompt chunks by content key (shared by every replica's connector)."""

    def __init__(self, chunk_tokens: int = 256, name: str = "remote"):
        if chunk_tokens < 1:
            raise ValueError(f"KV store {name!r}: chunk_tokens must be at least 1, got {chunk_tokens}")
        self.chunk_tokens = chunk_tokens
        self.name = name
        self._chunks: set = set()

    def chunk_keys(self, req) -> list:
        """Keys of the request's full prompt chunks, its last prompt token excluded (always
        recomputed); only chunks whose tokens the trace's prefix ids cover have a key."""
        ids, span = req.prefix_hash_ids, req.prefix_block_tokens
        if ids is None or not span:
            return []
        keys = []
        for c in range((req.prompt_tokens - 1) // self.chunk_tokens):
            end = (c + 1) * self.chunk_tokens
            covering = -(-end // span)
            if covering > len(ids):
                break
            keys.append((tuple(ids[:covering]), end))
        return keys

    def stored_tokens(self, req) -> int:
        """Leading prompt tokens whose chunks are stored."""
        n = 0
        for key in self.chunk_keys(req):
            if key not in self._chunks:
                break
            n += self.chunk_tokens
        return n

    def missing(self, req) -> list:
        return [k for k in self.chunk_keys(req) if k not in self._chunks]

    def add(self, keys: list) -> None:
        self._chunks.update(keys)


class RemoteStoreConnector:
    """One replica's connector to a shared `KVStore` over `link` (`clock()`: the engine's time)."""

    def __init__(self, store: KVStore, link: Link, kv_bytes_per_token: float, clock: Callable[[], float], *,
                 load_async: bool = True, overlap_layers: int = 1, name: str = "replica"):
        self.store, self.link, self.clock = store, link, clock
        self.kv_bytes_per_token = kv_bytes_per_token
        self.load_async = load_async
        self.overlap_layers = overlap_layers
        self.name = name
        self._loads = InFlight()
        self._saves = InFlight()
        self._saving: dict = {}          # request -> the chunk keys its save adds
        self._sync_load_s = 0.0
        self.num_queried_tokens = 0      # vLLM: external prefix cache queries / hits (tokens)
        self.num_hit_tokens = 0

    def get_num_new_matched_tokens(self, req, num_computed_tokens: int) -> tuple[int | None, bool]:
        stored = self.store.stored_tokens(req)
        self.num_queried_tokens += req.prompt_tokens - num_computed_tokens
        external = max(0, stored - num_computed_tokens)
        self.num_hit_tokens += external
        return external, self.load_async and external > 0

    def update_state_after_alloc(self, req, num_external_tokens: int) -> None:
        if not num_external_tokens:
            return
        now = self.clock()
        nbytes = num_external_tokens * self.kv_bytes_per_token
        start, end = self.link.reserve(now, nbytes)
        route_of(req).transfers.append(Transfer("load", self.store.name, self.name, num_external_tokens, nbytes,
                                                start, end))
        if self.load_async:
            self._loads.add(end, req)
        else:
            self._sync_load_s += end - now        # the step waits for its place on the link too

    def build_connector_meta(self, out) -> KVTransferStep | None:
        if not self._sync_load_s:
            return None
        step = KVTransferStep(load_s=self._sync_load_s, overlap_layers=self.overlap_layers)
        self._sync_load_s = 0.0
        return step

    def request_finished(self, req) -> bool:
        keys = self.store.missing(req)
        if not keys:
            return False
        tokens = len(keys) * self.store.chunk_tokens
        nbytes = tokens * self.kv_bytes_per_token
        start, end = self.link.reserve(self.clock(), nbytes)
        route_of(req).transfers.append(Transfer("save", self.name, self.store.name, tokens, nbytes, start, end))
        self._saving[req] = keys
        self._saves.add(end, req)
        return True

    def get_finished(self, now: float) -> FinishedTransfers:
        if not (self._loads or self._saves):
            return NO_TRANSFERS
        sent = self._saves.done(now)
        for req in sent:
            self.store.add(self._saving.pop(req))
        return FinishedTransfers(self._loads.done(now), sent)

    def next_completion(self) -> float:
        return min(self._loads.next_end(), self._saves.next_end())
