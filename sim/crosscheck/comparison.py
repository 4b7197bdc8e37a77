"""Cross-check comparison: a run's measured step times, latencies, throughput and memory against a prediction.

Also what the calibration shares with it (so `kvsim.sim.calibration` builds on this module, never the
reverse): the cost model's input for every row of a step log (`shape_of_steps`), the prefill / decode /
mixed classification of steps (`step_kind`), the relative error of predicted step times per kind
(`fit_errors`), and the step-by-step schedule check (`first_divergence`).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from kvsim.sim.core.step import BatchShape
from kvsim.sim.model.cost_model import CostModel
from kvsim.sim.io.safe_io import restore_nan

LATENCY_METRICS = ("ttft", "tpot", "e2e")
PERCENTILES = (50, 90, 99)
THROUGHPUT_METRICS = ("throughput_req_s", "throughput_output_tok_s", "throughput_total_tok_s")
# Step-log columns that must be identical in recorded mode (the schedule and the memory state).
MEMORY_COLUMNS = ("batch_size", "prefill_tokens", "decode_tokens", "blocks_used", "blocks_free",
                  "live_slots", "allocated_slots", "fragmentation", "preemptions", "finished",
                  "evicted_tokens", "blocks_freed_by_eviction", "bytes_moved", "num_running", "num_waiting")

# BatchShape fields the engine's step log does not carry: for a replay directory they are recomputed
# by simulating the replay in recorded mode, which schedules the very same batches.
SHAPE_COLUMNS = ("kv_tokens_padded", "attn_pairs_prefill_padded")
STEP_KINDS = ("prefill", "decode", "mixed")


class CrosscheckError(ValueError):
    """Missing or inconsistent run outputs; the message names the directory and file."""


@dataclass
class Run:
    """Outputs of one run (replay or simulation): requests, steps, summary."""
    name: str
    requests: pd.DataFrame
    steps: pd.DataFrame
    summary: dict
    shapes: pd.DataFrame | None = None     # per step: BatchShape fields the step log lacks (recorded sim)

    @classmethod
    def load(cls, directory: str | Path, name: str | None = None) -> "Run":
        d = Path(directory)
        files = {f: d / f for f in ("requests.parquet", "steps.parquet", "summary.json")}
        missing = [f for f, p in files.items() if not p.is_file()]
        if missing:
            raise CrosscheckError(f"{d}: missing {', '.join(missing)} (expected the output directory of "
                                  f"`kvsim replay` or `kvsim simulate`)")
        return cls(name or d.name, pd.read_parquet(files["requests.parquet"]), pd.read_parquet(files["steps.parquet"]),
                   restore_nan(json.loads(files["summary.json"].read_text())))


@dataclass
class CrosscheckResult:
    step_errors: dict[str, dict[str, float]]          # per step kind: MAPE etc. (replay steps)
    step_times: pd.DataFrame                          # per replay step: time_s, kind, measured, predicted
    latency: pd.DataFrame                             # metric, percentile, real, sim, rel_error
    throughput: pd.DataFrame                          # metric, real, sim, rel_error
    memory: pd.DataFrame                              # metric, real, predicted-sim[, recorded-sim]
    recorded: dict | None = None                      # identical / first divergence (recorded mode)
    context: dict = field(default_factory=dict)       # trace, profile, options, loadavg, ...
    series: dict[str, pd.DataFrame] = field(default_factory=dict)   # memory over time per run
    repeats: dict | None = None                       # N > 1 replays: spread, single-replay figures
    repeat_steps: pd.DataFrame | None = None          # N > 1: every replay's duration per step, median, spread
    total_time: dict = field(default_factory=dict)    # step time summed: measured, cost model on the replay's
                                                      # batches, predicted simulation (its own batches)

    def headline(self) -> dict[str, float]:
        """The figures the acceptance bar is stated in."""
        lat = self.latency.set_index(["metric", "percentile"])["rel_error"]
        thr = self.throughput.set_index("metric")["rel_error"]
        return {"step_mape": float(self.step_errors["all"]["mape"]),
                "ttft_p50_error": abs(float(lat[("ttft", 50)])), "tpot_p50_error": abs(float(lat[("tpot", 50)])),
                "e2e_p50_error": abs(float(lat[("e2e", 50)])),
                "throughput_error": abs(float(thr["throughput_total_tok_s"])),
                "memory_identical": None if self.recorded is None else bool(self.recorded["identical"]),
                "repeats": 1 if self.repeats is None else int(self.repeats["n"])}


# ---- step logs: batch shapes, step kinds, relative errors ----------------------------------------
def shape_of_steps(df: pd.DataFrame) -> BatchShape:
    """The cost model's input for every row of a step log."""
    def col(name: str) -> np.ndarray:
        if name in df.columns:
            return df[name].to_numpy(dtype=np.float64)
        return np.zeros(len(df))
    padded = None
    if "kv_tokens_padded" in df.columns:      # NaN (not known for that step): priced as kv_tokens_read
        padded = df["kv_tokens_padded"].to_numpy(dtype=np.float64)
        padded = np.where(np.isnan(padded), col("kv_tokens_read"), padded)
    pairs_padded = None
    if "attn_pairs_prefill_padded" in df.columns:
        pairs_padded = df["attn_pairs_prefill_padded"].to_numpy(dtype=np.float64)
        pairs_padded = np.where(np.isnan(pairs_padded), col("attn_pairs_prefill"), pairs_padded)
    return BatchShape(num_seqs=col("batch_size"), num_prefill_tokens=col("prefill_tokens"),
                      num_decode_tokens=col("decode_tokens"), attn_pairs_prefill=col("attn_pairs_prefill"),
                      kv_tokens_read=col("kv_tokens_read"), bytes_moved=col("bytes_moved"),
                      swap_bytes=col("swap_bytes"), block_table_entries=col("block_table_entries"),
                      kv_tokens_padded=padded, attn_pairs_prefill_padded=pairs_padded)


