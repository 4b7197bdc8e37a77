"""Lazy replica state (sim.engine.loop.LazyRouting): a fleet whose router reads replica state plans each
replica's decode runs past the fleet's arrivals and applies them when the router reads that replica or sends
it a request. The results must be those of cutting every replica's run at every arrival (the engine before
this change), bit for bit, and the reads answered from a plan must equal the state the replica has once
brought to now."""
import pandas as pd
import pytest

from kvsim.sim.cluster.connectors.offload import tier_occupancy
from kvsim.sim.config import load_config
from kvsim.sim.engine import assembly
from kvsim.sim.engine.assembly import build_engine, load_workload, trace_to_requests
from kvsim.sim.engine.bulk import decode_runs
from kvsim.sim.engine.loop import EngineReplica, LazyRouting
from kvsim.sim.engine.resolved_run import resolve_run
from kvsim.sim.results.metrics import StepLog
from kvsim.sim.simulator.executor import replica_parts
from kvsim.sim.simulator.simulate import offload_of

FLEETS = {
    # the speed check's fleet, small: precise prefix routing and a CPU tier on every replica
    "precise-prefix-cpu-tier": {"replicas": 6, "router": "precise_prefix", "kv_offload.cpu_gib": 1,
                                "engine.num_gpu_blocks": 1200, "trace_options.rate_scale": 3.0},
    # shared prefixes: the prefix-cache hits change as runs evict cached blocks
    "precise-prefix-shared-prefixes": {"trace": "mooncake-conversation", "replicas": 3, "router": "precise_prefix",
                                       "engine.num_gpu_blocks": 2500, "trace_options.rate_scale": 2.0},
    "least-outstanding-async": {"replicas": 4, "router": "least_outstanding", "engine.num_gpu_blocks": 3000,
                                "trace_options.rate_scale": 5.0},
    # stale signals: replicas are read at refresh instants only
    "prefix-affinity-stale-cpu-tier": {"replicas": 4, "router": "prefix_affinity", "router_options.refresh_s": 0.5,
                                       "kv_offload.cpu_gib": 1, "engine.num_gpu_blocks": 1200,
                                       "trace_options.rate_scale": 4.0},
    # LMCache's tiers: a disk per replica and the remote store they share (tiers.parquet: its own record)
    "session-affinity-disk-remote": {"trace": "mooncake-conversation", "replicas": 3, "router": "session_affinity",
                                     "kv_offload.cpu_gib": 0.5, "kv_offload.disk_gib": 4, "kv_offload.remote_gib": 16,
                                     "kv_offload.chunk_tokens": 256, "engine.num_gpu_blocks": 2500,
                                     "trace_options.rate_scale": 3.0},
    "kv-usage-stale": {"replicas": 4, "router": "kv_usage", "router_options.refresh_s": 0.2,
                       "engine.num_gpu_blocks": 3000, "trace_options.rate_scale": 4.0},
    # sync scheduling under memory pressure (preemptions), llm-d's weighted profile (reads every replica)
    "weighted-sync-memory-pressure": {"replicas": 3, "router": "weighted", "engine.async_scheduling": False,
                                      "engine.num_gpu_blocks": 700, "trace_options.rate_scale": 3.0},
    # the prefix scorers alone: read from the replicas' plans
    "weighted-prefix-sync-memory-pressure": {"trace": "mooncake-conversation", "replicas": 3, "router": "weighted",
                                             "router_options.weights": {"prefix": 2.0, "approx_prefix": 1.0},
                                             "engine.async_scheduling": False, "engine.num_gpu_blocks": 1500,
                                             "trace_options.rate_scale": 3.0},
    "dp-balance": {"replicas": 3, "router": "dp_balance", "engine.num_gpu_blocks": 3000, "trace_options.rate_scale": 4.0},
}


def fleet_run(sets: dict, lazy: bool, monkeypatch, max_requests: int = 100):
    sets = {"trace_options.max_requests": max_requests, "check_invariants": True, **sets}
    cfg = load_config(None, sets)
    trace = load_workload(cfg)
    plan = resolve_run(cfg, trace=trace)
    reqs = trace_to_requests(trace)
    log = StepLog(None)
    offload = offload_of(plan) if cfg.kv_offload is not None else None
    with monkeypatch.context() as m:
        if not lazy:                # the engine as it was: every replica's run cut at every arrival
            m.setattr(assembly, "reads_lazily", lambda *fleet: False)
        run = build_engine(plan, reqs, log, lambda i: replica_parts(plan, i), connector=offload)
        assert isinstance(run.arrivals.router, LazyRouting) is lazy
        assert run.drive(catch=()) is None
    frame = pd.DataFrame([(r.request_id, r.replica, r.status.name, r.first_scheduled_time, tuple(r.token_times),
                           r.finish_time, r.num_preemptions, r.num_cached_tokens) for r in reqs])
    steps = log.to_pandas().sort_values(["replica", "step"]).reset_index(drop=True)
    tiers = tier_occupancy(offload.made) if offload is not None else None
    return frame, steps, tiers


@pytest.mark.parametrize("name", FLEETS)
def test_lazy_fleet_gives_the_results_of_reading_every_replica_at_every_arrival(name, monkeypatch):
    lazy = fleet_run(FLEETS[name], True, monkeypatch)
    eager = fleet_run(FLEETS[name], False, monkeypatch)
    # (the prefix scorers alone send the Mooncake conversations, which share a prefix, to one replica)
    assert len(set(lazy[0][1])) == (1 if name.startswith("weighted-prefix") else FLEETS[name]["replicas"])
    pd.testing.assert_frame_equal(lazy[0], eager[0])
    pd.testing.assert_frame_equal(lazy[1], eager[1])
    if lazy[2] is not None:         # tiers.parquet: the tiers at each whole second, however often replicas polled
        pd.testing.assert_frame_equal(lazy[2], eager[2])
        assert lazy[2]["blocks_held"].max() > 0


