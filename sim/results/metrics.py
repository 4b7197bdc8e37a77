"""Step log (one row per engine step, written incrementally), request table and summary metrics.

The step-log schema is shared by the simulator and the real backend.
"""
from __future__ import annotations

import math
from array import array
from operator import attrgetter
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from ..core.request import RequestStatus
from ..io.safe_io import deferred_interrupts

# name -> (arrow type, meaning)
STEP_COLUMNS: dict[str, tuple[pa.DataType, str]] = {
    "replica": (pa.int32(), "engine replica index"),
    "step": (pa.int64(), "step number within the replica, from 0"),
    "time_s": (pa.float64(), "step start time"),
    "duration_s": (pa.float64(), "step duration that advanced the clock (predicted in sim, measured in replay)"),
    "predicted_s": (pa.float64(), "cost-model prediction for the step (NaN when no model)"),
    "batch_size": (pa.int32(), "sequences in the step"),
    "num_prefill_seqs": (pa.int32(), "sequences computing prompt (or recompute) tokens"),
    "num_decode_seqs": (pa.int32(), "sequences computing one decode token"),
    "prefill_tokens": (pa.int64(), "prompt tokens computed"),
    "decode_tokens": (pa.int64(), "decode tokens computed"),
    "kv_tokens_read": (pa.int64(), "KV token-equivalents read by attention"),
    "blocks_used": (pa.int64(), "blocks owned by requests after the step"),
    "blocks_free": (pa.int64(), "blocks in the free queue after the step"),
    "blocks_cached": (pa.int64(), "free blocks still holding a reusable prefix"),
    "live_slots": (pa.int64(), "slots holding a live token"),
    "allocated_slots": (pa.int64(), "slots in allocated blocks"),
    "fragmentation": (pa.float64(), "internal fragmentation: 1 - live / allocated slots"),
    "num_running": (pa.int32(), "running requests after the step"),
    "num_waiting": (pa.int32(), "waiting requests after the step"),
    "preemptions": (pa.int32(), "requests preempted in this step"),
    "finished": (pa.int32(), "requests finished in this step"),
    "evicted_tokens": (pa.int64(), "tokens evicted by the KV policy in this step"),
    "blocks_freed_by_eviction": (pa.int64(), "blocks returned to the pool by eviction/compaction"),
    "bytes_moved": (pa.int64(), "bytes copied or moved by the slot strategy"),
    "attn_pairs_prefill": (pa.float64(), "query-key pairs of prefill chunks: sum of chunk * (context_before + "
                                         "(chunk + 1) / 2)"),
    "block_table_entries": (pa.int64(), "block-table entries of the scheduled requests (x layers x heads in "
                                        "per_head)"),
}
STEP_SCHEMA = pa.schema([(name, t) for name, (t, _) in STEP_COLUMNS.items()])
_ARRAY_DTYPE = {"d": np.dtype(np.float64).char, "q": np.dtype(np.int64).char}    # typed buffer -> numpy type
STEP_DEFAULTS = {"predicted_s": math.nan, "evicted_tokens": 0, "blocks_freed_by_eviction": 0,
                 "bytes_moved": 0, "attn_pairs_prefill": 0.0, "block_table_entries": 0}
# speculative decoding's columns (sim/core/spec_decode.py): in the step log only when it is on
SPEC_STEP_COLUMNS: dict[str, tuple[pa.DataType, str]] = {
    "num_drafts": (pa.int32(), "requests whose drafts were verified in this step (vllm:spec_decode_num_drafts)"),
    "num_draft_tokens": (pa.int64(), "draft tokens verified in this step (vllm:spec_decode_num_draft_tokens)"),
    "num_accepted_tokens": (pa.int64(), "draft tokens accepted in this step (vllm:spec_decode_num_accepted_tokens)"),
    "draft_s": (pa.float64(), "seconds of the step spent drafting (the drafter's passes, or the n-gram lookup)"),
    "verify_s": (pa.float64(), "seconds of the step's target forward when it verified drafts (0 otherwise)"),
}
STEP_DEFAULTS.update({"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0, "draft_s": 0.0,
                      "verify_s": 0.0})


