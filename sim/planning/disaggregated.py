"""`kvsim plan --disaggregated`: the cheapest prefill/decode fleet meeting an SLO.

A disaggregated fleet is a prefill pool and a decode pool (docs/disaggregation.md), each its own GPU,
TP degree and replica count. The space is every (prefill GPU x TP) x (decode GPU x TP) pair that fits
the model, crossed with the two replica counts. It is searched without simulating most of it:

1. **Per-pool capacity bounds, before anything runs.** Each pool type's fewest replicas from
   bounds.py (provably optimistic: at most what a simulation needs): the prefill pool must compute the
   prompts of the requests that meet the TTFT percentile (the smallest such prompts, less an ideal
   prefix cache's hits) by the last arrival + the limit, at the best prompt tokens/s any step of its
   cost model reaches (attention left out); the decode pool must decode the outputs of the requests that
   meet both limits by their deadlines at its best output tokens/s (the shortest context, up to
   `max_num_seqs`), and hold their KV for at least one fastest step per token. A pool with fewer
   replicas is never simulated; a decode pool type whose one-sequence step is above the TPOT limit
   cannot meet it at all. The table also shows each pool type's best rate at the sample's mean context
   (`pool_bound`), for reading, not for pruning.
2. **Cheapest first.** The remaining points are taken in order of $/hour (then GPUs; GPUs then $/hour
   with the `gpus` objective), `width` at a time
   (the executor's workers); the first point that meets the SLO is the answer, and the search stops
   when no unsimulated point is cheaper.
3. **What a failure implies.** A failed (prefill x n_p, decode x n_d) implies every point of the same
   pool types with at most n_p and at most n_d replicas fails (more replicas never hurt the load: an
   assumption). When the prefill pool's own queue is above the TTFT limit (the p99 or mean of the
   TTFT split's `prefill_queue_s`, whichever the SLO names), every fleet with that prefill pool and at
   most n_p replicas fails whatever its decode pool: a request's TTFT includes its prefill queue, and
   that queue does not depend on the decode pool (but for KV held until pulled).
4. **Decider settings.** Each conditional-disaggregation threshold given (`local_prefill_tokens`: prompts
   whose uncached part is at most it are prefilled on the decode pool) is one more axis of the grid; its
   prefill bound counts only the prompts above it, and the prefill-queue rule holds for threshold 0 only.
5. **Reuse.** Every run goes through the plan's store (sweep rows, the same run ids), so a plan run
   again, or a point shared with another plan, is not simulated twice.
"""
from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from .bounds import demand_of, ideal_cache_hits, mixed_role_bound, replica_bound
from .fleets import FleetPoint, Pools, PoolType, point_of
from .mixed import MixedGrid, role_options
from .capacity import Constraint, slo_for_goodput
from ..config import SimConfig
from .sweep import SpecError, _FitChecker

ROLES = ("prefill", "decode")


@dataclass(frozen=True)
class OfferedLoad:
    """What the load sample asks of the pools: the tokens each pool must have computed per second of the
    time it has for them (zero where the SLO sets no deadline)."""
    requests: int
    duration_s: float              # first to last arrival
    prompt_tok_s: float            # prompt tokens an ideal prefix cache could not serve, per second
    output_tok_s: float
    mean_context: float            # prompt + half the output: a decoding request's mean KV
    prefill_span_s: float = math.inf    # the prefill pool's time: arrivals + the TTFT limit
    decode_span_s: float = math.inf     # the decode pool's: each request's arrival + TTFT + output x TPOT limit


@dataclass(frozen=True)
class PoolBound:
    """A pool type's best rate per replica and the fewest replicas the load needs at that rate."""
    role: str
    pool: PoolType
    tok_s_per_replica: float       # prompt tok/s (prefill) or output tok/s (decode); 0: cannot meet the SLO
    min_replicas: int | None       # None: no count can (see why)
    why: str


@dataclass(frozen=True)
class DisaggSpace:
    """The fleets `kvsim plan --disaggregated` searches: pool types per role and the replica limit."""
    models: list[str]
    prefill: list[tuple[str, int]]          # (GPU, TP) of the prefill pool
    decode: list[tuple[str, int]]           # (GPU, TP) of the decode pool
    link: str = "ib-ndr"
    max_pool_replicas: int = 16             # no pool is simulated with more replicas than this
    local_prefill_tokens: tuple[int, ...] = (0,)   # conditional disaggregation thresholds, each searched
    objective: str = "usd"                  # usd: the fewest dollars an hour; gpus: the fewest GPUs
    exhaustive: bool = False                # simulate every fleet of the grid (no bound, no implied failure)
    mixed_pools: int = 1                    # at most this many pool types a role (1: one pool a role, as before)


