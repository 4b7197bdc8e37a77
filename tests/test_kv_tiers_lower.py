"""LMCache's tiers behind the CPU (sim/cluster/connectors/offload.py's LowerTier): a local disk per replica
and a remote store the fleet shares, written through from the CPU and read back in LMCache's prefix
order, run end to end through the real engine with the invariants checked at every step."""
import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared_documents import document_requests, request_frame  # tests/shared_documents.py

from kvsim.sim.cli.options import parse_offload, tier_overrides
from kvsim.sim.cluster.connectors.offload import offload_summary
from kvsim.sim.cluster.links import LinkSpec
from kvsim.sim.cluster.tiers import BlockTier, TierSpec
from kvsim.sim.config import ConfigError, load_config
from kvsim.sim.core.request import RequestStatus
from kvsim.sim.engine.assembly import build_engine, load_workload
from kvsim.sim.engine.resolved_run import resolve_run
from kvsim.sim.results.metrics import StepLog
from kvsim.sim.simulator.executor import replica_parts
from kvsim.sim.simulator.simulate import offload_of

# a GPU pool of 300 blocks and a CPU tier of 0.25 GiB (8 chunks of 256 tokens): both forget the
# documents between their reuses; the disk and the remote store do not
SMALL = {"engine.num_gpu_blocks": 300, "engine.enable_prefix_caching": True, "trace_options.max_requests": 1,
         "kv_offload.cpu_gib": 0.25, "kv_offload.chunk_tokens": 256}


def tiered_run(fast_forward: bool = True, replicas: int = 1, **tiers):
    cfg = load_config(None, {**SMALL, "fast_forward": fast_forward, "check_invariants": True, "replicas": replicas,
                             **{f"kv_offload.{k}": v for k, v in tiers.items()}})
    plan = resolve_run(cfg, trace=load_workload(cfg))
    requests = document_requests(60, 3, documents=8, chunks=(4, 12), mean_gap_s=0.15, max_output=64)
    factory = offload_of(plan)           # the simulator's own connector factory for the run's kv_offload
    run = build_engine(plan, requests, StepLog(None), lambda i: replica_parts(plan, i), connector=factory)
    assert run.drive(catch=()) is None
    assert all(r.status == RequestStatus.FINISHED for r in requests)
    return requests, factory.made


def loads(requests, tier: str) -> list:
    return [t for r in requests if r.route for t in r.route.transfers if t.kind == "load" and t.source == tier]


def test_a_disk_serves_the_prefixes_the_cpu_forgot_and_fast_forward_matches_stepping():
    cpu_only, _ = tiered_run()
    with_disk, (conn,) = tiered_run(disk_gib=64)
    stepped, _ = tiered_run(fast_forward=False, disk_gib=64)
    pd.testing.assert_frame_equal(request_frame(with_disk), request_frame(stepped))
    disk = loads(with_disk, "disk")
    assert len(disk) >= 5 and not loads(cpu_only, "disk")
    external = lambda reqs: sum(r.num_external_computed_tokens for r in reqs)   # noqa: E731
    assert external(with_disk) > 1.5 * external(cpu_only)
    (path,) = conn.lower
    bpb = path.tier.spec.bytes_per_block
    for t in disk:
        # a disk read crosses the disk, then PCIe: at least both transfers' time
        assert t.num_tokens % 256 == 0 and t.nbytes == t.num_tokens // 256 * bpb
        assert t.end_s - t.start_s >= path.read.spec.seconds(t.nbytes) + conn.from_tier.spec.seconds(t.nbytes) - 1e-12
    s = offload_summary([conn])["lower_tiers"]["disk"]
    assert s["blocks_loaded"] == sum(t.num_tokens for t in disk) // 256
    assert s["bytes_written"] == s["blocks_stored"] * bpb and s["bytes_read"] == s["blocks_loaded"] * bpb
    assert s["blocks_held"] <= s["capacity_blocks"] and not s["shared"]


