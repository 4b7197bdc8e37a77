"""kvsim capacity: SLO parsing, bisection against an analytically known boundary, replicas search."""
from __future__ import annotations

import math

import numpy as np
import pytest
from typer.testing import CliRunner

from kvsim.sim.capacity import find_capacity, parse_slo, read_capacity
from kvsim.sim.config import ConfigError, load_config
from kvsim.sim.simulate import run_simulation
from kvsim.sim.sweep import read_store

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
    result = find_capacity(load_config(None, overrides), slo, rel_tol=0.01, store=tmp_path)
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
    again = find_capacity(load_config(None, overrides), slo, rel_tol=0.01, store=tmp_path)
    assert again.answer == result.answer
    assert mtimes == sorted(p.stat().st_mtime_ns for p in (tmp_path / "runs").iterdir())
    assert read_capacity(tmp_path)["answer"] == result.answer


def test_fewest_replicas_matches_round_robin_arithmetic(uniform):
    overrides, s = uniform
    # round robin over n replicas spaces each replica's arrivals n*SPACING/x apart: no queueing
    # iff n >= x*s/SPACING. x is chosen so that ratio is 2.5 -> 3 replicas
    x = 2.5 * SPACING / s
    cfg = load_config(None, {**overrides, "trace_options.rate_scale": x})
    result = find_capacity(cfg, parse_slo(f"ttft_p99<={s * 1.01 * 1e3:.9f}ms"), mode="replicas")
    assert result.answer == 3
    assert result.answer_metrics["num_gpus"] == 3
    meets = dict(zip(result.curve["searched_value"], result.curve["meets_slo"]))
    assert not meets[2] and meets[3]


def test_unreachable_slo_is_reported_infeasible(uniform):
    overrides, s = uniform
    result = find_capacity(load_config(None, overrides), parse_slo(f"ttft_p99<={s * 0.5 * 1e3:.6f}ms"),
                           min_scale=0.25)
    assert not result.feasible and result.answer is None
    assert result.curve["meets_slo"].sum() == 0


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
])
def test_parse_slo_errors(text, expected):
    with pytest.raises(ConfigError, match=expected):
        parse_slo(text)


def test_cli_capacity_prints_answer_and_cost(uniform, tmp_path):
    from kvsim.sim.cli import app
    overrides, s = uniform
    args = ["capacity", "--trace", overrides["trace"], "--num-gpu-blocks", "4000", "--max-num-seqs", "1",
            "--max-num-batched-tokens", str(PROMPT), "--slo", f"ttft_p99<={s * 1.5 * 1e3:.6f}ms",
            "--tol", "0.05", "--out", str(tmp_path), "-q"]
    res = CliRunner().invoke(app, args, env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    assert "max rate scale" in res.output and "per million output tokens" in res.output
    assert (tmp_path / "capacity.json").exists()
    bad = CliRunner().invoke(app, ["capacity", "--slo", "ttft_p99<=2"])
    assert bad.exit_code == 2 and "not a duration with a unit" in bad.output