@pytest.mark.parametrize("name,read", [("precise-prefix-cpu-tier", "outstanding"),
                                       ("precise-prefix-shared-prefixes", "outstanding"),
                                       ("precise-prefix-shared-prefixes", "hits"),
                                       ("weighted-prefix-sync-memory-pressure", "hits")])
def test_reads_from_a_plan_equal_the_state_brought_to_now(name, read, monkeypatch):
    """Each outstanding count (or prefix-cache hit list) read from a planned run equals what the replica
    holds once its run is cut and applied now (which is what the engine did at every arrival); the run
    then goes on with the replicas brought to now at those reads, with the same results."""
    checked = []
    planned = lambda rep: rep._planned is not None and rep._planned_rows is None  # noqa: E731
    real_outstanding, real_hits = EngineReplica.outstanding_now, EngineReplica.computed_blocks_now

    def outstanding(self):
        was_planned = planned(self)
        got = real_outstanding(self)
        self.sync()
        assert got == self.outstanding, (self.index, self.now)
        checked.append(was_planned)
        return got

    def hits(self, req):
        was_planned = planned(self)
        got = real_hits(self, req)
        self.sync()
        assert got == self.kv.get_computed_blocks(req), (self.index, self.now)
        checked.append(was_planned and bool(got))
        return got

    if read == "outstanding":
        monkeypatch.setattr(EngineReplica, "outstanding_now", outstanding)
    else:
        monkeypatch.setattr(EngineReplica, "computed_blocks_now", hits)
    checking = fleet_run(FLEETS[name], True, monkeypatch)
    monkeypatch.undo()
    assert sum(checked) >= 5, (sum(checked), len(checked))
    eager = fleet_run(FLEETS[name], False, monkeypatch)
    pd.testing.assert_frame_equal(checking[0], eager[0])


def test_lazy_runs_are_fewer_and_longer(monkeypatch):
    """The point of it: with precise prefix routing a replica's decode run no longer ends at every arrival."""
    counts = {}
    real = decode_runs.apply_decode_run
    for lazy in (True, False):
        runs = []

        def counting(sched, kv, run, runs=runs):
            runs.append(run.num_steps)
            return real(sched, kv, run)

        monkeypatch.setattr(decode_runs, "apply_decode_run", counting)
        fleet_run({"replicas": 8, "router": "precise_prefix", "trace_options.rate_scale": 4.0,
                   "check_invariants": False}, lazy, monkeypatch, max_requests=300)
        counts[lazy] = (len(runs), sum(runs))
    assert counts[True][1] > 0.9 * counts[False][1]          # most steps still taken in runs
    assert counts[True][0] < 0.5 * counts[False][0], counts  # in fewer than half as many runs


def test_which_fleets_read_lazily():
    for sets, lazy in (({"replicas": 4, "router": "precise_prefix"}, True),
                       ({"replicas": 4, "router": "round_robin"}, False),        # routed ahead instead
                       ({"replicas": 4, "router": "least_outstanding", "trace_options.max_concurrency": 8}, False),
                       ({"replicas": 4, "router": "least_outstanding", "fast_forward": False}, False),
                       ({"replicas": 1, "router": "least_outstanding"}, False)):
        cfg = load_config(None, {"trace_options.max_requests": 20, **sets})
        plan = resolve_run(cfg, trace=load_workload(cfg))
        run = build_engine(plan, trace_to_requests(load_workload(cfg)), StepLog(None),
                           lambda i, plan=plan: replica_parts(plan, i))
        assert isinstance(run.arrivals.router, LazyRouting) is lazy, sets
        assert run.drive(catch=()) is None


def test_cut_runs_are_the_runs_planned_with_that_arrival(monkeypatch):
    """decode_runs.steps_before / truncate_run: a run cut at an arrival is the run find_decode_run plans with
    that arrival as its next one (the premise of cutting a planned run instead of re-planning it)."""
    real = decode_runs.find_decode_run
    seen = []

    def comparing(view, sched, kv, executor, admitting=None):
        run = real(view, sched, kv, executor, admitting)
        if run is None or admitting is not None:
            return run
        # (a tiny last step: no horizon shortens the runs compared; a shorter run is exact too, but another run)
        view = view._replace(last_step_s=1e-9, max_steps=4096)
        long = real(view._replace(next_arrival=float("inf")), sched, kv, executor)
        if long is None or long.num_steps < 4:
            return run
        for t in ((long.starts[1] + long.starts[2]) / 2, long.starts[2], long.ends[-1]):
            short = real(view._replace(next_arrival=t), sched, kv, executor)
            cut = decode_runs.truncate_run(long, decode_runs.steps_before(long, t, sched.config.async_scheduling))
            assert short is not None and cut.num_steps == short.num_steps, t
            for field in ("starts", "ends", "allocs", "new_blocks", "finished", "last_step"):
                assert list(getattr(cut, field)) == list(getattr(short, field)), field
            assert cut.durations.tolist() == short.durations.tolist() and cut.batch.tolist() == short.batch.tolist()
        seen.append(long.num_steps)
        return run

    monkeypatch.setattr(decode_runs, "find_decode_run", comparing)
    for sync in (False, True):
        fleet_run({"replicas": 2, "router": "least_outstanding", "engine.async_scheduling": not sync,
                   "trace_options.rate_scale": 2.0, "check_invariants": False}, False, monkeypatch, max_requests=60)
    assert len(seen) >= 20
