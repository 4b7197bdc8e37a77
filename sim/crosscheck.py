"""Cross-check: the simulator's prediction of a run against the real backend's replay of it.

Two simulations are compared with one replay (the same trace, engine and policy options):

- **predicted**: the simulator with a calibrated profile, advancing time by the cost model. Gives
  the latency and throughput errors (TTFT/TPOT/E2E percentiles, tokens/s). Per-step time error is
  measured on the replay's own steps (the same batch shapes): cost-model prediction vs measurement.
- **recorded**: the simulator advancing time by the replay's *measured* step durations (and, for
  eviction policies, fed the replay's recorded decisions when the policy supports it), so every
  step schedules the same batch. Memory metrics (blocks used/free, slots, fragmentation,
  preemptions, evictions) must then agree step by step; the report says so or shows the first
  divergence.

**Repeats.** One replay's step times scatter by 10-20% on a shared CPU. With N replays of the same
workload (the schedule is deterministic: same config, seed and workload; checked step by step on the
schedule and memory columns), each step's measured time is the median over the N replays, and the
measured latencies and throughput are those of the recorded simulation fed these medians: it
advances time by the same step durations as a replay, so with one replay it reproduces the replay's
request timings exactly (checked: `request_timings_identical`).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from .calibrate import SHAPE_COLUMNS, fit_errors, shape_of_steps, step_kind
from .cost_model import CostModel

LATENCY_METRICS = ("ttft", "tpot", "e2e")
PERCENTILES = (50, 90, 99)
THROUGHPUT_METRICS = ("throughput_req_s", "throughput_output_tok_s", "throughput_total_tok_s")
# Step-log columns that must be identical in recorded mode (the schedule and the memory state).
MEMORY_COLUMNS = ("batch_size", "prefill_tokens", "decode_tokens", "blocks_used", "blocks_free",
                  "live_slots", "allocated_slots", "fragmentation", "preemptions", "finished",
                  "evicted_tokens", "blocks_freed_by_eviction", "bytes_moved", "num_running", "num_waiting")


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
                   json.loads(files["summary.json"].read_text()))


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


# ---- comparisons ------------------------------------------------------------------------------
def step_time_table(steps: pd.DataFrame, cost: CostModel) -> pd.DataFrame:
    """Each replay step's measured time next to the cost model's prediction for its batch shape."""
    pred = np.atleast_1d(cost.predict(shape_of_steps(steps))) if len(steps) else np.zeros(0)
    return pd.DataFrame({"step": np.arange(len(steps)), "time_s": steps["time_s"].to_numpy(),
                         "kind": step_kind(steps), "batch_size": steps["batch_size"].to_numpy(),
                         "measured_s": steps["duration_s"].to_numpy(dtype=float), "predicted_s": pred})


def _rel(sim: float, real: float) -> float:
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
            rows.append({"metric": metric, "percentile": q, "real": r, "sim": s, "rel_error": _rel(s, r)})
    return pd.DataFrame(rows)


def throughput_table(real: dict, sim: dict) -> pd.DataFrame:
    return pd.DataFrame([{"metric": m, "real": float(real.get(m, math.nan)), "sim": float(sim.get(m, math.nan)),
                          "rel_error": _rel(float(sim.get(m, math.nan)), float(real.get(m, math.nan)))}
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


def first_divergence(real: pd.DataFrame, sim: pd.DataFrame, columns=MEMORY_COLUMNS) -> dict:
    """Compare two step logs row by row on `columns`: identical, or where they first differ."""
    cols = [c for c in columns if c in real.columns and c in sim.columns]
    n = min(len(real), len(sim))
    for c in cols:
        a, b = real[c].to_numpy()[:n], sim[c].to_numpy()[:n]
        same = np.isclose(a, b, rtol=0, atol=1e-12) if a.dtype.kind == "f" else a == b
        if not same.all():
            i = int(np.argmin(same))
            first = {"step": i, "column": c, "real": a[i].item(), "sim": b[i].item()}
            # the earliest step over all columns is the real first divergence
            for c2 in cols:
                a2, b2 = real[c2].to_numpy()[:i], sim[c2].to_numpy()[:i]
                s2 = np.isclose(a2, b2, rtol=0, atol=1e-12) if a2.dtype.kind == "f" else a2 == b2
                if not s2.all():
                    j = int(np.argmin(s2))
                    first = {"step": j, "column": c2, "real": a2[j].item(), "sim": b2[j].item()}
                    i = j
            return {"identical": False, "steps_compared": n, "columns": cols, "first_divergence": first,
                    "real_steps": len(real), "sim_steps": len(sim)}
    if len(real) != len(sim):
        return {"identical": False, "steps_compared": n, "columns": cols, "real_steps": len(real),
                "sim_steps": len(sim), "first_divergence": {"step": n, "column": "(step count)",
                                                            "real": len(real), "sim": len(sim)}}
    return {"identical": True, "steps_compared": n, "columns": cols, "real_steps": len(real), "sim_steps": len(sim)}


def compare(real: Run, predicted: Run, cost: CostModel, recorded: Run | None = None,
            context: dict | None = None, repeats: "Repeats | None" = None) -> CrosscheckResult:
    """Figures of `real` (one replay) against `predicted`; with `repeats` (N > 1 replays of the same
    workload, `recorded` fed their median step times), the measured side is `repeats.measured_run(recorded)`."""
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


def predicted_config(cfg, profile):
    """`cfg` for the predicted simulation. A profile that prices padded attention (`padded_attn_cost`
    > 0, the CPU backend) needs each step's widest block table, which the decode fast-forward does not
    compute yet: those runs step one by one."""
    if profile.padded_attn_cost > 0 and cfg.fast_forward:
        return cfg.model_copy(update={"fast_forward": False})
    return cfg


# ---- recorded-timing simulation ---------------------------------------------------------------
class MeasuredTimeExecutor:
    """Wraps a simulator executor: the step does everything the simulator does (policies, memory)
    but takes exactly the replay's measured duration of the same step."""

    supports_fast_forward = False

    def __init__(self, inner, durations: np.ndarray):
        self.inner = inner
        self.durations = np.asarray(durations, dtype=np.float64)
        self.step = 0
        self.shapes = []           # the BatchShape of every step, as the simulator priced it

    def execute(self, out):
        result = self.inner.execute(out)
        if self.step >= len(self.durations):
            raise CrosscheckError(f"recorded mode: the simulation needs more steps than the replay's "
                                  f"{len(self.durations)}; schedules diverged (see the memory comparison)")
        result.duration_s = float(self.durations[self.step])
        self.step += 1
        self.shapes.append(result.shape)
        return result

    def predict_run(self, shape):
        return self.inner.predict_run(shape)


