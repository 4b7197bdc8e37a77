"""The two interfaces of the engine core: what it asks of a KV manager and of an executor.

The engine loop (`sim.engine.loop`), the scheduler (`sim.core.scheduler`), the step shape
(`sim.core.step`) and the decode fast-forward (`sim.engine.bulk.decode_runs`) use a KV manager and an
executor only through these protocols. KV managers: `sim.core.kv_manager.KVCacheManager` (shared
layout, prefix caching), `sim.kv.manager.EvictingKVManager` (token-level eviction/compression) and
`sim.kv.fast.FastKVManager` (fast mode). Executors: the simulator's (`sim.simulator.executor`: the cost
model prices each step) and the real backend's (`gpu.executor.RealExecutor`: runs it on tensors).

Capabilities are attributes, never probed with getattr: a manager without a batch decode path
returns None from `allocate_decodes`; only a manager AND an executor whose `supports_decode_runs`
is True are driven through the fast-forward protocols below.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import numpy as np

    from .prefix_lookups import PrefixLookups
    from .request import Request
    from .scheduler import SchedulerOutput
    from .step import StepResult


class KVEventSink(Protocol):
    """Told by the shared-layout KV manager (`KVCacheManager.attach_events`) what vLLM's KV-event publisher
    tells its subscribers (vllm/distributed/kv_events.py): blocks entering the prefix-cache index, in runs of
    one request's consecutive blocks, and cached blocks evicted. kvsim serve publishes them over ZMQ
    (sim/serve/kv_events.py)."""

    def stored(self, req: Request, first_block: int, block_hashes: list, parent_hash: Any) -> None:
        """Blocks first_block.. of `req` entered the index with `block_hashes`; `parent_hash`: the hash of
        block first_block - 1 (None for the first block)."""

    def removed(self, block_hashes: list) -> None:
        """Cached blocks holding `block_hashes` were evicted (their hashes left the index)."""


@runtime_checkable
class KVPool(Protocol):
    """The one pool abstraction every KV manager holds (`KVManager.pool`), and the only place its
    counters are defined: the scheduler, the engine's step log and the fast-forward read them here.
    Implemented by `sim.core.block_pool.BlockPool` (block ids, prefix caching),
    `sim.kv.pool.ArrayBlockPool` (block ids as numpy arrays), `sim.kv.fast.slab.CountPool`
    (counts only: fast mode) and `sim.kv.fast.sampled.rows.ScaledPoolView` (a sampled pool scaled up);
    tests/test_kv_pools.py checks each against it."""
    num_blocks: int
    enable_caching: bool
    num_cache_evictions: int

    @property
    def num_free_blocks(self) -> int: ...

    @property
    def num_used_blocks(self) -> int: ...

    @property
    def num_cached_free_blocks(self) -> int: ...

    def check_invariants(self) -> None: ...


@runtime_checkable
class KVManager(Protocol):
    """What the scheduler and the engine ask of a KV manager."""
    block_size: int
    enable_caching: bool            # prefix caching
    supports_decode_runs: bool     # state is a pure function of token counts (see DecodeRunKV)
    prefix_lookups: PrefixLookups   # prompt tokens looked up in the prefix cache, and hits

    @property
    def pool(self) -> KVPool:
        """The manager's blocks: their counters (num_blocks, num_free_blocks, ...) are read here."""

    @property
    def table_rows(self) -> int:
        """Block-table rows per sequence: layers x KV heads per GPU in the per_head layout, else 1."""

    @property
    def req_blocks(self) -> Mapping[Request, Any]:
        """The requests holding KV (a mapping keyed by request)."""

    def max_tokens_per_request(self) -> int: ...

    def kv_tokens(self, req: Request) -> float:
        """fp16 token-equivalents attention reads for `req` (its context before the next tokens)."""

    def block_table_entries(self, req: Request) -> int: ...

    def slot_stats(self) -> tuple[int, int]:
        """(live slots, slots in allocated blocks)."""

    def get_computed_blocks(self, req: Request) -> list[int]:
        """Prefix-cache hits of a waiting request."""

    def record_prefix_lookup(self, num_queried: int, num_hit: int, preempted: bool = False) -> None: ...

    def fits_full_sequence(self, req: Request, num_tokens: int, computed_blocks: list[int],
                           free_blocks: int | None = None) -> bool:
        """The admission gate: blocks for the whole known sequence fit the free pool."""

    def num_revivable(self, computed_blocks: list[int]) -> int:
        """Prefix hits on free cached blocks (reusing them takes them out of the free pool)."""

    def blocks_needed(self, req: Request, num_new_tokens: int, num_computed_blocks: int = 0) -> int: ...

    def allocate_slots(self, req: Request, num_new_tokens: int, computed_blocks: list[int] | None = None) -> bool:
        """Slots for `num_new_tokens` more tokens; False, changing nothing, when they do not fit."""

    def allocate_decodes(self, reqs: Sequence[Request]) -> list[float] | None:
        """One decode token's slots for every request at once: their contexts, or None (nothing
        reserved) when they do not all fit or the manager has no batch path."""

    def free(self, req: Request) -> int: ...

    def forget(self, req: Request) -> None:
        """Drop per-request state nothing reads once `req` has finished."""

    def reclaim(self, num_blocks: int, running: list[Request]) -> int:
        """Free up to `num_blocks` by compressing running requests (memory-pressure policies); freed count."""

    def finish_step(self, scheduled: list) -> Any:
        """The per-step policy hook, called by the engine once a step ran (after its attention): what
        the policies did (the eviction-aware managers' `KVStepEffects`), or None when there are none."""

    def check_invariants(self, live_requests: Iterable[Request]) -> None: ...


@runtime_checkable
class DecodeRunPool(KVPool, Protocol):
    """A pool the decode fast-forward can plan over (`sim.core.block_pool.BlockPool`)."""

    @property
    def ref_cnt(self) -> list[int]: ...

    def next_free_blocks(self, n: int) -> list[int]: ...

    @property
    def num_shared_refs(self) -> int: ...


@runtime_checkable
class DecodeRunKV(KVManager, Protocol):
    """A KV manager whose `supports_decode_runs` is True: the decode fast-forward grows its
    requests' block tables in bulk."""

    @property
    def pool(self) -> DecodeRunPool: ...

    def append_one_block_each(self, reqs: list[Request]) -> None: ...


@runtime_checkable
class Executor(Protocol):
    """Runs (or prices) one scheduled step."""
    supports_decode_runs: bool     # True: a DecodeRunExecutor (prices runs of decode steps)
    supports_admitting_runs: bool   # True (with supports_decode_runs): it prices a run's mixed steps from counts

    def execute(self, out: SchedulerOutput) -> StepResult:
        """Run (or price) the step's model part; `complete` finishes it."""

    def complete(self, result: StepResult, kv_effects: Any) -> StepResult:
        """Finish the step `execute` began, given what the KV manager's per-step policies did
        (`KVManager.finish_step`, which the engine calls in between): charge or apply it."""


@runtime_checkable
class DecodeRunExecutor(Executor, Protocol):
    """An executor that prices a run of pure-decode steps at once, bit-identical to `execute`."""

    def predict_decode_run(self, num_seqs: np.ndarray, kv_tokens_read: np.ndarray,
                           block_table_entries: np.ndarray) -> np.ndarray:
        """Float64 durations of the steps (counts given as int64 or float64 arrays)."""

    def predict_decode_steps(self, num_seqs: list[int], kv_tokens_read: list[int],
                             block_table_entries: list[int]) -> list[float]:
        """The same durations for counts given as integer lists (a run that admits arrivals prices
        the few steps up to the next one at a time)."""
