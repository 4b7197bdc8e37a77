"""Capacity search: the highest arrival-rate scale (or the fewest replicas) that meets an SLO.

An SLO is a list of constraints on summary metrics, e.g. ``ttft_p99<=2s,tpot_p99<=100ms`` or
``e2e_p90<=30s,slo_attainment>=0.99``. The search brackets the boundary by doubling/halving, then
bisects; every point it simulates goes through the sweep store (same task, same run ids), so a
search is resumable and `kvsim report` draws its curve.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Literal, NamedTuple
from collections.abc import Callable

import pandas as pd

from ..model.catalog import get_gpu
from ..engine.resolved_run import check_config_memory
from ..config import ConfigError, SimConfig, parse_duration
from ..io.result_dirs import holding_store_lock, mark_owned
from ..io.safe_io import atomic_output, dumps_json
from ..engine.step_noise import resolve_sigma
from .sweep import (PlannedRun, RunTask, StoreFileError, execute_run, finished_runs, make_row, read_store, read_store_object, run_id_of, slo_costs,
                    write_row)

LATENCY_METRICS = [f"{m}_{q}" for m in ("ttft", "tpot", "e2e", "queueing") for q in ("p50", "p90", "p99", "mean")]
LATENCY_METRICS += [f"itl_{q}" for q in ("p50", "p90", "p99")]
PLAIN_METRICS = ["slo_attainment", "goodput_req_s", "throughput_req_s", "throughput_output_tok_s",
                 "kv_util_mean", "kv_util_max", "fragmentation_mean", "fragmentation_p99",
                 "preemption_rate", "num_rejected", "usd_per_m_output_tok"]
FRACTION_METRICS = ("slo_attainment", "kv_util_mean", "kv_util_max", "fragmentation_mean", "fragmentation_p99")
_OPS: dict[str, Callable[[float, float], bool]] = {
    "<=": lambda v, lim: v <= lim, "<": lambda v, lim: v < lim,
    ">=": lambda v, lim: v >= lim, ">": lambda v, lim: v > lim,
}


@dataclass(frozen=True)
class Constraint:
    metric: str        # summary column, e.g. ttft_p99_s
    op: str
    limit: float
    text: str          # as the user wrote it

    def holds(self, row: dict) -> bool:
        value = row.get(self.metric)
        return value is not None and not (isinstance(value, float) and math.isnan(value)) \
            and _OPS[self.op](float(value), self.limit)


def parse_slo(text: str) -> list[Constraint]:
    """'ttft_p99<=2s, tpot_p99<=100ms' -> constraints. Latency metrics need a unit."""
    constraints = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        m = re.fullmatch(r"([a-z0-9_]+)\s*(<=|>=|<|>)\s*(.+)", part)
        if not m:
            raise ConfigError(f"--slo: {part!r} is not METRIC<=VALUE (e.g. ttft_p99<=2s, slo_attainment>=0.99)")
        name, op, raw = m.group(1), m.group(2), m.group(3).strip()
        if name.endswith("_s") and name[:-2] in LATENCY_METRICS:
            name = name[:-2]
        if name in LATENCY_METRICS:
            limit = parse_duration(raw, f"--slo {name}")
            if limit <= 0 and op in ("<=", "<"):
                raise ConfigError(f"--slo: {part!r}: a latency is never {raw}; expected a limit above 0")
            constraints.append(Constraint(f"{name}_s", op, limit, part))
        elif name in PLAIN_METRICS:
            try:
                limit = float(raw)
            except ValueError:
                raise ConfigError(f"--slo: {part!r}: {name} takes a plain number, got {raw!r}") from None
            if not math.isfinite(limit):
                raise ConfigError(f"--slo: {part!r}: {name} takes a finite number, got {raw!r}")
            if name in FRACTION_METRICS and not 0 <= limit <= 1:
                raise ConfigError(f"--slo: {part!r}: {name} is a fraction from 0 to 1 (0.99 = 99%), got {raw}")
            constraints.append(Constraint(name, op, limit, part))
        else:
            raise ConfigError(f"--slo: unknown metric {name!r} in {part!r}; latency metrics (with a unit): "
                              f"{', '.join(LATENCY_METRICS)}; others: {', '.join(PLAIN_METRICS)}")
    if not constraints:
        raise ConfigError("--slo: no constraint given (e.g. \"ttft_p99<=2s,tpot_p99<=100ms\")")
    return constraints


def slo_for_goodput(cfg: SimConfig, constraints: list[Constraint]) -> SimConfig:
    """Use the SLO's TTFT/TPOT limits as the per-request thresholds behind goodput."""
    limits: dict[str, float] = {}
    for c in constraints:
        kind = c.metric.split("_")[0]
        if kind in ("ttft", "tpot") and c.op in ("<=", "<"):
            # several limits of one kind (ttft_p50<=200ms,ttft_p99<=2s): the loosest, whatever their order
            limits[kind] = max(limits.get(kind, c.limit), c.limit)
    update = {kind: f"{limit * 1e3:.12g}ms" for kind, limit in limits.items()}
    return cfg.model_copy(update={"slo": cfg.slo.model_copy(update=update)}) if update else cfg


