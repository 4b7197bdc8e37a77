"""kvsim plan --disaggregated (sim/planning/disaggregated.py): the per-pool capacity bounds are upper bounds
of what the simulator delivers, the search finds what an exhaustive search of the same grid finds with
fewer simulations, fleets are priced per pool, and the command prints both forms side by side."""
from __future__ import annotations

import math

import pytest
from typer.testing import CliRunner

from kvsim.sim.config import load_config
from kvsim.sim.engine.resolved_run import resolve_run
from kvsim.sim.planning.capacity import parse_slo
from kvsim.sim.planning.disaggregated import (DisaggSpace, FleetPoint, PoolType, fleet_config, offered_load,
                                              pareto_front, plan_disaggregated, pool_bound,
                                              prefill_queue_fails)
from kvsim.sim.planning.plan import _Runner
from kvsim.sim.planning.sweep import RunTask, _serial, cost_metrics, execute_run
from kvsim.sim.simulator.simulate import run_simulation

N, SPACING, PROMPT, OUTPUT = 32, 0.025, 2048, 16
SLO = "ttft_p99<=500ms,tpot_p99<=50ms"


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    """N prompts of 2,048 tokens, 25 ms apart: more prompt tokens a second (82k) than one H100
    prefills, few output tokens."""
    path = tmp_path_factory.mktemp("trace") / "burst.csv"
    path.write_text("arrival_time_s,prompt_tokens,output_tokens\n"
                    + "".join(f"{i * SPACING:.3f},{PROMPT},{OUTPUT}\n" for i in range(N)))
    return str(path)


def base(trace, **more):
    return load_config(None, {"trace": trace, "model": "llama-3.1-8b", "gpu": "h100", **more})


def test_offered_load_is_the_tokens_due_by_the_slos_deadlines(trace):
    span = (N - 1) * SPACING
    load = offered_load(base(trace), (1.0, "p99"), (0.05, "p90"))
    assert load.requests == N and math.isclose(load.duration_s, span) and load.mean_context == PROMPT + OUTPUT / 2
    # 99% of the prompts by the last arrival + 1 s; 90% of the output by then + 16 tokens x 50 ms
    assert math.isclose(load.prompt_tok_s, 0.99 * N * PROMPT / (span + 1.0))
    assert math.isclose(load.output_tok_s, 0.9 * N * OUTPUT / (span + 1.0 + OUTPUT * 0.05))
    # no deadline (no limit, or a mean): nothing is due, one replica
    free = offered_load(base(trace), (1.0, "mean"), (None, None))
    assert free.prompt_tok_s == 0 == free.output_tok_s


def test_prefill_bound_is_above_what_a_saturated_replica_delivers(trace):
    """All prompts at once on one replica: the prompt tokens it computes per second of busy time stay
    below the bound's rate (which leaves attention out), and the bound's replica count follows."""
    cfg = base(trace, **{"trace_options.rate_scale": 1000.0})
    plan = resolve_run(cfg)
    pool = PoolType("h100", 1, cfg.gpu_usd_per_hour() * 1)
    load = offered_load(base(trace), (0.1, "p99"))
    b = pool_bound("prefill", pool, plan, load, None)
    steps = run_simulation(cfg).steps
    delivered = steps["prefill_tokens"].sum() / steps["duration_s"].sum()
    assert delivered <= b.tok_s_per_replica < 1.5 * delivered
    assert b.min_replicas == math.ceil(load.prompt_tok_s / b.tok_s_per_replica) >= 2