@dataclass
class DisaggPlanResult:
    slo: list[str]
    load: dict[str, OfferedLoad]                     # model -> its offered load (the same sample)
    bounds: dict[str, list[PoolBound]]               # model -> every pool type's bound
    unfit: list[tuple[str, str, PoolType, str]]      # (model, role, pool type, why it cannot run)
    points: list[FleetPoint]                         # every simulated point, in order of simulation
    cheapest: dict[str, FleetPoint]
    grid: dict[str, int] = field(default_factory=dict)            # model -> points within the replica limit
    below_bound: dict[str, int] = field(default_factory=dict)     # model -> points the bounds rule out
    implied_fail: dict[str, int] = field(default_factory=dict)    # model -> points a failure rules out
    ranges: dict[str, dict[str, bool | None]] = field(default_factory=dict)   # model -> variant -> meets
    simulations: int = 0
    wall_s: float = 0.0
    mixed_pools: int = 1                             # the space's cap on pool types a role


def fleet_config(base: SimConfig, model: str, prefill: Pools, decode: Pools, space: DisaggSpace,
                 local: int = 0) -> SimConfig:
    """One fleet's config from its roles' pools ((type, replicas) each): a role with one pool is a mapping
    (as before), with several a list of them."""
    def pools(role: Pools):
        spec = [{"gpu": t.gpu, "tp": t.tp, "replicas": k} for t, k in role]
        return spec if len(spec) > 1 else spec[0]

    d = decode[0][0]
    data = base.model_dump()
    data.update(model=model, gpu=d.gpu, tp=d.tp, replicas=1,
                fleet={"prefill": pools(prefill), "decode": pools(decode), "link": space.link,
                       "local_prefill_tokens": local})
    return SimConfig.model_validate(data)


def _key_config(base: SimConfig, space: DisaggSpace, key: tuple) -> SimConfig:
    """fleet_config of a FleetPoint's key (model, prefill, n, decode, n, local[, more prefill, more decode])."""
    point = FleetPoint(*key[:6], more_prefill=key[6] if len(key) > 6 else (), more_decode=key[7] if len(key) > 7 else ())
    return fleet_config(base, point.model, point.prefill_pools, point.decode_pools, space, point.local)


def _share(stat: str | None) -> float:
    """The share of requests a limit at this statistic holds for: p99 -> 0.99; 0 for a mean (no deadline)."""
    return float(stat[1:]) / 100 if stat and stat[0] == "p" and stat[1:].replace(".", "", 1).isdigit() else 0.0


def offered_load(cfg: SimConfig, ttft: tuple[float | None, str | None] = (None, None),
                 tpot: tuple[float | None, str | None] = (None, None), local: int = 0) -> OfferedLoad:
    """The tokens per second each pool must sustain for the SLO (`ttft`, `tpot`: its limits, `_limit`).
    A percentile limit sets deadlines: that share of the prompt tokens (less the leading blocks whose
    prefix hash an earlier request of the sample carried: an ideal cache) is prefilled by the last arrival
    plus the TTFT limit, and that share of the output tokens is decoded by the latest arrival + TTFT limit
    + output tokens x TPOT limit. No limit (or a mean), no deadline: a rate of zero (one replica). With a
    conditional-disaggregation threshold `local`, only prompts whose uncached part is above it count for
    the prefill pool (the ideal cache keeps the most prompts local: the bound stays optimistic)."""
    from ..engine.assembly import load_workload

    trace = load_workload(cfg)
    df = trace.df
    n = len(df)
    arrivals = df["arrival_time_s"].to_numpy(dtype=float)
    duration = float(arrivals.max() - arrivals.min()) if n > 1 else 0.0
    prompts = df["prompt_tokens"].to_numpy(dtype=float)
    outputs = df["output_tokens"].to_numpy(dtype=float)
    cached = ideal_cache_hits(trace, prompts)
    q_p = _share(ttft[1]) if ttft[0] is not None else 0.0
    q_d = min(q_p, _share(tpot[1])) if tpot[0] is not None else 0.0
    p_span = duration + ttft[0] if q_p else math.inf
    d_span = float((arrivals + ttft[0] + outputs * tpot[0]).max() - arrivals.min()) if q_d and n else math.inf
    uncached = prompts - cached
    return OfferedLoad(n, duration, q_p * float(uncached[uncached > local].sum()) / p_span,
                       q_d * float(outputs.sum()) / d_span,
                       float((prompts + outputs / 2).mean()) if n else 0.0, p_span, d_span)


