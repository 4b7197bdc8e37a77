"""What a vLLM user has at hand, as traces: ShareGPT conversation JSON, `vllm bench serve --save-result`
JSON, and generic CSV / JSONL / Parquet logs read through an explicit column mapping.

- ``sharegpt``: a JSON list of ``{"conversations": [{"from": "human", "value": ...}, {"from": "gpt", ...}]}``
  entries, as `vllm bench serve --dataset-name sharegpt` reads it: entries with at least two turns,
  shuffled with Python's ``random.seed(seed)`` (vLLM's order; ``shuffle=False`` keeps the file's),
  the first turn the prompt and the second the output, both counted with a real tokenizer
  (traces/tokenizer.py; the shipped SmolLM2 one by default: an approximation), and vLLM's filter
  (both at least 4 tokens, prompt at most 1,024, prompt + output at most 2,048; ``vllm_filter=False``
  keeps every pair). No arrival times: all at t=0 unless a request rate is given.
- ``vllm-bench``: a result JSON of `vllm bench serve --save-result --save-detailed`: per request
  ``input_lens`` and ``output_lens`` (the tokens it really produced), and ``start_times`` (the send
  times) when present. Failed requests (``errors``) are left out. The measured TTFT/ITL/E2EL stay
  on the trace (``Trace.measured``) for the predicted-vs-measured report (sim/results/bench_compare.py).
- ``csv``, ``jsonl``, ``parquet``: any table with one row per request, given ``columns`` naming the
  source column of ``arrival`` (ISO-8601 times, or epoch numbers in ``time_unit``), ``prompt_tokens``
  and ``output_tokens`` (and optionally ``request_id``, ``session_id``, ``turn`` (checked: each session's
  turns in arrival order), ``priority``). Never
  detected from content: a gateway log is read only when asked to, so it cannot be misread.
"""
from __future__ import annotations

import json
import math
import random
import re
from pathlib import Path

import numpy as np
import pandas as pd

from kvsim.sim.io.safe_io import MAX_NESTING, InputError, safe_json_loads
from kvsim.traces.arrivals import vllm_bench_arrivals
from kvsim.traces.errors import TraceError

VLLM_MIN_LEN, VLLM_MAX_PROMPT, VLLM_MAX_TOTAL = 4, 1024, 2048
GENERIC_FIELDS = ("arrival", "prompt_tokens", "output_tokens", "request_id", "session_id", "turn", "priority")
TIME_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}


def _read_json(path: Path, what: str):
    try:
        return json.loads(path.read_text(encoding="utf-8-sig"))
    except json.JSONDecodeError as exc:
        raise TraceError(path, exc.lineno, f"invalid JSON ({exc.msg}); expected {what}") from None


# ---- ShareGPT ---------------------------------------------------------------------------------
def sharegpt_pairs(path: Path, data, *, seed: int = 0, shuffle: bool = True) -> list[tuple[str, str]]:
    """(prompt, output) texts of the entries vLLM's ShareGPT dataset keeps, in its order."""
    if not isinstance(data, list):
        raise TraceError(path, None, "expected a JSON list of {\"conversations\": [...]} entries (ShareGPT)")
    entries = [e for e in data if isinstance(e, dict) and isinstance(e.get("conversations"), list)
               and len(e["conversations"]) >= 2]
    if not entries:
        raise TraceError(path, None, "no entry has a 'conversations' list of at least two turns (ShareGPT)")
    if shuffle:
        random.seed(seed)                 # vLLM: random.seed(args.seed); random.shuffle(self.data)
        random.shuffle(entries)
    pairs = []
    for i, e in enumerate(entries):
        turns = e["conversations"][:2]
        texts = [t.get("value") if isinstance(t, dict) else None for t in turns]
        if not all(isinstance(t, str) for t in texts):
            raise TraceError(path, None, f"entry {e.get('id', i)!r}: the first two turns need a string 'value'")
        pairs.append((texts[0], texts[1]))
    return pairs