class StepLog:
    """Buffers step rows and appends them to a Parquet file in row groups of exactly `flush_rows`
    rows (the last one shorter), so the file does not depend on how rows were appended (one step
    at a time or a decode run at once); memory stays bounded by about one row group.

    Within a row group, rows are ordered by (replica, step).
    """

    def __init__(self, path: str | Path | None, flush_rows: int = 65536, *, keep: tuple[str, ...] = (),
                 keep_rows: int = 0, extra_columns: dict[str, tuple[pa.DataType, str]] | None = None):
        self.path = Path(path) if path else None
        # the schema: STEP_COLUMNS, and `extra_columns` after them (speculative decoding's, when it is on)
        self._columns = STEP_COLUMNS if not extra_columns else {**STEP_COLUMNS, **extra_columns}
        self._schema = STEP_SCHEMA if not extra_columns else pa.schema([(n, t) for n, (t, _) in self._columns.items()])
        self.flush_rows = flush_rows
        # copies of the `keep` columns as written, while the log has at most `keep_rows` rows (`kept`)
        self._kept: dict[str, list[np.ndarray]] | None = {name: [] for name in keep} if keep else None
        self._keep_rows = keep_rows
        self._written = 0
        self._writer: pq.ParquetWriter | None = None
        self._typed = True
        self._reset_rows()
        self._carry: dict[str, np.ndarray] | None = None   # rows past the last full row group
        self._pending = 0
        self._tables: list[pa.Table] = []                # kept only when there is no file
        self.num_rows = 0

    def _reset_rows(self) -> None:
        # Typed buffers (int64 or float64 by the column's type): converted at flush without a pass over
        # Python objects. A value a buffer refuses (a float in an integer column) turns the log into
        # plain lists, converted by numpy as before (`_to_lists`).
        self._rows: dict[str, array | list] = (
            {name: array("d" if pa.types.is_floating(typ) else "q") for name, (typ, _) in self._columns.items()}
            if self._typed else {name: [] for name in self._columns})
        self._bind()

    def _bind(self) -> None:
        # (name, column buffer's append[, default]): one step's append is one pass over each
        self._required = [(name, v.append) for name, v in self._rows.items() if name not in STEP_DEFAULTS]
        self._optional = [(name, v.append, STEP_DEFAULTS[name]) for name, v in self._rows.items()
                          if name in STEP_DEFAULTS]
        self._extend = [(v.extend, v.typecode if isinstance(v, array) else None, name, STEP_DEFAULTS.get(name))
                        for name, v in self._rows.items()]

    def _to_lists(self) -> None:
        """Leave typed buffers for lists (dropping a row or run appended to some columns only)."""
        n = self._drop_torn_row()
        self._typed = False
        self._rows = {name: v[:n].tolist() if isinstance(v, array) else v[:n] for name, v in self._rows.items()}
        self._bind()

    def append(self, row: dict) -> None:
        try:
            self._append(row)
        except (TypeError, OverflowError):
            if not self._typed:
                raise
            self._to_lists()
            self._append(row)
        self._grow(1)

    def _append(self, row: dict) -> None:
        for name, append in self._required:
            append(row[name])
        get = row.get
        for name, append, default in self._optional:
            append(get(name, default))

    def append_columns(self, cols: dict, n: int) -> None:
        """Append n rows given as columns (sequences of length n, or scalars repeated n times)."""
        try:
            self._append_columns(cols, n)
        except (TypeError, OverflowError):
            if not self._typed:
                raise
            self._to_lists()
            self._append_columns(cols, n)
        self._grow(n)

    def _append_columns(self, cols: dict, n: int) -> None:
        # Typed buffers take each column as one typed array (a copy, not a conversion per value): a
        # scalar's as one value repeated, a list given for several columns converted once.
        converted: dict = {}
        for extend, typecode, name, default in self._extend:
            v = cols.get(name, default)
            kind = v.__class__
            if typecode is None:
                extend(v.tolist() if kind is np.ndarray else v if kind is list or kind is range or kind is tuple
                       else [v] * n)
            elif kind is list or kind is tuple:
                key = (id(v), typecode)
                typed = converted.get(key)
                if typed is None:
                    typed = converted[key] = array(typecode, v)
                extend(typed)
            elif kind is np.ndarray:
                if v.dtype.char == _ARRAY_DTYPE[typecode]:      # the buffer's own type: its bytes
                    extend(array(typecode, v.tobytes()))
                else:
                    extend(array(typecode, v.tolist()))
            elif kind is range:
                extend(array(typecode, list(v)))
            else:
                extend(array(typecode, (v,)) * n)

    def _grow(self, n: int) -> None:
        self._pending += n
        self.num_rows += n
        if self._pending >= self.flush_rows:
            self.flush(whole_groups=True)

    def flush(self, whole_groups: bool = False) -> None:
        """Write the buffered rows (`whole_groups`: only whole row groups of `flush_rows`)."""
        if not self._pending:
            return
        with deferred_interrupts():     # a Ctrl-C here would drop the rows taken out of the buffer
            self._flush(whole_groups)

    def _flush(self, whole_groups: bool) -> None:
        n = self._drop_torn_row()
        rows = self._rows
        columns = {name: (np.frombuffer(rows[name], dtype=_ARRAY_DTYPE[rows[name].typecode], count=n)
                          .astype(typ.to_pandas_dtype(), copy=False) if self._typed
                          else np.asarray(rows[name][:n], dtype=typ.to_pandas_dtype()))
                   for name, (typ, _) in self._columns.items()}
        self._reset_rows()
        if self._carry is not None:
            columns = {name: np.concatenate((self._carry[name], v)) for name, v in columns.items()}
            self._carry = None
        total = len(columns["step"])
        cut = total - total % self.flush_rows if whole_groups else total
        if cut < total:
            self._carry = {name: v[cut:] for name, v in columns.items()}
        self._pending = total - cut
        for start in range(0, cut, self.flush_rows):
            self._write({name: v[start:min(start + self.flush_rows, cut)] for name, v in columns.items()})

    def _write(self, columns: dict[str, np.ndarray]) -> None:
        replica, step = columns["replica"], columns["step"]
        in_order = (replica == replica[0]).all() and (np.diff(step) > 0).all()    # one replica: as appended
        order = slice(None) if in_order else np.lexsort((step, replica))
        arrays = [pa.array(columns[name][order], type=typ) for name, (typ, _) in self._columns.items()]
        self._written += len(step)
        if self._kept is not None:
            if self._written > self._keep_rows:
                self._kept = None
            else:
                for name, chunks in self._kept.items():
                    chunks.append(columns[name][order])
        table = pa.Table.from_arrays(arrays, schema=self._schema)
        if self.path is None:
            self._tables.append(table)
            return
        if self._writer is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # no dictionary pages: the columns are numeric and mostly distinct; 3x faster to write
            self._writer = pq.ParquetWriter(self.path, self._schema, use_dictionary=False)
        self._writer.write_table(table)

    def kept(self) -> pd.DataFrame | None:
        """The `keep` columns of every row written, as `pd.read_parquet(path, columns=keep)` reads
        them back; None when not kept (no `keep`, or more than `keep_rows` rows)."""
        if self._kept is None:
            return None
        self.flush()
        if self._kept is None:
            return None
        return pd.DataFrame({name: np.concatenate(chunks) if chunks else
                             np.empty(0, self._columns[name][0].to_pandas_dtype()) for name, chunks in self._kept.items()})

    def _drop_torn_row(self) -> int:
        """An interrupt (Ctrl-C) inside `append` leaves some columns one row longer: drop that row.
        Returns the complete rows."""
        return min(len(v) for v in self._rows.values())

    def close(self) -> None:
        self.flush()
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        elif self.path is not None and not self.path.exists():
            pq.write_table(self._schema.empty_table(), self.path)

    def to_pandas(self, columns: list[str] | None = None) -> pd.DataFrame:
        self.flush()
        if self.path is not None:
            self.close()
            return pq.read_table(self.path, columns=columns).to_pandas()
        table = self._schema.empty_table() if not self._tables else pa.concat_tables(self._tables)
        return (table.select(columns) if columns else table).to_pandas()