def test_decode_bound_respects_the_tpot_limit_and_the_kv_pool(trace):
    cfg = base(trace)
    plan = resolve_run(cfg)
    pool = PoolType("h100", 1, 1.0)
    load = offered_load(cfg, (1.0, "p99"), (1.0, "p99"))
    loose = pool_bound("decode", pool, plan, load, None)
    tight = pool_bound("decode", pool, plan, load, 0.010)
    assert 0 < tight.tok_s_per_replica < loose.tok_s_per_replica and tight.min_replicas >= loose.min_replicas
    impossible = pool_bound("decode", pool, plan, load, 0.0001)
    assert impossible.min_replicas is None and "above the TPOT limit" in impossible.why
    # a KV pool of 10 blocks holds no 2,056-token sequence but one: batch 1
    small = resolve_run(base(trace, **{"engine.num_gpu_blocks": 140}))
    one = pool_bound("decode", pool, small, load, None)
    assert "batch 1 " in one.why


def test_a_fleet_is_priced_per_pool(trace):
    cfg = fleet_config(base(trace), "llama-3.1-8b", ((PoolType("h100", 1, 0), 3),), ((PoolType("h200", 2, 0), 2),),
                       DisaggSpace(["llama-3.1-8b"], [], []))
    costs = cost_metrics(cfg, {})
    assert costs["num_gpus"] == 3 + 4
    assert math.isclose(costs["usd_per_hour"], 3 * cfg.gpu_usd_per_hour("h100") + 4 * cfg.gpu_usd_per_hour("h200"))


def test_search_finds_the_cheapest_an_exhaustive_search_finds(trace, tmp_path):
    slo = parse_slo(SLO)
    cfg = base(trace)
    space = DisaggSpace(["llama-3.1-8b"], [("h100", 1), ("h100", 2)], [("h100", 1)], max_pool_replicas=3)
    runner = _Runner(slo, _serial, tmp_path)
    result = plan_disaggregated(cfg, slo, space, runner, width=1)
    best = result.cheapest["llama-3.1-8b"]
    # every point of the grid, simulated
    bound_cfg = result.bounds["llama-3.1-8b"]
    meets, rows = {}, {}
    for p in [b.pool for b in bound_cfg if b.role == "prefill"]:
        for n_p in range(1, 4):
            for n_d in range(1, 4):
                d = PoolType("h100", 1, cfg.gpu_usd_per_hour("h100"))
                point = FleetPoint("llama-3.1-8b", p, n_p, d, n_d)
                fc = fleet_config(runner_base(cfg, slo), "llama-3.1-8b", ((p, n_p),), ((d, n_d),), space)
                row = runner([fc])[0]
                meets[(p, n_p, n_d)] = (bool(row["meets_slo"]), point.usd_per_hour, point.gpus)
                rows[(p, n_p, n_d)] = row
    cheapest = min((usd, gpus) for ok, usd, gpus in meets.values() if ok)
    assert (best.usd_per_hour, best.gpus) == cheapest
    assert meets[(best.prefill, best.n_prefill, best.n_decode)][0]
    # what the search took a failure to imply holds in the exhaustive grid: a prefill queue above the
    # TTFT limit fails every fleet with that prefill pool and at most that many replicas
    ttft = (0.5, "p99")
    queue_failed = [k for k, row in rows.items() if prefill_queue_fails(row, ttft)]
    assert queue_failed
    for p, n, _ in queue_failed:
        assert not any(ok for (pp, n_p, _), (ok, _, _) in meets.items() if pp == p and n_p <= n)
    # the bounds rule out 1 prefill replica; fewer simulations than the grid
    assert result.below_bound["llama-3.1-8b"] > 0
    assert not meets[(PoolType("h100", 1, cfg.gpu_usd_per_hour("h100")), 1, 1)][0]
    assert result.simulations < len(meets)
    # the gpus objective: the fewest GPUs of the grid (then the cheapest), found the same way
    by_gpus = plan_disaggregated(cfg, slo, DisaggSpace(["llama-3.1-8b"], space.prefill, space.decode,
                                                       max_pool_replicas=3, objective="gpus"),
                                 _Runner(slo, _serial, tmp_path), width=1)
    fewest = min((gpus, usd) for ok, usd, gpus in meets.values() if ok)
    assert by_gpus.cheapest["llama-3.1-8b"].rank("gpus") == fewest
    # the store: a second plan reuses every point
    again = plan_disaggregated(cfg, slo, space, _Runner(slo, _serial, tmp_path), width=2)
    assert again.simulations == 0 and again.cheapest["llama-3.1-8b"].label == best.label
    import json
    saved = json.loads((tmp_path / "plan-disaggregated.json").read_text())
    assert saved["cheapest"]["llama-3.1-8b"]["fleet"] == best.label and saved["cheapest"]["llama-3.1-8b"]["meets_slo"]
    assert len(saved["points"]) == len(again.points)


