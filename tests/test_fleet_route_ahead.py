"""Fleets routed ahead (sim.engine.loop.RoutedAhead): a router that reads no replica state (round-robin)
decides before the run, so each replica's decode runs stop at its own arrivals only. The results must be
those of routing at each arrival (the engine before this change) and of stepping, bit for bit."""
import pandas as pd
import pytest

from kvsim.sim.config import load_config
from kvsim.sim.engine import assembly
from kvsim.sim.engine.assembly import build_engine, load_workload, trace_to_requests
from kvsim.sim.engine.bulk import decode_runs
from kvsim.sim.engine.loop import RoutedAhead
from kvsim.sim.engine.resolved_run import resolve_run
from kvsim.sim.engine.routers import RouterBase, register_router, routes_ahead
from kvsim.sim.results.metrics import StepLog
from kvsim.sim.simulator.executor import replica_parts
from kvsim.sim.simulator.simulate import offload_of

FLEETS = {
    # async scheduling (the default), 4 replicas under load
    "async": {"replicas": 4, "trace_options.rate_scale": 6.0},
    "sync-memory-pressure": {"replicas": 3, "engine.async_scheduling": False, "engine.num_gpu_blocks": 700,
                             "trace_options.rate_scale": 4.0},
    # the CPU tier: runs also stop at transfers and finishes (a connector on every replica)
    "cpu-tier": {"replicas": 4, "kv_offload.cpu_gib": 1, "engine.num_gpu_blocks": 900, "trace_options.rate_scale": 5.0},
    "prefix-caching-swap": {"trace": "mooncake-conversation", "replicas": 3, "engine.num_gpu_blocks": 2500,
                            "engine.preemption_mode": "swap", "trace_options.rate_scale": 2.0},
}


def fleet_run(sets: dict, ahead: bool, monkeypatch, fast_forward: bool = True):
    sets = {"trace_options.max_requests": 160, "router": "round_robin", "check_invariants": True,
            "fast_forward": fast_forward, **sets}
    cfg = load_config(None, sets)
    trace = load_workload(cfg)
    plan = resolve_run(cfg, trace=trace)
    reqs = trace_to_requests(trace)
    log = StepLog(None)
    with monkeypatch.context() as m:
        if not ahead:               # the engine as it was: every replica's next arrival is the fleet's next one
            m.setattr(assembly, "routes_ahead", lambda name: False)
        offload = offload_of(plan) if cfg.kv_offload is not None else None
        run = build_engine(plan, reqs, log, lambda i: replica_parts(plan, i),
                           connector=offload)
        assert isinstance(run.arrivals.router, RoutedAhead) is ahead
        assert run.drive(catch=()) is None
    frame = pd.DataFrame([(r.request_id, r.replica, r.status.name, r.first_scheduled_time, tuple(r.token_times),
                           r.finish_time, r.num_preemptions, r.num_cached_tokens) for r in reqs])
    steps = log.to_pandas().sort_values(["replica", "step"]).reset_index(drop=True)
    return frame, steps


@pytest.mark.parametrize("name", FLEETS)
def test_routed_ahead_gives_the_results_of_routing_at_each_arrival(name, monkeypatch):
    ahead = fleet_run(FLEETS[name], True, monkeypatch)
    before = fleet_run(FLEETS[name], False, monkeypatch)
    assert len({r for r in ahead[0][1]}) == FLEETS[name]["replicas"]
    pd.testing.assert_frame_equal(ahead[0], before[0])
    pd.testing.assert_frame_equal(ahead[1], before[1])


def test_routed_ahead_gives_the_results_of_stepping(monkeypatch):
    sets = FLEETS["cpu-tier"]
    ahead = fleet_run(sets, True, monkeypatch)
    stepped = fleet_run(sets, True, monkeypatch, fast_forward=False)
    pd.testing.assert_frame_equal(ahead[0], stepped[0])
    cols = [c for c in ahead[1].columns if c != "predicted_s"]
    pd.testing.assert_frame_equal(ahead[1][cols], stepped[1][cols], check_dtype=False)


