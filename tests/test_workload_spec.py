"""Workload spec YAML (issue 47 item 9, traces/workload.py): arrival processes, lengths, shared prefixes,
client classes with their own SLOs, and one-line errors naming the file, line and field."""
import warnings

import numpy as np
import pytest
import yaml
from typer.testing import CliRunner

from kvsim.sim.cli import app
from kvsim.sim.config import load_config
from kvsim.sim.simulator.simulate import run_simulation
from kvsim.traces import load_trace
from kvsim.traces.errors import TraceError
from kvsim.traces.loaders import detect_format


def spec_file(tmp_path, classes, name="w.yaml", **top):
    path = tmp_path / name
    path.write_text(yaml.safe_dump({"workload": {**top, "classes": classes}}, sort_keys=False))
    return path


def one(name="c", **fields):
    return {"name": name, "prompt_tokens": "fixed:100", "output_tokens": "fixed:10", **fields}


def gaps(trace):
    return np.diff(trace.df["arrival_time_s"].to_numpy())


@pytest.mark.parametrize("arrival, mean_gap, cv", [
    ({"process": "constant", "rate": 5}, 0.2, 0.0),
    ({"process": "poisson", "rate": 5}, 0.2, 1.0),
    ({"process": "gamma", "rate": 5, "cv": 3}, 0.2, 3.0),
])
def test_arrival_processes_have_their_rate_and_burstiness(tmp_path, arrival, mean_gap, cv):
    t = load_trace(spec_file(tmp_path, [one(requests=20000, arrival=arrival)]), seed=3)
    g = gaps(t)
    assert g.mean() == pytest.approx(mean_gap, rel=0.05)
    assert g.std() / g.mean() == pytest.approx(cv, abs=0.1 * max(cv, 0.1))


def test_bursts_and_duration(tmp_path):
    t = load_trace(spec_file(tmp_path, [one(arrival={"process": "bursts", "size": 25, "every_s": 10})],
                             duration_s=60))
    times = t.df["arrival_time_s"].to_numpy()
    assert len(t) == 150 and sorted(set(times)) == [0.0, 10.0, 20.0, 30.0, 40.0, 50.0]
    assert (np.unique(times, return_counts=True)[1] == 25).all()


