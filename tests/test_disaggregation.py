"""Prefill/decode disaggregation through `kvsim simulate` (config `fleet:`; docs/disaggregation.md): the
link catalog, fleet descriptions refused in one line, per-pool hardware resolved once, the TTFT split
per request, conditional disaggregation, and a randomized property test of the hand-off's invariants
(KV freed on both sides exactly once, no decode before its KV arrived)."""
import numpy as np
import pandas as pd
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvsim.sim.cli.simulate import parse_pool
from kvsim.sim.cluster.fleet import Handoff, PoolSpec, build_disaggregated, feed
from kvsim.sim.cluster.links import LinkSpec, get_link, handoff_link
from kvsim.sim.config import ConfigError, load_config
from kvsim.sim.core.request import Request, RequestStatus
from kvsim.sim.engine.assembly import EngineRun
from kvsim.sim.engine.loop import EngineClock, ReplicaOptions
from kvsim.sim.engine.resolved_run import resolve_run
from kvsim.sim.model.links import link_catalog
from kvsim.sim.results.metrics import StepLog
from kvsim.sim.simulator.executor import replica_parts
from kvsim.sim.simulator.simulate import run_simulation

SPLIT = ["prefill_queue_s", "prefill_s", "kv_wait_s", "transfer_s", "first_decode_s"]


def fleet_config(prefill=None, decode=None, **fleet):
    return load_config(None, {"trace": "azure-code-2023", "trace_options.max_requests": 40,
                              "fleet": {"prefill": prefill or {"replicas": 2}, "decode": decode or {"replicas": 2},
                                        **fleet}})


def test_link_catalog_gives_every_link_a_rate_latency_and_source():
    assert {"nvlink4", "ib-ndr", "ib-hdr", "roce-100g", "roce-200g", "roce-400g", "pcie-gen4", "pcie-gen5"} <= set(
        link_catalog())
    for name, entry in link_catalog().items():
        spec = get_link(name)
        assert spec.bandwidth_gb_s > 0 and spec.latency_s >= 0 and entry["source"]
    # 400 Gb/s NDR is 50 GB/s per direction; a transfer of 1 GB on it takes 20 ms plus its latency
    assert get_link("ib-ndr").seconds(1e9) == pytest.approx(0.02 + 5e-6)
    assert get_link("ib-ndr", bandwidth_gb_s=10.0).bandwidth_gb_s == 10.0
    with pytest.raises(ValueError, match="unknown link 'ib-xdr'; known: "):
        get_link("ib-xdr")


def test_tp_groups_move_kv_over_their_gpus_links_in_parallel():
    one = LinkSpec("ib", 50.0, 5e-6)
    assert handoff_link(one, 1, 1).bandwidth_gb_s == 50.0
    assert handoff_link(one, 2, 4).bandwidth_gb_s == 100.0      # re-sharding: the 2 prefill GPUs' links
    assert handoff_link(one, 4, 2).bandwidth_gb_s == 100.0
    assert handoff_link(one, 4, 4).latency_s == 5e-6


@pytest.mark.parametrize("fleet, message", [
    ({"prefill": {"gpu": "h999"}, "decode": {}}, "fleet.prefill.gpu: unknown gpu 'h999'"),
    ({"prefill": {}, "decode": {}, "link_bandwidth_gb_s": -1}, "fleet.link_bandwidth_gb_s: Input should be greater"),
    ({"prefill": {}, "decode": {}, "link": "ib-xdr"}, "fleet.link: unknown link 'ib-xdr'"),
    ({"prefill": {}, "mixed": {}, "decode": {}}, "fleet.mixed: Extra inputs are not permitted"),
    ({"prefill": {}}, "fleet.decode: Field required"),
    ({"prefill": {"replicas": 0}, "decode": {}}, "fleet.prefill.replicas: Input should be greater than 0"),
    ({"prefill": {"engine": {"block_size": 24}}, "decode": {}}, "fleet.prefill.engine: block_size: "),
])
def test_bad_fleet_descriptions_are_refused_in_one_line(fleet, message):
    with pytest.raises(ConfigError, match=message) as err:
        load_config(None, {"fleet": fleet})
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("pools, message", [
    ({"prefill": {"tp": 3}, "decode": {}}, "fleet.prefill: Llama-3.1-8B: tp=3 must divide num_heads=32"),
    ({"prefill": {}, "decode": {"gpu": "t4"}}, "fleet.decode: Llama-3.1-8B does not fit on T4"),
    ({"prefill": {"engine": {"block_size": 32}}, "decode": {}}, "engine.block_size differs between the pools"),
])
def test_pools_that_cannot_run_are_refused_before_the_run(pools, message, tmp_path):
    with pytest.raises(ConfigError, match=message) as err:
        run_simulation(fleet_config(**pools), tmp_path / "out")
    assert "\n" not in str(err.value) and not (tmp_path / "out").exists()


