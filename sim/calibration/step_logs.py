"""Reading measured step logs for the calibration: one replay, a bare steps.parquet, or the median of repeats.

The padded-attention counts (`kv_tokens_padded`, `attn_pairs_prefill_padded`: each step's widest
block table) are not in the engine's step log; for a replay directory `load_step_logs` recomputes
them by simulating the replay in recorded mode (same config, workload, decisions and measured
times, hence the same batches and block tables; checked step by step). A bare steps.parquet without
them leaves the two padding factors unfitted.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from kvsim.sim.calibration.errors import CalibrationError
from kvsim.sim.crosscheck.comparison import SHAPE_COLUMNS, CrosscheckError, first_divergence, with_shape_columns
from kvsim.sim.crosscheck.recorded import replay_shape_columns

# Step-log columns every fit needs; the other BatchShape columns default to 0 when absent (shape_of_steps).
REQUIRED_COLUMNS = ("duration_s", "batch_size", "prefill_tokens", "decode_tokens", "kv_tokens_read")


def load_step_logs(paths: list[str | Path], *, recompute_shapes: bool = True) -> pd.DataFrame:
    """Concatenate step logs (Parquet) into one table with a `source` column; checks the columns.

    A replay directory whose step log lacks `kv_tokens_padded` (the engine does not log it) gets it
    recomputed by simulating the replay in recorded mode (`crosscheck.recorded.replay_shape_columns`), unless
    `recompute_shapes` is False; a bare steps.parquet then prices it as kv_tokens_read.

    An entry `DIR1,DIR2,...` names repeated replays of one workload: their step logs must schedule the
    same batches with the same memory state (checked step by step), and each step's `duration_s` is the
    median over them (`repeats` and `duration_spread` columns: N and (slowest - fastest) / median)."""
    if not paths:
        raise CalibrationError("no step logs given")
    frames = []
    for p in paths:
        group = [q for q in str(p).split(",") if q]
        if len(group) > 1:
            frames.append(_median_of_repeats(group, recompute_shapes))
        else:
            frames.append(_load_one(p, recompute_shapes))
    return pd.concat(frames, ignore_index=True)


def check_measured_on(paths: list[str | Path], model: str, tp: int) -> None:
    """Refuse a step log whose run directory says it is no measurement of `model` at `tp`: a `kvsim
    simulate` output (its durations are the cost model's predictions; summary.json without `replay`)
    or a replay of another model or TP degree (its config.yaml). A bare steps.parquet is taken as is."""
    import json

    import yaml

    from kvsim.sim.model.catalog import get_model
    spec = get_model(model)
    want = spec.name
    for entry in paths:
        for q in (q for q in str(entry).split(",") if q):
            path = _step_log_path(q)
            summary, config = path.parent / "summary.json", path.parent / "config.yaml"
            try:
                info = json.loads(summary.read_text()) if summary.is_file() else None
            except ValueError:
                raise CalibrationError(f"{summary}: not valid JSON (a replay writes it with its step log)") from None
            if isinstance(info, dict) and "replay" not in info:
                raise CalibrationError(f"{path}: a `kvsim simulate` step log: its duration_s are the simulator's "
                                       "predictions, not measured times; calibrate needs a replay (kvsim replay)")
            recorded = (yaml.safe_load(config.read_text()) or {}) if config.is_file() else {}
            if recorded.get("model") is not None and get_model(str(recorded["model"])).name != want:
                raise CalibrationError(f"{path}: measured on {recorded['model']} (its config.yaml), not --model "
                                       f"{model}; give --model {recorded['model']}")
            if recorded.get("tp") is not None and int(recorded["tp"]) != tp:
                raise CalibrationError(f"{path}: measured at tp={recorded['tp']} (its config.yaml), not --tp {tp}")
            layers = info.get("model_layers") if isinstance(info, dict) else None
            if layers is not None and int(layers) != spec.num_layers:
                raise CalibrationError(f"{path}: measured on {layers} of {want}'s {spec.num_layers} layers (kvsim "
                                       f"replay --layers {layers}); calibrate fits the whole model: replay all layers")


def _step_log_path(p: str | Path) -> Path:
    path = Path(p)
    if path.is_dir():
        path = path / "steps.parquet"
    if not path.is_file():
        raise CalibrationError(f"{p}: no such step log (expected a steps.parquet file or a run directory)")
    return path


def _read_step_log(path: Path) -> pd.DataFrame:
    try:
        df = pd.read_parquet(path)
    except Exception as exc:   # pyarrow raises several types for non-Parquet input
        raise CalibrationError(f"{path}: not a readable Parquet step log ({exc})") from None
    check_step_columns(df, str(path))
    return df


def _with_shapes(df: pd.DataFrame, path: Path, recompute_shapes: bool) -> pd.DataFrame:
    if recompute_shapes and not set(SHAPE_COLUMNS) <= set(df.columns) and (path.parent / "config.yaml").is_file():
        try:
            df = with_shape_columns(df, replay_shape_columns(path.parent), str(path))
        except CrosscheckError as exc:
            raise CalibrationError(str(exc)) from None
    return df


def _load_one(p: str | Path, recompute_shapes: bool) -> pd.DataFrame:
    path = _step_log_path(p)
    return _with_shapes(_read_step_log(path), path, recompute_shapes).assign(source=str(path))


def _median_of_repeats(group: list[str], recompute_shapes: bool) -> pd.DataFrame:
    paths = [_step_log_path(q) for q in group]
    logs = [_read_step_log(path) for path in paths]
    for path, df in zip(paths[1:], logs[1:]):
        same = first_divergence(logs[0], df)
        if not same["identical"]:
            f = same["first_divergence"]
            raise CalibrationError(f"{path}: not a repeat of {paths[0]}: it schedules differently from step "
                                   f"{f['step']} on ({f['column']}: {f['real']} vs {f['sim']})")
    durations = np.stack([df["duration_s"].to_numpy(dtype=np.float64) for df in logs])
    median = np.median(durations, axis=0)
    first = _with_shapes(logs[0], paths[0], recompute_shapes)
    return first.assign(duration_s=median, repeats=len(logs),
                        duration_spread=(durations.max(axis=0) - durations.min(axis=0)) / median,
                        source=",".join(str(q) for q in paths))


def check_step_columns(df: pd.DataFrame, where: str) -> None:
    missing = [c for c in REQUIRED_COLUMNS if c not in df.columns]
    if missing:
        raise CalibrationError(f"{where}: step log lacks column(s) {missing}; expected the kvsim step-log "
                               f"schema (sim/results/metrics.py STEP_COLUMNS)")
    if len(df) and not np.isfinite(df["duration_s"].to_numpy(dtype=float)).all():
        raise CalibrationError(f"{where}: column duration_s has NaN/inf values (a simulated log has no "
                               f"measured times; calibrate needs a replay step log)")