def step_kind(df: pd.DataFrame) -> np.ndarray:
    """'prefill' (only prompt tokens), 'decode' (only decode tokens) or 'mixed', per row."""
    p = df["prefill_tokens"].to_numpy() > 0
    d = df["decode_tokens"].to_numpy() > 0
    return np.where(p & d, "mixed", np.where(p, "prefill", "decode"))


def fit_errors(measured: np.ndarray, predicted: np.ndarray, kinds: np.ndarray) -> dict[str, dict[str, float]]:
    """Relative error of predictions per step kind and overall."""
    out = {}
    for kind in (*STEP_KINDS, "all"):
        m = np.ones(len(measured), bool) if kind == "all" else kinds == kind
        if not m.any():
            continue
        rel = (predicted[m] - measured[m]) / measured[m]
        ape = np.abs(rel)
        out[kind] = {"count": int(m.sum()), "mape": float(ape.mean()), "median_ape": float(np.median(ape)),
                     "p90_ape": float(np.percentile(ape, 90)), "bias": float(np.median(rel))}
    return out


def with_shape_columns(steps: pd.DataFrame, shapes: pd.DataFrame, where: str) -> pd.DataFrame:
    """`steps` with the SHAPE_COLUMNS it lacks taken from `shapes` (one row per step, same order)."""
    missing = [c for c in SHAPE_COLUMNS if c not in steps.columns and c in shapes.columns]
    if not missing:
        return steps
    if len(shapes) != len(steps):
        raise CrosscheckError(f"{where}: the recorded simulation ran {len(shapes)} steps, the replay {len(steps)}; "
                              f"cannot take per-step shapes from it")
    return steps.assign(**{c: shapes[c].to_numpy() for c in missing})


# ---- comparisons ------------------------------------------------------------------------------
def step_time_table(steps: pd.DataFrame, cost: CostModel) -> pd.DataFrame:
    """Each replay step's measured time next to the cost model's prediction for its batch shape."""
    pred = np.atleast_1d(cost.predict(shape_of_steps(steps))) if len(steps) else np.zeros(0)
    return pd.DataFrame({"step": np.arange(len(steps)), "time_s": steps["time_s"].to_numpy(),
                         "kind": step_kind(steps), "batch_size": steps["batch_size"].to_numpy(),
                         "measured_s": steps["duration_s"].to_numpy(dtype=float), "predicted_s": pred})