def _limit(constraints: list[Constraint], kind: str) -> tuple[float | None, str | None]:
    """The tightest upper limit on `kind` (ttft, tpot) and its statistic (p99, mean, ...)."""
    best: tuple[float | None, str | None] = (None, None)
    for c in constraints:
        parts = c.metric.split("_")
        if parts[0] == kind and c.op in ("<=", "<") and (best[0] is None or c.limit < best[0]):
            best = (c.limit, parts[1] if len(parts) > 2 else None)
    return best


def pool_bound(role: str, pool: PoolType, plan, load: OfferedLoad, tpot_limit: float | None) -> PoolBound:
    """The best per-replica rate of `pool` (a resolved run of one replica of it) for `role`."""
    from ..core.step import BatchShape

    cost, sched = plan.cost, plan.scheduler
    if role == "prefill":
        top = sched.max_num_batched_tokens
        sizes = sorted({min(top, 2 ** k) for k in range(6, 20)} | {top})
        rate = max(t / float(cost.predict(BatchShape(num_seqs=1, num_prefill_tokens=t))) for t in sizes)
        need = load.prompt_tok_s
        why = f"{rate:,.0f} prompt tok/s per replica at {top}-token steps (attention left out)"
    else:
        block = plan.cfg.engine.block_size
        kv_seqs = int((plan.num_blocks - 1) * block // max(load.mean_context, 1.0))
        top = max(1, min(sched.max_num_seqs, kv_seqs))
        b = np.arange(1, top + 1, dtype=float)
        ctx = max(load.mean_context, 1.0)
        t = np.asarray(cost.predict_decode(b, b * ctx, b * math.ceil(ctx / block)), dtype=float)
        ok = t <= tpot_limit if tpot_limit is not None else np.ones_like(t, dtype=bool)
        if not ok.any():
            return PoolBound(role, pool, 0.0, None, f"one sequence's decode step takes {t[0] * 1e3:.1f} ms, above "
                                                      f"the TPOT limit {tpot_limit * 1e3:g} ms")
        rates = np.where(ok, b / t, 0.0)
        i = int(rates.argmax())
        rate = float(rates[i])
        need = load.output_tok_s
        why = (f"{rate:,.0f} output tok/s per replica at batch {i + 1} (step {t[i] * 1e3:.1f} ms; KV holds "
               f"{kv_seqs} seqs of {ctx:,.0f} tokens, max_num_seqs {sched.max_num_seqs})")
    return PoolBound(role, pool, rate, max(1, math.ceil(need / rate * (1 - 1e-9))) if need > 0 else 1, why)


def pool_types(base: SimConfig, model: str, pairs: list[tuple[str, int]], role: str, fits: _FitChecker,
               unfit: list) -> list[tuple[PoolType, SimConfig]]:
    """The pool types of `role` that can run `model` (one replica's config each), the others into `unfit`."""
    out = []
    for gpu, tp in pairs:
        cfg = SimConfig.model_validate({**base.model_dump(), "model": model, "gpu": gpu, "tp": tp, "replicas": 1,
                                        "fleet": None})
        pool = PoolType(gpu, tp, cfg.gpu_usd_per_hour(gpu) * tp)
        try:
            fits.check(cfg, "")
        except SpecError as exc:
            from .plan import _short_reason
            unfit.append((model, role, pool, _short_reason(str(exc).removeprefix(": "))))
            continue
        out.append((pool, cfg))
    return out


class _Grid:
    """One model's search: the points above the bounds, cheapest first, and what failures imply."""

    def __init__(self, model: str, prefill: dict[int, list[PoolBound]], decode: list[PoolBound], max_n: int,
                 objective: str = "usd", exhaustive: bool = False):
        """`prefill`: each threshold's prefill bounds (threshold -> one bound per prefill pool type);
        `exhaustive`: every point of the grid, bounds and failures ignored, until all are simulated."""
        self.model, self.objective, self.exhaustive = model, objective, exhaustive
        if exhaustive:
            prefill = {t: [PoolBound(b.role, b.pool, b.tok_s_per_replica, 1, b.why) for b in bounds]
                       for t, bounds in prefill.items()}
            decode = [PoolBound(b.role, b.pool, b.tok_s_per_replica, 1, b.why) for b in decode]
        self.points: list[tuple[tuple, str, tuple]] = []
        self.total = self.below = 0
        for local, bounds in prefill.items():
            for pb in bounds:
                for db in decode:
                    self.total += max_n * max_n
                    if pb.min_replicas is None or db.min_replicas is None:
                        self.below += max_n * max_n
                        continue
                    lo_p, lo_d = min(pb.min_replicas, max_n + 1), min(db.min_replicas, max_n + 1)
                    self.below += max_n * max_n - (max_n - lo_p + 1) * (max_n - lo_d + 1)
                    for n_p in range(lo_p, max_n + 1):
                        for n_d in range(lo_d, max_n + 1):
                            point = FleetPoint(model, pb.pool, n_p, db.pool, n_d, local)
                            self.points.append((point.rank(objective), point.label, point.key))
        self.points.sort()
        self.failed: dict[tuple, list[tuple[int, int]]] = {}      # (prefill, decode, threshold) -> failed counts
        self.prefill_failed: dict[PoolType, int] = {}            # prefill type -> its queue fails up to n
        self.done: dict[tuple, FleetPoint] = {}
        self.best: FleetPoint | None = None
        self.implied = 0

    def failure_implied(self, key: tuple) -> str:
        if self.exhaustive:
            return ""
        _, p, n_p, d, n_d, local = key
        if not local and n_p <= self.prefill_failed.get(p, 0):
            return f"the prefill queue of {self.prefill_failed[p]}x {p.label} is above the TTFT limit"
        for fp, fd in self.failed.get((p, d, local), ()):
            if n_p <= fp and n_d <= fd:
                return f"{fp}x {p.label} + {fd}x {d.label} fails"
        return ""

    def next(self, count: int) -> list[tuple]:
        """Up to `count` points to simulate: the cheapest not yet simulated, not implied to fail, and
        cheaper than the best answer found."""
        picked = []
        for rank, _, key in self.points:
            if self.best is not None and rank >= self.best.rank(self.objective) and not self.exhaustive:
                break
            if key in self.done:
                continue
            if self.failure_implied(key):
                continue
            picked.append(key)
            if len(picked) >= count:
                break
        return picked

    def record(self, point: FleetPoint, prefill_queue_fails: bool) -> None:
        self.done[point.key] = point
        if point.meets:
            if self.best is None or point.rank(self.objective) < self.best.rank(self.objective):
                self.best = point
            return
        if not point.row or point.row.get("status") != "ok":
            return                      # a run that raised implies nothing about the others
        self.failed.setdefault((point.prefill, point.decode, point.local), []).append((point.n_prefill, point.n_decode))
        if prefill_queue_fails and not point.local:     # with local prefills, not every request queues there
            self.prefill_failed[point.prefill] = max(point.n_prefill, self.prefill_failed.get(point.prefill, 0))

    def count_implied(self) -> int:
        cheaper = [k for rank, _, k in self.points if self.best is None or rank < self.best.rank(self.objective)]
        return sum(1 for k in cheaper if k not in self.done and self.failure_implied(k))


def _mixed_grid(model: str, plans: dict, prefill: dict[int, list[PoolBound]], decode: list[PoolBound],
                space: DisaggSpace, base: SimConfig, constraints: list[Constraint], demand) -> MixedGrid:
    """The search of `--mixed-pools`: each role's options (up to `space.mixed_pools` types, one-type options
    at their own bound, mixes at the summed one), crossed lazily (sim/planning/mixed.py)."""
    def options(role: str, bounds: list[PoolBound], local: int = 0):
        runs = [plan for _, plan in plans[role]]
        return role_options([b.pool for b in bounds], [b.min_replicas for b in bounds],
                            lambda combo: mixed_role_bound([runs[i] for i in combo], demand, constraints, role, local),
                            space.max_pool_replicas, space.mixed_pools, space.objective, space.exhaustive)

    return MixedGrid(model, {t: options("prefill", b, t) for t, b in prefill.items()}, options("decode", decode),
                     space.objective, space.exhaustive)


def _handoff(row: dict) -> dict:
    value = row.get("handoff")
    if isinstance(value, str):
        return json.loads(value)
    return value if isinstance(value, dict) else {}


def prefill_queue_fails(row: dict, ttft: tuple[float | None, str | None]) -> bool:
    """The run's prefill queue alone (the TTFT split's `prefill_queue_s`) is above the TTFT limit."""
    limit, stat = ttft
    if limit is None or row.get("status") != "ok" or stat not in ("p99", "mean"):
        return False
    value = _handoff(row).get(f"{stat}_prefill_queue_s")
    return value is not None and not math.isnan(value) and value > limit


def plan_disaggregated(base: SimConfig, constraints: list[Constraint], space: DisaggSpace, runner, *,
                       width: int = 1, variants: Callable[[SimConfig], dict[str, SimConfig]] | None = None,
                       progress: Callable[[FleetPoint], None] | None = None) -> DisaggPlanResult:
    """The cheapest disaggregated fleet per model meeting `constraints` at `base`'s load (see the module
    docstring). `runner` is plan.py's `_Runner` (store, executor, SLO judging): shared with the
    aggregated search of the same plan. `variants(cfg)`: other versions of the answer's config (other
    windows, the profile band), each simulated once: whether the answer still meets the SLO there."""
    from ..engine.resolved_run import resolve_run

    t0 = time.perf_counter()
    base = slo_for_goodput(base, constraints)
    refuse_unmodelled(base, space)
    tpot, ttft = _limit(constraints, "tpot"), _limit(constraints, "ttft")
    fits = _FitChecker()
    unfit: list = []
    result = DisaggPlanResult([c.text for c in constraints], {}, {}, unfit, [], {}, mixed_pools=space.mixed_pools)
    grids: list = []
    configs: dict[tuple, SimConfig] = {}
    thresholds = sorted(set(space.local_prefill_tokens)) or [0]
    loads = {t: offered_load(base, ttft, tpot, t) for t in thresholds}
    load = loads[thresholds[0]]
    demand = demand_of(base)

    def bound(role: str, pool: PoolType, plan, local: int = 0) -> PoolBound:
        """The pool type's best rate (as shown) and its provably optimistic replica bound (bounds.py)."""
        best = pool_bound(role, pool, plan, loads[local] if role == "prefill" else load, tpot[0])
        proof = replica_bound(plan, demand, constraints, role, local)
        return PoolBound(role, pool, best.tok_s_per_replica, proof.min_replicas, f"{best.why}; bound: {proof.why}")

    for model in space.models:
        plans = {role: [(pool, resolve_run(cfg)) for pool, cfg in pool_types(base, model, pairs, role, fits, unfit)]
                 for role, pairs in (("prefill", space.prefill), ("decode", space.decode))}
        prefill = {t: [bound("prefill", pool, plan, t) for pool, plan in plans["prefill"]] for t in thresholds}
        decode = [bound("decode", pool, plan) for pool, plan in plans["decode"]]
        result.load[model] = load
        result.bounds[model] = prefill[thresholds[0]] + decode
        grid: _Grid | MixedGrid
        if space.mixed_pools > 1:
            grid = _mixed_grid(model, plans, prefill, decode, space, base, constraints, demand)
        else:
            grid = _Grid(model, prefill, decode, space.max_pool_replicas, space.objective, space.exhaustive)
        result.grid[model], result.below_bound[model] = grid.total, grid.below
        grids.append(grid)
    sims_before = runner.simulations
    _search(grids, configs, runner, width, lambda key: _key_config(base, space, key),
            lambda row: prefill_queue_fails(row, ttft), result.points, progress)
    for grid in grids:
        result.implied_fail[grid.model] = grid.count_implied()
        if grid.best is not None:
            result.cheapest[grid.model] = grid.best
    if variants:
        for model, best in result.cheapest.items():
            cfg = configs[best.key]
            found = variants(cfg)
            rows = runner(list(found.values())) if found else []
            result.ranges[model] = {label: (bool(r.get("meets_slo")) if r.get("status") == "ok" else None)
                                    for label, r in zip(found, rows, strict=True)}
    result.simulations = runner.simulations - sims_before
    result.wall_s = time.perf_counter() - t0
    if runner.store:
        write_result(runner.store, result)
    return result


def _point_json(p: FleetPoint) -> dict:
    """One fleet as plan-disaggregated.json lists it; a role of several pools (--mixed-pools) is a list of
    them, as in the fleet's config."""
    row = p.row or {}

    def pools(role: Pools):
        spec = [{"gpu": t.gpu, "tp": t.tp, "replicas": n} for t, n in role]
        return spec if len(spec) > 1 else spec[0]

    return {"model": p.model, "fleet": p.label, "prefill": pools(p.prefill_pools), "decode": pools(p.decode_pools),
            "local_prefill_tokens": p.local, "gpus": p.gpus, "usd_per_hour": p.usd_per_hour,
            "run_id": row.get("run_id"), "status": row.get("status"), "meets_slo": p.meets,
            "ttft_p99_s": row.get("ttft_p99_s"), "tpot_p99_s": row.get("tpot_p99_s")}


def write_result(store, result: DisaggPlanResult) -> None:
    """STORE/plan-disaggregated.json: the bounds, every fleet simulated, the cheapest per model and the range."""
    from pathlib import Path

    from ..io.safe_io import atomic_output

    data = {"slo": result.slo, "simulations": result.simulations, "wall_s": result.wall_s,
            "bounds": {m: [{"role": b.role, "gpu": b.pool.gpu, "tp": b.pool.tp, "tok_s_per_replica": b.tok_s_per_replica,
                            "min_replicas": b.min_replicas, "why": b.why} for b in bounds]
                       for m, bounds in result.bounds.items()},
            "unfit": [{"model": m, "role": r, "gpu": p.gpu, "tp": p.tp, "why": why} for m, r, p, why in result.unfit],
            **({"mixed_pools": result.mixed_pools} if result.mixed_pools > 1 else {}),
            "grid": result.grid, "below_bound": result.below_bound, "implied_fail": result.implied_fail,
            "points": [_point_json(p) for p in result.points],
            "cheapest": {m: _point_json(p) for m, p in result.cheapest.items()}, "ranges": result.ranges}
    path = Path(store)
    path.mkdir(parents=True, exist_ok=True)
    with atomic_output(path / "plan-disaggregated.json") as tmp:
        tmp.write_text(json.dumps(data, indent=2, default=str))


def _search(grids: list[_Grid], configs: dict[tuple, SimConfig], runner, width: int,
            make: Callable[[tuple], SimConfig], queue_fails: Callable[[dict], bool], points: list[FleetPoint],
            progress: Callable[[FleetPoint], None] | None) -> None:
    """Rounds of `width` simulations, shared among the models, until no grid has a point to run."""
    while True:
        batch: list[tuple[_Grid, tuple]] = []
        share = max(1, width // max(1, len(grids)))
        for grid in grids:
            batch += [(grid, key) for key in grid.next(share)]
        for grid in grids:              # fill the round from the models that have more to run
            if len(batch) < width:
                taken = {k for _, k in batch}
                batch += [(grid, k) for k in grid.next(width) if k not in taken][:width - len(batch)]
        if not batch:
            return
        for _, key in batch:
            if key not in configs:
                configs[key] = make(key)
        for (grid, key), row in zip(batch, runner([configs[k] for _, k in batch]), strict=True):
            point = point_of(key, row)
            grid.record(point, queue_fails(row))
            points.append(point)
            if progress:
                progress(point)


def refuse_unmodelled(base: SimConfig, space: DisaggSpace) -> None:
    """What a fleet does not model (a KV policy, a closed loop, client latency; docs/disaggregation.md):
    a ConfigError naming it, before anything runs."""
    from ..simulator.fleet_run import refuse_unsupported

    if space.prefill and space.decode and space.models:
        pool = PoolType(space.prefill[0][0], space.prefill[0][1], 0.0)
        refuse_unsupported(fleet_config(base, space.models[0], ((pool, 1),), ((pool, 1),), space,
                                        max(space.local_prefill_tokens, default=0)))


def pareto_front(points: list[dict]) -> list[dict]:
    """AIConfigurator's view: among points meeting the SLO, those no other point beats on both output
    tokens/s per GPU and tokens/s per user (1 / mean TPOT). Each point a dict with `per_gpu` and
    `per_user`; highest throughput per GPU first."""
    keep = []
    for a in points:
        beaten = any(b["per_gpu"] >= a["per_gpu"] and b["per_user"] >= a["per_user"]
                     and (b["per_gpu"] > a["per_gpu"] or b["per_user"] > a["per_user"]) for b in points)
        if not beaten:
            keep.append(a)
    return sorted(keep, key=lambda p: (-p["per_gpu"], -p["per_user"]))
