"""Multi-turn sessions: a closed loop per session (`trace_options.sessions`, docs/kv-tiers.md#sessions).

A session's turns are requests of the trace with the same session id, in arrival order. Its first
turn arrives at its trace time; every later turn is released when the previous turn finished, plus a
think time (the user reading the answer and typing): the trace's gap between the two turns, or
`sessions.think_time_s`. This is the seam of the client-side concurrency limit (sim/engine/loop.py's
`ConcurrencyLimit`): the engine tells the client which requests left it (`ReplicaFeed.on_finished`),
and the client sends the next request, through the router (or through the concurrency limit, when
there is one) at its release time. A replica's decode fast-forward stops at each finish and at the
next release (`next_release`), exactly as it stops for the closed loop.

Content: each turn's prompt is the conversation so far (every previous prompt and answer) plus a new
user message, so its leading blocks are those of the previous turn's prompt and answer. The requests
get prefix ids by position in the session's conversation (one id per `SESSION_ID_TOKENS` tokens,
unique per session) that cover the answer too (`Request.ids_cover_output`): the prefix cache, the CPU
tier and the prefix-aware routers see the repeated history as shared blocks. A trace's own prefix ids
are replaced.
"""
from __future__ import annotations

import heapq
from collections.abc import Callable

import pandas as pd
import simpy

from ..config import ConfigError, SessionOptions
from ..core.request import Request, RequestStatus

SESSION_ID_TOKENS = 16        # tokens per prefix id of a session's conversation (the default KV block)
SHARED_PREFIX_BASE = 1 << 62  # ids of the prefix all sessions share (a trace's shared_prefix_tokens)


def session_keys(trace) -> list:
    """Each trace row's session (rows without one are sessions of one turn, keyed by their request id)."""
    df = trace.df
    sessions = df["session_id"].tolist()
    return [("row", int(rid)) if _missing(s) else ("session", s)
            for s, rid in zip(sessions, df["request_id"].tolist(), strict=True)]


def _missing(value) -> bool:
    return value is None or value is pd.NA or (isinstance(value, float) and value != value)


def apply_sessions(trace, requests: list[Request], opts: SessionOptions) -> None:
    """Give the trace's requests (in trace order) their session and the prefix ids of their session's
    conversation; with `history: append` a turn's prompt becomes the conversation so far plus the
    trace's prompt (the new message). Refused in one line: a turn whose prompt (history: in_prompt) is
    shorter than the conversation before it (the previous prompt and answer)."""
    index: dict = {}
    held: dict[int, int] = {}          # session -> tokens of its conversation so far
    shared = trace.shared_prefix_tokens // SESSION_ID_TOKENS     # whole blocks every conversation begins with
    base = 0
    bases: dict[int, int] = {}
    for key, req in zip(session_keys(trace), requests, strict=True):
        s = index.setdefault(key, len(index))
        before = held.get(s, 0)
        if opts.history == "append":
            req.prompt_tokens = before + req.prompt_tokens
        elif req.prompt_tokens < before:
            raise ConfigError(
                f"trace_options.sessions: request_id {req.request_id} (session {key[1]!r}): prompt_tokens "
                f"{req.prompt_tokens} is shorter than the conversation before it ({before} tokens: the previous "
                f"turn's prompt and answer); expected the whole conversation so far (history: in_prompt) or "
                f"give sessions.history: append (the prompt is the new message only)")
        total = req.prompt_tokens + req.max_output_tokens
        held[s] = total
        if s not in bases:
            bases[s] = base
            base += 1 << 40              # ids of different sessions never meet
        req.session = s
        ids = range(bases[s], bases[s] + -(-total // SESSION_ID_TOKENS))
        req.prefix_hash_ids = [*range(SHARED_PREFIX_BASE, SHARED_PREFIX_BASE + min(shared, len(ids))),  # type: ignore[assignment]
                               *ids[shared:]] if shared else ids
        req.prefix_block_tokens = SESSION_ID_TOKENS
        req.ids_cover_output = True


class SessionLoop:
    """The client's sessions: which turn follows which, and the turns released but not yet sent."""

    def __init__(self, env: simpy.Environment, requests: list[Request], opts: SessionOptions, entry=None):
        self.env = env
        self.entry = entry
        self.send: Callable[[Request, float], None] = lambda req, now: None     # set by the engine's assembly
        self.following: dict[int, tuple[Request, float]] = {}   # id(turn) -> (next turn, think time)
        self.released: list[Request] = []                       # later turns sent so far, in send order
        self._queue: list[tuple[float, int, Request]] = []      # (release time, order, turn): a heap
        last: dict[int, Request] = {}
        first: list[Request] = []
        self.session_of: dict[int, int] = {}     # request id -> its session (0.. in order of first arrival)
        self.turn_of: dict[int, int] = {}        # request id -> its turn in the session (0: the first)
        for req in requests:
            if req.session is None:             # not given its session (apply_sessions): a session of its own
                first.append(req)
                self.session_of[req.request_id] = -1
                self.turn_of[req.request_id] = 0
                continue
            prev = last.get(req.session)
            self.session_of[req.request_id] = req.session          # type: ignore[assignment]
            self.turn_of[req.request_id] = 0 if prev is None else self.turn_of[prev.request_id] + 1
            if prev is None:
                first.append(req)
            else:
                think = opts.think_time_s if opts.think_time_s is not None else req.arrival_time - prev.arrival_time
                self.following[id(prev)] = (req, max(think, 0.0))
            last[req.session] = req
        if entry is not None:               # the client-side API server lets each first turn in after its send
            for req in first:
                req.arrival_time = entry.enter(req.request_id, req.arrival_time)
            # a per-request frontend latency (frontend_jitter) can reorder entries: the arrival process
            # takes them in time order (stable: unchanged without it)
            first.sort(key=lambda r: r.arrival_time)
        self.first_turns = first
        self.num_requests = len(requests)

    def next_release(self) -> float:
        """When the next released turn reaches the engine (inf: none is on its way)."""
        return self._queue[0][0] if self._queue else float("inf")

    @property
    def in_transit(self) -> bool:
        return bool(self._queue)

    def finished(self, reqs: list[Request], now: float) -> None:
        """`reqs` left the engine at `now` (EngineReplica.on_finished): release their sessions' next
        turns. A turn that was rejected or aborted ends its session (the user got no answer)."""
        for req in reqs:
            nxt = self.following.pop(id(req), None)
            if nxt is None or req.status != RequestStatus.FINISHED:
                continue
            turn, think = nxt
            t = now + think
            if self.entry is not None:       # the client-side API server lets it in (sim.simulator.client)
                t = self.entry.enter(turn.request_id, t)
            turn.arrival_time = t
            heapq.heappush(self._queue, (t, turn.request_id, turn))
            self.env.process(self._release(turn))

    def _release(self, turn: Request):
        yield self.env.timeout(max(turn.arrival_time - self.env.now, 0.0))
        queue = self._queue
        queue.remove(next(e for e in queue if e[2] is turn))
        heapq.heapify(queue)
        self.released.append(turn)
        self.send(turn, self.env.now)

    def sent(self) -> list[Request]:
        return self.first_turns + self.released