def recorded_config(cfg, replay_dir: str | Path | None):
    """`cfg` for the recorded simulation: an evicting policy becomes `recorded`, replaying the decisions in
    `replay_dir` (same layout, slot strategy and trigger); score-free policies (none, streaming, quest)
    are deterministic and run as they are when no replay directory is given."""
    from .kv.policies.recorded import recorded_trigger
    from .kv.policy import get_policy
    from .kv.build import policy_params

    kv = cfg.kv
    policy = get_policy(kv.policy, **policy_params(kv))
    if not policy.evicts or kv.policy == "recorded":
        return cfg
    if replay_dir is None:
        if policy.needs_scores:
            raise CrosscheckError(f"recorded mode: kv.policy={kv.policy} decides from attention scores; give the "
                                  f"replay directory so its recorded decisions (decisions.parquet) are replayed")
        return cfg
    trigger = kv.trigger if kv.trigger != "policy" else policy.default_trigger
    try:
        recorded_from = recorded_trigger(replay_dir)
    except ValueError as exc:
        raise CrosscheckError(str(exc)) from None
    if recorded_from != trigger:
        raise CrosscheckError(f"{replay_dir}: the replay ran with trigger {recorded_from!r}, this config with "
                              f"{trigger!r} (kv.policy={kv.policy}, kv.trigger={kv.trigger})")
    new_kv = kv.model_copy(update={"policy": "recorded", "budget": None, "trigger": trigger,
                                   "params": {"path": str(replay_dir), "trigger": trigger}})
    return cfg.model_copy(update={"kv": new_kv})


