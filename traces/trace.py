"""The canonical in-memory trace: a validated, arrival-sorted table of requests.

Columns of ``Trace.df`` (always all present, in this order):

=================  ======================  ===============================================
request_id         int64                   unique per trace
arrival_time_s     float64                 finite, >= 0, non-decreasing
prompt_tokens      int64                   >= 1
output_tokens      int64                   >= 1
session_id         Int64 (nullable) or str  <NA> when the source has no sessions
prefix_hash_ids    object                  list of int (one id per prefix block of
                                           ``prefix_block_tokens`` tokens) or None
priority           int64                   lower value = more urgent, default 0
=================  ======================  ===============================================
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd

from kvsim.sim.io.safe_io import atomic_output, file_starts_with
from kvsim.traces.errors import TraceError

REQUIRED_COLUMNS = ("request_id", "arrival_time_s", "prompt_tokens", "output_tokens")
OPTIONAL_COLUMNS = ("session_id", "prefix_hash_ids", "priority")
COLUMNS = REQUIRED_COLUMNS + OPTIONAL_COLUMNS
NATIVE_METADATA_KEY = "kvsim_trace"
NATIVE_FORMAT_VERSION = 1


@dataclass(eq=False)
class Trace:
    """A request trace. Build one with a loader, a generator or ``Trace.from_columns``."""

    df: pd.DataFrame
    name: str = ""
    source: str = ""
    prefix_block_tokens: int | None = None
    num_clipped: int = 0           # requests shortened by clip(max_model_len)
    num_output_clamped: int = 0    # requests whose output length 0 was raised to 1 on load
    num_reordered: int = 0         # requests found earlier than a predecessor in the source file
    notices: list[str] = field(default_factory=list)
    # a `vllm bench serve` result read as a trace: its measured per-request figures ("request_id" plus
    # "ttfts", "itls", "latencies" lists in the same order) and load options (traces/user_formats.py)
    measured: dict | None = None
    bench_load: dict | None = None
    # request ids that were not integers in the source (`r0`, UUIDs): request_id -> the original id
    request_labels: dict[int, str] | None = None
    # a workload spec's trace (traces/workload.py): each request's client class and the classes' SLOs
    workload_classes: Any = None
    # sessions whose conversations all begin with the same tokens (vLLM's multi-turn common prefix): the
    # prefix cache shares those across sessions (sim/engine/sessions.py)
    shared_prefix_tokens: int = 0

    def __post_init__(self) -> None:
        self.df = _canonical_frame(self.df, self.source or self.name)
        if self.prefix_block_tokens is not None and self.prefix_block_tokens < 1:
            raise TraceError(self.source or None, None,
                             f"prefix_block_tokens must be >= 1, got {self.prefix_block_tokens}")
        if self.prefix_block_tokens is None and self.has_prefix_ids:
            raise TraceError(self.source or None, None,
                             "prefix_hash_ids are given without prefix_block_tokens (tokens per block id)")

    @classmethod
    def from_columns(cls, *, arrival_time_s, prompt_tokens, output_tokens, request_id=None,
                     session_id=None, prefix_hash_ids=None, priority=None, **meta) -> Trace:
        n = len(prompt_tokens)
        df = pd.DataFrame({
            "request_id": np.arange(n, dtype=np.int64) if request_id is None else request_id,
            "arrival_time_s": np.asarray(arrival_time_s, dtype=np.float64),
            "prompt_tokens": np.asarray(prompt_tokens, dtype=np.int64),
            "output_tokens": np.asarray(output_tokens, dtype=np.int64),
            "session_id": pd.array([pd.NA] * n, dtype="Int64") if session_id is None else session_id,
            "prefix_hash_ids": pd.Series([None] * n, dtype=object) if prefix_hash_ids is None
            else pd.Series(list(prefix_hash_ids), dtype=object),
            "priority": np.zeros(n, dtype=np.int64) if priority is None else priority,
        })
        return cls(df, **meta)

    # ---- basic properties -------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.df)

    def __repr__(self) -> str:
        span = self.duration_s
        return (f"Trace(name={self.name!r}, requests={len(self)}, span={span:.1f}s, "
                f"prefix_block_tokens={self.prefix_block_tokens})")

    @property
    def duration_s(self) -> float:
        arrivals = self.df["arrival_time_s"]
        return float(arrivals.iloc[-1] - arrivals.iloc[0]) if len(arrivals) else 0.0

    @property
    def has_prefix_ids(self) -> bool:
        return bool(self.df["prefix_hash_ids"].notna().any())

    def _derive(self, df: pd.DataFrame, **changes) -> Trace:
        return replace(self, df=df.reset_index(drop=True), notices=list(self.notices), **changes)

    # ---- transforms (each returns a new Trace) ------------------------------------------------
    def window(self, start_s: float, end_s: float, *, shift: bool = True) -> Trace:
        """Requests arriving in [start_s, end_s); times shifted so start_s becomes 0 unless shift=False."""
        if not end_s > start_s:
            raise TraceError(None, None, f"window: end_s ({end_s}) must be greater than start_s ({start_s})")
        arrivals = self.df["arrival_time_s"]
        df = self.df[(arrivals >= start_s) & (arrivals < end_s)].copy()
        if shift:
            df["arrival_time_s"] = df["arrival_time_s"] - start_s
        return self._derive(df)

    def scale_rate(self, factor: float) -> Trace:
        """Multiply the arrival rate by ``factor`` (2.0 = twice as many requests per second)."""
        if not (math.isfinite(factor) and factor > 0):
            raise TraceError(None, None, f"scale_rate: factor must be a finite number > 0, got {factor}")
        df = self.df.copy()
        df["arrival_time_s"] = df["arrival_time_s"] / factor
        return self._derive(df)

    def with_arrivals(self, times) -> Trace:
        """The same requests, in the same order, arriving at ``times`` (s; one per request, non-decreasing)."""
        times = np.asarray(times, dtype=np.float64)
        if times.shape != (len(self),):
            raise TraceError(None, None, f"with_arrivals: {times.size} times for {len(self)} requests")
        df = self.df.copy()
        df["arrival_time_s"] = times
        return self._derive(df)

    def head(self, n: int) -> Trace:
        """The first ``n`` requests by arrival."""
        if n < 0:
            raise TraceError(None, None, f"head: n must be >= 0, got {n}")
        return self._derive(self.df.iloc[:n].copy())

    def sample(self, n: int, seed: int = 0) -> Trace:
        """``n`` requests drawn uniformly without replacement, kept in arrival order."""
        if not 0 <= n <= len(self):
            raise TraceError(None, None, f"sample: n must be between 0 and {len(self)}, got {n}")
        rows = np.sort(np.random.default_rng(seed).choice(len(self), size=n, replace=False))
        return self._derive(self.df.iloc[rows].copy())

    def clip(self, max_model_len: int) -> Trace:
        """Fit every request into ``max_model_len`` tokens (prompt + output), as a serving engine must.

        The output is shortened first; a prompt that alone reaches ``max_model_len`` is cut to
        ``max_model_len - 1`` tokens with one output token. Prefix block ids beyond the new prompt
        are dropped. The number of requests changed is added to ``num_clipped``.
        """
        if max_model_len < 2:
            raise TraceError(None, None, f"clip: max_model_len must be >= 2, got {max_model_len}")
        df = self.df.copy()
        prompt = df["prompt_tokens"].to_numpy()
        output = df["output_tokens"].to_numpy()
        new_prompt = np.minimum(prompt, max_model_len - 1)
        new_output = np.minimum(output, max_model_len - new_prompt)
        changed = (new_prompt != prompt) | (new_output != output)
        df["prompt_tokens"] = new_prompt
        df["output_tokens"] = new_output
        if self.prefix_block_tokens is not None:
            max_blocks = -(-new_prompt // self.prefix_block_tokens)
            ids = list(df["prefix_hash_ids"])
            for row in np.flatnonzero(changed):
                if ids[row] is not None and len(ids[row]) > max_blocks[row]:
                    ids[row] = ids[row][: max_blocks[row]]
            df["prefix_hash_ids"] = ids
        return self._derive(df, num_clipped=self.num_clipped + int(changed.sum()))

    @staticmethod
    def concat(traces: Sequence[Trace], *, how: str = "sequential", name: str | None = None) -> Trace:
        """Join traces into one, renumbering request ids 0..n-1.

        ``how="sequential"``: each trace starts where the previous one's last request arrived.
        ``how="overlay"``: arrival times are kept and the requests interleave (merged by time).
        Prefix block ids (and integer session ids) are offset per trace, because ids only mean
        "same content" within one source.
        """
        if not traces:
            raise TraceError(None, None, "concat: need at least one trace")
        if how not in ("sequential", "overlay"):
            raise TraceError(None, None, f"concat: how must be 'sequential' or 'overlay', got {how!r}")
        block_sizes = {t.prefix_block_tokens for t in traces if t.has_prefix_ids}
        if len(block_sizes) > 1:
            raise TraceError(None, None, f"concat: traces use different prefix block sizes {sorted(block_sizes)}")
        frames, time_offset, id_offset, session_offset = [], 0.0, 0, 0
        for t in traces:
            df = t.df.copy()
            if how == "sequential" and len(df):
                df["arrival_time_s"] = df["arrival_time_s"] - df["arrival_time_s"].iloc[0] + time_offset
                time_offset = float(df["arrival_time_s"].iloc[-1])
            present = [x for x in df["prefix_hash_ids"] if x is not None and len(x)]
            if present:
                shift = id_offset - min(min(x) for x in present)
                df["prefix_hash_ids"] = [None if x is None else [h + shift for h in x]
                                         for x in df["prefix_hash_ids"]]
                id_offset = max(max(x) for x in present) + shift + 1
            sessions = df["session_id"]
            if sessions.dtype == "Int64" and sessions.notna().any():
                df["session_id"] = sessions - int(sessions.min()) + session_offset
                session_offset = int(df["session_id"].max()) + 1
            frames.append(df)
        if len({str(f["session_id"].dtype) for f in frames}) > 1:  # mixed int/str ids: all become str
            for f in frames:
                f["session_id"] = pd.Series([None if _is_missing(v) else str(v) for v in f["session_id"]],
                                            dtype=object, index=f.index)
        df = pd.concat(frames, ignore_index=True)
        df = df.iloc[np.argsort(df["arrival_time_s"].to_numpy(), kind="stable")].reset_index(drop=True)
        df["request_id"] = np.arange(len(df), dtype=np.int64)
        first = traces[0]
        return Trace(df, name=name or "+".join(t.name for t in traces), source=first.source,
                     prefix_block_tokens=block_sizes.pop() if block_sizes else None,
                     num_clipped=sum(t.num_clipped for t in traces),
                     num_output_clamped=sum(t.num_output_clamped for t in traces),
                     num_reordered=sum(t.num_reordered for t in traces),
                     notices=[n for t in traces for n in t.notices])

    # ---- native on-disk format ----------------------------------------------------------------
    def metadata(self) -> dict:
        return {"version": NATIVE_FORMAT_VERSION, "name": self.name,
                "prefix_block_tokens": self.prefix_block_tokens, "num_clipped": self.num_clipped,
                "num_output_clamped": self.num_output_clamped, "num_reordered": self.num_reordered,
                "notices": self.notices}

    def save(self, path: str | os.PathLike) -> Path:
        """Write the native format chosen by extension: ``.parquet`` or ``.jsonl``."""
        path = Path(path)
        suffix = path.suffix.lower()
        writers = {".parquet": _write_parquet, ".jsonl": _write_jsonl}
        if suffix not in writers:
            raise TraceError(path, None, f"unsupported extension {path.suffix!r}: expected .parquet or .jsonl")
        with atomic_output(path) as tmp:            # a full disk leaves no half trace that loads
            writers[suffix](self, tmp)
        return path


def _canonical_frame(df: pd.DataFrame, where: str) -> pd.DataFrame:
    """Check the invariants of a canonical frame and return it with canonical dtypes and order."""
    missing = [c for c in REQUIRED_COLUMNS if c not in df.columns]
    if missing:
        raise TraceError(where or None, None, f"trace is missing columns {missing}")
    n = len(df)
    out = pd.DataFrame(index=pd.RangeIndex(n))
    for column in ("request_id", "prompt_tokens", "output_tokens"):
        out[column] = df[column].to_numpy(dtype=np.int64)
    out["arrival_time_s"] = df["arrival_time_s"].to_numpy(dtype=np.float64)
    out["session_id"] = (_session_column(df["session_id"].reset_index(drop=True)) if "session_id" in df.columns
                         else pd.array([pd.NA] * n, dtype="Int64"))
    prefix = df["prefix_hash_ids"] if "prefix_hash_ids" in df.columns else [None] * n
    out["prefix_hash_ids"] = pd.Series(list(prefix), dtype=object, index=out.index)
    out["priority"] = (df["priority"].to_numpy(dtype=np.int64) if "priority" in df.columns
                       else np.zeros(n, dtype=np.int64))
    out = out[list(COLUMNS)]

    arrivals = out["arrival_time_s"].to_numpy()
    problems = [
        (~np.isfinite(arrivals) | (arrivals < 0), "arrival_time_s must be finite and >= 0"),
        (np.r_[False, np.diff(arrivals) < 0] if n else np.zeros(0, bool),
         "arrival_time_s must be non-decreasing"),
        (out["prompt_tokens"].to_numpy() < 1, "prompt_tokens must be >= 1"),
        (out["output_tokens"].to_numpy() < 1, "output_tokens must be >= 1"),
        (out["request_id"].duplicated().to_numpy(), "request_id must be unique"),
    ]
    for bad, message in problems:
        if bad.any():
            row = int(np.flatnonzero(bad)[0])
            raise TraceError(where or None, None, f"row {row}: {message} (request_id {out['request_id'].iloc[row]})")
    return out


def _session_column(values: pd.Series) -> pd.Series:
    """Int64 when every present session id is an integer, else strings (missing stays None)."""
    if values.dtype == "Int64":
        return values
    present = [v for v in values if not _is_missing(v)]
    if all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in present):
        return pd.Series(pd.array([None if _is_missing(v) else int(v) for v in values], dtype="Int64"))
    return pd.Series([None if _is_missing(v) else str(v) for v in values], dtype=object)


def _is_missing(value) -> bool:
    return value is None or value is pd.NA or (isinstance(value, float) and math.isnan(value))


# ---- writers (readers live in traces.loaders) -------------------------------------------------
def written_by_kvsim(path: str | os.PathLike) -> bool:
    """Whether `path` is a native trace kvsim wrote (its metadata line or Parquet key): a trace command
    may replace it without --overwrite; anything else there is the user's."""
    path = Path(path)
    if path.suffix.lower() == ".parquet":
        import pyarrow.parquet as pq
        return NATIVE_METADATA_KEY.encode() in (pq.read_schema(path).metadata or {})
    return file_starts_with(path, b'{"' + NATIVE_METADATA_KEY.encode() + b'"', within=64)

