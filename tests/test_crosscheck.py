"""kvsim crosscheck: comparison figures, recorded-mode step-by-step memory check, report files,
and a tiny calibrate + crosscheck against the real backend on CPU."""
from __future__ import annotations

import json
import re

import numpy as np
import pandas as pd
import pytest

from typer.testing import CliRunner

from kvsim.sim.calibration.profile_fit import fit_profile
from kvsim.sim.calibration.step_logs import load_step_logs
from kvsim.sim.model.catalog import get_model
from kvsim.sim.cli import app
from kvsim.sim.config import load_config
from kvsim.sim.model.cost_model import CostModel, load_profile
from kvsim.sim.crosscheck.comparison import (CrosscheckError, Repeats, Run, compare, first_divergence,
                                            same_request_timings)
from kvsim.sim.crosscheck.recorded import predicted_config, simulate_recorded
from kvsim.sim.crosscheck.report import write_report
from kvsim.sim.simulator.simulate import run_simulation
from kvsim.traces.synthetic import closed_batch, synthesize
from kvsim.traces.trace import Trace


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A 'measured' run (cpu-2core profile) and a prediction of it with another profile."""
    trace = synthesize(30, rate=2.0, prompt="lognormal:300,0.8,1500", output="lognormal:50,0.8,200", seed=1)
    cfg = load_config(None, {"model": "smollm2", "gpu": "cpu-2core", "profile": "cpu-2core",
                             "engine.num_gpu_blocks": 150, "engine.max_num_seqs": 16})
    d = tmp_path_factory.mktemp("cc")
    run_simulation(cfg, d / "real", trace=trace)
    real = Run.load(d / "real", "real")
    other = cfg.model_copy(update={"profile": "default"})
    pred = run_simulation(other, d / "sim", trace=trace)
    return cfg, trace, real, Run("sim", pred.requests, pred.steps, pred.summary), d


def test_recorded_mode_reproduces_memory_step_by_step(pair):
    cfg, trace, real, _, _ = pair
    assert real.summary["preemptions"] > 0               # memory pressure: the check is not trivial
    rec = simulate_recorded(cfg, trace, real.steps["duration_s"].to_numpy())
    check = first_divergence(real.steps, rec.steps)
    assert check["identical"] and check["steps_compared"] == len(real.steps)
    np.testing.assert_array_equal(rec.steps["time_s"], real.steps["time_s"])


def test_divergence_is_located(pair):
    _, _, real, _, _ = pair
    bad = real.steps.copy()
    bad.loc[17:, "blocks_used"] += 1
    bad.loc[40, "preemptions"] += 1
    d = first_divergence(real.steps, bad)
    assert not d["identical"]
    assert d["first_divergence"]["step"] == 17 and d["first_divergence"]["column"] == "blocks_used"
    d = first_divergence(real.steps, real.steps.iloc[:-3])
    assert d["first_divergence"]["column"] == "(step count)"


def test_report_figures_and_files(pair):
    cfg, trace, real, sim, d = pair
    cost = CostModel("smollm2", "cpu-2core", "cpu-2core")
    res = compare(real, sim, cost, context={"trace": "synthetic"})
    h = res.headline()
    assert h["step_mape"] < 1e-9               # replay steps priced with the profile that timed them
    lat = res.latency.set_index(["metric", "percentile"])
    r, s = real.requests, sim.requests
    assert lat.loc[("ttft", 50), "real"] == pytest.approx(np.percentile(r["ttft_s"].dropna(), 50))
    assert lat.loc[("ttft", 50), "rel_error"] == pytest.approx(
        np.percentile(s["ttft_s"].dropna(), 50) / np.percentile(r["ttft_s"].dropna(), 50) - 1)
    thr = res.throughput.set_index("metric")
    assert h["throughput_error"] == pytest.approx(abs(sim.summary["throughput_total_tok_s"]
                                                      / real.summary["throughput_total_tok_s"] - 1))
    assert h["throughput_error"] > 0.2 and thr.loc["throughput_req_s", "real"] > 0   # different profiles differ
    t = res.total_time      # the same batches priced by the replay's own profile; the prediction ran its own
    assert t["model_on_replay_batches_s"] == pytest.approx(t["measured_s"]) == pytest.approx(real.steps.duration_s.sum())
    assert t["predicted_simulation_s"] == pytest.approx(sim.steps.duration_s.sum())
    md, html = write_report(res, d / "report")
    text = md.read_text()
    assert "per-step time MAPE" in text and "| ttft | p50 |" in text and "fragmentation_p99" in text
    assert re.search(rf"cost model on the replay's own batches {t['measured_s']:.2f} s \([+-]0\.0%\)", text)
    page = html.read_text()
    assert page.count("plotly-graph-div") >= 4 and "predicted vs measured" in page
    saved = json.loads((d / "report" / "crosscheck.json").read_text())
    assert saved["headline"]["ttft_p50_error"] == pytest.approx(h["ttft_p50_error"])


def test_tiny_calibrate_and_crosscheck_on_the_real_backend(tmp_path):
    """Replay on the real model (2 layers of SmolLM2), fit a profile, cross-check another trace."""
    torch = pytest.importorskip("torch")
    replay = pytest.importorskip("kvsim.gpu.replay")
    from kvsim.gpu.weights import load_smollm2       # imports torch: only where the real backend runs

    torch.set_num_threads(1)
    model = load_smollm2().truncated(2)
    cfg = load_config(None, {"model": "smollm2-135m", "gpu": "cpu-2core", "profile": "cpu-2core",
                             "engine.num_gpu_blocks": 64})
    parts = [closed_batch(b, p, 4) for b in (1, 3) for p in (16, 48)]
    for i, t in enumerate(parts):
        t.df["arrival_time_s"] = i * 100.0
    cpu_clock = replay.ReplayOptions(clock="cpu")      # steps timed by this thread's CPU time
    cal = replay.run_replay(cfg, tmp_path / "cal", trace=Trace.concat(parts, how="overlay"), model=model,
                            options=cpu_clock)
    assert cal.summary["replay"]["clock"] == "cpu"
    spec = replay.model_spec_for(model.config, get_model("smollm2"), model.dtype)      # the 2-layer model that ran
    steps = load_step_logs([tmp_path / "cal"])        # padded decode counts recomputed by a recorded simulation
    decode = steps[steps.prefill_tokens == 0]
    assert (decode.kv_tokens_padded >= decode.kv_tokens_read).all()
    assert (decode.kv_tokens_padded % 16 == 0).all() and (steps[steps.decode_tokens == 0].kv_tokens_padded == 0).all()
    prefill = steps[steps.decode_tokens == 0]          # equal prompts p: each attends over ceil(p/16)*16 + p keys
    p = prefill.prefill_tokens / prefill.batch_size
    np.testing.assert_array_equal(prefill.attn_pairs_prefill_padded, prefill.prefill_tokens * (np.ceil(p / 16) * 16 + p))
    report = fit_profile(steps, spec, "cpu-2core", base_profile="cpu-2core")
    assert report.errors["all"]["count"] == len(cal.steps)
    assert report.errors["all"]["median_ape"] < 0.5
    held_out = synthesize(4, rate=5.0, prompt="uniform:8,40", output="uniform:2,6", seed=3)
    real = replay.run_replay(cfg, tmp_path / "real", trace=held_out, model=model, options=cpu_clock)
    real_run = Run.load(tmp_path / "real", "real")
    rec = simulate_recorded(cfg, held_out, real_run.steps["duration_s"].to_numpy(), replay_dir=tmp_path / "real")
    check = first_divergence(real_run.steps, rec.steps)
    assert check["identical"], check
    assert len(real.steps) == check["steps_compared"]
    assert rec.shapes is not None and len(rec.shapes) == len(real.steps)
    # fed one replay's step times, the recorded simulation reproduces its request timings bit for bit
    assert same_request_timings(real_run.requests, rec.requests)
    res = compare(real_run, Run("sim", rec.requests, rec.steps, rec.summary), CostModel(spec, "cpu-2core", report.profile),
                  recorded=rec)
    assert res.recorded["request_timings_identical"] and res.headline()["ttft_p50_error"] == 0
    # repeated replays of one closed batch schedule identically; their per-step median is the measured time
    batch = closed_batch(3, 40, 5)
    dirs = [tmp_path / f"rep-{i}" for i in range(3)]
    for d in dirs:
        replay.run_replay(cfg, d, trace=batch, model=model, options=cpu_clock)
    reps = Repeats.of([Run.load(d, "real") for d in dirs], dirs)
    assert reps.durations.shape == (3, len(reps.runs[0].steps)) and (reps.durations > 0).all()
    np.testing.assert_array_equal(reps.median, np.median(reps.durations, axis=0))
    rec = simulate_recorded(cfg, batch, reps.median, replay_dir=dirs[0])
    assert first_divergence(reps.runs[0].steps, rec.steps)["identical"]
    measured = reps.measured_run(rec)
    assert measured.summary["measured_step_time_s"] == pytest.approx(reps.median.sum())
    np.testing.assert_allclose(measured.requests["e2e_s"], reps.median.sum())     # all arrive at 0, finish last
    torch.set_num_threads(2)
    try:
        with pytest.raises(ValueError, match="1 torch thread"):
            replay.run_replay(cfg, None, trace=held_out, model=model, options=cpu_clock)
    finally:
        torch.set_num_threads(1)


def test_report_states_recorded_identity_or_divergence(pair):
    cfg, trace, real, sim, d = pair
    cost = CostModel("smollm2", "cpu-2core", "cpu-2core")
    rec = simulate_recorded(cfg, trace, real.steps["duration_s"].to_numpy())
    res = compare(real, sim, cost, recorded=rec)
    md, _ = write_report(res, d / "report-recorded")
    assert "memory metrics **identical** over all" in md.read_text()
    bad = Run("sim", rec.requests, rec.steps.assign(blocks_used=rec.steps.blocks_used + 1), rec.summary)
    md, _ = write_report(compare(real, sim, cost, recorded=bad), d / "report-diverged")
    assert "memory metrics **diverge** at step 0: blocks_used" in md.read_text()


def test_padded_attention_profiles_price_every_decode_step_with_its_own_shape(pair):
    """The decode fast-forward has no per-step widest block table: with a padding profile the
    predicted simulation steps one by one, so each step is priced with its padded count."""
    cfg, trace, _, _, d = pair
    plain = load_profile("cpu-2core")
    assert predicted_config(cfg, plain) is cfg
    padded = plain.model_copy(update={"padded_attn_cost": 30.0})
    path = padded.to_yaml(d / "padded.yaml")
    stepped = predicted_config(cfg.model_copy(update={"profile": str(path)}), padded)
    assert not stepped.fast_forward and cfg.fast_forward
    flat = run_simulation(cfg, None, trace=trace)
    slow = run_simulation(stepped, None, trace=trace)
    assert slow.summary["makespan_s"] > flat.summary["makespan_s"]     # padding costs time


def _scaled(run: Run, factor: float) -> Run:
    return Run(run.name, run.requests, run.steps.assign(duration_s=run.steps["duration_s"] * factor), run.summary)


def test_repeats_compare_with_the_median_step_time(pair):
    cfg, trace, real, sim, d = pair
    cost = CostModel("smollm2", "cpu-2core", "default")
    runs = [_scaled(real, 0.9), real, _scaled(real, 1.25)]
    reps = Repeats.of(runs, ["r1", "r2", "r3"])
    np.testing.assert_array_equal(reps.median, real.steps["duration_s"].to_numpy())
    np.testing.assert_allclose(reps.relative_spread(), 0.35)
    rec = simulate_recorded(cfg, trace, reps.median)
    single = compare(real, sim, cost, recorded=rec)
    assert single.recorded["request_timings_identical"] and single.repeats is None
    res = compare(real, sim, cost, recorded=rec, repeats=reps)
    # the median is this replay's own step times: the recorded simulation fed them gives its metrics exactly
    assert res.headline() == {**single.headline(), "repeats": 3}
    pd.testing.assert_frame_equal(res.latency, single.latency)
    assert res.repeats["spread_median"] == pytest.approx(0.35)
    shifts = [r["shift_vs_median"] for r in res.repeats["singles"]]
    assert shifts == pytest.approx([-0.1, 0.0, 0.25])
    assert res.repeats["singles"][1]["step_mape"] == pytest.approx(res.headline()["step_mape"])
    md, html = write_report(res, d / "report-repeats")
    text = md.read_text()
    assert "**median of 3 replays**" in text and "## Repeats (3 replays)" in text and "| `r3` |" in text
    saved = pd.read_parquet(d / "report-repeats" / "repeat_steps.parquet")
    np.testing.assert_array_equal(saved["duration_3_s"], runs[2].steps["duration_s"])
    assert json.loads((d / "report-repeats" / "crosscheck.json").read_text())["repeats"]["n"] == 3
    with pytest.raises(CrosscheckError, match="recorded simulation"):
        compare(real, sim, cost, repeats=reps)


def test_repeats_refuse_replays_that_schedule_differently(pair):
    cfg, trace, real, _, _ = pair
    slower = simulate_recorded(cfg, trace, real.steps["duration_s"].to_numpy() * 1.5)   # arrivals land elsewhere
    with pytest.raises(CrosscheckError, match=r"runs/b: this repeat schedules differently from runs/a from step 0 "
                                              r"on \(num_waiting: 16 vs 22\)"):
        Repeats.of([real, slower], ["runs/a", "runs/b"])
    bad = real.steps.copy()
    bad.loc[5:, "batch_size"] += 1
    with pytest.raises(CrosscheckError, match="from step 5 on .batch_size"):
        Repeats.of([real, Run("x", real.requests, bad, real.summary)], ["runs/a", "runs/b"])
    timings = real.requests.assign(ttft_s=real.requests["ttft_s"] * 1.01)
    assert same_request_timings(real.requests, real.requests) and not same_request_timings(real.requests, timings)


@pytest.mark.parametrize("args, message", [
    (["--repeats", "3", "--real", "a", "--real", "b"], "give one --real per repeat"),
    (["--repeats", "2", "--no-recorded"], "--repeats needs recorded mode"),
])
def test_crosscheck_repeats_options_are_checked(args, message, tmp_path):
    res = CliRunner().invoke(app, ["crosscheck", "--trace", "azure-conv-2023", "--profile", "cpu-smollm2",
                                   "--num-gpu-blocks", "100", "--out", str(tmp_path), *args])
    assert res.exit_code == 2 and message in res.output


def test_a_replay_that_ran_no_step_is_refused_with_the_reason():
    # every request rejected (e.g. a pool too small for any prompt): a clear error, not a KeyError deep in the report
    from kvsim.sim.results.metrics import STEP_COLUMNS
    empty = Run("real", pd.DataFrame({"request_id": [0], "status": ["rejected"]}),
                pd.DataFrame({c: [] for c in STEP_COLUMNS}), {})
    with pytest.raises(CrosscheckError, match="ran no engine step.*reject_reason"):
        compare(empty, empty, cost=None)


def test_crosscheck_simulates_the_engine_as_the_replay_ran(tmp_path):
    """A replay steps synchronously without prefix caching; the cross-check's simulations must too, or
    requests arriving mid-step reach other batches (the first H100 validation failed so). A reused
    replay whose engine settings differ from the cross-check's options is refused by field."""
    trace = synthesize(40, rate=20.0, prompt="uniform:64,400", output="uniform:4,40", seed=5)
    path = trace.save(tmp_path / "t.jsonl")
    base = {"model": "smollm2", "gpu": "cpu-2core", "profile": "cpu-2core", "engine.num_gpu_blocks": 200,
            "engine.async_scheduling": False, "engine.enable_prefix_caching": False}
    run_simulation(load_config(None, base), tmp_path / "real", trace=trace)      # stands in for a replay
    args = ["crosscheck", "--trace", str(path), "--profile", "cpu-2core", "--model", "smollm2",
            "--num-gpu-blocks", "200"]
    ok = CliRunner().invoke(app, [*args, "--real", str(tmp_path / "real"), "--out", str(tmp_path / "cc")])
    assert ok.exit_code == 0, ok.output
    assert "memory identical (recorded): True" in " ".join(ok.output.split())
    run_simulation(load_config(None, {**base, "engine.max_num_seqs": 8}), tmp_path / "other", trace=trace)
    bad = CliRunner().invoke(app, [*args, "--real", str(tmp_path / "other"), "--out", str(tmp_path / "cc2")])
    assert bad.exit_code != 0
    assert "engine.max_num_seqs: replay 8" in " ".join(bad.output.split())
    # a replay of SmolLM2's first 2 layers (replay --layers 2) was compared with the 30-layer cost model
    summary = json.loads((tmp_path / "real" / "summary.json").read_text())
    (tmp_path / "real" / "summary.json").write_text(json.dumps({**summary, "model_layers": 2}))
    part = CliRunner().invoke(app, [*args, "--real", str(tmp_path / "real"), "--out", str(tmp_path / "cc3")])
    assert part.exit_code == 2 and "the replay ran 2 of SmolLM2-135M's 30 layers" in " ".join(part.output.split())


