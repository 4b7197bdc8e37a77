"""The KV-tier options on the command line: --kv-offload, --router, --sessions and --think-time reach the run's
config in simulate, capacity and plan (what `plan --kv-offload` answers depends on the tier), and bad values
are refused in one line naming the option."""
import json

import pandas as pd
import pytest
import yaml
from typer.testing import CliRunner

from kvsim.sim.cli import app
from kvsim.sim.cli.options import tier_overrides
from kvsim.sim.config import ConfigError

SMALL = ["--trace", "synthetic-sessions", "--set", "trace_options.synthetic_sessions.sessions=6",
         "--set", "trace_options.synthetic_sessions.turns=fixed:3"]


def test_tier_overrides():
    assert tier_overrides("cpu:0") == {} and tier_overrides(None) == {}
    assert tier_overrides("cpu:100GiB") == {"kv_offload.cpu_gib": 100.0}
    assert tier_overrides("cpu:512MiB")["kv_offload.cpu_gib"] == 0.5
    assert tier_overrides(None, sessions=True) == {"trace_options.sessions": {}}
    assert tier_overrides(None, think_time=4.0) == {"trace_options.sessions.think_time_s": 4.0}
    for bad, why in (("cpu:-5GiB", r"the size must be 0 \(no offload\) or positive"), ("disk:5GiB", r"the disk and remote tiers sit behind a CPU tier \(LMCache's local CPU backend\): give cpu:SIZE first"),
                     ("cpu:lots", "expected a size")):
        with pytest.raises(ConfigError, match=f"^--kv-offload '{bad}': {why}"):
            tier_overrides(bad)
    with pytest.raises(ConfigError, match=r"^--think-time -1: expected seconds in 0\.\.1e9"):
        tier_overrides(None, think_time=-1.0)


def test_simulate_with_sessions_offload_and_a_router(tmp_path):
    out = tmp_path / "run"
    res = CliRunner().invoke(app, ["simulate", *SMALL, "--replicas", "2", "--router", "session_affinity",
                                   "--kv-offload", "cpu:2GiB", "--think-time", "3", "--out", str(out), "-q"])
    assert res.exit_code == 0, res.output
    cfg = yaml.safe_load((out / "config.yaml").read_text())
    assert cfg["router"] == "session_affinity" and cfg["kv_offload"]["cpu_gib"] == 2.0
    assert cfg["trace_options"]["sessions"] == {"think_time_s": 3.0, "history": "in_prompt"}
    summary = json.loads((out / "summary.json").read_text())
    assert summary["num_finished"] == 18 and "kv_offload" in summary


def stored_runs(store):
    """The runs a capacity or plan store holds, one row each with its config flattened."""
    return pd.concat([pd.read_parquet(p) for p in sorted((store / "runs").glob("*.parquet"))], ignore_index=True)


def test_capacity_and_plan_take_the_tier_options(tmp_path):
    base = [*SMALL, "--slo", "ttft_p99<=5s", "-q", "--repeats", "1", "--no-band"]
    cap = CliRunner().invoke(app, ["capacity", *base, "--mode", "replicas", "--max-replicas", "2",
                                   "--router", "session_affinity", "--kv-offload", "cpu:1GiB", "--sessions",
                                   "--out", str(tmp_path / "cap")])
    assert cap.exit_code == 0, cap.output
    runs = stored_runs(tmp_path / "cap")
    assert len(runs) and (runs["router"] == "session_affinity").all() and (runs["kv_offload.cpu_gib"] == 1.0).all()
    assert (runs["trace_options.sessions.history"] == "in_prompt").all() and (runs["status"] == "ok").all()
    plan = CliRunner().invoke(app, ["plan", *base, "--models", "llama-3.1-8b", "--gpus", "h100", "--tps", "1",
                                    "--jobs", "1", "--max-replicas", "2", "--router", "precise_prefix",
                                    "--kv-offload", "cpu:1GiB", "--sessions", "--out", str(tmp_path / "plan")])
    assert plan.exit_code == 0, plan.output
    assert "cheapest h100 TP1 x 1 replicas" in plan.output or "cheapest h100 TP1 x 1 replica" in plan.output
    runs = stored_runs(tmp_path / "plan")
    assert len(runs) and (runs["router"] == "precise_prefix").all() and (runs["kv_offload.cpu_gib"] == 1.0).all()
    bad = CliRunner().invoke(app, ["plan", *base, "--models", "llama-3.1-8b", "--gpus", "h100", "--jobs", "1",
                                   "--kv-offload", "cpu:-1GiB"])
    assert bad.exit_code != 0 and "--kv-offload 'cpu:-1GiB': the size must be 0" in bad.output
