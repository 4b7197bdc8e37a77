"""Search the configuration space for the cheapest way to serve a load under an SLO.

For every (model, GPU, TP degree[, KV policy]) whose weights fit, the fewest replicas that meet the
SLO at the given load; the searches advance in rounds, every round's simulations submitted together
to one executor (a local Dask cluster by default, the same task `kvsim sweep` runs). Between rounds
a configuration is dropped once it cannot be cheaper than a passing point already found for its
model (its GPU price x TP x the fewest replicas it may still need), so the expensive corners of the
space are never simulated. Before anything runs, each configuration's capacity bound (bounds.py: the
fewest replicas whose roofline ceilings could finish the work the SLO's deadlines make due) rules out
the counts below it, and a configuration whose bound already costs as much as an answer is dropped
unsimulated. An optional low-fidelity pass (`PlanSpace.low_fi`: the busiest share of the sample) starts
and orders the full searches; the full simulations decide. `PlanSpace.exhaustive` simulates every
configuration at every count instead (the reference the pruned search is tested against). Every run
goes through a sweep store (same run ids as `kvsim sweep` and `kvsim capacity`), so a plan is
resumable and `kvsim report` draws it.
"""
from __future__ import annotations

import json
import math
import os
import re
import time
import warnings
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from collections.abc import Callable, Iterator

from kvsim.traces.errors import TraceWarning

from .capacity import Constraint, judge_row, slo_for_goodput
from ..config import KVConfig, SimConfig
from ..kv.policy import policy_parameters
from ..io.safe_io import atomic_output
from .sweep import (DASK_EXTRA, MissingExtra, PlannedRun, RunTask, SpecError, _dask, _FitChecker, _local, _serial,
                    finished_runs, make_row,
                    read_store, run_id_of, write_row)

RunBatch = Callable[[list[RunTask]], Iterator[tuple[RunTask, dict]]]


@dataclass(frozen=True)
class Candidate:
    model: str
    gpu: str
    tp: int
    policy: str | None
    cfg: SimConfig                 # replicas set per run
    objective: str = "usd"         # what the search minimises: usd ($/hour) or gpus (then $/hour)
    spec: str | None = None        # the speculative-decoding variant's label (PlanSpace.speculative), or None

    @property
    def label(self) -> str:
        pol = f" {self.policy}" if self.policy else ""
        spec = f" {self.spec}" if self.spec else ""
        return f"{self.model} {self.gpu} TP{self.tp}{pol}{spec}"

    @property
    def usd_per_replica_hour(self) -> float:
        return self.cfg.gpu_usd_per_hour(self.gpu) * self.tp

    @property
    def cost_per_replica(self) -> float:
        """One replica's cost in the objective's unit: $/hour, or GPUs plus 1e-6 x $/hour (the price breaks ties
        between equal GPU counts and never outweighs one GPU below $1,000,000/h)."""
        if self.objective == "gpus":
            return self.tp + 1e-6 * self.usd_per_replica_hour
        return self.usd_per_replica_hour

    def unit(self, cost: float) -> str:
        return f"{cost:.2f} GPUs" if self.objective == "gpus" else f"${cost:.2f}/h"


@dataclass
class Search:
    """The fewest-replicas search of one candidate: fails at `lo_fail`, meets at `hi_ok`."""
    cand: Candidate
    start: int = 1
    prune: bool = True              # may be dropped as dominated
    lo_fail: int = 0
    hi_ok: int | None = None
    status: str = "searching"       # answer | dominated | over max replicas | failed | cannot meet (bound)
    note: str = ""
    rows: dict[int, dict] = field(default_factory=dict)
    bound: int = 1                  # the capacity bound: fewer replicas cannot meet the SLO (bounds.py)
    bound_why: str = ""             # what sets it
    guess: int | None = None        # the low-fidelity pass's fewest replicas (None: not run)

    @property
    def answer_row(self) -> dict | None:
        return self.rows.get(self.hi_ok) if self.status == "answer" else None