def test_the_remote_store_is_shared_one_replica_reads_what_another_wrote():
    reqs, conns = tiered_run(replicas=2, remote_gib=64)
    assert conns[0].lower[0].tier is conns[1].lower[0].tier          # one store
    assert conns[0].tier is not conns[1].tier                        # each its own CPU
    remote = loads(reqs, "remote")
    assert remote
    # a replica loads chunks its own CPU never stored: another replica wrote them through
    readers = {t.destination for t in remote}
    writers = {t.source for r in reqs if r.route for t in r.route.transfers if t.kind == "store"}
    assert readers and readers <= writers
    s = offload_summary(conns)["lower_tiers"]["remote"]
    assert s["shared"] and s["capacity_blocks"] == conns[0].lower[0].tier.capacity
    # a remote read is written back into the reader's CPU (LMCache's write-back)
    assert 0 < s["blocks_written_back_to_cpu"] <= s["blocks_loaded"]


def test_a_written_through_block_is_readable_only_once_its_write_ends():
    tier = BlockTier(TierSpec("disk", 2, 1.0, LinkSpec("disk-write", 1.0)))
    assert tier.place(["a", "b"]) == ["a", "b"]
    tier.ready_at(["a", "b"], 5.0)
    assert tier.lookup(["a", "b"], now=4.9) == 0 and tier.lookup(["a", "b"], now=5.0) == 2
    tier.prepare_load(["a"], now=5.0)                 # pinned while read: the next store evicts b
    assert tier.place(["c"]) == ["c"] and "b" not in tier.blocks and tier.stats.blocks_evicted == 1
    tier.ready_at(["c"], 6.0)
    tier.check_invariants()


def test_offload_tiers_on_the_command_line_and_bad_settings_refused_in_one_line():
    assert parse_offload("cpu:64GiB,disk:1TiB,remote:10TiB") == {"cpu": 64, "disk": 1024, "remote": 10240}
    assert tier_overrides("cpu:8GiB,disk:0") == {"kv_offload.cpu_gib": 8}
    for bad, said in (("disk:1TiB", "give cpu:SIZE first"), ("cpu:8GiB,ssd:1TiB", "expected cpu:SIZE"),
                      ("cpu:0,disk:1TiB", "needs a CPU tier"), ("cpu:8GiB,disk:1TiB,disk:2TiB", "each tier once")):
        with pytest.raises(ConfigError, match=said):
            parse_offload(bad)
    with pytest.raises(ConfigError, match=r"kv_offload\.chunk_tokens: 100 is not a multiple of engine\.block_size"):
        load_config(None, {"kv_offload.cpu_gib": 4, "kv_offload.chunk_tokens": 100})
    with pytest.raises(ConfigError, match=r"kv_offload\.remote_link: .*unknown link 'wifi'"):
        load_config(None, {"kv_offload.cpu_gib": 4, "kv_offload.remote_gib": 100, "kv_offload.remote_link": "wifi"})
    with pytest.raises(ConfigError, match=r"kv_offload\.disk_read_gb_s"):
        load_config(None, {"kv_offload.cpu_gib": 4, "kv_offload.disk_gib": 100, "kv_offload.disk_read_gb_s": 0})


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 8), st.lists(st.tuples(st.sampled_from(["place", "load", "unload"]),
                                            st.lists(st.integers(0, 12), min_size=1, max_size=5),
                                            st.floats(0, 2)), max_size=60))
def test_a_written_through_tier_holds_its_invariants_under_random_operations(capacity, ops):
    """Never over capacity; a block being read is never evicted; a lookup at `now` sees only blocks whose
    write ended by then."""
    tier = BlockTier(TierSpec("remote", capacity, 1.0, LinkSpec("roce-100g", 1.0)))
    now, written, reading = 0.0, {}, []
    for op, keys, dt in ops:
        now += dt
        if op == "place":
            before = set(tier.blocks)
            new = tier.place(keys)
            if new is not None:
                assert not (before - set(tier.blocks)) & set(reading)     # pinned blocks survive eviction
                tier.ready_at(new, now + 1.0)
                written.update({k: now + 1.0 for k in new})
        elif op == "load":
            hit = list(dict.fromkeys(keys[:tier.lookup(keys, now)]))
            assert all(written[k] <= now for k in hit)
            tier.prepare_load(hit, now)
            reading.extend(hit)
        elif op == "unload" and reading:
            tier.complete_load([reading.pop(0)])
        tier.check_invariants()
        assert len(tier) <= capacity