def sharegpt_lengths(path: Path, *, seed: int = 0, tokenizer=None, shuffle: bool = True,
                     vllm_filter: bool = True) -> tuple[np.ndarray, np.ndarray, str]:
    """(prompt tokens, output tokens, notice) of the pairs kept (traces.loaders builds the trace)."""
    from kvsim.traces.tokenizer import count_tokens, load_tokenizer

    pairs = sharegpt_pairs(path, _read_json(path, "a ShareGPT JSON list"), seed=seed, shuffle=shuffle)
    tok = load_tokenizer(tokenizer)
    prompt = np.array(count_tokens(tok, [p for p, _ in pairs]), dtype=np.int64)
    output = np.array(count_tokens(tok, [o for _, o in pairs]), dtype=np.int64)
    keep = (prompt >= 1) & (output >= 1)
    if vllm_filter:
        keep &= (prompt >= VLLM_MIN_LEN) & (output >= VLLM_MIN_LEN) & (prompt <= VLLM_MAX_PROMPT) & \
                (prompt + output <= VLLM_MAX_TOTAL)
    if not keep.any():
        raise TraceError(path, None, "no conversation pair passes the length filter (vLLM's: 4 <= tokens, "
                                     "prompt <= 1024, prompt + output <= 2048)")
    n = int(keep.sum())
    which = ("the shipped SmolLM2 tokenizer (an approximation of the served model's: give --tokenizer its "
             "tokenizer.json or Hugging Face id)" if tokenizer is None else f"tokenizer {tokenizer}")
    order = f"shuffled with seed {seed}" if shuffle else "file order"
    notice = (f"ShareGPT: {n} of {len(pairs)} conversation pairs ({order}"
              f"{', vLLM length filter' if vllm_filter else ''}), counted with {which}")
    return prompt[keep], output[keep], notice


# ---- vllm bench serve results -----------------------------------------------------------------
MEASURED = ("ttfts", "itls", "latencies")


def vllm_bench_columns(path: Path) -> dict:
    """The requests of a bench result: raw `prompt`/`output` lists, `arrival`, `request_id` (position in the
    file), `measured`, `bench_load` and a `notice` (traces.loaders validates and builds the trace)."""
    data = _read_json(path, "a vllm bench serve result JSON")
    if not isinstance(data, dict) or "input_lens" not in data or "output_lens" not in data:
        raise TraceError(path, None, "no per-request 'input_lens' / 'output_lens': save the benchmark with "
                                     "vllm bench serve --save-result --save-detailed")
    n = len(data["input_lens"])
    for key in ("output_lens", *MEASURED, "start_times", "errors"):
        if key in data and (not isinstance(data[key], list) or len(data[key]) != n):
            raise TraceError(path, None, f"'{key}': expected a list of {n} values, one per request (as input_lens)")
    for i, v in enumerate(data.get("start_times") or []):
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise TraceError(path, None, f"'start_times'[{i}]: expected a send time in seconds, got {v!r:.40}")
    errors = data.get("errors") or [""] * n
    ok = np.array([not e for e in errors], dtype=bool)
    ok &= np.array([isinstance(v, (int, float)) and v > 0 for v in data["output_lens"]], dtype=bool)
    if not ok.any():
        raise TraceError(path, None, "every request of the benchmark failed; nothing to replay")
    idx = np.flatnonzero(ok)
    _check_measured(path, data, idx)
    _check_load(path, data)
    starts, queue = data.get("start_times"), data.get("queue_times")
    if starts is not None and data.get("max_concurrency") is None:
        arrival = np.array([starts[i] for i in idx], dtype=np.float64)
    elif starts is not None and queue is not None and all(isinstance(q, (int, float)) for q in queue):
        arrival = np.array([starts[i] - queue[i] for i in idx], dtype=np.float64)     # client arrival times
    else:           # no send times saved (older vLLM): its rate's arrivals, drawn as vllm bench serve draws them
        rate = data.get("request_rate")
        rate = float(rate) if isinstance(rate, (int, float)) or str(rate).replace(".", "", 1).isdigit() else None
        arrival = (vllm_bench_arrivals(len(idx), rate, float(data.get("burstiness") or 1.0))
                   if rate and data.get("max_concurrency") is None else np.zeros(len(idx)))
    measured = {key: [data[key][i] for i in idx] for key in MEASURED if key in data}
    dropped = n - len(idx)
    failed = data.get("failed")
    measured.update(request_id=idx.tolist(), duration=data.get("duration"),
                    failed=failed if isinstance(failed, int) and not isinstance(failed, bool) else dropped,
                    model_id=data.get("model_id") if isinstance(data.get("model_id"), str) else None)
    return {"prompt": [data["input_lens"][i] for i in idx], "output": [data["output_lens"][i] for i in idx],
            "arrival": arrival, "request_id": idx.astype(np.int64), "measured": measured,
            "bench_load": {k: data.get(k) for k in ("request_rate", "burstiness", "max_concurrency")},
            "notice": f"vllm bench serve result: {len(idx)} requests"
                      + (f" ({dropped} failed ones left out)" if dropped else "")}


