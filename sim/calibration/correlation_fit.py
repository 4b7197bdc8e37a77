"""Fit the importance model's content correlation to how clustered a real model's recorded evictions are.

SyntheticImportance's content weights may be positionally correlated (content_correlation rho,
correlation_length ell; see sim/kv/importance.py). The per-head attention statistics cannot see that
(keys_95 and the shares are blind to where the heavy keys sit), but a score-driven eviction policy's
recorded decisions can: H2O on real attention evicts runs of neighbouring tokens and empties whole
pages. The fit simulates each recorded replay (its own config.yaml and workload, kv.importance = the
candidate model) in token-level mode and compares two statistics of the evictions with the replay's:
  - the mean run length of the prefill cuts' evicted positions (evicted tokens / maximal runs of
    consecutive evicted positions, pooled over requests): how far the correlation reaches;
  - the blocks freed by eviction (whole pages emptied, summed over all steps): what the memory
    metrics and the padded-attention cost depend on.
The loss is the sum of the two squared log ratios; (rho, ell) is the best point of a grid, refined
once around it. Budgets that evict most of the prompt and budgets that keep most of it respond
differently to rho and ell, so give replays at several budgets.
"""
from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import yaml

from kvsim.sim.calibration.errors import CalibrationError
from kvsim.sim.config import ConfigError, load_config
from kvsim.sim.crosscheck.comparison import Run
from kvsim.sim.crosscheck.recorded import trace_of_replay
from kvsim.sim.kv.build import policy_params
from kvsim.sim.kv.importance import MAX_CORRELATION_LENGTH
from kvsim.sim.kv.policy import get_policy
from kvsim.sim.simulator.simulate import run_simulation

CORRELATION_GRID = ((0.0, 0.15, 0.3, 0.45, 0.6, 0.75, 0.9), (2.0, 4.0, 8.0, 16.0, 32.0, 64.0))


@dataclass
class EvictionClustering:
    evicted_tokens: int                 # all evictions (token x row)
    blocks_freed: int                   # blocks freed by eviction (step log)
    prefill_evicted: int                # tokens evicted by the prefill cuts
    prefill_runs: int                   # maximal runs of consecutive evicted positions in those cuts

    @property
    def mean_run(self) -> float:
        return self.prefill_evicted / max(self.prefill_runs, 1)

    def __add__(self, other: "EvictionClustering") -> "EvictionClustering":
        return EvictionClustering(*(a + b for a, b in zip(self.astuple(), other.astuple())))

    def astuple(self) -> tuple[int, int, int, int]:
        return self.evicted_tokens, self.blocks_freed, self.prefill_evicted, self.prefill_runs


def prefill_cut_runs(decisions: pd.DataFrame) -> tuple[int, int]:
    """(evicted positions, maximal runs of consecutive positions) over the prefill cuts (step -1, the
    policy's own trigger) in a decisions table (RECORDED FORMAT), per request, event, layer and head."""
    cut = decisions[(decisions["step"] == -1) & (decisions["action"] == "evict")]
    if "reason" in cut.columns:
        cut = cut[cut["reason"] == "policy"]
    if not len(cut):
        return 0, 0
    keys = [c for c in ("request_id", "event", "layer", "head") if c in cut.columns]
    cut = cut.sort_values([*keys, "position"], kind="stable")
    same = np.ones(len(cut), dtype=bool)
    for k in keys:
        v = cut[k].to_numpy()
        same[1:] &= v[1:] == v[:-1]
    pos = cut["position"].to_numpy()
    starts = ~same
    starts[0] = True
    starts[1:] |= np.diff(pos) != 1
    return len(cut), int(starts.sum())


