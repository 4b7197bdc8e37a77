"""The KV connector seam (sim/core/connector.py) and the cluster layer's fleets (sim/cluster/), run end to
end through the real engine: a prefix loaded from a shared remote store after a priced delay, and a
request handed from a prefill replica to a decode replica. Each runs with the decode fast-forward on
and must give exactly what stepping one step at a time gives, with the engine's invariants checked
at every step."""
import pandas as pd
import pytest

from shared_documents import document_requests, request_frame  # tests/shared_documents.py

from kvsim.sim.engine.assembly import EngineRun, load_workload, trace_to_requests
from kvsim.sim.cluster.connectors.remote_store import KVStore, RemoteStoreConnector
from kvsim.sim.cluster.fleet import Fleet, Handoff, PoolSpec, PoolWiring, build_disaggregated, build_pools, feed
from kvsim.sim.cluster.links import Link, LinkSpec
from kvsim.sim.config import load_config
from kvsim.sim.core.connector import KVTransferStep, step_seconds_with_transfer
from kvsim.sim.core.request import Request, RequestStatus
from kvsim.sim.engine.loop import EngineClock, ReplicaOptions
from kvsim.sim.simulator.executor import replica_parts
from kvsim.sim.results.metrics import StepLog
from kvsim.sim.engine.resolved_run import resolve_run

# 2 replicas: Llama-3.1-8B on H100 with a small pool (its prefix cache forgets), prefix caching on
STORE_RUN = {"engine.num_gpu_blocks": 400, "engine.enable_prefix_caching": True}
PD_RUN = {"trace_options.max_requests": 60, "engine.num_gpu_blocks": 3000}


def shared_prefix_requests(n: int = 70, seed: int = 7) -> list[Request]:
    """Requests on a few shared documents (2-4 chunks of 256 tokens each, ids as Mooncake's hash_ids)
    plus a question of their own, 10 a second, with short answers."""
    return document_requests(n, seed, documents=6, chunks=(2, 5), mean_gap_s=0.1, max_output=48)


def plan_and_requests(overrides):
    cfg = load_config(None, overrides)
    trace = load_workload(cfg)
    plan = resolve_run(cfg, trace=trace)
    return plan, trace_to_requests(trace)


def parts_of(plan):
    return lambda spec, i, index: replica_parts(plan, index)


def store_run(fast_forward: bool, load_async: bool = True, replicas: int = 2, overlap_layers: int = 1):
    plan, _ = plan_and_requests({**STORE_RUN, "trace_options.max_requests": 1})
    requests = shared_prefix_requests()
    env = EngineClock()
    log = StepLog(None)
    store = KVStore(chunk_tokens=256)
    link = Link(LinkSpec("store", bandwidth_gb_s=2.0, latency_s=0.002))
    spec = PoolSpec("mixed", "mixed", replicas, plan.scheduler, router="round_robin")

    def connector(spec, index):
        return RemoteStoreConnector(store, link, plan.cost.kv_bytes_per_token, lambda: env.now,
                                    load_async=load_async, overlap_layers=overlap_layers, name=f"replica{index}")

    fleet = Fleet(env, [])
    fleet.pools = build_pools(env, [spec], log, parts_of(plan), connector, lambda spec: PoolWiring(fleet.next_arrival),
                              ReplicaOptions(fast_forward=fast_forward, check_invariants=True))
    feed(fleet, requests, fleet.pools[0].router)
    run = EngineRun(env, fleet.replicas, fleet.arrivals, None, None)
    assert run.drive(catch=()) is None
    return requests, log.to_pandas(), fleet, link


