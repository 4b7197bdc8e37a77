"""Trace loaders. ``load_trace`` detects the format from the file's content, not its name.

Formats (``format=`` names):

- ``azure``: Azure LLM inference 2023/2024 CSV ``TIMESTAMP,ContextTokens,GeneratedTokens``
  (wall-clock timestamps, any ISO-8601 form incl. 7 fractional digits or a UTC offset).
- ``mooncake``: Mooncake JSONL ``timestamp`` (ms), ``input_length``, ``output_length``,
  ``hash_ids`` (one id per 512-token prefix block).
- ``vidur``: Vidur/Splitwise processed CSV ``arrived_at,num_prefill_tokens,num_decode_tokens`` (s).
- ``burstgpt``: BurstGPT CSV ``Timestamp,Session ID,Elapsed time,Model,Request tokens,
  Response tokens,Total tokens,Log Type`` (options ``model=``, ``log_type=`` filter rows).
- ``lengths``: length-only stats CSV ``num_prefill_tokens,num_decode_tokens,...`` (ShareGPT,
  arXiv); arrivals come from ``rate=``/``cv=``/``seed=`` or, with no rate, all at t=0.
- ``native-jsonl``, ``native-parquet``, ``native-csv``: kvsim's own format (see ``Trace.save``).
- ``sharegpt``, ``vllm-bench`` (detected) and ``csv``, ``jsonl``, ``parquet`` (only when named, with
  ``columns=``): a vLLM user's files, traces/user_formats.py.

Every loader except the native ones shifts time so the first request arrives at t=0. Output
lengths of 0 (failed requests in BurstGPT) become 1 and are counted in ``num_output_clamped``.
Unsorted arrivals are sorted stably, counted in ``num_reordered`` and reported with a
``TraceWarning``.
"""
from __future__ import annotations

import json
import math
import os
import re
import warnings
from contextvars import ContextVar
from pathlib import Path

import numpy as np
import pandas as pd

from kvsim.sim.io.safe_io import InputError, check_input_file, check_read_memory, safe_json_loads
from kvsim.traces.arrivals import arrivals
from kvsim.traces.errors import TraceError, TraceWarning
from kvsim.traces.formats import is_multi_turn_config
from kvsim.traces.trace import NATIVE_METADATA_KEY, Trace, _session_column
from kvsim.traces.time_units import detect_epoch_unit
from kvsim.traces.user_formats import (TIME_UNITS, check_csv_fields, malformed_csv, read_mapped_table,
                                       sharegpt_lengths, vllm_bench_columns)

DATA_DIR = Path(__file__).resolve().parent / "data"

from kvsim.traces.formats import DATA_TRACES, TRACE_ALIASES  # noqa: E402,F401 - re-exported

MOONCAKE_BLOCK_TOKENS = 512
MAX_TIME_S = 1e9            # ~31 years: later arrivals are mistakes (and lose sub-millisecond precision)
MAX_INTEGER = 2**53          # token counts and ids beyond are not exact in the float64 they are parsed into

_CSV_SIGNATURES = (  # (format, any of these header columns identifies it), checked in order
    ("native-csv", {"arrival_time_s", "prompt_tokens"}),
    ("azure", {"TIMESTAMP", "ContextTokens", "GeneratedTokens"}),
    ("burstgpt", {"Request tokens", "Response tokens", "Log Type"}),
    ("vidur", {"arrived_at"}),
    ("lengths", {"num_prefill_tokens", "num_decode_tokens"}),
)
_KNOWN_FORMATS_HELP = (
    "expected one of: Azure CSV (TIMESTAMP,ContextTokens,GeneratedTokens), Mooncake JSONL "
    "(timestamp,input_length,output_length,hash_ids), Vidur CSV (arrived_at,num_prefill_tokens,"
    "num_decode_tokens), BurstGPT CSV (Timestamp,...,Request tokens,Response tokens,...), length-only "
    "CSV (num_prefill_tokens,num_decode_tokens), kvsim native JSONL/Parquet/CSV "
    "(arrival_time_s,prompt_tokens,output_tokens), ShareGPT JSON, a vllm bench serve result JSON, vLLM's "
    "multi-turn benchmark config JSON (\"filetype\": \"generate_conversations\"); any other "
    "CSV/JSONL/Parquet log with --trace-format csv|jsonl|parquet and --trace-columns")
from kvsim.traces.formats import FORMATS, GENERIC_FORMATS, LENGTH_ONLY_FORMATS  # noqa: E402,F401 - re-exported
# the most data rows a loader reads (load_trace's max_rows); None: the whole file
_ROW_LIMIT: ContextVar[int | None] = ContextVar("trace_row_limit", default=None)


# ---- public entry points ----------------------------------------------------------------------
def resolve_trace_path(source: str | os.PathLike) -> tuple[Path, str]:
    """(path, short name) for a short name from DATA_TRACES or a file path."""
    text = str(source)
    if text in TRACE_ALIASES:
        text, notice = TRACE_ALIASES[text]
        warnings.warn(notice, TraceWarning, stacklevel=2)
    if text in DATA_TRACES:
        return DATA_DIR / DATA_TRACES[text], text
    path = Path(source)
    if not path.exists():
        names = ", ".join(DATA_TRACES)
        raise TraceError(path, None, f"no such file, and not a shipped trace name ({names})")
    if path.is_dir():
        raise TraceError(path, None, "is a directory, expected a trace file")
    try:
        check_input_file(path, what="trace file", max_bytes=None)
    except InputError as exc:
        raise TraceError(path, None, str(exc).removeprefix(f"{path}: ")) from None
    return path, path.stem


