"""vLLM v1 scheduler semantics pinned on small hand-built cases."""
import pytest

from kvsim.sim.core.kv_manager import KVCacheManager
from kvsim.sim.core.request import Request, RequestStatus
from kvsim.sim.core.scheduler import Scheduler, SchedulerConfig


def make(num_blocks=100, block_size=4, caching=False, **cfg):
    cfg.setdefault("max_model_len", 10_000)
    return Scheduler(SchedulerConfig(**cfg), KVCacheManager(num_blocks, block_size, enable_caching=caching))


def req(i, prompt, output, arrival=0.0, **kw):
    return Request(request_id=i, arrival_time=arrival, prompt_tokens=prompt, max_output_tokens=output, **kw)


def step(s, now=0.0):
    out = s.schedule()
    s.update(out, now)
    return out


def chunks(out):
    return {x.request.request_id: x.num_new_tokens for x in out.scheduled}


def test_chunked_prefill_follows_the_token_budget():
    s = make(max_num_batched_tokens=100)
    s.add_request(req(0, 250, 3))
    assert [chunks(step(s))[0] for _ in range(3)] == [100, 100, 50]
    r = s.running[0]
    assert r.num_output_tokens == 1 and r.num_computed_tokens == 250
    assert chunks(step(s)) == {0: 1}                  # then one decode token per step


def test_long_prefill_threshold_caps_each_chunk_while_others_wait_or_run():
    s = make(max_num_batched_tokens=1000, long_prefill_token_threshold=64)
    s.add_request(req(0, 150, 2))
    s.add_request(req(1, 10, 9))
    assert [chunks(step(s))[0] for _ in range(3)] == [64, 64, 22]


def test_long_prefill_threshold_is_lifted_for_a_request_alone():
    """vLLM: the cap keeps a long prefill from starving others; with nobody to starve it is off."""
    s = make(max_num_batched_tokens=1000, long_prefill_token_threshold=64)
    s.add_request(req(0, 150, 2))
    assert chunks(step(s)) == {0: 150}


def test_admission_needs_blocks_for_the_whole_prompt():
    """vLLM's scheduler_reserve_full_isl: a waiting request is admitted only when the free pool holds
    its whole prompt, not just its first chunk (admitting on the first chunk thrashes under pressure)."""
    s = make(num_blocks=21, block_size=4, max_num_batched_tokens=16)      # 20 usable blocks
    s.add_request(req(0, 16, 50))
    step(s)                                            # r0 prefilled: 4 blocks
    s.add_request(req(1, 64, 2))                       # its 15-token first chunk would fit, its 16 blocks do not
    out = step(s)                                      # r0's decode takes a 5th block: 15 free
    assert chunks(out) == {0: 1} and len(s.waiting) == 1


def test_block_zero_is_the_reserved_null_block():
    s = make(num_blocks=10)
    assert s.kv.pool.num_free_blocks == 9 and s.kv.num_gpu_blocks == 10
    with pytest.raises(ValueError, match="null block"):
        make(num_blocks=1)


def test_priority_victim_is_the_least_urgent_latest_arrival():
    """Equal (priority, arrival time) requests are ordered by submission, as vLLM's wall-clock
    arrival times order them: the later submitted one is preempted first."""
    s = make(num_blocks=9, block_size=4, policy="priority", max_num_batched_tokens=64)
    for i in range(3):
        s.add_request(req(i, 8, 20, priority=1))          # 2 blocks each; 8 usable
    step(s)
    for _ in range(4):
        out = step(s)
        if out.preempted:
            break
    assert [r.request_id for r in out.preempted] == [2]


def test_running_requests_are_served_before_waiting_ones():
    s = make(max_num_batched_tokens=100)
    s.add_request(req(0, 90, 5))
    step(s)                                           # r0 prefilled
    s.add_request(req(1, 300, 5))
    out = step(s)
    assert chunks(out) == {0: 1, 1: 99}               # decode first, the rest of the budget to r1


def test_max_num_seqs_limits_admission():
    s = make(max_num_seqs=2)
    for i in range(3):
        s.add_request(req(i, 10, 5))
    out = step(s)
    assert sorted(chunks(out)) == [0, 1]
    assert len(s.waiting) == 1


def test_no_chunking_when_disabled_waits_for_budget():
    s = make(max_num_batched_tokens=100, enable_chunked_prefill=False)
    s.add_request(req(0, 60, 5))
    s.add_request(req(1, 60, 5))
    assert sorted(chunks(step(s))) == [0]             # r1 does not fit the remaining 40 tokens


