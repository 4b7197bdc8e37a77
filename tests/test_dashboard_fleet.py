"""The Simulate page's fleet view (issue 51: views of a fleet): per replica, per pool, the prefill/decode
hand-off and the CPU offload tier, each figure the run's own (summary.json, requests and steps)."""
from __future__ import annotations


import numpy as np
import pandas as pd
import pytest
from plotly_json import figure, open_page, trace_in, values  # tests/plotly_json.py
from streamlit.testing.v1 import AppTest

from kvsim.dashboard.data import DATA_ROOT_ENV
from kvsim.sim.config import load_config
from kvsim.sim.simulator.simulate import run_simulation

PD = {"trace": "azure-code-2023", "trace_options.max_requests": 40, "fleet.prefill.replicas": 2,
      "fleet.decode.replicas": 1}
OFFLOAD = {"trace": "azure-conv-2023", "trace_options.max_requests": 60, "replicas": 2,
           "router": "precise_prefix", "kv_offload.cpu_gib": 1, "engine.num_gpu_blocks": 200}


COLUMNS = {"sim_fleet_replicas": {"replica", "KV blocks used mean"}, "sim_fleet_pools": {"pool", "GPU"},
           "sim_fleet_handoff": {"figure", "p99"}, "sim_fleet_offload": {"figure", "CPU tier"}}


def table(at: AppTest, key: str):
    """The fleet table `key` names (AppTest does not keep a dataframe's key: found by its columns)."""
    found = [d.value for d in at.dataframe if COLUMNS[key] <= set(d.value.columns)]
    return found[0] if found else None


def test_a_disaggregated_run_shows_its_pools_replicas_and_handoff(tmp_path, monkeypatch):
    monkeypatch.setenv(DATA_ROOT_ENV, str(tmp_path))
    result = run_simulation(load_config(None, PD), tmp_path / "pd")
    s = result.summary
    at = open_page("simulate", "pd")
    pools = table(at, "sim_fleet_pools")
    assert list(pools["pool"]) == ["prefill", "decode"] and list(pools["replicas"]) == [2, 1]
    assert list(pools["busy share"]) == pytest.approx([s["pools"]["prefill"]["utilization"],
                                                        s["pools"]["decode"]["utilization"]])
    replicas = table(at, "sim_fleet_replicas")
    assert list(replicas["pool"]) == ["prefill", "prefill", "decode"]
    # every request finishes on the one decode replica; the prefill replicas only prefill
    assert list(replicas["requests"]) == [0, 0, s["num_finished"]]
    handoff = table(at, "sim_fleet_handoff").set_index("figure")
    assert handoff.loc["transfers", "mean"] == s["handoff"]["transfers"] > 0
    assert handoff.loc["transfer (s)", "p99"] == pytest.approx(s["handoff"]["p99_transfer_s"])
    assert table(at, "sim_fleet_offload") is None


def test_an_offload_run_shows_its_tier_and_per_replica_load(tmp_path, monkeypatch):
    monkeypatch.setenv(DATA_ROOT_ENV, str(tmp_path))
    result = run_simulation(load_config(None, OFFLOAD), tmp_path / "off")
    s, reqs = result.summary, result.requests
    at = open_page("simulate", "off")
    tier = table(at, "sim_fleet_offload").set_index("figure")["CPU tier"]
    assert tier["blocks stored"] == s["kv_offload"]["blocks_stored"] > 0
    assert tier["GB to the tier"] == pytest.approx(s["kv_offload"]["bytes_to_tier"] / 1e9)
    replicas = table(at, "sim_fleet_replicas").set_index("replica")
    assert replicas["requests"].sum() == len(reqs)
    for r, group in reqs.groupby("replica"):
        assert replicas.loc[r, "prefix hit rate"] == pytest.approx(group.cached_tokens.sum() / group.prompt_tokens.sum())
    assert table(at, "sim_fleet_pools") is None and table(at, "sim_fleet_handoff") is None


def test_one_replica_without_tiers_has_no_fleet_view(tmp_path, monkeypatch):
    monkeypatch.setenv(DATA_ROOT_ENV, str(tmp_path))
    run_simulation(load_config(None, {"trace_options.max_requests": 10}), tmp_path / "one")
    at = open_page("simulate", "one")
    assert "Fleet" not in [h.value for h in at.subheader]