def replay_model_spec(cfg, summary: dict):
    """The catalog spec of the model a replay really ran (its layers and dtype, from summary.json), as
    `gpu.replay.model_spec_for` priced it — so bytes moved are counted in the same units."""
    from .catalog import get_model, normalize_dtype

    base = get_model(cfg.model)
    layers = int(summary.get("model_layers", base.num_layers))
    dt = normalize_dtype(str(summary.get("dtype", base.kv_dtype)))
    return base.model_copy(update={
        "num_layers": layers, "weight_dtype": dt, "activation_dtype": dt, "kv_dtype": dt, "embedding_dtype": None,
        "name": base.name if layers == base.num_layers else f"{base.name} ({layers} layers)"})


def simulate_recorded(cfg, trace, measured_durations: np.ndarray, out_dir: str | Path | None = None,
                      replay_dir: str | Path | None = None) -> Run:
    """Simulate `trace` under `cfg` with the replay's measured step durations (see module doc). With
    `replay_dir` (the replay's output directory), the simulated model is the one the replay ran and an
    evicting policy replays the recorded decisions (`kv.policy=recorded`)."""
    from .simulate import run_simulation

    cfg = recorded_config(cfg, replay_dir).model_copy(update={"fast_forward": False})
    spec = None
    if replay_dir is not None:
        summary_file = Path(replay_dir) / "summary.json"
        if not summary_file.is_file():
            raise CrosscheckError(f"{replay_dir}: missing summary.json (expected a `kvsim replay` output directory)")
        cfg = cfg.model_copy(update={"kv_dtype": None})        # the replay's cache held the model's dtype
        spec = replay_model_spec(cfg, json.loads(summary_file.read_text()))
    built = {}

    def measured(kv, executor):
        built["kv"] = kv
        built["executor"] = MeasuredTimeExecutor(executor, measured_durations)
        return kv, built["executor"]

    result = run_simulation(cfg, out_dir, trace=trace, wrap_kv=measured, model=spec)
    summary = dict(result.summary)
    policy = getattr(built.get("kv"), "policy", None)
    if policy is not None and policy.name == "recorded":
        summary["recorded_policy"] = {"decisions": str(policy.path), "decisions_replayed": policy.replayed,
                                      "decisions_missing": policy.missing}
    shapes = built["executor"].shapes if "executor" in built else []
    columns = {c: np.asarray([np.nan if sh is None or getattr(sh, c) is None else float(getattr(sh, c))
                              for sh in shapes], dtype=np.float64) for c in SHAPE_COLUMNS}
    return Run("sim_recorded", result.requests, result.steps, summary, shapes=pd.DataFrame(columns))


def with_shape_columns(steps: pd.DataFrame, shapes: pd.DataFrame, where: str) -> pd.DataFrame:
    """`steps` with the SHAPE_COLUMNS it lacks taken from `shapes` (one row per step, same order)."""
    missing = [c for c in SHAPE_COLUMNS if c not in steps.columns and c in shapes.columns]
    if not missing:
        return steps
    if len(shapes) != len(steps):
        raise CrosscheckError(f"{where}: the recorded simulation ran {len(shapes)} steps, the replay {len(steps)}; "
                              f"cannot take per-step shapes from it")
    return steps.assign(**{c: shapes[c].to_numpy() for c in missing})


