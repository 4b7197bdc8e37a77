"""kvsim plan at scale (issue 49): capacity bounds (sim/planning/bounds.py) rule out replica counts before
anything runs and never the answer, the low-fidelity pass only orders the full search, and the pruned
search answers what an exhaustive search of the same space answers (48 configurations, aggregated and
disaggregated, on a 12-second slice of the Azure conversation trace at 8x its rate)."""
from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from kvsim.sim.config import load_config
from kvsim.sim.engine.resolved_run import resolve_run
from kvsim.sim.planning.bounds import at_least, demand_of, replica_bound
from kvsim.sim.planning.capacity import parse_slo
from kvsim.sim.planning.disaggregated import DisaggSpace, plan_disaggregated
from kvsim.sim.planning.plan import PlanSpace, _Runner, low_fi_window, plan_capacity
from kvsim.sim.planning.sweep import _serial

SLO = "ttft_p99<=1s,tpot_p99<=100ms"
MODEL = "llama-3.1-8b"
GPUS, TPS, MAX_REPLICAS = ["h100", "a100-80gb"], [1, 2], 8                 # 2 x 2 x 8 = 32 aggregated
POOLS, MAX_POOL = [("h100", 1), ("a100-80gb", 1)], 2                       # 2 x 2 x 2 x 2 = 16 disaggregated
SLICE = {"trace": "azure-conv-2023", "trace_options.start_s": 1586.0, "trace_options.end_s": 1598.0,
         "trace_options.rate_scale": 8.0}


def base():
    return load_config(None, {**SLICE, "model": MODEL})


@pytest.fixture(scope="module")
def exhaustive(tmp_path_factory):
    """Every configuration of the space simulated (one store, reused by the pruned searches)."""
    store = tmp_path_factory.mktemp("plan")
    slo = parse_slo(SLO)
    agg = plan_capacity(base(), slo, PlanSpace([MODEL], GPUS, TPS, max_replicas=MAX_REPLICAS, exhaustive=True),
                        store=store)
    dspace = DisaggSpace([MODEL], POOLS, POOLS, max_pool_replicas=MAX_POOL, exhaustive=True)
    dis = plan_disaggregated(base(), slo, dspace, _Runner(slo, _serial, store))
    return store, agg, dis


def _cost(s) -> float:
    return s.cand.usd_per_replica_hour * s.hi_ok


def test_exhaustive_search_simulates_the_whole_space(exhaustive):
    _, agg, dis = exhaustive
    assert agg.counts.configurations == 32 and agg.counts.below_bound == 0
    assert agg.simulations == 32 and all(len(s.rows) == MAX_REPLICAS for s in agg.searches)
    assert dis.grid[MODEL] == 16 and dis.below_bound[MODEL] == 0 and len(dis.points) == 16
    # the space is not trivial: several configurations need more than one replica, some none within 8
    answers = {s.cand.label: s.hi_ok for s in agg.searches}
    assert sum(1 for n in answers.values() if n and n > 1) >= 2, answers
    assert any(p.meets for p in dis.points) and not all(p.meets for p in dis.points)


def test_pruned_search_answers_what_the_exhaustive_search_answers(exhaustive, tmp_path):
    _, agg, dis = exhaustive
    slo = parse_slo(SLO)
    for low_fi in (0.0, 0.25):
        pruned = plan_capacity(base(), slo, PlanSpace([MODEL], GPUS, TPS, max_replicas=MAX_REPLICAS, low_fi=low_fi),
                               store=tmp_path / f"agg{low_fi}", width=2)
        want, got = agg.cheapest[MODEL], pruned.cheapest[MODEL]
        # the same cost; on a tie of cost the exhaustive search's configuration is one of those tied
        assert _cost(got) == _cost(want)
        tied = {s.cand.label for s in agg.searches if s.status == "answer" and _cost(s) == _cost(want)}
        assert got.cand.label in tied
        c = pruned.counts
        assert c.configurations == 32 and c.below_bound > 0 and c.full_runs < 32 / 2
        assert (c.low_fi_runs > 0) == (low_fi > 0)
        # what was simulated in full agrees with the exhaustive rows, point for point
        full = {(s.cand.label, n): row["meets_slo"] for s in agg.searches for n, row in s.rows.items()}
        for s in pruned.searches:
            for n, row in s.rows.items():
                assert row["meets_slo"] == full[(s.cand.label, n)]
    dpruned = plan_disaggregated(base(), slo, DisaggSpace([MODEL], POOLS, POOLS, max_pool_replicas=MAX_POOL),
                                 _Runner(slo, _serial, tmp_path / "dis"), width=2)
    assert dpruned.cheapest[MODEL].rank() == dis.cheapest[MODEL].rank()
    assert len(dpruned.points) < len(dis.points)