def test_crosscheck_refuses_a_reused_replay_of_another_workload_or_kv_policy(tmp_path):
    """A --real replay of another window of the trace (or another rate, first N, KV policy) was
    compared step by step with a simulation of this one: per-step errors of 13-20% and 'memory
    identical: False' that were a wrong pairing, not a model error. It is refused, saying what differs."""
    trace = synthesize(40, rate=20.0, prompt="uniform:64,400", output="uniform:4,40", seed=5)
    path = trace.save(tmp_path / "t.jsonl")
    base = {"model": "smollm2", "gpu": "cpu-2core", "profile": "cpu-2core", "engine.num_gpu_blocks": 200,
            "engine.async_scheduling": False, "engine.enable_prefix_caching": False}
    run_simulation(load_config(None, {**base, "trace": str(path), "trace_options.max_requests": 30}),
                   tmp_path / "first30")                                    # stands in for a replay
    args = ["crosscheck", "--trace", str(path), "--profile", "cpu-2core", "--model", "smollm2",
            "--num-gpu-blocks", "200", "--real", str(tmp_path / "first30"), "--no-recorded"]
    other = CliRunner().invoke(app, [*args, "--out", str(tmp_path / "cc")])
    assert other.exit_code == 2
    assert "the replay's requests (30, ids 0-29) are not this cross-check's (40, ids 0-39)" in " ".join(
        other.output.split())
    policy = CliRunner().invoke(app, [*args, "--max-requests", "30", "--set", "kv.policy=streaming",
                                      "--set", "kv.budget=64", "--out", str(tmp_path / "cc2")])
    assert policy.exit_code == 2 and "kv.policy: replay 'none', here 'streaming'" in " ".join(policy.output.split())
    same = CliRunner().invoke(app, [*args, "--max-requests", "30", "--out", str(tmp_path / "cc3")])
    assert same.exit_code == 0, same.output