def test_preemption_evicts_most_recently_admitted_and_blocks_admission():
    # 8 blocks of 4 tokens; each request alone fits (27 slots at its end), both together do not.
    s = make(num_blocks=8, block_size=4)
    a, b = req(0, 8, 20), req(1, 8, 20)
    s.add_request(a)
    s.add_request(b)
    step(s)
    assert [r.request_id for r in s.running] == [0, 1]
    late = req(2, 4, 5)
    for _ in range(12):
        order = list(s.running)
        if s.kv.pool.num_free_blocks == 0 and late not in s.waiting:
            s.add_request(late)                       # waiting while memory is exhausted
        out = step(s)
        if out.preempted:
            break
    assert out.preempted == [order[-1]] == [b]        # the most recently admitted running request
    assert b.status == RequestStatus.WAITING and b.num_computed_tokens == 0 and b.num_preemptions == 1
    assert list(s.waiting)[0] is b                    # back at the head of WAITING
    assert set(chunks(out)) <= {r.request_id for r in order}   # nothing admitted in that step
    assert late.status == RequestStatus.WAITING


def test_the_last_running_request_preempts_itself():
    s = make(num_blocks=8, block_size=4)
    a, b = req(0, 16, 10), req(1, 12, 10)
    s.add_request(a)
    s.add_request(b)
    step(s)                                           # 4 + 3 blocks; 1 left
    out = step(s)                                     # a takes the last block for token 17; b has none
    assert out.preempted == [b] and chunks(out) == {0: 1}
    assert a.status == RequestStatus.RUNNING and b.num_computed_tokens == 0


def test_requests_that_can_never_fit_are_rejected_with_a_reason():
    s = make(num_blocks=4, block_size=4, max_model_len=64)             # 3 usable blocks
    assert not s.add_request(req(0, 64, 10))
    assert "max_model_len=64" in s.rejected[0].reject_reason
    assert not s.add_request(req(1, 10, 10))          # 19 slots at its last token > 12 (3 usable blocks)
    assert "whole KV pool holds 12 tokens" in s.rejected[1].reject_reason
    ok = req(2, 10, 3)
    assert s.add_request(ok)                          # 12 slots: fits exactly
    capped = req(3, 10, 100)
    s2 = make(num_blocks=100, block_size=4, max_model_len=64)
    assert s2.add_request(capped) and capped.max_output_tokens == 54


def test_priority_mode_orders_waiting_and_preempts_lowest_priority():
    s = make(num_blocks=8, block_size=4, policy="priority", max_num_seqs=2)
    low, high, mid = req(0, 8, 20, priority=5), req(1, 8, 20, priority=0, arrival=1.0), req(2, 4, 3, priority=1)
    for r in (low, high, mid):
        s.add_request(r)
    out = step(s)
    assert sorted(chunks(out)) == [1, 2]              # priority 0 and 1 first
    for _ in range(20):
        out = step(s)
        if out.preempted:
            assert all(v.priority >= 1 for v in out.preempted)
            break


def test_swap_preemption_keeps_computed_tokens_and_counts_swap():
    s = make(num_blocks=8, block_size=4, preemption_mode="swap", swap_space_tokens=1000)
    a, b = req(0, 8, 20), req(1, 8, 20)
    s.add_request(a)
    s.add_request(b)
    step(s)
    for _ in range(12):
        out = step(s)
        if out.preempted:
            break
    assert out.preempted == [b] and out.swap_out_tokens == b.num_computed_tokens > 0
    assert b.swapped_tokens == b.num_computed_tokens
    for _ in range(40):
        out = step(s)
        if out.swap_in_tokens:
            break
    assert out.swap_in_tokens > 0 and b.status == RequestStatus.RUNNING


def test_prefix_cache_hits_shared_blocks_and_recomputes_the_last_token():
    s = make(num_blocks=50, block_size=4, caching=True)
    ids = (7, 8)                                      # two shared 4-token prefix chunks
    a = req(0, 8, 2, prefix_hash_ids=ids, prefix_block_tokens=4)
    s.add_request(a)
    step(s)
    step(s)                                           # a finishes; its blocks stay cached in the free queue
    assert a.status == RequestStatus.FINISHED
    b = req(1, 8, 2, prefix_hash_ids=ids, prefix_block_tokens=4)
    s.add_request(b)
    out = step(s)
    assert b.num_cached_tokens == 4                   # 8 tokens = 2 full blocks, but the last token recomputes
    assert chunks(out) == {1: 4}
    assert s.kv.prefix_lookups.hits == 4


