"""kvsim calibrate --bench (issue 47 item 8): a profile fitted to vllm bench serve result files. The files are
'measured' by kvsim itself under a profile with known factors, so the fit must recover them."""
import json
import warnings

import numpy as np
import pytest
import yaml
from typer.testing import CliRunner

from kvsim.sim.calibration.bench_fit import fit_bench, with_factors
from kvsim.sim.cli import app
from kvsim.sim.config import load_config
from kvsim.sim.model.cost_model import load_profile
from kvsim.sim.simulator.simulate import run_simulation
from kvsim.traces import load_trace

BASE = {"model": "qwen2.5-0.5b", "gpu": "l4"}
WORKLOADS = {      # two loads the way vllm bench serve sends them: closed loop of 8, and a trace's arrival times
    "sharegpt-c8.json": ("sharegpt-8k-filtered", {"trace_options.max_concurrency": 8}, 8),
    "azure-rate.json": ("azure-conv-2023", {"trace_options.rate_scale": 4}, None),
}


def bench_file(path, requests, max_concurrency):
    """A result JSON in vllm bench serve's layout (--save-result --save-detailed) from a kvsim run's table."""
    out = {"backend": "vllm", "model_id": "Qwen/Qwen2.5-0.5B-Instruct", "num_prompts": len(requests),
           "request_rate": "inf" if max_concurrency else 4.0, "burstiness": 1.0, "max_concurrency": max_concurrency,
           "duration": float(requests["finish_s"].max()), "completed": len(requests), "failed": 0,
           "input_lens": requests["prompt_tokens"].tolist(), "output_lens": requests["output_tokens"].tolist(),
           "ttfts": requests["ttft_s"].tolist(), "itls": [np.diff(t).tolist() for t in requests["token_times_s"]],
           "latencies": requests["e2e_s"].tolist(), "start_times": requests["arrival_s"].tolist(),
           "errors": [""] * len(requests)}
    path.write_text(json.dumps(out))
    return path


def measured(tmp_path, scale: float, request_s: float, names=tuple(WORKLOADS)):
    """The bench files of a 'server' that steps `scale` x slower than the L4 profile, `request_s` client latency."""
    true = with_factors(load_profile("auto", "l4"), scale, request_s).to_yaml(tmp_path / f"true-{scale}.yaml")
    paths = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in names:
            trace, options, concurrency = WORKLOADS[name]
            cfg = load_config(None, {**BASE, **options, "profile": str(true), "client_latency": True})
            run = run_simulation(cfg, trace=load_trace(trace).head(60), keep_steps=False)
            paths.append(bench_file(tmp_path / f"{scale}-{name}", run.requests, concurrency))
    return paths


def test_the_fit_recovers_the_servers_step_time_scale_and_client_latency(tmp_path):
    files = measured(tmp_path, 1.3, 0.040)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fit = fit_bench(files, BASE, load_profile("auto", "l4"), name="mine")
    assert fit.converged
    assert fit.step_time_scale == pytest.approx(1.3, rel=2e-3)
    assert fit.client_request_s == pytest.approx(0.040, abs=1e-3)
    assert fit.fit_error < 0.005 and fit.held_out_error < 0.005
    for k, r in fit.held_out_factors.values():            # each file alone gives the same server back
        assert k == pytest.approx(1.3, rel=2e-3) and r == pytest.approx(0.040, abs=1e-3)


def test_held_out_error_is_measured_on_the_file_left_out(tmp_path):
    """Two files of servers that differ (x1.15 and x1.6 step times): one scale cannot fit both, and each
    file predicted by a fit to the other errs more than the joint fit does."""
    files = measured(tmp_path, 1.15, 0.02, ("sharegpt-c8.json",)) + measured(tmp_path, 1.6, 0.02, ("azure-rate.json",))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fit = fit_bench(files, BASE, load_profile("auto", "l4"), name="mixed")
    assert 1.15 < fit.step_time_scale < 1.6
    tpot = {f: fit.errors[f]["median_tpot_ms"] for f in fit.errors}
    assert tpot[str(files[0])] > 0.05 and tpot[str(files[1])] < -0.05           # between the two servers
    held = {f: fit.held_out[f]["median_tpot_ms"] for f in fit.held_out}
    assert held[str(files[0])] > 0.3 and held[str(files[1])] < -0.2              # the other server's scale
    assert fit.held_out_error > 1.5 * fit.fit_error


def test_calibrate_bench_writes_a_profile_that_reproduces_the_files(tmp_path):
    files = measured(tmp_path, 0.8, 0.030)
    args = ["calibrate", *(a for f in files for a in ("--bench", str(f))), "--gpu", "l4", "-o", str(tmp_path / "p.yaml"),
            "--vllm", "vllm serve Qwen/Qwen2.5-0.5B-Instruct --max-num-seqs 256"]
    r = CliRunner().invoke(app, args, prog_name="kvsim", env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    assert "fit error: mean |error|" in r.output and "held-out error (leave-one-out" in r.output
    written = yaml.safe_load((tmp_path / "p.yaml").read_text())
    assert written["step_time_scale"] == pytest.approx(0.8, rel=2e-3)
    assert written["meta"]["fitted_on"]["model"] == "Qwen/Qwen2.5-0.5B-Instruct"
    assert set(written["meta"]["held_out_errors"]) == {f.name for f in files}
    assert written["meta"]["fitted_on"]["config"] == {"engine.max_num_seqs": 256}      # the pasted server line
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = load_config(None, {**BASE, "trace": str(files[0]), "profile": str(tmp_path / "p.yaml"),
                                 "client_latency": True})
        agg = run_simulation(cfg).summary["bench_comparison"]
    assert abs(agg["median_tpot_ms"]["error"]) < 0.005 and abs(agg["median_ttft_ms"]["error"]) < 0.01


@pytest.mark.parametrize("args, message", [
    (["--bench", "{a}"], "error: --bench: give --gpu, the GPU the benchmark ran on"),
    (["--bench", "missing.json", "--gpu", "l4"], "error: --bench missing.json: no such file"),
    (["--bench", "{a}", "--gpu", "l4", "--attention", "x"], "error: --bench fits to vllm bench serve results"),
    (["--vllm", "vllm serve x", "s.parquet"], "error: --vllm gives the measured server's flags to --bench"),
])
def test_calibrate_bench_mistakes_are_one_line(tmp_path, args, message):
    a = tmp_path / "a.json"
    a.write_text("{}")
    args = [x.replace("{a}", str(a)) for x in args]
    r = CliRunner().invoke(app, ["calibrate", *args, "-o", str(tmp_path / "p.yaml")], prog_name="kvsim")
    assert r.exit_code == 2 and r.stderr.startswith(message), r.output


def test_engine_only_fits_the_step_time_scale_alone(tmp_path):
    """--no-client: the files are simulated without the client's terms and only K moves (R stays 0)."""
    paths = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        true = with_factors(load_profile("auto", "l4"), 1.4, 0.0).to_yaml(tmp_path / "engine-only.yaml")
        trace, options, concurrency = WORKLOADS["sharegpt-c8.json"]
        run = run_simulation(load_config(None, {**BASE, **options, "profile": str(true)}),
                             trace=load_trace(trace).head(60), keep_steps=False)
        paths.append(bench_file(tmp_path / "engine.json", run.requests, concurrency))
        fit = fit_bench(paths, BASE, load_profile("auto", "l4"), name="engine", client=False)
    assert fit.step_time_scale == pytest.approx(1.4, rel=2e-3) and fit.client_request_s == 0.0
    assert fit.held_out == {} and fit.fit_error < 0.005          # one file: no held-out error