# Parsed traces kept for the runs of one process that load the same file again (a sweep's or a plan's
# worker: every run of a plan reads the same trace). Only inside `reusing_parsed_traces()`; keyed by the
# file's path, size and modification time and every load option, so a rewritten file is parsed again.
_PARSED: dict[tuple, Trace] = {}
_PARSED_MAX = 2
_REUSE_PARSED: ContextVar[bool] = ContextVar("reuse_parsed_traces", default=False)


class reusing_parsed_traces:
    """Within it, `load_trace` hands out a copy of a trace already parsed in this process (same file,
    unchanged, same options): the same requests without parsing the file again."""

    def __enter__(self):
        self._token = _REUSE_PARSED.set(True)
        return self

    def __exit__(self, *exc) -> None:
        _REUSE_PARSED.reset(self._token)


def _copy_trace(trace: Trace) -> Trace:
    import copy

    out = copy.copy(trace)
    out.df = trace.df.copy()
    out.notices = list(trace.notices)
    return out


def load_trace(source: str | os.PathLike, *, format: str | None = None, rate: float | None = None,
               cv: float | None = None, seed: int = 0, name: str | None = None, max_rows: int | None = None,
               **options) -> Trace:
    """`_load_trace` (below), or inside `reusing_parsed_traces()` a copy of the same load done before."""
    if not _REUSE_PARSED.get():
        return _load_trace(source, format=format, rate=rate, cv=cv, seed=seed, name=name, max_rows=max_rows,
                           **options)
    path, _ = resolve_trace_path(source)
    stat = path.stat()
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns, format, rate, cv, seed, name, max_rows,
           tuple(sorted((k, repr(v)) for k, v in options.items())))
    if key not in _PARSED:
        trace = _load_trace(source, format=format, rate=rate, cv=cv, seed=seed, name=name, max_rows=max_rows,
                            **options)
        if len(_PARSED) >= _PARSED_MAX:
            _PARSED.pop(next(iter(_PARSED)))
        _PARSED[key] = trace
    return _copy_trace(_PARSED[key])


def _load_trace(source: str | os.PathLike, *, format: str | None = None, rate: float | None = None,
                cv: float | None = None, seed: int = 0, name: str | None = None, max_rows: int | None = None,
                **options) -> Trace:
    """Load a trace from a shipped short name or a file of any supported format.

    ``rate`` (req/s), ``cv`` (inter-arrival coefficient of variation; 1 = Poisson, >1 = bursty
    Gamma) and ``seed`` give arrivals to length-only files; without ``rate`` every request of a
    length-only file arrives at t=0 (a closed batch). ``options`` go to the format's loader
    (BurstGPT: ``model``, ``log_type``). ``max_rows``: read only the file's first N requests (the
    rest of the file is not read; length-only files and filtered BurstGPT files are read whole, their
    first N rows are not their first N requests).
    """
    path, short_name = resolve_trace_path(source)
    fmt = format or detect_format(path)
    if fmt not in _LOADERS:
        raise TraceError(path, None, f"unknown format {fmt!r}; expected one of {', '.join(FORMATS)}")
    if fmt not in LENGTH_ONLY_FORMATS and (rate is not None or cv is not None):
        raise TraceError(path, None, f"rate/cv apply only to length-only traces, this is a {fmt} trace "
                                     "with its own arrival times (use Trace.scale_rate to change its rate)")
    if fmt == "lengths":
        options.update(rate=rate, cv=cv, seed=seed)
    elif fmt in ("sharegpt", "workload", "inference-perf", "vllm-multi-turn"):
        options.update(seed=seed)
    if options.get("tokenizer") is not None and fmt != "sharegpt":
        raise TraceError(path, None, f"a tokenizer applies to ShareGPT JSON (text), this is a {fmt} trace of "
                                     "token counts")
    options = {k: v for k, v in options.items() if not (k == "tokenizer" and v is None)}
    # the first N rows are the first N requests only where rows are requests in file order
    limited = (max_rows is not None and fmt not in LENGTH_ONLY_FORMATS + ("vllm-bench",) + GENERIC_FORMATS
               and not any(options.get(k) for k in ("model", "log_type")))
    if not limited:             # the whole file is parsed: refuse one that cannot fit before reading it
        kind = "parquet" if fmt in ("native-parquet", "parquet") else "json" if fmt in ("sharegpt", "vllm-bench") else "text"
        try:
            check_read_memory(path, kind)
        except InputError as exc:
            raise TraceError(path, None, str(exc).removeprefix(f"{path}: ")) from None
    token = _ROW_LIMIT.set(max_rows if limited else None)
    try:
        trace = _LOADERS[fmt](path, **options)
    except UnicodeDecodeError as exc:
        raise TraceError(path, None, f"not a text file ({exc.reason}); {_KNOWN_FORMATS_HELP}") from None
    finally:
        _ROW_LIMIT.reset(token)
    if fmt == "sharegpt" and rate is not None:
        times, how = arrivals(len(trace), rate=rate, cv=cv, seed=seed)
        trace = trace.with_arrivals(times)
        trace.notices.append(f"arrivals synthesized: {how}")
    trace.name = name or trace.name or short_name
    trace.source = str(path)
    return trace


