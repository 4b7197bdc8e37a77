"""kvsim capacity: SLO parsing, bisection against an analytically known boundary, replicas search."""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from typer.testing import CliRunner

from kvsim.sim.planning.capacity import CapacitySearch, find_capacity, parse_slo, read_capacity
from kvsim.sim.config import ConfigError, load_config
from kvsim.sim.simulator.simulate import run_simulation
from kvsim.sim.planning.sweep import read_store

N, SPACING, PROMPT = 40, 1.0, 2048


@pytest.fixture(scope="module")
def uniform(tmp_path_factory):
    """N requests SPACING s apart, PROMPT tokens in, one token out, on an engine that runs exactly one
    prefill per step (max_num_seqs=1, token budget = PROMPT). Each request alone takes one step of s
    seconds. At rate scale x, arrivals are SPACING/x apart: if SPACING/x >= s every TTFT is s, else
    request k waits for k earlier steps and TTFT_k = s + k (s - SPACING/x) exactly."""
    path = tmp_path_factory.mktemp("trace") / "uniform.csv"
    path.write_text("arrival_time_s,prompt_tokens,output_tokens\n"
                    + "".join(f"{i * SPACING},{PROMPT},1\n" for i in range(N)))
    overrides = {"trace": str(path), "engine.num_gpu_blocks": 4000, "engine.max_num_seqs": 1,
                 "engine.max_num_batched_tokens": PROMPT}
    step_s = run_simulation(load_config(None, {**overrides, "trace_options.max_requests": 1})).summary["ttft_p50_s"]
    return overrides, step_s


def test_uniform_trace_follows_the_closed_form(uniform):
    overrides, s = uniform
    k = np.arange(N)
    for x in (0.8 * SPACING / s, 1.3 * SPACING / s):
        ttft = run_simulation(load_config(None, {**overrides, "trace_options.rate_scale": x})).requests["ttft_s"]
        np.testing.assert_allclose(ttft, s + k * max(s - SPACING / x, 0.0), rtol=1e-9)


def test_bisection_finds_the_known_max_rate(uniform, tmp_path):
    overrides, s = uniform
    eps = 0.5
    # p99 of TTFT_k = s + k*delta over k = 0..N-1 is s + 0.99 (N-1) delta; solve for the boundary
    x_star = SPACING / (s - eps * s / (0.99 * (N - 1)))
    slo = parse_slo(f"ttft_p99<={s * (1 + eps) * 1e3:.9f}ms")
    result = find_capacity(load_config(None, overrides), slo, CapacitySearch(rel_tol=0.01), store=tmp_path)
    assert result.feasible and result.bounded
    curve = result.curve
    lowest_failing = curve.loc[~curve["meets_slo"], "searched_value"].min()
    assert result.answer <= x_star < lowest_failing
    assert (lowest_failing - result.answer) / result.answer <= 0.01
    assert result.answer == pytest.approx(x_star, rel=0.01)
    # the curve is what was simulated: passing below the answer, failing above
    assert curve.loc[curve["searched_value"] <= result.answer, "meets_slo"].all()
    assert not curve.loc[curve["searched_value"] > result.answer, "meets_slo"].any()
    assert result.answer_rate_req_s == pytest.approx(result.answer / SPACING)
    assert result.answer_metrics["num_gpus"] == 1 and result.answer_metrics["usd_per_m_output_tok"] > 0
    # every point is a run in the store; a second search reuses them all
    assert len(read_store(tmp_path)) == len(curve)
    mtimes = sorted(p.stat().st_mtime_ns for p in (tmp_path / "runs").iterdir())
    again = find_capacity(load_config(None, overrides), slo, CapacitySearch(rel_tol=0.01), store=tmp_path)
    assert again.answer == result.answer
    assert mtimes == sorted(p.stat().st_mtime_ns for p in (tmp_path / "runs").iterdir())
    assert read_capacity(tmp_path)["answer"] == result.answer


def test_fewest_replicas_matches_round_robin_arithmetic(uniform):
    overrides, s = uniform
    # round robin over n replicas spaces each replica's arrivals n*SPACING/x apart: no queueing
    # iff n >= x*s/SPACING. x is chosen so that ratio is 2.5 -> 3 replicas
    x = 2.5 * SPACING / s
    cfg = load_config(None, {**overrides, "trace_options.rate_scale": x})
    result = find_capacity(cfg, parse_slo(f"ttft_p99<={s * 1.01 * 1e3:.9f}ms"), CapacitySearch(mode="replicas"))
    assert result.answer == 3
    assert result.answer_metrics["num_gpus"] == 3
    meets = dict(zip(result.curve["searched_value"], result.curve["meets_slo"], strict=True))
    assert not meets[2] and meets[3]


