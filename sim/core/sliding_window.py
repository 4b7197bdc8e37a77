"""KV accounting of models with sliding-window layers, as vLLM's hybrid KV cache allocator does it.

vLLM (v1, `vllm/v1/core/kv_cache_coordinator.py` and `single_type_kv_cache_manager.py`) cuts the layers
into KV cache groups of equal size, each of one attention type (`ModelSpec.kv_cache_groups`); a pool
block holds `block_size` tokens of one group, so every group takes one block per `block_size` tokens of
a request. A full-attention group keeps all of a request's blocks; a sliding-window group
(`SlidingWindowManager`) frees the blocks that fell out of the window before each allocation: with
`num_computed_tokens` tokens computed, the first token still attended to is
`num_computed_tokens - sliding_window + 1`, and every block wholly before it goes back to the pool (its
table slot becomes the null block). A request's new blocks are allocated in every group for all its new
tokens (a long prefill chunk holds its whole chunk until the next step frees what fell out).

`HybridKVManager` composes one `GroupTables` per attention type over one shared `BlockPool` and answers
the scheduler's `KVManager` protocol. Not modelled: prefix caching (no hits with sliding-window layers
here; vLLM can hit when the window's blocks are cached), the per-step eviction policies, swapping.
"""
from __future__ import annotations

from .block_pool import BlockPool
from .prefix_lookups import PrefixLookups
from .request import Request


