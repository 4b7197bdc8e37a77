"""Scheduler-facing surface shared by the eviction-aware KV managers (token-level and fast mode)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..core.prefix_lookups import PrefixLookups

if TYPE_CHECKING:
    from .importance import ImportanceModelSpec
    from .policy import EvictionPolicy, PolicyContext


@dataclass(frozen=True)
class FastOptions:
    """kv.mode=fast's options (resolved once from `kv:` by sim/kv/build.py): the slot strategy, the
    bytes of one token of one row, and the row sample (`sample_rows` = kv.fast_rows, drawn for
    `seed` from the importance model's heads; `copy_threshold` = kv.copy_threshold)."""
    slot_strategy: str = "free_block"
    bytes_per_token_row: float = 0.0
    copy_threshold: int = 0              # copy strategies: holes a row may hold before its rewrite (0: none)
    seed: int = 0
    sample_rows: int = 32
    importance: str | ImportanceModelSpec = "smollm2-135m"


def sample_row_count(rows: int, wanted: int) -> int:
    """Rows a fast-mode manager simulates: the largest divisor of `rows` (layers x KV heads) not above
    `wanted` (`kv.fast_rows`), so that every simulated row stands for the same number of real rows."""
    return max(d for d in range(1, rows + 1) if rows % d == 0 and d <= max(wanted, 1))


class EvictingManagerBase:
    """The part of the `KVManager` protocol (sim/core/protocols.py) that is the same for every
    eviction-aware manager.

    No prefix caching (evicted tokens break shared prefix blocks) and no bulk decode fast-forward
    (eviction changes memory every step). The pool counts blocks of one (layer, KV head) row in the
    per_head layout, so a request can hold at most `pool blocks / ctx.rows` blocks of tokens.
    Subclasses set `pool`, `ctx`, `policy` and `block_size`.
    """
    supports_decode_runs = False
    ctx: PolicyContext
    policy: EvictionPolicy
    enable_caching = False

    @property
    def prefix_lookups(self) -> PrefixLookups:
        return PrefixLookups()          # no prefix cache: nothing is looked up

    @property
    def table_rows(self) -> int:
        return self.ctx.rows

    def capacity_tokens(self) -> int:
        return self.pool.num_blocks // self.ctx.rows * self.block_size

    def max_tokens_per_request(self) -> int:
        return self.capacity_tokens()

    def get_computed_blocks(self, req) -> list[int]:
        return []

    def fits_full_sequence(self, req, num_tokens, computed_blocks, free_blocks=None) -> bool:
        """vLLM's full-prompt admission: the whole known sequence is written before any compression
        acts on it, so its pages must fit the free pool (or `free_blocks`)."""
        free = self.pool.num_free_blocks if free_blocks is None else free_blocks
        return self.blocks_needed(req, num_tokens - req.num_computed_tokens) <= free

    def num_revivable(self, computed_blocks) -> int:
        return 0                     # no prefix caching: no cached free blocks to revive

    def allocate_decodes(self, reqs) -> list[float] | None:
        """No batch decode path unless a subclass has one: the scheduler allocates request by request."""
        return None

    def record_prefix_lookup(self, num_queried: int, num_hit: int, preempted: bool = False) -> None:
        pass

    def forget(self, req) -> None:
        """Nothing per request outlives `free` here."""
