"""Per-request variation of the frontend's fixed latency (`frontend_jitter`, sim/simulator/client.py
`RequestJitter`; issue 54 item 5): seeded and reproducible, off by default (byte-identical outputs), a
mean-one lognormal, fitted to a published run's TTFT spread, and it knocks a fixed-length closed loop
out of lockstep where the profile's deterministic frontend keeps it in waves."""
import json

import numpy as np
import pytest
from typer.testing import CliRunner

from kvsim.sim.cli import app
from kvsim.sim.config import SimConfig
from kvsim.sim.model.cost_model import ClientLatency
from kvsim.sim.simulator.client import Frontend, RequestJitter, fitted_jitter, resolve_jitter
from kvsim.sim.simulator.simulate import run_simulation
from kvsim.traces.synthetic import closed_batch


def test_factors_are_a_seeded_mean_one_lognormal_keyed_by_request():
    jitter = RequestJitter(0.356, seed=3)
    f = np.array([jitter.factor(i) for i in range(20_000)])
    assert f.mean() == pytest.approx(1.0, abs=0.01)                       # the mean latency is kept
    assert np.median(f) == pytest.approx(np.exp(-0.356 ** 2 / 2), abs=0.01)   # the median below it
    assert np.log(f).std() == pytest.approx(0.356, abs=0.01)
    # a request's factor depends on (seed, request id) alone, not on the order of the calls
    again = RequestJitter(0.356, seed=3)
    assert [again.factor(i) for i in (19_999, 5, 4_100)] == [f[19_999], f[5], f[4_100]]
    assert RequestJitter(0.356, seed=4).factor(5) != f[5]


def test_the_frontend_varies_only_the_fixed_latency():
    terms = ClientLatency(request_s=0.020, request_serial_s=0.001)
    jitter = RequestJitter(0.5, seed=0)
    entry = Frontend(terms, jitter)
    # the serial parse still queues in send order; the fixed part after it is the request's own
    assert entry.enter(7, 0.0, 0) == pytest.approx(0.001 + 0.020 * jitter.factor(7))
    assert entry.enter(8, 0.0, 0) == pytest.approx(0.002 + 0.020 * jitter.factor(8))
    plain = Frontend(terms)
    assert plain.enter(7, 0.0, 0) == pytest.approx(0.021)


def test_auto_is_the_fitted_sigma_with_its_source():
    entry = fitted_jitter()
    assert resolve_jitter("auto") == entry["sigma"] > 0
    assert "kvcached" in entry["source"] and len(entry["fitted_to"]["std_ttft_ms"]) == 3
    assert resolve_jitter(0.2) == 0.2


@pytest.fixture(scope="module")
def batch(tmp_path_factory):
    path = tmp_path_factory.mktemp("jitter") / "batch.jsonl"
    closed_batch(64, 256, 128).save(path)
    return path


def closed_loop(batch, jitter=0.0, seed=0, **extra):
    cfg = SimConfig.model_validate({
        "trace": str(batch), "model": "qwen2.5-0.5b", "gpu": "l4", "seed": seed, "client_latency": True,
        "frontend_jitter": jitter, "trace_options": {"max_concurrency": 16, **extra}})
    return run_simulation(cfg, None)


def test_jitter_knocks_a_closed_loop_out_of_lockstep_and_repeats(batch):
    """Fixed lengths under --max-concurrency 16 with the L4 profile's client terms: deterministic, the
    48 requests after the first wave get their first tokens at 12 step ends (the serial parse spreads a
    wave's sends by 0.7 ms each, no more); with the fitted jitter (sigma 0.356) at 16-17, with sigma 0.7
    at 23-27 (requests entering within one step still prefill together: docs/results.md, 2026-12-08).
    Same seed: the same run; another seed: another run."""
    def later(result):
        return result.requests.sort_values(["arrival_s", "request_id"]).iloc[16:]
    lockstep = later(closed_loop(batch))
    assert lockstep["first_token_s"].round(9).nunique() <= 12
    spread = later(closed_loop(batch, "auto"))
    assert spread["first_token_s"].round(9).nunique() >= 15
    assert later(closed_loop(batch, 0.7))["first_token_s"].round(9).nunique() >= 20
    again = later(closed_loop(batch, "auto"))
    np.testing.assert_array_equal(again["first_token_s"].to_numpy(), spread["first_token_s"].to_numpy())
    other = later(closed_loop(batch, "auto", seed=1))
    assert not np.array_equal(other["first_token_s"].to_numpy(), spread["first_token_s"].to_numpy())


