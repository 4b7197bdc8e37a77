"""Several pools of one role in a disaggregated fleet (xPyD over GPU types and TP; docs/disaggregation.md,
"Several pools of a role"): fleet descriptions refused in one line, the proxy's pool choices (least_work,
round_robin over instances as vLLM's toy proxy), pulls priced per pool pair (link type per pair, lanes from
both TPs, bytes from each decode pool's KV layout), outputs per pool, and a randomized property test of the
hand-off's invariants over random multi-pool fleets."""
import numpy as np
import pandas as pd
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvsim.dashboard.data import RunRecord
from kvsim.dashboard.fleet import fleet_view, replica_labels
from kvsim.sim.cli.simulate import fleet_overrides
from kvsim.sim.cluster.fleet import Handoff, PoolSpec, build_disaggregated
from kvsim.sim.cluster.links import LinkSpec, get_link
from kvsim.sim.cluster.pool_choice import make_pool_choice, pool_choice_names
from kvsim.sim.config import ConfigError, load_config
from kvsim.sim.core.request import Request
from kvsim.sim.engine.loop import EngineClock, ReplicaOptions
from kvsim.sim.results.metrics import StepLog
from kvsim.sim.simulator.executor import replica_parts
from kvsim.sim.simulator.simulate import run_simulation
from test_disaggregation import drive_and_check_handoffs, small_plan  # tests/test_disaggregation.py

SPLIT = ["prefill_queue_s", "prefill_s", "kv_wait_s", "transfer_s", "first_decode_s"]
# two prefill pools of different GPUs and TP, two decode pools; one pair over a slower link
XPYD = {"prefill": [{"gpu": "h100", "tp": 1, "replicas": 2}, {"gpu": "a100-80gb", "tp": 2}],
        "decode": [{"gpu": "h200", "tp": 2}, {"gpu": "h100", "tp": 1}],
        "pair_links": {"prefill-1>decode-1": "roce-100g"}}


def xpyd_config(requests=60, rate_scale=8.0, check_invariants=True, **fleet):
    return load_config(None, {"trace": "azure-code-2023", "trace_options.max_requests": requests,
                              "trace_options.rate_scale": rate_scale, "check_invariants": check_invariants,
                              "fleet": {**XPYD, **fleet}})


@pytest.mark.parametrize("fleet, message", [
    ({"prefill": [], "decode": {}}, "fleet.prefill: List should have at least 1 item"),
    ({"prefill": [{}, {"gpu": "h999"}], "decode": {}}, "fleet.prefill.1.gpu: unknown gpu 'h999'"),
    ({"prefill": {}, "decode": [{}, {"replicas": 0}]}, "fleet.decode.1.replicas: Input should be greater than 0"),
    ({"prefill": 3, "decode": {}}, "fleet.prefill: Input should be a valid dictionary"),
    ({"prefill": [{}, {}], "decode": {}, "pair_links": {"prefill>decode": "ib-ndr"}},
     "pair_links: expected keys 'PREFILL_POOL>DECODE_POOL' of pools prefill-0, prefill-1 and decode"),
    ({"prefill": [{}, {}], "decode": {}, "pair_links": {"prefill-1>decode": "ib-xdr"}},
     "pair_links.prefill-1>decode: expected a link of"),
])
def test_bad_multi_pool_fleets_are_refused_in_one_line(fleet, message):
    with pytest.raises(ConfigError, match=message) as err:
        load_config(None, {"fleet": fleet})
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("pools, message", [
    ({"decode": [{}, {"tp": 3}]}, "fleet.decode.1: Llama-3.1-8B: tp=3 must divide num_heads=32"),
    ({"prefill": [{}, {"engine": {"block_size": 32}}]},
     "engine.block_size differs between fleet.prefill.0 and fleet.prefill.1"),
    ({"pool_choice": "random"}, "fleet.pool_choice: unknown pool choice 'random'; known: least_work, round_robin"),
])
def test_multi_pool_fleets_that_cannot_run_are_refused_naming_the_pool(pools, message, tmp_path):
    fleet = {"prefill": [{}, {}], "decode": {}, **pools}
    cfg = load_config(None, {"trace": "azure-code-2023", "trace_options.max_requests": 5, "fleet": fleet})
    with pytest.raises(ConfigError, match=message) as err:
        run_simulation(cfg, tmp_path / "out")
    assert "\n" not in str(err.value) and not (tmp_path / "out").exists()


