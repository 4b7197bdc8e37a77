"""`recorded`: replay the eviction decisions a real-backend run made (`kvsim replay`'s decisions.parquet).

For each request it evicts exactly the recorded (layer, KV head, position) entries at the points
where the real run's policy evicted them: after prefill and after the same decode step (`compress`),
and under memory pressure in the same `reclaim` call. It needs no scores, so with the same schedule
(`sim.crosscheck.recorded.simulate_recorded` feeds the replay's measured step times) the simulated memory
state equals the real one step by step.

A decision is found by (request id, reason, tokens cached when it happened, ordinal): a request's
cached token count only grows within one admission, and a recompute-preempted request comes back
with more tokens than it ever cached before, so the key is unique across preemptions; two pressure
decisions at the same count (the scheduler calling `reclaim` twice in one step) are told apart by
their order (`event`). The trigger is the recorded run's (read from `config.yaml` beside the
decisions, or given as `trigger`), so `compress` and `reclaim` run at the same times as there.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from ..policy import Decision, EvictionPolicy, register_policy

DECISIONS_FILE = "decisions.parquet"
REQUIRED_COLUMNS = {"request_id": "i", "step": "i", "layer": "i", "head": "i", "position": "i", "action": "O",
                    "engine_step": "i", "reason": "O", "num_tokens": "i", "event": "i"}
REASONS = ("policy", "pressure")


class RecordedDecisionsError(ValueError):
    """Missing or malformed decisions file; the message names the file and what was expected."""


def decisions_path(path: str | Path) -> Path:
    p = Path(path)
    f = p if p.suffix == ".parquet" else p / DECISIONS_FILE
    if not f.is_file():
        what = "a Parquet file" if p.suffix == ".parquet" else "a replay output directory holding decisions.parquet"
        raise RecordedDecisionsError(f"recorded decisions: {f} not found (kv.params.path must be {what}, "
                                     f"written by `kvsim replay`)")
    return f


def load_recorded_decisions(path: str | Path):
    """decisions.parquet (a file or a replay directory) as a DataFrame, its columns checked."""
    import pandas as pd

    f = decisions_path(path)
    try:
        df = pd.read_parquet(f)
    except Exception as exc:                     # noqa: BLE001 (pyarrow raises several types)
        raise RecordedDecisionsError(f"{f}: not a readable Parquet file ({exc})") from None
    missing = [c for c in REQUIRED_COLUMNS if c not in df.columns]
    if missing:
        raise RecordedDecisionsError(
            f"{f}: missing column(s) {missing}; expected {list(REQUIRED_COLUMNS)} (the recorded format of "
            f"sim.kv.importance; replays written before num_tokens/event were recorded must be re-run)")
    for c, kind in REQUIRED_COLUMNS.items():
        if kind == "i" and df[c].dtype.kind not in "iu":
            raise RecordedDecisionsError(f"{f}: column {c!r} must hold integers, found {df[c].dtype}")
    bad = sorted(set(df["action"]) - {"evict"})
    if bad:
        raise RecordedDecisionsError(f"{f}: action {bad[0]!r} cannot be replayed; expected 'evict' "
                                     f"(precision groups are not recorded by the real backend yet)")
    bad = sorted(set(df["reason"]) - set(REASONS))
    if bad:
        raise RecordedDecisionsError(f"{f}: reason {bad[0]!r}; expected one of {REASONS}")
    return df, f


def recorded_trigger(path: str | Path) -> str:
    """The effective trigger of the run that wrote the decisions (its config.yaml's kv section)."""
    import yaml

    from ..policy import _REGISTRY, _load_builtin

    f = decisions_path(path)
    cfg_file = f.parent / "config.yaml"
    if not cfg_file.is_file():
        raise RecordedDecisionsError(f"{cfg_file} not found: give kv.params.trigger (the recorded run's "
                                     f"kv.trigger, or its policy's default trigger)")
    try:
        data = yaml.safe_load(cfg_file.read_text()) or {}
    except (yaml.YAMLError, OSError, UnicodeDecodeError) as exc:
        problem = getattr(exc, "problem", None) or getattr(exc, "strerror", None) or type(exc).__name__
        raise RecordedDecisionsError(f"{cfg_file}: cannot be read as YAML ({problem}); give kv.params.trigger "
                                     "(the recorded run's kv.trigger)") from None
    kv = (data.get("kv") if isinstance(data, dict) else None) or {}
    if not isinstance(kv, dict):
        raise RecordedDecisionsError(f"{cfg_file}: kv: expected a mapping (the recorded run's config.yaml)")
    trigger, policy = kv.get("trigger", "policy"), kv.get("policy", "none")
    if trigger != "policy":
        return trigger
    _load_builtin()
    if policy not in _REGISTRY or policy == "recorded":
        raise RecordedDecisionsError(f"{cfg_file}: kv.policy {policy!r} has no known default trigger; "
                                     f"give kv.params.trigger")
    return _REGISTRY[policy].default_trigger


@register_policy("recorded")
class Recorded(EvictionPolicy):
    needs_scores = False
    evicts = True
    parameter_help = {
        "path": "a `kvsim replay` output directory, or its decisions.parquet (required)",
        "trigger": "the recorded run's kv.trigger; empty: read from config.yaml beside the decisions",
    }

    def __init__(self, path: str | None = None, trigger: str | None = None):
        if path is None:
            raise ValueError("path is required: a `kvsim replay` output directory or its decisions.parquet")
        df, self.path = load_recorded_decisions(path)
        self.default_trigger = trigger or recorded_trigger(path)
        self.layout = "shared" if len(df) and (df["head"] < 0).all() else "per_head"
        if len(df) and (df["head"] < 0).any() != (df["head"] < 0).all():
            raise RecordedDecisionsError(f"{self.path}: mixes shared-layout rows (head -1) with per-head rows")
        self._df = df
        self._events: dict[tuple[int, str, int, int], tuple[np.ndarray, np.ndarray]] = {}
        self._bound = None
        self.replayed = 0              # (row, token) entries evicted
        self.missing = 0               # recorded entries that were not live here (the runs diverged)
        self._pressure_calls: dict[int, dict[int, int]] = {}   # request -> {length: pressure calls there}

    def _bind(self, ctx) -> None:
        """Index the decisions by (request, reason, tokens cached, ordinal) once the layout is known."""
        if self._bound is not None:
            if self._bound != (ctx.layout, ctx.num_layers, ctx.num_kv_heads):
                raise RecordedDecisionsError(f"{self.path}: one recorded policy used with two KV layouts")
            return
        df = self._df
        if len(df) and ctx.layout != self.layout:
            raise RecordedDecisionsError(f"{self.path}: decisions were recorded with kv.layout={self.layout} "
                                         f"but this run has kv.layout={ctx.layout}")
        if ctx.layout == "per_head" and len(df):
            over = df[(df["layer"] >= ctx.num_layers) | (df["head"] >= ctx.num_kv_heads) | (df["layer"] < 0)]
            if len(over):
                r = over.iloc[0]
                raise RecordedDecisionsError(
                    f"{self.path}: decision for layer {r['layer']} head {r['head']} but the model has "
                    f"{ctx.num_layers} layers x {ctx.num_kv_heads} KV heads (simulate the model the replay ran)")
            rows = df["layer"].to_numpy(np.int64) * ctx.num_kv_heads + df["head"].to_numpy(np.int64)
        else:
            rows = np.zeros(len(df), dtype=np.int64)
        df = df.assign(row=rows).sort_values("event", kind="stable")
        events = df.drop_duplicates("event")[["event", "request_id", "reason", "num_tokens"]]
        ordinal = events.groupby(["request_id", "reason", "num_tokens"], sort=False).cumcount().to_numpy()
        ordinal_of = dict(zip(events["event"].to_numpy(), ordinal, strict=False))
        for event, part in df.groupby("event", sort=True):
            head = part.iloc[0]
            key = (int(head["request_id"]), head["reason"], int(head["num_tokens"]), int(ordinal_of[event]))
            self._events[key] = (part["row"].to_numpy(), part["position"].to_numpy(np.int64))
        self._bound = (ctx.layout, ctx.num_layers, ctx.num_kv_heads)
        self._df = None

    def on_admit(self, state, ctx) -> None:
        self._bind(ctx)
        if state.request_id is None:
            raise RuntimeError("the recorded policy needs the request id the eviction-aware KV manager tags "
                               "each request's TokenState with (state.request_id)")
        self._pressure_calls[state.request_id] = {}

    def observe(self, state, ctx, scores, phase) -> None:
        pass

    def _decision(self, state, key) -> Decision | None:
        event = self._events.get(key)
        if event is None:
            return None
        rows, positions = event
        mask = live_position_mask(state, rows, positions)
        found = int(mask.sum())
        self.replayed += found
        self.missing += positions.size - found
        return Decision(evict=mask) if found else None

    def compress(self, state, ctx, reason, scores):
        return self._decision(state, (state.request_id, "policy", state.num_tokens, 0))

    def reclaim(self, state, ctx, num_tokens):
        calls = self._pressure_calls[state.request_id]     # pressure calls at each length, this admission
        n = calls.get(state.num_tokens, 0)
        key = (state.request_id, "pressure", state.num_tokens, n)
        if key not in self._events:
            return None
        calls[state.num_tokens] = n + 1
        return self._decision(state, key)

    def __repr__(self) -> str:
        return f"recorded(path={str(self.path)!r}, trigger={self.default_trigger!r})"


def live_position_mask(state, rows: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """bool [rows, S]: the live slots holding (rows[i], positions[i]) — one sorted lookup, no loop over rows."""
    live_r, live_s = np.nonzero(state.live)
    span = max(state.num_tokens, int(positions.max(initial=-1)) + 1, 1)
    keys = live_r * span + state.pos[live_r, live_s]
    order = np.argsort(keys, kind="stable")
    keys = keys[order]
    want = np.asarray(rows, dtype=np.int64) * span + np.asarray(positions, dtype=np.int64)
    mask = np.zeros(state.live.shape, dtype=bool)
    if keys.size == 0:
        return mask
    idx = np.minimum(np.searchsorted(keys, want), keys.size - 1)
    hit = keys[idx] == want
    mask[live_r[order[idx[hit]]], live_s[order[idx[hit]]]] = True
    return mask