def _eviction_replay(replay_dir: str | Path):
    """(config, steps, decisions) of a replay whose policy evicts by attention scores."""
    d = Path(replay_dir)
    for f in ("config.yaml", "steps.parquet", "requests.parquet", "decisions.parquet"):
        if not (d / f).is_file():
            raise CalibrationError(f"{d}: missing {f} (expected a `kvsim replay` directory of a score-driven "
                                   f"eviction policy, e.g. kv.policy=h2o)")
    try:
        cfg = load_config(d / "config.yaml")
    except ConfigError as exc:
        raise CalibrationError(f"{d / 'config.yaml'}: {exc}") from None
    policy = get_policy(cfg.kv.policy, **policy_params(cfg.kv))
    if not (policy.evicts and policy.needs_scores) or cfg.kv.mode != "token":
        raise CalibrationError(f"{d / 'config.yaml'}: kv.policy={cfg.kv.policy} (mode {cfg.kv.mode}); the content "
                               f"correlation fit needs a token-level replay of a score-driven eviction policy "
                               f"(h2o, snapkv, ...)")
    return cfg, pd.read_parquet(d / "steps.parquet"), pd.read_parquet(d / "decisions.parquet")


def _clustering(steps: pd.DataFrame, decisions: pd.DataFrame) -> EvictionClustering:
    evicted, runs = prefill_cut_runs(decisions)
    return EvictionClustering(int(steps["evicted_tokens"].sum()), int(steps["blocks_freed_by_eviction"].sum()),
                              evicted, runs)


def recorded_clustering(replay_dir: str | Path) -> EvictionClustering:
    """The eviction statistics of a real replay (its step log and decisions.parquet)."""
    _, steps, decisions = _eviction_replay(replay_dir)
    return _clustering(steps, decisions)


def simulated_clustering(replay_dir: str | Path, importance: str | Path) -> EvictionClustering:
    """The same statistics of the simulator on the replay's config and workload, token-level, with the
    synthetic importance model `importance` (name or YAML)."""
    cfg, _, _ = _eviction_replay(replay_dir)
    cfg = cfg.model_copy(update={"kv": cfg.kv.model_copy(update={"importance": str(importance)})})
    return _clustering(*simulate_evictions(cfg, trace_of_replay(Run.load(replay_dir, "real").requests)))


def simulate_evictions(cfg, trace, out_dir: str | Path | None = None) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Simulate `trace` under `cfg`; (step log, every eviction applied as a decisions table: request_id,
    event, step (-1 = the prefill cut), layer, head (row indices; -1 in the shared layout), position,
    action, num_tokens). With `out_dir`, the run's outputs and decisions.parquet are written there."""
    tables = []

    def record(kv, executor):
        finish, ctx = kv.finish_step, kv.ctx

        def finish_step(scheduled):
            plan = finish(scheduled)
            for rid, rows, positions, decode_steps, num_tokens in plan.decisions:
                per_head = ctx.layout == "per_head"
                tables.append(pd.DataFrame({
                    "request_id": np.int64(rid), "step": np.int32(decode_steps if decode_steps > 0 else -1),
                    "layer": (ctx.row_layer[rows] if per_head else np.full(rows.size, -1)).astype(np.int16),
                    "head": (ctx.row_head[rows] if per_head else np.full(rows.size, -1)).astype(np.int16),
                    "position": positions.astype(np.int64), "action": "evict", "num_tokens": np.int64(num_tokens),
                    "event": np.int64(len(tables))}))
            return plan
        kv.finish_step = finish_step
        return kv, executor

    res = run_simulation(cfg, out_dir, trace=trace, wrap_kv=record)
    columns = ["request_id", "step", "layer", "head", "position", "action", "num_tokens", "event"]
    decisions = pd.concat(tables, ignore_index=True) if tables else pd.DataFrame(columns=columns)
    if out_dir is not None:
        decisions.to_parquet(Path(out_dir) / "decisions.parquet", index=False)
    steps = res.steps if res.steps is not None else pd.read_parquet(Path(out_dir) / "steps.parquet")
    return steps, decisions


def clustering_loss(sim: EvictionClustering, real: EvictionClustering) -> float:
    """Squared log ratios of the mean prefill-cut run length and the blocks freed by eviction (+1 each)."""
    return float(np.log((sim.mean_run + 1) / (real.mean_run + 1)) ** 2
                 + np.log((sim.blocks_freed + 1) / (real.blocks_freed + 1)) ** 2)