@dataclass
class CapacityResult:
    mode: str
    slo: list[str]
    feasible: bool            # some point met the SLO
    bounded: bool             # some point failed it (so the answer is a maximum, not a lower bound)
    answer: float | None      # max rate scale (mode=rate) / fewest replicas (mode=replicas)
    answer_rate_req_s: float | None
    answer_run_id: str | None
    answer_metrics: dict = field(default_factory=dict)
    curve: pd.DataFrame | None = None    # every point simulated, sorted by the searched value

    def to_json(self) -> dict:
        out = asdict(self)
        out["curve"] = None
        return out


class _Evaluator:
    """Runs (or reuses from the store) one configuration and reports whether it meets the SLO."""

    def __init__(self, constraints: list[Constraint], store: Path | None, progress: Callable[[dict], None] | None):
        self.constraints = constraints
        self.store = store
        self.rows: dict[str, dict] = {}
        self.progress = progress
        self.done = finished_runs(store, include_failed=False) if store else set()
        self.cached = read_store(store, order=False).set_index("run_id", drop=False) if self.done else None

    def __call__(self, cfg: SimConfig, value: float) -> dict:
        rid = run_id_of(cfg)
        if rid in self.rows:
            return self.rows[rid]
        if self.cached is not None and rid in self.done:
            row = {k: v for k, v in self.cached.loc[rid].to_dict().items() if not _is_missing(v)}
        else:
            run = PlannedRun(len(self.rows), rid, cfg.model_dump(mode="json"), {})
            row = make_row(run, execute_run(RunTask(rid, run.config)))
            if self.store:
                write_row(self.store, row)
        if row["status"] != "ok":
            raise RuntimeError(f"simulation failed at {value:g}: {row['error']}")
        judge_row(row, self.constraints)
        row["searched_value"] = value
        self.rows[rid] = row
        if self.progress:
            self.progress(row)
        return row


def judge_row(row: dict, constraints: list[Constraint]) -> dict:
    """Set a run row's `meets_slo` and `violations` by `constraints`, and its cost columns to count only
    if it meets them (a cost limit in the SLO is judged on the run's price either way)."""
    tok_s, good = row.get("throughput_output_tok_s"), row.get("goodput_req_s")
    row.update(slo_costs(row["usd_per_hour"], tok_s, good, True))
    row["meets_slo"] = all(c.holds(row) for c in constraints)
    row["violations"] = "; ".join(f"{c.text} (got {_fmt(row.get(c.metric), c)})" for c in constraints if not c.holds(row))
    row.update(slo_costs(row["usd_per_hour"], tok_s, good, row["meets_slo"]))
    return row


def _is_missing(v) -> bool:
    return v is None or (isinstance(v, float) and math.isnan(v))


def _fmt(value, c: Constraint) -> str:
    if _is_missing(value):
        return "n/a"
    if not c.metric.endswith("_s"):
        return f"{value:.4g}"
    return f"{value * 1e3:.1f}ms" if abs(value) < 10 else f"{value:,.1f}s"      # 2,571.2s, not 2571157.9ms