def test_pool_option_parses_gpu_tp_and_replicas():
    assert parse_pool("h100:tp1:x2", "--prefill-pool") == {"gpu": "h100", "tp": 1, "replicas": 2}
    assert parse_pool("h200:x3", "--decode-pool") == {"gpu": "h200", "replicas": 3}
    for bad in ("h100:tp0", "h100:tpx", "h100:x2:x3", ":tp1", "h100:2"):
        with pytest.raises(ConfigError, match="expected"):
            parse_pool(bad, "--prefill-pool")


def test_heterogeneous_fleet_runs_through_simulate_with_the_ttft_split(tmp_path):
    cfg = fleet_config({"gpu": "h100", "tp": 1, "replicas": 2}, {"gpu": "h200", "tp": 2, "replicas": 1},
                       link="roce-200g")
    result = run_simulation(cfg, tmp_path / "out")
    df = pd.read_parquet(tmp_path / "out" / "requests.parquet")
    steps = pd.read_parquet(tmp_path / "out" / "steps.parquet")
    assert (df["status"] == "finished").all() and len(df) == 40
    assert set(df["prefill_replica"]) == {0, 1} and set(df["replica"]) == {2}
    assert set(steps["replica"]) == {0, 1, 2}
    # the split adds up to the TTFT; each part is a real interval
    np.testing.assert_allclose(df[SPLIT].sum(axis=1), df["ttft_s"], rtol=0, atol=1e-9)
    assert (df[SPLIT] >= -1e-12).all().all() and (df["transfer_s"] > 0).all()
    # the decode side pulls the whole prompt at its own KV layout (H200 TP2 of an 8-KV-head model: no
    # replication, the model's bytes per token), over one 25 GB/s link (the TP1 side's single NIC)
    per_token = 2 * 32 * 8 * 128 * 2            # K and V x 32 layers x 8 KV heads x 128 dims x bf16
    assert (df["transfer_tokens"] == df["prompt_tokens"]).all()
    np.testing.assert_allclose(df["transfer_bytes"], df["prompt_tokens"] * per_token)
    handoff, pools = result.summary["handoff"], result.summary["pools"]
    assert handoff["link_bandwidth_gb_s"] == 25.0 and handoff["transfers"] == 40
    assert handoff["transfer_bytes"] == pytest.approx(df["transfer_bytes"].sum())
    # each pool resolved its own hardware: the H200's pool is larger, its TP halves the per-GPU KV
    assert pools["prefill"]["gpu"] == "H100-SXM" and pools["decode"]["gpu"] == "H200"
    assert pools["decode"]["num_gpu_blocks"] > 2 * pools["prefill"]["num_gpu_blocks"]
    assert pools["prefill"]["decode_tokens"] == 0 and pools["decode"]["prefill_tokens"] == 40
    # config.yaml reruns the same fleet
    again = run_simulation(load_config(tmp_path / "out" / "config.yaml"), tmp_path / "again")
    pd.testing.assert_frame_equal(result.requests.drop(columns="token_times_s"),
                                  again.requests.drop(columns="token_times_s"))


def test_conditional_disaggregation_prefills_short_prompts_on_the_decode_pool():
    cfg = fleet_config({"replicas": 1}, {"replicas": 1}, local_prefill_tokens=1500)
    df = run_simulation(cfg).requests
    local = ~df["disaggregated"]
    assert local.any() and (~local).any()
    # the decider: prompts up to the threshold (nothing cached on a trace without shared prefixes)
    assert (df.loc[local, "prompt_tokens"] <= 1500).all() and (df.loc[~local, "prompt_tokens"] > 1500).all()
    assert (df.loc[local, "transfer_bytes"] == 0).all() and (df.loc[local, "prefill_replica"] == -1).all()
    assert (df["status"] == "finished").all()
    # everything local: the prefill pool never runs
    all_local = run_simulation(fleet_config({"replicas": 1}, {"replicas": 1}, local_prefill_tokens=10**6))
    assert all_local.summary["pools"]["prefill"]["steps"] == 0 and all_local.summary["handoff"]["transfers"] == 0


def test_fleet_fast_forward_gives_what_stepping_gives_with_local_prefills():
    on = run_simulation(fleet_config({"replicas": 2}, {"replicas": 2}, local_prefill_tokens=1500))
    off = run_simulation(fleet_config({"replicas": 2}, {"replicas": 2}, local_prefill_tokens=1500).model_copy(
        update={"fast_forward": False}))
    pd.testing.assert_frame_equal(on.requests, off.requests)