def test_bounds_never_exceed_the_fewest_replicas_simulated(exhaustive):
    """Optimistic: a configuration's bound is at most the fewest replicas meeting the SLO in the
    exhaustive search, and 'cannot meet' only where no count did."""
    _, agg, dis = exhaustive
    slo = parse_slo(SLO)
    demand = demand_of(base())
    bounds = []
    for s in agg.searches:
        b = replica_bound(resolve_run(s.cand.cfg), demand, slo)
        bounds.append(b.min_replicas)
        if s.hi_ok is None:
            continue
        assert b.min_replicas is not None and b.min_replicas <= s.hi_ok, (s.cand.label, b, s.hi_ok)
    assert max(b or 0 for b in bounds) > 1, "the bounds rule something out on this space"
    for p in dis.points:
        if p.meets:
            for role, pool, n in (("prefill", p.prefill, p.n_prefill), ("decode", p.decode, p.n_decode)):
                cfg = base().model_copy(update={"gpu": pool.gpu, "tp": pool.tp})
                b = replica_bound(resolve_run(cfg), demand, slo, role)
                assert b.min_replicas is not None and b.min_replicas <= n, (p.label, role, b)


def test_a_tpot_limit_below_one_decode_step_is_ruled_out_without_a_run(tmp_path):
    slo = parse_slo("ttft_p99<=1s,tpot_p99<=1ms")
    result = plan_capacity(base(), slo, PlanSpace([MODEL], ["h100"], [1], max_replicas=4), store=tmp_path)
    (s,) = result.searches
    assert s.status == "cannot meet (bound)" and "one sequence's decode step takes" in s.note
    assert result.simulations == 0 and result.counts.below_bound == 4


def test_at_least_is_the_count_numpys_percentile_implies():
    rng = np.random.default_rng(0)
    for _ in range(300):
        n = int(rng.integers(1, 400))
        v = rng.exponential(size=n)
        q = float(rng.choice([50, 90, 99, 99.9]))
        limit = float(np.percentile(v, q))
        assert (v <= limit).sum() >= at_least(q, n)
        # and it is the tightest such count: the values of that rank can sit at the limit, the rest above
        w = np.concatenate([np.zeros(at_least(q, n)), np.full(n - at_least(q, n), 1e9)])
        assert np.percentile(w, q) < 1e9 or at_least(q, n) == 0


def test_bounds_do_not_apply_where_their_assumptions_fail():
    slo = parse_slo(SLO)
    noisy = base().model_copy(update={"step_variance": 0.1})
    b = replica_bound(resolve_run(noisy), demand_of(noisy), slo)
    assert b.min_replicas == 1 and "variance" in b.why
    # each configuration is bounded on its own config: a KV policy (--policies) gets no bound, the full cache does
    from kvsim.sim.planning.plan import Search, apply_bounds, candidates
    cands, _ = candidates(base(), PlanSpace([MODEL], ["a100-80gb"], [1], policies=["none", "h2o"], max_replicas=8))
    searches = [Search(c) for c in cands]
    apply_bounds(searches, slo, 8)
    by_policy = {s.cand.policy: s for s in searches}
    assert by_policy["none"].bound > 1 and by_policy["h2o"].bound == 1 and "KV policy h2o" in by_policy["h2o"].bound_why