def test_routed_ahead_runs_are_fewer_and_longer(monkeypatch):
    """The point of it: a replica's decode run no longer ends at other replicas' arrivals."""
    counts = {}
    real = decode_runs.find_decode_run
    for ahead in (True, False):
        runs = []

        def counting(*args, runs=runs, **kw):
            run = real(*args, **kw)
            if run is not None:
                runs.append(run.num_steps)
            return run

        monkeypatch.setattr(decode_runs, "find_decode_run", counting)
        fleet_run({"replicas": 8, "trace_options.rate_scale": 4.0, "trace_options.max_requests": 300,
                   "check_invariants": False}, ahead, monkeypatch)
        counts[ahead] = (len(runs), sum(runs))
    assert counts[True][1] > 0.9 * counts[False][1]          # most steps still taken in runs
    assert counts[True][0] < 0.5 * counts[False][0], counts  # in fewer than half as many runs


def test_which_routers_route_ahead(monkeypatch):
    assert routes_ahead("round_robin")
    for name in ("least_outstanding", "queue_depth", "kv_usage", "prefix_affinity", "precise_prefix",
                 "session_affinity", "weighted", "no-such-router"):
        assert not routes_ahead(name), name

    @register_router("test-ahead-first")
    class First(RouterBase):
        reads_replicas = False

        def route(self, req):
            return self.replicas[0]

    assert routes_ahead("test-ahead-first")
    frame, _ = fleet_run({"replicas": 2, "router": "test-ahead-first", "trace_options.max_requests": 40}, True,
                         monkeypatch)
    assert set(frame[1]) == {0}


def test_closed_loops_and_one_replica_are_not_routed_ahead():
    for sets in ({"replicas": 4, "trace_options.max_concurrency": 8}, {"replicas": 1}):
        cfg = load_config(None, {"trace_options.max_requests": 20, **sets})
        plan = resolve_run(cfg, trace=load_workload(cfg))
        reqs = trace_to_requests(load_workload(cfg))
        run = build_engine(plan, reqs, StepLog(None),
                           lambda i, plan=plan: replica_parts(plan, i))
        assert not isinstance(run.arrivals.router, RoutedAhead)
        assert run.drive(catch=()) is None


def test_routed_ahead_refuses_requests_out_of_order():
    cfg = load_config(None, {"trace_options.max_requests": 6, "replicas": 2})
    plan = resolve_run(cfg, trace=load_workload(cfg))
    reqs = trace_to_requests(load_workload(cfg))
    run = build_engine(plan, reqs, StepLog(None), lambda i: replica_parts(plan, i))
    ahead = run.arrivals.router
    assert ahead.route(reqs[0]).index == 0 and ahead.next_arrival(1) == reqs[1].arrival_time
    with pytest.raises(RuntimeError, match=f"request {reqs[2].request_id} arrived out of the trace's order"):
        ahead.route(reqs[2])


def test_cpu_tier_runs_go_on_past_finishes_that_keep_no_blocks(monkeypatch):
    """The CPU tier tells ahead which finishes keep their blocks (a store still copying them:
    FinishAwareConnector); a decode run goes on past the others, with the results of stepping."""
    from kvsim.sim.cluster.connectors.offload import OffloadingConnector
    from kvsim.sim.core.connector import FinishAwareConnector
    assert issubclass(OffloadingConnector, FinishAwareConnector)
    past = []
    real = decode_runs.find_decode_run

    def recording(*args, **kw):
        run = real(*args, **kw)
        if run is not None and any(run.finished[:-1]):
            past.append(run.num_steps)
        return run

    monkeypatch.setattr(decode_runs, "find_decode_run", recording)
    sets = {"replicas": 2, "kv_offload.cpu_gib": 1, "trace_options.rate_scale": 2.0, "trace_options.max_requests": 60,
            "check_invariants": False}
    fast = fleet_run(sets, True, monkeypatch)
    assert past, "no decode run went past a finish"
    stepped = fleet_run(sets, True, monkeypatch, fast_forward=False)
    pd.testing.assert_frame_equal(fast[0], stepped[0])
