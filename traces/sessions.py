"""Multi-turn session traces: one row per turn, ``session_id`` naming the conversation, each turn's
``prompt_tokens`` the whole conversation so far (every earlier message and answer) plus its new user
message, ``output_tokens`` its answer. Arrivals: a session's first turn at its start; each later turn at
the previous turn's arrival plus its think time, so the trace's gap between two turns is the think time
(a closed-loop run, ``trace_options.sessions``, releases a turn at the previous answer's end plus that
gap: sim/engine/sessions.py).

- ``synthetic_sessions``: seeded (turns, message and answer lengths, exponential think times, Poisson
  session starts), each drawn from its own child stream of the seed.
- ``sharegpt_sessions``: ShareGPT conversations (``{"conversations": [{"from": "human"|"gpt", ...}]}``)
  as sessions, every human message followed by a gpt answer one turn; messages counted one by one with
  a real tokenizer (the shipped SmolLM2 one by default; a chat template's few tokens per message are not
  counted).
"""
from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pandas as pd

from kvsim.traces.errors import TraceError
from kvsim.traces.synthetic import parse_length_spec
from kvsim.traces.trace import Trace, session_trace


def synthetic_sessions(num_sessions: int, *, turns="uniform:2,8", first_tokens="lognormal:1000,1.0,8000",
                       user_tokens="lognormal:200,1.0,2000", output_tokens="lognormal:250,0.8,1000",
                       think_time_s: float = 10.0, session_rate: float | None = 1.0, seed: int = 0) -> Trace:
    """`num_sessions` seeded sessions: turn counts, first-message, later-message and answer lengths
    from length specs (traces/synthetic.py), exponential think times of mean `think_time_s`, sessions
    started as a Poisson process of `session_rate` per second (None: all at t=0)."""
    if num_sessions < 1:
        raise TraceError(None, None, f"synthetic_sessions: sessions must be >= 1, got {num_sessions}")
    if not think_time_s >= 0:
        raise TraceError(None, None, f"synthetic_sessions: think_time_s must be >= 0, got {think_time_s}")
    if session_rate is not None and not session_rate > 0:
        raise TraceError(None, None, f"synthetic_sessions: session_rate must be > 0, got {session_rate}")
    streams = [np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(6)]
    counts = parse_length_spec(turns).draw(num_sessions, streams[0])
    total = int(counts.sum())
    first = parse_length_spec(first_tokens).draw(num_sessions, streams[1])
    later = parse_length_spec(user_tokens).draw(total, streams[2])
    answers = parse_length_spec(output_tokens).draw(total, streams[3])
    think = streams[4].exponential(think_time_s, total) if think_time_s > 0 else np.zeros(total)
    starts = (np.cumsum(streams[5].exponential(1.0 / session_rate, num_sessions)) - 0.0
              if session_rate is not None else np.zeros(num_sessions))
    if session_rate is not None:
        starts -= starts[0]                  # the first session starts at t=0
    sessions, thinks, at = [], [], 0
    for s, n in enumerate(counts.tolist()):
        msgs = [int(first[s])] + [int(x) for x in later[at + 1:at + n]]
        sessions.append(list(zip(msgs, (int(x) for x in answers[at:at + n]), strict=False)))
        thinks.append(think[at:at + n])
        at += n
    trace = session_trace(sessions, starts, thinks, f"synthetic-sessions-seed{seed}", "synthetic")
    trace.notices.append(f"synthetic sessions: {num_sessions} sessions, {total} turns (turns {turns}, first message "
                         f"{first_tokens}, later messages {user_tokens}, answers {output_tokens}), think time "
                         f"exponential mean {think_time_s:g} s, sessions "
                         + (f"Poisson {session_rate:g}/s" if session_rate else "all at t=0") + f", seed {seed}")
    return trace


