"""Cross-check simulations: the recorded-timing simulation of a replay, and the predicted simulation's config.

The recorded simulation advances time by the replay's *measured* step durations and, for an evicting
policy, replays the decisions the replay recorded (`kv.policy=recorded`), so it schedules the replay's
very batches: its memory metrics must agree with the replay's step by step, and it yields the
per-step batch shapes the engine's step log lacks (`replay_shape_columns`).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd

from kvsim.sim.model.catalog import get_model, normalize_dtype
from kvsim.sim.config import ConfigError, load_config
from kvsim.sim.crosscheck.comparison import SHAPE_COLUMNS, CrosscheckError, Run, first_divergence
from kvsim.sim.kv.build import policy_params
from kvsim.sim.kv.policies.recorded import recorded_trigger
from kvsim.sim.kv.policy import get_policy
from kvsim.sim.simulator.simulate import run_simulation
from kvsim.traces.trace import Trace


def predicted_config(cfg, profile):
    """`cfg` for the predicted simulation. A profile that prices padded attention (`padded_attn_cost`
    > 0, the CPU backend) needs each step's widest block table, which the decode fast-forward does not
    compute yet: those runs step one by one."""
    if profile.padded_attn_cost > 0 and cfg.fast_forward:
        return cfg.model_copy(update={"fast_forward": False})
    return cfg


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
        return self.inner.execute(out)

    def complete(self, result, kv_plan):
        result = self.inner.complete(result, kv_plan)
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


def trace_of_replay(requests: pd.DataFrame):
    """The workload a replay ran, rebuilt from its requests.parquet (arrivals, prompt and output
    lengths, request ids; rejected requests get one output token: they never run)."""
    r = requests.sort_values(["arrival_s", "request_id"], kind="stable")
    return Trace.from_columns(arrival_time_s=r["arrival_s"].to_numpy(), prompt_tokens=r["prompt_tokens"].to_numpy(),
                              output_tokens=np.maximum(r["output_tokens"].to_numpy(), 1),
                              request_id=r["request_id"].to_numpy(), name="replay")


def replay_shape_columns(replay_dir: str | Path) -> pd.DataFrame:
    """SHAPE_COLUMNS for every step of a replay (`kvsim replay` output directory), by simulating it in
    recorded mode with its own config, workload (requests.parquet), decisions and measured step times.
    The schedule must come out identical to the replay's (checked), so the shapes are the replay's."""
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