@dataclass(frozen=True)
class CapacitySearch:
    """What a capacity search looks for and how far it may walk (`kvsim capacity`'s --mode, --tol,
    --max-evals, --max-replicas)."""
    mode: Literal["rate", "replicas"] = "rate"   # highest rate scale, or fewest replicas, meeting the SLO
    start: float = 1.0              # mode=rate: the first rate scale simulated
    growth: float = 2.0             # mode=rate: factor between bracketing points (x growth up, / growth down)
    rel_tol: float = 0.02           # mode=rate: bisect until the bracket is within this share of the answer
    max_evals: int = 24             # mode=rate: at most this many simulations
    min_scale: float = 1 / 1024     # mode=rate: no rate scale below this is tried
    max_scale: float = 1024.0       # mode=rate: no rate scale above this is tried
    max_replicas: int = 64          # mode=replicas: no count above this is tried
    start_replicas: int = 1         # mode=replicas: the first count simulated


@holding_store_lock
def find_capacity(cfg: SimConfig, constraints: list[Constraint], search: CapacitySearch = CapacitySearch(), *,
                  store: str | Path | None = None, progress: Callable[[dict], None] | None = None,
                  write_result: bool = True) -> CapacityResult:
    """search.mode='rate': highest trace_options.rate_scale meeting the SLO, within search.rel_tol.
    search.mode='replicas': fewest replicas meeting it for the trace at its configured rate (the search
    starts at `search.start_replicas`). write_result=False leaves the store's capacity.json as it is."""
    mode = search.mode
    if mode not in ("rate", "replicas"):
        raise ConfigError(f"capacity mode must be 'rate' or 'replicas', got {mode!r}")
    cfg = slo_for_goodput(cfg, constraints)
    check_config_memory(cfg)        # the pool every run allocates, before the search starts (each run checks again)
    store = Path(store) if store else None
    evaluate = _Evaluator(constraints, store, progress)
    if mode == "rate":
        bracket = _search_rate(cfg, evaluate, search)
    else:
        bracket = _search_replicas(cfg, evaluate, search.max_replicas, search.start_replicas)
    lo, hi = bracket
    bounded = hi is not None if mode == "rate" else lo is not None
    curve = pd.DataFrame(list(evaluate.rows.values())).sort_values("searched_value", kind="stable")
    curve = curve.reset_index(drop=True)
    best = evaluate.rows.get(_rid_at(cfg, mode, lo)) if lo is not None else None
    result = CapacityResult(
        mode=mode, slo=[c.text for c in constraints], feasible=lo is not None, bounded=bounded,
        answer=lo, answer_rate_req_s=best.get("offered_rate_req_s") if best else None,
        answer_run_id=best["run_id"] if best else None,
        answer_metrics={k: best.get(k) for k in _ANSWER_KEYS if best and k in best} if best else {},
        curve=curve)
    if store and write_result:
        _write_result(store, result)
    return result


_ANSWER_KEYS = ("offered_rate_req_s", "throughput_req_s", "throughput_output_tok_s", "goodput_req_s",
                "slo_attainment", "ttft_p99_s", "tpot_p99_s", "e2e_p99_s", "kv_util_mean",
                "num_gpus", "usd_per_hour", "usd_per_m_output_tok")


def _at(cfg: SimConfig, mode: str, value: float) -> SimConfig:
    if mode == "rate":
        return cfg.model_copy(update={"trace_options": cfg.trace_options.model_copy(update={"rate_scale": value})})
    return cfg.model_copy(update={"replicas": int(value)})


def _rid_at(cfg: SimConfig, mode: str, value: float) -> str:
    return run_id_of(SimConfig.model_validate(_at(cfg, mode, value).model_dump()))


def _meets(cfg: SimConfig, evaluate: _Evaluator, mode: str, value: float) -> bool:
    # re-validate so the copy is a canonical SimConfig (same run id as a sweep would compute)
    return evaluate(SimConfig.model_validate(_at(cfg, mode, value).model_dump()), value)["meets_slo"]