def test_lmcache_loads_and_saves_inside_the_step_and_fast_forward_matches_stepping():
    """connector lmcache: a CPU hit is scheduled at once and the step that computes the rest of its prompt
    waits for the load (no WAITING_FOR_REMOTE_KVS); the chunks a step fills are saved before the next step."""
    in_step, (conn,) = tiered_run(connector="lmcache")
    stepped, _ = tiered_run(fast_forward=False, connector="lmcache")
    pd.testing.assert_frame_equal(request_frame(in_step), request_frame(stepped))
    assert conn.in_step and conn.block_size == 256
    loaded = [r for r in in_step if r.num_external_computed_tokens]
    assert loaded
    for r in loaded:
        load = [t for t in r.route.transfers if t.kind == "load"][-1]
        assert r.token_times[0] >= load.end_s                  # its first token after the load it waited for
    beside, _ = tiered_run()
    first = lambda reqs: np.mean([r.token_times[0] - r.arrival_time for r in reqs])   # noqa: E731
    assert first(in_step) != first(beside)
    assert not any(conn._storing.values()) and not conn._pending and not conn._loads


def test_tiers_parquet_gives_each_tiers_occupancy_over_time(tmp_path):
    from kvsim.sim.simulator.simulate import run_simulation
    cfg = load_config(None, {**SMALL, "trace": "mooncake-conversation", "trace_options.max_requests": 120,
                             "replicas": 2, "kv_offload.disk_gib": 1, "kv_offload.remote_gib": 4})
    s = run_simulation(cfg, tmp_path / "run").summary["kv_offload"]
    tiers = pd.read_parquet(tmp_path / "run" / "tiers.parquet")
    assert list(tiers["tier"].unique()) == ["cpu", "disk", "remote"]
    for _, rows in tiers.groupby("tier"):
        held = rows["blocks_held"].to_numpy()
        assert (np.diff(rows["time_s"].to_numpy()) == 1.0).all()      # one row a second
        assert (held <= rows["capacity_blocks"].to_numpy()).all() and held.max() > 0
        assert (np.diff(held) >= 0).all()           # a tier only evicts to make room: what it holds never shrinks
    last = tiers.groupby("tier")["blocks_held"].last()
    lower = s["lower_tiers"]
    assert last["disk"] == lower["disk"]["blocks_held"] and last["remote"] == lower["remote"]["blocks_held"]
    assert tiers[tiers["tier"] == "disk"]["capacity_blocks"].iloc[0] == lower["disk"]["capacity_blocks"]
    assert tiers[tiers["tier"] == "remote"]["capacity_blocks"].iloc[0] == lower["remote"]["capacity_blocks"]


def test_a_preempted_request_gets_its_stored_blocks_back_from_the_cpu_tier():
    """vLLM v1 has no swap: a preempted request is recomputed, except the blocks the CPU tier stored, which
    its re-admission loads (the tier is where swapped KV goes in v1); swap mode with a tier is refused."""
    from kvsim.sim.engine.assembly import build_engine as build

    def run(cpu_gib):
        sets = {"engine.num_gpu_blocks": 400, "engine.enable_prefix_caching": True, "trace_options.max_requests": 1,
                "check_invariants": True, **({"kv_offload.cpu_gib": cpu_gib} if cpu_gib else {})}
        cfg = load_config(None, sets)
        plan = resolve_run(cfg, trace=load_workload(cfg))
        reqs = document_requests(40, 5, documents=8, chunks=(4, 10), mean_gap_s=0.05, max_output=800)
        log = StepLog(None)
        assert build(plan, reqs, log, lambda i: replica_parts(plan, i),
                     connector=offload_of(plan) if cpu_gib else None).drive(catch=()) is None
        return reqs, log.to_pandas()

    tiered, steps = run(4)
    plain, plain_steps = run(None)
    preempted = [r for r in tiered if r.num_preemptions]
    assert preempted and sum(r.num_external_computed_tokens for r in preempted) > 0
    assert steps["prefill_tokens"].sum() < plain_steps["prefill_tokens"].sum()
    with pytest.raises(ConfigError, match="vLLM v1 has no swap.*expected recompute, got swap"):
        load_config(None, {"kv_offload.cpu_gib": 4, "engine.preemption_mode": "swap"})
