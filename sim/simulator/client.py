"""The frontend: what a `vllm bench serve` client sees beyond the engine (`--frontend NAME`: a named set
of terms in sim/data/frontends.yaml, or `profile` / `--client-latency`: the GPU profile's `client`
terms; docs/gpu-profiles.md).

A request enters the engine after the API server's serial work on it (parsing, then tokenizing its
prompt: `request_serial_s + prompt_tokens * prompt_token_s`, one request at a time in send order) and
a fixed latency (`Frontend`; the trace's arrival times, or the closed loop's sends, are the client's
sends); the API server then processes
each step's output tokens serially, `output_token_s` each,
so a token reaches the client when the server has processed it and everything before it:

    done_k = max(done_{k-1}, t_k) + n_k * output_token_s

over the distinct token times t_k of a replica (n_k tokens each), i.e. done_k = C_k + max_{j<=k}(t_j -
C_{j-1}) with C the cumulative server work: one running maximum, vectorized.

A new request's handler yielding to the shared loop (`handler_yields` K > 1, `stream_s`; issue 54): each
of its K - 1 later resumptions queues behind one engine step's streaming, `stream_s` x the streams in
flight after the latest step (`Frontend.yield_waits`; docs/gpu-profiles.md). K = 1 (the default): none.

Per-request variation (`frontend_jitter`, `RequestJitter`): real requests do not all take the same time
through the client and the API server (HTTP handling, the asyncio loops of the client and the server,
the IPC to the engine core), and that spread is what knocks a fixed-length closed loop out of lockstep.
With a sigma > 0 request i's fixed latency is `request_s * exp(sigma z_i - sigma^2 / 2)`, a mean-one
lognormal (the mean kept, the median below it), z_i from a counter-based stream keyed by (seed,
request id) alone, so a run is reproducible and does not depend on the order requests are sent in.
Off (0, the default): no factor at all, today's results byte for byte.
"""
from __future__ import annotations

import math

import numpy as np
import pandas as pd
import yaml

from ..engine.step_noise import StepNoise
from ..model.cost_model import FRONTENDS_FILE, ClientLatency
from ..results.metrics import flat_token_times, set_latencies

# the key of the frontend's stream of draws beside the replicas' step-noise streams (0, 1, ...)
JITTER_STREAM = 2**32 + 54


class RequestJitter:
    """The factors of the requests' fixed frontend latency (see the module docstring): request i's is
    the i-th draw of a mean-one lognormal stream keyed by (seed, JITTER_STREAM)."""

    def __init__(self, sigma: float, seed: int):
        self.sigma = float(sigma)
        self._draws = StepNoise(sigma, seed, JITTER_STREAM)

    def factor(self, request_id: int) -> float:
        return self._draws.factor(int(request_id))


def fitted_jitter() -> dict:
    """sim/data/frontends.yaml's `request_jitter` entry: {sigma, fitted_to, source}."""
    return yaml.safe_load(FRONTENDS_FILE.read_text())["request_jitter"]


def resolve_jitter(setting: float | str) -> float:
    """The sigma of `frontend_jitter`: the configured number, or (auto) frontends.yaml's fitted one."""
    return float(fitted_jitter()["sigma"]) if setting == "auto" else float(setting)


def request_jitter(setting: float | str, seed: int) -> RequestJitter | None:
    """The run's per-request variation of the frontend's fixed latency (None when off)."""
    sigma = resolve_jitter(setting)
    return RequestJitter(sigma, seed) if sigma > 0 else None


