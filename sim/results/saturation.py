"""Is a run over capacity? Queue growth over the run and the rate the engine sustained.

An engine fed faster than it can serve builds a waiting queue that grows for as long as the load
lasts; one fed below capacity sees its queue come and go. Read from the request table alone (so a
streamed run, a replay and a `vllm bench serve` result replayed as a trace are judged alike):

- the offered rate: requests per second over the arrival window (first to last arrival; with a
  closed-loop client, when requests reached the client);
- the waiting queue Q(t): requests arrived and not yet scheduled once (those aborted or never
  scheduled count to the end), sampled at SAMPLES evenly spaced times over the arrival window;
- its growth: the least-squares slope of Q over the window's second half (the first half is the
  warm-up of a run that starts empty);
- over capacity: the queue grew over that half by at least GROWTH_SHARE of the requests that
  arrived in it (and by at least MIN_GROWTH requests), or the client gave up on at least
  GROWTH_SHARE of them while they still waited (a timeout drains the queue it would have built);
- the sustainable rate, over capacity: the finish rate of requests while the engine is backlogged,
  from the middle of the arrival window (or the first finish, if later) to the last time a request
  still waited (the queue drains after the last arrival): the requests per second this engine
  completes at this request mix when it never runs dry.
  Below capacity the engine kept up: the offered rate is a lower bound of what it sustains.
"""
from __future__ import annotations

import math

import numpy as np
import pandas as pd

SAMPLES = 256          # queue samples over the arrival window
GROWTH_SHARE = 0.05    # growth (or aborts in the queue) over the second half, as a share of its arrivals
MIN_GROWTH = 8         # requests: below it a queue's growth is noise, whatever the share
MIN_REQUESTS = 20      # arrivals needed to judge a run


def saturation(requests: pd.DataFrame) -> dict:
    """The saturation keys of summary.json (documented in docs/outputs.md)."""
    arrivals = _arrival_times(requests)
    n = int(arrivals.size)
    first, last = (float(arrivals.min()), float(arrivals.max())) if n else (0.0, 0.0)
    if n < MIN_REQUESTS or last <= first:
        why = (f"{n} requests: at least {MIN_REQUESTS} are needed" if n < MIN_REQUESTS
               else "every request arrived at once: no arrival window to judge a rate over")
        return {"overloaded": None, "saturation_reason": why, "offered_rate_req_s": None, "sustainable_rate_req_s": None,
                "queue_growth_req_s": None, "waiting_at_last_arrival": None, "waiting_max": None}
    offered = (n - 1) / (last - first)
    scheduled = _scheduled_times(requests, arrivals)
    times = np.linspace(first, last, SAMPLES)
    waiting = _count_before(arrivals, times) - _count_before(scheduled, times)
    half = times >= first + (last - first) / 2
    slope = float(np.polyfit(times[half], waiting[half], 1)[0])
    mid = first + (last - first) / 2
    arrived_half = int(((arrivals >= mid) & (arrivals <= last)).sum())
    growth = slope * (last - mid)
    aborted_waiting = _aborted_while_waiting(requests, mid, last)
    needed = max(MIN_GROWTH, GROWTH_SHARE * arrived_half)
    overloaded = growth >= needed or aborted_waiting >= needed
    out = {"overloaded": bool(overloaded),
           "saturation_reason": _reason(overloaded, growth, aborted_waiting, arrived_half),
           "offered_rate_req_s": offered,
           "sustainable_rate_req_s": _backlogged_finish_rate(requests, arrivals, scheduled, mid) if overloaded else None,
           "queue_growth_req_s": slope,
           "waiting_at_last_arrival": int(waiting[-1]),
           "waiting_max": int(waiting.max())}
    return out


def _sent(requests: pd.DataFrame) -> pd.DataFrame:
    """The requests that queued: not rejected (a rejected request never queues), and sent (a session's
    turns after a rejected turn are never sent: they have no arrival time)."""
    column = "client_arrival_s" if "client_arrival_s" in requests else "arrival_s"
    return requests[(requests["status"] != "rejected") & requests[column].notna()]


def _arrival_times(requests: pd.DataFrame) -> np.ndarray:
    """When requests reached the client (a closed loop's queue at the client counts) or were sent."""
    column = "client_arrival_s" if "client_arrival_s" in requests else "arrival_s"
    return _sent(requests)[column].to_numpy(np.float64)


def _scheduled_times(requests: pd.DataFrame, arrivals: np.ndarray) -> np.ndarray:
    """When each request that queued was first scheduled; inf for one never scheduled."""
    live = _sent(requests)
    sent = live["arrival_s"].to_numpy(np.float64)
    queued = live["queueing_s"].to_numpy(np.float64) if "queueing_s" in live else np.full(len(live), math.nan)
    out = sent + queued
    return np.where(np.isnan(out), math.inf, out)


def _count_before(events: np.ndarray, times: np.ndarray) -> np.ndarray:
    return np.searchsorted(np.sort(events), times, side="right")


def _aborted_while_waiting(requests: pd.DataFrame, start: float, end: float) -> int:
    """Requests arriving in [start, end] that the client gave up on before they were ever scheduled."""
    if "queueing_s" not in requests:
        return 0
    arrived = requests["arrival_s"].between(start, end)
    return int((arrived & (requests["status"] == "aborted") & requests["queueing_s"].isna()).sum())


def _backlogged_finish_rate(requests: pd.DataFrame, arrivals: np.ndarray, scheduled: np.ndarray,
                            mid: float) -> float | None:
    """Finished requests per second from `mid` (or the first finish, if later) to the last time a
    request still waited to be scheduled."""
    finish = np.sort(requests.loc[requests["status"] == "finished", "finish_s"].to_numpy(np.float64))
    waited = scheduled[np.isfinite(scheduled) & (scheduled > arrivals)]
    if not finish.size or not waited.size:
        return None
    start, end = max(mid, float(finish[0])), float(waited.max())
    if end <= start:
        return None
    return float(((finish > start) & (finish <= end)).sum() / (end - start))


def _reason(overloaded: bool, growth: float, aborted: int, arrived: int) -> str:
    if not overloaded:
        return (f"the waiting queue grew by {max(growth, 0.0):.0f} requests over the second half of the arrivals "
                f"({arrived} arrived): the engine kept up")
    if growth >= aborted:
        return (f"the waiting queue grew by {growth:.0f} requests over the second half of the arrivals "
                f"({arrived} arrived): over capacity")
    return f"the client gave up on {aborted} of the {arrived} requests of the second half while they waited: over capacity"
