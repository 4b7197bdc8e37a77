"""Summary statistics of a trace (used by ``kvsim trace stats`` and the dashboard)."""
from __future__ import annotations

import numpy as np

from kvsim.traces.trace import Trace

PERCENTILES = (50, 90, 99)


def trace_stats(trace: Trace) -> dict:
    """A flat dict of figures; values are None where undefined (e.g. the rate of a batch at t=0).

    Keys: name, requests, span_s, mean_rate_rps (requests / span), interarrival_cv (std/mean of
    the gaps), prompt_{mean,p50,p90,p99,max}, output_{...}, prefix_block_tokens, prefix_blocks,
    prefix_repeat_share (share of prefix block ids already seen in an earlier or the same
    request), sessions, num_clipped, num_output_clamped, num_reordered.
    Percentiles use numpy's default linear interpolation.
    """
    df = trace.df
    arrivals = df["arrival_time_s"].to_numpy()
    span = float(arrivals[-1] - arrivals[0]) if len(arrivals) else 0.0
    gaps = np.diff(arrivals)
    stats: dict = {
        "name": trace.name,
        "requests": len(df),
        "span_s": span,
        "mean_rate_rps": len(df) / span if span > 0 else None,
        "interarrival_cv": float(gaps.std() / gaps.mean()) if len(gaps) and gaps.mean() > 0 else None,
    }
    for label, column in (("prompt", "prompt_tokens"), ("output", "output_tokens")):
        values = df[column].to_numpy()
        stats[f"{label}_mean"] = float(values.mean()) if len(values) else None
        for q, value in zip(PERCENTILES, np.percentile(values, PERCENTILES) if len(values) else [None] * 3, strict=True):
            stats[f"{label}_p{q}"] = None if value is None else float(value)
        stats[f"{label}_max"] = int(values.max()) if len(values) else None
    stats.update(_prefix_stats(trace))
    sessions = df["session_id"].dropna()
    stats["sessions"] = int(sessions.nunique()) if len(sessions) else None
    stats["num_clipped"] = trace.num_clipped
    stats["num_output_clamped"] = trace.num_output_clamped
    stats["num_reordered"] = trace.num_reordered
    return stats


def _prefix_stats(trace: Trace) -> dict:
    lists = [ids for ids in trace.df["prefix_hash_ids"] if ids is not None]
    if not lists:
        return {"prefix_block_tokens": None, "prefix_blocks": None, "prefix_repeat_share": None}
    blocks = np.fromiter((h for ids in lists for h in ids), dtype=np.int64)
    repeated = len(blocks) - len(np.unique(blocks))
    return {"prefix_block_tokens": trace.prefix_block_tokens, "prefix_blocks": int(len(blocks)),
            "prefix_repeat_share": repeated / len(blocks) if len(blocks) else None}
