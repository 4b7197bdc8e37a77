"""The two block pools on their own: vLLM's prefix-caching BlockPool (sim/core/block_pool.py) and the
array pool of the eviction-aware managers (sim/kv/pool.py)."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsim.sim.core.block_pool import BlockPool
from kvsim.sim.kv.pool import ArrayBlockPool


def test_without_caching_the_last_freed_block_is_reused_first():
    pool = BlockPool(6)
    a = pool.get_new_blocks(3)
    pool.free_blocks(reversed(a))                 # callers free a request's tail first
    assert pool.get_new_blocks(3) == a            # its head block comes back first
    assert pool.num_free_blocks == 3 and pool.num_cached_free_blocks == 0


def test_freed_hashed_blocks_stay_findable_until_the_allocator_needs_them():
    pool = BlockPool(4, enable_caching=True)
    a = pool.get_new_blocks(2)
    pool.cache_block(a[0], "h0")
    pool.cache_block(a[1], "h1")
    pool.free_blocks(reversed(a))
    assert pool.num_free_blocks == 4 and pool.num_cached_free_blocks == 2
    assert pool.lookup("h0") == a[0]
    # unhashed free blocks go first; the cached ones follow in LRU order (the tail freed first)
    fresh = pool.get_new_blocks(3)
    assert set(fresh[:2]).isdisjoint(a) and fresh[2] == a[1]
    assert pool.lookup("h1") is None and pool.lookup("h0") == a[0]
    assert pool.num_cache_evictions == 1 and pool.num_cached_free_blocks == 1
    pool.check_invariants()


def test_a_hit_on_a_free_cached_block_revives_it():
    pool = BlockPool(3, enable_caching=True)
    [b] = pool.get_new_blocks(1)
    pool.cache_block(b, "prefix")
    pool.free_blocks([b])
    pool.touch([pool.lookup("prefix")])
    assert pool.num_free_blocks == 2 and pool.num_cached_free_blocks == 0 and pool.ref_cnt[b] == 1
    pool.touch([b])                              # a second request shares it
    pool.free_blocks([b])
    assert pool.ref_cnt[b] == 1 and pool.num_free_blocks == 2
    pool.check_invariants()


def test_an_identical_block_keeps_the_first_copy_in_the_index():
    pool = BlockPool(3, enable_caching=True)
    a, b = pool.get_new_blocks(2)
    pool.cache_blocks([a, b], ["same", "same"])
    assert pool.lookup("same") == a and pool.block_hash[b] is None


def test_a_private_block_is_found_at_its_own_index_only_while_it_keeps_its_hash():
    """A request's blocks hashed before its first preemption share one key, `(request id,)`: a
    lookup must still miss a block evicted and then hashed again by the same request at another index."""
    pool, chain = BlockPool(4, enable_caching=True), []
    a = pool.get_new_blocks(3)
    pool.cache_private(a, 7, 0, chain, fresh=True)
    assert [pool.private_lookup(chain, (7, j)) for j in range(3)] == a
    assert pool.private_lookup(chain, (8, 0)) is None                 # another request's key
    pool.free_request_blocks(a)                   # preempted: tail first, so the tail is evicted first
    taken = pool.get_new_blocks(3)                # the unhashed block, then a[2] and a[1]
    assert taken[1:] == [a[2], a[1]]
    assert [pool.private_lookup(chain, (7, j)) for j in range(3)] == [a[0], None, None]
    pool.cache_private([a[2]], 7, 1, chain)       # resumed, it fills its block 1 in a[2]
    assert chain == [a[0], a[2], a[2]]
    assert [pool.private_lookup(chain, (7, j)) for j in range(3)] == [a[0], a[2], None]
    pool.cache_private([taken[0]], 7, 0, chain)   # an identical block 0 is cached: it keeps the index
    assert chain[0] == a[0] and pool.block_hash[taken[0]] is None


def test_overdrawing_a_pool_is_refused():
    with pytest.raises(ValueError, match="only 2 free"):
        BlockPool(2).get_new_blocks(3)
    with pytest.raises(ValueError, match="only 2 free"):
        ArrayBlockPool(2).get_new_blocks(3)
    with pytest.raises(AssertionError, match="not owned"):
        ArrayBlockPool(4).free_blocks([1])


@pytest.mark.parametrize("order", ["stack", "ring"])
def test_array_pool_orders(order):
    pool = ArrayBlockPool(5, order=order)
    a = pool.get_new_blocks(2)
    pool.free_blocks(a)
    b = pool.get_new_blocks(2)
    if order == "stack":
        assert b.tolist() == a.tolist()          # the freed blocks come back first, in the same order
    else:
        assert set(b.tolist()).isdisjoint(a.tolist())   # the ring moves on to never-used pages
    pool.check_invariants()


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(["stack", "ring"]), st.lists(st.integers(-4, 4), min_size=1, max_size=40))
def test_array_pool_accounting_survives_any_sequence(order, ops):
    pool = ArrayBlockPool(12, order=order)
    held: list[int] = []
    for op in ops:
        if op > 0 and pool.num_free_blocks >= op:
            held += pool.get_new_blocks(op).tolist()
        elif op < 0 and held:
            k = min(-op, len(held))
            pool.free_blocks(np.array(held[:k]))
            held = held[k:]
        assert pool.num_used_blocks == len(held) == len(set(held))
        pool.check_invariants()


class QueuePool:
    """vLLM's free queue as one ordered dict (the pool's previous implementation), for reference."""

    def __init__(self, n):
        from collections import OrderedDict
        self.queue, self.hash, self.cached, self.ref = OrderedDict.fromkeys(range(n)), [None] * n, {}, [0] * n

    def get_new_blocks(self, n):
        out = []
        for _ in range(n):
            b, _ = self.queue.popitem(last=False)
            h, self.hash[b] = self.hash[b], None
            if h is not None and self.cached.get(h) == b:
                del self.cached[h]
            self.ref[b] = 1
            out.append(b)
        return out

    def free_blocks(self, blocks):
        for b in blocks:
            self.ref[b] -= 1
            if not self.ref[b]:
                self.queue[b] = None
                if self.hash[b] is None:
                    self.queue.move_to_end(b, last=False)

    def touch(self, blocks):
        for b in blocks:
            if not self.ref[b]:
                del self.queue[b]
            self.ref[b] += 1

    def cache_blocks(self, blocks, hashes):
        for b, h in zip(blocks, hashes, strict=True):
            if self.hash[b] is None and h not in self.cached:
                self.hash[b], self.cached[h] = h, b


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["alloc", "free", "hash", "hit"]), st.integers(0, 6)), max_size=80))
def test_two_part_free_queue_hands_out_blocks_in_vllms_single_queue_order(ops):
    # the pool keeps its free queue as an unhashed stack and a hashed FIFO (revivals leave
    # tombstones); every allocation, eviction and cached-free count must match the one queue
    pool, ref = BlockPool(12, enable_caching=True), QueuePool(12)
    held = []                                          # groups of blocks, each owned by one "request"
    for op, x in ops:
        if op == "alloc" and x <= pool.num_free_blocks:
            got = pool.get_new_blocks(x)
            assert got == ref.get_new_blocks(x)
            held.append(got)
        elif op == "free" and held:
            group = held.pop(x % len(held))
            pool.free_request_blocks(group)
            ref.free_blocks(reversed(group))
        elif op == "hash" and held:
            group = held[x % len(held)]
            keys = [f"h{(x + i) % 5}" for i in range(len(group))]     # repeats: first copy kept
            pool.cache_blocks(group, keys)
            ref.cache_blocks(group, keys)
        elif op == "hit":
            hit = pool.lookup(f"h{x % 5}")
            assert hit == ref.cached.get(f"h{x % 5}")
            if hit is not None:
                pool.touch([hit])
                ref.touch([hit])
                held.append([hit])
        assert pool.free_block_ids() == list(ref.queue)
        assert pool.num_cached_free_blocks == sum(1 for b in ref.queue if ref.hash[b] is not None)
        assert pool.next_free_blocks(3) == list(ref.queue)[:3]
        pool.check_invariants()


class RecordingSink:
    """A KVEventSink (sim/core/protocols.py) keeping what it is told, in order."""

    def __init__(self):
        self.events = []

    def stored(self, req, first_block, block_hashes, parent_hash):
        self.events.append(("stored", req.request_id, first_block, list(block_hashes), parent_hash))

    def removed(self, block_hashes):
        self.events.append(("removed", list(block_hashes)))


def _run_shared_prefixes(sink):
    """Requests sharing prefixes through the real scheduler and engine loop on a tiny pool (evictions)."""
    from kvsim.sim.core.kv_manager import KVCacheManager
    from kvsim.sim.core.request import Request
    from kvsim.sim.core.scheduler import Scheduler, SchedulerConfig
    from kvsim.sim.engine.loop import EngineClock, EngineReplica
    from kvsim.sim.model.cost_model import CostModel
    from kvsim.sim.results.metrics import StepLog
    from kvsim.sim.simulator.executor import EXECUTORS

    kv = KVCacheManager(30, 16, enable_caching=True)
    if sink is not None:
        kv.attach_events(sink)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512, max_model_len=4096), kv)
    env = EngineClock(event_per_step=True)
    rep = EngineReplica(env, 0, sched, EXECUTORS["cost_model"](CostModel("smollm2-135m", "l4"), kv), StepLog(None))
    reqs = []
    for i in range(12):
        ids = (1, 2, 3, 100 + i // 3, 200 + i)       # 64-token prompt blocks: a shared head, groups of three
        reqs.append(Request(i, 0.05 * i, 5 * 64, 20, prefix_hash_ids=ids, prefix_block_tokens=64))
    for r in reqs:
        env.timeout(r.arrival_time).callbacks.append(lambda _e, r=r: rep.submit(r))
    env.run()
    return kv, reqs


def test_kv_event_sink_replays_into_the_prefix_cache_index():
    sink = RecordingSink()
    kv, reqs = _run_shared_prefixes(sink)
    index, chains, owner, chained_to_another = {}, {}, {}, 0
    for ev in sink.events:
        if ev[0] == "stored":
            _, rid, first, hashes, parent = ev
            own = chains.setdefault(rid, {})
            assert (parent is None) == (first == 0)
            if first - 1 in own:
                assert parent == own[first - 1]
            chained_to_another += parent is not None and owner.get(parent, rid) != rid
            for k, h in enumerate(hashes):
                own[first + k], owner[h] = h, rid
                assert h not in index, "stored twice without a removal"
                index[h] = rid
        else:
            for h in ev[1]:
                assert index.pop(h, None) is not None, "removed a hash never stored"
    assert set(index) == set(kv.pool.cached)
    assert any(ev[0] == "removed" for ev in sink.events), "the tiny pool evicts cached blocks"
    assert kv.prefix_lookups.hits > 0
    assert chained_to_another, "a request that hit another's prefix stores its own blocks chained to that prefix"
    # the hooks change nothing: the same run without a sink gives the same token times
    _, plain = _run_shared_prefixes(None)
    assert [r.token_times for r in reqs] == [r.token_times for r in plain]
