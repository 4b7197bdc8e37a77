"""Published measurements of real vLLM on real GPUs, simulated as they were run.

The validation set lives in `tests/data/published_runs/runs.yaml` (setup, source, measured figures);
`compare_published(path)` simulates every point of every run and returns kvsim's figure beside the
measured one. `kvsim`'s test suite pins each error (tests/test_published_runs.py) and
`bench/bench_published_runs.py` prints the table (docs/gpu-profiles.md, docs/results.md).

Kinds of run:
- `serve`: `vllm bench serve` with a fixed-length random dataset, as the client measures (the
  profile's client terms on), at each `max_concurrency` (closed loop) or `request_rate` point;
  `seeds` > 1 averages the figures over that many arrival seeds, as the source did.
- `latency`: `vllm bench latency`: `batch_size` requests at once, engine only; the batch's latency.
- `kernels`: GPU kernel time of one step (Vidur's per-operator rows summed over a model's layers)
  against the cost model's device time for the same step (no CPU overhead, no LM head).
"""
from __future__ import annotations

import math
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import yaml

from kvsim.sim.calibration.errors import CalibrationError

METRICS = {     # measured figure -> (summary key, scale to the figure's unit)
    "itl_p50_ms": ("itl_p50_s", 1e3), "ttft_p50_ms": ("ttft_p50_s", 1e3), "ttft_mean_ms": ("ttft_mean_s", 1e3),
    "tpot_mean_ms": ("tpot_mean_s", 1e3), "tpot_p50_ms": ("tpot_p50_s", 1e3),
    "output_tok_s": ("throughput_output_tok_s", 1.0), "request_throughput": ("throughput_req_s", 1.0),
    "batch_latency_ms": ("makespan_s", 1e3),
    # the tails (vllm bench serve's median / p95 / p99 keys; p95 from the summary's vLLM-named keys)
    "ttft_p99_ms": ("ttft_p99_s", 1e3), "tpot_p99_ms": ("tpot_p99_s", 1e3), "e2e_p50_ms": ("e2e_p50_s", 1e3),
    "e2e_p99_ms": ("e2e_p99_s", 1e3), "ttft_p95_ms": ("p95_ttft_ms", 1.0), "e2e_p95_ms": ("p95_e2el_ms", 1.0),
    # the spread over requests (vllm bench serve's std_ttft_ms): what bench/fit_frontend_jitter.py fits
    "ttft_std_ms": ("std_ttft_ms", 1.0),
}
# a latency figure's distribution in kvsim's summary (seconds): mean, p50, p90, p99
SPREAD = {name: tuple(f"{name}_{q}_s" for q in ("mean", "p50", "p90", "p99")) for name in ("ttft", "tpot", "e2e")}
SPREAD["itl"] = ("mean_itl_ms", "itl_p50_s", "itl_p90_s", "itl_p99_s")      # vLLM's mean key is in ms


@dataclass(frozen=True)
class PublishedRun:
    id: str
    source: str
    kind: str
    setup: dict
    workload: dict
    points: dict           # one key -> its values
    measured: dict         # figure -> one value per point


@dataclass(frozen=True)
class Comparison:
    run: str
    point: str
    figure: str
    measured: float
    predicted: float
    spread: tuple | None = None      # kvsim's mean, p50, p90, p99 of the figure's latency (its unit)

    @property
    def error(self) -> float:
        """Relative error of kvsim's figure, (predicted - measured) / measured."""
        return (self.predicted - self.measured) / self.measured


def load_published_runs(path: str | Path) -> list[PublishedRun]:
    path = Path(path)
    data = yaml.safe_load(path.read_text())
    runs = []
    for i, entry in enumerate(data.get("runs", [])):
        try:
            run = PublishedRun(id=entry["id"], source=entry["source"], kind=entry["kind"], setup=entry["setup"],
                               workload=entry.get("workload") or {}, points=entry["points"],
                               measured=entry.get("measured") or {})
        except KeyError as exc:
            raise CalibrationError(f"{path}: run {i + 1}: missing key {exc}") from exc
        if run.kind not in ("serve", "latency", "kernels") or len(run.points) != 1:
            raise CalibrationError(f"{path}: run {run.id}: kind must be serve | latency | kernels with one points key")
        runs.append(run)
    return runs


def compare_published(path: str | Path, only: str | None = None, step_variance: float | str = 0.0,
                      frontend: str | None = None, frontend_jitter: float | str = 0.0) -> list[Comparison]:
    out = []
    for run in load_published_runs(path):
        if only is None or run.id == only:
            out.extend(compare_run(run, step_variance=step_variance, frontend=frontend,
                                   frontend_jitter=frontend_jitter))
    return out


def compare_run(run: PublishedRun, profile: str = "auto", step_variance: float | str = 0.0,
                frontend: str | None = None, frontend_jitter: float | str = 0.0) -> list[Comparison]:
    """kvsim's figure beside each measured one of `run` (under `profile`: the GPU's own by default;
    `step_variance`: the simulation's, sim/engine/step_noise.py; `frontend`: a serve run's frontend,
    sim/data/frontends.yaml, by default the profile's client terms; `frontend_jitter`: its per-request
    variation, sim/simulator/client.py, on serve runs)."""
    if run.kind == "kernels":
        return _kernel_comparisons(run)
    (key, values), = run.points.items()
    out = []
    with tempfile.TemporaryDirectory(prefix="kvsim-published-") as tmp:
        for i, value in enumerate(values):
            seeds = int(run.workload.get("seeds", 1))
            summaries = [_simulate_point(run, key, value, seed, Path(tmp), profile,
                                         (step_variance, frontend, frontend_jitter))
                         for seed in range(seeds)]
            for figure, measured in run.measured.items():
                summary_key, scale = METRICS[figure]
                predicted = float(np.mean([s[summary_key] for s in summaries])) * scale
                out.append(Comparison(run.id, f"{key}={value}", figure, float(measured[i]), predicted,
                                      _spread(figure, summaries, scale)))
    return out


