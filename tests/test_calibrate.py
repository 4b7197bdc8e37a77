"""kvsim calibrate: the cost-model fit recovers known factors from synthetic step logs, the
importance fit recovers the synthetic model's statistics, and bad input fails clearly."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from typer.testing import CliRunner

from kvsim.sim.calibration import regenerate_cpu_profile as regen
from kvsim.sim.calibration.errors import CalibrationError
from kvsim.sim.calibration.importance_fit import fit_importance, load_attention_stats
from kvsim.sim.calibration.profile_fit import FitOptions, fit_profile, nnls
from kvsim.sim.calibration.step_logs import load_step_logs
from kvsim.sim.cli import app
from kvsim.sim.model.cost_model import CostModel, load_profile
from kvsim.sim.crosscheck.comparison import shape_of_steps
from kvsim.sim.kv.importance import ImportanceModelSpec, attention_stats
from kvsim.sim.kv.policy import PolicyContext

FITTED = ("mfu_prefill", "mfu_decode", "mem_bw_eff", "attn_compute_eff", "attn_bw_eff", "copy_bw_eff",
          "step_overhead_s", "per_seq_overhead_s", "per_block_entry_overhead_s", "padded_attn_cost",
          "padded_prefill_cost")
TRUE = dict(mfu_prefill=0.21, mfu_decode=0.07, mem_bw_eff=0.33, attn_compute_eff=0.05, attn_bw_eff=0.15,
            copy_bw_eff=0.12, step_overhead_s=0.012, per_seq_overhead_s=2e-4, per_block_entry_overhead_s=3e-7,
            padded_attn_cost=12.0, padded_prefill_cost=6.0)


def synthetic_steps(n: int = 500, noise: float = 0.0, seed: int = 0, padded: bool = True) -> pd.DataFrame:
    """Step logs of a mix of prefill, decode and mixed steps timed by a known profile (without
    `padded`: no kv_tokens_padded column, timed by a profile whose attention does not pad)."""
    rng = np.random.default_rng(seed)
    kind = rng.integers(0, 3, n)
    batch = rng.integers(1, 33, n)
    ctx = rng.integers(16, 1500, n)
    prefill = np.where(kind == 0, rng.integers(16, 1024, n), np.where(kind == 2, rng.integers(16, 512, n), 0))
    decode = np.where(kind == 0, 0, batch)
    kv = decode * ctx + prefill
    prefill_seqs = rng.integers(1, 9, n)      # batched prefill of several prompts separates per-seq costs
    per_head = rng.random(n) < 0.5            # per_head layout: entries x layers x KV heads
    df = pd.DataFrame({"batch_size": np.where(kind == 0, prefill_seqs, batch + (kind == 2)), "prefill_tokens": prefill,
                       "decode_tokens": decode, "kv_tokens_read": kv, "attn_pairs_prefill": prefill * (prefill + 1) / 2,
                       "block_table_entries": (kv // 16 + 1) * np.where(per_head, 90, 1),
                       "bytes_moved": np.where(rng.random(n) < 0.3, rng.integers(2**22, 2**25, n), 0),
                       # decodes of unequal contexts, each padded to the longest (and holes left by eviction)
                       "kv_tokens_padded": decode * ctx * rng.uniform(1.0, 3.0, n),
                       # prefill chunks attending over the step's widest block table plus themselves
                       "attn_pairs_prefill_padded": prefill * (rng.integers(0, 2048, n) + prefill)})
    truth = load_profile("cpu-2core").model_copy(update=TRUE)
    if not padded:
        df = df.drop(columns=["kv_tokens_padded", "attn_pairs_prefill_padded"])
        truth = truth.model_copy(update={"padded_attn_cost": 0.0, "padded_prefill_cost": 0.0})
    df["duration_s"] = CostModel("smollm2", "cpu-2core", truth).predict(shape_of_steps(df))
    df["duration_s"] *= np.exp(noise * rng.standard_normal(n))
    return df


@pytest.mark.parametrize("noise", [0.0, 0.01])
def test_fit_recovers_known_factors(noise):
    # 1% timing noise: enough steps that every factor is determined to well under 2%
    report = fit_profile(synthetic_steps(n=4000 if noise else 500, noise=noise), "smollm2", "cpu-2core", base_profile="cpu-2core")
    # per_seq_overhead_s is nearly collinear with mfu_decode (both scale with the batch; only
    # memory-bound steps separate them), so under noise only the prediction pins it down
    for name in FITTED if noise == 0 else [f for f in FITTED if f != "per_seq_overhead_s"]:
        assert getattr(report.profile, name) == pytest.approx(TRUE[name], rel=0.02), name
    assert set(FITTED) <= set(report.fitted)
    assert {"pcie_eff", "allreduce_bw_eff", "allreduce_latency_s"} <= set(report.not_fitted)
    assert report.profile.pcie_eff == load_profile("cpu-2core").pcie_eff   # kept, not identifiable
    assert report.converged
    assert report.errors["all"]["mape"] < (1e-9 if noise == 0 else 0.02)
    assert set(report.errors) == {"prefill", "decode", "mixed", "all"}


def test_fit_starting_from_wrong_branches_still_converges():
    # default (H100) profile puts every step on other roofline branches than the truth
    report = fit_profile(synthetic_steps(), "smollm2", "cpu-2core", base_profile="default")
    assert report.errors["all"]["mape"] < 1e-6
    assert report.profile.mfu_prefill == pytest.approx(TRUE["mfu_prefill"], rel=0.02)


def test_fit_recovers_per_batch_size_decode_factors():
    """Decode steps timed with a per-batch-size factor: the fit recovers the table (sizes with enough
    decode steps) and the other factors; without such an effect the table stays ~1."""
    truth_table = {b: 1.0 for b in range(1, 33)}
    truth_table.update({3: 0.95, 4: 1.08, 8: 1.04})
    steps = synthetic_steps(n=2000)
    truth = load_profile("cpu-2core").model_copy(update={**TRUE, "decode_batch_factors": truth_table})
    steps["duration_s"] = CostModel("smollm2", "cpu-2core", truth).predict(shape_of_steps(steps))
    report = fit_profile(steps, "smollm2", "cpu-2core", base_profile="cpu-2core", options=FitOptions(decode_batch_factors=True))
    table = report.profile.decode_batch_factors
    for b in (3, 4, 8, 1, 16):
        assert table[b] == pytest.approx(truth_table[b], rel=0.02), b
    assert report.profile.mfu_decode == pytest.approx(TRUE["mfu_decode"], rel=0.02)
    assert report.errors["decode"]["mape"] < 0.01
    plain = fit_profile(synthetic_steps(n=2000), "smollm2", "cpu-2core", base_profile="cpu-2core",
                        options=FitOptions(decode_batch_factors=True))
    assert all(f == pytest.approx(1.0, abs=0.01) for f in plain.profile.decode_batch_factors.values())
    no_table = fit_profile(steps, "smollm2", "cpu-2core", base_profile="cpu-2core")
    assert no_table.profile.decode_batch_factors == {}
    assert no_table.errors["decode"]["mape"] > 10 * report.errors["decode"]["mape"]


def test_fit_trims_outliers():
    df = synthetic_steps(n=1000, noise=0.005)
    df.loc[::50, "duration_s"] *= 3.0           # 2% of steps hit by a background process
    report = fit_profile(df, "smollm2", "cpu-2core", base_profile="cpu-2core", options=FitOptions(trim=0.03))
    for name in ("mfu_prefill", "mfu_decode", "attn_compute_eff", "attn_bw_eff", "copy_bw_eff", "padded_attn_cost",
                 "padded_prefill_cost"):
        assert getattr(report.profile, name) == pytest.approx(TRUE[name], rel=0.02), name
    assert report.errors["all"]["median_ape"] < 0.01


def test_nnls_matches_exhaustive_search():
    rng = np.random.default_rng(3)
    a, b = rng.standard_normal((40, 5)), rng.standard_normal(40)
    x = nnls(a, b)
    assert (x >= 0).all()
    best = np.inf
    for mask in range(32):                     # brute force over active sets
        cols = [i for i in range(5) if mask >> i & 1]
        z = np.zeros(5)
        if cols:
            z[cols] = np.linalg.lstsq(a[:, cols], b, rcond=None)[0]
        if (z >= 0).all():
            best = min(best, np.linalg.norm(a @ z - b))
    assert np.linalg.norm(a @ x - b) == pytest.approx(best, rel=1e-9)


def test_cli_writes_profile_that_simulate_uses(tmp_path):
    steps = synthetic_steps(padded=False)         # a step log without padded counts: that factor stays 0
    steps.to_parquet(tmp_path / "steps.parquet")
    out = tmp_path / "fitted.yaml"
    res = CliRunner().invoke(app, ["calibrate", str(tmp_path), "--out", str(out), "--model", "smollm2",
                                   "--gpu", "cpu-2core", "--trim", "0"])
    assert res.exit_code == 0, res.output
    assert "decode" in res.output and "MAPE" in res.output
    prof = load_profile(out)
    assert prof.name == "fitted" and prof.mfu_decode == pytest.approx(0.07, rel=0.02)
    assert prof.meta["fit_errors"]["all"]["mape"] < 1e-6 and "kvsim calibrate" in prof.meta["command"]
    assert prof.padded_attn_cost == prof.padded_prefill_cost == 0
    assert {"padded_attn_cost", "padded_prefill_cost"} <= set(prof.meta["not_fitted"])
    run = CliRunner().invoke(app, ["simulate", "--trace", "azure-conv-2023", "--model", "smollm2", "--gpu", "cpu-2core",
                                   "--profile", str(out), "--max-requests", "5", "--num-gpu-blocks", "500",
                                   "--out", str(tmp_path / "run"), "-q"])
    assert run.exit_code == 0, run.output
    sim_steps = pd.read_parquet(tmp_path / "run" / "steps.parquet")
    expected = CostModel("smollm2", "cpu-2core", prof).predict(shape_of_steps(sim_steps))
    np.testing.assert_allclose(sim_steps["duration_s"], expected, rtol=1e-12)


def test_bad_step_logs_fail_with_file_and_column(tmp_path):
    with pytest.raises(CalibrationError, match="no such step log"):
        load_step_logs([tmp_path / "nope.parquet"])
    pd.DataFrame({"duration_s": [0.1]}).to_parquet(tmp_path / "a.parquet")
    with pytest.raises(CalibrationError, match=r"a\.parquet.*batch_size"):
        load_step_logs([tmp_path / "a.parquet"])
    df = synthetic_steps(20)
    df.loc[3, "duration_s"] = np.nan
    df.to_parquet(tmp_path / "b.parquet")
    with pytest.raises(CalibrationError, match=r"b\.parquet.*duration_s.*NaN"):
        load_step_logs([tmp_path / "b.parquet"])
    res = CliRunner().invoke(app, ["calibrate", str(tmp_path / "b.parquet"), "--out", str(tmp_path / "p.yaml")])
    assert res.exit_code == 2 and "duration_s" in res.output


def _stats_of_synthetic(spec: str, num_requests: int, seed: int) -> pd.DataFrame:
    ctx = PolicyContext("per_head", 30, 3, 9, 16, 90)
    st = attention_stats(ctx, spec, num_requests=num_requests, num_tokens=800, seed=seed)
    return pd.DataFrame({"request_id": np.repeat(np.arange(num_requests), 90), "layer": st["layer"],
                         "head": np.tile(ctx.row_head, num_requests), "num_keys": 800, "keys_95": st["keys_95"],
                         "sink_share": st["sink_share"], "recent_share": st["recent_share"]})


def test_importance_fit_reproduces_measured_statistics(tmp_path):
    stats = _stats_of_synthetic("smollm2-135m", 3, seed=5)
    fit = fit_importance(stats, seed=1)
    m, s = fit.measured, fit.synthetic
    assert s["keys95_median"] == pytest.approx(m["keys95_median"], rel=0.1)
    assert s["keys95_p90"] == pytest.approx(m["keys95_p90"], rel=0.15)
    assert s["sink_share_median"] == pytest.approx(m["sink_share_median"], abs=0.05)
    assert s["recent_share_median"] == pytest.approx(m["recent_share_median"], abs=0.05)
    assert s["request_log_keys95_std"] == pytest.approx(m["request_log_keys95_std"], rel=0.25)
    spec = ImportanceModelSpec.load(fit.write(tmp_path / "imp.yaml", command="kvsim calibrate --attention x"))
    assert spec.dense_layers in (2, 3) and spec.mix["heavy"] > 0.2
    assert "regenerate: kvsim calibrate" in (tmp_path / "imp.yaml").read_text()


def test_bad_attention_stats_fail_clearly(tmp_path):
    with pytest.raises(CalibrationError, match="attention_stats.parquet"):
        load_attention_stats(tmp_path)
    df = _stats_of_synthetic("smollm2-135m", 1, 0).drop(columns=["sink_share"])
    df.to_parquet(tmp_path / "attention_stats.parquet")
    with pytest.raises(CalibrationError, match="sink_share"):
        load_attention_stats(tmp_path)
    res = CliRunner().invoke(app, ["calibrate", "--attention", str(tmp_path), "--out", str(tmp_path / "i.yaml")])
    assert res.exit_code == 2 and "sink_share" in res.output


def test_repeated_replays_are_fitted_on_each_steps_median(tmp_path):
    """Three repeats of one workload, each step off by up to 30% in two of them: the median is exact."""
    steps = synthetic_steps(n=500)
    rng = np.random.default_rng(7)
    factors = rng.permuted(np.stack([np.ones(len(steps)), 1 + rng.uniform(0, 0.3, len(steps)),
                                     1 - rng.uniform(0, 0.3, len(steps))], axis=1), axis=1)
    dirs = []
    for i in range(3):
        d = tmp_path / f"rep{i}"
        d.mkdir()
        steps.assign(duration_s=steps["duration_s"] * factors[:, i]).to_parquet(d / "steps.parquet")
        dirs.append(str(d))
    merged = load_step_logs([",".join(dirs)])
    np.testing.assert_allclose(merged["duration_s"], steps["duration_s"], rtol=1e-12)
    assert (merged["repeats"] == 3).all() and merged["source"].iloc[0] == ",".join(f"{d}/steps.parquet" for d in dirs)
    np.testing.assert_allclose(merged["duration_spread"], factors.max(axis=1) - factors.min(axis=1), rtol=1e-9)
    out = tmp_path / "fitted.yaml"
    res = CliRunner().invoke(app, ["calibrate", ",".join(dirs), "--out", str(out), "--model", "smollm2",
                                   "--gpu", "cpu-2core", "--base-profile", "cpu-2core", "--trim", "0"])
    assert res.exit_code == 0, res.output
    assert "500 steps are medians of repeated replays" in res.output
    prof = load_profile(out)
    for name in FITTED:
        assert getattr(prof, name) == pytest.approx(TRUE[name], rel=0.02), name
    single = fit_profile(load_step_logs([dirs[1]]), "smollm2", "cpu-2core", base_profile="cpu-2core")
    assert single.errors["all"]["mape"] > 0.05             # one noisy repeat alone fits far worse
    bad = steps.copy()
    bad.loc[7:, "batch_size"] += 1
    bad.to_parquet(tmp_path / "rep0" / "steps.parquet")
    with pytest.raises(CalibrationError, match=r"rep1/steps.parquet: not a repeat of .*rep0/steps.parquet: it "
                                               r"schedules differently from step 7 on \(batch_size"):
        load_step_logs([",".join(dirs)])


def test_cpu_profile_regeneration_replays_the_documented_workloads():
    """The workloads `python -m kvsim.sim.calibration.regenerate_cpu_profile` replays (defaults)."""
    args = regen.parse_args([])
    runs = regen.calibration_runs(args)
    assert list(runs) == ["replay-sweep", "replay-staggered", "replay-long-decode", "replay-irregular",
                          "replay-h2o-b128", "replay-h2o-b256", "replay-h2o-b512"]
    assert all(cfg.kv.policy == "none" for name, (cfg, _) in runs.items() if "h2o" not in name)
    assert [runs[f"replay-h2o-b{b}"][0].kv.budget for b in (128, 256, 512)] == [128, 256, 512]
    sweep = runs["replay-sweep"][1].df
    closed = sweep[sweep["arrival_time_s"] < 16 * 1e4]          # 4 batch sizes x 4 prompt lengths, one per gap
    assert closed.groupby("arrival_time_s").size().tolist() == [1, 2, 4, 8] * 4
    assert sorted(set(closed["prompt_tokens"])) == [64, 256, 768, 1024]
    staggered = runs["replay-staggered"][1].df
    first = staggered.groupby(staggered["arrival_time_s"] // 1e4)["arrival_time_s"].agg(["min", "max"])
    assert ((first["max"] - first["min"]) == 1.5).all()         # the later prompts join the first one's prefill
    irregular = runs["replay-irregular"][1].df["prompt_tokens"]
    assert (irregular % 16 != 0).all()
    assert regen.SHIPPED_PROFILE.is_file() and regen.SHIPPED_IMPORTANCE.is_file()


def test_cpu_profile_regeneration_fits_every_repeat_into_the_shipped_files(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(regen, "kvsim", lambda *a: calls.append(a))
    earlier = tmp_path / "earlier"
    for name in ("replay-sweep", "replay-sweep-r2", "replay-staggered"):
        (earlier / name).mkdir(parents=True)
    args = regen.parse_args(["--out", str(tmp_path / "cal"), "--repeats", "2", "--h2o-budgets", "64",
                             "--fit-also", str(earlier)])
    regen.fit(regen.calibration_runs(args), args)
    profile, importance = calls
    cal = tmp_path / "cal"
    assert profile[1] == f"{cal}/replay-sweep,{cal}/replay-sweep-r2,{earlier}/replay-sweep,{earlier}/replay-sweep-r2"
    assert profile[2] == f"{cal}/replay-staggered,{cal}/replay-staggered-r2,{earlier}/replay-staggered"
    assert profile[-6:] == ("--out", str(regen.SHIPPED_PROFILE), "--model", "smollm2-135m", "--gpu", "cpu-2core")
    assert importance == ("calibrate", "--attention", str(cal / "replay-sweep"), "--decisions",
                          str(cal / "replay-h2o-b64"), "--out", str(regen.SHIPPED_IMPORTANCE))


def test_cli_refuses_a_simulated_log_or_one_measured_on_another_model(tmp_path):
    """A `kvsim simulate` output was fitted as measurements (the simulator's own predictions), and a
    replay of SmolLM2 was fitted as the --model given (Llama-3.1-8B): two profiles that look fitted
    and are meaningless. Both are refused naming the log; a replay of the model given is fitted."""
    from kvsim.sim.config import load_config
    from kvsim.sim.simulator.simulate import run_simulation
    run_simulation(load_config(None, {"model": "smollm2", "gpu": "cpu-2core", "profile": "cpu-2core",
                                      "trace_options.max_requests": 8, "engine.num_gpu_blocks": 400}), tmp_path / "sim")
    res = CliRunner().invoke(app, ["calibrate", str(tmp_path / "sim"), "--out", str(tmp_path / "p.yaml")])
    assert res.exit_code == 2 and "a `kvsim simulate` step log: its duration_s are the simulator's predictions" in (
        " ".join(res.output.split()))
    replay = tmp_path / "replay"                     # a replay's files: a measured step log and its config
    replay.mkdir()
    synthetic_steps().to_parquet(replay / "steps.parquet")
    (replay / "summary.json").write_text('{"replay": {"device": "cpu"}}')
    (replay / "config.yaml").write_text("model: smollm2-135m\ntp: 1\n")
    other = CliRunner().invoke(app, ["calibrate", str(replay), "--out", str(tmp_path / "p.yaml"),
                                     "--model", "llama-3.1-8b"])
    assert other.exit_code == 2
    assert "measured on smollm2-135m (its config.yaml), not --model llama-3.1-8b" in " ".join(other.output.split())
    tp = CliRunner().invoke(app, ["calibrate", str(replay), "--out", str(tmp_path / "p.yaml"), "--tp", "2"])
    assert tp.exit_code == 2 and "measured at tp=1" in tp.output
    # a replay of the first 2 of SmolLM2's 30 layers (--layers 2) was fitted as the whole model: every
    # factor at the efficiency bound, step times ~15x too long
    (replay / "summary.json").write_text('{"replay": {"device": "cpu", "layers": 2}, "model_layers": 2}')
    part = CliRunner().invoke(app, ["calibrate", str(replay), "--out", str(tmp_path / "p.yaml")])
    assert part.exit_code == 2 and "measured on 2 of SmolLM2-135M's 30 layers" in " ".join(part.output.split())
    assert not (tmp_path / "p.yaml").exists()
