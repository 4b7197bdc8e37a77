"""kvsim plan: the fewest replicas of every configuration that fits, pruning, the cheapest per model,
checked against an exhaustive search with `find_capacity` on each configuration."""
from __future__ import annotations

import json
import re

import pytest
from typer.testing import CliRunner

from kvsim.sim.planning.capacity import CapacitySearch, find_capacity, parse_slo
from kvsim.sim.model.catalog import get_gpu
from kvsim.sim.config import load_config
from kvsim.sim.planning.plan import PlanSpace, executor, plan_capacity
from kvsim.sim.simulator.simulate import run_simulation

N, SPACING, PROMPT = 24, 1.0, 2048
GPUS, TPS = ["h100", "a100-80gb", "t4"], [1, 2]


@pytest.fixture(scope="module")
def uniform(tmp_path_factory):
    """N requests SPACING s apart, one prefill step each (see test_capacity.uniform); a load at which
    one H100 queues and a few replicas of it do not."""
    path = tmp_path_factory.mktemp("trace") / "uniform.csv"
    path.write_text("arrival_time_s,prompt_tokens,output_tokens\n"
                    + "".join(f"{i * SPACING},{PROMPT},1\n" for i in range(N)))
    overrides = {"trace": str(path), "engine.num_gpu_blocks": 4000, "engine.max_num_seqs": 1,
                 "engine.max_num_batched_tokens": PROMPT}
    s = run_simulation(load_config(None, {**overrides, "trace_options.max_requests": 1})).summary["ttft_p50_s"]
    x = 2.5 * SPACING / s
    return {**overrides, "trace_options.rate_scale": x}, parse_slo(f"ttft_p99<={s * 1.2 * 1e3:.6f}ms")


def test_plan_finds_the_cheapest_that_an_exhaustive_search_finds(uniform, tmp_path):
    overrides, slo = uniform
    base = load_config(None, overrides)
    result = plan_capacity(base, slo, PlanSpace(["llama-3.1-8b"], GPUS, TPS, max_replicas=8), store=tmp_path)
    # T4 (15 GiB) cannot hold the 16 GB of bf16 weights at TP 1: pruned before anything runs
    assert [(c.gpu, c.tp) for c, _ in result.unfit] == [("t4", 1)]
    assert "does not fit" in result.unfit[0][1]
    exhaustive, one_by_one = {}, 0
    for s in result.searches:
        r = find_capacity(s.cand.cfg, slo, CapacitySearch(mode="replicas", max_replicas=8))
        exhaustive[(s.cand.gpu, s.cand.tp)] = r.answer
        one_by_one += len(r.curve)
        if s.status == "answer":
            assert s.hi_ok == r.answer, s.cand.label
        elif s.status == "over max replicas":
            assert r.answer is None
    cost = {k: get_gpu(g).usd_per_hour * k[1] * n for k, n in exhaustive.items() if n is not None for g in [k[0]]}
    best = min(cost.values())
    winner = result.cheapest["llama-3.1-8b"]
    assert cost[(winner.cand.gpu, winner.cand.tp)] == best
    dominated = [s for s in result.searches if s.status == "dominated"]
    assert dominated, "the slower or bigger configurations are dropped once an answer is cheaper"
    for s in dominated:
        key = (s.cand.gpu, s.cand.tp)
        assert exhaustive[key] is None or cost[key] >= best
    # pruning saves simulations: fewer than the searches above ran one by one
    assert result.simulations == sum(len(s.rows) for s in result.searches) < one_by_one
    front = result.pareto()
    assert front["meets_slo"].all() and front["usd_per_hour"].min() == best
    # the store: every point a sweep row, a second plan reuses them all
    again = plan_capacity(base, slo, PlanSpace(["llama-3.1-8b"], GPUS, TPS, max_replicas=8), store=tmp_path)
    assert again.simulations == 0 and again.cheapest["llama-3.1-8b"].cand.label == winner.cand.label
    saved = json.loads((tmp_path / "plan-result.json").read_text())
    assert saved["cheapest"] == {"llama-3.1-8b": winner.cand.label}


def test_dask_executor_gives_the_serial_rounds(uniform):
    from distributed import LocalCluster
    overrides, slo = uniform
    base = load_config(None, overrides)
    # the same rounds (width 2) run in this process
    serial = plan_capacity(base, slo, PlanSpace(["llama-3.1-8b"], ["h100"], TPS, max_replicas=8), width=2)
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=False, dashboard_address=None) as cluster, \
            executor(cluster.scheduler_address) as (run_batch, width):
        assert width == 2
        dask = plan_capacity(base, slo, PlanSpace(["llama-3.1-8b"], ["h100"], TPS, max_replicas=8),
                             run_batch=run_batch, width=width)
    assert [(s.cand.label, s.status, s.hi_ok) for s in dask.searches] == \
        [(s.cand.label, s.status, s.hi_ok) for s in serial.searches]
    key = ["run_id", "ttft_p99_s", "meets_slo"]
    assert dask.points()[key].sort_values("run_id").values.tolist() == \
        serial.points()[key].sort_values("run_id").values.tolist()