def test_an_open_loop_takes_requests_in_entry_order(batch):
    """At 200 req/s a 20 ms fixed latency varied by sigma 1 lets later sends enter first: every request
    still enters at its own send + parse + fixed latency (the arrival process takes them in entry order),
    the TTFT of each includes its own fixed latency, and the decode fast-forward changes nothing."""
    def run(**opts):
        cfg = SimConfig.model_validate({
            "trace": str(batch), "model": "qwen2.5-0.5b", "gpu": "l4", "client_latency": True,
            "frontend_jitter": 1.0, "trace_options": {"request_rate": 200.0}, **opts})
        return run_simulation(cfg, None)
    res, stepped = run(), run(fast_forward=False)
    cols = ["request_id", "arrival_s", "first_token_s", "finish_s"]
    a = res.requests.sort_values("request_id")[cols].reset_index(drop=True)
    b = stepped.requests.sort_values("request_id")[cols].reset_index(drop=True)
    assert a.equals(b)
    assert (res.requests["status"] == "finished").all()
    jitter = RequestJitter(1.0, seed=0)
    fixed = np.array([0.0282 * jitter.factor(i) for i in a["request_id"]])
    assert (a["first_token_s"] - a["arrival_s"] > fixed).all()     # TTFT holds the request's own latency
    assert res.summary["frontend_jitter_sigma"] == 1.0


def test_jitter_is_opt_in_and_off_keeps_the_run(tmp_path):
    """Unset and 0 leave the outputs and summary.json as they were; config.yaml records it only when on."""
    def sim(*flags):
        out = tmp_path / "-".join(["run", *flags]).replace("--", "")
        res = CliRunner().invoke(app, ["simulate", "--trace", "azure-conv-2023", "--max-requests", "30", "--gpu", "h100",
                                       "--model", "qwen2.5-0.5b", "--client-latency", *flags, "-q", "--out", str(out)])
        assert res.exit_code == 0, res.output
        return out
    base, zero, on = sim(), sim("--frontend-jitter", "0"), sim("--frontend-jitter", "auto")
    assert (base / "requests.parquet").read_bytes() == (zero / "requests.parquet").read_bytes()
    assert "frontend_jitter" not in (base / "config.yaml").read_text()
    assert "frontend_jitter: auto" in (on / "config.yaml").read_text()
    assert "frontend_jitter_sigma" not in json.loads((base / "summary.json").read_text())
    assert json.loads((on / "summary.json").read_text())["frontend_jitter_sigma"] == resolve_jitter("auto")
    assert (base / "requests.parquet").read_bytes() != (on / "requests.parquet").read_bytes()


@pytest.mark.parametrize("flags, words", [
    (["--frontend-jitter", "lots"], ["--frontend-jitter", "'lots'", "auto"]),
    (["--frontend-jitter", "3"], ["frontend_jitter", "between 0 and 2"]),
    (["--frontend-jitter", "0.3"], ["frontend_jitter", "needs a frontend", "--frontend"]),
    (["--client-latency", "--set", "frontend_jitter=lots"], ["frontend_jitter", "expected auto", "'lots'"]),
    (["--client-latency", "--set", "frontend_jitter=true"], ["frontend_jitter", "expected auto", "True"]),
    (["--client-latency", "--set", "frontend_jitter=nan"], ["frontend_jitter", "expected auto"]),
    (["--set", "step_variance=lots"], ["step_variance", "expected auto", "deterministic"]),
])
def test_bad_jitter_is_one_line_naming_the_option(tmp_path, flags, words):
    res = CliRunner().invoke(app, ["simulate", "--trace", "azure-conv-2023", "--max-requests", "5", *flags,
                                   "-q", "--out", str(tmp_path / "run")])
    assert res.exit_code != 0
    assert all(w in res.output for w in words), res.output
    assert "Traceback" not in res.output and len(res.output.strip().splitlines()) == 1, res.output


def test_the_shipped_sigma_reproduces_the_spread_it_was_fitted_to():
    """auto's sigma gives the published TTFT std of the run it was fitted to (bench/fit_frontend_jitter.py)
    and, not fitted, brings that run's TTFT p99 within 10% (deterministic frontend: -28%)."""
    import importlib.util
    from pathlib import Path

    from kvsim.sim.calibration.published_runs import load_published_runs
    script = Path(__file__).resolve().parent.parent / "bench" / "fit_frontend_jitter.py"
    spec = importlib.util.spec_from_file_location("fit_frontend_jitter", script)
    fit = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fit)
    figures, point_run = fit.figures, fit.point_run
    runs = Path(__file__).parent / "data" / "published_runs" / "runs.yaml"
    run = next(r for r in load_published_runs(runs) if r.id == "h100-qwen3-0.6b")
    std_ms = float(np.mean(fitted_jitter()["fitted_to"]["std_ttft_ms"]))
    fitted = figures(point_run(run, 16.0, std_ms), resolve_jitter("auto"))
    assert abs(fitted["ttft_std_ms"].error) < 0.03
    assert abs(fitted["ttft_p99_ms"].error) < 0.10