def pd_run(fast_forward: bool, prefill: int = 1, decode: int = 1, bandwidth_gb_s: float = 25.0):
    plan, requests = plan_and_requests(PD_RUN)
    env = EngineClock()
    log = StepLog(None)
    link = Link(LinkSpec("rdma", bandwidth_gb_s=bandwidth_gb_s, latency_s=0.0005))
    fleet, proxy = build_disaggregated(env, PoolSpec("prefill", "prefill", prefill, plan.scheduler),
                                       PoolSpec("decode", "decode", decode, plan.scheduler),
                                       Handoff(link, plan.cost.kv_bytes_per_token), log, parts_of(plan),
                                       ReplicaOptions(fast_forward=fast_forward, check_invariants=True))
    feed(fleet, requests, proxy)
    run = EngineRun(env, fleet.replicas, fleet.arrivals, None, None)
    assert run.drive(catch=()) is None
    return requests, log.to_pandas(), fleet, link


def same_steps(a: pd.DataFrame, b: pd.DataFrame):
    cols = [c for c in a.columns if c != "predicted_s"]
    sa, sb = (x[cols].sort_values(["replica", "step"]).reset_index(drop=True) for x in (a, b))
    pd.testing.assert_frame_equal(sa, sb, check_dtype=False)


def test_transfer_adds_to_a_step_or_overlaps_it_layer_by_layer():
    assert step_seconds_with_transfer(0.010, None) == 0.010
    assert step_seconds_with_transfer(0.010, KVTransferStep(load_s=0.004)) == pytest.approx(0.014)
    # pipelined over 32 layers: the longer dominates, the shorter shows for one layer
    assert step_seconds_with_transfer(0.010, KVTransferStep(load_s=0.004, overlap_layers=32)) == pytest.approx(
        0.010 + 0.004 / 32)
    assert step_seconds_with_transfer(0.002, KVTransferStep(load_s=0.008, overlap_layers=4)) == pytest.approx(
        0.008 + 0.002 / 4)


def test_link_serves_transfers_in_order():
    link = Link(LinkSpec("pcie", bandwidth_gb_s=1.0, latency_s=0.001))
    assert link.reserve(0.0, 1e9) == (0.0, pytest.approx(1.001))
    start, end = link.reserve(0.5, 1e9)          # queued behind the first
    assert start == pytest.approx(1.001) and end == pytest.approx(2.002)
    with pytest.raises(ValueError, match="bandwidth_gb_s"):
        LinkSpec("bad", bandwidth_gb_s=-1.0)


def test_remote_store_loads_prefixes_after_their_delay_and_fast_forward_matches_stepping():
    reqs, steps, fleet, link = store_run(fast_forward=True)
    slow_reqs, slow_steps, _, _ = store_run(fast_forward=False)
    pd.testing.assert_frame_equal(request_frame(reqs), request_frame(slow_reqs))
    same_steps(steps, slow_steps)
    assert all(r.status == RequestStatus.FINISHED for r in reqs)
    loaded = [r for r in reqs if r.num_external_computed_tokens]
    assert len(loaded) >= 5, "the shared prefixes must come back from the store"
    for r in loaded:
        load = next(t for t in r.route.transfers if t.kind == "load")
        assert load.num_tokens == r.num_external_computed_tokens
        assert load.nbytes == pytest.approx(load.num_tokens * fleet.replicas[0].executor.cost.kv_bytes_per_token)
        # the request waited in WAITING_FOR_REMOTE_KVS: its first token comes after the load ended
        assert r.token_times[0] > load.end_s >= load.start_s + link.spec.latency_s
    assert link.bytes_moved > 0 and link.num_transfers >= len(loaded)
    # every finished request's blocks went back (the saves held some until they were done)
    for replica in fleet.replicas:
        assert not replica.kv.req_blocks and not replica.scheduler.sending and not replica.scheduler.loading


def test_loaded_tokens_are_not_computed_again():
    """The engine computes a loaded request's prompt minus what came from the store (and its local hits)."""
    reqs, steps, _, _ = store_run(fast_forward=True, replicas=1)
    prompt_total = sum(r.prompt_tokens for r in reqs)
    reused = sum(r.num_cached_tokens for r in reqs)        # local hits + external tokens, at first admission
    assert steps["prefill_tokens"].sum() == prompt_total - reused
    assert sum(r.num_external_computed_tokens for r in reqs) > 0