def relative_error(sim: float, real: float) -> float:
    """(sim - real) / real; NaN when either is not finite or real is 0."""
    if not (math.isfinite(sim) and math.isfinite(real)) or real == 0:
        return math.nan
    return (sim - real) / real


def latency_table(real: pd.DataFrame, sim: pd.DataFrame) -> pd.DataFrame:
    rows = []
    for metric in LATENCY_METRICS:
        a = real.loc[real["status"] == "finished", f"{metric}_s"].dropna().to_numpy()
        b = sim.loc[sim["status"] == "finished", f"{metric}_s"].dropna().to_numpy()
        for q in PERCENTILES:
            r = float(np.percentile(a, q)) if a.size else math.nan
            s = float(np.percentile(b, q)) if b.size else math.nan
            rows.append({"metric": metric, "percentile": q, "real": r, "sim": s, "rel_error": relative_error(s, r)})
    return pd.DataFrame(rows)


def throughput_table(real: dict, sim: dict) -> pd.DataFrame:
    return pd.DataFrame([{"metric": m, "real": float(real.get(m, math.nan)), "sim": float(sim.get(m, math.nan)),
                          "rel_error": relative_error(float(sim.get(m, math.nan)), float(real.get(m, math.nan)))}
                         for m in THROUGHPUT_METRICS])


def memory_stats(steps: pd.DataFrame, requests: pd.DataFrame) -> dict[str, float]:
    if not len(steps):
        return {}
    return {
        "steps": float(len(steps)),
        "blocks_used_mean": float(steps["blocks_used"].mean()),
        "blocks_used_max": float(steps["blocks_used"].max()),
        "fragmentation_mean": float(steps["fragmentation"].mean()),
        "fragmentation_p99": float(np.percentile(steps["fragmentation"], 99)),
        "preemptions": float(steps["preemptions"].sum()),
        "evicted_tokens": float(steps["evicted_tokens"].sum()),
        "blocks_freed_by_eviction": float(steps["blocks_freed_by_eviction"].sum()),
        "batch_size_mean": float(steps["batch_size"].mean()),
        "requests_preempted": float((requests["preemptions"] > 0).sum()),
    }


def memory_table(runs: dict[str, Run]) -> pd.DataFrame:
    stats = {name: memory_stats(r.steps, r.requests) for name, r in runs.items()}
    metrics = list(next(iter(stats.values())))
    return pd.DataFrame({"metric": metrics, **{name: [s.get(m, math.nan) for m in metrics]
                                               for name, s in stats.items()}})