def test_layerwise_overlap_hides_the_pull_behind_the_prefill_but_never_below_one_layer():
    """fleet.layerwise_overlap: the exposed transfer is latency + max(0, T - prefill) + T / layers (T the
    whole transfer on the link), never more than the plain pull's latency + T and never less than one
    layer's; off, the pull is the plain one and nothing about it is written."""
    kw = {"link": "roce-100g", "link_bandwidth_gb_s": 2.0}     # a slow link: transfers as long as prefills
    off = run_simulation(fleet_config({"replicas": 1}, {"replicas": 1}, **kw))
    on = run_simulation(fleet_config({"replicas": 1}, {"replicas": 1}, layerwise_overlap=True, **kw))
    a, b = off.requests.set_index("request_id"), on.requests.set_index("request_id").loc[off.requests["request_id"]]
    latency = get_link("roce-100g").latency_s
    whole = a["transfer_bytes"] / 2e9
    np.testing.assert_allclose(a["transfer_s"], latency + whole, rtol=1e-9)        # off: the plain pull
    layers = 32                                                                    # Llama-3.1-8B
    t = b["transfer_bytes"] / 2e9
    expected = latency + np.minimum(t, np.maximum(0.0, t - b["prefill_s"]) + t / layers)
    np.testing.assert_allclose(b["transfer_s"], expected, rtol=1e-9)
    assert (b["transfer_s"] >= latency + t / layers - 1e-12).all()                # at least one layer's transfer
    assert (b["transfer_s"] <= latency + t + 1e-12).all()
    assert (b["transfer_s"] < a["transfer_s"] - 1e-6).mean() > 0.5                # most pulls shrink
    assert b["ttft_s"].mean() < a["ttft_s"].mean()
    np.testing.assert_allclose(b[SPLIT].sum(axis=1), b["ttft_s"], rtol=0, atol=1e-9)
    assert on.summary["handoff"]["layerwise_overlap"] is True and "layerwise_overlap" not in off.summary["handoff"]
    assert "layerwise_overlap" not in fleet_config(**kw).model_dump()["fleet"]
    assert fleet_config(layerwise_overlap=True).model_dump()["fleet"]["layerwise_overlap"] is True


def test_fleet_off_writes_no_fleet_key():
    assert "fleet" not in load_config(None, {}).model_dump()


# --- randomized: the hand-off's invariants over random fleets and loads -------------------------------

PLAN = None


def small_plan():
    global PLAN
    if PLAN is None:
        PLAN = resolve_run(load_config(None, {"engine.num_gpu_blocks": 160, "engine.max_num_seqs": 8,
                                                 "engine.max_num_batched_tokens": 512}))
    return PLAN


requests_strategy = st.lists(st.tuples(st.floats(0, 0.5), st.integers(1, 1500), st.integers(1, 30)),
                             min_size=1, max_size=14)


def drive_and_check_handoffs(env, fleet, requests: list, proxy) -> list:
    """Run a disaggregated fleet to the end and check the hand-off invariants: every finished request decoded
    on a decode replica after its KV was pulled exactly once (none for a local prefill), and KV freed on both
    sides exactly once (nothing held, every block back in the free queue, no prefill leg still waiting for a
    pull). Returns (request, transfer) of every pulled request, for further checks."""
    feed(fleet, requests, proxy)
    assert EngineRun(env, fleet.replicas, fleet.arrivals, None, None).drive(catch=()) is None
    decode_ids = {r.index for p in fleet.pools if p.spec.role == "decode" for r in p.replicas}
    pulled = []
    for r in requests:
        assert r.status in (RequestStatus.FINISHED, RequestStatus.REJECTED)
        if r.status != RequestStatus.FINISHED:
            continue
        assert r.replica in decode_ids
        transfers = r.route.transfers if r.route else []
        if r.request_id in proxy.local:
            assert not transfers
        else:
            (xfer,) = transfers                                  # pulled exactly once
            assert r.token_times[0] > xfer.end_s                 # no decode before its KV arrived
            assert xfer.start_s >= r.route.hops[0].leave_s
            pulled.append((r, xfer))
    for replica in fleet.replicas:
        assert not replica.kv.req_blocks and not replica.scheduler.sending and not replica.scheduler.loading
        assert replica.kv.pool.num_free_blocks == replica.kv.pool.num_blocks
    for pool in fleet.pools:
        for conn in pool.connectors if pool.spec.role == "prefill" else ():
            assert not conn.handoffs and conn.next_completion() == float("inf")
    return pulled


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reqs=requests_strategy, prefill=st.integers(1, 2), decode=st.integers(1, 2),
       bandwidth=st.sampled_from([0.05, 1.0, 50.0]), local=st.sampled_from([0, 200]),
       fast_forward=st.booleans(), layers=st.sampled_from([0, 4]))
def test_handoff_invariants_hold_on_random_fleets(reqs, prefill, decode, bandwidth, local, fast_forward, layers):
    plan = small_plan()
    t, requests = 0.0, []
    for i, (gap, prompt, out) in enumerate(reqs):
        t += gap
        requests.append(Request(request_id=i, arrival_time=t, prompt_tokens=prompt, max_output_tokens=out))
    env, log = EngineClock(), StepLog(None)
    fleet, proxy = build_disaggregated(
        env, PoolSpec("p", "prefill", prefill, plan.scheduler), PoolSpec("d", "decode", decode, plan.scheduler),
        Handoff(LinkSpec("l", bandwidth, 1e-4), plan.cost.kv_bytes_per_token, local_prefill_tokens=local,
                layerwise_layers=layers), log,
        lambda spec, i, index: replica_parts(plan, index),
        ReplicaOptions(fast_forward=fast_forward, check_invariants=True))     # the engine's checks, every step
    drive_and_check_handoffs(env, fleet, requests, proxy)