@dataclass
class PlanResult:
    slo: list[str]
    searches: list[Search]
    unfit: list[tuple[Candidate, str]]        # (configuration, why it cannot run)
    cheapest: dict[str, Search]               # model -> the cheapest search that found an answer
    ranges: dict[str, dict] = field(default_factory=dict)   # model -> {label: replicas or None}
    range_notes: list[str] = field(default_factory=list)
    simulations: int = 0
    wall_s: float = 0.0
    counts: SpaceCounts | None = None

    def points(self):
        """Every simulated point (one row per run) with its candidate and replica count."""
        import pandas as pd

        rows = [{**row, "candidate": s.cand.label, "model_key": s.cand.model} for s in self.searches
                for row in s.rows.values()]
        return pd.DataFrame(rows)

    def pareto(self):
        """Points meeting the SLO that no other point of the same model beats on $/hour, TTFT p99 and
        TPOT p99 at once (among the points simulated), cheapest first."""
        df = self.points()
        if df.empty:
            return df
        ok = df[df["meets_slo"]].copy()
        keep = []
        for _, group in ok.groupby("model_key", sort=False):
            values = group[["usd_per_hour", "ttft_p99_s", "tpot_p99_s"]].fillna(0.0).to_numpy()
            for i, v in enumerate(values):
                beaten = ((values <= v).all(axis=1) & (values < v).any(axis=1)).any()
                if not beaten:
                    keep.append(group.index[i])
        return ok.loc[keep].sort_values(["model_key", "usd_per_hour", "ttft_p99_s"], kind="stable")


@dataclass(frozen=True)
class PlanSpace:
    """The configurations a plan searches (`kvsim plan`'s --models, --gpus, --tps, --policies, --max-replicas)."""
    models: list[str]                   # catalog model names (or model YAML paths): one cheapest answer each
    gpus: list[str]                     # catalog GPU names
    tps: list[int]                      # tensor-parallel degrees
    policies: list[str] | None = None   # kv.policy names (None: the base config's policy only)
    max_replicas: int = 64              # no configuration is simulated with more replicas than this
    objective: str = "usd"              # usd: the fewest dollars an hour; gpus: the fewest GPUs
    # speculative-decoding variants (`speculative_config` mappings; None: without): each one a configuration
    # of its own (None: the base config's setting only)
    speculative: list[dict | None] | None = None
    exhaustive: bool = False            # simulate every configuration x replica count (no bound, no pruning)
    bounds: bool = True                 # rule out replica counts below each configuration's capacity bound
    low_fi: float = 0.0                 # > 0: first run each configuration at its bound on the busiest window
                                        # of this share of the sample (orders the full search and starts it)


def spec_label(spec: dict | None) -> str:
    """A speculative variant's label: `no-spec`, or its method and k (`eagle3 k=3`)."""
    if spec is None:
        return "no-spec"
    from ..config import SpeculativeConfig
    sc = SpeculativeConfig.model_validate(spec)
    k = f" k={sc.num_speculative_tokens}" if sc.num_speculative_tokens else ""
    return f"{sc.method or sc.model}{k}"


@dataclass
class SpaceCounts:
    """How much of the space a plan simulated: every (configuration, replica count) within the limit."""
    configurations: int = 0             # models x GPUs x TPs (x policies) x 1..max_replicas
    cannot_run: int = 0                 # of configurations whose weights do not fit
    below_bound: int = 0                # counts below a configuration's capacity bound (incl. no count can meet)
    low_fi_runs: int = 0                # low-fidelity simulations (the short window)
    full_runs: int = 0                  # simulations of the sample that decided (the store's reuse not counted)
    reused: int = 0                     # points found in the store (identical configurations simulated before)

    @property
    def simulated(self) -> int:
        return self.full_runs + self.reused


def candidates(base: SimConfig, space: PlanSpace) -> tuple[list[Candidate], list[tuple[Candidate, str]]]:
    """The cross product of `space`, less the configurations that cannot run (weights do not fit, TP
    does not divide the heads, ...), each with why."""
    fits = _FitChecker()
    keep, unfit = [], []
    for model in space.models:
        for gpu in space.gpus:
            for tp in space.tps:
                for policy in space.policies or [None]:
                    # `...`: the base config's own speculative setting (no variants asked for)
                    for spec in space.speculative if space.speculative is not None else [...]:
                        update = {"model": model, "gpu": gpu, "tp": tp, "replicas": 1}
                        data = base.model_dump()
                        data.update(update)
                        if policy:
                            data["kv"] = {**data["kv"], "policy": policy}
                            if "budget" not in policy_parameters(policy):     # the base's budget is for those that take one
                                data["kv"]["budget"] = KVConfig.model_fields["budget"].default
                        if spec is not ...:
                            data["speculative_config"] = spec
                        cfg = SimConfig.model_validate(data)
                        cand = Candidate(model, gpu, tp, policy, cfg, space.objective,
                                         None if spec is ... else spec_label(spec))
                        try:
                            fits.check(cfg, "")
                        except SpecError as exc:
                            unfit.append((cand, _short_reason(str(exc).removeprefix(": "))))
                            continue
                        keep.append(cand)
    return keep, unfit


