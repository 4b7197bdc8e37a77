"""kvsim plan --disaggregated --mixed-pools (sim/planning/mixed.py, bounds.mixed_role_bound): a role may mix
pool types; the search answers what a brute-force simulation of every fleet of a small space answers, its
bounds never rule out a fleet that meets the SLO, and the one-type bound is the aggregated search's."""
from __future__ import annotations

import itertools
import json

import pytest
from typer.testing import CliRunner

from kvsim.sim.config import load_config
from kvsim.sim.engine.resolved_run import resolve_run
from kvsim.sim.planning.bounds import demand_of, mixed_role_bound, replica_bound
from kvsim.sim.planning.capacity import parse_slo, slo_for_goodput
from kvsim.sim.planning.disaggregated import DisaggSpace, FleetPoint, PoolType, fleet_config, plan_disaggregated
from kvsim.sim.planning.plan import _Runner
from kvsim.sim.planning.sweep import _serial

N, SPACING, PROMPT, OUTPUT = 32, 0.025, 2048, 16
SLO = "ttft_p99<=500ms,tpot_p99<=50ms"
MODEL = "llama-3.1-8b"
PREFILL = [("h100", 1), ("a100-80gb", 1), ("l40s", 1)]
DECODE = [("h100", 1)]


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    """32 prompts of 2,048 tokens 25 ms apart: one H100 TP1 queues them past 500 ms, two meet it, and so does
    one H100 with two L40S beside it, for less."""
    path = tmp_path_factory.mktemp("trace") / "burst.csv"
    path.write_text("arrival_time_s,prompt_tokens,output_tokens\n"
                    + "".join(f"{i * SPACING:.3f},{PROMPT},{OUTPUT}\n" for i in range(N)))
    return str(path)


def base(trace):
    return load_config(None, {"trace": trace, "model": MODEL, "gpu": "h100"})


def one_replica(cfg, gpu, tp):
    return resolve_run(cfg.model_copy(update={"gpu": gpu, "tp": tp, "replicas": 1}))


def test_one_type_mixed_bound_is_the_replica_bound(trace):
    """A 'mix' of one type gives the fewest replicas replica_bound gives, for each role and threshold."""
    slo = parse_slo(SLO)
    cfg = slo_for_goodput(base(trace), slo)
    demand = demand_of(cfg)
    for gpu, tp in PREFILL + [("l4", 1)]:
        plan = one_replica(cfg, gpu, tp)
        for role, local in (("prefill", 0), ("prefill", 1024), ("decode", 0)):
            single = replica_bound(plan, demand, slo, role, local).min_replicas
            assert mixed_role_bound([plan], demand, slo, role, local).min_single(0) == single, (gpu, role, local)
    # capacity is the sum: a mix of two types admits counts whose summed rate reaches what one type needs
    h100, l40s = one_replica(cfg, "h100", 1), one_replica(cfg, "l40s", 1)
    mix = mixed_role_bound([h100, l40s], demand, slo, "prefill")
    need_h100 = mix.min_single(0)
    assert need_h100 == 2 and mix.admits((need_h100, 1)) and not mix.admits((1, 0)) and mix.admits((1, 2))
    # an L4's one-sequence decode step is above a 10 ms TPOT limit: out of reach alone, not beside an H100
    tight = parse_slo("ttft_p99<=500ms,tpot_p99<=10ms")
    l4 = one_replica(cfg, "l4", 1)
    assert mixed_role_bound([l4], demand, tight, "decode").impossible
    assert not mixed_role_bound([h100, l4], demand, tight, "decode").impossible


def test_mixed_search_answers_what_brute_force_answers(trace, tmp_path):
    """36 fleets (3 prefill types mixed up to 2, 1-2 replicas a pool, x 1-2 H100 decode replicas), every one
    simulated through fleet_config: the search's answer has the cheapest cost of those meeting the SLO, is a
    mixed fleet here, needs fewer simulations, and no fleet its bounds or implied failures ruled out meets."""
    slo = parse_slo(SLO)
    cfg = base(trace)
    space = DisaggSpace([MODEL], PREFILL, DECODE, max_pool_replicas=2, mixed_pools=2)
    result = plan_disaggregated(cfg, slo, space, _Runner(slo, _serial, tmp_path), width=1)
    best = result.cheapest[MODEL]
    assert result.grid[MODEL] == (3 * 2 + 3 * 4) * 2
    # brute force, enumerated here (not by the search's code), on the same store (the search's points reused)
    price = {g: cfg.gpu_usd_per_hour(g) for g, _ in PREFILL}
    types = [PoolType(g, t, price[g] * t) for g, t in PREFILL]
    d = PoolType("h100", 1, price["h100"])
    runner = _Runner(slo, _serial, tmp_path)
    gbase = slo_for_goodput(cfg, slo)
    rows = {}
    for size in (1, 2):
        for combo in itertools.combinations(types, size):
            for counts in itertools.product((1, 2), repeat=size):
                pools = tuple(zip(combo, counts, strict=True))
                for n_d in (1, 2):
                    point = FleetPoint(MODEL, pools[0][0], pools[0][1], d, n_d, 0, None, "", pools[1:])
                    fc = fleet_config(gbase, MODEL, tuple(pools), ((d, n_d),), space)
                    point.row = runner([fc])[0]
                    assert point.row["status"] == "ok", point.row.get("error")
                    rows[point.key] = point
    assert len(rows) == result.grid[MODEL] and runner.simulations == len(rows) - result.simulations
    meeting = [p for p in rows.values() if p.meets]
    assert best.rank() == min(p.rank() for p in meeting)
    assert rows[best.key].meets and best.mixed and best.usd_per_hour < min(
        p.usd_per_hour for p in meeting if not p.mixed)
    assert result.simulations < len(rows) / 4
    # the bounds: every fleet below them fails (a mix's capacity is the sum of its pools')
    demand = demand_of(gbase)
    plans = {t: one_replica(gbase, t.gpu, t.tp) for t in types}
    ruled_out = 0
    for p in rows.values():
        kinds = [t for t, _ in p.prefill_pools]
        bound = mixed_role_bound([plans[t] for t in kinds], demand, slo, "prefill")
        if len(kinds) == 1:
            single = replica_bound(plans[kinds[0]], demand, slo, "prefill").min_replicas
            below = single is None or p.n_prefill < single
        else:
            below = not bound.admits(tuple(n for _, n in p.prefill_pools))
        if below:
            ruled_out += 1
            assert not p.meets, p.label
    assert ruled_out == result.below_bound[MODEL] > 0
    # what the search's failures implied: same pools, no more replicas anywhere -> fails in brute force too
    for q in result.points:
        if q.row.get("status") == "ok" and not q.meets:
            for p in rows.values():
                if [t for t, _ in p.prefill_pools] == [t for t, _ in q.prefill_pools] and \
                        all(a <= b for (_, a), (_, b) in zip(p.prefill_pools, q.prefill_pools, strict=True)) and \
                        p.n_decode <= q.n_decode:
                    assert not p.meets, (q.label, p.label)
    saved = json.loads((tmp_path / "plan-disaggregated.json").read_text())
    assert saved["mixed_pools"] == 2 and isinstance(saved["cheapest"][MODEL]["prefill"], list)
    assert best.pool_names().startswith("prefill-0 ")
    # the exhaustive flag over the same space gives the same cost (every fleet from the store)
    exh = plan_disaggregated(cfg, slo, DisaggSpace([MODEL], PREFILL, DECODE, max_pool_replicas=2, mixed_pools=2,
                                                   exhaustive=True), _Runner(slo, _serial, tmp_path), width=2)
    assert exh.simulations == 0 and len(exh.points) == len(rows)
    assert exh.cheapest[MODEL].rank() == best.rank()