def test_synchronous_loads_lengthen_their_step():
    reqs, steps, _, _ = store_run(fast_forward=True, load_async=False, overlap_layers=1)
    slow_reqs, slow_steps, _, _ = store_run(fast_forward=False, load_async=False, overlap_layers=1)
    pd.testing.assert_frame_equal(request_frame(reqs), request_frame(slow_reqs))
    same_steps(steps, slow_steps)
    loaded = [r for r in reqs if r.num_external_computed_tokens]
    assert loaded
    assert all(r.status == RequestStatus.FINISHED for r in reqs)
    # a synchronous load's step ends after the load itself ended
    for r in loaded:
        load = next(t for t in r.route.transfers if t.kind == "load")
        assert r.token_times[0] >= load.end_s


def test_prefill_to_decode_handoff_through_the_engine():
    reqs, steps, fleet, link = pd_run(fast_forward=True)
    slow_reqs, slow_steps, _, _ = pd_run(fast_forward=False)
    pd.testing.assert_frame_equal(request_frame(reqs), request_frame(slow_reqs))
    same_steps(steps, slow_steps)
    prefill_ids = {r.index for r in fleet.pools[0].replicas}
    decode_ids = {r.index for r in fleet.pools[1].replicas}
    done = [r for r in reqs if r.status == RequestStatus.FINISHED]
    assert len(done) == len(reqs)
    for r in done:
        (p_hop, d_hop) = r.route.hops
        assert p_hop.replica in prefill_ids and d_hop.replica in decode_ids == {r.replica}
        (xfer,) = r.route.transfers
        assert xfer.kind == "prefill_to_decode"
        # the decode side pulls the whole prompt (no prefix of it is cached there), after the prefill
        # ended, and recomputes only its last token (for the first token's logits)
        assert xfer.num_tokens == r.num_external_computed_tokens == r.prompt_tokens
        assert r.num_cached_tokens == r.prompt_tokens - 1
        assert xfer.start_s >= p_hop.leave_s
        # no decode before the KV arrived; TTFT covers prefill, transfer and the first decode step
        assert r.token_times[0] > xfer.end_s
        assert len(r.token_times) == r.max_output_tokens
    # the prefill pool computed every prompt once; the decode pool recomputed one token per request
    by_pool = steps.assign(pool=steps["replica"].map(lambda i: "p" if i in prefill_ids else "d"))
    prefill_tokens = by_pool.groupby("pool")["prefill_tokens"].sum()
    assert prefill_tokens["p"] == sum(r.prompt_tokens for r in reqs)
    assert prefill_tokens["d"] == len(reqs)
    assert by_pool[by_pool.pool == "p"]["decode_tokens"].sum() == 0
    # KV freed on both sides exactly once (check_invariants ran every step; nothing left held)
    for replica in fleet.replicas:
        assert not replica.kv.req_blocks and not replica.scheduler.sending and not replica.scheduler.loading
        assert replica.kv.pool.num_free_blocks == replica.kv.pool.num_blocks


def test_a_slow_link_delays_first_tokens_not_the_prefill():
    fast, _, _, _ = pd_run(fast_forward=True, bandwidth_gb_s=50.0)
    slow, _, _, _ = pd_run(fast_forward=True, bandwidth_gb_s=0.5)
    f0 = {r.request_id: r for r in fast}
    later = [r.token_times[0] - f0[r.request_id].token_times[0] for r in slow]
    assert min(later) >= -1e-9 and sum(later) > 0
    assert all(r.route.hops[0].leave_s == f0[r.request_id].route.hops[0].leave_s for r in slow[:20])


def test_two_by_two_fleet_spreads_requests_over_both_pools():
    reqs, steps, fleet, _ = pd_run(fast_forward=True, prefill=2, decode=2)
    assert all(r.status == RequestStatus.FINISHED for r in reqs)
    assert set(steps["replica"]) == {0, 1, 2, 3}
    assert {r.route.hops[0].replica for r in reqs} == {0, 1}
    assert {r.replica for r in reqs} == {2, 3}