def _short_reason(text: str) -> str:
    """'model=... gpu=... tp=1: Llama-3.1-70B does not fit on L4 (tp=1): weights ... 112.67 GiB missing (raise
    tp, ...)' -> 'Llama-3.1-70B does not fit on L4 (tp=1): 112.67 GiB missing'."""
    text = text.split(": ", 1)[1] if text.startswith("model=") and ": " in text else text
    head, _, rest = text.partition(": ")
    missing = re.search(r"[\d.]+ GiB missing", rest)
    return f"{head}: {missing.group(0)}" if missing else text


@contextmanager
def executor(scheduler: str | None = None, jobs: int | None = None) -> Iterator[tuple[RunBatch, int]]:
    """(a function running a batch of tasks, how many run at once): on the Dask scheduler at
    `scheduler`, else on a local Dask cluster of `jobs` single-threaded worker processes (default: all
    cores); jobs=1 without a scheduler runs in this process."""
    if scheduler is None and jobs == 1:
        yield _serial, 1
        return
    import logging

    try:
        from distributed import Client, LocalCluster
    except ImportError:
        if scheduler is not None:
            raise MissingExtra(DASK_EXTRA) from None
        workers = jobs or os.cpu_count() or 1
        warnings.warn(f"Dask is not installed (the 'distributed' extra): the plan runs on a local process pool of "
                      f"{workers} workers instead (same results)", TraceWarning, stacklevel=3)
        yield (lambda tasks: _local(tasks, workers) if len(tasks) > 1 and workers > 1 else _serial(tasks)), workers
        return

    cluster = None
    if scheduler is None:
        cluster = LocalCluster(n_workers=jobs or os.cpu_count() or 1, threads_per_worker=1, processes=True,
                               dashboard_address=":0", silence_logs=logging.ERROR)
    client = Client(scheduler or cluster)
    try:
        yield (lambda tasks: _dask(tasks, client)), max(1, sum(client.nthreads().values()))
    finally:
        client.close()
        if cluster is not None:
            cluster.close()


class _Runner:
    """Runs a round's configurations (those not in the store) as one batch and judges every row."""

    def __init__(self, constraints: list[Constraint], run_batch: RunBatch, store: Path | None):
        self.constraints, self.run_batch, self.store = constraints, run_batch, store
        self.done = finished_runs(store, include_failed=False) if store else set()
        self.cached = read_store(store, order=False).set_index("run_id", drop=False) if self.done else None
        self.simulations = 0
        self.reused = 0                 # rows taken from the store (identical configurations run before)
        self.run_ids: list[str] = []

    def __call__(self, cfgs: list[SimConfig]) -> list[dict]:
        ids = [run_id_of(c) for c in cfgs]
        rows: dict[str, dict] = {}
        tasks = []
        for rid, cfg in zip(ids, cfgs, strict=True):
            if self.cached is not None and rid in self.done:
                self.reused += 1
                rows[rid] = {k: v for k, v in self.cached.loc[rid].to_dict().items()
                             if not (isinstance(v, float) and math.isnan(v)) and v is not None}
            elif rid not in {t.run_id for t in tasks}:
                tasks.append(RunTask(rid, cfg.model_dump(mode="json")))
        for task, metrics in self.run_batch(tasks) if tasks else ():
            row = make_row(PlannedRun(0, task.run_id, task.config, {}), metrics)
            if self.store:
                write_row(self.store, row)
            rows[task.run_id] = row
            self.simulations += 1
        self.run_ids += [i for i in ids if i not in self.run_ids]
        return [judge_row(dict(rows[rid]), self.constraints) if rows[rid]["status"] == "ok" else dict(rows[rid])
                for rid in ids]