def test_repeated_pool_options_give_a_list_of_pools_and_one_stays_a_mapping():
    assert fleet_overrides(["h100:tp1:x2", "a100-80gb:tp2"], ["h200:tp2"], None, None) == {
        "fleet.prefill": [{"gpu": "h100", "tp": 1, "replicas": 2}, {"gpu": "a100-80gb", "tp": 2}],
        "fleet.decode.gpu": "h200", "fleet.decode.tp": 2}
    one = load_config(None, {"fleet": {"prefill": {"replicas": 2}, "decode": {}}}).model_dump()["fleet"]
    assert isinstance(one["prefill"], dict) and "pool_choice" not in one and "pair_links" not in one
    several = load_config(None, {"fleet": XPYD}).fleet
    assert [name for _, name, _ in several.all_pools()] == ["prefill-0", "prefill-1", "decode-0", "decode-1"]
    assert set(pool_choice_names()) >= {"least_work", "round_robin"}
    with pytest.raises(ValueError, match="unknown pool choice 'nope'; known: "):
        make_pool_choice("nope")


def test_xpyd_fleet_prices_each_pull_by_its_pool_pair_and_reports_each_pool(tmp_path):
    result = run_simulation(xpyd_config(), tmp_path / "out")
    df, s = result.requests, result.summary
    assert (df["status"] == "finished").all() and len(df) == 60
    np.testing.assert_allclose(df[SPLIT].sum(axis=1), df["ttft_s"], rtol=0, atol=1e-9)
    # pools are numbered prefill pools first: prefill-0 = replicas 0-1, prefill-1 = 2, decode-0 = 3, decode-1 = 4
    assert list(s["pools"]) == ["prefill-0", "prefill-1", "decode-0", "decode-1"]
    assert [p["replicas"] for p in s["pools"].values()] == [2, 1, 1, 1]
    assert set(df["prefill_replica"]) == {0, 1, 2} and set(df["replica"]) == {3, 4}
    assert (df["pool"] == df["replica"].map({3: "decode-0", 4: "decode-1"})).all()
    # bytes per token from each decode pool's layout (an 8-KV-head model at TP1 or TP2: no replication)
    per_token = 2 * 32 * 8 * 128 * 2
    np.testing.assert_allclose(df["transfer_bytes"], df["prompt_tokens"] * per_token)
    # each pull takes latency + bytes / its pair's bandwidth: ib-ndr (50 GB/s a lane) x min(TP prefill, TP
    # decode) lanes; prefill-1 (TP2) to decode-1 (TP1) over roce-100g, one lane
    source = df["prefill_replica"].map({0: "prefill-0", 1: "prefill-0", 2: "prefill-1"})
    lanes = {("prefill-0", "decode-0"): ("ib-ndr", 1), ("prefill-0", "decode-1"): ("ib-ndr", 1),
             ("prefill-1", "decode-0"): ("ib-ndr", 2), ("prefill-1", "decode-1"): ("roce-100g", 1)}
    for (p, d), (kind, n) in lanes.items():
        mine = df[(source == p) & (df["pool"] == d)]
        assert len(mine), (p, d)
        link = get_link(kind)
        np.testing.assert_allclose(mine["transfer_s"],
                                   link.latency_s + mine["transfer_bytes"] / (link.bandwidth_gb_s * n * 1e9), rtol=1e-9)
        pair = s["handoff"]["pairs"][f"{p}>{d}"]
        assert pair["link"] == kind and pair["link_bandwidth_gb_s"] == link.bandwidth_gb_s * n
        assert pair["transfers"] == len(mine)
    assert sum(p["transfers"] for p in s["handoff"]["pairs"].values()) == s["handoff"]["transfers"] == 60
    assert s["handoff"]["link_bandwidth_gb_s"] is None        # one figure per pair instead
    assert s["fleet"].startswith("2x H100-SXM TP1 prefill-0 + 1x A100-80GB TP2 prefill-1 + 1x H200 TP2 decode-0")
    # the dashboard's fleet view names each pool and each replica's pool
    run = RunRecord("xpyd", s, pd.read_parquet(tmp_path / "out" / "requests.parquet"),
                    pd.read_parquet(tmp_path / "out" / "steps.parquet"))
    view = fleet_view(run)
    assert list(view.pools["pool"]) == list(s["pools"]) and list(view.pools["GPU"])[1] == "A100-80GB"
    assert list(view.replicas["pool"]) == ["prefill-0", "prefill-0", "prefill-1", "decode-0", "decode-1"]
    assert replica_labels(run)[4] == "replica 4 (decode-1)"
    # config.yaml reruns the same fleet, bit for bit (same inputs and seed: the same results)
    again = run_simulation(load_config(tmp_path / "out" / "config.yaml"), tmp_path / "again")
    assert again.requests.drop(columns="token_times_s").equals(result.requests.drop(columns="token_times_s"))