def trace_of_replay(requests: pd.DataFrame):
    """The workload a replay ran, rebuilt from its requests.parquet (arrivals, prompt and output
    lengths, request ids; rejected requests get one output token: they never run)."""
    from kvsim.traces.trace import Trace
    r = requests.sort_values(["arrival_s", "request_id"], kind="stable")
    return Trace.from_columns(arrival_time_s=r["arrival_s"].to_numpy(), prompt_tokens=r["prompt_tokens"].to_numpy(),
                              output_tokens=np.maximum(r["output_tokens"].to_numpy(), 1),
                              request_id=r["request_id"].to_numpy(), name="replay")


def replay_shape_columns(replay_dir: str | Path) -> pd.DataFrame:
    """SHAPE_COLUMNS for every step of a replay (`kvsim replay` output directory), by simulating it in
    recorded mode with its own config, workload (requests.parquet), decisions and measured step times.
    The schedule must come out identical to the replay's (checked), so the shapes are the replay's."""
    from .config import ConfigError, load_config
    d = Path(replay_dir)
    if not (d / "config.yaml").is_file():
        raise CrosscheckError(f"{d}: missing config.yaml (expected a `kvsim replay` output directory)")
    real = Run.load(d, "real")
    try:
        cfg = load_config(d / "config.yaml")
    except ConfigError as exc:
        raise CrosscheckError(f"{d / 'config.yaml'}: {exc}") from None
    rec = simulate_recorded(cfg, trace_of_replay(real.requests), real.steps["duration_s"].to_numpy(), None,
                            replay_dir=d)
    same = first_divergence(real.steps, rec.steps)
    if not same["identical"]:
        raise CrosscheckError(f"{d}: the recorded simulation does not reproduce the replay's schedule "
                              f"(first difference: {same['first_divergence']}); cannot recompute step shapes")
    return rec.shapes


# ---- report -----------------------------------------------------------------------------------
def _pct(v: float) -> str:
    return "n/a" if v is None or not math.isfinite(v) else f"{v:+.1%}"


def _num(v: float) -> str:
    if v is None or not math.isfinite(v):
        return "n/a"
    return f"{v:.4g}"