def test_low_fi_window_is_the_busiest_share_inside_the_sample():
    cfg = base()
    low = low_fi_window(cfg, 0.25)
    o = low.trace_options
    assert 1586.0 <= o.start_s < o.end_s <= 1598.0 and o.end_s - o.start_s == pytest.approx(3.0)
    assert o.rate_scale == 8.0
    assert low_fi_window(load_config(None, {"trace_options.max_requests": 50}), 0.25) is None


def test_cli_plan_exhaustive_and_low_fi(exhaustive):
    from kvsim.sim.cli import app
    store, agg, _ = exhaustive
    args = ["plan", "--slo", SLO, "--models", MODEL, "--gpus", ",".join(GPUS), "--tps", "1,2", "--trace",
            "azure-conv-2023", "--window", "1586:1598", "--rate-scale", "8", "--max-replicas", str(MAX_REPLICAS),
            "--no-band", "--repeats", "1", "-j", "1", "-q", "--out", str(store)]
    res = CliRunner().invoke(app, [*args, "--exhaustive"], env={"COLUMNS": "250"})
    assert res.exit_code == 0, res.output
    assert "space: 32 configurations (model x GPU x TP x replica count): 0 cannot run, 0 below a capacity bound, " \
           "0 low-fidelity runs, 0 full simulations (32 more reused from the store)" in res.output
    want = agg.cheapest[MODEL]
    assert f"{MODEL}: cheapest {want.cand.gpu} TP{want.cand.tp} x {want.hi_ok} " in res.output
    saved = json.loads((store / "plan-result.json").read_text())
    assert saved["counts"]["configurations"] == 32
    for bad, message in ((["--low-fi", "1.5"], "--low-fi: expected a share of the sample from 0 (off) to below 1"),
                         (["--low-fi", "0.2", "--exhaustive"], "--low-fi: the exhaustive search simulates")):
        out = CliRunner().invoke(app, [*args, *bad], env={"COLUMNS": "250"})
        assert out.exit_code == 2 and message in out.output, out.output
    first_n = ["plan", "--slo", SLO, "--models", MODEL, "--gpus", "h100", "--tps", "1", "--trace", "azure-conv-2023",
               "--set", "trace_options.max_requests=40", "--low-fi", "0.2", "-j", "1", "-q"]
    out = CliRunner().invoke(app, first_n, env={"COLUMNS": "250"})
    assert out.exit_code == 2 and "--low-fi 0.2: the sample has no busiest window to cut" in out.output, out.output


def test_a_reused_parsed_trace_gives_the_same_run(tmp_path):
    """Reuse (sweep.execute_run): a plan's runs take the trace parsed by the worker's earlier run; the
    rows are those of a fresh parse, and a file rewritten in place is parsed again."""
    from kvsim.sim.planning.sweep import RunTask, execute_run, run_id_of
    from kvsim.sim.simulator.simulate import run_simulation
    from kvsim.traces.loaders import _PARSED, load_trace, reusing_parsed_traces

    cfg = base().model_copy(update={"replicas": 2})
    fresh = run_simulation(cfg).summary
    _PARSED.clear()
    for _ in range(2):                              # parsed on the first run, reused on the second
        row = execute_run(RunTask(run_id_of(cfg), cfg.model_dump(mode="json")))
        assert {k: row[k] for k in ("ttft_p99_s", "tpot_p99_s", "makespan_s")} == \
            {k: fresh[k] for k in ("ttft_p99_s", "tpot_p99_s", "makespan_s")}
    assert len(_PARSED) == 1
    path = tmp_path / "t.csv"
    path.write_text("arrival_time_s,prompt_tokens,output_tokens\n0,10,2\n")
    with reusing_parsed_traces():
        assert len(load_trace(path)) == 1
        path.write_text("arrival_time_s,prompt_tokens,output_tokens\n0,10,2\n1,20,3\n")
        assert len(load_trace(path)) == 2
        a = load_trace(path)
        a.df.loc[0, "prompt_tokens"] = 99             # a copy: the kept trace is untouched
        assert int(load_trace(path).df["prompt_tokens"].iloc[0]) == 10
