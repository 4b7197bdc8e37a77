"""CPU KV offload as vLLM's OffloadingConnector runs it (sim/cluster/connectors/offload.py, the tier
model sim/cluster/tiers.py), run end to end through the real engine via build_engine: prefixes the GPU
prefix cache forgot come back from CPU after their PCIe transfer; stores are asynchronous and never
exceed the tier's capacity; the decode fast-forward gives exactly what stepping gives."""
import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared_documents import document_requests, request_frame  # tests/shared_documents.py

from kvsim.sim.cluster.connectors.offload import (OffloadingConnector, cpu_tier_spec, offload_connectors,
                                                  offload_summary)
from kvsim.sim.cluster.links import Link, LinkSpec
from kvsim.sim.cluster.tiers import BlockTier, TierSpec
from kvsim.sim.config import ConfigError, load_config
from kvsim.sim.core.request import Request, RequestStatus
from kvsim.sim.engine.assembly import build_engine, load_workload
from kvsim.sim.engine.resolved_run import resolve_run
from kvsim.sim.results.metrics import StepLog
from kvsim.sim.simulator.executor import replica_parts

# a GPU pool of 300 blocks (4,800 tokens): it forgets the documents between their reuses
SMALL_POOL = {"engine.num_gpu_blocks": 300, "engine.enable_prefix_caching": True, "trace_options.max_requests": 1}


def offload_documents(n: int = 60, seed: int = 3) -> list[Request]:
    """Requests over 8 documents of 1-3 thousand tokens (ids per 256 tokens) plus a question of their own."""
    return document_requests(n, seed, documents=8, chunks=(4, 12), mean_gap_s=0.15, max_output=64)


def offload_run(fast_forward: bool, cpu_gib: float | None = 4.0, replicas: int = 1, **overrides):
    sets = {**SMALL_POOL, "fast_forward": fast_forward, "check_invariants": True, "replicas": replicas, **overrides}
    if cpu_gib is not None:
        sets["kv_offload.cpu_gib"] = cpu_gib
    cfg = load_config(None, sets)
    plan = resolve_run(cfg, trace=load_workload(cfg))
    requests = offload_documents()
    log = StepLog(None)
    factory = (offload_connectors(cpu_tier_spec(plan.cfg.kv_offload, plan), plan.cfg.engine.block_size)
               if cpu_gib is not None else None)
    run = build_engine(plan, requests, log, lambda i: replica_parts(plan, i), connector=factory)
    assert run.drive(catch=()) is None
    return requests, log.to_pandas(), run, (factory.made if factory else [])


def test_cpu_hits_load_after_their_transfer_and_fast_forward_matches_stepping():
    reqs, steps, run, conns = offload_run(fast_forward=True)
    slow, slow_steps, _, _ = offload_run(fast_forward=False)
    pd.testing.assert_frame_equal(request_frame(reqs), request_frame(slow))
    cols = [c for c in steps.columns if c != "predicted_s"]
    pd.testing.assert_frame_equal(steps[cols], slow_steps[cols], check_dtype=False)
    assert all(r.status == RequestStatus.FINISHED for r in reqs)
    (conn,) = conns
    loaded = [r for r in reqs if r.num_external_computed_tokens]
    assert len(loaded) >= 10, "documents the GPU forgot must come back from CPU"
    bpb = conn.tier.spec.bytes_per_block
    for r in loaded:
        # (a request preempted after its load looks its blocks up again: its last load is its admission's)
        load = [t for t in r.route.transfers if t.kind == "load"][-1]
        assert load.num_tokens == r.num_external_computed_tokens and load.num_tokens % 16 == 0
        assert load.nbytes == load.num_tokens // 16 * bpb
        assert load.end_s >= load.start_s + conn.from_tier.spec.latency_s
        # the request waited in WAITING_FOR_REMOTE_KVS: no token of it while its blocks crossed PCIe
        assert not [t for t in r.token_times if load.start_s <= t <= load.end_s]
        # what was loaded had been stored, by an earlier request, before the load started
        stores = [t for q in reqs if q.route for t in q.route.transfers if t.kind == "store"]
        assert any(t.end_s <= load.start_s for t in stores)
    # a loaded request's prompt is computed minus its GPU hits and CPU tokens (plus what preemptions redo)
    fresh = sum(r.prompt_tokens for r in reqs) - sum(r.num_cached_tokens for r in reqs)
    redo = sum(r.num_preemptions * (r.prompt_tokens + r.max_output_tokens) for r in reqs)
    assert fresh <= steps["prefill_tokens"].sum() <= fresh + redo
    assert not run.replicas[0].kv.req_blocks and not run.replicas[0].scheduler.sending


def test_offload_cuts_recomputation_and_ttft_against_no_offload():
    with_cpu, steps_cpu, _, conns = offload_run(fast_forward=True)
    without, steps_none, _, _ = offload_run(fast_forward=True, cpu_gib=None)
    assert steps_cpu["prefill_tokens"].sum() < 0.8 * steps_none["prefill_tokens"].sum()
    ttft = lambda reqs: np.mean([r.token_times[0] - r.arrival_time for r in reqs])   # noqa: E731
    assert ttft(with_cpu) < ttft(without)
    s = offload_summary(conns)
    assert 0 < s["external_prefix_cache_hits"] <= s["external_prefix_cache_queries"]
    assert s["bytes_from_tier"] == s["blocks_loaded"] * s["bytes_per_block"]
    assert s["bytes_to_tier"] == s["blocks_stored"] * s["bytes_per_block"]