def _is_time(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0


def _check_measured(path: Path, data: dict, idx: np.ndarray) -> None:
    """The measured times of the requests kept: seconds >= 0 (a negative or NaN TTFT is a broken file, not a
    measurement); `itls` a list of such times per request."""
    for key in ("ttfts", "latencies"):
        for i in idx if key in data else ():
            if not _is_time(data[key][i]):
                raise TraceError(path, None, f"'{key}'[{i}]: expected a measured time in seconds >= 0, got "
                                             f"{data[key][i]!r:.40}")
    for i in idx if "itls" in data else ():
        itls = data["itls"][i]
        if not isinstance(itls, list) or not all(_is_time(v) for v in itls):
            raise TraceError(path, None, f"'itls'[{i}]: expected a list of inter-token times in seconds >= 0, got "
                                         f"{itls!r:.40}")


def _check_load(path: Path, data: dict) -> None:
    concurrency = data.get("max_concurrency")
    if concurrency is not None and (isinstance(concurrency, bool) or not isinstance(concurrency, int)
                                    or concurrency < 1):
        raise TraceError(path, None, f"'max_concurrency': expected null or an integer >= 1, got {concurrency!r:.40}")
    duration = data.get("duration")
    if duration is not None and not (_is_time(duration) and duration > 0):
        raise TraceError(path, None, f"'duration': expected the benchmark's length in seconds > 0, got {duration!r:.40}")


# ---- generic tables -----------------------------------------------------------------------------
def parse_columns(text: str | dict | None) -> dict[str, str]:
    """'arrival=timestamp,prompt_tokens=usage.prompt_tokens' (or a mapping) -> {kvsim field: source column}."""
    if text is None:
        return {}
    if isinstance(text, dict):
        mapping = {str(k): str(v) for k, v in text.items()}
    else:
        mapping = {}
        for item in str(text).split(","):
            key, sep, value = item.partition("=")
            if not sep or not key.strip() or not value.strip():
                raise TraceError(None, None, f"columns: {item!r} is not FIELD=COLUMN (e.g. arrival=timestamp)")
            if key.strip() in mapping:
                raise TraceError(None, None, f"columns: {key.strip()} is mapped twice ({mapping[key.strip()]} and "
                                             f"{value.strip()}); expected each field once")
            mapping[key.strip()] = value.strip()
    unknown = sorted(set(mapping) - set(GENERIC_FIELDS))
    if unknown:
        raise TraceError(None, None, f"columns: unknown field(s) {', '.join(unknown)}; expected "
                                     f"{', '.join(GENERIC_FIELDS)}")
    return mapping


def read_mapped_table(path: Path, fmt: str, columns=None) -> tuple[pd.DataFrame, np.ndarray | None, dict]:
    """(table, file line of each row or None, {field: source column}) of a csv / jsonl / parquet log."""
    mapping = {"arrival": "arrival_time_s", "prompt_tokens": "prompt_tokens", "output_tokens": "output_tokens",
               **parse_columns(columns)}
    df, lines = _read_table(path, fmt)
    missing = [f"{field} -> '{mapping[field]}'" for field in ("arrival", "prompt_tokens", "output_tokens")
               if mapping[field] not in df.columns]
    if missing:
        have = ", ".join(map(str, df.columns[:12]))
        raise TraceError(path, None, f"no column for {', '.join(missing)}; the file has {have}; map them with "
                                     "columns FIELD=COLUMN")
    absent = [f"{f} -> '{c}'" for f, c in mapping.items() if c not in df.columns]
    if absent:
        raise TraceError(path, None, f"no column for {', '.join(absent)}")
    return df, lines, mapping


def _read_table(path: Path, fmt: str) -> tuple[pd.DataFrame, np.ndarray | None]:
    if fmt == "parquet":
        import pyarrow.parquet as pq
        try:
            return pq.read_table(path).to_pandas(), None
        except Exception as exc:  # noqa: BLE001 - pyarrow raises several types for corrupt files
            raise TraceError(path, None, f"unreadable Parquet file ({exc}); expected --trace-format parquet") from None
    if fmt == "csv":
        try:
            df = pd.read_csv(path, dtype=str, keep_default_na=False, skip_blank_lines=False, encoding="utf-8-sig")
        except pd.errors.EmptyDataError as exc:
            raise TraceError(path, None, f"not a CSV table with a header line ({str(exc).splitlines()[0]})") from None
        except pd.errors.ParserError as exc:
            raise malformed_csv(path, exc) from None
        check_csv_fields(path, df)
        df.columns = [str(c).strip() for c in df.columns]
        lines = np.arange(len(df), dtype=np.int64) + 2
        blank = (df == "").all(axis=1).to_numpy()
        df, lines = df[~blank].reset_index(drop=True), lines[~blank]
        if df.empty:
            raise TraceError(path, 2, "no requests: the CSV has a header but no data rows")
        return df, lines
    records, lines = [], []
    with open(path, encoding="utf-8-sig") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = safe_json_loads(line, f"line {line_no}")
            except InputError:
                raise TraceError(path, line_no, f"JSON nested more than {MAX_NESTING} levels deep; expected one "
                                                "JSON object per line") from None
            except json.JSONDecodeError as exc:
                raise TraceError(path, line_no, f"invalid JSON ({exc.msg}); expected one object per line") from None
            if not isinstance(record, dict):
                raise TraceError(path, line_no, "expected one JSON object per line")
            records.append(_flatten(record))
            lines.append(line_no)
    if not records:
        raise TraceError(path, None, "no requests: the file has no JSON lines")
    return pd.DataFrame(records), np.array(lines)


def malformed_csv(path: Path, exc: Exception) -> TraceError:
    """pandas' 'Expected 3 fields in line 5, saw 4' as 'path:5: malformed row: ...'."""
    match = re.search(r"Expected (\d+) fields in line (\d+), saw (\d+)", str(exc))
    if not match:
        return TraceError(path, None, f"malformed CSV: {str(exc).splitlines()[0]}")
    expected, line, saw = match.groups()
    return TraceError(path, int(line), f"malformed row: {saw} fields, expected {expected} as in the header")


def check_csv_fields(path: Path, df: pd.DataFrame) -> None:
    """Refuse a CSV whose first data row has more fields than its header: pandas would take the extra
    leading fields as an index and shift every column by them, silently."""
    if not isinstance(df.index, pd.RangeIndex):
        expected = len(df.columns)
        raise TraceError(path, 2, f"malformed row: {expected + df.index.nlevels} fields, expected {expected} "
                                  "as in the header")


def _flatten(record: dict, prefix: str = "") -> dict:
    """{'usage': {'prompt_tokens': 3}} -> {'usage.prompt_tokens': 3}: nested log fields by dotted name."""
    out = {}
    for k, v in record.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out
