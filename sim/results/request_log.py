"""Requests summarised as they finish and streamed to requests.parquet, so a run's memory does not grow
with its finished requests (issue 32).

`RequestLog` takes the requests that finished or were rejected (collected from the schedulers' lists
every so often) and emits their rows in request-id order (the order of requests.parquet) as soon as
every lower id is done. While the rows kept hold fewer than `chunk_tokens` token times and
`chunk_rows` rows, nothing is written: a run that never exceeds that is written at the end in one
piece, exactly as before (same bytes). Past it, whole chunks are written as Parquet row groups and the
requests' token times released; the summary is then computed from the file (one column at a time for
the per-request metrics, row group by row group for the token times: `TokenStats`).

Exact throughout: per-request percentiles from the full columns (8 bytes a request each), inter-token
latencies through `ValueCounts` (the gaps of one step pair are the same float for every request in it,
so their distinct values stay few; percentiles, median exact as numpy's; mean and standard deviation from
the exact distribution, equal to numpy's pairwise sums to ~1e-15 relative).
"""
from __future__ import annotations

import math
from typing import NamedTuple
from collections.abc import Callable

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from .metrics import SUMMARY_STEP_COLUMNS, flat_token_times, list_gaps
from ..io.safe_io import deferred_interrupts
from .pandas_schema import PandasSchemaError, arrow_table