def test_shared_prefixes_are_shared_within_a_group_and_hit_the_prefix_cache(tmp_path):
    cls = one(requests=120, arrival={"process": "poisson", "rate": 2}, prompt_tokens="uniform:50,300",
              output_tokens="fixed:20")
    shared = spec_file(tmp_path, [{**cls, "shared_prefix": {"tokens": 1024, "groups": 3}}], name="s.yaml", block_tokens=16)
    plain = spec_file(tmp_path, [cls], name="p.yaml")
    t = load_trace(shared)
    ids = t.df["prefix_hash_ids"]
    assert (t.df["prompt_tokens"] >= 1024 + 50).all() and t.prefix_block_tokens == 16
    heads = {tuple(x[:64]) for x in ids}                      # 1024 tokens = 64 blocks: one of 3 prefixes
    assert len(heads) == 3
    tails = [x[64:] for x in ids]
    assert len({h for x in tails for h in x}) == sum(map(len, tails))     # the rest is each request's own
    assert [len(x) for x in ids] == [-(-p // 16) for p in t.df["prompt_tokens"]]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hit = run_simulation(load_config(None, {"trace": str(shared), "model": "qwen2.5-0.5b", "gpu": "l4"})).summary
        miss = run_simulation(load_config(None, {"trace": str(plain), "model": "qwen2.5-0.5b", "gpu": "l4"})).summary
    assert hit["prefix_hit_rate"] > 0.7 and miss["prefix_hit_rate"] < 0.05


def test_classes_are_seeded_apart_and_report_their_own_slos(tmp_path):
    chat = one("chat", requests=60, arrival={"process": "poisson", "rate": 3}, prompt_tokens="lognormal:400,1.0,4000",
               output_tokens="uniform:20,200", slo={"ttft": "200ms", "tpot": "30ms"})
    batch = one("batch", requests=30, arrival={"process": "bursts", "size": 15, "every_s": 10},
                prompt_tokens="fixed:3000", output_tokens="fixed:100", priority=1, slo={"ttft": "1m"})
    both, alone = spec_file(tmp_path, [chat, batch], seed=5), spec_file(tmp_path, [chat], name="a.yaml", seed=5)
    assert detect_format(both) == "workload"
    t, t_alone = load_trace(both), load_trace(alone)
    mine = sorted(r for r, c in t.workload_classes.of_request.items() if c == "chat")
    np.testing.assert_array_equal(t.df.loc[mine, "prompt_tokens"], t_alone.df["prompt_tokens"])   # own stream
    assert load_trace(both).df.equals(t.df)                                                       # seeded
    assert (t.df.loc[t.df["priority"] == 1, "prompt_tokens"] == 3000).all()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = run_simulation(load_config(None, {"trace": str(both), "model": "llama-3.1-8b", "gpu": "h100"}))
    classes = res.summary["workload_classes"]
    assert {k: v["requests"] for k, v in classes.items()} == {"chat": 60, "batch": 30}
    req = res.requests.assign(cls=res.requests["request_id"].map(t.workload_classes.of_request))
    c = req[req["cls"] == "chat"]
    within = ((c["ttft_s"] <= 0.2) & (c["tpot_s"].fillna(0) <= 0.03)).mean()
    assert classes["chat"]["slo_attainment"] == pytest.approx(within)
    assert classes["batch"]["slo_ttft_s"] == 60.0 and classes["batch"]["slo_tpot_s"] is None
    assert classes["batch"]["ttft_p50_s"] > classes["chat"]["ttft_p50_s"]         # 3,000-token bursts wait


@pytest.mark.parametrize("classes, top, message", [
    ([one(requests=5, arrival={"process": "gamma", "rate": 2})], {}, "classes.0.arrival: process gamma needs cv"),
    ([one(requests=5, arrival={"process": "poisson", "rate": 2}, colour="red")], {}, "classes.0.colour: unknown field"),
    ([one(arrival={"process": "poisson", "rate": 2})], {}, "give its 'requests' or the workload's 'duration_s'"),
    ([one(requests=5, arrival={"process": "poisson", "rate": 2}, slo={"ttft": 5})], {}, "is not a duration > 0 with a unit"),
    ([one(requests=5, arrival={"process": "poisson", "rate": 2}, prompt_tokens="normal:5")], {}, "length spec"),
    ([one(requests=5, arrival={"process": "poisson", "rate": 2}, sessions={"turns": 3})], {},
     "multi-turn sessions are not in the workload spec yet"),
])
def test_spec_mistakes_are_one_line_naming_file_line_and_field(tmp_path, classes, top, message):
    path = spec_file(tmp_path, classes, **top)
    with pytest.raises(TraceError) as err:
        load_trace(path)
    text = str(err.value)
    assert "\n" not in text and text.startswith(f"{path}:") and message in text, text


def test_simulate_workload_option(tmp_path):
    path = spec_file(tmp_path, [one("chat", requests=20, arrival={"process": "constant", "rate": 4},
                                    slo={"ttft": "1s"})])
    r = CliRunner().invoke(app, ["simulate", "--workload", str(path), "--model", "qwen2.5-0.5b", "--gpu", "l4",
                                 "-o", str(tmp_path / "run")], prog_name="kvsim", env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    assert "client classes (workload spec)" in r.output and "│ chat" in r.output
    r = CliRunner().invoke(app, ["simulate", "--workload", str(path), "--trace", "azure-conv-2023"], prog_name="kvsim")
    assert r.exit_code == 2 and "give one" in r.stderr
