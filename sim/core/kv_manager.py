"""KV cache manager for the shared (vLLM) layout: one block table per request.

Owns which blocks each request holds and the prefix-cache hashing of full blocks. The scheduler
and the engine talk to it only through the `KVManager` protocol (sim/core/protocols.py), so other
layouts and eviction-aware managers can stand in for it.
"""
from __future__ import annotations

from itertools import repeat
from operator import attrgetter

from .block_pool import BlockPool
from .prefix_lookups import PrefixLookups
from .protocols import KVEventSink
from .request import Request, RequestStatus

_COMPUTED = attrgetter("num_computed_tokens")


class KVCacheManager:
    """`num_blocks` is vLLM's num_gpu_blocks: block 0 is its reserved null block (padding of block
    tables), so `num_blocks - 1` hold KV."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = False):
        if num_blocks < 2:
            raise ValueError(f"num_gpu_blocks must be at least 2 (one is vLLM's reserved null block), "
                             f"got {num_blocks}")
        self.block_size = block_size
        self.num_gpu_blocks = num_blocks
        self.pool = BlockPool(num_blocks - 1, enable_caching)
        self.enable_caching = enable_caching
        self.req_blocks: dict[Request, list[int]] = {}
        self.prefix_lookups = PrefixLookups()
        # told which blocks enter the prefix-cache index and which leave it (vLLM's KV events: kvsim serve
        # --kv-events-endpoint); None, the default, costs one test per hashing call (`attach_events`)
        self.events: KVEventSink | None = None
        # speculative decoding with an EAGLE-style drafter (eagle, eagle3, mtp): vLLM drops the last block of a
        # prefix-cache hit, whose hidden states the drafter needs recomputed (KVCacheManager(use_eagle=True))
        self.use_eagle = False

    def attach_events(self, sink: KVEventSink | None) -> None:
        """Tell `sink` every block newly stored in the prefix cache and every cached block evicted."""
        self.events = sink
        self.pool.on_evict = sink.removed if sink is not None else None

    # ----- read-only views (the pool's counters are read on `pool`) ----------------------------
    def blocks_of(self, req: Request) -> list[int]:
        return self.req_blocks.get(req, [])

    def kv_tokens(self, req: Request) -> int:
        """Token-equivalents attention reads for this request (all computed tokens here)."""
        return req.num_computed_tokens

    def block_table_entries(self, req: Request) -> int:
        return len(self.req_blocks.get(req, ()))

    def block_table_entries_of(self, reqs: list[Request]) -> list[int]:
        """`block_table_entries` of each request (a step's batch at once)."""
        return list(map(len, map(self.req_blocks.get, reqs, repeat(()))))

    def slot_stats(self) -> tuple[int, int]:
        """(live slots, slots in allocated blocks); shared prefix blocks count once."""
        bs, req_blocks = self.block_size, self.req_blocks
        allocated = self.pool.num_used_blocks * bs
        empty = sum(map(len, req_blocks.values())) * bs - sum(map(_COMPUTED, req_blocks))
        return allocated - empty, allocated

    # The simulator may advance pure-decode runs in bulk when the manager's state is a pure
    # function of token counts (no per-step eviction).
    supports_decode_runs = True
    table_rows = 1                   # one block table per sequence

    def capacity_tokens(self) -> int:
        return self.pool.num_blocks * self.block_size

    def max_tokens_per_request(self) -> int:
        """Most tokens one request can ever hold resident (the whole pool, here)."""
        return self.capacity_tokens()

    # ----- prefix caching --------------------------------------------------------------------
    def get_computed_blocks(self, req: Request) -> list[int]:
        """Cached blocks covering the longest hit prefix; the last prompt token is always recomputed (with
        `use_eagle`, the hit's last block too)."""
        if not self.enable_caching:
            return []
        if self.use_eagle:
            hits = self._computed_blocks(req)
            return hits[:-1]
        return self._computed_blocks(req)

    def _computed_blocks(self, req: Request) -> list[int]:
        max_hit_blocks = (req.num_tokens - 1) // self.block_size
        hits = []
        if req.prefix_hash_ids is None:
            chain = req.private_blocks
            if chain:
                lookup = self.pool.private_lookup
                for j in range(min(max_hit_blocks, len(chain))):
                    block = lookup(chain, (req.request_id, j))
                    if block is None:
                        break
                    hits.append(block)
            return hits
        for j in range(max_hit_blocks):
            block = self.pool.lookup(self._block_hash(req, j))
            if block is None:
                break
            hits.append(block)
        return hits

    def record_prefix_lookup(self, num_queried: int, num_hit: int, preempted: bool = False) -> None:
        self.prefix_lookups.record(num_queried, num_hit, preempted)

    def fits_full_sequence(self, req: Request, num_tokens: int, computed_blocks: list[int],
                           free_blocks: int | None = None) -> bool:
        """vLLM's admission gate (`scheduler_reserve_full_isl`): the free pool (or `free_blocks`)
        must hold blocks for all `num_tokens` known tokens after the prefix hits, where a hit on a
        free cached block takes that block out of the free pool."""
        need = self.blocks_needed(req, num_tokens - req.num_computed_tokens, len(computed_blocks))
        free = self.pool.num_free_blocks if free_blocks is None else free_blocks
        return need + self.num_revivable(computed_blocks) <= free

    def num_revivable(self, computed_blocks: list[int]) -> int:
        """Prefix hits on free cached blocks: reusing them takes them out of the free pool."""
        return sum(1 for b in computed_blocks if self.pool.ref_cnt[b] == 0)

    def _block_hash(self, req: Request, j: int):
        if req.prefix_hash_ids is None:
            # no shared-prefix information: only the request itself can hit its blocks (after a
            # preemption), so (request, block) identifies them without hashing a chain
            return req.request_id, j
        hashes = req.block_hashes
        if hashes is None:
            hashes = req.block_hashes = []
        while len(hashes) <= j:
            parent = hashes[-1] if hashes else None
            hashes.append(hash((parent, self._block_key(req, len(hashes)))))
        return hashes[j]

    def _block_key(self, req: Request, j: int) -> tuple:
        start, end = j * self.block_size, (j + 1) * self.block_size
        ids, span = req.prefix_hash_ids, req.prefix_block_tokens
        # a session's ids cover its answer too (sim/engine/sessions.py): every token it will hold is known
        known = req.prompt_tokens + req.max_output_tokens if req.ids_cover_output else req.prompt_tokens
        if ids is not None and span and end <= known and (end - 1) // span < len(ids):
            return (tuple(ids[start // span:(end - 1) // span + 1]), start % span)
        # No shared-prefix information: only the request itself can hit it (after a preemption).
        return ("req", req.request_id, j)

    # ----- allocation ------------------------------------------------------------------------
    def blocks_needed(self, req: Request, num_new_tokens: int, num_computed_blocks: int = 0) -> int:
        total = req.num_computed_tokens + num_new_tokens
        held = len(self.req_blocks.get(req, ())) + num_computed_blocks
        return max(0, -(-total // self.block_size) - held)

    def allocate_slots(self, req: Request, num_new_tokens: int,
                       computed_blocks: list[int] | None = None) -> bool:
        """Give `req` slots for `num_new_tokens` more tokens (after `computed_blocks` prefix hits).

        Returns False, changing nothing, when the pool cannot supply the blocks.
        """
        if not computed_blocks:
            blocks = self.req_blocks.get(req)
            total = req.num_computed_tokens + num_new_tokens
            if blocks is not None and len(blocks) * self.block_size >= total and (
                    not self.enable_caching
                    or req.num_cached_blocks >= min(total // self.block_size, len(blocks))):
                return True      # fits in the blocks it holds, no block newly full (the common decode step)
        computed_blocks = computed_blocks or []
        need = self.blocks_needed(req, num_new_tokens, len(computed_blocks))
        if need > self.pool.num_free_blocks - self.num_revivable(computed_blocks):
            return False
        blocks = self.req_blocks.setdefault(req, [])
        if computed_blocks:
            self.pool.touch(computed_blocks)
            blocks.extend(computed_blocks)
        if need:
            blocks.extend(self.pool.get_new_blocks(need))
        # blocks a KV connector is still loading are hashed once loaded (vLLM: delay_cache_blocks)
        if self.enable_caching and req.status != RequestStatus.WAITING_FOR_REMOTE_KVS:
            self.cache_full_blocks(req, req.num_computed_tokens + num_new_tokens)
        return True

    def allocate_spec_slots(self, req: Request, num_new_tokens: int, num_lookahead_tokens: int) -> bool:
        """vLLM's `allocate_slots(req, num_new_tokens, num_lookahead_tokens=...)` for a running request
        with draft tokens: blocks for its computed tokens, this step's `num_new_tokens` (the sampled
        token and the drafts) and `num_lookahead_tokens` more (an EAGLE drafter's slots), of which only
        the blocks full of known tokens are hashed (drafts are not known tokens until accepted). Blocks
        held beyond that (after rejections) are kept and reused. False, changing nothing, when the pool
        cannot supply them."""
        blocks = self.req_blocks.setdefault(req, [])
        total = req.num_computed_tokens + num_new_tokens + num_lookahead_tokens
        need = max(0, -(-total // self.block_size) - len(blocks))
        if need > self.pool.num_free_blocks:
            if not blocks:
                del self.req_blocks[req]
            return False
        if need:
            blocks.extend(self.pool.get_new_blocks(need))
        if self.enable_caching:
            self.cache_full_blocks(req, min(req.num_computed_tokens + num_new_tokens, req.num_tokens))
        return True

    def cache_full_blocks(self, req: Request, num_tokens: int) -> None:
        """Hash the blocks of `req` that `num_tokens` tokens fill and that are not hashed yet."""
        blocks = self.req_blocks[req]
        full = min(num_tokens // self.block_size, len(blocks))
        first = req.num_cached_blocks
        if full <= first:
            return
        if req.prefix_hash_ids is None:
            chain = req.private_blocks
            if chain is None:
                chain = req.private_blocks = []
            self.pool.cache_private(blocks[first:full], req.request_id, first, chain, not req.num_preemptions)
        else:
            hashes = [self._block_hash(req, j) for j in range(first, full)]
            if self.events is None:
                self.pool.cache_blocks(blocks[first:full], hashes)
            else:
                self._cache_and_tell(req, blocks[first:full], first, hashes, self.events)
        req.num_cached_blocks = full

    def _cache_and_tell(self, req: Request, blocks: list[int], first: int, hashes: list, sink: KVEventSink) -> None:
        """`pool.cache_blocks`, telling `sink` each run of blocks that entered the index (a block whose hash an
        identical cached block already holds stays out of it, as in vLLM, and is not told)."""
        cached, chain = self.pool.cached, req.block_hashes or []     # (the chain `_block_hash` filled)
        new = [h not in cached for h in hashes]
        self.pool.cache_blocks(blocks, hashes)
        j, n = 0, len(hashes)
        while j < n:
            if not new[j]:
                j += 1
                continue
            k = j
            while k < n and new[k]:
                k += 1
            parent = hashes[j - 1] if j else (chain[first - 1] if first else None)
            sink.stored(req, first + j, hashes[j:k], parent)
            j = k

    def allocate_decodes(self, reqs: list[Request]) -> list[int] | None:
        """One decode token's slots for every request in `reqs` (each holding its computed tokens) at
        once: the contexts, with the pool left as `allocate_slots(req, 1)` request by request would
        leave it (the same blocks, in the same order), or None with nothing allocated when the free
        pool is short (the scheduler then preempts request by request)."""
        bs, req_blocks = self.block_size, self.req_blocks
        contexts = list(map(_COMPUTED, reqs))
        growing = [r for r, c, n in zip(reqs, contexts, map(len, map(req_blocks.__getitem__, reqs)), strict=True)
                   if n * bs <= c]
        if len(growing) > self.pool.num_free_blocks:
            return None
        fills = [(r, c) for r, c in zip(reqs, contexts, strict=True) if not (c + 1) % bs] \
            if self.enable_caching else []
        if any(r.num_preemptions and self._may_meet_own_copy(r, c) for r, c in fills):
            # a resumed request may find its own older copy of a block cached (its hash stays
            # with that copy): hash in stepping order, each request's allocation then its fill;
            # `allocate_slots(r, 1)` of a request that neither grows nor fills a block changes
            # nothing (its first test), so only the others are called
            for r, c in zip(reqs, contexts, strict=False):
                held = len(req_blocks[r])
                if held * bs <= c or r.num_cached_blocks < min((c + 1) // bs, held):
                    self.allocate_slots(r, 1)
            return contexts
        if growing:
            self.append_one_block_each(growing)
        # otherwise a decode fill's hash is its request's own and new: the order of
        # allocations and fills changes nothing (see sim/engine/bulk/decode_runs.py)
        for r, c in fills:
            self.cache_full_blocks(r, c + 1)
        return contexts

    def _may_meet_own_copy(self, req: Request, context: int) -> bool:
        """Whether the block a resumed request fills with its decode token at `context` may meet an older
        copy of itself (the fill's outcome then depends on evictions earlier in the step): with shared
        hashes, always; with private ones, when its chain holds a block at that index (one it held
        before a preemption), or its earlier full blocks are not all hashed."""
        if req.prefix_hash_ids is not None:
            return True
        j = (context + 1) // self.block_size - 1
        chain = req.private_blocks
        return req.num_cached_blocks != j or (chain is not None and j < len(chain))

    def append_one_block_each(self, reqs: list[Request]) -> None:
        """Give each request one new block, in order (bulk decode growth without prefix caching)."""
        for req, block in zip(reqs, self.pool.get_new_blocks(len(reqs)), strict=False):
            self.req_blocks[req].append(block)

    def free(self, req: Request) -> int:
        """Release all of a request's blocks (tail first, so its tail is evicted from the cache first)."""
        blocks = self.req_blocks.pop(req, [])
        self.pool.free_request_blocks(blocks)
        req.num_cached_blocks = 0
        return len(blocks)

    def forget(self, req: Request) -> None:
        """Drop the per-request state nothing reads once `req` has finished (its block-hash chain:
        ~40 bytes a prompt block, kept across preemptions for re-hits, useless after the finish)."""
        req.block_hashes = req.private_blocks = None

    def reclaim(self, num_blocks: int, running: list[Request]) -> int:
        """Hook for compression-on-pressure managers: free up to `num_blocks`; none here."""
        return 0

    def finish_step(self, scheduled: list) -> None:
        """The per-step policy hook (the engine calls it after every step): no policies here."""
        return None

    def check_invariants(self, live_requests) -> None:
        self.pool.check_invariants()
        counts: dict[int, int] = {}
        for req, blocks in self.req_blocks.items():
            assert len(blocks) * self.block_size >= req.num_computed_tokens, (
                f"request {req.request_id} holds {len(blocks)} blocks for {req.num_computed_tokens} tokens")
            for b in blocks:
                counts[b] = counts.get(b, 0) + 1
        ref = self.pool.ref_cnt
        for b, c in counts.items():
            assert ref[b] == c, f"block {b}: ref count {ref[b]} != {c} owners"
        leaked = [b for b, r in enumerate(ref) if r and b not in counts]
        assert not leaked, f"blocks referenced but owned by no request: {leaked[:10]}"
        owners = set(self.req_blocks)
        assert owners <= set(live_requests), "blocks held by a request that is not live"