class GroupTables:
    """The block tables of `groups` KV cache groups of one attention type (`window` None: full
    attention). Each logical block of a request holds one pool block per group; a freed logical
    block is None."""

    def __init__(self, pool: BlockPool, block_size: int, groups: int, window: int | None):
        self.pool, self.block_size, self.groups, self.window = pool, block_size, groups, window
        self.tables: dict[Request, list[list[int] | None]] = {}
        self.live: dict[Request, int] = {}          # pool blocks each request holds in these groups

    def skipped_blocks(self, num_computed_tokens: int) -> int:
        """Logical blocks wholly before the window of the next token (0 for full attention)."""
        if self.window is None:
            return 0
        return max(0, num_computed_tokens - self.window + 1) // self.block_size

    def blocks_to_allocate(self, req: Request, total_tokens: int) -> int:
        """Pool blocks a request needs to hold `total_tokens` tokens after its skipped blocks are freed."""
        have = len(self.tables.get(req, ()))
        return self.groups * max(0, -(-total_tokens // self.block_size) - have)

    def blocks_for_sequence(self, total_tokens: int) -> int:
        """Pool blocks a sequence of `total_tokens` tokens holds once computed (the admission gate's
        figure): a full group all of them, a sliding group the window's (a prefill chunk holds more
        until the next step: allocate_slots checks those)."""
        blocks = -(-total_tokens // self.block_size)
        if self.window is not None:
            blocks = min(blocks, -(-self.window // self.block_size) + 1)
        return self.groups * blocks

    def remove_skipped(self, req: Request, num_computed_tokens: int) -> None:
        table = self.tables.get(req)
        if not table:
            return
        freed: list[int] = []
        for j in range(min(self.skipped_blocks(num_computed_tokens), len(table)) - 1, -1, -1):
            entry = table[j]
            if entry is None:                     # everything before it was freed already
                break
            freed.extend(entry)
            table[j] = None
        if freed:
            self.pool.free_blocks(freed)
            self.live[req] -= len(freed)

    def allocate(self, req: Request, total_tokens: int) -> None:
        table = self.tables.setdefault(req, [])
        new = -(-total_tokens // self.block_size) - len(table)
        if new <= 0:
            return
        blocks = self.pool.get_new_blocks(new * self.groups)
        g = self.groups
        table.extend(blocks[i * g:(i + 1) * g] for i in range(new))
        self.live[req] = self.live.get(req, 0) + len(blocks)

    def free(self, req: Request) -> int:
        table = self.tables.pop(req, None)
        self.live.pop(req, None)
        if not table:
            return 0
        blocks = [b for entry in reversed(table) if entry is not None for b in reversed(entry)]
        self.pool.free_blocks(blocks)
        return len(blocks)


class HybridKVManager:
    """The KV manager of a model with sliding-window layers (see the module docstring). `num_blocks`
    is vLLM's num_gpu_blocks of group-sized blocks (one of them the reserved null block)."""

    supports_decode_runs = False       # freed window blocks make the pool depend on more than token counts
    table_rows = 1
    enable_caching = False

    def __init__(self, num_blocks: int, block_size: int, *, window: int, full_groups: int, sliding_groups: int,
                 sliding_layer_fraction: float):
        if num_blocks < 2:
            raise ValueError(f"num_gpu_blocks must be at least 2 (one is vLLM's reserved null block), "
                             f"got {num_blocks}")
        self.block_size, self.window = block_size, window
        self.num_gpu_blocks = num_blocks
        self.pool = BlockPool(num_blocks - 1, False)
        self.types = [GroupTables(self.pool, block_size, n, w)
                      for n, w in ((full_groups, None), (sliding_groups, window)) if n]
        self.sliding_fraction = sliding_layer_fraction
        self.prefix_lookups = PrefixLookups()

    # ----- read-only views (the pool's counters are read on `pool`) ----------------------------
    @property
    def req_blocks(self) -> dict[Request, int]:
        """Pool blocks each request holds, over all groups."""
        out: dict[Request, int] = {}
        for t in self.types:
            for req, n in t.live.items():
                out[req] = out.get(req, 0) + n
        return out

    def blocks_held(self, req: Request) -> int:
        return sum(t.live.get(req, 0) for t in self.types)

    def kv_tokens(self, req: Request) -> float:
        """Token-equivalents (of all layers) attention reads: sliding layers read at most the window."""
        n = req.num_computed_tokens
        return n - self.sliding_fraction * max(0, n - self.window)

    def block_table_entries(self, req: Request) -> int:
        return sum(len(t.tables.get(req, ())) * t.groups for t in self.types)

    def slot_stats(self) -> tuple[int, int]:
        """(live slots, slots in allocated blocks), in group-block slots: a sliding group's live blocks
        are the suffix of its table (freed ones are a prefix)."""
        live = 0
        for t in self.types:
            for req, table in t.tables.items():
                first_live = len(table) - t.live[req] // t.groups
                live += t.groups * max(0, req.num_computed_tokens - first_live * self.block_size)
        return live, self.pool.num_used_blocks * self.block_size

    def max_tokens_per_request(self) -> int:
        """Most tokens one request can hold: full groups hold every block, sliding ones about the window."""
        full = sum(t.groups for t in self.types if t.window is None)
        window_blocks = sum(t.groups * (-(-self.window // self.block_size) + 1) for t in self.types
                            if t.window is not None)
        if not full:
            return 2**62
        return max(0, self.pool.num_blocks - window_blocks) // full * self.block_size

    # ----- prefix caching (not modelled with sliding-window layers) -------------------------
    def get_computed_blocks(self, req: Request) -> list[int]:
        return []

    def record_prefix_lookup(self, num_queried: int, num_hit: int, preempted: bool = False) -> None:
        self.prefix_lookups.record(num_queried, num_hit, preempted)

    def num_revivable(self, computed_blocks: list[int]) -> int:
        return 0

    # ----- allocation ------------------------------------------------------------------------
    def fits_full_sequence(self, req: Request, num_tokens: int, computed_blocks: list[int],
                           free_blocks: int | None = None) -> bool:
        need = sum(t.blocks_for_sequence(num_tokens) for t in self.types)
        need -= self.blocks_held(req)
        return need <= (self.pool.num_free_blocks if free_blocks is None else free_blocks)

    def blocks_needed(self, req: Request, num_new_tokens: int, num_computed_blocks: int = 0) -> int:
        total = req.num_computed_tokens + num_new_tokens
        return sum(t.blocks_to_allocate(req, total) for t in self.types)

    def allocate_slots(self, req: Request, num_new_tokens: int, computed_blocks: list[int] | None = None) -> bool:
        for t in self.types:
            t.remove_skipped(req, req.num_computed_tokens)
        total = req.num_computed_tokens + num_new_tokens
        if sum(t.blocks_to_allocate(req, total) for t in self.types) > self.pool.num_free_blocks:
            return False
        for t in self.types:
            t.allocate(req, total)
        return True

    def allocate_spec_slots(self, req: Request, num_new_tokens: int, num_lookahead_tokens: int) -> bool:
        """Speculative decoding's allocation (vLLM's `allocate_slots(..., num_lookahead_tokens)`): the scheduled
        tokens and the lookahead slots; nothing is hashed here (no prefix caching for these layers)."""
        return self.allocate_slots(req, num_new_tokens + num_lookahead_tokens)

    def allocate_decodes(self, reqs) -> None:
        return None

    def free(self, req: Request) -> int:
        return sum(t.free(req) for t in self.types)

    def forget(self, req: Request) -> None:
        return None

    def reclaim(self, num_blocks: int, running: list[Request]) -> int:
        return 0

    def finish_step(self, scheduled: list) -> None:
        """The per-step policy hook (the engine calls it after every step): no policies here."""
        return None

    def check_invariants(self, live_requests) -> None:
        self.pool.check_invariants()
        owned = [b for t in self.types for table in t.tables.values() for e in table if e is not None for b in e]
        assert len(owned) == len(set(owned)), "a pool block held twice"
        assert len(owned) == self.pool.num_used_blocks, (
            f"{len(owned)} blocks in tables but {self.pool.num_used_blocks} in use")
        for t in self.types:
            for req, table in t.tables.items():
                assert t.live[req] == t.groups * sum(e is not None for e in table)
                assert len(table) * self.block_size >= req.num_computed_tokens
        assert set(self.req_blocks) <= set(live_requests), "blocks held by a request that is not live"