def _next_count(s: Search, best: float | None, max_replicas: int) -> int | None:
    """The replica count to simulate next, or None when the search is over (status set)."""
    price = s.cand.cost_per_replica
    if s.hi_ok is not None and s.hi_ok - s.lo_fail <= 1:
        s.status = "answer"
        return None
    if s.prune and best is not None and price * (s.lo_fail + 1) >= best * (1 - 1e-9):
        s.status, s.note = "dominated", f">= {s.cand.unit(best)}"
        return None
    near = s.start - 1 if s.hi_ok == s.start else s.start + 1 if s.lo_fail == s.start else None
    if s.start > 1 and near is not None and near not in s.rows and s.lo_fail < near <= max_replicas \
            and (s.hi_ok is None or near < s.hi_ok):
        return near                 # from a guess (a range search): its neighbour settles most cases
    if s.hi_ok is not None:
        return (s.lo_fail + s.hi_ok) // 2
    if s.lo_fail >= max_replicas:
        s.status, s.note = "over max replicas", f"fails at {s.lo_fail}"
        return None
    n = s.start if not s.rows else max(2 * s.lo_fail, _saturation_guess(s.rows[s.lo_fail], s.lo_fail))
    if s.prune and best is not None:       # never simulate a count that cannot be cheaper
        n = min(n, math.ceil(best / price * (1 - 1e-9)) - 1)
    return max(s.lo_fail + 1, min(n, max_replicas))


def _saturation_guess(row: dict, n: int) -> int:
    """Replicas needed if an overloaded run's throughput scales with the replica count (x1.1)."""
    offered, served = row.get("offered_rate_req_s"), row.get("throughput_req_s")
    if not offered or not served or served <= 0 or math.isnan(offered) or math.isnan(served):
        return 2 * n
    return math.ceil(n * offered / served * 1.1)


def search_rounds(searches: list[Search], runner: _Runner, max_replicas: int, width: int | None = None,
                  progress: Callable[[Search, int, dict], None] | None = None) -> None:
    """Advance the searches in rounds of at most `width` simulations (None: every search each round),
    all of a round's runs in one batch. The cheapest proposals go first, taken in turn from each model,
    so a cheap answer found early drops the expensive configurations before they are simulated."""
    while True:
        best = _best_costs(searches)
        proposals = [(s, n) for s in searches if s.status == "searching"
                     for n in [_next_count(s, best.get(s.cand.model), max_replicas)] if n is not None]
        if not proposals:
            return
        rows = runner([s.cand.cfg.model_copy(update={"replicas": n}) for s, n in _cheapest_first(proposals, width)])
        for (s, n), row in zip(_cheapest_first(proposals, width), rows, strict=True):
            row["replicas"] = n
            s.rows[n] = row
            if row["status"] != "ok":
                s.status, s.note = "failed", str(row.get("error"))
            elif row["meets_slo"]:
                s.hi_ok = n
            else:
                s.lo_fail = n
            if progress:
                progress(s, n, row)


def _cheapest_first(proposals: list[tuple[Search, int]], width: int | None) -> list[tuple[Search, int]]:
    if width is None or len(proposals) <= width:
        return proposals
    by_model: dict[str, list] = {}
    for s, n in sorted(proposals, key=lambda p: p[0].cand.cost_per_replica * p[1]):
        by_model.setdefault(s.cand.model, []).append((s, n))
    queues = list(by_model.values())
    picked = []
    while len(picked) < width:
        for q in queues:
            if q and len(picked) < width:
                picked.append(q.pop(0))
    return picked


def _best_costs(searches: list[Search]) -> dict[str, float]:
    best: dict[str, float] = {}
    for s in searches:
        if s.hi_ok is not None and s.prune:
            cost = s.cand.cost_per_replica * s.hi_ok
            best[s.cand.model] = min(cost, best.get(s.cand.model, math.inf))
    return best