def test_a_small_tier_evicts_lru_and_never_exceeds_its_capacity():
    # 0.5 GiB: 256 blocks of 2 MiB (Llama-3.1-8B, bf16, 16 tokens): invariants checked at every step
    reqs, _, _, (conn,) = offload_run(fast_forward=True, cpu_gib=0.5)
    assert conn.tier.capacity == 256 and len(conn.tier) <= 256
    assert conn.tier.stats.blocks_evicted > 0 and conn.tier.stats.blocks_loaded > 0
    assert all(r.status == RequestStatus.FINISHED for r in reqs)


def test_a_store_larger_than_the_tier_is_dropped_as_vllm_drops_it():
    # 25 blocks: a prompt chunk of more than 25 new blocks cannot be made room for (prepare_store: None)
    reqs, _, _, (conn,) = offload_run(fast_forward=True, cpu_gib=0.05)
    assert conn.tier.capacity == 25 and len(conn.tier) <= 25
    assert conn.tier.stats.stores_dropped > 0
    assert all(r.status == RequestStatus.FINISHED for r in reqs)


def test_two_replicas_each_have_their_own_tier():
    reqs, steps, _, conns = offload_run(fast_forward=True, replicas=2)
    slow, slow_steps, _, _ = offload_run(fast_forward=False, replicas=2)
    pd.testing.assert_frame_equal(request_frame(reqs), request_frame(slow))
    assert len(conns) == 2 and conns[0].tier is not conns[1].tier
    assert all(c.tier.stats.blocks_stored for c in conns)


def test_lru_tier_semantics():
    tier = BlockTier(TierSpec("cpu", 3, 1.0, LinkSpec("pcie", 1.0)))
    assert tier.prepare_store(["a", "b"]) == ["a", "b"]
    assert tier.lookup(["a", "b"]) == 0                   # not ready until the store completes
    tier.complete_store(["a", "b"])
    assert tier.lookup(["a", "b", "c"]) == 2
    tier.prepare_load(["a"])                               # pinned, and now most recently used
    assert tier.prepare_store(["b", "c", "d"]) == ["c", "d"]   # b held already; evicts b? no: LRU unpinned is b
    assert "a" in tier.blocks and "b" not in tier.blocks
    # every block pinned or in flight: a further store is dropped, nothing evicted
    assert tier.prepare_store(["e"]) is None and tier.stats.stores_dropped == 1
    tier.complete_load(["a"])
    tier.check_invariants()


def test_bad_offload_settings_are_refused_in_one_line():
    with pytest.raises(ConfigError, match=r"kv_offload\.cpu_gib"):
        load_config(None, {"kv_offload.cpu_gib": -4})
    with pytest.raises(ConfigError, match=r"kv_offload\.bandwidth_gb_s"):
        load_config(None, {"kv_offload.cpu_gib": 4, "kv_offload.bandwidth_gb_s": "fast"})
    with pytest.raises(ConfigError, match=r"kv_offload\.eviction"):
        load_config(None, {"kv_offload.cpu_gib": 4, "kv_offload.eviction": "mru"})
    cfg = load_config(None, {**SMALL_POOL, "kv_offload.cpu_gib": 1e-6})
    with pytest.raises(ValueError, match=r"kv_offload\.cpu_gib: .* holds no KV block"):
        cpu_tier_spec(cfg.kv_offload, resolve_run(cfg))


def test_connector_alone_reports_stores_of_a_finished_request_when_they_end():
    spec = TierSpec("cpu", 100, 1e6, LinkSpec("pcie", 1.0))
    now = [0.0]
    conn = OffloadingConnector(BlockTier(spec), Link(spec.link), Link(spec.link), 16, lambda: now[0])
    req = Request(request_id=1, arrival_time=0.0, prompt_tokens=64, max_output_tokens=1,
                  prefix_hash_ids=(1, 2, 3, 4), prefix_block_tokens=16)

    class Out:
        preempted = []
        scheduled = [type("S", (), {"request": req, "num_new_tokens": 64})()]
    assert conn.build_connector_meta(Out) is None
    assert conn.next_completion() == 0.0                   # the stores start at the step's end
    now[0] = 0.01
    assert conn.request_finished(req) is True              # its blocks wait for the copy
    assert conn.get_finished(0.01).sent == []
    end = conn.next_completion()
    assert end == pytest.approx(0.01 + 4e6 / 1e9)
    assert conn.get_finished(end).sent == [req]
    assert conn.tier.lookup(conn.block_hashes(req, 4)) == 4     # visible to lookups once stored


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 8), st.lists(st.tuples(st.sampled_from(["store", "done", "load", "unload"]),
                                            st.lists(st.integers(0, 12), min_size=1, max_size=5)), max_size=60))
def test_tier_holds_its_invariants_under_random_operations(capacity, ops):
    """Never over capacity; a block in flight or being read is never evicted; only stored blocks load."""
    tier = BlockTier(TierSpec("cpu", capacity, 1.0, LinkSpec("pcie", 1.0)))
    in_flight: list = []           # stores prepared, not completed
    reading: list = []             # loads prepared, not completed
    ever_stored: set = set()
    for op, keys in ops:
        if op == "store":
            before = set(tier.blocks)
            new = tier.prepare_store(keys)
            if new is None:
                assert set(tier.blocks) == before                     # a dropped store changes nothing
            else:
                assert not set(new) & before
                gone = before - set(tier.blocks)
                assert not gone & (set(in_flight) | set(reading))     # pinned blocks survive eviction
                in_flight.extend(new)
        elif op == "done" and in_flight:
            key = in_flight.pop(0)
            tier.complete_store([key])
            ever_stored.add(key)
        elif op == "load":
            n = tier.lookup(keys)
            hit = list(dict.fromkeys(keys[:n]))
            assert set(hit) <= ever_stored
            tier.prepare_load(hit)
            reading.extend(hit)
        elif op == "unload" and reading:
            tier.complete_load([reading.pop(0)])
        tier.check_invariants()
        assert len(tier) <= capacity