def test_unreachable_slo_is_reported_infeasible(uniform):
    overrides, s = uniform
    result = find_capacity(load_config(None, overrides), parse_slo(f"ttft_p99<={s * 0.5 * 1e3:.6f}ms"),
                           CapacitySearch(min_scale=0.25))
    assert not result.feasible and result.answer is None
    assert result.curve["meets_slo"].sum() == 0
    # the output says why (it only said "no configuration searched meets the SLO")
    from kvsim.sim.planning.capacity import result_warnings
    [why] = result_warnings(result, max_evals=24)
    assert why.startswith("no rate scale down to 0.25 (") and f"(got {s * 1e3:.1f}ms)" in why
    assert "nearly unloaded, this configuration's latency is above the SLO" in why
    few = find_capacity(load_config(None, overrides), parse_slo(f"ttft_p99<={s * 0.5 * 1e3:.6f}ms"),
                        CapacitySearch(mode="replicas", max_replicas=2))
    assert result_warnings(few, max_evals=24)[0].startswith("no replica count up to 2 meets the SLO: ttft_p99<=")


def test_parse_slo():
    cs = parse_slo("ttft_p99<=2s, tpot_p99 < 100ms,slo_attainment>=0.99")
    assert [(c.metric, c.op, c.limit) for c in cs] == [
        ("ttft_p99_s", "<=", 2.0), ("tpot_p99_s", "<", 0.1), ("slo_attainment", ">=", 0.99)]
    assert cs[0].holds({"ttft_p99_s": 2.0}) and not cs[0].holds({"ttft_p99_s": 2.001})
    assert not cs[0].holds({"ttft_p99_s": math.nan})


@pytest.mark.parametrize("text, expected", [
    ("ttft_p99<=2", "not a duration with a unit"),
    ("ttft_p98<=2s", "unknown metric 'ttft_p98'"),
    ("ttft_p99=2s", "is not METRIC<=VALUE"),
    ("slo_attainment>=high", "takes a plain number"),
    (" , ", "no constraint"),
    # limits no run can meet (the search ran down to its lowest rate): refused before anything runs
    ("slo_attainment>=1.5", "slo_attainment is a fraction from 0 to 1 .* got 1.5"),
    ("goodput_req_s>=nan", "goodput_req_s takes a finite number, got 'nan'"),
    ("throughput_req_s>=inf", "takes a finite number"),
    ("ttft_p99<=0s", "a latency is never 0s; expected a limit above 0"),
])
def test_parse_slo_errors(text, expected):
    with pytest.raises(ConfigError, match=expected):
        parse_slo(text)


def test_goodput_thresholds_do_not_depend_on_the_constraints_order():
    """Each TTFT/TPOT upper limit overwrote the per-request goodput threshold, so
    'ttft_p99<=2s,ttft_p50<=200ms' counted good requests against 200 ms and the reverse order against
    2 s: two answers (and two run ids) for one SLO. The loosest limit of each kind is the threshold."""
    from kvsim.sim.planning.capacity import slo_for_goodput
    cfg = load_config(None, {})
    one = slo_for_goodput(cfg, parse_slo("ttft_p99<=2s,ttft_p50<=200ms,tpot_p99<=100ms"))
    two = slo_for_goodput(cfg, parse_slo("tpot_p99<=100ms,ttft_p50<=200ms,ttft_p99<=2s"))
    assert one.slo == two.slo and one.slo.ttft == two.slo.ttft
    assert math.isclose(parse_slo(f"ttft_p99<={one.slo.ttft}")[0].limit, 2.0)