def _search_rate(cfg: SimConfig, evaluate: _Evaluator, search: CapacitySearch):
    """(highest passing scale or None, lowest failing scale or None)."""
    growth, rel_tol, max_evals = search.growth, search.rel_tol, search.max_evals
    min_scale, max_scale = search.min_scale, search.max_scale
    lo = hi = None
    x = search.start
    while len(evaluate.rows) < max_evals:
        if _meets(cfg, evaluate, "rate", x):
            lo = x
            if hi is not None or x * growth > max_scale:
                break
            x *= growth
        else:
            hi = x
            if lo is not None or x / growth < min_scale:
                break
            x /= growth
    if lo is None or hi is None:
        return lo, hi
    while hi - lo > rel_tol * lo and len(evaluate.rows) < max_evals:
        mid = float(f"{(lo + hi) / 2:.6g}")   # short decimals keep run ids and labels readable
        if mid in (lo, hi):
            break
        if _meets(cfg, evaluate, "rate", mid):
            lo = mid
        else:
            hi = mid
    return lo, hi


def _search_replicas(cfg, evaluate, max_replicas, start=1):
    """(fewest passing replica count or None, highest failing count or None). From `start`: doubling
    while counts fail, or halving while they pass, then bisection."""
    def meets(n: int) -> bool:
        return _meets(cfg, evaluate, "replicas", n)

    lo_fail, hi_ok = None, None
    n = max(1, min(start, max_replicas))
    if n > 1 and meets(n):
        hi_ok = n
        while hi_ok > 1 and lo_fail is None:
            if meets(hi_ok // 2):
                hi_ok //= 2
            else:
                lo_fail = hi_ok // 2
    while hi_ok is None:
        if meets(n):
            hi_ok = n
            break
        lo_fail = n
        if n >= max_replicas:
            return None, lo_fail
        n = min(n * 2, max_replicas)
    while lo_fail is not None and hi_ok - lo_fail > 1:
        mid = (lo_fail + hi_ok) // 2
        if meets(mid):
            hi_ok = mid
        else:
            lo_fail = mid
    return hi_ok, lo_fail


def _write_result(store: Path, result: CapacityResult) -> None:
    store.mkdir(parents=True, exist_ok=True)
    mark_owned(store)
    data = result.to_json()
    data["curve_run_ids"] = result.curve["run_id"].tolist() if result.curve is not None else []
    with atomic_output(store / "capacity.json") as tmp:
        tmp.write_text(dumps_json(data, indent=2, default=_json_default))
    if result.curve is not None:
        with atomic_output(store / "plan.json") as tmp:
            tmp.write_text(json.dumps({"name": f"capacity ({result.mode})", "axis_keys": [_axis(result.mode)],
                                       "run_ids": data["curve_run_ids"]}, indent=1))


def _axis(mode: str) -> str:
    return "trace_options.rate_scale" if mode == "rate" else "replicas"


def _json_default(value):
    if hasattr(value, "item"):
        return value.item()
    return str(value)


def read_capacity(store: str | Path) -> dict | None:
    """The store's capacity.json (None without one); a malformed file is a StoreFileError naming it."""
    path = Path(store) / "capacity.json"
    if not path.exists():
        return None
    data = read_store_object(path, "(mode, slo, answer, ...)")
    if data.get("mode") not in ("rate", "replicas"):
        raise StoreFileError(f"{path}: mode: expected 'rate' or 'replicas'")
    slo = data.get("slo")
    if not isinstance(slo, list) or not slo or not all(isinstance(c, str) for c in slo):
        raise StoreFileError(f"{path}: slo: expected a list of constraints such as 'ttft_p99<=2s'")
    try:
        parse_slo(",".join(slo))
    except ConfigError:
        raise StoreFileError(f"{path}: slo: not constraints kvsim capacity writes (METRIC<=VALUE)") from None
    answer, run_ids = data.get("answer"), data.get("curve_run_ids", [])
    if answer is not None and (isinstance(answer, bool) or not isinstance(answer, (int, float))):
        raise StoreFileError(f"{path}: answer: expected a number or null")
    if not isinstance(data.get("feasible"), bool):
        raise StoreFileError(f"{path}: feasible: expected true or false")
    if not isinstance(run_ids, list) or not all(isinstance(r, str) for r in run_ids):
        raise StoreFileError(f"{path}: curve_run_ids: expected a list of run ids")
    return data


# ---- the load a capacity answer is for: window, sample statistics, warnings ------------------------

DRAIN_WARN_SHARE = 0.25      # drain (after the last arrival) above this share of the makespan
RATE_WARN_RATIO = 1.2        # sample vs trace mean rate (either way)
CV_WARN_RATIO = 1.25         # sample vs trace inter-arrival CV (either way)


@dataclass(frozen=True)
class LoadSample:
    """Which part of the trace a search ran on, and how it compares with the whole trace."""
    window: str                 # '10m@peak', '600:1200', 'full trace', 'first 200 requests'
    start_s: float | None
    end_s: float | None
    requests: int
    rate_req_s: float           # at rate scale 1
    interarrival_cv: float
    trace_requests: int
    trace_rate_req_s: float
    trace_interarrival_cv: float
    distinct_arrivals: int = 2  # distinct arrival times in the sample (1: it arrives all at once)
    rate_scale: float = 1.0     # the config's trace_options.rate_scale (a rate search's first scale)

    def rates(self) -> tuple[float, float]:
        """(sample, trace) arrival rates in req/s at `rate_scale`."""
        return self.rate_req_s * self.rate_scale, self.trace_rate_req_s * self.rate_scale

    def describe(self) -> str:
        share = self.requests / self.trace_requests if self.trace_requests else math.nan
        rate, trace_rate = self.rates()
        return (f"load sample: {self.window}, {self.requests:,} of {self.trace_requests:,} requests ({share:.0%}), "
                f"{rate:.2f} req/s (trace {trace_rate:.2f}), inter-arrival CV "
                f"{self.interarrival_cv:.2f} (trace {self.trace_interarrival_cv:.2f}), at rate scale {self.rate_scale:g}")


def unwindowed_trace(cfg: SimConfig):
    """The trace of `cfg` as loaded (arrivals drawn for a length-only trace), before its window,
    rate scale and first-N selection."""
    from ..engine.assembly import load_workload

    opts = cfg.trace_options.model_copy(update={"start_s": None, "end_s": None, "rate_scale": 1.0,
                                                "max_requests": None})      # request_rate kept: its arrivals
    return load_workload(cfg.model_copy(update={"trace_options": opts}))


def choose_sample(cfg: SimConfig, window: str | None, trace=None) -> tuple[SimConfig, LoadSample]:
    """`cfg` over `window` (a spec of kvsim.traces.windows), or, when None, over the representative
    default unless `cfg` already selects part of the trace (start_s/end_s or max_requests)."""
    from kvsim.traces.windows import Window, representative_window, resolve_window, window_stats

    opts = cfg.trace_options
    sent = opts.request_rate is not None or opts.max_concurrency is not None
    if sent and window is not None:
        raise ConfigError("--window selects requests by arrival time; with trace_options.request_rate or "
                          "max_concurrency the arrivals are drawn after the selection: use --max-requests")
    trace = unwindowed_trace(cfg) if trace is None else trace
    whole = window_stats(trace, Window(None, None, "full trace"))
    if window is not None:
        if opts.max_requests is not None:
            raise ConfigError("--window and --max-requests both select requests; give one")
        w = resolve_window(trace, window)
    elif opts.max_requests is not None:
        head = trace.head(opts.max_requests)
        st = window_stats(head, Window(None, None, ""))
        return cfg, LoadSample(f"first {len(head):,} requests", None, None, st["requests"], st["rate_req_s"],
                               st["interarrival_cv"], whole["requests"], whole["rate_req_s"],
                               whole["interarrival_cv"], st["distinct_arrivals"], opts.rate_scale)
    elif opts.start_s is not None or opts.end_s is not None:
        w = Window(opts.start_s, opts.end_s, f"{opts.start_s or 0:g}:{'' if opts.end_s is None else f'{opts.end_s:g}'}")
    elif sent:          # arrivals drawn by the sender: the whole trace, as configured
        w = Window(None, None, "full trace", len(trace))
    else:
        w = representative_window(trace)
    cfg = cfg.model_copy(update={"trace_options": opts.model_copy(update={"start_s": w.start_s, "end_s": w.end_s})})
    cfg = SimConfig.model_validate(cfg.model_dump())
    st = window_stats(trace, w)
    label = f"{w.label} ({w.start_s:.0f}-{w.end_s:.0f} s)" if "@peak" in w.label else w.label
    return cfg, LoadSample(label, w.start_s, w.end_s, st["requests"], st["rate_req_s"], st["interarrival_cv"],
                           whole["requests"], whole["rate_req_s"], whole["interarrival_cv"], st["distinct_arrivals"],
                           opts.rate_scale)


def check_rate_search(sample: LoadSample) -> None:
    """Refuse a rate search on a sample that arrives all at once (one request, a closed batch): a rate
    scale moves no arrival, so every scale would give the same run and the 'answer' would be the
    search limit."""
    if sample.distinct_arrivals < 2:
        what = "holds one request" if sample.requests == 1 else f"arrives all at once ({sample.requests:,} requests)"
        raise ConfigError(f"--mode rate: the load sample ({sample.window}) {what}: no rate scale changes its load; "
                          "give it arrival times (--set trace_options.request_rate=R for a trace without them, or "
                          "another --window) or search --mode replicas")


def sample_warnings(sample: LoadSample) -> list[str]:
    """The sample's arrival rate or burstiness is not the trace's."""
    out = []
    ratio = sample.rate_req_s / sample.trace_rate_req_s if sample.trace_rate_req_s else math.nan
    if math.isfinite(ratio) and not 1 / RATE_WARN_RATIO <= ratio <= RATE_WARN_RATIO:
        why = ("the answer holds for the trace's busiest period" if "@peak" in sample.window and ratio > 1
               else "the answer is not the whole trace's")
        rate, trace_rate = sample.rates()
        out.append(f"the sample arrives at {rate:.2f} req/s, {ratio:.2f}x the trace's {trace_rate:.2f} req/s: {why}")
    cv = sample.interarrival_cv / sample.trace_interarrival_cv if sample.trace_interarrival_cv else math.nan
    if math.isfinite(cv) and not 1 / CV_WARN_RATIO <= cv <= CV_WARN_RATIO:
        out.append(f"the sample's inter-arrival CV is {sample.interarrival_cv:.2f}, the trace's "
                   f"{sample.trace_interarrival_cv:.2f}: its burstiness differs")
    return out


def drain_share(row: dict) -> float:
    """Share of a run's makespan after its last arrival (the queue draining with nothing arriving)."""
    rate, n, makespan = row.get("offered_rate_req_s"), row.get("num_requests"), row.get("makespan_s")
    if _is_missing(rate) or _is_missing(makespan) or not n or not makespan or not rate > 0:
        return math.nan
    return max(0.0, 1.0 - (n - 1) / rate / makespan)


def result_warnings(result: CapacityResult, max_evals: int | None = None) -> list[str]:
    """A search that hit its limit, or an answer whose latencies come from draining a queue."""
    out = []
    if not result.feasible and result.curve is not None and len(result.curve):
        out.append(_infeasible_warning(result, max_evals))
    if result.feasible and not result.bounded:
        out.append("the search limit was reached before any point failed the SLO: the answer is a lower bound "
                   "(raise --max-evals / --max-replicas, or the load)")
    elif result.feasible and result.mode == "rate" and result.curve is not None and max_evals is not None \
            and len(result.curve) >= max_evals:
        failing = result.curve.loc[~result.curve["meets_slo"], "searched_value"]
        out.append(f"the search stopped after {max_evals} simulations with the bracket "
                   f"[{result.answer:g}, {failing.min():g}] still open")
    if result.feasible and result.answer_run_id is not None:
        row = result.curve.set_index("run_id").loc[result.answer_run_id].to_dict()
        rejected = int(row.get("num_rejected") or 0)
        if rejected:
            out.append(f"{rejected:,} of {int(row['num_requests']):,} requests were rejected at the answer ({REJECTED}); "
                       "they are in no latency and no goodput: the answer is for the others only")
        share = drain_share(row)
        if share > DRAIN_WARN_SHARE:
            out.append(f"drain-dominated: {share:.0%} of the answer's run is spent after the last arrival; its "
                       f"latencies describe a queue emptying, not steady load: use a longer window")
    return out


REJECTED = ("they can never fit: prompt + output above max_model_len, or more KV blocks than the pool holds; "
            "`kvsim simulate` with the same options gives each one's reject_reason")


def _infeasible_warning(result: CapacityResult, max_evals: int | None) -> str:
    """Why no point met the SLO: the search's last point (the lowest rate, the most replicas) and what it
    violated, and whether the search stopped at its limit or on a configuration that cannot meet it."""
    rate = result.mode == "rate"
    last = result.curve.iloc[0] if rate else result.curve.iloc[-1]
    value, why = last["searched_value"], last.get("violations", "")
    if not last.get("num_finished") and last.get("num_rejected"):
        return (f"every request was rejected ({REJECTED}), at {result.mode} {value:g} as at every point: the "
                "workload does not fit this configuration")
    stopped = max_evals is not None and len(result.curve) >= max_evals
    if rate:
        head = f"no rate scale down to {value:g} ({last['offered_rate_req_s']:.3g} req/s offered) meets the SLO: {why}"
        tail = (f"; the search stopped after {max_evals} simulations" if stopped else
                "; nearly unloaded, this configuration's latency is above the SLO: loosen it, or give a faster "
                "GPU, a higher TP degree or a smaller model")
    else:
        head = f"no replica count up to {value:g} meets the SLO: {why}"
        tail = (f"; the search stopped after {max_evals} simulations" if stopped else
                "; raise --max-replicas if more replicas keep lowering the latency")
    return head + tail


# ---- error bars: other samples, and the GPU profile's measured error -----------------------------

@dataclass(frozen=True)
class FitError:
    mape: float       # mean absolute percentage error of step times (0.04 = 4%)
    bias: float       # mean signed error (predicted - measured) / measured
    count: int | None


def measured_profile_error(profile: str, gpu: str | None = None) -> FitError | None:
    """The step-time error the profile of `profile` (and `gpu`, for `auto`) measured when it was fitted
    (`meta.fit_errors`, read by cost_model.profile_fit_error), or None when it carries none (a hand-set
    profile) or cannot be loaded."""
    from ..model.cost_model import ProfileError, load_profile, profile_fit_error

    try:
        loaded = load_profile(profile, gpu=gpu)
    except (ProfileError, ValueError, OSError):
        return None
    mape = profile_fit_error(loaded)
    if mape is None:
        return None
    errors = loaded.meta.get("fit_errors") or {}
    entry = next((errors[k] for k in ("step", "all") if isinstance(errors.get(k), dict)), {})
    try:
        return FitError(mape, float(entry.get("bias", 0.0)), int(entry["count"]) if "count" in entry else None)
    except (TypeError, ValueError):
        return FitError(mape, 0.0, None)


@dataclass
class CapacityRange:
    answer: float
    low: float
    high: float
    samples: dict[str, float | None]          # other load samples (windows, seeds) -> answer
    profile_band: dict[str, float | None]     # 'steps x0.96' -> answer; empty without a fit error
    notes: list[str] = field(default_factory=list)
    # the answer with deterministic steps, when the search ran with step-time variance (sim/engine/step_noise.py):
    # {sigma, deterministic_answer, moved: (answer - deterministic) / deterministic}
    variance: dict | None = None

    def text(self, fmt: str = "{:g}") -> str:
        return f"{fmt.format(self.answer)} (range {fmt.format(self.low)}-{fmt.format(self.high)})"


def variant_configs(cfg: SimConfig, sample: LoadSample, repeats: int, trace=None) -> tuple[dict[str, SimConfig], list[str]]:
    """Other samples of the same load, for the spread of the answer: the next busiest windows of the
    same length for a peak window, other arrival seeds for a trace whose arrivals are drawn; none for
    a fixed sample of fixed arrivals (said in the notes)."""
    from kvsim.traces.windows import resolve_window

    notes, out = [], {}
    if repeats <= 1:
        return out, notes
    opts = cfg.trace_options
    if opts.rate is not None or opts.request_rate is not None:
        for seed in range(cfg.seed + 1, cfg.seed + repeats):
            out[f"arrival seed {seed}"] = cfg.model_copy(update={"seed": seed})
        return out, notes
    if "@peak" in sample.window:
        spec = sample.window.split(" ")[0]
        base = spec.split("@peak")[0]
        trace = unwindowed_trace(cfg) if trace is None else trace
        for k in range(2, repeats + 1):
            try:
                w = resolve_window(trace, f"{base}@peak{k}")
            except Exception as exc:  # noqa: BLE001 - the trace has fewer windows: say so
                notes.append(str(exc))
                break
            out[f"{base}@peak{k}"] = cfg.model_copy(update={"trace_options": opts.model_copy(
                update={"start_s": w.start_s, "end_s": w.end_s})})
        return {k: SimConfig.model_validate(v.model_dump()) for k, v in out.items()}, notes
    notes.append(f"no resampled range: the sample ({sample.window}) has fixed arrivals; use --window DUR@peak "
                 "for a range over the busiest windows")
    return out, notes


def profile_configs(cfg: SimConfig) -> tuple[dict[str, SimConfig], list[str]]:
    """`cfg` with every step time x (1 - mape) and x (1 + mape) of its profile's measured fit error."""
    err = measured_profile_error(cfg.profile, cfg.gpu)
    if err is None:
        return {}, [f"no profile band: profile {cfg.profile!r} carries no measured fit error (meta.fit_errors)"]
    out = {}
    for factor in (1 - err.mape, 1 + err.mape):
        out[f"step times x{factor:.3g}"] = SimConfig.model_validate(
            cfg.model_copy(update={"profile": f"{cfg.profile}*{factor:.6g}"}).model_dump())
    return out, [f"profile band: step times x(1 +/- {err.mape:.3g}), the profile's measured step-time MAPE "
                 f"(bias {err.bias:+.3g})"]


class RangeVariants(NamedTuple):
    """Which other versions of a capacity answer's config `capacity_range` searches again."""
    repeats: int = 3        # load samples in all (the answer's and repeats - 1 others: busy windows, seeds)
    band: bool = True       # also the profile's measured error band (step times x (1 -/+ MAPE))


def capacity_range(cfg: SimConfig, constraints: list[Constraint], result: CapacityResult, sample: LoadSample,
                   search: CapacitySearch = CapacitySearch(), variants: RangeVariants = RangeVariants(), *,
                   store: str | Path | None = None,
                   progress: Callable[[str, dict], None] | None = None) -> CapacityRange | None:
    """The answer's range over other load samples and the profile's error band, each searched again
    from the answer (so a narrow bracket is reached in a few simulations) with `search`'s mode and limits."""
    if not result.feasible:
        return None
    samples, notes = variant_configs(cfg, sample, variants.repeats)
    profiles, more = profile_configs(cfg) if variants.band else ({}, ["no profile band (--no-band)"])
    notes += more
    rate = search.mode == "rate"
    again = replace(search, start=result.answer if rate else cfg.trace_options.rate_scale, growth=1.25,
                    start_replicas=1 if rate else int(result.answer))

    def research(label: str, c: SimConfig) -> float | None:
        r = find_capacity(c, constraints, again, store=store, write_result=False,
                          progress=(lambda row: progress(label, row)) if progress else None)
        return r.answer

    got_samples = {k: research(k, c) for k, c in samples.items()}
    got_band = {k: research(k, c) for k, c in profiles.items()}
    variance = None
    sigma = resolve_sigma(cfg.step_variance, get_gpu(cfg.gpu).name)
    if sigma > 0:
        plain = research("deterministic steps", SimConfig.model_validate(
            cfg.model_copy(update={"step_variance": 0.0}).model_dump()))
        variance = {"sigma": sigma, "setting": cfg.step_variance, "deterministic_answer": plain,
                    "moved": (result.answer - plain) / plain if plain else None}
    else:
        notes.append("deterministic steps (step_variance 0): the answer's move under step-time variance was "
                     "not measured (--step-variance auto measures it)")
    values = [result.answer] + [v for v in (*got_samples.values(), *got_band.values()) if v is not None]
    infeasible = [k for k, v in (*got_samples.items(), *got_band.items()) if v is None]
    if infeasible:
        notes.append(f"no point met the SLO for: {', '.join(infeasible)}")
    spread = CapacityRange(result.answer, min(values), max(values), got_samples, got_band, notes, variance)
    if store is not None:
        _write_range(Path(store), spread, sample)
    return spread


def _write_range(store: Path, spread: CapacityRange, sample: LoadSample) -> None:
    """Add the range and the load sample it is for to the store's capacity.json (what the command
    prints, for a script to read)."""
    path = store / "capacity.json"
    data = json.loads(path.read_text())
    data["range"] = asdict(spread)
    data["load_sample"] = {**asdict(sample), "description": sample.describe()}
    with atomic_output(path) as tmp:
        tmp.write_text(dumps_json(data, indent=2, default=_json_default))
