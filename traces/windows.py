"""Time windows of a trace: explicit ones (`600s:1200s`), the busiest ones by arrival rate
(`5m@peak`, `5m@peak2` for the second busiest, not overlapping the first), and the representative
sample capacity planning uses by default.

A window is always resolved to `[start_s, end_s)` on the trace's own (unscaled) clock, which is what
`trace_options.start_s/end_s` hold: a run over a window stays an ordinary, hashable configuration.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

import numpy as np

from kvsim.traces.durations import duration_seconds
from kvsim.traces.errors import TraceError
from kvsim.traces.trace import Trace

_PEAK = re.compile(r"(.+)@peak(\d*)")
_SPAN = re.compile(r"([^:]*):([^:]*)")
WINDOW_HELP = ("DUR@peak (the busiest DUR of the trace), DUR@peakK (the K-th busiest, not overlapping the "
               "busier ones), START:END (either may be empty), full (the whole trace); durations in "
               "s, m, h (e.g. 10m@peak, 600:1200, 10m:20m)")


@dataclass(frozen=True)
class Window:
    start_s: float | None        # None: from the trace's start
    end_s: float | None          # None: to its end
    label: str                   # as the user wrote it, or how it was chosen
    requests: int = 0            # requests arriving in it

    @property
    def is_full(self) -> bool:
        return self.start_s is None and self.end_s is None


def parse_duration_s(text: str, what: str = "window") -> float:
    """'10m' -> 600.0; a bare number is seconds."""
    value = duration_seconds(text, unit_required=False)
    if value is None:
        raise TraceError(None, None, f"{what}: {text!r} is not a duration (e.g. 600, 600s, 10m, 1h)")
    if not value > 0:
        raise TraceError(None, None, f"{what}: duration must be > 0, got {text!r}")
    return value


def busiest_windows(arrivals: np.ndarray, duration_s: float, k: int = 1) -> list[tuple[float, int]]:
    """The `k` busiest non-overlapping windows of `duration_s`, busiest first, as (start, requests).

    Every window starts at an arrival (the busiest window of a given length always can) and ends
    before the last one (a window running past the trace's end would be partly empty; a window longer
    than the trace is the whole trace); the i-th is the busiest one that does not overlap the i-1
    before it. Fewer than k when the trace runs out."""
    t = np.asarray(arrivals, dtype=np.float64)
    if not len(t):
        return []
    counts = np.searchsorted(t, t + duration_s, side="left") - np.arange(len(t))
    free = t <= max(t[0], t[-1] - duration_s)
    found = []
    for _ in range(k):
        if not free.any():
            break
        i = int(np.argmax(np.where(free, counts, -1)))
        found.append((float(t[i]), int(counts[i])))
        free &= (t <= t[i] - duration_s) | (t >= t[i] + duration_s)
    return found


def resolve_window(trace: Trace, spec: str) -> Window:
    """A window spec (see WINDOW_HELP) on `trace` -> the window in trace seconds."""
    text = spec.strip()
    where = trace.source or trace.name or None     # names the trace in every error
    arrivals = trace.df["arrival_time_s"].to_numpy()
    if text in ("full", "all", ""):
        return Window(None, None, "full trace", len(arrivals))
    peak = _PEAK.fullmatch(text)
    if peak:
        duration = parse_duration_s(peak.group(1), f"window {spec!r}")
        rank = int(peak.group(2) or 1)
        if rank < 1:
            raise TraceError(where, None, f"window {spec!r}: peak rank must be >= 1")
        found = busiest_windows(arrivals, duration, rank)
        if len(found) < rank:
            raise TraceError(where, None, f"window {spec!r}: the trace ({trace.duration_s:.0f} s) has only "
                                          f"{len(found)} non-overlapping {peak.group(1)} windows")
        start, n = found[rank - 1]
        return Window(start, start + duration, text, n)
    span = _SPAN.fullmatch(text)
    if span:
        start = parse_duration_s(span.group(1), f"window {spec!r} start") if span.group(1).strip() not in ("", "0") \
            else None
        end = parse_duration_s(span.group(2), f"window {spec!r} end") if span.group(2).strip() else None
        if start is not None and end is not None and not end > start:
            raise TraceError(where, None, f"window {spec!r}: end must be after start")
        lo = start if start is not None else -math.inf
        hi = end if end is not None else math.inf
        n = int(((arrivals >= lo) & (arrivals < hi)).sum())
        if n == 0:
            raise TraceError(where, None, f"window {spec!r}: no request arrives in it (the trace spans "
                                          f"{arrivals[0]:.0f}-{arrivals[-1]:.0f} s)")
        return Window(start, end, text, n)
    raise TraceError(where, None, f"window {spec!r}: expected {WINDOW_HELP}")


def representative_window(trace: Trace, *, full_max_requests: int = 4000,
                          target_requests: int = 2500) -> Window:
    """The sample capacity planning uses by default: the whole trace when it has at most
    `full_max_requests` requests (fast enough), else its busiest window holding about
    `target_requests` requests at the trace's mean rate. A p99 over the whole trace is set by its
    busiest periods, so the peak window keeps what decides the answer at a fraction of the cost."""
    n = len(trace)
    if n <= full_max_requests or trace.duration_s <= 0:
        return Window(None, None, "full trace", n)
    duration = trace.duration_s * target_requests / n
    minutes = max(1, round(duration / 60))
    return resolve_window(trace, f"{minutes}m@peak")


def window_stats(trace: Trace, window: Window) -> dict:
    """Mean rate (req/s) and inter-arrival CV of the requests in `window`."""
    t = trace.df["arrival_time_s"].to_numpy()
    lo = -math.inf if window.start_s is None else window.start_s
    hi = math.inf if window.end_s is None else window.end_s
    t = t[(t >= lo) & (t < hi)]
    span = (hi - lo) if math.isfinite(hi - lo) else (float(t[-1] - t[0]) if len(t) > 1 else 0.0)
    gaps = np.diff(t)
    return {"requests": int(len(t)), "rate_req_s": len(t) / span if span > 0 else math.nan,
            "distinct_arrivals": int(len(np.unique(t))),
            "interarrival_cv": float(gaps.std() / gaps.mean()) if len(gaps) and gaps.mean() > 0 else math.nan}