REQUEST_COLUMNS = {
    "request_id": "trace request id",
    "replica": "replica that served it",
    "status": "finished | rejected | aborted (its client timed out: --request-timeout) | unfinished",
    "reject_reason": "why a request that can never fit was rejected, or why it was aborted",
    "arrival_s": "arrival time",
    "first_scheduled_s": "first time it was scheduled",
    "first_token_s": "time its first output token was produced",
    "finish_s": "time its last output token was produced",
    "queueing_s": "first_scheduled - arrival",
    "ttft_s": "time to first token",
    "tpot_s": "mean time per output token after the first",
    "e2e_s": "finish - arrival",
    "prompt_tokens": "prompt length",
    "output_tokens": "output tokens produced",
    "cached_tokens": "prompt tokens served from the prefix cache",
    "preemptions": "times preempted",
    "evicted_tokens": "(token, layer, KV head) entries evicted by the KV policy / rows (token-equivalents)",
    "attention_mass_retained": "mean share of the full-cache attention its kept tokens received per decode "
                               "step (1 = nothing lost; NaN when no eviction policy ran)",
    "token_times_s": "time of every output token (inter-token latencies are its differences)",
}


_STATUS_NAMES = {RequestStatus.FINISHED: "finished", RequestStatus.REJECTED: "rejected",
                 RequestStatus.ABORTED: "aborted"}   # else "unfinished"