def detect_format(path: str | os.PathLike) -> str:
    """The format name of a trace file, decided from its first bytes / header line (a YAML file whose top key
    is `workload:`: a workload spec, traces/workload.py)."""
    path = Path(path)
    if path.suffix.lower() in (".yaml", ".yml"):
        from kvsim.traces.inference_perf import is_inference_perf_config     # pydantic: only for YAML files
        from kvsim.traces.workload import is_workload_spec
        if is_workload_spec(path):
            return "workload"
        if is_inference_perf_config(path):
            return "inference-perf"
        if path.is_file():
            _refuse_other_yaml(path)
    return _detect_data_format(path)


def _refuse_other_yaml(path: Path) -> None:
    """A YAML file that is neither a workload spec nor an inference-perf config: its YAML error (naming the
    line), or one line saying what a YAML trace must hold (no trace format is YAML)."""
    from kvsim.traces.workload import read_yaml
    data, _ = read_yaml(path, "workload spec YAML")
    if isinstance(data, dict) and "workload" in data:
        got = "'workload:' after other keys (it must be the file's first key)"
    elif isinstance(data, dict):
        got = f"top-level keys {', '.join(repr(str(k)) for k in list(data)[:5])}"
    else:
        got = "an empty file" if data is None else f"a YAML {type(data).__name__}, not a mapping"
    raise TraceError(path, None, f"expected a workload spec (top-level key 'workload:', docs/traces.md#workload-specs) "
                                 f"or an inference-perf config (top-level 'load:' and 'data:'), got {got}")


def _json_document_format(text: str) -> str | None:
    """A file that is one JSON document (not JSON lines): vLLM's multi-turn benchmark config or a bench
    result (its per-request lists may push output_lens past the first 64 KiB read)."""
    if is_multi_turn_config(text):
        return "vllm-multi-turn"
    if '"input_lens"' in text or '"output_lens"' in text:
        return "vllm-bench"
    return None


def _detect_data_format(path: Path) -> str:
    with open(path, "rb") as f:
        head = f.read(65536)
    if head.startswith(b"PAR1"):
        return "native-parquet"
    try:
        text = head.decode("utf-8-sig")
    except UnicodeDecodeError:
        text = head.decode("utf-8-sig", errors="replace")
        if "\ufffd" in text[:-4]:  # a cut multi-byte character at the end is fine
            raise TraceError(path, 1, f"not a text or Parquet file; {_KNOWN_FORMATS_HELP}") from None
    lines = text.splitlines()
    first = next(((i + 1, line.strip()) for i, line in enumerate(lines) if line.strip()), None)
    if first is None:
        raise TraceError(path, 1, f"empty file; {_KNOWN_FORMATS_HELP}")
    line_no, line = first
    if line.startswith("[") and '"conversations"' in text:
        return "sharegpt"
    document = _json_document_format(text) if line.startswith("{") else None
    if document:
        return document
    if line.startswith("{"):
        try:
            record = safe_json_loads(line, f"line {line_no}")
        except json.JSONDecodeError as exc:
            raise TraceError(path, line_no, f"invalid JSON ({exc.msg}); {_KNOWN_FORMATS_HELP}") from None
        except InputError:
            raise TraceError(path, line_no, "JSON nested too deeply; expected one flat JSON object per line") from None
        if not isinstance(record, dict):
            raise TraceError(path, line_no, f"expected a JSON object, got {type(record).__name__}; "
                                            f"{_KNOWN_FORMATS_HELP}")
        if NATIVE_METADATA_KEY in record or "arrival_time_s" in record:
            return "native-jsonl"
        if "input_length" in record or "timestamp" in record:
            return "mooncake"
        raise TraceError(path, line_no, f"the first JSON object has none of the keys of a known trace; "
                                        f"{_KNOWN_FORMATS_HELP}")
    header = {c.strip().strip('"') for c in line.split(",")}
    for fmt, signature in _CSV_SIGNATURES:
        if header & signature:
            return fmt
    # the line itself is not quoted: error messages may be shown to others (the dashboard)
    raise TraceError(path, line_no, f"the header line is not a known trace format; {_KNOWN_FORMATS_HELP}")


# ---- value parsing with file positions ----------------------------------------------------------
class _Rows:
    """Maps row positions to file lines (text files) or row numbers (Parquet) for error messages."""

    def __init__(self, path: Path, lines: np.ndarray | None, n: int):
        self.path, self.lines, self.n = path, lines, n

    def error(self, row: int, message: str) -> TraceError:
        if self.lines is None:
            return TraceError(self.path, None, f"row {row}: {message}")
        return TraceError(self.path, int(self.lines[row]), message)

    def line_of(self, row: int) -> str:
        return f"row {row}" if self.lines is None else f"line {int(self.lines[row])}"


def _describe(value) -> str:
    if value is None or (isinstance(value, str) and not value.strip()):
        return "nothing (missing value)"
    if isinstance(value, float) and math.isnan(value):
        return "nothing (missing value)"
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:37]}..."


def _numbers(raw) -> np.ndarray:
    series = pd.Series(raw, dtype=object) if not isinstance(raw, pd.Series) else raw
    is_bool = series.map(lambda v: isinstance(v, bool)).to_numpy(dtype=bool) if series.dtype == object \
        else np.zeros(len(series), bool)
    values = pd.to_numeric(series, errors="coerce").to_numpy(dtype=np.float64, na_value=np.nan)
    return np.where(is_bool, np.nan, values)