def sharegpt_conversations(path: Path, data, *, seed: int = 0, shuffle: bool = True) -> list[list[tuple[str, str]]]:
    """Each ShareGPT entry's (human message, gpt answer) turns in order; an entry's leading non-human
    messages (a system prompt) join its first message, a turn without an answer ends the conversation."""
    if not isinstance(data, list):
        raise TraceError(path, None, "expected a JSON list of {\"conversations\": [...]} entries (ShareGPT)")
    entries = [e for e in data if isinstance(e, dict) and isinstance(e.get("conversations"), list)]
    if shuffle:
        random.seed(seed)
        random.shuffle(entries)
    out = []
    for i, e in enumerate(entries):
        turns, pending = [], ""
        for j, m in enumerate(e["conversations"]):
            if not isinstance(m, dict) or not isinstance(m.get("value"), str):
                raise TraceError(path, None, f"entry {e.get('id', i)!r}: conversations[{j}] needs a string 'value'")
            if m.get("from") in ("gpt", "chatgpt", "assistant", "bard", "bing"):
                if pending:
                    turns.append((pending, m["value"]))
                pending = ""
            else:
                pending = f"{pending}\n{m['value']}" if pending else m["value"]
        if turns:
            out.append(turns)
    if not out:
        raise TraceError(path, None, "no entry has a human message followed by a gpt answer (ShareGPT conversations)")
    return out


def sharegpt_sessions(path: str | Path, *, tokenizer=None, seed: int = 0, shuffle: bool = True,
                      think_time_s: float = 0.0, max_sessions: int | None = None) -> Trace:
    """ShareGPT conversations as sessions (all starting at t=0, turns `think_time_s` apart)."""
    from kvsim.traces.tokenizer import count_tokens, load_tokenizer
    from kvsim.traces.user_formats import _read_json

    path = Path(path)
    convs = sharegpt_conversations(path, _read_json(path, "a ShareGPT JSON list"), seed=seed, shuffle=shuffle)
    if max_sessions is not None:
        convs = convs[:max_sessions]
    tok = load_tokenizer(tokenizer)
    flat = [text for conv in convs for pair in conv for text in pair]
    counts = iter(max(c, 1) for c in count_tokens(tok, flat))
    sessions = [[(next(counts), next(counts)) for _ in conv] for conv in convs]
    thinks = [np.full(len(c), float(think_time_s)) for c in sessions]
    trace = session_trace(sessions, np.zeros(len(sessions)), thinks, path.stem, str(path))
    trace.notices.append(f"ShareGPT sessions: {len(sessions)} conversations, {len(trace)} turns, counted with "
                         + ("the shipped SmolLM2 tokenizer" if tokenizer is None else f"tokenizer {tokenizer}"))
    return trace


def with_session_starts(trace: Trace, starts) -> Trace:
    """`trace`'s sessions started at `starts` (one per session, in order of their first arrival), each
    keeping its turns' gaps: `vllm bench serve --request-rate` applied to sessions, not to turns."""
    df = trace.df
    keys = [("row", rid) if v is None or v is pd.NA or v != v else ("s", v)
            for v, rid in zip(df["session_id"].tolist(), df["request_id"].tolist(), strict=True)]
    index: dict = {}
    first: list[float] = []
    arrival = df["arrival_time_s"].to_numpy()
    for key, t in zip(keys, arrival.tolist(), strict=True):
        if key not in index:
            index[key] = len(index)
            first.append(t)
    starts = np.asarray(starts, dtype=np.float64)
    if starts.shape != (len(index),):
        raise TraceError(None, None, f"with_session_starts: {starts.size} starts for {len(index)} sessions")
    s = np.array([index[k] for k in keys], dtype=np.int64)
    new = starts[s] + (arrival - np.asarray(first)[s])
    order = np.argsort(new, kind="stable")
    out = df.iloc[order].copy()
    out["arrival_time_s"] = new[order]
    return trace._derive(out)


def num_sessions(trace: Trace) -> int:
    df = trace.df
    present = df["session_id"].dropna()
    return int(present.nunique()) + int(df["session_id"].isna().sum())