class Frontend:
    """The API server between the client's sends and the engine: when a request the client sent enters
    the engine. The server takes requests one at a time in send order (`ClientLatency.serial_s`: parsing
    and tokenizing its prompt), then `request_s` of fixed latency. Remembers each request's send time
    for `client_view` and the client's timeout. `jitter`: the per-request variation of `request_s`
    (None: every request takes `request_s`)."""

    def __init__(self, client: ClientLatency, jitter: RequestJitter | None = None):
        self.client = client
        self.jitter = jitter
        self.shared = client.shared_loop
        self.serial = client.request_serial_s > 0 or client.prompt_token_s > 0 or self.shared
        self.server_free = -math.inf
        self.sent: dict[int, float] = {}
        # shared loop: (replica, engine time of a step's tokens) -> when the server has streamed them
        self.delivered: dict[tuple[int, float], float] = {}
        self.last_streamed = (-math.inf, -math.inf)      # (engine time, streamed by) of the latest step told
        # handler_yields > 1: each replica's latest step's streaming work (output tokens x stream_s)
        self.step_work: dict[int, float] = {}

    def enter(self, request_id: int, send_time: float, prompt_tokens: int = 0) -> float:
        """When the request sent at `send_time` enters the engine. With a shared loop it is called at
        `send_time` in the simulation (the queue takes entries and outputs in time order)."""
        self.sent[request_id] = send_time
        fixed = self.client.request_s if self.jitter is None else self.client.request_s * self.jitter.factor(request_id)
        if not self.serial:
            return send_time + fixed
        self.server_free = max(self.server_free, send_time) + self.client.serial_s(prompt_tokens)
        return self.server_free + self.yield_waits() + fixed

    def yield_waits(self) -> float:
        """Shared loop with `handler_yields` K > 1: the handler's K - 1 later resumptions each queue behind
        one engine step's streaming (asyncio's ready queue is FIFO and the output handler wakes every
        stream of a step at once): (K - 1) x stream_s x the streams in flight after the latest step told,
        summed over replicas (one API server). 0 with K = 1, before any step produced tokens, or with
        nothing streaming."""
        if self.client.handler_yields <= 1 or not self.step_work:
            return 0.0
        return (self.client.handler_yields - 1) * sum(self.step_work.values())

    def outputs(self, replica: int, time_s: float, tokens: int, streams: int | None = None) -> None:
        """Shared loop: replica `replica`'s step ending at `time_s` produced `tokens` output tokens; the
        server streams them after the work queued before them (EngineReplica calls it at the step's end).
        `streams`: the replica's requests still streaming after the step (None: `tokens`), whose next
        step's streaming a new request's handler waits behind (`handler_yields`)."""
        self.server_free = max(self.server_free, time_s) + tokens * self.client.output_token_s
        self.delivered[(replica, time_s)] = self.server_free
        self.last_streamed = (time_s, self.server_free)
        if self.client.handler_yields > 1:
            self.step_work[replica] = (tokens if streams is None else streams) * self.client.stream_s

    def received_by(self, now: float) -> float:
        """When the client has the tokens the engine produced at `now` (shared loop: once the server has
        streamed the step that ended at `now`; otherwise, or for a request that produced nothing then, `now`)."""
        at, streamed = self.last_streamed
        return streamed if self.shared and at == now else now


def client_view(req_df: pd.DataFrame, client: ClientLatency, sent: dict[int, float],
                delivered: dict[tuple[int, float], float] | None = None) -> pd.DataFrame:
    """The request table as the client measures it: arrival at the client's send (`sent`: request id
    -> send time), token times after the API server's serial work (with a shared loop, `delivered`:
    `Frontend.delivered`); queueing stays the engine's."""
    if not client.enabled or req_df.empty:
        return req_df
    df = req_df.copy()
    df["arrival_s"] = df["request_id"].map(sent).astype("float64").fillna(df["arrival_s"])
    if client.output_token_s > 0:
        df["token_times_s"] = (_served_token_times(df, client.output_token_s) if delivered is None
                               else _delivered_token_times(df, delivered))
        first = np.array([t[0] if len(t) else math.nan for t in df["token_times_s"]])
        last = np.array([t[-1] if len(t) else math.nan for t in df["token_times_s"]])
        df["first_token_s"] = first
        df["finish_s"] = np.where(df["status"] == "finished", last, math.nan)
    set_latencies(df)
    return df


def _delivered_token_times(df: pd.DataFrame, delivered: dict[tuple[int, float], float]) -> list[np.ndarray]:
    """Token times as the shared loop streamed them (a time the loop was not told of stays as it is)."""
    out = []
    for replica, times in zip(df["replica"].tolist(), df["token_times_s"], strict=True):
        out.append(np.array([delivered.get((replica, t), t) for t in np.asarray(times, dtype=np.float64).tolist()],
                            dtype=np.float64))
    return out


def _served_token_times(df: pd.DataFrame, per_token_s: float) -> list[np.ndarray]:
    offsets, values = flat_token_times(df["token_times_s"])
    replica = np.repeat(df["replica"].to_numpy(), np.diff(offsets))
    served = np.empty_like(values)
    for r in np.unique(replica):
        idx = np.flatnonzero(replica == r)
        served[idx] = _serial_server(values[idx], per_token_s)
    return [served[offsets[i]:offsets[i + 1]] for i in range(len(df))]


def _serial_server(times: np.ndarray, per_token_s: float) -> np.ndarray:
    """Client times of tokens produced at `times` by one engine, through one serial server."""
    t, inverse, counts = np.unique(times, return_inverse=True, return_counts=True)
    work = np.cumsum(counts) * per_token_s                       # C_k
    before = np.concatenate(([0.0], work[:-1]))                  # C_{k-1}
    done = work + np.maximum.accumulate(t - before)
    return done[inverse]
