"""kvsim crosscheck: comparison figures, recorded-mode step-by-step memory check, report files,
and a tiny calibrate + crosscheck against the real backend on CPU."""
from __future__ import annotations

import json

import numpy as np
import pytest

from sim.config import load_config
from sim.cost_model import CostModel
from sim.crosscheck import Run, compare, first_divergence, simulate_recorded, write_report
from sim.simulate import run_simulation
from traces.synthetic import synthesize


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
    md, html = write_report(res, d / "report")
    text = md.read_text()
    assert "per-step time MAPE" in text and "| ttft | p50 |" in text and "fragmentation_p99" in text
    page = html.read_text()
    assert page.count("plotly-graph-div") >= 4 and "predicted vs measured" in page
    saved = json.loads((d / "report" / "crosscheck.json").read_text())
    assert saved["headline"]["ttft_p50_error"] == pytest.approx(h["ttft_p50_error"])


def test_tiny_calibrate_and_crosscheck_on_the_real_backend(tmp_path):
    """Replay on the real model (2 layers of SmolLM2), fit a profile, cross-check another trace."""
    torch = pytest.importorskip("torch")
    replay = pytest.importorskip("gpu.replay")
    from gpu.weights import load_smollm2
    from sim.calibrate import fit_profile, load_step_logs
    from sim.catalog import get_model
    from traces.synthetic import closed_batch
    from traces.trace import Trace

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
    from sim.cost_model import load_profile
    from sim.crosscheck import predicted_config
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