def test_round_robin_cycles_over_every_instance_and_least_work_avoids_the_queue():
    rr = run_simulation(xpyd_config(check_invariants=False, pool_choice="round_robin")).requests.sort_values("arrival_s")
    # vLLM's toy proxy: itertools.cycle over the prefill instances, pool after pool
    assert list(rr["prefill_replica"][:9]) == [0, 1, 2] * 3
    assert rr["replica"].value_counts().to_dict() == {3: 30, 4: 30}
    lw = run_simulation(xpyd_config(check_invariants=False)).requests
    # at 8x the trace's rate the slower pools queue under round robin; least_work sends work where it ends first
    assert lw["ttft_s"].quantile(0.99) < 0.7 * rr["ttft_s"].quantile(0.99)
    assert lw["prefill_queue_s"].quantile(0.99) < rr["prefill_queue_s"].quantile(0.99)


# --- randomized: the hand-off's invariants over random multi-pool fleets --------------------------------





@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reqs=st.lists(st.tuples(st.floats(0, 0.5), st.integers(1, 1500), st.integers(1, 30)), min_size=1, max_size=14),
       prefill=st.lists(st.integers(1, 2), min_size=1, max_size=3), decode=st.lists(st.integers(1, 2), min_size=1, max_size=3),
       bandwidths=st.lists(st.sampled_from([0.05, 1.0, 50.0]), min_size=9, max_size=9),
       choice=st.sampled_from(["least_work", "round_robin"]), local=st.sampled_from([0, 200]),
       fast_forward=st.booleans(), layers=st.sampled_from([0, 4]))
def test_handoff_invariants_hold_on_random_multi_pool_fleets(reqs, prefill, decode, bandwidths, choice, local,
                                                             fast_forward, layers):
    plan = small_plan()
    t, requests = 0.0, []
    for i, (gap, prompt, out) in enumerate(reqs):
        t += gap
        requests.append(Request(request_id=i, arrival_time=t, prompt_tokens=prompt, max_output_tokens=out))
    p_specs = [PoolSpec(f"p{i}", "prefill", n, plan.scheduler) for i, n in enumerate(prefill)]
    d_specs = [PoolSpec(f"d{i}", "decode", n, plan.scheduler) for i, n in enumerate(decode)]
    pairs = {(p.name, d.name): LinkSpec("l", bandwidths[3 * i + j], 1e-4)
             for i, p in enumerate(p_specs) for j, d in enumerate(d_specs)}
    env, log = EngineClock(), StepLog(None)
    fleet, proxy = build_disaggregated(
        env, p_specs, d_specs,
        Handoff(LinkSpec("l", 1.0, 1e-4), plan.cost.kv_bytes_per_token, local_prefill_tokens=local,
                layerwise_layers=layers, pairs=pairs),
        log, lambda spec, i, index: replica_parts(plan, index),
        ReplicaOptions(fast_forward=fast_forward, check_invariants=True),     # the engine's checks, every step
        make_pool_choice(choice, {s.name: 1.0 + i for i, s in enumerate(p_specs + d_specs)}))
    for r, xfer in drive_and_check_handoffs(env, fleet, requests, proxy):
        # priced at its pair's bandwidth (a link queue may delay its start, not stretch it)
        spec = pairs[(r.route.hops[0].pool, r.route.hops[-1].pool)]
        if not layers:
            assert xfer.end_s - xfer.start_s == pytest.approx(spec.seconds(xfer.nbytes), rel=1e-9)