def plan_capacity(base: SimConfig, constraints: list[Constraint], space: PlanSpace, *,
                  run_batch: RunBatch = _serial, width: int | None = 1, store: str | Path | None = None,
                  variants: Callable[[SimConfig], dict[str, SimConfig]] | None = None,
                  progress: Callable[[Search, int, dict], None] | None = None) -> PlanResult:
    """The cheapest (model-wise) configuration meeting `constraints` at `base`'s load, searched over
    `space` (models x gpus x tps (x policies)), `width` simulations at a time (the executor's workers;
    None: every open search each round). `variants(cfg)`: other versions of the winner's config (other
    load samples, profile band) whose fewest replicas give the answer's range."""
    t0 = time.perf_counter()
    base = slo_for_goodput(base, constraints)
    store = Path(store) if store else None
    max_replicas = space.max_replicas
    cands, unfit = candidates(base, space)
    runner = _Runner(constraints, run_batch, store)
    searches = [Search(c) for c in cands]
    counts = SpaceCounts(configurations=(len(cands) + len(unfit)) * max_replicas, cannot_run=len(unfit) * max_replicas)
    if space.exhaustive:
        _exhaustive(searches, runner, max_replicas, width, progress)
    else:
        if space.bounds:
            counts.below_bound = apply_bounds(searches, constraints, max_replicas)
        if space.low_fi > 0:
            before = runner.simulations
            low_fi_guesses(base, searches, runner, max_replicas, width, space.low_fi)
            counts.low_fi_runs = runner.simulations - before
        reused = runner.reused
        before = runner.simulations
        search_rounds(searches, runner, max_replicas, width, progress)
        counts.full_runs, counts.reused = runner.simulations - before, runner.reused - reused
    if space.exhaustive:
        counts.full_runs, counts.reused = runner.simulations, runner.reused
    cheapest: dict[str, Search] = {}
    for s in searches:
        if s.status == "answer":
            cur = cheapest.get(s.cand.model)
            key = (s.cand.cost_per_replica * s.hi_ok, s.answer_row.get("ttft_p99_s", math.inf))
            if cur is None or key < (cur.cand.cost_per_replica * cur.hi_ok, cur.answer_row.get("ttft_p99_s", math.inf)):
                cheapest[s.cand.model] = s
    result = PlanResult([c.text for c in constraints], searches, unfit, cheapest, counts=counts)
    if variants:
        extra: list[tuple[str, str, Search]] = []
        for model, s in cheapest.items():
            for label, cfg in variants(s.cand.cfg).items():
                cand = Candidate(s.cand.model, s.cand.gpu, s.cand.tp, s.cand.policy, cfg, s.cand.objective, s.cand.spec)
                extra.append((model, label, Search(cand, start=s.hi_ok, prune=False)))
        if space.bounds and not space.exhaustive:       # a variant's own bound (its window, its step times)
            apply_bounds([e[2] for e in extra], constraints, max_replicas)
            for _, _, s in extra:
                s.start = max(s.start, s.bound)
        search_rounds([e[2] for e in extra], runner, max_replicas, None, progress)
        for model, label, s in extra:
            result.ranges.setdefault(model, {})[label] = s.hi_ok if s.status == "answer" else None
    result.simulations = runner.simulations
    result.wall_s = time.perf_counter() - t0
    if store:
        _write_plan_result(store, result, runner.run_ids)
    return result


def apply_bounds(searches: list[Search], constraints: list[Constraint], max_replicas: int) -> int:
    """Each search's capacity bound (bounds.py, on its own config's sample and KV policy): its counts below
    the bound are failures without a run, a configuration no count can serve is settled as `cannot meet
    (bound)`. Returns the counts ruled out."""
    from .bounds import ReplicaBound, demand_of, replica_bound
    from ..engine.resolved_run import resolve_run

    demands: dict[str, object] = {}
    ruled_out = 0
    for s in searches:
        cfg = s.cand.cfg            # its own sample and KV policy (--policies, a range's other windows)
        key = json.dumps([cfg.trace, cfg.seed, cfg.step_variance, cfg.engine.enable_prefix_caching,
                          cfg.trace_options.model_dump(mode="json"), cfg.kv.model_dump(mode="json")], default=str)
        if key not in demands:
            demands[key] = demand_of(cfg)
        try:
            b = replica_bound(resolve_run(cfg), demands[key], constraints)
        except (ValueError, KeyError) as exc:        # the run itself will say what is wrong; nothing pruned
            b = ReplicaBound(1, f"no bound: {type(exc).__name__}: {exc}")
        if b.min_replicas is None:
            s.status, s.note = "cannot meet (bound)", b.why
            ruled_out += max_replicas
        elif b.min_replicas > max_replicas:
            s.status, s.note = "over max replicas", f"bound {b.min_replicas}: {b.why}"
            ruled_out += max_replicas
        else:
            s.bound, s.lo_fail, s.bound_why = b.min_replicas, b.min_replicas - 1, b.why
            ruled_out += b.min_replicas - 1
    return ruled_out


def low_fi_window(cfg: SimConfig, share: float) -> SimConfig | None:
    """`cfg` on the busiest window of `share` x its sample's duration (trace seconds, inside the sample);
    None when the sample is too short to cut (under 2 requests, or the first N requests)."""
    from kvsim.traces.windows import busiest_windows
    from ..engine.assembly import load_workload

    opts = cfg.trace_options
    if opts.max_requests is not None or opts.request_rate is not None or not 0 < share < 1:
        return None
    trace = load_workload(cfg.model_copy(update={"trace_options": opts.model_copy(update={"rate_scale": 1.0})}))
    arrivals = trace.df["arrival_time_s"].to_numpy(dtype=float) + (opts.start_s or 0.0)
    if len(arrivals) < 2 or not arrivals[-1] > arrivals[0]:
        return None
    lo = opts.start_s if opts.start_s is not None else float(arrivals[0])
    hi = opts.end_s if opts.end_s is not None else float(arrivals[-1])
    found = busiest_windows(arrivals, share * (hi - lo), 1)
    if not found or found[0][1] < 2:
        return None
    start = found[0][0]
    return cfg.model_copy(update={"trace_options": opts.model_copy(
        update={"start_s": start, "end_s": min(start + share * (hi - lo), hi)})})