def _write_parquet(trace: Trace, path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    df = trace.df
    session = df["session_id"]
    session_array = (pa.array(session.to_numpy(dtype=object, na_value=None), type=pa.int64())
                     if session.dtype == "Int64" else pa.array(list(session), type=pa.string()))
    table = pa.table({
        "request_id": pa.array(df["request_id"].to_numpy(), type=pa.int64()),
        "arrival_time_s": pa.array(df["arrival_time_s"].to_numpy(), type=pa.float64()),
        "prompt_tokens": pa.array(df["prompt_tokens"].to_numpy(), type=pa.int64()),
        "output_tokens": pa.array(df["output_tokens"].to_numpy(), type=pa.int64()),
        "session_id": session_array,
        "prefix_hash_ids": pa.array(list(df["prefix_hash_ids"]), type=pa.list_(pa.int64())),
        "priority": pa.array(df["priority"].to_numpy(), type=pa.int64()),
    })
    table = table.replace_schema_metadata({NATIVE_METADATA_KEY: json.dumps(trace.metadata())})
    pq.write_table(table, path)


def _write_jsonl(trace: Trace, path: Path) -> None:
    df = trace.df
    session = df["session_id"].to_numpy(dtype=object, na_value=None) if df["session_id"].dtype == "Int64" \
        else list(df["session_id"])
    columns = zip(df["request_id"].tolist(), df["arrival_time_s"].tolist(), df["prompt_tokens"].tolist(),
                  df["output_tokens"].tolist(), session, df["prefix_hash_ids"], df["priority"].tolist(), strict=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(json.dumps({NATIVE_METADATA_KEY: trace.metadata()}) + "\n")
        for rid, arrival, prompt, output, sid, prefix, priority in columns:
            record = {"request_id": rid, "arrival_time_s": arrival, "prompt_tokens": prompt,
                      "output_tokens": output}
            if sid is not None:
                record["session_id"] = sid if isinstance(sid, str) else int(sid)
            if prefix is not None:
                record["prefix_hash_ids"] = [int(h) for h in prefix]
            if priority:
                record["priority"] = priority
            f.write(json.dumps(record) + "\n")


def session_trace(sessions: list[list[tuple[int, int]]], starts: np.ndarray, thinks: list[np.ndarray],
                   name: str, source: str) -> Trace:
    """The trace of `sessions` (each a list of (new message tokens, answer tokens) per turn)."""
    rows = []
    for s, turns in enumerate(sessions):
        held, t = 0, float(starts[s])
        for k, (message, answer) in enumerate(turns):
            if k:
                t += float(thinks[s][k - 1])
            rows.append((t, s, held + message, answer))
            held += message + answer
    rows.sort(key=lambda r: r[0])           # stable: a session's turns keep their order
    arr = np.array([r[0] for r in rows], dtype=np.float64)
    return Trace.from_columns(
        arrival_time_s=arr, prompt_tokens=np.array([r[2] for r in rows], dtype=np.int64),
        output_tokens=np.array([r[3] for r in rows], dtype=np.int64),
        session_id=np.array([r[1] for r in rows], dtype=np.int64), name=name, source=source)