def test_lru_evicts_the_tail_block_of_the_oldest_freed_request_first():
    s = make(num_blocks=5, block_size=4, caching=True)               # 4 usable blocks
    a = req(0, 8, 1, prefix_hash_ids=(1, 2), prefix_block_tokens=4)
    s.add_request(a)
    step(s)                                           # a done, blocks [b0, b1] cached, free
    pool = s.kv.pool
    assert pool.num_cached_free_blocks == 2
    twin = req(9, 8, 1, prefix_hash_ids=(1, 2), prefix_block_tokens=4)     # a's hashes (a dropped them)
    head_hash, tail_hash = (s.kv._block_hash(twin, j) for j in (0, 1))
    c = req(1, 12, 1)                                 # needs 3 blocks: 2 unhashed free + 1 evicted
    s.add_request(c)
    step(s)
    assert pool.num_cache_evictions == 1
    assert head_hash in pool.cached and tail_hash not in pool.cached


def test_invariants_hold_and_every_block_is_free_at_the_end():
    s = make(num_blocks=9, block_size=4)                              # 8 usable blocks
    for i in range(6):
        s.add_request(req(i, 5 + i, 6))
    for _ in range(200):
        if not s.has_work:
            break
        step(s)
        s.kv.check_invariants(set(s.running) | set(s.waiting))
    assert not s.has_work and len(s.finished) == 6
    assert s.kv.pool.num_free_blocks == 8
    assert all(r.num_output_tokens == 6 for r in s.finished)


def test_a_swap_in_that_cannot_fit_leaves_the_pool_untouched():
    # 6 blocks of 4: a holds 4 (15 prompt tokens + its first output), b comes back from swap with 8
    # tokens and needs 3 blocks for them and its next token; only 2 are free
    s = make(num_blocks=7, block_size=4, caching=True, preemption_mode="swap", swap_space_tokens=1000)  # 6 usable
    a = req(0, 15, 10)
    s.add_request(a)
    step(s)
    b = req(1, 8, 5)
    b.num_output_tokens, b.num_computed_tokens, b.swapped_tokens = 1, 8, 8
    s.swap_used_tokens = 8
    s.waiting.add(b)
    pool = s.kv.pool
    free_state = lambda: [(blk, pool.block_hash[blk]) for blk in pool.free_block_ids()]  # noqa: E731
    before = free_state()
    out = step(s)
    assert chunks(out) == {0: 1} and list(s.waiting) == [b]
    assert free_state() == before and pool.num_cached_free_blocks == 0      # same blocks, order, hashes
    assert b.swapped_tokens == b.num_computed_tokens == 8 and b not in s.kv.req_blocks


def test_a_request_that_preempts_itself_lets_the_more_urgent_ones_after_it_run():
    """vLLM ends the running loop there and runs an empty step; the next schedule runs the rest.
    kvsim reports both as one step (it used to give up: nothing schedulable)."""
    s = make(num_blocks=9, block_size=4, policy="priority")         # 8 usable
    x, y = req(0, 3, 10, priority=1), req(1, 27, 2, priority=0)
    s.add_request(x)
    step(s)
    s.add_request(y)
    step(s)                                           # running [x, y], every block taken
    assert s.running == [x, y] and s.kv.pool.num_free_blocks == 0
    out = step(s)                                     # x needs a block: the least urgent is x itself
    assert out.preempted == [x]
    assert chunks(out) == {1: 1}                      # before: nothing ran and the engine gave up


def test_without_chunked_prefill_a_request_beyond_the_step_budget_is_rejected():
    s = make(max_num_batched_tokens=100, enable_chunked_prefill=False)
    long_prompt, long_recompute, fits = req(0, 150, 5), req(1, 90, 20), req(2, 60, 41)
    assert not s.add_request(long_prompt) and not s.add_request(long_recompute)
    assert s.add_request(fits)
    assert long_prompt.status == RequestStatus.REJECTED
    assert "max_num_batched_tokens=100 and chunked prefill is off" in long_recompute.reject_reason


def test_finished_requests_keep_no_prefix_hash_state():
    s = make(num_blocks=50, block_size=4, caching=True)
    r = req(0, 16, 3, prefix_hash_ids=(7, 8), prefix_block_tokens=8)
    s.add_request(r)
    step(s)
    assert r.block_hashes                    # hashed while it runs (kept across preemptions)
    while r.status != RequestStatus.FINISHED:
        step(s)
    assert r.block_hashes is None and r.prefix_hash_ids is None
    hit = req(1, 16, 2, prefix_hash_ids=(7, 8), prefix_block_tokens=8)
    s.add_request(hit)
    step(s)
    assert hit.num_cached_tokens == 12                # its cached blocks still serve later requests
