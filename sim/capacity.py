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
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Literal

import pandas as pd

from .config import ConfigError, SimConfig, parse_duration
from .results import holding_store_lock, mark_owned
from .safe_io import atomic_output, dumps_json
from .sweep import PlannedRun, RunTask, execute_run, finished_runs, make_row, read_store, run_id_of, write_row

LATENCY_METRICS = [f"{m}_{q}" for m in ("ttft", "tpot", "e2e", "queueing") for q in ("p50", "p90", "p99", "mean")]
LATENCY_METRICS += [f"itl_{q}" for q in ("p50", "p90", "p99")]
PLAIN_METRICS = ["slo_attainment", "goodput_req_s", "throughput_req_s", "throughput_output_tok_s",
                 "kv_util_mean", "kv_util_max", "fragmentation_mean", "fragmentation_p99",
                 "preemption_rate", "num_rejected", "usd_per_m_output_tok"]
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
            constraints.append(Constraint(f"{name}_s", op, parse_duration(raw, f"--slo {name}"), part))
        elif name in PLAIN_METRICS:
            try:
                limit = float(raw)
            except ValueError:
                raise ConfigError(f"--slo: {part!r}: {name} takes a plain number, got {raw!r}") from None
            constraints.append(Constraint(name, op, limit, part))
        else:
            raise ConfigError(f"--slo: unknown metric {name!r} in {part!r}; latency metrics (with a unit): "
                              f"{', '.join(LATENCY_METRICS)}; others: {', '.join(PLAIN_METRICS)}")
    if not constraints:
        raise ConfigError("--slo: no constraint given (e.g. \"ttft_p99<=2s,tpot_p99<=100ms\")")
    return constraints


def slo_for_goodput(cfg: SimConfig, constraints: list[Constraint]) -> SimConfig:
    """Use the SLO's TTFT/TPOT limits as the per-request thresholds behind goodput."""
    update = {}
    for c in constraints:
        kind = c.metric.split("_")[0]
        if kind in ("ttft", "tpot") and c.op in ("<=", "<"):
            update[kind] = f"{c.limit * 1e3:g}ms"
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
        row["meets_slo"] = all(c.holds(row) for c in self.constraints)
        row["violations"] = "; ".join(f"{c.text} (got {_fmt(row.get(c.metric), c)})"
                                      for c in self.constraints if not c.holds(row))
        row["searched_value"] = value
        self.rows[rid] = row
        if self.progress:
            self.progress(row)
        return row


def _is_missing(v) -> bool:
    return v is None or (isinstance(v, float) and math.isnan(v))


def _fmt(value, c: Constraint) -> str:
    if _is_missing(value):
        return "n/a"
    return f"{value * 1e3:.1f}ms" if c.metric.endswith("_s") else f"{value:.4g}"


@holding_store_lock
def find_capacity(cfg: SimConfig, constraints: list[Constraint], *, mode: Literal["rate", "replicas"] = "rate",
                  start: float = 1.0, growth: float = 2.0, rel_tol: float = 0.02, max_evals: int = 24,
                  min_scale: float = 1 / 1024, max_scale: float = 1024.0, max_replicas: int = 64,
                  store: str | Path | None = None, progress: Callable[[dict], None] | None = None) -> CapacityResult:
    """mode='rate': highest trace_options.rate_scale meeting the SLO, within rel_tol.
    mode='replicas': fewest replicas meeting it for the trace at its configured rate."""
    if mode not in ("rate", "replicas"):
        raise ConfigError(f"capacity mode must be 'rate' or 'replicas', got {mode!r}")
    cfg = slo_for_goodput(cfg, constraints)
    store = Path(store) if store else None
    evaluate = _Evaluator(constraints, store, progress)
    if mode == "rate":
        search = _search_rate(cfg, evaluate, start, growth, rel_tol, max_evals, min_scale, max_scale)
    else:
        search = _search_replicas(cfg, evaluate, max_replicas)
    lo, hi = search
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
    if store:
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


def _search_rate(cfg, evaluate, start, growth, rel_tol, max_evals, min_scale, max_scale):
    """(highest passing scale or None, lowest failing scale or None)."""
    lo = hi = None
    x = start
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


def _search_replicas(cfg, evaluate, max_replicas):
    """(fewest passing replica count or None, highest failing count or None)."""
    lo_fail, hi_ok = None, None
    n = 1
    while True:
        if _meets(cfg, evaluate, "replicas", n):
            hi_ok = n
            break
        lo_fail = n
        if n >= max_replicas:
            return None, lo_fail
        n = min(n * 2, max_replicas)
    while lo_fail is not None and hi_ok - lo_fail > 1:
        mid = (lo_fail + hi_ok) // 2
        if _meets(cfg, evaluate, "replicas", mid):
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
    path = Path(store) / "capacity.json"
    return json.loads(path.read_text()) if path.exists() else None