def test_decider_thresholds_are_an_axis_of_the_search(trace, tmp_path):
    """--local-prefill-tokens 0,4096: every 2,048-token prompt of the burst is prefilled on the decode pool at
    4,096 (no prefill tokens are due on the prefill pool: its bound is one replica); the search's cheapest
    over both thresholds is the exhaustive one."""
    slo = parse_slo(SLO)
    cfg = base(trace)
    ttft, tpot = (0.5, "p99"), (0.05, "p99")
    assert offered_load(cfg, ttft, tpot, 4096).prompt_tok_s == 0 < offered_load(cfg, ttft, tpot, 0).prompt_tok_s
    space = DisaggSpace(["llama-3.1-8b"], [("h100", 1)], [("h100", 1)], max_pool_replicas=2,
                        local_prefill_tokens=(0, 4096))
    result = plan_disaggregated(cfg, slo, space, _Runner(slo, _serial, tmp_path), width=2)
    h100 = PoolType("h100", 1, cfg.gpu_usd_per_hour("h100"))
    runner = _Runner(slo, _serial, tmp_path)
    meets = {}
    for local in (0, 4096):
        for n_p in (1, 2):
            for n_d in (1, 2):
                row = runner([fleet_config(runner_base(cfg, slo), "llama-3.1-8b", ((h100, n_p),), ((h100, n_d),), space,
                                           local)])[0]
                point = FleetPoint("llama-3.1-8b", h100, n_p, h100, n_d, local)
                meets[point.key] = (bool(row["meets_slo"]), point.rank())
                if local:
                    assert row["handoff"]["local_prefills"] == N
    best = result.cheapest["llama-3.1-8b"]
    assert best.rank() == min(rank for ok, rank in meets.values() if ok)
    assert meets[best.key][0]
    assert 4096 in {p.local for p in result.points} and "local prefill <= 4,096" in best.label


def runner_base(cfg, slo):
    from kvsim.sim.planning.capacity import slo_for_goodput
    return slo_for_goodput(cfg, slo)


def test_a_prefill_queue_above_the_ttft_limit_rules_out_every_decode_pool(trace):
    """One H100 TP1 prefill replica queues the burst beyond the TTFT limit: the run's row carries the TTFT
    split's prefill queue (what the search's rule reads), and the rule fires on it."""
    slo = parse_slo(SLO)
    cfg = base(trace)
    h100 = PoolType("h100", 1, cfg.gpu_usd_per_hour("h100"))
    row = execute_run(RunTask("x", fleet_config(runner_base(cfg, slo), "llama-3.1-8b", ((h100, 1),), ((h100, 1),),
                                                DisaggSpace(["llama-3.1-8b"], [], [])).model_dump(mode="json")))
    assert row["handoff"]["p99_prefill_queue_s"] > 0.5
    assert prefill_queue_fails(row, (0.5, "p99")) and not prefill_queue_fails(row, (60.0, "p99"))
    assert not prefill_queue_fails(row, (0.5, "p90.5"))      # no such figure in the split: no rule