def markdown_report(res: CrosscheckResult) -> str:
    ctx = res.context
    h = res.headline()
    lines = [f"# kvsim cross-check: {ctx.get('trace', '')}", ""]
    if ctx:
        lines += ["| setting | value |", "|---|---|"]
        lines += [f"| {k} | {v} |" for k, v in ctx.items()]
        lines.append("")
    lines += ["## Headline", "",
              f"- per-step time MAPE: **{h['step_mape']:.1%}**",
              f"- TTFT p50 error: **{h['ttft_p50_error']:.1%}**, TPOT p50 error: **{h['tpot_p50_error']:.1%}**, "
              f"E2E p50 error: **{h['e2e_p50_error']:.1%}**",
              f"- throughput (total tok/s) error: **{h['throughput_error']:.1%}**"]
    if res.recorded is not None:
        r = res.recorded
        if r["identical"]:
            lines.append(f"- recorded mode: memory metrics **identical** over all {r['steps_compared']} steps "
                         f"({', '.join(r['columns'])})")
        else:
            d = r["first_divergence"]
            lines.append(f"- recorded mode: memory metrics **diverge** at step {d['step']}: {d['column']} "
                         f"real={d['real']} sim={d['sim']} (real {r['real_steps']} steps, sim {r['sim_steps']})")
        if "decisions" in r:
            lines.append(f"- recorded mode replayed {r['decisions_replayed']} recorded evictions from "
                         f"`{r['decisions']}` ({r['decisions_missing']} recorded entries not found live)")
        if "request_timings_identical" in r:
            lines.append(f"- recorded mode reproduces the replay's request timings (TTFT/TPOT/E2E): "
                         f"**{'identical' if r['request_timings_identical'] else 'NOT identical'}**")
    t = res.total_time
    if t:
        m = t["measured_s"]
        lines.append(f"- total step time: measured {m:.2f} s; cost model on the replay's own batches "
                     f"{t['model_on_replay_batches_s']:.2f} s ({_pct(_rel(t['model_on_replay_batches_s'], m))}); "
                     f"predicted simulation {t['predicted_simulation_s']:.2f} s "
                     f"({_pct(_rel(t['predicted_simulation_s'], m))}) — the difference between the last two is the "
                     f"simulation running other batches (its own policy decisions, block use: see Memory)")
    rep = res.repeats
    if rep is None:
        lines.append("- measured side: **1 replay** (step times of a single run; `--repeats N` takes the "
                     "per-step median of N)")
    else:
        lines.append(f"- measured side: **median of {rep['n']} replays** per step (identical schedules); "
                     f"relative spread (slowest - fastest) / median per step: median "
                     f"**{rep['spread_median']:.1%}**, p90 {rep['spread_p90']:.1%}; latencies and throughput "
                     f"from the recorded simulation fed the median step times")
    lines += ["", "## Per-step time (replay steps: cost model vs measured)", "",
              "| kind | steps | MAPE | median APE | p90 APE | median bias |", "|---|---:|---:|---:|---:|---:|"]
    for kind, e in res.step_errors.items():
        lines.append(f"| {kind} | {e['count']} | {e['mape']:.1%} | {e['median_ape']:.1%} | {e['p90_ape']:.1%} "
                     f"| {e['bias']:+.1%} |")
    if rep is not None:
        lines += ["", f"## Repeats ({rep['n']} replays)", "",
                  "| kind | steps | median spread | p90 spread |", "|---|---:|---:|---:|"]
        for kind, e in rep["spread_by_kind"].items():
            lines.append(f"| {kind} | {e['count']} | {e['median']:.1%} | {e['p90']:.1%} |")
        lines += ["", "Each replay alone against the prediction (what a single replay would have reported):", "",
                  "| replay | load avg 1m | measured step time (s) | shift vs median | step MAPE | TTFT p50 err "
                  "| TPOT p50 err | throughput err |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
        for r in rep["singles"]:
            lines.append(f"| `{r['replay']}` | {_num(r['loadavg_1m'])} | {r['measured_s']:.2f} | "
                         f"{r['shift_vs_median']:+.1%} | {r['step_mape']:.1%} | {r['ttft_p50_error']:.1%} | "
                         f"{r['tpot_p50_error']:.1%} | {r['throughput_error']:.1%} |")
    lines += ["", "## Latency (finished requests)", "", "| metric | pct | real (s) | sim (s) | error |",
              "|---|---:|---:|---:|---:|"]
    for row in res.latency.itertuples():
        lines.append(f"| {row.metric} | p{row.percentile} | {_num(row.real)} | {_num(row.sim)} | {_pct(row.rel_error)} |")
    lines += ["", "## Throughput", "", "| metric | real | sim | error |", "|---|---:|---:|---:|"]
    for row in res.throughput.itertuples():
        lines.append(f"| {row.metric} | {_num(row.real)} | {_num(row.sim)} | {_pct(row.rel_error)} |")
    names = [c for c in res.memory.columns if c != "metric"]
    lines += ["", "## Memory", "", "| metric | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    for _, row in res.memory.iterrows():
        lines.append(f"| {row['metric']} | " + " | ".join(_num(row[n]) for n in names) + " |")
    lines += ["", "Charts: `report.html`.", ""]
    return "\n".join(lines)


def html_report(res: CrosscheckResult) -> str:
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    t = res.step_times
    figs = []
    scatter = go.Figure()
    for kind in ("prefill", "decode", "mixed"):
        m = t[t["kind"] == kind]
        if len(m):
            scatter.add_trace(go.Scattergl(x=m["measured_s"] * 1e3, y=m["predicted_s"] * 1e3, mode="markers",
                                           name=kind, marker={"size": 4, "opacity": 0.6}))
    hi = float(max(t["measured_s"].max(), t["predicted_s"].max()) * 1e3) if len(t) else 1.0
    scatter.add_trace(go.Scatter(x=[0, hi], y=[0, hi], mode="lines", name="y = x", line={"dash": "dash", "color": "gray"}))
    scatter.update_layout(title="Per-step time: predicted vs measured (replay steps)",
                          xaxis_title="measured (ms)", yaxis_title="predicted (ms)")
    figs.append(scatter)

    over = go.Figure()
    if res.repeat_steps is not None:
        reps = res.repeat_steps.filter(like="duration_")
        over.add_trace(go.Scattergl(x=t["time_s"], y=reps.min(axis=1) * 1e3, mode="lines", name="fastest repeat",
                                    line={"width": 0.5, "color": "lightgray"}))
        over.add_trace(go.Scattergl(x=t["time_s"], y=reps.max(axis=1) * 1e3, mode="lines", name="slowest repeat",
                                    line={"width": 0.5, "color": "gray"}))
    over.add_trace(go.Scattergl(x=t["time_s"], y=t["measured_s"] * 1e3, mode="lines",
                                name="measured" if res.repeat_steps is None else "measured (median)"))
    over.add_trace(go.Scattergl(x=t["time_s"], y=t["predicted_s"] * 1e3, mode="lines", name="predicted"))
    over.update_layout(title="Per-step time over the replay", xaxis_title="replay time (s)", yaxis_title="step time (ms)")
    figs.append(over)

    lat = make_subplots(rows=1, cols=len(LATENCY_METRICS), subplot_titles=[m.upper() for m in LATENCY_METRICS])
    for i, metric in enumerate(LATENCY_METRICS, start=1):
        d = res.latency[res.latency["metric"] == metric]
        labels = [f"p{q}" for q in d["percentile"]]
        lat.add_trace(go.Bar(x=labels, y=d["real"], name="real", marker_color="#1f77b4", showlegend=i == 1), 1, i)
        lat.add_trace(go.Bar(x=labels, y=d["sim"], name="sim", marker_color="#ff7f0e", showlegend=i == 1), 1, i)
    lat.update_layout(title="Latency percentiles (s): real vs simulated", barmode="group")
    figs.append(lat)

    mem = make_subplots(rows=2, cols=1, shared_xaxes=True, subplot_titles=["blocks used", "fragmentation"])
    for name, s in res.series.items():
        mem.add_trace(go.Scattergl(x=s["time_s"], y=s["blocks_used"], mode="lines", name=name, legendgroup=name), 1, 1)
        mem.add_trace(go.Scattergl(x=s["time_s"], y=s["fragmentation"], mode="lines", name=name, legendgroup=name,
                                   showlegend=False), 2, 1)
    mem.update_layout(title="Memory over time", xaxis2_title="time (s)")
    figs.append(mem)

    body = "\n".join(f.to_html(full_html=False, include_plotlyjs="cdn" if i == 0 else False)
                     for i, f in enumerate(figs))
    import html as html_mod
    md = html_mod.escape(markdown_report(res))
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>kvsim cross-check</title></head>"
            f"<body style='font-family:sans-serif;max-width:1100px;margin:auto'>{body}"
            f"<h2>Figures</h2><pre>{md}</pre></body></html>")


def write_report(res: CrosscheckResult, out_dir: str | Path) -> tuple[Path, Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    md, html = out / "report.md", out / "report.html"
    md.write_text(markdown_report(res))
    html.write_text(html_report(res))
    (out / "crosscheck.json").write_text(json.dumps({
        "headline": res.headline(), "step_errors": res.step_errors, "recorded": res.recorded,
        "latency": res.latency.to_dict("records"), "throughput": res.throughput.to_dict("records"),
        "memory": res.memory.to_dict("records"), "context": res.context, "repeats": res.repeats,
        "total_time": res.total_time},
        indent=2, default=str))
    res.step_times.to_parquet(out / "step_times.parquet", index=False)
    if res.repeat_steps is not None:
        res.repeat_steps.to_parquet(out / "repeat_steps.parquet", index=False)
    return md, html
