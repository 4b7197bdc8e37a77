"""The KV connector seam: how the engine core admits a request whose KV is computed or stored elsewhere.

Modelled on vLLM v1's `KVConnectorBase_V1` (vllm/distributed/kv_transfer/kv_connector/v1/base.py)
and the calls its scheduler (vllm/v1/core/sched/scheduler.py) makes; real implementations are vLLM's
OffloadingConnector (CPU), LMCache (CPU, disk, remote) and NIXL (prefill -> decode). The scheduler
side, per waiting request at admission:

1. `get_num_new_matched_tokens(req, num_local_computed)`: prompt tokens beyond the local prefix-cache
   hits whose KV the connector can supply, and whether they load asynchronously (between steps) or
   synchronously (inside the step that computes the rest of the prompt). None: ask again later (the
   request is skipped this schedule).
2. blocks are allocated for the local hits, the external tokens and this step's new tokens;
   `update_state_after_alloc(req, num_external_tokens)` tells the connector to start the load.
3. an asynchronous load parks the request in WAITING_FOR_REMOTE_KVS (it holds its blocks, takes no
   budget and no sequence slot); when the load is done (`get_finished`) it returns to the front of
   WAITING with the loaded tokens computed (the last prompt token is always recomputed, for its logits).

Per step, `build_connector_meta(out)` reports what the step itself waits for (synchronous loads and
saves): the engine adds it to the step's duration (`step_seconds_with_transfer`). When a request
finishes, `request_finished(req)` may keep its blocks (True) until an asynchronous save or send is
done (reported by `get_finished` too). The engine polls `get_finished(now)` at every step end, wakes
an idle replica at `next_completion()`, and the decode fast-forward stops there.

Connectors live above the core (sim/cluster/): they price transfers with a link model and the cost
model's KV bytes. The core sees only this protocol; without a connector the scheduler takes none of
these paths (bit-identical outputs).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple, Protocol, runtime_checkable

if TYPE_CHECKING:
    from .request import Request
    from .scheduler import SchedulerOutput


class KVTransferStep(NamedTuple):
    """What one engine step waits for besides its compute: synchronous loads (external prefix KV
    read into the step's blocks) and saves, in seconds on their link, and how many layers they
    pipeline with the step's compute (layer-wise loading/saving as LMCache and vLLM's connectors do
    it; 1: not overlapped)."""
    load_s: float = 0.0
    save_s: float = 0.0
    overlap_layers: int = 1


class FinishedTransfers(NamedTuple):
    """Asynchronous transfers done by now: loads (their requests may be scheduled) and saves or
    sends (their finished requests' blocks may be freed)."""
    received: list
    sent: list


NO_TRANSFERS = FinishedTransfers([], [])


@runtime_checkable
class KVConnector(Protocol):
    """The scheduler-side connector (one per engine replica)."""

    def get_num_new_matched_tokens(self, req: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """(tokens the connector can load beyond `num_computed_tokens` local hits, or None to be asked
        again later; whether they load asynchronously). The async flag must be False when 0 tokens."""

    def update_state_after_alloc(self, req: Request, num_external_tokens: int) -> None:
        """Blocks are allocated for `req`: start loading its `num_external_tokens` (0: nothing)."""

    def build_connector_meta(self, out: SchedulerOutput) -> KVTransferStep | None:
        """What the scheduled step waits for (synchronous loads/saves); None: nothing. Resets the
        connector's per-step state."""

    def request_finished(self, req: Request) -> bool:
        """`req` finished (called once, before its blocks are freed): True keeps its blocks until
        `get_finished` reports it sent/saved."""

    def get_finished(self, now: float) -> FinishedTransfers:
        """Asynchronous loads and sends/saves completed at or before `now` (each reported once)."""

    def next_completion(self) -> float:
        """When the next asynchronous transfer of this replica completes (inf: none in flight)."""


@runtime_checkable
class FinishAwareConnector(Protocol):
    """A connector that can tell, without acting, whether a request's finish would keep its blocks: a decode
    run (sim/engine/bulk/decode_runs.py) then goes on past the finishes that keep none (a plain finish, as
    without a connector) and stops only at the first finish of a request that keeps them. A connector
    without it stops every run at its first finish (any finish may start a save or a send)."""

    def keeps_blocks_at_finish(self, req: Request) -> bool:
        """What `request_finished(req)` would return now (it changes nothing). A decode run polls no
        transfer, so the answer must hold until the next transfer ends (`next_completion`)."""


def step_seconds_with_transfer(compute_s: float, transfer: KVTransferStep | None) -> float:
    """A step's duration with its synchronous transfers. Without overlap they add to the compute;
    pipelined over L layers (layer i's KV moves while layer i-1 computes), the longer of the two
    dominates and the shorter shows only for one layer: max(c, t) + min(c, t) / L."""
    if transfer is None:
        return compute_s
    t = transfer.load_s + transfer.save_s
    if t <= 0.0:
        return compute_s
    layers = transfer.overlap_layers
    if layers <= 1:
        return compute_s + t
    return max(compute_s, t) + min(compute_s, t) / layers
