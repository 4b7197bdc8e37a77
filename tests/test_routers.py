"""Routers behind the registry (sim/engine/routers): each picks what its scorer says on fake replicas
whose state the test sets, stale signals lag the state, and the KV-aware ones, run through the real
engine, route shared documents to where their prefix is cached (fast-forward == stepping)."""
from types import SimpleNamespace

import pandas as pd
import pytest

from shared_documents import document_requests  # tests/shared_documents.py

from kvsim.sim.config import ConfigError, load_config
from kvsim.sim.core.request import Request
from kvsim.sim.engine.assembly import build_engine, load_workload
from kvsim.sim.engine.routers import RouterBase, build_router, register_router, router_names
from kvsim.sim.engine.routers.prefix_affinity import leading_block_hashes
from kvsim.sim.engine.resolved_run import resolve_run
from kvsim.sim.results.metrics import StepLog
from kvsim.sim.simulator.executor import replica_parts


def fake(index, running=0, waiting=0, used=0, blocks=101, now=0.0):
    pool = SimpleNamespace(num_used_blocks=used, num_blocks=blocks)
    return SimpleNamespace(index=index, outstanding=running + waiting, now=now,
                           scheduler=SimpleNamespace(waiting=[None] * waiting), kv=SimpleNamespace(pool=pool))


def doc_request(i, doc, tokens=1000):
    return Request(request_id=i, arrival_time=0.0, prompt_tokens=tokens, max_output_tokens=4,
                   prefix_hash_ids=doc, prefix_block_tokens=256)


def test_registry_names_and_one_line_errors():
    assert {"round_robin", "least_outstanding", "queue_depth", "kv_usage", "prefix_affinity", "precise_prefix",
            "weighted"} <= set(router_names())
    with pytest.raises(ConfigError, match=r"^router: unknown router 'nope'; known: .*round_robin"):
        resolve_run(load_config(None, {"router": "nope"}))
    with pytest.raises(ConfigError, match=r"router_options\.weights: unknown scorer 'q'"):
        resolve_run(load_config(None, {"router": "weighted", "router_options.weights": {"q": 1}}))
    with pytest.raises(ConfigError, match=r"router_options\.weights"):
        load_config(None, {"router": "weighted", "router_options.weights": {"queue": "much"}})


def test_a_plug_in_router_registers_like_a_policy():
    @register_router("always_last")
    class AlwaysLast(RouterBase):
        def route(self, req):
            return self.replicas[-1]
    reps = [fake(0), fake(1)]
    assert build_router("always_last", reps).route(None) is reps[1]


def test_round_robin_and_least_outstanding():
    reps = [fake(0, running=3), fake(1, running=1), fake(2, running=1)]
    rr = build_router("round_robin", reps)
    assert [rr.route(None).index for _ in range(4)] == [0, 1, 2, 0]
    assert build_router("least_outstanding", reps).route(None).index == 1      # ties: lowest index


def test_queue_depth_and_kv_usage_scorers():
    reps = [fake(0, waiting=5, used=10), fake(1, waiting=1, used=90), fake(2, waiting=3, used=50)]
    assert build_router("queue_depth", reps).route(None).index == 1
    assert build_router("kv_usage", reps).route(None).index == 0


def test_stale_signals_lag_the_state_until_the_refresh():
    reps = [fake(0, waiting=0), fake(1, waiting=4)]
    router = build_router("queue_depth", reps, SimpleNamespace(refresh_s=1.0))
    assert router.route(None).index == 0
    reps[0].scheduler.waiting = [None] * 9                # replica 0 fills up: the router does not see it yet
    for r in reps:
        r.now = 0.5
    assert router.route(None).index == 0
    for r in reps:
        r.now = 1.0                                       # refreshed
    assert router.route(None).index == 1
    exact = build_router("queue_depth", reps)
    assert exact.route(None).index == 1


def test_prefix_affinity_sends_a_document_back_where_it_went():
    reps = [fake(0), fake(1), fake(2)]
    router = build_router("prefix_affinity", reps, SimpleNamespace(prefix_block_tokens=256, refresh_s=0.0,
                                                                 prefix_table_size=1000))
    a, b = (1, 2, 3, 4), (7, 8, 9, 10)
    first = router.route(doc_request(0, a))
    reps[first.index].outstanding = 5                    # it is now busier, but holds the document
    assert router.route(doc_request(1, a)) is first
    other = router.route(doc_request(2, b))              # a new document: the least loaded replica
    assert other is not first
    assert len(leading_block_hashes(doc_request(3, a), 256)) == 3      # 999 tokens: 3 full 256-token blocks


# ----- through the engine ---------------------------------------------------------------------------
def documents(n=80, seed=5):
    return document_requests(n, seed, documents=6, chunks=(4, 10), mean_gap_s=0.05, max_output=40)


def routed_run(router, fast_forward=True, **options):
    sets = {"engine.num_gpu_blocks": 600, "engine.enable_prefix_caching": True, "trace_options.max_requests": 1,
            "replicas": 3, "router": router, "fast_forward": fast_forward, "check_invariants": True}
    sets.update({f"router_options.{k}": v for k, v in options.items()})
    cfg = load_config(None, sets)
    plan = resolve_run(cfg, trace=load_workload(cfg))
    reqs = documents()
    run = build_engine(plan, reqs, StepLog(None), lambda i: replica_parts(plan, i))
    assert run.drive(catch=()) is None
    return reqs


def cached_share(reqs):
    return sum(r.num_cached_tokens for r in reqs) / sum(r.prompt_tokens for r in reqs)


@pytest.mark.parametrize("router, options", [("precise_prefix", {}), ("prefix_affinity", {"prefix_block_tokens": 256}),
                                             ("weighted", {"refresh_s": 0.5})])
def test_prefix_aware_routers_reuse_more_cache_than_round_robin(router, options):
    aware = routed_run(router, **options)
    slow = routed_run(router, fast_forward=False, **options)
    frame = lambda rs: pd.DataFrame([(r.request_id, r.replica, r.token_times[0], r.finish_time) for r in rs])  # noqa: E731
    pd.testing.assert_frame_equal(frame(aware), frame(slow))
    assert cached_share(aware) > cached_share(routed_run("round_robin")) + 0.05
    assert len({r.replica for r in aware}) > 1          # it still spreads documents over the replicas