def _mismatches(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return ~np.isclose(a, b, rtol=0, atol=1e-12) if a.dtype.kind == "f" else a != b


def first_divergence(real: pd.DataFrame, sim: pd.DataFrame, columns=MEMORY_COLUMNS) -> dict:
    """Compare two step logs row by row on `columns`: identical, or where they first differ (the
    earliest step over all columns; on a tie, the first column in `columns`)."""
    cols = [c for c in columns if c in real.columns and c in sim.columns]
    n = min(len(real), len(sim))
    compared = {"steps_compared": n, "columns": cols}
    lengths = {"real_steps": len(real), "sim_steps": len(sim)}
    first_step = {}
    for c in cols:
        differ = _mismatches(real[c].to_numpy()[:n], sim[c].to_numpy()[:n])
        if differ.any():
            first_step[c] = int(np.argmax(differ))
    if first_step:
        c = min(first_step, key=first_step.get)
        i = first_step[c]
        first = {"step": i, "column": c, "real": real[c].to_numpy()[i].item(), "sim": sim[c].to_numpy()[i].item()}
        return {"identical": False, **compared, "first_divergence": first, **lengths}
    if len(real) != len(sim):
        return {"identical": False, **compared, **lengths,
                "first_divergence": {"step": n, "column": "(step count)", "real": len(real), "sim": len(sim)}}
    return {"identical": True, **compared, **lengths}


def compare(real: Run, predicted: Run, cost: CostModel, recorded: Run | None = None,
            context: dict | None = None, repeats: "Repeats | None" = None) -> CrosscheckResult:
    """Figures of `real` (one replay) against `predicted`; with `repeats` (N > 1 replays of the same
    workload, `recorded` fed their median step times), the measured side is `repeats.measured_run(recorded)`."""
    if len(real.steps) == 0:
        raise CrosscheckError(f"{real.name}: the replay ran no engine step (every request was rejected or none "
                              f"arrived; see reject_reason in its requests.parquet): nothing to compare")
    timings_identical = None
    if repeats is not None and repeats.n > 1:
        if recorded is None:
            raise CrosscheckError("repeated replays need the recorded simulation (fed the median step times) "
                                  "for the measured request timings")
        real = repeats.measured_run(recorded)
    elif recorded is not None:
        timings_identical = same_request_timings(real.requests, recorded.requests)
    steps = real.steps
    if recorded is not None and recorded.shapes is not None:
        steps = with_shape_columns(steps, recorded.shapes, f"{real.name} step log")
    times = step_time_table(steps, cost)
    runs = {"real": real, "sim": predicted}
    if recorded is not None:
        runs["sim_recorded"] = recorded
    series = {name: r.steps[["time_s", "blocks_used", "fragmentation", "num_running", "num_waiting",
                             "evicted_tokens", "preemptions"]].copy() for name, r in runs.items()}
    return CrosscheckResult(
        step_errors=fit_errors(times["measured_s"].to_numpy(), times["predicted_s"].to_numpy(),
                               times["kind"].to_numpy()),
        step_times=times,
        latency=latency_table(real.requests, predicted.requests),
        throughput=throughput_table(real.summary, predicted.summary),
        memory=memory_table(runs),
        recorded=None if recorded is None else {**first_divergence(real.steps, recorded.steps),
                                                 **recorded.summary.get("recorded_policy", {}),
                                                 **({} if timings_identical is None
                                                    else {"request_timings_identical": timings_identical})},
        context=dict(context or {}),
        series=series,
        repeats=None if repeats is None or repeats.n == 1 else repeats.table(cost, steps, predicted),
        repeat_steps=None if repeats is None or repeats.n == 1 else repeats.durations_frame(),
        total_time={"measured_s": float(times["measured_s"].sum()),
                    "model_on_replay_batches_s": float(times["predicted_s"].sum()),
                    "predicted_simulation_s": float(predicted.steps["duration_s"].sum())},
    )


TIMING_COLUMNS = ("arrival_s", "first_scheduled_s", "first_token_s", "finish_s", "ttft_s", "tpot_s", "e2e_s")


def same_request_timings(a: pd.DataFrame, b: pd.DataFrame) -> bool:
    """Whether two request tables hold the same requests with bit-identical timings."""
    if len(a) != len(b) or not np.array_equal(a["request_id"].to_numpy(), b["request_id"].to_numpy()):
        return False
    return all(np.array_equal(a[c].to_numpy(dtype=float), b[c].to_numpy(dtype=float), equal_nan=True)
               for c in TIMING_COLUMNS if c in a.columns and c in b.columns)

# ---- repeated replays -------------------------------------------------------------------------
# summary.json keys that follow from the step times (taken from the median-timed recorded simulation)
TIMING_SUMMARY_PREFIXES = ("makespan", "throughput_", "ttft_", "tpot_", "e2e_", "queueing_", "itl_", "slo_",
                           "goodput_")


@dataclass
class Repeats:
    """N replays of one workload with identical schedules; their measured step times side by side."""
    runs: list[Run]
    dirs: list[str]
    durations: np.ndarray            # [N, steps]

    @classmethod
    def of(cls, runs: list[Run], dirs: list[str | Path]) -> "Repeats":
        """Check that every replay scheduled the same batches with the same memory state as the first
        (MEMORY_COLUMNS, step by step) and collect their step durations."""
        if not runs:
            raise CrosscheckError("no replays given")
        first = runs[0].steps
        for run, d in zip(runs[1:], dirs[1:]):
            same = first_divergence(first, run.steps)
            if not same["identical"]:
                f = same["first_divergence"]
                raise CrosscheckError(
                    f"{d}: this repeat schedules differently from {dirs[0]} from step {f['step']} on "
                    f"({f['column']}: {f['real']} vs {f['sim']}); repeated replays must run the same batches "
                    f"to pair their step times (is the schedule sensitive to the measured times?)")
        durations = np.stack([r.steps["duration_s"].to_numpy(dtype=np.float64) for r in runs])
        return cls(list(runs), [str(d) for d in dirs], durations)

    @property
    def n(self) -> int:
        return len(self.runs)

    @property
    def median(self) -> np.ndarray:
        return np.median(self.durations, axis=0)

    def relative_spread(self) -> np.ndarray:
        """Per step: (slowest - fastest) / median over the repeats."""
        return (self.durations.max(axis=0) - self.durations.min(axis=0)) / self.median

    def measured_run(self, recorded: Run) -> Run:
        """The measured side of the comparison: the first replay's step log with the median step times,
        and the requests and timing metrics of `recorded` (the recorded simulation fed those medians)."""
        first = self.runs[0]
        if len(recorded.steps) != len(first.steps):
            raise CrosscheckError(f"recorded mode ran {len(recorded.steps)} steps, the replays {len(first.steps)}")
        steps = first.steps.assign(duration_s=self.median, time_s=recorded.steps["time_s"].to_numpy())
        summary = {**first.summary, **{k: v for k, v in recorded.summary.items()
                                       if k.startswith(TIMING_SUMMARY_PREFIXES)},
                   "measured_step_time_s": float(self.median.sum()), "repeats": self.n}
        return Run(f"real (median of {self.n})", recorded.requests, steps, summary, shapes=first.shapes)

    def table(self, cost: CostModel, steps: pd.DataFrame, predicted: Run) -> dict:
        """Spread over the repeats, and each single replay's own figures against the prediction."""
        spread = self.relative_spread()
        kinds = step_kind(steps)
        pred = np.atleast_1d(cost.predict(shape_of_steps(steps)))
        singles = []
        for run, d, dur in zip(self.runs, self.dirs, self.durations):
            lat = latency_table(run.requests, predicted.requests).set_index(["metric", "percentile"])["rel_error"]
            thr = throughput_table(run.summary, predicted.summary).set_index("metric")["rel_error"]
            singles.append({"replay": d, "loadavg_1m": run.summary.get("load_avg_1m", math.nan),
                            "measured_s": float(dur.sum()),
                            "shift_vs_median": float(np.median(dur / self.median) - 1),
                            "step_mape": float(np.mean(np.abs(pred - dur) / dur)),
                            "ttft_p50_error": abs(float(lat[("ttft", 50)])),
                            "tpot_p50_error": abs(float(lat[("tpot", 50)])),
                            "throughput_error": abs(float(thr["throughput_total_tok_s"]))})
        by_kind = {k: {"count": int((kinds == k).sum()), "median": float(np.median(spread[kinds == k])),
                       "p90": float(np.percentile(spread[kinds == k], 90))}
                   for k in ("prefill", "decode", "mixed") if (kinds == k).any()}
        return {"n": self.n, "spread_median": float(np.median(spread)), "spread_p90": float(np.percentile(spread, 90)),
                "spread_by_kind": by_kind, "singles": singles}

    def durations_frame(self) -> pd.DataFrame:
        kinds = step_kind(self.runs[0].steps)
        cols = {f"duration_{i + 1}_s": d for i, d in enumerate(self.durations)}
        return pd.DataFrame({"step": np.arange(self.durations.shape[1]), "kind": kinds, **cols,
                             "median_s": self.median, "relative_spread": self.relative_spread()})