def test_cli_plan_prints_each_configuration_and_the_cheapest(uniform, tmp_path):
    from kvsim.sim.cli import app
    overrides, slo = uniform
    args = ["plan", "--slo", slo[0].text, "--models", "llama-3.1-8b", "--gpus", "h100,t4", "--tps", "1,2",
            "--trace", overrides["trace"], "--rate-scale", str(overrides["trace_options.rate_scale"]),
            "--set", "engine.num_gpu_blocks=4000", "--set", "engine.max_num_seqs=1",
            "--set", f"engine.max_num_batched_tokens={PROMPT}", "--max-replicas", "8", "-j", "1", "-q",
            "--out", str(tmp_path)]
    res = CliRunner().invoke(app, args, env={"COLUMNS": "250"})
    assert res.exit_code == 0, res.output
    assert "llama-3.1-8b: cheapest h100 TP1 x 3 replicas = 3 GPUs" in res.output
    text = " ".join(res.output.split())
    # the unfit configuration with its reason (in the table, wrapped to the terminal, and in the store)
    saved = json.loads((tmp_path / "plan-result.json").read_text())
    (unfit,) = saved["unfit"]
    assert unfit["config"] == "llama-3.1-8b t4 TP1"
    assert re.fullmatch(r"Llama-3.1-8B does not fit on T4 \(tp=1\): [\d.]+ GiB missing", unfit["why"])
    # the range: H100's fitted profile carries its measured error, so the band is searched
    assert "Pareto table" in text and "profile band: step times x(1 +/- 0.0476)" in text
    for bad, message in ((["--tps", "1,x"], "--tps: expected comma-separated positive integers"),
                         (["--gpus", "h100,b300"], "--gpus: unknown gpu 'b300'"),
                         (["--models", "llama-3.1-8b,llama-9000"], "--models: unknown model 'llama-9000'")):
        out = CliRunner().invoke(app, [*args[:1], "--slo", "ttft_p99<=2s", "--models", "llama-3.1-8b",
                                       "--gpus", "h100", *bad, "-j", "1"])
        assert out.exit_code == 2 and message in out.output, out.output


def test_cli_plan_names_a_model_that_cannot_run_and_plans_an_alias_once(uniform, tmp_path):
    """A model with no configuration that fits got no line of its own (only the table's 'cannot
    run' rows); a second spelling of one catalog entry (l4, L4) was planned as another GPU."""
    from kvsim.sim.cli import app
    overrides, slo = uniform
    args = ["plan", "--slo", "ttft_p99<=2s", "--models", "llama-3.1-70b,llama-3.1-8b,Llama-3.1-8B",
            "--gpus", "t4,T4", "--tps", "1", "--trace", overrides["trace"], "--set", "trace_options.max_requests=4",
            "--set", "engine.num_gpu_blocks=400", "--repeats", "1", "--no-band", "-j", "1", "-q", "--out", str(tmp_path)]
    res = CliRunner().invoke(app, args, env={"COLUMNS": "250"})
    assert res.exit_code == 1, res.output
    text = " ".join(res.output.split())
    assert "llama-3.1-70b: no configuration can run" in text and "llama-3.1-8b: no configuration can run" in text
    assert "Llama-3.1-8B: no" not in text
    saved = json.loads((tmp_path / "plan-result.json").read_text())
    assert sorted(u["config"] for u in saved["unfit"]) == ["llama-3.1-70b t4 TP1", "llama-3.1-8b t4 TP1"]


def test_candidates_cross_models_gpus_tps_and_policies():
    from kvsim.sim.planning.plan import candidates
    base = load_config(None, {"kv.budget": 256})
    cands, unfit = candidates(base, PlanSpace(["llama-3.1-8b"], ["h100", "l4"], [1, 3], ["none", "h2o"]))
    assert [(c.gpu, c.tp, c.policy, c.cfg.kv.policy) for c in cands] == [
        ("h100", 1, "none", "none"), ("h100", 1, "h2o", "h2o"), ("l4", 1, "none", "none"), ("l4", 1, "h2o", "h2o")]
    # TP 3 does not divide Llama-3.1-8B's 32 heads: never simulated, with the reason
    assert {(c.gpu, c.tp) for c, _ in unfit} == {("h100", 3), ("l4", 3)}
    assert all("tp=3 must divide num_heads=32" in why for _, why in unfit)


def test_a_budget_crossed_with_policies_goes_to_those_that_take_one():
    """`plan --policies none,h2o --budget 256`: the baseline runs without the budget it would refuse."""
    from kvsim.sim.planning.plan import candidates
    base = load_config(None, {"kv.budget": 256})
    cands, _ = candidates(base, PlanSpace(["llama-3.1-8b"], ["h100"], [1], ["none", "h2o", "streaming"]))
    assert {c.policy: c.cfg.kv.budget for c in cands} == {"none": None, "h2o": 256, "streaming": None}