def _spread(figure: str, summaries: list[dict], scale: float) -> tuple | None:
    """kvsim's mean, p50, p90 and p99 of a latency figure's metric, averaged over the seeds, in ms (a
    figure read from a vLLM-named key in ms, ttft_p95_ms, has scale 1 while the spread's keys are in s)."""
    keys = SPREAD.get(figure.split("_")[0])
    if keys is None or figure.endswith("_std_ms"):
        return None
    return tuple(float(np.mean([s[k] for s in summaries])) * (1.0 if k.endswith("_ms") else 1e3) for k in keys)


def _simulate_point(run: PublishedRun, key: str, value, seed: int, tmp: Path, profile: str,
                    variance_frontend: tuple = (0.0, None, 0.0)) -> dict:
    """One point's summary; `variance_frontend`: (step_variance, frontend name or None: the profile's
    client terms on a serve run, frontend_jitter)."""
    from kvsim.sim.config import SimConfig
    from kvsim.sim.simulator.simulate import run_simulation
    from kvsim.traces.synthetic import closed_batch

    w, setup = run.workload, run.setup
    n = int(value) if run.kind == "latency" else int(w["num_prompts"])
    trace_file = tmp / f"{run.id}-{n}-{w['input_tokens']}-{w['output_tokens']}.jsonl"
    if not trace_file.exists():
        closed_batch(n, int(w["input_tokens"]), int(w["output_tokens"]), name=run.id).save(trace_file)
    engine = {k: setup[k] for k in ("gpu_memory_utilization", "max_model_len") if k in setup}
    options = {}
    if run.kind == "serve":
        rate = float(value)
        options = {"max_concurrency": int(value)} if key == "max_concurrency" else \
            ({"request_rate": rate} if math.isfinite(rate) else {})
    step_variance, frontend, jitter = variance_frontend
    front = {"client_latency": True} if frontend is None else {"frontend": frontend}
    if jitter != 0:
        front["frontend_jitter"] = jitter
    cfg = SimConfig.model_validate({
        "trace": str(trace_file), "model": setup["model"], "gpu": setup["gpu"], "seed": seed, "profile": profile,
        "engine": engine, "trace_options": options, **(front if run.kind == "serve" else {}),
        "step_variance": step_variance, "metric_percentiles": [95.0, 99.0]})
    return run_simulation(cfg, None).summary


def _kernel_comparisons(run: PublishedRun) -> list[Comparison]:
    from kvsim.sim.calibration.operator_fit import SHIPPED_OPERATORS, kernel_step_times
    return [Comparison(run.id, step, "gpu_time_ms", meas * 1e3, pred * 1e3)
            for step, (meas, pred) in kernel_step_times(SHIPPED_OPERATORS, run.setup["gpu"], run.setup["model"],
                                                        run.points["step"]).items()]


def comparison_table(rows: list[Comparison]) -> str:
    """One line per figure: measured, kvsim, error, then kvsim's mean / p50 / p90 / p99 of the figure's
    latency (as BLIS reports them; the sources publish one statistic each)."""
    lines = [f"{'run':<28} {'point':<22} {'figure':<18} {'measured':>10} {'kvsim':>10} {'error':>8} "
             f"{'mean':>9} {'p50':>9} {'p90':>9} {'p99':>9}"]
    for c in rows:
        spread = " ".join(f"{v:>9.2f}" for v in c.spread) if c.spread else ""
        lines.append(f"{c.run:<28} {c.point:<22} {c.figure:<18} {c.measured:>10.2f} {c.predicted:>10.2f} "
                     f"{c.error:>+7.1%} {spread}".rstrip())
    return "\n".join(lines)


def tails_table(rows: list[Comparison]) -> str:
    """The published percentiles beside kvsim's, one line per run, point and latency (TTFT, TPOT, ITL,
    E2E) that has a measured median or tail: mean, p50 and the tail (p95 or p99, as published), each
    measured / kvsim / error; '-' where the source did not publish that statistic."""
    groups: dict[tuple[str, str, str], dict[str, Comparison]] = {}
    for c in rows:
        name, _, stat = c.figure.partition("_")
        if name in SPREAD:
            groups.setdefault((c.run, c.point, name), {})[stat.removesuffix("_ms")] = c
    lines = [f"{'run':<22} {'point':<20} {'lat':<4} {'mean':>20} {'p50':>20} {'tail':>4} {'p95 | p99':>20}"]

    def cell(c: Comparison | None) -> str:
        return f"{'-':>20}" if c is None else f"{c.measured:>7.1f} {c.predicted:>7.1f} {c.error:>+5.0%}"

    for (run, point, name), stats in groups.items():
        tail = next((q for q in ("p99", "p95") if q in stats), None)
        if "p50" not in stats and tail is None:
            continue
        lines.append(f"{run:<22} {point:<20} {name:<4} {cell(stats.get('mean'))} {cell(stats.get('p50'))} "
                     f"{tail or '-':>4} {cell(stats.get(tail) if tail else None)}")
    return "\n".join(lines)