def request_table(requests) -> pd.DataFrame:
    """One row per request (REQUEST_COLUMNS), sorted by request id (stable)."""
    reqs = sorted(requests, key=attrgetter("request_id"))
    times = [r.token_times for r in reqs]
    status = [_STATUS_NAMES.get(r.status, "unfinished") for r in reqs]
    columns = {
        "request_id": [r.request_id for r in reqs], "replica": [r.replica for r in reqs], "status": status,
        "reject_reason": [r.reject_reason for r in reqs],
        "arrival_s": [r.arrival_time for r in reqs],
        "first_scheduled_s": [math.nan if r.first_scheduled_time is None else r.first_scheduled_time for r in reqs],
        "first_token_s": [t[0] if t else math.nan for t in times],
        "finish_s": [t[-1] if t and s == "finished" else math.nan for t, s in zip(times, status, strict=False)],
        "prompt_tokens": [r.prompt_tokens for r in reqs], "output_tokens": [r.num_output_tokens for r in reqs],
        "cached_tokens": [r.num_cached_tokens for r in reqs], "preemptions": [r.num_preemptions for r in reqs],
        "evicted_tokens": [r.kv_evicted_tokens for r in reqs],
        "attention_mass_retained": [r.kv_mass_sum / r.kv_mass_steps if r.kv_mass_steps else math.nan for r in reqs],
        "token_times_s": token_time_arrays(times),
    }
    # no rows: object columns, as a table built from no records
    df = pd.DataFrame(columns) if reqs else pd.DataFrame(columns=list(columns))
    df["queueing_s"] = df["first_scheduled_s"] - df["arrival_s"]
    set_latencies(df)
    return df[list(REQUEST_COLUMNS)]


def token_time_arrays(token_times: list) -> list[np.ndarray]:
    """Each request's token times as a float64 array: views of one buffer filled by a single copy
    (a numpy array made per request costs ~5x more)."""
    offsets, values = flat_token_times(token_times)
    bounds = offsets.tolist()
    return [values[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=False)]


def set_latencies(df: pd.DataFrame) -> None:
    """TTFT, TPOT and E2E of each request from its arrival, first-token and finish times (in place)."""
    df["ttft_s"] = df["first_token_s"] - df["arrival_s"]
    n_out = df["output_tokens"].astype("float64")
    df["tpot_s"] = np.where(n_out > 1, (df["finish_s"] - df["first_token_s"]) / (n_out - 1), math.nan)
    df["e2e_s"] = df["finish_s"] - df["arrival_s"]


def add_client_queue(req_df: pd.DataFrame, client_arrival: dict[int, float]) -> None:
    """With a concurrency limit (`trace_options.max_concurrency`): when each request reached the client
    and how long it waited there for a slot (vLLM's client_queue_time); `arrival_s` is when it was sent."""
    reached = req_df["request_id"].map(client_arrival).astype("float64")
    req_df["client_arrival_s"] = reached
    req_df["client_queue_s"] = req_df["arrival_s"] - reached