def low_fi_guesses(base: SimConfig, searches: list[Search], runner: _Runner, max_replicas: int, width: int | None,
                   share: float) -> None:
    """The low-fidelity pass: one run of each open search at its bound on the busiest `share` of the
    sample. Where it meets, the full search starts at the bound; where it is overloaded, at the count its
    throughput implies (as the full search's second step would, x1.1); either way the full search checks
    the neighbouring count, and the guesses order the searches cheapest first. Only an order and a start:
    the full simulations decide."""
    window = low_fi_window(base, share)
    if window is None:
        return
    open_ = [s for s in searches if s.status == "searching"]
    cfgs = [s.cand.cfg.model_copy(update={"trace_options": window.trace_options, "replicas": s.bound})
            for s in open_]
    for s, row in zip(open_, runner(cfgs) if cfgs else [], strict=True):
        if row["status"] != "ok":
            continue
        guess = s.bound if row["meets_slo"] else max(s.bound + 1, _saturation_guess(row, s.bound))
        s.guess = s.start = min(guess, max_replicas)


def _exhaustive(searches: list[Search], runner: _Runner, max_replicas: int, width: int | None,
                progress: Callable[[Search, int, dict], None] | None) -> None:
    """Every configuration at every count 1..max_replicas, in batches of `width` x 8; each search's answer
    is its fewest replicas meeting the SLO (no assumption that more replicas never hurt)."""
    todo = [(s, n) for s in searches for n in range(1, max_replicas + 1)]
    size = max(1, (width or 1) * 8)
    for i in range(0, len(todo), size):
        part = todo[i:i + size]
        for (s, n), row in zip(part, runner([s.cand.cfg.model_copy(update={"replicas": n}) for s, n in part]),
                               strict=True):
            row["replicas"] = n
            s.rows[n] = row
            if progress:
                progress(s, n, row)
    for s in searches:
        ok = [n for n, row in s.rows.items() if row["status"] == "ok" and row["meets_slo"]]
        failed = [row for row in s.rows.values() if row["status"] != "ok"]
        if ok:
            s.status, s.hi_ok, s.lo_fail = "answer", min(ok), min(ok) - 1
        elif failed:
            s.status, s.note = "failed", str(failed[0].get("error"))
        else:
            s.status, s.note, s.lo_fail = "over max replicas", f"fails at 1-{max_replicas}", max_replicas


def _write_plan_result(store: Path, result: PlanResult, run_ids: list[str]) -> None:
    store.mkdir(parents=True, exist_ok=True)
    data = {
        "slo": result.slo, "simulations": result.simulations, "wall_s": result.wall_s,
        "unfit": [{"config": c.label, "why": why} for c, why in result.unfit],
        "searches": [{"config": s.cand.label, "model": s.cand.model, "gpu": s.cand.gpu, "tp": s.cand.tp,
                      "policy": s.cand.policy, "speculative": s.cand.spec, "status": s.status, "note": s.note,
                      "fewest_replicas": s.hi_ok if s.status == "answer" else None,
                      "bound": s.bound, "bound_why": s.bound_why, "low_fi_guess": s.guess,
                      "usd_per_hour": s.cand.usd_per_replica_hour * s.hi_ok if s.status == "answer" else None}
                     for s in result.searches],
        "cheapest": {m: s.cand.label for m, s in result.cheapest.items()},
        "ranges": result.ranges, "range_notes": result.range_notes,
        "counts": None if result.counts is None else {**asdict(result.counts), "simulated": result.counts.simulated},
    }
    texts = {"plan-result.json": json.dumps(data, indent=2, default=str),
             "plan.json": json.dumps({"name": "capacity plan", "axis_keys": ["model", "gpu", "tp", "replicas"],
                                      "run_ids": run_ids}, indent=1)}
    for name, text in texts.items():
        with atomic_output(store / name) as tmp:
            tmp.write_text(text)