@dataclass
class CorrelationFit:
    content_correlation: float
    correlation_length: float
    measured: EvictionClustering
    synthetic: EvictionClustering
    uncorrelated: EvictionClustering        # the model without correlation, for comparison
    grid: pd.DataFrame                      # every point tried: rho, ell, statistics, loss
    sources: list[str] = field(default_factory=list)

    def table(self) -> str:
        lines = [f"{'eviction statistic':<28} {'measured':>9} {'rho=0':>9} {'fitted':>9}"]
        for label, attr in (("evicted tokens", "evicted_tokens"), ("blocks freed by eviction", "blocks_freed"),
                            ("prefill-cut mean run", "mean_run")):
            lines.append(f"{label:<28} {getattr(self.measured, attr):>9.4g} {getattr(self.uncorrelated, attr):>9.4g} "
                         f"{getattr(self.synthetic, attr):>9.4g}")
        lines.append(f"fitted content_correlation {self.content_correlation:g}, correlation_length "
                     f"{self.correlation_length:g} tokens ({len(self.grid)} grid points)")
        return "\n".join(lines)


def fit_content_correlation(replay_dirs: list[str | Path], spec: dict, *,
                            rhos: tuple[float, ...] = CORRELATION_GRID[0],
                            lengths: tuple[float, ...] = CORRELATION_GRID[1], refine: bool = True) -> CorrelationFit:
    """Fit `spec`'s content_correlation and correlation_length (see the module docstring) to the
    evictions recorded in `replay_dirs`. `spec` is an importance YAML mapping; it is not modified."""
    if not replay_dirs:
        raise CalibrationError("no replay directories with recorded evictions given")
    measured = sum((recorded_clustering(d) for d in replay_dirs[1:]), recorded_clustering(replay_dirs[0]))
    if measured.prefill_evicted == 0:
        raise CalibrationError(f"{', '.join(map(str, replay_dirs))}: no prefill-cut evictions recorded (budget above "
                               f"every prompt?); the content correlation cannot be fitted from them")
    rows, seen = [], {}

    def evaluate(rho: float, ell: float) -> EvictionClustering:
        key = (round(float(rho), 4), round(float(ell), 4) if rho > 0 else 0.0)
        if key not in seen:
            d = {k: v for k, v in spec.items() if k not in ("content_correlation", "correlation_length")}
            if key[0] > 0:
                d.update(content_correlation=key[0], correlation_length=key[1])
            with tempfile.TemporaryDirectory() as tmp:
                path = Path(tmp) / "importance.yaml"
                path.write_text(yaml.safe_dump(d))
                got = [simulated_clustering(r, path) for r in replay_dirs]
            seen[key] = sum(got[1:], got[0])
            rows.append({"content_correlation": key[0], "correlation_length": key[1],
                         "blocks_freed": seen[key].blocks_freed, "mean_run": seen[key].mean_run,
                         "loss": clustering_loss(seen[key], measured)})
        return seen[key]

    def best(points):
        return min(points, key=lambda p: (clustering_loss(evaluate(*p), measured), p))

    uncorrelated = evaluate(0.0, 0.0)
    rho, ell = best([(0.0, 0.0)] + [(r, e) for r in rhos if r > 0 for e in lengths])
    if refine and rho > 0:
        step = float(np.min(np.diff(sorted(rhos)))) / 2 if len(rhos) > 1 else 0.05
        near = [(min(max(rho + dr, 0.0), 0.97), min(ell * f, MAX_CORRELATION_LENGTH)) for dr in (-step, 0.0, step)
                for f in (2 ** -0.5, 1.0, 2 ** 0.5)]
        rho, ell = best([(rho, ell)] + [p for p in near if p[0] > 0])
    return CorrelationFit(content_correlation=float(rho), correlation_length=float(ell) if rho > 0 else 0.0,
                          measured=measured, synthetic=evaluate(rho, ell), uncorrelated=uncorrelated,
                          grid=pd.DataFrame(rows), sources=[str(d) for d in replay_dirs])