def flat_token_times(token_times) -> tuple[np.ndarray, np.ndarray]:
    """(offsets [n + 1], values): every request's token times in one float64 buffer; request i's
    are values[offsets[i]:offsets[i + 1]]."""
    parts = [t if isinstance(t, array) and t.typecode == "d" else np.ascontiguousarray(t, dtype=np.float64)
             for t in token_times]
    offsets = np.zeros(len(parts) + 1, dtype=np.int64)
    np.cumsum(np.fromiter(map(len, parts), np.int64, len(parts)), out=offsets[1:])
    # one bytes join of the buffers: several x faster than np.concatenate of 10^4-10^5 small arrays
    values = np.frombuffer(bytearray().join(parts), dtype=np.float64)
    return offsets, values


def inter_token_latencies(token_times) -> np.ndarray:
    """Gaps between consecutive output tokens of each request, all requests concatenated."""
    return list_gaps(*flat_token_times(token_times))


def list_gaps(offsets: np.ndarray, times: np.ndarray, *, overwrite: bool = False) -> np.ndarray:
    """Gaps between consecutive values of each list (lists given as offsets [n + 1] and values).
    `overwrite`: `times` may be overwritten; the gaps are then computed into its own memory (a view
    of it is returned), not into two fresh buffers of its size, each faulted in page by page."""
    if times.size == 0:
        return np.array([])
    first_of_list = offsets[1:-1]                          # a list's first value follows another's last
    keep = np.ones(times.size - 1, dtype=bool)
    keep[first_of_list[(first_of_list > 0) & (first_of_list < times.size)] - 1] = False
    return _gaps_in_place(times, keep) if overwrite else np.diff(times)[keep]


GAPS_SLICE = 1 << 16


def _gaps_in_place(times: np.ndarray, keep: np.ndarray) -> np.ndarray:
    """np.diff(times)[keep] written to the front of `times`, one slice at a time: the kept gaps before
    a slice are at most its start, so no value is overwritten before it is read."""
    n = 0
    for start in range(0, keep.size, GAPS_SLICE):
        end = min(start + GAPS_SLICE, keep.size)
        part = (times[start + 1:end + 1] - times[start:end])[keep[start:end]]
        times[n:n + part.size] = part
        n += part.size
    return times[:n]


def _pct(values: pd.Series, q: float) -> float:
    v = values.dropna().to_numpy()
    return float(np.percentile(v, q)) if v.size else math.nan


# step-log columns the run summary reads (incl. the eviction summary of sim/kv/metrics.py)
SUMMARY_STEP_COLUMNS = ("duration_s", "blocks_used", "fragmentation", "batch_size", "preemptions",
                        "bytes_moved", "blocks_freed_by_eviction", "evicted_tokens")