def _integers(raw, rows: _Rows, field: str, minimum: int | None) -> np.ndarray:
    values = _numbers(raw)
    with np.errstate(invalid="ignore"):
        bad = ~np.isfinite(values) | (values != np.round(values)) | (np.abs(values) > MAX_INTEGER)
        if minimum is not None:
            bad |= values < minimum
    if bad.any():
        row = int(np.flatnonzero(bad)[0])
        expected = "an integer" if minimum is None else f"an integer >= {minimum}"
        too_large = " (above 2^53, not a count)" if abs(values[row]) > MAX_INTEGER else ""
        raise rows.error(row, f"{field}: expected {expected}, got {_describe(_at(raw, row))}{too_large}")
    return values.astype(np.int64)


def _floats(raw, rows: _Rows, field: str, what: str, minimum: float | None = None,
            maximum: float = MAX_TIME_S) -> np.ndarray:
    values = _numbers(raw)
    with np.errstate(invalid="ignore"):
        bad = ~np.isfinite(values) | (values < minimum if minimum is not None else False) | (np.abs(values) > maximum)
    if bad.any() and np.isfinite(values[bad]).all() and (np.abs(values[bad]) > maximum).any():
        row = int(np.flatnonzero(bad)[0])
        raise rows.error(row, f"{field}: expected {what} of at most {maximum:g}, got {_describe(_at(raw, row))}")
    if bad.any():
        row = int(np.flatnonzero(bad)[0])
        raise rows.error(row, f"{field}: expected {what}, got {_describe(_at(raw, row))}")
    return values


def _at(raw, row: int):
    return raw.iloc[row] if isinstance(raw, pd.Series) else raw[row]