def test_mixed_pools_one_is_the_one_type_search(trace, tmp_path):
    """--mixed-pools 1 (the default) builds the one-type grid: the same points as before the option."""
    slo = parse_slo(SLO)
    cfg = base(trace)
    one = plan_disaggregated(cfg, slo, DisaggSpace([MODEL], PREFILL[:2], DECODE, max_pool_replicas=2),
                             _Runner(slo, _serial, tmp_path), width=1)
    assert one.grid[MODEL] == 2 * 2 * 2 and not any(p.mixed for p in one.points)


def test_cli_mixed_pools_names_the_cheapest_fleets_pools(trace, tmp_path):
    from kvsim.sim.cli import app
    args = ["plan", "--slo", SLO, "--models", MODEL, "--gpus", "h100", "--tps", "1", "--trace", trace,
            "--max-replicas", "4", "--repeats", "1", "--no-band", "-j", "1", "-q", "--out", str(tmp_path)]
    pd = ["--disaggregated", "--prefill-gpus", "h100,l40s", "--decode-gpus", "h100", "--max-pool-replicas", "2"]
    res = CliRunner().invoke(app, [*args, *pd, "--mixed-pools", "2"], env={"COLUMNS": "250"})
    assert res.exit_code == 0, res.output
    text = " ".join(res.output.split())
    assert "cheapest disaggregated fleet's pools (as kvsim simulate names them): prefill-0 1x h100 TP1, " \
           "prefill-1 2x l40s TP1; decode 1x h100 TP1" in text, text
    out = CliRunner().invoke(app, [*args, "--mixed-pools", "2"])
    assert out.exit_code == 2 and "--mixed-pools: applies to disaggregated fleets" in out.output, out.output
    out = CliRunner().invoke(app, [*args, *pd, "--mixed-pools", "0"])
    assert out.exit_code == 2 and "--mixed-pools: expected the most pool types a role may mix" in out.output


def test_the_lazy_grid_yields_every_fleet_cheapest_first_one_type_before_a_tied_mix():
    """MixedGrid's heap gives every prefill x decode option pair exactly once, in order of ($/h, GPUs, pools):
    the sorted brute-force cross product; at the same price and GPUs, one type a role comes before a mix."""
    from kvsim.sim.planning.mixed import MixedGrid, role_options
    a, b, c = PoolType("h100", 1, 1.0), PoolType("a100-80gb", 1, 1.0), PoolType("h200", 2, 3.0)
    prefill = role_options([a, b, c], [1, 2, None], lambda combo: None, 3, 2, "usd", False)
    decode = role_options([a, c], [1, 1], lambda combo: None, 2, 2, "usd", False)
    assert prefill[0] == 3 * 3 + 3 * 9 and all(o.pools != ((b, 1),) for o in prefill[1])     # b's bound is 2
    grid = MixedGrid(MODEL, {0: prefill}, decode)
    got = grid.next(10 ** 6)
    pts = [FleetPoint(MODEL, p.pools[0][0], p.pools[0][1], d.pools[0][0], d.pools[0][1], 0, None, "", p.pools[1:],
                      d.pools[1:]) for p in prefill[1] for d in decode[1]]
    assert len(got) == len(set(got)) == len(pts)
    order = [grid._order(FleetPoint(*k[:6], None, "", *k[6:])) for k in got]
    assert order == sorted(grid._order(p) for p in pts)
    # 2x h100 prefill + 1x h100 decode and 1x h100 + 1x a100 prefill + 1x h100 decode: both $3/h and 3 GPUs
    two = FleetPoint(MODEL, a, 2, a, 1).key
    mix = FleetPoint(MODEL, a, 1, a, 1, 0, None, "", ((b, 1),)).key
    assert got.index(two) < got.index(mix)