def test_time_series_draws_each_replica_and_the_routers_decisions(tmp_path, monkeypatch):
    monkeypatch.setenv(DATA_ROOT_ENV, str(tmp_path))
    reqs = run_simulation(load_config(None, OFFLOAD), tmp_path / "off").requests
    at = open_page("timeseries", "off")
    fleet, per_replica = figure(at, "off over time"), figure(at, "off per replica")
    width = np.diff(values(fleet["data"][0]["x"]))[0]
    routed = [trace_in(per_replica, "Router decisions", f"replica {r}") for r in (0, 1)]
    # the router's decisions: each replica's routed requests are the requests that ran on it, and the
    # replicas' lines add up to the fleet's arrivals
    for r, line in enumerate(routed):
        assert np.nansum(line) * width == pytest.approx((reqs["replica"] == r).sum())
    assert routed[0] + routed[1] == pytest.approx(trace_in(fleet, "Load: arrivals", "arrivals / s"))
    running = [trace_in(per_replica, "Num Running per replica", f"replica {r}") for r in (0, 1)]
    assert running[0] + running[1] == pytest.approx(trace_in(fleet, "Scheduler State", "Num Running"))
    assert max(np.nanmax(running[0]), np.nanmax(running[1])) > 0
    usage = trace_in(per_replica, "GPU Cache Usage per replica", "replica 1")
    assert 0 < np.nanmax(usage) <= 1


def test_a_disaggregated_fleet_names_each_replicas_pool_over_time(tmp_path, monkeypatch):
    monkeypatch.setenv(DATA_ROOT_ENV, str(tmp_path))
    reqs = run_simulation(load_config(None, PD), tmp_path / "pd").requests
    per_replica = figure(open_page("timeseries", "pd"), "pd per replica")
    names = {t["name"] for t in per_replica["data"]}
    assert names == {"replica 0 (prefill)", "replica 1 (prefill)", "replica 2 (decode)"}
    # every request is routed to (and finishes on) the decode replica
    x = values(per_replica["data"][0]["x"])
    routed = trace_in(per_replica, "Router decisions", "replica 2 (decode)")
    assert np.nansum(routed) * (x[1] - x[0]) == pytest.approx(len(reqs))
    assert np.nansum(trace_in(per_replica, "Router decisions", "replica 0 (prefill)")) == 0


def test_one_replica_has_no_per_replica_panels(tmp_path, monkeypatch):
    monkeypatch.setenv(DATA_ROOT_ENV, str(tmp_path))
    run_simulation(load_config(None, {"trace_options.max_requests": 10}), tmp_path / "one")
    at = open_page("timeseries", "one")
    assert "Per replica" not in [h.value for h in at.subheader]
    assert "Prefill/decode hand-off" not in [h.value for h in at.subheader]


def test_time_series_draws_the_offload_tiers_occupancy(tmp_path, monkeypatch):
    monkeypatch.setenv(DATA_ROOT_ENV, str(tmp_path))
    run_simulation(load_config(None, {**OFFLOAD, "kv_offload.disk_gib": 2}), tmp_path / "tiers")
    tiers = pd.read_parquet(tmp_path / "tiers" / "tiers.parquet")
    fig = figure(open_page("timeseries", "tiers"), "tiers: KV offload tiers over time")
    lines = {t["name"].split(" ")[0]: values(t["y"]) for t in fig["data"]}
    assert set(lines) == {"cpu", "disk"}
    for name, rows in tiers.groupby("tier"):
        assert lines[name] == pytest.approx((rows["blocks_held"] / rows["capacity_blocks"]).to_numpy())


def test_time_series_draws_the_handoff_over_time(tmp_path, monkeypatch):
    monkeypatch.setenv(DATA_ROOT_ENV, str(tmp_path))
    reqs = run_simulation(load_config(None, PD), tmp_path / "pd").requests
    fig = figure(open_page("timeseries", "pd"), "pd KV hand-off over time")
    x = values(fig["data"][0]["x"])
    pulls = trace_in(fig, "KV hand-off: pulls started", "pulls / s")
    moved = reqs[reqs["transfer_s"].notna()]
    assert np.nansum(pulls) * (x[1] - x[0]) == pytest.approx(len(moved)) and len(moved) > 0
    gb = trace_in(fig, "KV hand-off: GB pulled", "GB / s")
    assert np.nansum(gb) * (x[1] - x[0]) == pytest.approx(moved["transfer_bytes"].sum() / 1e9)
    transfer = trace_in(fig, "KV hand-off: TTFT legs", "transfer")
    assert np.nanmax(transfer) <= moved["transfer_s"].max() * 1e3 + 1e-9