class ValueCounts:
    """Exact distribution of float64 values: kept raw up to `raw_limit` values (numpy's own results,
    bit for bit), then as runs of sorted distinct values with their counts (one run per `raw_limit`
    values added; exact order statistics by a search over the values' bit patterns, no merge)."""

    def __init__(self, raw_limit: int = 1 << 20, max_runs: int = 512):
        self.raw_limit, self.max_runs = raw_limit, max_runs
        self._raw: list[np.ndarray] = []
        self._raw_n = 0
        self.runs: list[tuple[np.ndarray, np.ndarray]] = []     # (sorted order keys, counts)
        self._cums: list[np.ndarray] | None = None              # cumulative counts of each run

    def add(self, v: np.ndarray) -> None:
        if v.size:
            self._raw.append(np.asarray(v, dtype=np.float64))
            self._raw_n += v.size
            if self._raw_n > self.raw_limit:
                self._flush()

    def _flush(self) -> None:
        if not self._raw:
            return
        keys, counts = np.unique(_order_keys(np.concatenate(self._raw)), return_counts=True)
        self._raw, self._raw_n, self._cums = [], 0, None
        self.runs.append((keys, counts.astype(np.int64)))
        if len(self.runs) > self.max_runs:          # values repeating across runs: one run of them all
            keys = np.concatenate([k for k, _ in self.runs])
            counts = np.concatenate([c for _, c in self.runs])
            order = np.argsort(keys, kind="stable")
            keys, counts = keys[order], counts[order]
            starts = np.flatnonzero(np.concatenate(([True], keys[1:] != keys[:-1])))
            self.runs = [(keys[starts], np.add.reduceat(counts, starts))]

    @property
    def compacted(self) -> bool:
        return bool(self.runs)

    def raw(self) -> np.ndarray:
        """All values in the order added (only before compaction)."""
        return np.concatenate(self._raw) if self._raw else np.array([], dtype=np.float64)

    @property
    def size(self) -> int:
        return self._raw_n + sum(int(c.sum()) for _, c in self.runs)

    def finish(self) -> None:
        if self.runs:
            self._flush()

    def _kth(self, k: int) -> float:
        """The k-th smallest value (0-based): the smallest key with more than k values at or below it."""
        lo, hi = min(int(keys[0]) for keys, _ in self.runs), max(int(keys[-1]) for keys, _ in self.runs)
        cums = self._cums if self._cums is not None else [np.cumsum(c) for _, c in self.runs]
        self._cums = cums
        while lo < hi:
            mid = (lo + hi) // 2
            at_or_below = sum(int(cum[i - 1]) if (i := int(np.searchsorted(keys, mid, side="right"))) else 0
                              for (keys, _), cum in zip(self.runs, cums, strict=False))
            if at_or_below > k:
                hi = mid
            else:
                lo = mid + 1
        return float(_from_order_key(np.int64(lo)))

    def percentile(self, q):
        """numpy's percentile (linear method), over the compacted values."""
        if not self.compacted:
            return np.percentile(self.raw(), q)
        self.finish()
        n = self.size
        virtual = np.asanyarray((n - 1) * np.true_divide(q, 100))
        prev = np.clip(np.floor(virtual), 0, n - 1).astype(np.int64)
        nxt = np.clip(np.floor(virtual) + 1, 0, n - 1).astype(np.int64)
        nxt = np.where(virtual >= n - 1, n - 1, nxt)
        a = np.array([self._kth(int(k)) for k in prev.ravel()]).reshape(prev.shape)
        b = np.array([self._kth(int(k)) for k in nxt.ravel()]).reshape(nxt.shape)
        gamma = np.asanyarray(virtual - np.floor(virtual))
        diff = b - a
        out = np.where(gamma >= 0.5, b - diff * (1 - gamma), a + diff * gamma)
        return out[()] if out.ndim == 0 else out

    def median(self) -> float:
        if not self.compacted:
            return float(np.median(self.raw()))
        self.finish()
        n = self.size
        if n % 2:
            return self._kth((n - 1) // 2)
        return (self._kth(n // 2 - 1) + self._kth(n // 2)) / 2

    def _weighted_sum(self, f) -> float:
        return math.fsum(float(np.dot(f(_from_order_key(keys)), counts)) for keys, counts in self.runs)

    def mean(self) -> float:
        if not self.compacted:
            return float(np.mean(self.raw()))
        self.finish()
        return self._weighted_sum(lambda v: v) / self.size

    def std(self) -> float:
        if not self.compacted:
            return float(np.std(self.raw()))
        mean = self.mean()
        return math.sqrt(self._weighted_sum(lambda v: (v - mean) ** 2) / self.size)


_LOW_BITS = np.int64(0x7FFFFFFFFFFFFFFF)


def _order_keys(v: np.ndarray) -> np.ndarray:
    """int64 keys ordered as the float64 values (negative floats' bits reversed)."""
    bits = v.view(np.int64)
    return bits ^ ((bits >> 63) & _LOW_BITS)


def _from_order_key(keys):
    keys = np.asarray(keys, dtype=np.int64)
    return (keys ^ ((keys >> 63) & _LOW_BITS)).view(np.float64)


class TokenStats(NamedTuple):
    """What the summary needs from every finished request's token times."""
    itl: ValueCounts                 # gaps between consecutive output tokens of a request, all requests
    peak_tokens_per_s: float         # most tokens in one whole second counted from `start`


class ExactValues:
    """Values kept whole, with ValueCounts' interface: numpy's own mean, std, median and percentiles
    of them, bit for bit. The mean and std are taken first, since the order statistics then reorder
    the values in place (no copy of millions of gaps per statistic), which would change a sum's order."""

    def __init__(self, values: np.ndarray):
        self._values = values
        self.size = values.size
        self._mean = float(np.mean(values)) if values.size else math.nan
        self._std = float(np.std(values)) if values.size else math.nan

    def mean(self) -> float:
        return self._mean

    def std(self) -> float:
        return self._std

    def median(self) -> float:
        return float(np.median(self._values, overwrite_input=True))

    def percentile(self, q):
        return np.percentile(self._values, q, overwrite_input=True)


def token_stats(token_times, start_s: float) -> TokenStats:
    """TokenStats of finished requests' token times held in memory (one array or list a request):
    what `summarize` and `bench_metrics` would compute from them, computed once."""
    offsets, times = flat_token_times(token_times)
    peak = peak_tokens_per_s(times, start_s)
    gaps = list_gaps(offsets, times, overwrite=True)        # `times` is this function's own copy
    del times                                   # before the statistics' temporaries
    return TokenStats(ExactValues(gaps), peak)


PEAK_SLICE = 1 << 16              # token times counted per slice by peak_tokens_per_s


def peak_tokens_per_s(times: np.ndarray, start_s: float) -> float:
    """Most token times in one whole second counted from `start_s` (vLLM's per-second buckets)."""
    counts = np.zeros(0, np.int64)
    # in slices: temporaries of a few hundred KiB reused, not ~4 of the whole buffer's size (each
    # fresh memory, faulted in page by page)
    for i in range(0, times.size, PEAK_SLICE):
        counts = _add_counts(counts, _second_counts(times[i:i + PEAK_SLICE], start_s))
    return float(counts.max()) if counts.size else 0.0


def _second_counts(times: np.ndarray, start_s: float) -> np.ndarray:
    """Token times in each whole second from `start_s` (0, 1, ...; none before it)."""
    buckets = (times - start_s).astype(np.int64)
    return np.bincount(buckets[buckets >= 0])


def _add_counts(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Counts of the same buckets added (either may be shorter)."""
    if b.size > a.size:
        a, b = b, a
    a[:b.size] += b
    return a


def token_stats_from_file(path, start_s: float) -> TokenStats:
    """TokenStats of the finished requests of a requests.parquet, read row group by row group."""
    itl, buckets = ValueCounts(), np.zeros(0, np.int64)
    file = pq.ParquetFile(path, pre_buffer=False)
    for i in range(file.num_row_groups):       # one row group at a time: memory stays about one's
        batch = file.read_row_group(i, columns=["status", "token_times_s"], use_threads=False)
        keep = pc.equal(batch.column(0), "finished")
        lists = pc.filter(batch.column(1), keep).combine_chunks()
        offsets = lists.offsets.to_numpy().astype(np.int64)
        times = lists.values.to_numpy()[offsets[0]:offsets[-1]]
        offsets = offsets - offsets[0]
        itl.add(list_gaps(offsets, times))
        buckets = _add_counts(buckets, _second_counts(times, start_s))
    itl.finish()
    return TokenStats(itl, float(buckets.max()) if buckets.size else 0.0)


# the columns of a streamed requests.parquet that the summary reads (8 bytes a request each)
SUMMARY_REQUEST_COLUMNS = ("request_id", "status", "arrival_s", "finish_s", "queueing_s", "ttft_s", "tpot_s",
                           "e2e_s", "prompt_tokens", "output_tokens", "preemptions", "evicted_tokens",
                           "attention_mass_retained", "client_arrival_s")


def read_request_columns(path) -> pd.DataFrame:
    """The summary's columns of a streamed requests.parquet (SUMMARY_REQUEST_COLUMNS present in it)."""
    names = [c for c in pq.read_schema(path).names if c in SUMMARY_REQUEST_COLUMNS]
    return pq.read_table(path, columns=names, use_threads=False).to_pandas(self_destruct=True)


# streaming starts once the rows ready hold this many token times or rows (~64 MiB of token times; a run
# below it is written whole at the end, as before); from then on rows are written in row groups of about
# WRITE_TOKENS token times (at most CHUNK_ROWS rows)
CHUNK_TOKENS = 1 << 23
CHUNK_ROWS = 1 << 16
WRITE_TOKENS = 1 << 20


class RequestLog:
    """Finished requests' rows, emitted in request-id order and streamed to `path` in chunks.

    `frame(requests)` makes the rows (a DataFrame: sim.results.metrics.request_table and the client view);
    `stream`: whether chunks may be written before the end (False: the whole table at the end)."""

    def __init__(self, requests: list, path, frame: Callable[[list], pd.DataFrame], *, stream: bool = True,
                 chunk_tokens: int | None = None, chunk_rows: int | None = None):
        self.path = path
        self.frame = frame
        self.requests = requests
        self.chunk_tokens = CHUNK_TOKENS if chunk_tokens is None else chunk_tokens
        self.chunk_rows = CHUNK_ROWS if chunk_rows is None else chunk_rows
        ids = np.fromiter((r.request_id for r in requests), np.int64, len(requests))
        self.sorted_ids = np.sort(ids, kind="stable")
        # rows come out in id order as ids finish: needs distinct ids (else all rows wait to the end)
        self.stream = stream and path is not None and (
            ids.size < 2 or bool((self.sorted_ids[1:] != self.sorted_ids[:-1]).all()))
        self.done = np.zeros(len(requests), dtype=bool)
        self.pending: dict[int, object] = {}     # rank -> finished request waiting for lower ids
        self.watermark = 0                       # ranks below it are in `ready` or written
        self.ready: list = []
        self.ready_tokens = 0
        self._seen: dict[int, list[int]] = {}    # replica scheduler -> how many finished/rejected/aborted taken
        self._writer: pq.ParquetWriter | None = None
        self._schema: pa.Schema | None = None
        self.rows_written = 0

    @property
    def streamed(self) -> bool:
        return self._writer is not None

    def collect(self, schedulers) -> None:
        """Take the requests the schedulers finished or rejected since the last call."""
        new = []
        for i, s in enumerate(schedulers):
            seen = self._seen.setdefault(i, [0, 0, 0])
            new += s.finished[seen[0]:]
            new += s.rejected[seen[1]:]
            new += s.aborted[seen[2]:]
            seen[0], seen[1], seen[2] = len(s.finished), len(s.rejected), len(s.aborted)
        if not new or not self.stream:
            return
        ranks = np.searchsorted(self.sorted_ids, [r.request_id for r in new])
        for rank, req in zip(ranks.tolist(), new, strict=False):
            self.done[rank] = True
            self.pending[rank] = req
        done, pending, ready = self.done, self.pending, self.ready
        wm = self.watermark
        while wm < done.size and done[wm]:
            req = pending.pop(wm)
            ready.append(req)
            self.ready_tokens += len(req.token_times)
            wm += 1
        self.watermark = wm
        if self.streamed or self.ready_tokens >= self.chunk_tokens or len(ready) >= self.chunk_rows:
            self._write_ready(whole=False)

    def _write_ready(self, whole: bool) -> None:
        """Write the ready rows in pieces of about WRITE_TOKENS token times (`whole`: the last, shorter
        piece too)."""
        while self.ready:
            n = tokens = 0
            for r in self.ready:
                if n and (tokens + len(r.token_times) > WRITE_TOKENS or n >= self.chunk_rows):
                    break
                n += 1
                tokens += len(r.token_times)
            if n == len(self.ready) and not whole and tokens < WRITE_TOKENS:
                return
            self._write(self.ready[:n], tokens)

    def _write(self, reqs: list, tokens: int) -> None:
        table = self._arrow(self.frame(reqs))
        with deferred_interrupts():
            if self._writer is None:
                self._writer = pq.ParquetWriter(self.path, self._schema, use_dictionary=False)
            self._writer.write_table(table)
            self.rows_written += len(reqs)
            del self.ready[:len(reqs)]
            self.ready_tokens -= tokens
        for r in reqs:
            del r.token_times[:]               # written: the Request keeps an empty array
            r.route = None                     # and no route (the cluster layer's record: not in the row)

    def _arrow(self, df: pd.DataFrame) -> pa.Table:
        table = requests_arrow(df)
        if self._schema is None:
            self._schema = table.schema
        return table.cast(self._schema)

    def finish(self, included: list) -> pd.DataFrame | None:
        """The table of the `included` requests (those that arrived) when nothing was streamed, else
        None after writing the rest to the file."""
        if not self.streamed:
            return self.frame(included)
        left = [r for r in included if not r.is_finished] + list(self.pending.values())
        self.ready += sorted(left, key=lambda r: r.request_id)
        self.pending = {}
        self.ready_tokens = sum(len(r.token_times) for r in self.ready)
        self._write_ready(whole=True)
        self._writer.close()
        return None

    def release(self, replicas) -> None:
        """After `finish` of a streamed run: drop the engine's references to its requests (the trace's
        list, the schedulers' finished and rejected lists), whose rows are in the file."""
        self.requests.clear()
        for replica in replicas:
            replica.scheduler.finished.clear()
            replica.scheduler.rejected.clear()
            replica.scheduler.aborted.clear()

    def close(self) -> None:
        """Release the file (a run that failed before `finish`)."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def requests_arrow(req_df: pd.DataFrame) -> pa.Table:
    """The request table as Arrow; token times become a list<double> column built from one
    concatenated buffer (pandas' object-column conversion of 10^4-10^5 arrays is several x slower)."""
    offsets, values = flat_token_times(req_df["token_times_s"])
    names = [c for c in req_df.columns if c != "token_times_s"]
    try:                                 # the table pandas would make, built from the columns (pandas_schema.py)
        table = arrow_table({n: req_df[n].to_numpy() for n in names}, {n: str(req_df[n].dtype) for n in names})
    except PandasSchemaError:            # a column kind it does not build (e.g. the source's request labels)
        table = pa.Table.from_pandas(req_df.drop(columns="token_times_s"), preserve_index=False)
    i = table.schema.get_field_index("reject_reason")
    if i >= 0 and pa.types.is_null(table.schema.field(i).type):
        # no rejection in the run: still a string column, so every run's file has one schema
        table = table.set_column(i, pa.field("reject_reason", pa.large_string()),
                                 table.column(i).cast(pa.large_string()))
    lists = pa.ListArray if offsets[-1] < 2**31 else pa.LargeListArray      # int32 offsets while they fit
    offsets = offsets.astype(np.int32) if lists is pa.ListArray else offsets
    return table.append_column("token_times_s", lists.from_arrays(pa.array(offsets), pa.array(values)))


# step logs up to this many rows are summarised from whole columns (numpy's sums, as always); longer
# ones row group by row group (`step_figures_from_file`)
WHOLE_STEP_LOG_ROWS = 1 << 20


def step_figures_from_file(path, num_blocks_total: int) -> dict:
    """summarize's step figures (and the eviction totals kv_summary reads) from a steps.parquet, one row
    group at a time: memory bounded whatever the run's length. Sums are float64 per row group (equal to
    numpy's whole-column sums to ~1e-15 relative); the fragmentation p99 is exact (sim.results.request_log.ValueCounts)."""
    n = 0
    dur_sum = util_w = frag_w = util_sum = frag_sum = batch = 0.0
    util_max = -math.inf
    totals = dict.fromkeys(("preemptions", "bytes_moved", "blocks_freed_by_eviction", "evicted_tokens"), 0)
    frags = ValueCounts()
    durations = LogHistogram()
    file = pq.ParquetFile(path, pre_buffer=False)
    for i in range(file.num_row_groups):            # one row group at a time (no read-ahead)
        group = file.read_row_group(i, columns=list(SUMMARY_STEP_COLUMNS), use_threads=False)
        cols = {name: group.column(name).to_numpy() for name in SUMMARY_STEP_COLUMNS}
        dur, frag = cols["duration_s"], cols["fragmentation"]
        util = cols["blocks_used"] / num_blocks_total
        n += dur.size
        dur_sum += float(dur.sum())
        util_w += float(np.dot(util, dur))
        frag_w += float(np.dot(frag, dur))
        util_sum += float(util.sum())
        frag_sum += float(frag.sum())
        util_max = max(util_max, float(util.max()))
        batch += float(cols["batch_size"].sum())
        frags.add(frag)
        durations.add(dur)
        for k in totals:
            totals[k] += int(cols[k].sum())
    if not n:
        return {}
    out = {"num_steps": n,
           "kv_util_mean": util_w / dur_sum if dur_sum > 0 else util_sum / n,
           "kv_util_max": util_max,
           "fragmentation_mean": frag_w / dur_sum if dur_sum > 0 else frag_sum / n,
           "fragmentation_p99": float(frags.percentile(99)),
           "batch_size_mean": batch / n, "step_duration_mean_s": dur_sum / n}
    out.update({f"step_duration_p{q}_s": durations.percentile(q) for q in (50, 90, 99)})
    out.update(totals)
    return out


class LogHistogram:
    """Percentiles of positive values to within 0.1% (log-spaced bins from 1 us to 1e4 s), in fixed
    memory: a step log's durations, which rarely repeat (step-time variance), read row group by row group."""
    LOW, HIGH, BINS = -6.0, 4.0, 24_000

    def __init__(self):
        self.counts = np.zeros(self.BINS + 2, np.int64)        # below LOW, the bins, above HIGH

    def add(self, values: np.ndarray) -> None:
        logs = np.log10(np.maximum(values, 1e-300))
        idx = np.clip(np.floor((logs - self.LOW) / (self.HIGH - self.LOW) * self.BINS).astype(np.int64) + 1,
                      0, self.BINS + 1)
        self.counts += np.bincount(idx, minlength=self.BINS + 2)

    def percentile(self, q: float) -> float:
        """The bin centre holding the q-th percentile (nearest rank); NaN when empty."""
        n = int(self.counts.sum())
        if not n:
            return math.nan
        i = int(np.searchsorted(np.cumsum(self.counts), max(1, math.ceil(q / 100 * n))))
        i = min(max(i, 1), self.BINS)
        return 10 ** (self.LOW + (i - 0.5) * (self.HIGH - self.LOW) / self.BINS)