def test_cli_capacity_prints_answer_and_cost(uniform, tmp_path):
    from kvsim.sim.cli import app
    overrides, s = uniform
    args = ["capacity", "--trace", overrides["trace"], "--num-gpu-blocks", "4000", "--max-num-seqs", "1",
            "--max-num-batched-tokens", str(PROMPT), "--slo", f"ttft_p99<={s * 1.5 * 1e3:.6f}ms",
            "--tol", "0.05", "--out", str(tmp_path), "-q"]
    res = CliRunner().invoke(app, args, env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    assert "max rate scale" in res.output and "per million output tokens" in res.output
    # the range printed is in capacity.json too (it was only printed), with the load sample it is for
    saved = read_capacity(tmp_path)
    low, high = saved["range"]["low"], saved["range"]["high"]
    assert low <= saved["answer"] <= high and f"(range {low:.4g}-{high:.4g})" in res.output
    assert set(saved["range"]["profile_band"]) == {"step times x0.952", "step times x1.05"}
    assert saved["load_sample"]["requests"] == N and saved["load_sample"]["window"] == "full trace"
    bad = CliRunner().invoke(app, ["capacity", "--slo", "ttft_p99<=2"])
    assert bad.exit_code == 2 and "not a duration with a unit" in bad.output


def test_cli_capacity_progress_names_each_range_variant(uniform, tmp_path):
    """The range's progress lines are labelled by the variant they search ("[8m@peak2] rate 2: meets").
    The profile band's labels, "[step times x0.952]", were read as Rich markup and swallowed, so its
    lines printed as an unlabelled "   rate 1.9375: meets" indistinguishable from each other."""
    from kvsim.sim.cli import app
    overrides, s = uniform
    args = ["capacity", "--trace", overrides["trace"], "--num-gpu-blocks", "4000", "--max-num-seqs", "1",
            "--max-num-batched-tokens", str(PROMPT), "--slo", f"ttft_p99<={s * 1.5 * 1e3:.6f}ms",
            "--tol", "0.05", "--repeats", "1", "--out", str(tmp_path)]
    res = CliRunner().invoke(app, args, env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    for label in ("step times x0.952", "step times x1.05"):
        assert f"  [{label}] rate " in res.output, res.output


def test_rate_search_on_a_sample_arriving_all_at_once_is_refused(tmp_path):
    """A closed batch (no arrival times) or one request: no rate scale changes the load. The search
    used to simulate the same run 11 times up to the 1024x limit and answer 'max rate scale 1024,
    nan req/s offered'; now one error says why and what to give instead, and nothing runs."""
    from kvsim.sim.cli import app
    batch = tmp_path / "batch.jsonl"
    synth = CliRunner().invoke(app, ["trace", "synth", str(batch), "-n", "20", "--prompt", "fixed:100",
                                     "--output", "fixed:10"])
    assert synth.exit_code == 0, synth.output
    one = tmp_path / "one.csv"
    one.write_text("arrival_time_s,prompt_tokens,output_tokens\n5.0,100,10\n")
    for trace, what in ((batch, "arrives all at once (20 requests)"), (one, "holds one request")):
        store = tmp_path / f"store-{trace.stem}"
        res = CliRunner().invoke(app, ["capacity", "--trace", str(trace), "--slo", "ttft_p99<=2s", "-q",
                                       "--out", str(store)])
        assert res.exit_code == 2, res.output
        assert f"--mode rate: the load sample (full trace) {what}: no rate scale changes its load" in res.output
        assert "--mode replicas" in res.output and not (store / "runs").exists()
    drawn = CliRunner().invoke(app, ["capacity", "--trace", str(batch), "--slo", "ttft_p99<=2s", "-q", "--max-evals", "2",
                                     "--repeats", "1", "--no-band", "--set", "trace_options.request_rate=10"])
    assert drawn.exit_code == 0 and "max rate scale" in drawn.output


def test_rejected_requests_are_said_not_hidden(tmp_path):
    """Requests that can never fit (over max_model_len) are rejected and fall out of every percentile:
    the search answered for the others without a word. Now a warning counts them at the answer, and
    when every request is rejected the infeasible answer says that instead of 'latency above the SLO'."""
    from kvsim.sim.planning.capacity import result_warnings
    path = tmp_path / "mixed.csv"
    path.write_text("arrival_time_s,prompt_tokens,output_tokens\n"
                    + "".join(f"{i},{100 if i % 2 else 3000},8\n" for i in range(20)))
    base = {"trace": str(path), "engine.num_gpu_blocks": 2000}
    some = find_capacity(load_config(None, {**base, "engine.max_model_len": 2000}), parse_slo("ttft_p99<=2s"),
                         CapacitySearch(max_evals=3))
    assert some.feasible
    assert any(w.startswith("10 of 20 requests were rejected at the answer (they can never fit")
               for w in result_warnings(some, max_evals=3))
    none = find_capacity(load_config(None, {**base, "engine.max_model_len": 50}), parse_slo("ttft_p99<=2s"),
                         CapacitySearch(max_evals=3))
    [why] = result_warnings(none, max_evals=3)
    assert not none.feasible and why.startswith("every request was rejected (they can never fit")


# ---- load windows and the representative sample ------------------------------------------------

def _trace(arrivals):
    from kvsim.traces import Trace
    n = len(arrivals)
    return Trace.from_columns(arrival_time_s=arrivals, prompt_tokens=[100] * n, output_tokens=[10] * n)


def test_busiest_windows_find_the_bursts_in_order_without_overlap():
    from kvsim.traces.windows import busiest_windows, resolve_window
    # one request a second for 1000 s, plus a burst of 50 at 300-310 s and one of 30 at 700-705 s
    arrivals = np.sort(np.r_[np.arange(1000.0), np.linspace(300, 310, 50), np.linspace(700, 705, 30)])
    first, second, third = busiest_windows(arrivals, 60.0, 3)
    assert first[0] <= 300 and first[0] + 60 > 310 and first[1] == 60 + 50
    assert second[0] <= 700 and second[0] + 60 > 705 and second[1] == 60 + 30
    assert third[1] == 60 and abs(third[0] - first[0]) >= 60 and abs(third[0] - second[0]) >= 60
    w = resolve_window(_trace(arrivals), "1m@peak2")
    assert (w.start_s, w.end_s, w.requests) == (second[0], second[0] + 60, 90)
    w = resolve_window(_trace(arrivals), "100:200")
    assert (w.start_s, w.end_s, w.requests) == (100.0, 200.0, 100)
    assert resolve_window(_trace(arrivals), "full").is_full


@pytest.mark.parametrize("spec, message", [
    ("5x@peak", "is not a duration"),
    ("200:100", "end must be after start"),
    ("5000:6000", "no request arrives in it"),
    ("10m@peak3", "has only 1 non-overlapping 10m windows"),
    ("soon", "expected DUR@peak"),
])
def test_window_errors_say_what_was_expected(spec, message):
    from kvsim.traces import TraceError
    from kvsim.traces.windows import resolve_window
    with pytest.raises(TraceError, match=message) as exc:
        resolve_window(_named(_trace(np.arange(1000.0)), "steady"), spec)
    if "duration" not in message:
        assert str(exc.value).startswith("steady: window ")     # the trace is named, not '<trace>'


def _named(trace, name: str):
    trace.name = name
    return trace


def test_representative_sample_is_the_full_trace_when_small_else_its_peak():
    from kvsim.sim.planning.capacity import choose_sample
    small, sample = choose_sample(load_config(None, {"trace": "azure-code-2023", "trace_options.max_requests": 100}),
                                  None)
    assert sample.window == "first 100 requests" and small.trace_options.max_requests == 100
    cfg, sample = choose_sample(load_config(None, {"trace": "azure-conv-2023"}), None)
    # 19,366 requests over 3,502 s: the busiest window holding ~2,500 at the mean rate (8 minutes)
    assert sample.window.startswith("8m@peak") and cfg.trace_options.end_s - cfg.trace_options.start_s == pytest.approx(480)
    assert sample.requests > 2500 * 1.2 and sample.rate_req_s > sample.trace_rate_req_s
    from kvsim.sim.engine.assembly import load_workload
    assert len(load_workload(cfg)) == sample.requests


def test_the_load_sample_line_states_the_rate_scale_applied(uniform, tmp_path):
    from kvsim.sim.cli import app
    trace = uniform[0]["trace"]
    rate = N / ((N - 1) * SPACING)                  # N arrivals over (N - 1) SPACING s, at scale 1
    line = f"load sample: full trace, {N} of {N} requests (100%), {{r:.2f}} req/s (trace {{r:.2f}}), inter-arrival CV "
    once = ["--max-replicas", "1", "--repeats", "1", "--no-band", "--slo", "ttft_p99<=100s", "-q"]
    for scale, args in ((1, []), (2.5, ["--rate-scale", "2.5"])):
        for command in (["capacity", "--mode", "replicas"], ["plan", "--models", "llama-3.2-1b", "--gpus", "h100",
                                                              "--tps", "1", "-j", "1"]):
            res = CliRunner().invoke(app, [*command, "--trace", trace, *once, *args, "--out",
                                           str(tmp_path / f"{command[0]}{scale}")], env={"COLUMNS": "300"})
            assert res.exit_code == 0, res.output
            first = res.output.splitlines()[0]
            assert first.startswith(line.format(r=rate * scale)) and first.endswith(f"at rate scale {scale:g}"), first
    from kvsim.sim.planning.capacity import LoadSample, sample_warnings
    (warning,) = sample_warnings(LoadSample("first 200 requests", None, None, 200, 3.2, 1.0, 19366, 5.5, 1.1,
                                            rate_scale=2))
    assert "6.40 req/s, 0.58x the trace's 11.00 req/s" in warning


def test_sample_warnings_name_rate_and_burstiness():
    from kvsim.sim.planning.capacity import LoadSample, sample_warnings
    calm = LoadSample("first 200 requests", None, None, 200, 3.2, 1.0, 19366, 5.5, 1.1)
    (rate,) = sample_warnings(calm)
    assert "3.20 req/s, 0.58x the trace's 5.50 req/s" in rate
    bursty = LoadSample("10m@peak", 0, 600, 4000, 6.0, 2.0, 19366, 5.5, 1.1)
    assert "burstiness differs" in sample_warnings(bursty)[0]
    assert sample_warnings(LoadSample("full trace", None, None, 10, 5.5, 1.1, 10, 5.5, 1.1)) == []


def test_drain_dominated_and_search_limit_warnings(uniform):
    from kvsim.sim.planning.capacity import drain_share, result_warnings
    overrides, s = uniform
    # every request arrives at once (huge rate scale): the whole run is the queue draining
    loose = parse_slo("ttft_p99<=1000s")
    result = find_capacity(load_config(None, overrides), loose, CapacitySearch(start=512, max_scale=1024, max_evals=3))
    assert result.feasible and not result.bounded
    row = result.curve.set_index("run_id").loc[result.answer_run_id].to_dict()
    assert drain_share(row) > 0.9
    text = " ".join(result_warnings(result, 3))
    assert "lower bound" in text and "drain-dominated" in text
    # well below capacity nothing drains and the answer is bracketed: no warning
    ok = find_capacity(load_config(None, overrides), parse_slo(f"ttft_p99<={s * 1.5 * 1e3:.6f}ms"),
                       CapacitySearch(rel_tol=0.05))
    assert ok.bounded and result_warnings(ok, 24) == []


# ---- error bars: the profile's measured error, other samples ------------------------------------

def test_profile_fit_error_is_read_when_present():
    from kvsim.sim.planning.capacity import measured_profile_error, profile_configs
    err = measured_profile_error("cpu-smollm2")
    assert err is not None and err.mape == pytest.approx(0.04026) and err.bias == pytest.approx(-0.00875)
    assert measured_profile_error("default") is None        # hand-set: no measured error, no band
    assert measured_profile_error("no-such-profile") is None
    # `auto` is the GPU's own profile: the band scales it by its own measured error
    h100 = measured_profile_error("auto", "h100")
    assert h100 is not None and 0 < h100.mape < 0.2
    band, notes = profile_configs(load_config(None, {"gpu": "h100", "profile": "auto"}))
    assert [c.profile for c in band.values()] == [f"auto*{1 - h100.mape:.6g}", f"auto*{1 + h100.mape:.6g}"]
    assert "MAPE" in notes[0]


def test_scaled_profile_multiplies_every_step_time():
    from kvsim.sim.model.cost_model import CostModel, ProfileError, load_profile
    from kvsim.sim.core.step import BatchShape
    shape = BatchShape(num_seqs=np.array([1.0, 8, 64]), num_prefill_tokens=np.array([2048.0, 0, 100]),
                       num_decode_tokens=np.array([0.0, 8, 63]), kv_tokens_read=np.array([0.0, 8000, 64000]),
                       block_table_entries=np.array([128.0, 500, 4000]))
    base = CostModel("llama-3.1-8b", "h100", load_profile("default"), tp=2)
    slow = CostModel("llama-3.1-8b", "h100", load_profile("default*1.25"), tp=2)
    np.testing.assert_allclose(slow.predict(shape), 1.25 * base.predict(shape), rtol=1e-12)
    args = (np.array([8.0, 64]), np.array([8000.0, 64000]), np.array([500.0, 4000]))
    np.testing.assert_allclose(slow.predict_decode(*args), 1.25 * base.predict_decode(*args), rtol=1e-12)
    fitted = CostModel("llama-3.1-8b", "h100", load_profile("auto", gpu="h100"), tp=2)      # operator form
    scaled = CostModel("llama-3.1-8b", "h100", load_profile("auto*0.9", gpu="h100"), tp=2)
    np.testing.assert_allclose(scaled.predict(shape), 0.9 * fitted.predict(shape), rtol=1e-12)
    np.testing.assert_allclose(scaled.predict_decode(*args), 0.9 * fitted.predict_decode(*args), rtol=1e-12)
    assert load_profile("default*1").step_time_scale == 1.0
    with pytest.raises(ProfileError, match=r"must be in 0\.001\.\.1000"):
        load_profile("default*0")


def test_profile_band_follows_the_closed_form(uniform, tmp_path):
    """Step times x k make every TTFT of the uniform trace k s + i (k s - SPACING/x): the band's two
    searches land on the closed-form boundary for k = 1 -/+ mape."""
    from kvsim.sim.planning.capacity import LoadSample, RangeVariants, capacity_range
    from kvsim.sim.model.cost_model import load_profile
    overrides, s = uniform
    mape = 0.1
    profile = load_profile("auto", gpu="h100").model_copy(update={"name": "fitted", "meta": {
        "fit_errors": {"all": {"count": 100, "mape": mape, "bias": 0.01}}}})
    path = profile.to_yaml(tmp_path / "fitted.yaml")
    cfg = load_config(None, {**overrides, "profile": str(path)})
    limit = s * 1.5
    slo = parse_slo(f"ttft_p99<={limit * 1e3:.9f}ms")
    result = find_capacity(cfg, slo, CapacitySearch(rel_tol=0.005, max_evals=40))
    sample = LoadSample("full trace", None, None, N, 1.0, 0.0, N, 1.0, 0.0)
    spread = capacity_range(cfg, slo, result, sample, CapacitySearch(rel_tol=0.005, max_evals=40), RangeVariants(repeats=1))

    def boundary(k):     # p99 = k s + 0.99 (N-1) (k s - SPACING/x) = limit
        return SPACING / (k * s - (limit - k * s) / (0.99 * (N - 1)))
    low, high = spread.profile_band["step times x1.1"], spread.profile_band["step times x0.9"]
    assert low == pytest.approx(boundary(1 + mape), rel=0.006) and high == pytest.approx(boundary(1 - mape), rel=0.006)
    assert spread.low == low < result.answer < spread.high == high
    assert any("MAPE" in n for n in spread.notes) and spread.samples == {}


def test_length_only_trace_ranges_over_arrival_seeds():
    from kvsim.sim.planning.capacity import choose_sample, variant_configs
    cfg = load_config(None, {"trace": "sharegpt-8k-filtered", "trace_options.rate": 2.0, "seed": 3})
    cfg, sample = choose_sample(cfg, "10m@peak")
    variants, notes = variant_configs(cfg, sample, 3)
    assert [v.seed for v in variants.values()] == [4, 5] and notes == []
    full, notes = variant_configs(load_config(None, {"trace": "azure-conv-2023"}),
                                  dataclasses.replace(sample, window="full trace"), 3)
    assert full == {} and "no resampled range" in notes[0]


def test_default_sample_range_holds_the_full_trace_answer():
    """docs/planning.md's example on the shipped Azure code trace: the answer on the default sample
    (its busiest 16 minutes) and its range over the next busiest window hold the answer on all 8,819
    requests. The full trace's bracket [answer, lowest failing scale] must overlap the range."""
    from kvsim.sim.planning.capacity import capacity_range, choose_sample
    slo = parse_slo("ttft_p99<=2s,tpot_p99<=100ms")
    cfg = load_config(None, {"trace": "azure-code-2023", "model": "llama-3.1-8b", "gpu": "h100"})
    sampled, sample = choose_sample(cfg, None)
    assert sample.window.startswith("16m@peak") and sample.requests < len_of_trace(cfg) / 2
    result = find_capacity(sampled, slo, CapacitySearch(start=0.25, rel_tol=0.1))
    spread = capacity_range(sampled, slo, result, sample, CapacitySearch(rel_tol=0.1))
    assert spread.samples and spread.low < spread.high
    full_cfg, full_sample = choose_sample(cfg, "full")
    assert full_sample.requests == len_of_trace(cfg) and full_cfg.trace_options.start_s is None
    full = find_capacity(full_cfg, slo, CapacitySearch(start=0.25, rel_tol=0.1))
    assert full.bounded
    full_fail = full.curve.loc[~full.curve["meets_slo"], "searched_value"].min()
    assert full.answer <= spread.high and full_fail >= spread.low, (full.answer, full_fail, spread)


def len_of_trace(cfg) -> int:
    from kvsim.sim.planning.capacity import unwindowed_trace
    return len(unwindowed_trace(cfg))


def test_request_rate_loads_are_not_windowed():
    """vllm bench serve's --request-rate draws arrivals after the selection: the sample is the trace as
    configured, its range is over arrival seeds, and a window is refused."""
    from kvsim.sim.planning.capacity import choose_sample, variant_configs
    cfg = load_config(None, {"trace": "sharegpt-8k-filtered", "trace_options.request_rate": 4.0,
                             "trace_options.max_requests": 300})
    sampled, sample = choose_sample(cfg, None)
    assert sampled == cfg and sample.requests == 300
    assert [v.seed for v in variant_configs(sampled, sample, 3)[0].values()] == [1, 2]
    with pytest.raises(ConfigError, match="--window selects requests by arrival time"):
        choose_sample(load_config(None, {"trace": "sharegpt-8k-filtered", "trace_options.request_rate": 4.0}),
                      "10m@peak")


def test_a_violation_of_many_seconds_reads_in_seconds():
    """A progress line printed a TTFT p99 of 2,571 s as '2571157.9ms'."""
    from kvsim.sim.planning.capacity import _fmt
    [c] = parse_slo("ttft_p99<=2s")
    assert _fmt(2571.1579, c) == "2,571.2s" and _fmt(0.1234, c) == "123.4ms"


def test_one_duration_parser_for_slos_and_windows():
    """`--window 10m` worked and an SLO of `1m` did not: SLOs and windows read durations with one parser."""
    from kvsim.sim.config import ConfigError, parse_duration
    from kvsim.traces.windows import parse_duration_s
    for text, seconds in (("1m", 60.0), ("1.5min", 90.0), ("1h", 3600.0), ("250ms", 0.25), ("500us", 5e-4)):
        assert parse_duration(text) == pytest.approx(seconds) == parse_duration_s(text)
    assert load_config(None, {"slo.ttft": "1m"}).slo.ttft_s == 60.0
    assert parse_duration_s("600") == 600.0                     # a window's bare number is seconds
    with pytest.raises(ConfigError, match="not a duration with a unit"):
        parse_duration("5")                                     # an SLO's is ambiguous

def test_capacity_searches_with_step_variance_and_says_how_much_the_answer_moved(uniform, tmp_path):
    from kvsim.sim.cli import app
    overrides, s = uniform
    args = ["capacity", "--trace", overrides["trace"], "--num-gpu-blocks", "4000", "--max-num-seqs", "1",
            "--max-num-batched-tokens", str(PROMPT), "--slo", f"ttft_p99<={s * 1.5 * 1e3:.6f}ms",
            "--tol", "0.05", "--repeats", "1", "--no-band", "--out", str(tmp_path / "auto"), "-q"]
    res = CliRunner().invoke(app, args, env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    v = read_capacity(tmp_path / "auto")["range"]["variance"]
    assert v["setting"] == "auto" and v["sigma"] > 0 and v["deterministic_answer"] > 0
    assert v["moved"] == pytest.approx((read_capacity(tmp_path / "auto")["answer"] - v["deterministic_answer"])
                                       / v["deterministic_answer"])
    assert "the answer moved by" in res.output and "with deterministic steps" in res.output
    off = CliRunner().invoke(app, [*args[:-3], "--step-variance", "0", "--out", str(tmp_path / "off"), "-q"],
                             env={"COLUMNS": "200"})
    assert off.exit_code == 0, off.output
    assert read_capacity(tmp_path / "off")["range"]["variance"] is None and "moved by" not in off.output
    bad = CliRunner().invoke(app, [*args[:-3], "--step-variance", "-1", "--out", str(tmp_path / "bad")])
    assert bad.exit_code == 2 and "step_variance" in bad.output