def summarize(requests: pd.DataFrame, steps: pd.DataFrame | dict, *, num_blocks_total: int,
              slo_ttft_s: float | None = None, slo_tpot_s: float | None = None,
              prefix_queries: int = 0, prefix_hits: int = 0, tokens=None) -> dict:
    """The run's summary. `steps`: the step log (or its figures, `step_figures_from_file`); `tokens`
    (sim.results.request_log.TokenStats): the token times' figures when the table has no token_times_s column."""
    done = requests[requests["status"] == "finished"]
    start = float(requests["arrival_s"].min()) if len(requests) else 0.0
    end = float(done["finish_s"].max()) if len(done) else start
    span = max(end - start, 1e-12)
    out_tokens = int(done["output_tokens"].sum())
    in_tokens = int(done["prompt_tokens"].sum())
    s: dict = {
        "num_requests": int(len(requests)),
        "num_finished": int(len(done)),
        "num_rejected": int((requests["status"] == "rejected").sum()),
        "num_unfinished": int((requests["status"] == "unfinished").sum()),
        "num_aborted": int((requests["status"] == "aborted").sum()),
        "makespan_s": end - start,
        "throughput_req_s": len(done) / span,
        "throughput_output_tok_s": out_tokens / span,
        "throughput_total_tok_s": (out_tokens + in_tokens) / span,
    }
    for metric in ("ttft_s", "tpot_s", "e2e_s", "queueing_s"):
        for q in (50, 90, 99):
            s[f"{metric[:-2]}_p{q}_s"] = _pct(done[metric], q)
        s[f"{metric[:-2]}_mean_s"] = float(done[metric].mean()) if len(done) else math.nan
    itl = inter_token_latencies(done["token_times_s"]) if tokens is None else tokens.itl
    itl_q = (np.percentile(itl, (50, 90, 99)) if tokens is None else itl.percentile((50, 90, 99))) \
        if itl.size else [math.nan] * 3
    for q, v in zip((50, 90, 99), itl_q, strict=False):
        s[f"itl_p{q}_s"] = float(v)
    if slo_ttft_s is not None or slo_tpot_s is not None:
        ok = np.ones(len(done), dtype=bool)
        if slo_ttft_s is not None:
            ok &= done["ttft_s"].to_numpy() <= slo_ttft_s
        if slo_tpot_s is not None:
            ok &= np.nan_to_num(done["tpot_s"].to_numpy(), nan=0.0) <= slo_tpot_s
        s["slo_attainment"] = float(ok.sum() / max(len(requests), 1))
        s["goodput_req_s"] = float(ok.sum() / span)
    if isinstance(steps, dict):
        s.update({k: v for k, v in steps.items() if k in STEP_FIGURES})
    elif len(steps):
        dur = steps["duration_s"].to_numpy()
        util = steps["blocks_used"].to_numpy() / num_blocks_total
        s["num_steps"] = int(len(steps))
        s["kv_util_mean"] = float(np.average(util, weights=dur)) if dur.sum() > 0 else float(util.mean())
        s["kv_util_max"] = float(util.max())
        frag = steps["fragmentation"].to_numpy()
        s["fragmentation_mean"] = float(np.average(frag, weights=dur)) if dur.sum() > 0 else float(frag.mean())
        s["fragmentation_p99"] = float(np.percentile(frag, 99))
        s["batch_size_mean"] = float(steps["batch_size"].mean())
        s["preemptions"] = int(steps["preemptions"].sum())
        s["step_duration_mean_s"] = float(dur.mean())
        for q, v in zip((50, 90, 99), np.percentile(dur, (50, 90, 99)), strict=True):
            s[f"step_duration_p{q}_s"] = float(v)
    s["preemption_rate"] = float(requests["preemptions"].sum() / max(len(requests), 1))
    s["prefix_hit_rate"] = prefix_hits / prefix_queries if prefix_queries else 0.0
    return s


STEP_FIGURES = ("num_steps", "kv_util_mean", "kv_util_max", "fragmentation_mean", "fragmentation_p99",
                "batch_size_mean", "preemptions", "step_duration_mean_s", "step_duration_p50_s", "step_duration_p90_s",
                "step_duration_p99_s")


def class_figures(classes, requests: pd.DataFrame) -> dict:
    """summary.json's `workload_classes` of a workload spec's run (traces/workload.py): per client class,
    its requests, finished ones, TTFT / TPOT p50 and p99 (s) and, where the class has SLOs, the share of its
    requests that finished within them (the goodput rule of `summarize`, per class)."""
    of_request = requests["request_id"].map(classes.of_request)
    out = {}
    for name, (slo_ttft, slo_tpot) in classes.slos.items():
        rows = requests[(of_request == name).to_numpy()]
        done = rows[rows["status"] == "finished"]
        figures = {"requests": int(len(rows)), "finished": int(len(done))}
        for metric in ("ttft_s", "tpot_s"):
            for q in (50, 99):
                figures[f"{metric[:-2]}_p{q}_s"] = _pct(done[metric], q)
        if slo_ttft is not None or slo_tpot is not None:
            ok = np.ones(len(done), dtype=bool)
            if slo_ttft is not None:
                ok &= done["ttft_s"].to_numpy() <= slo_ttft
            if slo_tpot is not None:
                ok &= np.nan_to_num(done["tpot_s"].to_numpy(), nan=0.0) <= slo_tpot
            figures.update(slo_ttft_s=slo_ttft, slo_tpot_s=slo_tpot,
                           slo_attainment=float(ok.sum() / max(len(rows), 1)))
        out[name] = figures
    return out
