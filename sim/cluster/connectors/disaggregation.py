"""Prefill/decode disaggregation as vLLM runs it with the NIXL connector.

A proxy (vLLM's examples/online_serving/disaggregated_serving toy proxy) sends each request first to
a prefill instance as a prefill leg (one output token, `do_remote_decode`): the prefill instance
computes the prompt, and when the leg finishes its connector keeps the leg's blocks
(`request_finished` -> True). The proxy then sends the request to a decode instance with the
prefill's handle (`do_remote_prefill`): the decode connector reports every prompt token beyond the
local prefix-cache hits as external and loading asynchronously, the scheduler allocates the blocks
and parks the request in WAITING_FOR_REMOTE_KVS, and the decode side pulls the KV over the link.
When the pull ends the request joins WAITING with its prompt computed but the last token (recomputed
for its logits: the first output token is sampled on the decode side), and the prefill side frees
the leg's blocks. If no decode side pulls within `abort_timeout_s` (vLLM's
VLLM_NIXL_ABORT_REQUEST_TIMEOUT, 480 s), the prefill side frees them anyway and a late decode side
computes the prompt itself.
"""
from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Callable

from ...core.connector import NO_TRANSFERS, FinishedTransfers, KVTransferStep
from ...core.request import Request
from ..links import Link, LinkSpec, layerwise_seconds
from ..route import Transfer, route_of
from .in_flight import InFlight

NIXL_ABORT_TIMEOUT_S = 480.0


@dataclass(eq=False)
class PrefillLeg:
    """kv_transfer_params of a prefill leg (vLLM: do_remote_decode): the request it prefills for."""
    parent: Request


@dataclass(eq=False)
class PrefillHandoff:
    """kv_transfer_params the decode side receives (vLLM: do_remote_prefill with the remote engine's
    block ids): where the prompt's KV waits and since when."""
    source: PrefillSideConnector
    leg: object
    ready_s: float
    prefill_s: float = 0.0          # the leg's first scheduled step to its end: the prefill compute
    pulled: bool = False
    expired: bool = False


class PrefillSideConnector:
    """The prefill instance's connector: holds each finished leg's blocks until its KV is pulled."""

    def __init__(self, clock: Callable[[], float], *, abort_timeout_s: float = NIXL_ABORT_TIMEOUT_S,
                 name: str = "prefill", pool: str = "prefill"):
        self.clock = clock
        self.abort_timeout_s = abort_timeout_s
        self.name = name
        self.pool = pool                               # its pool's name (the hand-off's pair: pool -> decode pool)
        self.wake: Callable[[], None] = lambda: None    # the replica's: a release time became known
        self._release_at: dict = {}                    # leg -> when its blocks are freed
        self.handoffs: dict = {}                       # leg -> its PrefillHandoff

    def get_num_new_matched_tokens(self, req, num_computed_tokens: int) -> tuple[int | None, bool]:
        return 0, False

    def update_state_after_alloc(self, req, num_external_tokens: int) -> None:
        return None

    def build_connector_meta(self, out) -> KVTransferStep | None:
        return None

    def request_finished(self, req) -> bool:
        if not isinstance(req.kv_transfer_params, PrefillLeg):
            return False
        now = self.clock()
        self._release_at[req] = now + self.abort_timeout_s
        first = req.first_scheduled_time
        self.handoffs[req] = PrefillHandoff(self, req, now, now - first if first is not None else 0.0)
        return True

    def release(self, leg, at: float) -> None:
        """The decode side's pull of `leg`'s KV ends at `at` (or it needs none: `at` is now)."""
        self._release_at[leg] = at
        self.wake()

    def get_finished(self, now: float) -> FinishedTransfers:
        if not self._release_at:
            return NO_TRANSFERS
        sent = sorted((t, leg.arrival_order, leg) for leg, t in self._release_at.items() if t <= now)
        for _, _, leg in sent:
            del self._release_at[leg]
            handoff = self.handoffs.pop(leg)
            handoff.expired = not handoff.pulled
        return FinishedTransfers([], [leg for _, _, leg in sent])

    def next_completion(self) -> float:
        return min(self._release_at.values(), default=float("inf"))


class DecodeSideConnector:
    """The decode instance's connector: pulls a handed-off prompt's KV over `link`.

    With `layers` > 0 the hand-off is pushed layer by layer while the prefill runs (LMCache's and
    Mooncake's layer-wise transfer; vLLM's NIXL connector pulls after the prefill instead): the link is
    busy for `layerwise_seconds` of the pull (what the prefill's compute did not hide), from when the
    decode side has its blocks. The layers pushed during the prefill are taken to wait on the decode
    host (a staging buffer) if the decode side admits the request later; their link time during the
    prefill is not queued on the link (concurrent pushes to one decode replica do not contend).

    `pair` (several pools of a role): the prefill pool's name -> the link queue the pull waits on and the link
    type that prices it (that pair's bandwidth: its link type, lanes from both sides' TP); None: `link` for
    every pull."""

    def __init__(self, link: Link, kv_bytes_per_token: float, clock: Callable[[], float], *, name: str = "decode",
                 layers: int = 0, pair: Callable[[str], tuple[Link, LinkSpec]] | None = None):
        self.link, self.clock, self.name = link, clock, name
        self.kv_bytes_per_token = kv_bytes_per_token
        self.layers = layers
        self.pair = pair
        self._loads = InFlight()

    def get_num_new_matched_tokens(self, req, num_computed_tokens: int) -> tuple[int | None, bool]:
        handoff = req.kv_transfer_params
        if not isinstance(handoff, PrefillHandoff) or handoff.pulled or handoff.expired:
            return 0, False
        external = req.prompt_tokens - num_computed_tokens
        return external, external > 0

    def update_state_after_alloc(self, req, num_external_tokens: int) -> None:
        handoff = req.kv_transfer_params
        if not isinstance(handoff, PrefillHandoff) or handoff.pulled or handoff.expired:
            return
        handoff.pulled = True
        now = self.clock()
        if not num_external_tokens:
            handoff.source.release(handoff.leg, now)
            return
        nbytes = num_external_tokens * self.kv_bytes_per_token
        link, spec = self.pair(handoff.source.pool) if self.pair is not None else (self.link, self.link.spec)
        seconds = layerwise_seconds(spec, nbytes, self.layers, handoff.prefill_s) if self.layers else spec.seconds(nbytes)
        start, end = link.reserve(now, nbytes, seconds)
        route_of(req).transfers.append(Transfer("prefill_to_decode", handoff.source.name, self.name,
                                                num_external_tokens, nbytes, start, end))
        self._loads.add(end, req)
        handoff.source.release(handoff.leg, end)

    def build_connector_meta(self, out) -> KVTransferStep | None:
        return None

    def request_finished(self, req) -> bool:
        return False

    def get_finished(self, now: float) -> FinishedTransfers:
        if not self._loads:
            return NO_TRANSFERS
        return FinishedTransfers(self._loads.done(now), [])

    def next_completion(self) -> float:
        return self._loads.next_end()