def test_plan_objective_gpus_picks_the_fewest_gpus(tmp_path):
    """A 2,048-token prompt every 0.3 s: an L4 prefills one in 0.6 s at its sustained (power-limited)
    compute (sim/data/sustained_compute.yaml), so one or two L4s queue them; three L4s or one H100 meet
    800 ms. In dollars three L4s are cheaper than one H100; in GPUs one H100 is fewer."""
    from kvsim.sim.planning.plan import PlanSpace, candidates, plan_capacity
    path = tmp_path / "t.csv"
    path.write_text("arrival_time_s,prompt_tokens,output_tokens\n" + "".join(f"{i * 0.3:.2f},2048,8\n" for i in range(12)))
    cfg = base(str(path))
    slo = parse_slo("ttft_p99<=800ms")
    answers = {}
    for objective in ("usd", "gpus"):
        result = plan_capacity(cfg, slo, PlanSpace(["llama-3.1-8b"], ["l4", "h100"], [1], max_replicas=4,
                                                   objective=objective))
        best = result.cheapest["llama-3.1-8b"]
        answers[objective] = (best.cand.gpu, best.hi_ok)
    assert answers == {"usd": ("l4", 3), "gpus": ("h100", 1)}
    (cand,), _ = candidates(cfg, PlanSpace(["llama-3.1-8b"], ["h200"], [2], objective="gpus"))
    assert 2 < cand.cost_per_replica < 2 + 1e-4 and cand.unit(4) == "4.00 GPUs"
    # equal GPU counts: the price decides (3x H100 TP4 before 6x H200 TP2, both 12 GPUs)
    (h100,), _ = candidates(cfg, PlanSpace(["llama-3.1-8b"], ["h100"], [4], objective="gpus"))
    assert h100.usd_per_replica_hour * 3 < cand.usd_per_replica_hour * 6
    assert 3 * h100.cost_per_replica < 6 * cand.cost_per_replica < 12 + 1e-3


def test_pareto_front_keeps_the_points_no_other_beats_on_both():
    pts = [{"per_gpu": 100, "per_user": 10}, {"per_gpu": 80, "per_user": 20}, {"per_gpu": 70, "per_user": 15},
           {"per_gpu": 100, "per_user": 5}]
    assert pareto_front(pts) == [{"per_gpu": 100, "per_user": 10}, {"per_gpu": 80, "per_user": 20}]


def test_cli_plan_disaggregated_prints_both_forms(trace, tmp_path):
    from kvsim.sim.cli import app
    args = ["plan", "--slo", SLO, "--models", "llama-3.1-8b", "--gpus", "h100", "--tps", "1", "--trace", trace,
            "--disaggregated", "--max-pool-replicas", "3", "--max-replicas", "4", "--repeats", "1", "--no-band",
            "-j", "1", "-q", "--out", str(tmp_path)]
    res = CliRunner().invoke(app, args, env={"COLUMNS": "250"})
    assert res.exit_code == 0, res.output
    text = " ".join(res.output.split())
    for part in ("per-pool capacity bounds", "aggregated vs disaggregated", "Pareto front", "cheaper form"):
        assert part in text, part
    for bad, message in ((["--link", "ib-xdr"], "--link: unknown link 'ib-xdr'"),
                         (["--objective", "watts"], "--objective: expected usd or gpus, got 'watts'"),
                         (["--local-prefill-tokens", "0,-5"], "--local-prefill-tokens: expected comma-separated"),
                         (["--max-pool-replicas", "0"], "--max-pool-replicas: expected a positive number")):
        out = CliRunner().invoke(app, [*args, *bad])
        assert out.exit_code == 2 and message in out.output, out.output
    # what a fleet does not model is refused in one line before anything runs
    out = CliRunner().invoke(app, [*args, "--set", "kv.policy=h2o", "--set", "kv.budget=256"])
    assert out.exit_code == 2 and "fleet: KV policy 'h2o'" in out.output, out.output
    no_flag = [a for a in args if a != "--disaggregated"]
    out = CliRunner().invoke(app, [*no_flag, "--prefill-gpus", "h200"])
    assert out.exit_code == 2 and "--prefill-gpus: applies to disaggregated fleets" in out.output, out.output