def _prefix_lists(raw: list, rows: _Rows, field: str, prompt: np.ndarray, block_tokens: int) -> list:
    out = []
    for row, ids in enumerate(raw):
        if ids is None:
            out.append(None)
            continue
        if isinstance(ids, np.ndarray):
            ids = ids.tolist()
        if not isinstance(ids, list) or not all(type(h) is int for h in ids):
            raise rows.error(row, f"{field}: expected a list of integer block ids, got {_describe(ids)[:80]}")
        max_blocks = -(-int(prompt[row]) // block_tokens)
        if len(ids) > max_blocks:
            raise rows.error(row, f"{field}: {len(ids)} block ids for a {prompt[row]}-token prompt; expected at "
                                  f"most {max_blocks} (one per {block_tokens}-token block)")
        out.append(ids)
    return out


# ---- building the trace ----------------------------------------------------------------------
def _build(path: Path, rows: _Rows, *, arrival: np.ndarray, prompt: np.ndarray, output: np.ndarray,
           shift: bool = True, **columns_and_meta) -> Trace:
    notices: list[str] = list(columns_and_meta.pop("notices", []))
    known_notices = len(notices)
    meta = {k: columns_and_meta.pop(k) for k in list(columns_and_meta)
            if k in ("name", "prefix_block_tokens", "num_clipped", "num_output_clamped", "num_reordered")}
    columns = columns_and_meta
    n = len(prompt)
    if n == 0:
        raise TraceError(path, None, "no requests: the file has no data rows")

    zero_output = output == 0
    if zero_output.any():
        output = np.where(zero_output, 1, output)
        count = int(zero_output.sum())
        meta["num_output_clamped"] = meta.get("num_output_clamped", 0) + count
        notices.append(f"{count} requests have 0 output tokens (first at {rows.line_of(int(np.flatnonzero(zero_output)[0]))}); "
                       "set to 1 because every request decodes at least one token")

    if shift:
        arrival = arrival - arrival.min()
    late = arrival < np.maximum.accumulate(arrival)
    order = np.arange(n)
    if late.any():
        count = int(late.sum())
        order = np.argsort(arrival, kind="stable")
        meta["num_reordered"] = meta.get("num_reordered", 0) + count
        notices.append(f"arrivals are not sorted: {count} requests arrive before an earlier row (first at "
                       f"{rows.line_of(int(np.flatnonzero(late)[0]))}); sorted by arrival time (stable)")

    request_id = columns.pop("request_id", None)
    if request_id is None:
        request_id = np.arange(n, dtype=np.int64)
    else:
        duplicated = pd.Series(request_id).duplicated().to_numpy()
        if duplicated.any():
            row = int(np.flatnonzero(duplicated)[0])
            raise rows.error(row, f"request_id: {request_id[row]} is used twice; expected unique ids")
    data = {"request_id": request_id, "arrival_time_s": arrival, "prompt_tokens": prompt, "output_tokens": output}
    data.update({k: v for k, v in columns.items() if v is not None})
    if "session_id" in data and not isinstance(data["session_id"], pd.api.extensions.ExtensionArray):
        data["session_id"] = _session_column(pd.Series(list(data["session_id"]), dtype=object))
    df = pd.DataFrame({k: (pd.Series(list(v), dtype=object) if k == "prefix_hash_ids" else v)
                       for k, v in data.items()})
    df = df.iloc[order].reset_index(drop=True)
    for notice in notices[known_notices:]:
        warnings.warn(f"{path}: {notice}", TraceWarning, stacklevel=4)
    return Trace(df, source=str(path), notices=notices, **meta)


# ---- CSV formats -----------------------------------------------------------------------------
def _read_csv(path: Path, required: tuple[str, ...], fmt: str) -> tuple[pd.DataFrame, _Rows]:
    try:
        df = pd.read_csv(path, dtype=str, keep_default_na=False, skip_blank_lines=False, encoding="utf-8-sig",
                         nrows=_ROW_LIMIT.get())
    except pd.errors.EmptyDataError:
        raise TraceError(path, 1, f"empty file; expected a {fmt} CSV header {','.join(required)}") from None
    except pd.errors.ParserError as exc:
        raise malformed_csv(path, exc) from None
    check_csv_fields(path, df)
    df.columns = [str(c).strip() for c in df.columns]
    missing = [c for c in required if c not in df.columns]
    if missing:
        raise TraceError(path, 1, f"missing column(s) {', '.join(missing)}; "
                                  f"a {fmt} CSV needs {','.join(required)}")
    lines = np.arange(len(df), dtype=np.int64) + 2
    blank = (df == "").all(axis=1).to_numpy()
    if blank.any():
        df, lines = df[~blank].reset_index(drop=True), lines[~blank]
    if df.empty:
        raise TraceError(path, 2, f"no requests: the {fmt} CSV has a header but no data rows")
    return df, _Rows(path, lines, len(df))


def _timestamps_s(raw: pd.Series, rows: _Rows, field: str) -> np.ndarray:
    parsed = pd.to_datetime(raw.str.strip(), format="ISO8601", utc=True, errors="coerce")
    bad = parsed.isna().to_numpy()
    if bad.any():
        row = int(np.flatnonzero(bad)[0])
        raise rows.error(row, f"{field}: expected a timestamp like 2023-11-16 18:15:46.6805900, "
                              f"got {_describe(raw.iloc[row])}")
    return (parsed - parsed.min()).dt.total_seconds().to_numpy(dtype=np.float64)


def load_azure(path: Path) -> Trace:
    df, rows = _read_csv(path, ("TIMESTAMP", "ContextTokens", "GeneratedTokens"), "Azure")
    return _build(path, rows, arrival=_timestamps_s(df["TIMESTAMP"], rows, "TIMESTAMP"),
                  prompt=_integers(df["ContextTokens"], rows, "ContextTokens", 1),
                  output=_integers(df["GeneratedTokens"], rows, "GeneratedTokens", 0))


def load_vidur(path: Path) -> Trace:
    df, rows = _read_csv(path, ("arrived_at", "num_prefill_tokens", "num_decode_tokens"), "Vidur")
    return _build(path, rows, arrival=_floats(df["arrived_at"], rows, "arrived_at", "a time in seconds"),
                  prompt=_integers(df["num_prefill_tokens"], rows, "num_prefill_tokens", 1),
                  output=_integers(df["num_decode_tokens"], rows, "num_decode_tokens", 0))


def load_burstgpt(path: Path, *, model: str | None = None, log_type: str | None = None) -> Trace:
    required = ("Timestamp", "Model", "Request tokens", "Response tokens", "Log Type")
    df, rows = _read_csv(path, required, "BurstGPT")
    keep = np.ones(len(df), bool)
    for column, wanted in (("Model", model), ("Log Type", log_type)):
        if wanted is not None:
            keep &= (df[column].str.strip() == wanted).to_numpy()
            if not keep.any():
                seen = sorted(set(df[column].str.strip()))
                raise TraceError(path, None, f"no rows with {column} == {wanted!r} (the column holds "
                                             f"{len(seen)} other distinct value(s))")
    if not keep.all():
        df, rows = df[keep].reset_index(drop=True), _Rows(path, rows.lines[keep], int(keep.sum()))
    session = None
    if "Session ID" in df.columns:
        raw = df["Session ID"].str.strip()
        present = (raw != "").to_numpy()
        if present.any():
            ids = _integers(raw[present].reset_index(drop=True), _Rows(path, rows.lines[present], 0), "Session ID", 0)
            values = np.zeros(len(df), np.int64)
            values[present] = ids
            session = pd.array(values, dtype="Int64")
            session[~present] = pd.NA
    return _build(path, rows, arrival=_floats(df["Timestamp"], rows, "Timestamp", "a time in seconds"),
                  prompt=_integers(df["Request tokens"], rows, "Request tokens", 1),
                  output=_integers(df["Response tokens"], rows, "Response tokens", 0),
                  session_id=session)


def load_lengths(path: Path, *, rate: float | None = None, cv: float | None = None, seed: int = 0) -> Trace:
    df, rows = _read_csv(path, ("num_prefill_tokens", "num_decode_tokens"), "length-only")
    prompt = _integers(df["num_prefill_tokens"], rows, "num_prefill_tokens", 1)
    output = _integers(df["num_decode_tokens"], rows, "num_decode_tokens", 0)
    try:
        times, how = arrivals(len(prompt), rate=rate, cv=cv, seed=seed)
    except TraceError as exc:
        raise TraceError(path, None, exc.reason) from None
    trace = _build(path, rows, arrival=times, prompt=prompt, output=output)
    trace.notices.append(f"arrivals synthesized: {how}")
    return trace


# ---- JSON lines formats ----------------------------------------------------------------------
def _read_jsonl(path: Path) -> tuple[list[dict], np.ndarray, dict | None]:
    records, lines, metadata = [], [], None
    limit = _ROW_LIMIT.get()
    with open(path, encoding="utf-8-sig") as f:
        for line_no, line in enumerate(f, start=1):
            if limit is not None and len(records) >= limit:
                break
            if not line.strip():
                continue
            try:
                record = safe_json_loads(line, f"line {line_no}")
            except InputError:
                raise TraceError(path, line_no, "JSON nested more than a request needs; expected one flat "
                                                "JSON object per line") from None
            except json.JSONDecodeError as exc:
                raise TraceError(path, line_no, f"invalid JSON ({exc.msg} at column {exc.colno}); "
                                                "expected one JSON object per line") from None
            if not isinstance(record, dict):
                raise TraceError(path, line_no, f"expected a JSON object, got {type(record).__name__}")
            if NATIVE_METADATA_KEY in record and not records and metadata is None:
                metadata = record[NATIVE_METADATA_KEY]
                continue
            records.append(record)
            lines.append(line_no)
    if not records:
        raise TraceError(path, 1, "no requests: the file has no JSON request lines")
    return records, np.asarray(lines, dtype=np.int64), metadata


def _field(records: list[dict], rows: _Rows, key: str, required: bool = True) -> list:
    values = [r.get(key) for r in records]
    if required:
        for row, r in enumerate(records):
            if key not in r:
                raise rows.error(row, f"missing key {key!r}")
    return values


def load_mooncake(path: Path) -> Trace:
    records, lines, _ = _read_jsonl(path)
    rows = _Rows(path, lines, len(records))
    prompt = _integers(_field(records, rows, "input_length"), rows, "input_length", 1)
    output = _integers(_field(records, rows, "output_length"), rows, "output_length", 0)
    arrival_ms = _floats(_field(records, rows, "timestamp"), rows, "timestamp", "milliseconds from the trace start",
                         maximum=MAX_TIME_S * 1000)
    hash_ids = _field(records, rows, "hash_ids", required=False)
    has_prefix = any(h is not None for h in hash_ids)
    prefix = _prefix_lists(hash_ids, rows, "hash_ids", prompt, MOONCAKE_BLOCK_TOKENS) if has_prefix else None
    return _build(path, rows, arrival=arrival_ms / 1000.0, prompt=prompt, output=output, prefix_hash_ids=prefix,
                  prefix_block_tokens=MOONCAKE_BLOCK_TOKENS if has_prefix else None)


def _native_meta(path: Path, metadata: dict | None, has_prefix: bool) -> dict:
    metadata = metadata or {}
    if not isinstance(metadata, dict):
        raise TraceError(path, 1, f"{NATIVE_METADATA_KEY}: expected an object, got {_describe(metadata)}")
    block = metadata.get("prefix_block_tokens")
    if has_prefix and not (isinstance(block, int) and block >= 1):
        raise TraceError(path, 1, f"prefix_hash_ids are given but {NATIVE_METADATA_KEY}.prefix_block_tokens is "
                                  f"{_describe(block)}; expected the number of tokens each id stands for")
    meta = {"name": metadata.get("name") or "", "prefix_block_tokens": block if has_prefix else None,
            "notices": list(metadata.get("notices") or [])}
    for key in ("num_clipped", "num_output_clamped", "num_reordered"):
        meta[key] = int(metadata.get(key) or 0)
    return meta


def _native_columns(path: Path, rows: _Rows, get) -> dict:
    """Validated canonical columns; ``get(name)`` returns the raw values or None when absent."""
    prompt = _integers(get("prompt_tokens"), rows, "prompt_tokens", 1)
    columns = {
        "arrival": _floats(get("arrival_time_s"), rows, "arrival_time_s", "a time in seconds >= 0", minimum=0),
        "prompt": prompt,
        "output": _integers(get("output_tokens"), rows, "output_tokens", 0),
    }
    for key, minimum in (("request_id", 0), ("priority", None)):
        raw = get(key)
        if raw is not None:
            columns[key] = _integers(raw, rows, key, minimum)
    if get("session_id") is not None:
        columns["session_id"] = list(get("session_id"))
    return columns


def load_native_jsonl(path: Path) -> Trace:
    records, lines, metadata = _read_jsonl(path)
    rows = _Rows(path, lines, len(records))
    for key in ("arrival_time_s", "prompt_tokens", "output_tokens"):
        _field(records, rows, key)

    def get(key):
        values = [r.get(key, 0) if key == "priority" else r.get(key) for r in records]
        if key in ("arrival_time_s", "prompt_tokens", "output_tokens"):
            return values
        return values if any(key in r for r in records) else None

    columns = _native_columns(path, rows, get)
    prefix_raw = get("prefix_hash_ids")
    meta = _native_meta(path, metadata, prefix_raw is not None)
    if prefix_raw is not None:
        columns["prefix_hash_ids"] = _prefix_lists(prefix_raw, rows, "prefix_hash_ids", columns["prompt"],
                                                   meta["prefix_block_tokens"])
    return _build(path, rows, shift=False, **columns, **meta)


def load_native_csv(path: Path) -> Trace:
    df, rows = _read_csv(path, ("arrival_time_s", "prompt_tokens", "output_tokens"), "kvsim native")
    if "prefix_hash_ids" in df.columns:
        raise TraceError(path, 1, "prefix_hash_ids cannot be stored in CSV; use the .jsonl or .parquet native format")

    def get(key):
        if key not in df.columns:
            return None
        if key == "session_id":
            raw = df[key].str.strip()
            return [None if v == "" else (int(v) if re.fullmatch(r"-?\d+", v) else v) for v in raw]
        return df[key]

    columns = _native_columns(path, rows, get)
    return _build(path, rows, shift=False, **columns)


def load_native_parquet(path: Path) -> Trace:

    try:
        table = _read_parquet_rows(path, _ROW_LIMIT.get())
    except Exception as exc:  # pyarrow raises several types for corrupt files
        raise TraceError(path, None, f"unreadable Parquet file: {exc}") from None
    required = ("arrival_time_s", "prompt_tokens", "output_tokens")
    missing = [c for c in required if c not in table.column_names]
    if missing:
        raise TraceError(path, None, f"missing column(s) {', '.join(missing)}; a kvsim native Parquet trace "
                                     f"needs {', '.join(required)}")
    if table.num_rows == 0:
        raise TraceError(path, None, "no requests: the Parquet file has no rows")
    raw_meta = (table.schema.metadata or {}).get(NATIVE_METADATA_KEY.encode())
    try:
        metadata = safe_json_loads(raw_meta, "metadata") if raw_meta else None
    except (ValueError, UnicodeDecodeError):
        raise TraceError(path, None, f"the Parquet schema metadata {NATIVE_METADATA_KEY!r} is not valid JSON "
                                     "(at most 100 levels deep); expected the object kvsim writes") from None
    rows = _Rows(path, None, table.num_rows)

    def get(key):
        return table.column(key).to_pylist() if key in table.column_names else None

    columns = _native_columns(path, rows, get)
    prefix_raw = get("prefix_hash_ids")
    if prefix_raw is not None and all(v is None for v in prefix_raw):
        prefix_raw = None
    meta = _native_meta(path, metadata, prefix_raw is not None)
    if prefix_raw is not None:
        columns["prefix_hash_ids"] = _prefix_lists(prefix_raw, rows, "prefix_hash_ids", columns["prompt"],
                                                   meta["prefix_block_tokens"])
    return _build(path, rows, shift=False, **columns, **meta)


def _read_parquet_rows(path: Path, limit: int | None):
    """The Parquet file as a table, or its first `limit` rows (later row groups are not read)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if limit is None:
        return pq.read_table(path)
    pf = pq.ParquetFile(path)
    batches, n = [], 0
    for batch in pf.iter_batches(batch_size=min(max(limit, 1), 65536)):
        batches.append(batch.slice(0, limit - n))
        n += len(batches[-1])
        if n >= limit:
            break
    return pa.Table.from_batches(batches, schema=pf.schema_arrow)


# ---- a vLLM user's files (traces/user_formats.py reads them; built and validated here) ----------------
def load_sharegpt(path: Path, *, seed: int = 0, tokenizer=None, shuffle: bool = True, vllm_filter: bool = True):
    prompt, output, notice = sharegpt_lengths(path, seed=seed, tokenizer=tokenizer, shuffle=shuffle,
                                              vllm_filter=vllm_filter)
    trace = _build(path, _Rows(path, None, len(prompt)), arrival=np.zeros(len(prompt)), prompt=prompt,
                   output=output)
    trace.notices.append(notice)
    # the counts depend on the tokenizer: say which one counted them (the default is an approximation)
    warnings.warn(f"{path}: {notice}", TraceWarning, stacklevel=3)
    return trace


def load_vllm_bench(path: Path) -> Trace:
    c = vllm_bench_columns(path)
    rows = _Rows(path, None, len(c["prompt"]))
    trace = _build(path, rows, arrival=c["arrival"], prompt=_integers(c["prompt"], rows, "input_lens", 1),
                   output=_integers(c["output"], rows, "output_lens", 1), request_id=c["request_id"])
    trace.measured, trace.bench_load = c["measured"], c["bench_load"]
    trace.notices.append(c["notice"])
    return trace


def _generic(fmt: str):
    def load(path: Path, *, columns=None, time_unit: str = "s") -> Trace:
        if time_unit not in TIME_UNITS:
            raise TraceError(path, None, f"time_unit {time_unit!r}; expected one of {', '.join(TIME_UNITS)}")
        df, lines, mapping = read_mapped_table(path, fmt, columns)
        rows = _Rows(path, lines, len(df))
        extra, labels = {}, None
        if "priority" in mapping:
            extra["priority"] = _integers(df[mapping["priority"]], rows, mapping["priority"], None)
        if "request_id" in mapping:
            extra["request_id"], labels = _request_ids(df[mapping["request_id"]], rows, mapping["request_id"])
        if "session_id" in mapping:
            extra["session_id"] = list(df[mapping["session_id"]])
        notices: list[str] = []
        arrival = _log_times(df[mapping["arrival"]], rows, mapping["arrival"], time_unit, notices)
        if "turn" in mapping:
            _check_turns(df, rows, mapping, arrival)
        trace = _build(path, rows, arrival=arrival,
                       prompt=_integers(df[mapping["prompt_tokens"]], rows, mapping["prompt_tokens"], 1),
                       output=_integers(df[mapping["output_tokens"]], rows, mapping["output_tokens"], 0), **extra)
        trace.notices.extend(notices)
        if labels is not None:
            trace.request_labels = labels
            notice = (f"{mapping['request_id']}: request ids that are not integers (such as {labels[0]!r:.40}) "
                      f"numbered 0..{len(labels) - 1} in file order; requests.parquet's request_label keeps them")
            trace.notices.append(notice)
            warnings.warn(f"{path}: {notice}", TraceWarning, stacklevel=3)
        return trace
    return load


def _check_turns(df: pd.DataFrame, rows: _Rows, mapping: dict, arrival: np.ndarray) -> None:
    """A session trace's `turn` column: integers, each session's turns in arrival order (turn numbers
    rising with time); refused at the first row that breaks it, naming its line and the field."""
    field = mapping["turn"]
    if "session_id" not in mapping:
        raise TraceError(rows.path, None, f"columns: turn={field} needs session_id=COLUMN (a turn counts within a session)")
    turns = _integers(df[field], rows, field, 0)
    order = np.argsort(arrival, kind="stable")
    last: dict = {}
    sessions = df[mapping["session_id"]].tolist()
    for row in order.tolist():
        sid = sessions[row]
        if sid is None or sid != sid:
            continue
        prev = last.get(sid)
        if prev is not None and turns[row] <= turns[prev]:
            raise rows.error(row, f"{field}: session {sid!r} turn {int(turns[row])} arrives after its turn "
                                  f"{int(turns[prev])} ({rows.line_of(prev)}); expected each session's turns in "
                                  "arrival order (rising turn numbers)")
        last[sid] = row


def _request_ids(raw: pd.Series, rows: _Rows, name: str) -> tuple[np.ndarray, dict[int, str] | None]:
    """Integer request ids as they are; any other ids (`r0`, UUIDs) numbered in file order, with the originals."""
    if not np.isnan(_numbers(raw)).any():
        return _integers(raw, rows, name, 0), None
    text = raw.astype(str).where(raw.notna(), "")
    empty = np.flatnonzero((text.str.strip() == "").to_numpy())
    if len(empty):
        raise rows.error(int(empty[0]), f"{name}: expected a request id, got an empty value")
    repeated = np.flatnonzero(text.duplicated().to_numpy())
    if len(repeated):
        raise rows.error(int(repeated[0]), f"{name}: request id {text.iloc[int(repeated[0])]!r:.40} repeats an "
                                           "earlier row's; expected one row per request")
    return np.arange(len(text), dtype=np.int64), dict(enumerate(text.tolist()))


def _epoch_unit(values: np.ndarray, unit: str, rows: _Rows, name: str, notices: list[str]) -> str:
    """`unit`, or the finer unit that epoch times too large for it are in (1.7e12 'seconds' are epoch
    milliseconds: read as seconds, a 1000x load error), with a notice and a warning."""
    detected = detect_epoch_unit(values) if unit == "s" else None
    if not detected:
        return unit
    first = float(np.min(values))
    notice = (f"{name}: epoch times such as {first:.0f} would be past the year 5000 in seconds: read as {detected} "
              f"(epoch {detected}; give --time-unit {detected} to say so)")
    notices.append(notice)
    warnings.warn(f"{rows.path}: {notice}", TraceWarning, stacklevel=4)
    return detected


def _log_times(raw: pd.Series, rows: _Rows, name: str, unit: str, notices: list[str]) -> np.ndarray:
    """Epoch numbers (in `unit`) or ISO-8601 strings -> seconds from the first request. Epoch numbers
    said to be seconds that can only be a finer unit are read in that unit, with a notice."""
    if pd.api.types.is_datetime64_any_dtype(raw):       # a Parquet timestamp column: times, not epoch numbers
        parsed = pd.to_datetime(raw, utc=True)
    else:
        numeric = ~np.isnan(_numbers(raw))
        if numeric.all():
            # epoch numbers are large by nature: the bound on arrival times applies once they are relative
            values = _floats(raw, rows, name, f"a time (epoch {unit} or ISO-8601)", maximum=np.inf)
            unit = _epoch_unit(values, unit, rows, name, notices)
            values = values * TIME_UNITS[unit]
            relative = values - values.min()
            return _floats(relative, rows, name, "a time span from the first request (s)")
        text = raw.astype(str).where(raw.notna(), "").str.strip()
        parsed = pd.to_datetime(text, format="ISO8601", utc=True, errors="coerce")
    bad = parsed.isna().to_numpy()
    if bad.any():
        # mixed epoch numbers and text: the first value not of the column's majority kind is the one named
        majority_numeric = not pd.api.types.is_datetime64_any_dtype(raw) and numeric.sum() > (~bad).sum()
        row = int(np.flatnonzero(~numeric if majority_numeric else bad)[0])
        raise rows.error(row, f"{name}: expected an ISO-8601 time (2026-11-25T17:00:00.123Z) or an epoch number, "
                              f"got {_describe(raw.iloc[row])}")
    return (parsed - parsed.min()).dt.total_seconds().to_numpy(dtype=np.float64)


def load_workload(path: Path, *, seed: int = 0) -> Trace:
    """A workload spec YAML (traces/workload.py) built into its trace."""
    from kvsim.traces.workload import load_workload_spec

    return load_workload_spec(path, seed=seed)


def load_inference_perf(path: Path, *, seed: int = 0) -> Trace:
    """An inference-perf config's load and synthetic data built into a trace (traces/inference_perf.py)."""
    from kvsim.traces.inference_perf import load_inference_perf as load

    return load(path, seed=seed)


def load_vllm_multi_turn(path: Path, *, seed: int = 0) -> Trace:
    """vLLM's multi-turn benchmark config as the sessions it generates (traces/multi_turn.py)."""
    from kvsim.traces.multi_turn import load_multi_turn_config

    return load_multi_turn_config(path, seed=seed)


_LOADERS = {
    "sharegpt": load_sharegpt,
    "vllm-multi-turn": load_vllm_multi_turn,
    "workload": load_workload,
    "inference-perf": load_inference_perf,
    "vllm-bench": load_vllm_bench,
    **{fmt: _generic(fmt) for fmt in GENERIC_FORMATS},
    "azure": load_azure,
    "mooncake": load_mooncake,
    "vidur": load_vidur,
    "burstgpt": load_burstgpt,
    "lengths": load_lengths,
    "native-jsonl": load_native_jsonl,
    "native-csv": load_native_csv,
    "native-parquet": load_native_parquet,
}
