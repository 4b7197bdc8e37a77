"""Data shaping for the dashboard: run records, binned step logs, CDFs, the pool map, fidelity
errors, capacity tables. Pure functions over the simulator's own tables (no Streamlit here)."""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import yaml

from kvsim.dashboard import DATA_ROOT_ENV
from kvsim.sim.io.safe_io import InputError, load_yaml_file, read_input_text, restore_nan, safe_json_loads

LATENCY_METRICS = {"ttft_s": "TTFT", "tpot_s": "TPOT", "e2e_s": "E2E"}

# Columns of a step log that count things (summed over replicas when binning).
_ADDITIVE = ("batch_size", "blocks_used", "blocks_free", "blocks_cached", "live_slots", "allocated_slots",
             "num_running", "num_waiting")
# Columns that count events in a step (summed within a bin, not averaged).
_EVENTS = ("prefill_tokens", "decode_tokens", "preemptions", "finished", "evicted_tokens",
           "blocks_freed_by_eviction", "bytes_moved")

POOL_STATES = ("free", "cached prefix", "allocated, empty or evicted slots", "live tokens")


class DataError(ValueError):
    """A results file or directory does not hold what the page needs; the message names it."""


# ---- the data root: the only directory tree the dashboard reads and writes -------------------
def data_root() -> Path:
    """$KVSIM_DATA_ROOT (set by `kvsim dashboard --data-root`), else ./runs of the server's directory."""
    return Path(os.environ.get(DATA_ROOT_ENV) or "runs").expanduser().resolve()


MAX_NAME_BYTES = 255        # one file or folder name (NAME_MAX of Linux file systems)


def resolve_user_path(text: str) -> Path:
    """A path typed into the page: relative paths are taken from the data root; anything resolving
    outside it (absolute paths elsewhere, `..`, symbolic links out) is refused."""
    root = data_root()
    if "\x00" in text or len(text) > 1024:
        raise DataError("the path holds a NUL character or is longer than 1024 characters; expected a path under "
                        f"the data directory {root}")
    if any(len(part.encode()) > MAX_NAME_BYTES for part in Path(text.strip()).parts):
        raise DataError(f"a name in the path is longer than {MAX_NAME_BYTES} bytes (the file system's limit); "
                        f"expected a path under the data directory {root}")
    path = (root / Path(text.strip()).expanduser()).resolve()
    if path != root and root not in path.parents:
        raise DataError(f"{text.strip()}: outside the dashboard's data directory {root}; the dashboard reads "
                        f"and writes only there (its owner chooses it when starting the dashboard)")
    return path


_QUOTED = re.compile(r"'[^']*'|\"[^\"]*\"|\[[^\]]*\]")
_LISTED = re.compile(r"(the header has|the file has|has columns?)[^;]*", re.IGNORECASE)


def redact_content(message: str) -> str:
    """An error message about a user's file without the file's own content: quoted values, bracketed
    lists and listed header columns are dropped (a path field must not become a file viewer)."""
    return _LISTED.sub(r"\1 other content", _QUOTED.sub("(content not shown)", message))


def redact_file_text(message: str, paths: list[str]) -> str:
    """`message` with what follows the first of `paths` it names redacted (redact_content): a loader
    names its file, then says what it found there; a message naming none of them is unchanged."""
    found = [(message.find(p), p) for p in paths if p and p in message]
    if not found:
        return message
    at, path = min(found)
    cut = at + len(path)
    return message[:cut] + redact_content(message[cut:])


@dataclass(frozen=True)
class TokenTimes:
    """Every request's output token times in one float64 buffer: request i's (row i of the run's
    requests) are values[offsets[i]:offsets[i + 1]]. Kept flat as requests.parquet stores them (an
    Arrow list column's values and offsets): a pandas column of one array per request costs more to
    build, and to concatenate again, than anything the pages compute from the 10^6-10^7 times."""
    offsets: np.ndarray     # int64 [requests + 1], offsets[0] == 0
    values: np.ndarray      # float64 [tokens]

    @classmethod
    def from_column(cls, column) -> TokenTimes:
        """From a column of per-request sequences (None or empty: no token); no column: no tokens."""
        if column is None:
            return cls(np.zeros(1, dtype=np.int64), np.zeros(0))
        from kvsim.sim.results.metrics import flat_token_times

        offsets, values = flat_token_times([() if t is None else t for t in column])
        return cls(offsets, values)

    @classmethod
    def from_arrow(cls, array) -> TokenTimes:
        """From an Arrow list<double> column (chunked or not; null lists hold no token)."""
        import pyarrow as pa
        import pyarrow.compute as pc

        if isinstance(array, pa.ChunkedArray):
            array = array.combine_chunks() if array.num_chunks else pa.array([], array.type)
        if array.null_count == 0:         # as written: the list offsets and a view of the values, no copy
            bounds = array.offsets.to_numpy()          # respects a slice; `values` is the whole child
            values = array.values.to_numpy(zero_copy_only=False)[int(bounds[0]):int(bounds[-1])]
            return cls((bounds - bounds[0]).astype(np.int64), values.astype(np.float64, copy=False))
        lengths = pc.list_value_length(array).fill_null(0).to_numpy(zero_copy_only=False)
        offsets = np.zeros(len(array) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        values = array.flatten().to_numpy(zero_copy_only=False).astype(np.float64, copy=False)   # null lists: none
        return cls(offsets, values)

    def gaps(self) -> np.ndarray:
        """Each token's gap since its request's previous token; NaN for a request's first token."""
        gaps = np.empty_like(self.values)
        if len(gaps):
            gaps[0] = np.nan
            np.subtract(self.values[1:], self.values[:-1], out=gaps[1:])
        starts = self.offsets[:-1][np.diff(self.offsets) > 0]
        gaps[starts] = np.nan
        return gaps


@dataclass
class RunRecord:
    """One simulation's results as the pages use them (from run_simulation or a --out directory)."""
    label: str
    summary: dict
    requests: pd.DataFrame
    steps: pd.DataFrame
    config: dict = field(default_factory=dict)
    path: Path | None = None           # its run directory (every dashboard run has one)
    tiers: pd.DataFrame | None = None  # tiers.parquet: the KV offload tiers' occupancy over time (with kv_offload)
    # every output token's time, flat (TokenTimes); read from requests.parquet's list column, whose
    # per-request arrays `requests` then leaves out. None: taken from requests["token_times_s"] when asked
    token_times: TokenTimes | None = field(default=None, repr=False, compare=False)
    _memo: dict = field(default_factory=dict, repr=False, compare=False)

    def tokens(self) -> TokenTimes:
        """Every output token's time, all requests in one buffer (TokenTimes), in the rows' order."""
        if self.token_times is None:
            self.token_times = TokenTimes.from_column(self.requests.get("token_times_s"))
        return self.token_times

    def memo(self, key, compute):
        """compute() once per run and key: a run is read once (ui caches the record) and shown on many
        page runs, and its derived tables (binned steps, token timestamps) cost more than drawing them."""
        if key not in self._memo:
            self._memo[key] = compute()
        return self._memo[key]

    @property
    def num_blocks_total(self) -> int:
        return int(self.summary.get("num_gpu_blocks") or 0) * int(self.summary.get("replicas") or 1)

    @property
    def pool_blocks(self) -> int:
        """Blocks of the managed pool, all replicas. Per-head layouts manage one-(layer, KV head) pages:
        num_gpu_blocks x layers x KV heads of them; the step log's used + free count says how many."""
        if len(self.steps) and {"blocks_used", "blocks_free"} <= set(self.steps.columns):
            per_replica = (self.steps["blocks_used"] + self.steps["blocks_free"]).groupby(
                self.steps.get("replica", 0)).max()
            return int(per_replica.sum())
        return self.num_blocks_total

    @property
    def rows_per_block(self) -> int:
        """Pool pages per configured block: 1 for the shared layout, layers x KV heads per GPU for per_head."""
        if self.num_blocks_total <= 0:   # a summary without the pool size: draw the pool as it is
            return 1
        return max(1, round(self.pool_blocks / self.num_blocks_total))

    @property
    def block_size(self) -> int:
        return int(self.summary.get("block_size") or self.config.get("engine", {}).get("block_size", 16))

    @property
    def per_head(self) -> bool:
        return self.rows_per_block > 1


def partial_note(run: RunRecord) -> str | None:
    """What an interrupted run (summary.json `partial: true`) covers, or None for a complete one."""
    s = run.summary
    if not s.get("partial"):
        return None
    total = s.get("num_trace_requests")
    of = f" of the workload's {total:,}" if isinstance(total, int) else ""
    return (f"{run.label}: partial result ({s.get('partial_reason') or 'interrupted'}): the run stopped after "
            f"{s.get('num_requests', 0):,} requests{of} had arrived, {s.get('num_finished', 0):,} finished; every "
            "figure covers the run up to then.")


def record_from_result(result, cfg, label: str) -> RunRecord:
    return RunRecord(label, dict(result.summary), result.requests,
                     result.steps if result.steps is not None else pd.DataFrame(),
                     cfg.model_dump(mode="json"))


def load_run_dir(path: str | Path, label: str | None = None) -> RunRecord:
    """Read a `kvsim simulate --out DIR` directory (summary.json, requests.parquet, steps.parquet)."""
    d = Path(path).expanduser()
    if not d.is_dir():
        raise DataError(f"{d}: not a directory (expected the --out directory of `kvsim simulate`)")
    missing = [n for n in ("summary.json", "requests.parquet", "steps.parquet") if not (d / n).exists()]
    if missing:
        raise DataError(f"{d}: missing {', '.join(missing)} (expected the --out directory of `kvsim simulate`)")
    try:
        summary = restore_nan(safe_json_loads(read_input_text(d / "summary.json", what="summary.json"),
                                              str(d / "summary.json")))
    except json.JSONDecodeError as exc:
        raise DataError(f"{d / 'summary.json'}:{exc.lineno}: not valid JSON ({exc.msg})") from None
    except InputError as exc:
        raise DataError(str(exc)) from None
    config = {}
    if (d / "config.yaml").exists():
        try:
            config = load_yaml_file(d / "config.yaml", what="config.yaml") or {}
        except InputError as exc:
            raise DataError(str(exc)) from None
        except (yaml.YAMLError, ValueError):
            raise DataError(f"{d / 'config.yaml'}: not valid YAML") from None
    if not isinstance(summary, dict) or not isinstance(config, dict):
        raise DataError(f"{d}: summary.json and config.yaml must each hold a mapping")
    check_summary(summary, d / "summary.json")
    tiers = read_parquet(d / "tiers.parquet", TIER_COLUMNS) if (d / "tiers.parquet").exists() else None
    requests, tokens = read_requests(d / "requests.parquet")
    return RunRecord(label or run_label(d), summary, requests, read_parquet(d / "steps.parquet"), config, d, tiers,
                     tokens)


# summary.json figures the pages read: the counts must be there, every one a number (or null: not measured)
SUMMARY_COUNTS = ("num_requests", "num_finished", "num_rejected")
SUMMARY_NUMBERS = SUMMARY_COUNTS + (
    "num_gpu_blocks", "replicas", "block_size", "num_trace_requests", "throughput_output_tok_s", "goodput_req_s",
    "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s", "slo_attainment", "kv_util_mean", "kv_util_max",
    "fragmentation_mean", "fragmentation_p99", "preemptions", "evicted_tokens", "evicted_token_rows",
    "blocks_freed_by_eviction", "bytes_moved", "compression_ratio", "attention_mass_retained_mean", "torch_threads")


def check_summary(summary: dict, where: Path) -> None:
    """DataError naming the file and key when a summary.json lacks a count or holds a non-number
    where the pages read a figure (a file edited by hand or written by another tool)."""
    missing = [k for k in SUMMARY_COUNTS if k not in summary]
    if missing:
        raise DataError(f"{where}: no {', '.join(missing)} (expected the summary.json of a kvsim run)")
    wrong = [k for k in SUMMARY_NUMBERS if summary.get(k) is not None
             and (isinstance(summary[k], bool) or not isinstance(summary[k], (int, float)))]
    if wrong:
        raise DataError(f"{where}: {', '.join(wrong)}: expected a number or null")


# ---- run directories: every dashboard run is one, in the CLI's layout -----------------------------
RUNS_DIR = "dashboard-runs"       # where the dashboard's own runs go, under the data root
LABEL_FILE = "dashboard.json"     # the label a dashboard run was given (CLI runs: their path)
RUN_FILES = ("summary.json", "requests.parquet", "steps.parquet")
TIER_COLUMNS = ("time_s", "tier", "blocks_held", "capacity_blocks")


def is_run_dir(path: Path) -> bool:
    return all((path / name).is_file() for name in RUN_FILES)


def list_run_dirs(root: Path, max_depth: int = 4) -> list[Path]:
    """Run directories (summary.json + requests/steps.parquet) under `root`, newest first: the
    dashboard's own runs and any `kvsim simulate --out` directory there. Staging directories of
    runs still being written (hidden names) are skipped."""
    found = []
    for summary in root.glob("**/summary.json"):
        d = summary.parent
        rel = d.relative_to(root).parts
        if len(rel) <= max_depth and not any(p.startswith(".") for p in rel) and is_run_dir(d):
            found.append(d)
    return sorted(found, key=lambda d: ((d / "summary.json").stat().st_mtime, str(d)), reverse=True)


def run_label(d: Path) -> str:
    try:
        return str(json.loads((d / LABEL_FILE).read_text())["label"])
    except (OSError, ValueError, KeyError, TypeError):
        return d.name


def new_run_dir(root: Path, label: str, taken: set[str]) -> tuple[Path, str]:
    """A fresh directory for a dashboard run (not created) and the run's label, made unique
    among `taken` labels by a counter ("label (2)")."""
    unique, n = label, 2
    while unique in taken:
        unique, n = f"{label} ({n})", n + 1
    slug = re.sub(r"[^A-Za-z0-9._=-]+", "-", unique).strip("-.")[:80] or "run"
    stamp = pd.Timestamp.now().strftime("%Y%m%d-%H%M%S")
    d, n = root / RUNS_DIR / f"{stamp}-{slug}", 2
    while d.exists():
        d, n = root / RUNS_DIR / f"{stamp}-{slug}-{n}", n + 1
    return d, unique


def write_label(d: Path, label: str) -> None:
    from kvsim.sim.io.safe_io import atomic_output

    with atomic_output(d / LABEL_FILE) as tmp:
        tmp.write_text(json.dumps({"label": label}) + "\n")


def run_zip(d: Path) -> bytes:
    """The run directory as a zip (its files under the directory's name): regular files only, never
    a symbolic link (a link in a run directory to /etc/shadow must not ship that file) nor a pipe or
    device, and only what lies inside the directory."""
    import io
    import zipfile

    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as z:
        for f in _regular_files_inside(d):
            z.write(f, f"{d.name}/{f.relative_to(d)}")
    return out.getvalue()


def _regular_files_inside(d: Path) -> list[Path]:
    """The regular files under `d`, walking no symbolic link (to a file or a folder), each resolving
    inside `d`."""
    import stat

    root, found = d.resolve(), []
    for folder, dirs, files in os.walk(d, followlinks=False):
        dirs[:] = [x for x in dirs if not os.path.islink(os.path.join(folder, x))]
        for name in files:
            path = Path(folder) / name
            try:
                mode = os.lstat(path).st_mode
            except OSError:
                continue
            if stat.S_ISREG(mode) and root in path.resolve().parents:
                found.append(path)
    return sorted(found)


def cli_command(d: Path, root: Path, summary: dict | None = None) -> str:
    """The command that reruns a run directory from its resolved config.yaml: `kvsim simulate`, bit
    for bit; for a real-backend replay (`backend: real`), `kvsim replay` with the replay's options."""
    rel = d.relative_to(root) if d == root or root in d.parents else d
    config = root / rel / "config.yaml"
    if (summary or {}).get("backend") != "real":
        return f"kvsim simulate -c {config} --out {rel}-rerun"
    return " ".join(["kvsim replay -c", str(config), *replay_options(summary), f"--out {rel}-rerun"])


def replay_options(summary: dict) -> list[str]:
    """The `kvsim replay` options a replay ran with (summary.json's `replay` and `torch_threads`),
    those that differ from the command's defaults."""
    ran = summary.get("replay") or {}
    out = [f"--{key} {ran[key]}" for key, default in (("device", "cpu"), ("weights", "smollm2"), ("dtype", None),
                                                       ("layers", None), ("clock", "wall"))
           if ran.get(key) not in (None, default)]
    if ran.get("attention_stats") is False:
        out.append("--no-attention-stats")
    if summary.get("torch_threads"):
        out.append(f"--threads {summary['torch_threads']}")
    return out


def flatten(config: dict, prefix: str = "") -> dict:
    """{'engine': {'block_size': 16}} -> {'engine.block_size': 16}."""
    out = {}
    for k, v in config.items():
        if isinstance(v, dict) and v:
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def config_diff(config: dict, base: dict) -> dict:
    """Dotted keys whose value in `config` differs from `base` (both nested dicts)."""
    a, b = flatten(config), flatten(base)
    return {k: v for k, v in a.items() if k in b and b[k] != v or k not in b}


# what a reader of any chart of the run needs to know of its configuration, in this order
CONFIG_HEADLINE = ("trace", "trace_options.max_requests", "trace_options.rate_scale", "model", "gpu", "tp",
                   "replicas", "engine.block_size", "engine.num_gpu_blocks", "engine.max_num_seqs",
                   "engine.max_num_batched_tokens", "engine.enable_prefix_caching", "kv.policy", "kv.budget",
                   "kv.layout", "kv.slot_strategy", "kv.mode", "seed")


def used_config(run: RunRecord) -> dict:
    """The run's configuration as dotted keys, with the KV pool it actually used: a pool sized from
    GPU memory (`engine.num_gpu_blocks` unset) shows the block count the run computed."""
    flat = flatten(run.config)
    if run.summary.get("num_gpu_blocks"):
        flat["engine.num_gpu_blocks"] = run.summary["num_gpu_blocks"]
    return flat


def config_headline(run: RunRecord, omit: tuple[str, ...] = ()) -> str:
    """One line of the run's configuration (trace, model, GPU, engine, KV policy, budget, layout,
    slot strategy), with the pool size the run actually used; `omit`: dotted keys left out."""
    flat = {k: v for k, v in used_config(run).items() if k not in omit}
    if flat.get("kv.policy") in (None, "none"):
        for k in ("kv.budget", "kv.layout", "kv.slot_strategy", "kv.mode"):
            flat.pop(k, None)
    parts = [f"{k.rsplit('.', 1)[-1]}={Path(str(flat[k])).name if k == 'trace' else flat[k]}"
             for k in CONFIG_HEADLINE if flat.get(k) is not None]
    return ", ".join(parts)


def read_parquet(path: str | Path, required: tuple[str, ...] = ()) -> pd.DataFrame:
    """Read a Parquet file or directory of Parquet files; check the columns a page needs."""
    p = Path(path).expanduser()
    return _to_pandas(_read_table(p, required), p)


def read_requests(path: str | Path) -> tuple[pd.DataFrame, TokenTimes | None]:
    """requests.parquet as (the table without its `token_times_s` list column, that column's token
    times flat), or (the table, None) for a file without the column."""
    p = Path(path).expanduser()
    table = _read_table(p)
    if "token_times_s" not in table.column_names:
        return _to_pandas(table, p), None
    import pyarrow as pa

    column = table.column("token_times_s")
    if not (pa.types.is_list(column.type) or pa.types.is_large_list(column.type)) \
            or not pa.types.is_floating(column.type.value_type):
        raise DataError(f"{p}: column token_times_s is {column.type}; expected a list of numbers per request")
    return _to_pandas(table.drop_columns(["token_times_s"]), p), TokenTimes.from_arrow(column)


def _read_table(p: Path, required: tuple[str, ...] = ()):
    """The Arrow table of a Parquet file or directory, read in this thread (pyarrow's reader threads add
    CPU time, not speed, on tables the size of a run's), with the `required` columns."""
    import pyarrow.parquet as pq

    if not p.exists():
        raise DataError(f"{p}: no such file or directory")
    try:
        table = pq.read_table(p, use_threads=False)
    except Exception as exc:  # pyarrow raises several types for a non-Parquet file
        raise DataError(f"{p}: not a readable Parquet file ({type(exc).__name__})") from None
    lacking = [c for c in required if c not in table.column_names]
    if lacking:
        raise DataError(f"{p}: missing column(s) {', '.join(lacking)}")
    return table


def _to_pandas(table, p: Path) -> pd.DataFrame:
    try:
        return table.to_pandas(use_threads=False, split_blocks=True)     # no copy into 2-D blocks
    except Exception as exc:  # a type pandas cannot hold
        raise DataError(f"{p}: not a readable Parquet file ({type(exc).__name__})") from None


# ---- request metrics ---------------------------------------------------------------------------
def latency_cdf(requests: pd.DataFrame, column: str) -> pd.DataFrame:
    """Empirical CDF of a latency column over finished requests: columns value_ms, fraction."""
    done = requests[requests["status"] == "finished"]
    values = np.sort(done[column].dropna().to_numpy(dtype=float)) * 1e3
    return pd.DataFrame({"value_ms": values, "fraction": np.arange(1, values.size + 1) / max(values.size, 1)})


def output_token_rate(times: np.ndarray, num_bins: int = 200) -> pd.DataFrame:
    """Output tokens per second over time, from every output token's time (TokenTimes.values)."""
    if not len(times):
        return pd.DataFrame({"time_s": [], "output_tok_s": []})
    lo, hi = float(times.min()), float(times.max())
    edges = np.linspace(lo, hi if hi > lo else lo + 1.0, num_bins + 1)
    counts = np.bincount(windows_small(times, edges), minlength=num_bins)    # np.histogram's bins; it sorts 4 M times
    return pd.DataFrame({"time_s": 0.5 * (edges[:-1] + edges[1:]), "output_tok_s": counts / np.diff(edges)})


# ---- step log ----------------------------------------------------------------------------------
def bin_steps(steps: pd.DataFrame, num_bins: int = 200, span: tuple[float, float] | None = None) -> pd.DataFrame:
    """Resample a step log onto `num_bins` equal time bins (over `span`, default the log's).

    State columns (pool counts, queue lengths, batch size) are duration-weighted means per replica,
    summed over replicas; a bin with no step start holds the previous bin's state (the engine was
    idle). Event columns (tokens, preemptions, evictions, bytes moved) are summed per bin and also
    given per second (`*_per_s`). `busy_s` is the step time started in each bin (all replicas) and
    `fragmentation` the duration-weighted mean of the steps' own, as summary.json weighs them: the
    busy-time-weighted mean of a state column over the bins is the summary's time-weighted mean.
    """
    if steps is None or not len(steps):
        return pd.DataFrame()
    t0, t1 = span if span is not None else (float(steps["time_s"].min()),
                                            float((steps["time_s"] + steps["duration_s"]).max()))
    edges = np.linspace(t0, t1 if t1 > t0 else t0 + 1.0, num_bins + 1)
    width = np.diff(edges)
    idx = np.clip(np.searchsorted(edges, steps["time_s"].to_numpy(), side="right") - 1, 0, num_bins - 1)
    weight = np.maximum(steps["duration_s"].to_numpy(dtype=float), 1e-12)
    out = pd.DataFrame({"time_s": 0.5 * (edges[:-1] + edges[1:]), "bin_s": width})
    state_cols = [c for c in _ADDITIVE if c in steps]
    state = {c: steps[c].to_numpy(float) for c in state_cols}
    total = np.zeros((num_bins, len(state_cols)))
    groups = steps.groupby("replica" if "replica" in steps else np.zeros(len(steps)), sort=True).indices
    for key in sorted(groups):      # each replica's rows by position (no index lookups), in replica order
        pos = groups[key]
        w = weight[pos]
        wsum = np.bincount(idx[pos], weights=w, minlength=num_bins)
        means = np.column_stack([np.bincount(idx[pos], weights=state[c][pos] * w, minlength=num_bins)
                                 for c in state_cols]) / np.where(wsum > 0, wsum, 1)[:, None]
        means = pd.DataFrame(np.where(wsum[:, None] > 0, means, np.nan)).ffill().fillna(0.0).to_numpy()
        total += means
    for j, c in enumerate(state_cols):
        out[c] = total[:, j]
    busy = np.bincount(idx, weights=weight, minlength=num_bins)
    out["busy_s"] = busy
    out["steps"] = np.bincount(idx, minlength=num_bins)
    for c in _EVENTS:
        if c in steps:
            out[c] = np.bincount(idx, weights=steps[c].to_numpy(float), minlength=num_bins)
            out[f"{c}_per_s"] = out[c] / width
    if "fragmentation" in steps:
        frag = np.bincount(idx, weights=steps["fragmentation"].to_numpy(float) * weight, minlength=num_bins)
        out["fragmentation"] = pd.Series(np.where(busy > 0, frag / np.where(busy > 0, busy, 1), np.nan)).ffill().fillna(0.0)
    elif "allocated_slots" in out:
        alloc = out["allocated_slots"].to_numpy()
        out["fragmentation"] = np.where(alloc > 0, 1.0 - out["live_slots"] / np.where(alloc > 0, alloc, 1), 0.0)
    return out


def eviction_rates(binned: pd.DataFrame, rows_per_block: int) -> pd.DataFrame:
    """Eviction per second in the summary's units: tokens evicted (a per-head run's (token, layer,
    KV head) entries divided by the layers x KV heads: token-equivalents, summed as summary.json's
    evicted_tokens is) and blocks freed (a per-head run's one-(layer, KV head) pages divided likewise:
    block-equivalents)."""
    out = pd.DataFrame({"time_s": binned["time_s"]})
    for col, name in (("evicted_tokens", "tokens_per_s"), ("blocks_freed_by_eviction", "blocks_per_s")):
        out[name] = binned[f"{col}_per_s"] / rows_per_block if f"{col}_per_s" in binned else 0.0
    return out


def pool_map(binned: pd.DataFrame, num_blocks: int, block_size: int, rows: int = 120,
             zoom: bool = False, pages_per_block: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """A (rows x bins) map of the block pool over time, state codes indexing POOL_STATES.

    The step log holds pool counts, not per-block states, so each time bin's column is the pool
    laid out by state: live-token block-equivalents at the bottom, then allocated blocks' empty
    or evicted slots, then free blocks still caching a prefix, then free blocks. Per-head layouts
    (`pages_per_block` (layer, KV head) pages per block) are drawn as the mean row: page and slot
    counts divided by the number of rows, against the `num_blocks` pages each row has, so the share
    of allocated slots holding no live token is the run's fragmentation. Returns (codes, block_edges)
    where row i covers blocks [block_edges[i], block_edges[i+1]). With `zoom` the rows span only the
    part of the pool that was ever used or cached (plus 10%).
    """
    used = binned["blocks_used"].to_numpy() / pages_per_block if len(binned) else np.zeros(0)
    cached = used + (binned["blocks_cached"].to_numpy() / pages_per_block if len(binned) else 0)
    live = binned["live_slots"].to_numpy() / (block_size * pages_per_block) if len(binned) else np.zeros(0)
    top = num_blocks
    if zoom and len(binned):
        top = min(num_blocks, max(1.0, 1.1 * float(cached.max())))
    edges = np.linspace(0, top, rows + 1)
    y = (0.5 * (edges[:-1] + edges[1:]))[:, None]
    codes = np.select([y < live[None, :], y < used[None, :], y < cached[None, :]], [3, 2, 1], default=0)
    return codes, edges


# ---- fidelity ----------------------------------------------------------------------------------
def step_kind(steps: pd.DataFrame) -> pd.Series:
    """prefill / decode / mixed per step, as the calibration and the cross-check classify steps."""
    if {"prefill_tokens", "decode_tokens"} <= set(steps.columns):
        from kvsim.sim.crosscheck.comparison import step_kind as by_tokens
        return pd.Series(by_tokens(steps), index=steps.index)
    prefill = steps["num_prefill_seqs"] > 0
    decode = steps["num_decode_seqs"] > 0
    return pd.Series(np.select([prefill & decode, prefill], ["mixed", "prefill"], default="decode"),
                     index=steps.index)


def fidelity_table(steps: pd.DataFrame, measured: str = "duration_s", predicted: str = "predicted_s",
                   kind: pd.Series | None = None) -> pd.DataFrame:
    """Per-step error of the cost model's prediction against the measured step time, with the
    cross-check report's definitions (sim.crosscheck.comparison.fit_errors).

    Rows: all steps, then by step kind (prefill / decode / mixed) and batch-size bucket. Columns:
    steps, MAPE, median and p90 absolute percentage error, median bias (signed; + = the model
    predicts slower than measured), total predicted / measured time ratio.
    """
    both = steps[[measured, predicted]].astype(float)
    ok = np.isfinite(both[measured]) & np.isfinite(both[predicted]) & (both[measured] > 0)
    if not ok.any():
        raise DataError(f"no step has both a finite {predicted} and a positive {measured}")
    s = steps[ok]
    groups = [("all steps", pd.Series(True, index=s.index))]
    if kind is not None or {"num_prefill_seqs", "num_decode_seqs"} <= set(s.columns) \
            or {"prefill_tokens", "decode_tokens"} <= set(s.columns):
        k = (kind.loc[s.index] if kind is not None else step_kind(s))
        groups += [(f"{name} steps", k == name) for name in ("prefill", "decode", "mixed") if (k == name).any()]
    if "batch_size" in s:
        bucket = pd.cut(s["batch_size"], [0, 1, 4, 16, 64, 256, np.inf], labels=[
            "batch 1", "batch 2-4", "batch 5-16", "batch 17-64", "batch 65-256", "batch >256"])
        groups += [(str(b), bucket == b) for b in bucket.cat.categories if (bucket == b).any()]
    return pd.DataFrame([_error_row(name, s.loc[mask, measured].to_numpy(float), s.loc[mask, predicted].to_numpy(float))
                         for name, mask in groups])


def _error_row(name: str, measured: np.ndarray, predicted: np.ndarray) -> dict:
    from kvsim.sim.crosscheck.comparison import fit_errors

    e = fit_errors(measured, predicted, np.full(measured.size, "all"))["all"]
    return {"group": name, "steps": e["count"], "MAPE_%": 100 * e["mape"], "median_APE_%": 100 * e["median_ape"],
            "p90_APE_%": 100 * e["p90_ape"], "median_bias_%": 100 * e["bias"],
            "predicted/measured": predicted.sum() / measured.sum()}


CROSSCHECK_FILES = ("crosscheck.json", "step_times.parquet")


@dataclass
class Crosscheck:
    """A `kvsim crosscheck --out DIR` directory: its figures (crosscheck.json) and the replay's steps
    priced by the cost model with the calibrated profile (step_times.parquet)."""
    path: Path
    figures: dict
    step_times: pd.DataFrame

    @property
    def steps(self) -> pd.DataFrame:
        """step_times as a step log (duration_s = measured, predicted_s = the cross-check's prediction)."""
        return self.step_times.rename(columns={"measured_s": "duration_s"})

    @property
    def kind(self) -> pd.Series:
        return self.step_times["kind"]

    def signed_error(self, metric: str, percentile: int | None = None) -> float:
        """(simulated - measured) / measured of a latency percentile or a throughput metric, with its
        sign (the headline keeps only the size)."""
        table = self.figures.get("latency" if percentile is not None else "throughput") or []
        for row in table:
            if row.get("metric") == metric and (percentile is None or row.get("percentile") == percentile):
                value = row.get("rel_error")
                return math.nan if value is None else float(value)
        return math.nan

    @property
    def model_vs_measured(self) -> float:
        """Relative difference of the summed step time, cost model on the replay's batches vs measured."""
        t = self.figures.get("total_time") or {}
        m = t.get("measured_s")
        return t["model_on_replay_batches_s"] / m - 1 if m else math.nan


def is_crosscheck_dir(path: Path) -> bool:
    return path.is_dir() and all((path / name).is_file() for name in CROSSCHECK_FILES)


def read_crosscheck(path: str | Path) -> Crosscheck:
    d = Path(path)
    try:     # read as summary.json is: size-bounded, UTF-8 checked, the error naming the file, not quoting it
        figures = safe_json_loads(read_input_text(d / "crosscheck.json", what="crosscheck.json"),
                                  str(d / "crosscheck.json"))
    except json.JSONDecodeError as exc:
        raise DataError(f"{d / 'crosscheck.json'}:{exc.lineno}: not valid JSON ({exc.msg})") from None
    except InputError as exc:
        raise DataError(str(exc)) from None
    times = read_parquet(d / "step_times.parquet", ("kind", "measured_s", "predicted_s"))
    if not isinstance(figures, dict) or "step_errors" not in figures:
        raise DataError(f"{d / 'crosscheck.json'}: not a kvsim crosscheck result (no step_errors)")
    return Crosscheck(d, figures, times)


# ---- capacity ----------------------------------------------------------------------------------
def read_sweep_store(path: str | Path) -> tuple[pd.DataFrame, pd.DataFrame, dict | None]:
    """(finished rows, failed rows, capacity result or None) of a sweep/capacity store directory
    (`kvsim sweep` / `kvsim capacity --store`), or of a single Parquet file of rows."""
    from kvsim.sim.planning.capacity import read_capacity
    from kvsim.sim.planning.sweep import StoreFileError, read_store

    p = Path(path).expanduser()
    if p.is_file():
        df, capacity = read_parquet(p), None
    elif (p / "runs").is_dir():
        try:
            df, capacity = read_store(p), read_capacity(p)
        except StoreFileError as exc:    # names the file and what it lacks, never its content
            raise DataError(str(exc)) from None
        except Exception as exc:  # pyarrow / json errors of a damaged store; their text may quote the files
            raise DataError(f"{p}: a file of this sweep store cannot be read ({type(exc).__name__})") from None
    elif p.is_dir():
        raise DataError(f"{p}: not a sweep store (expected a runs/ directory of Parquet rows, "
                        "as written by `kvsim sweep` or `kvsim capacity --store`)")
    else:
        raise DataError(f"{p}: no such file or directory")
    if not len(df):
        raise DataError(f"{p}: the store has no finished runs yet")
    if "status" not in df:
        return df, df.iloc[0:0], capacity
    return df[df["status"] == "ok"].reset_index(drop=True), df[df["status"] != "ok"], capacity


def varying_columns(df: pd.DataFrame, candidates: list[str]) -> list[str]:
    return [c for c in candidates if c in df and df[c].astype(str).nunique(dropna=False) > 1]


def pareto_front(df: pd.DataFrame, cost: str, benefit: str) -> pd.Series:
    """True for rows no other row beats on both lower `cost` and higher `benefit`."""
    c = df[cost].to_numpy(float)
    b = df[benefit].to_numpy(float)
    order = np.lexsort((-b, c))
    front = np.zeros(len(df), dtype=bool)
    best = -np.inf
    for i in order:
        if np.isfinite(c[i]) and np.isfinite(b[i]) and b[i] > best:
            front[i] = True
            best = b[i]
    return pd.Series(front, index=df.index)


def meets_slo(df: pd.DataFrame, constraints) -> pd.Series:
    """Rows meeting every constraint (sim.planning.capacity.Constraint: metric, op, limit)."""
    ok = pd.Series(True, index=df.index)
    for c in constraints:
        if c.metric not in df:
            raise DataError(f"SLO metric {c.metric} is not a column of this table")
        ok &= df.apply(lambda row, c=c: c.holds(row.to_dict()), axis=1)
    return ok


def capacity_by_group(df: pd.DataFrame, load: str, ok: pd.Series, group: str | None) -> pd.DataFrame:
    """Highest `load` value per group among rows meeting the SLO (a grid's answer)."""
    rows = []
    for key, part in (df.groupby(group, sort=True, dropna=False) if group else [("all runs", df)]):
        good = part[ok.loc[part.index]]
        rows.append({group or "group": key[0] if isinstance(key, tuple) else key,
                     f"max {load} meeting the SLO": good[load].max() if len(good) else math.nan,
                     "points": len(part), "points meeting the SLO": len(good)})
    return pd.DataFrame(rows)


def drain_share(row) -> float:
    """Share of a run's makespan after its last arrival (the queue draining); NaN if unknown.

    Above one half, goodput and throughput describe how fast the batch drains, not a rate the
    server sustains: the capacity curve then plateaus at the batch's size, not at the server's."""
    rate, n, makespan = row.get("offered_rate_req_s"), row.get("num_requests"), row.get("makespan_s")
    if not rate or not n or not makespan or any(map(math.isnan, (rate, n, makespan))) or n < 2:
        return math.nan
    return max(0.0, 1.0 - ((n - 1) / rate) / makespan)


# ---- time series: what a vLLM operator's Grafana shows, over the simulated run ---------------------
WINDOW_PERCENTILES = (50, 90, 99)
# the cost model's time terms (CostModel.breakdown) as the time-series page names them
TIME_TERMS = {"linear": "GEMMs (linear layers, LM head)", "attention": "attention", "copy": "KV copies / moves",
              "allreduce": "all-reduce", "swap": "swap", "overhead": "CPU overhead (not hidden)",
              "rest": "policy ops and other (not in the step log)"}


def time_edges(run: RunRecord, num_bins: int) -> np.ndarray:
    """Window edges spanning the run: first arrival to the end of its last step."""
    t0 = float(run.requests["arrival_s"].min()) if len(run.requests) else 0.0
    ends = [float((run.steps["time_s"] + run.steps["duration_s"]).max())] if len(run.steps) else []
    if len(run.requests) and run.requests["finish_s"].notna().any():
        ends.append(float(run.requests["finish_s"].max()))
    t1 = max(ends + [t0 + 1e-9])
    return np.linspace(t0, t1, num_bins + 1)


def window_of(times: np.ndarray, edges: np.ndarray) -> np.ndarray:
    w = np.searchsorted(edges, times, side="right")
    w -= 1                                  # in place: millions of token times
    return np.clip(w, 0, len(edges) - 2, out=w)


_CHUNK = 1 << 18


def windows_small(times: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """window_of of millions of times (a run's output tokens) in the smallest integer type that also
    holds one more window than there are: 2 bytes a time for up to 32,766 windows, not 8, computed a
    chunk at a time (a fresh 8-byte array of 4 M windows costs more in page faults than the search)."""
    n = len(edges) - 1
    out = np.empty(len(times), dtype=np.int16 if n < 32_767 else np.int32)
    for at in range(0, len(times), _CHUNK):
        out[at:at + _CHUNK] = window_of(times[at:at + _CHUNK], edges)
    return out


def window_percentiles(times: pd.Series, values: pd.Series, edges: np.ndarray, scale: float = 1.0) -> pd.DataFrame:
    """Percentiles (p50/p90/p99) of `values` observed at `times`, per window (NaN where none): a
    histogram_quantile over the window, as Grafana shows vLLM's latency histograms."""
    ok = times.notna() & values.notna()
    n = len(edges) - 1
    out = pd.DataFrame(index=range(n))
    if not ok.any():
        for q in WINDOW_PERCENTILES:
            out[f"p{q}"] = np.nan
        out["count"] = 0
        return out
    w = window_of(times[ok].to_numpy(float), edges)
    grouped = pd.Series(values[ok].to_numpy(float) * scale).groupby(w)
    for q in WINDOW_PERCENTILES:
        out[f"p{q}"] = grouped.quantile(q / 100).reindex(range(n))
    out["count"] = grouped.size().reindex(range(n)).fillna(0).astype(int)
    return out


def request_series(requests: pd.DataFrame, edges: np.ndarray) -> pd.DataFrame:
    """Per window: arrivals and finishes per second; TTFT percentiles of the requests whose first token
    came in it, TPOT and E2E of those that finished in it, queue time of those first scheduled in it
    (as vLLM's histograms observe them); the prefix-cache hit rate of prompt tokens admitted in it."""
    r = requests
    width = np.diff(edges)
    out = pd.DataFrame({"time_s": 0.5 * (edges[:-1] + edges[1:])})
    n = len(width)
    arrivals = np.bincount(window_of(r["arrival_s"].to_numpy(float), edges), minlength=n) if len(r) else np.zeros(n)
    done = r[r["status"] == "finished"]
    finishes = np.bincount(window_of(done["finish_s"].to_numpy(float), edges), minlength=n) if len(done) else np.zeros(n)
    out["arrivals_per_s"], out["finished_per_s"] = arrivals / width, finishes / width
    for name, at, column, scale in (("ttft_ms", "first_token_s", "ttft_s", 1e3), ("tpot_ms", "finish_s", "tpot_s", 1e3),
                                    ("e2e_s", "finish_s", "e2e_s", 1.0), ("queue_s", "first_scheduled_s", "queueing_s", 1.0)):
        p = window_percentiles(done[at], done[column], edges, scale)
        for q in WINDOW_PERCENTILES:
            out[f"{name}_p{q}"] = p[f"p{q}"].to_numpy()
    admitted = r[r["first_scheduled_s"].notna()]
    w = window_of(admitted["first_scheduled_s"].to_numpy(float), edges)
    prompt = np.bincount(w, weights=admitted["prompt_tokens"].to_numpy(float), minlength=n)
    cached = np.bincount(w, weights=admitted["cached_tokens"].to_numpy(float), minlength=n)
    out["prefix_hit_rate"] = np.where(prompt > 0, cached / np.where(prompt > 0, prompt, 1), np.nan)
    return out


def step_shape(steps: pd.DataFrame):
    """The step log's columns as the cost model's BatchShape (float arrays). Policy-operation work
    and swap bytes are not logged: they are 0 here."""
    from kvsim.sim.core.step import BatchShape

    col = lambda c: steps[c].to_numpy(np.float64) if c in steps else np.zeros(len(steps))   # noqa: E731
    return BatchShape(num_seqs=col("batch_size"), num_prefill_tokens=col("prefill_tokens"),
                      num_decode_tokens=col("decode_tokens"), attn_pairs_prefill=col("attn_pairs_prefill"),
                      kv_tokens_read=col("kv_tokens_read"), bytes_moved=col("bytes_moved"),
                      block_table_entries=col("block_table_entries"))


def step_costs(steps: pd.DataFrame, cost) -> pd.DataFrame:
    """Per step, from the cost model (`sim.model.cost_model.CostModel`): `flops_s` and `bytes_s`, the seconds
    the step's model FLOPs (linear layers, LM head, attention) and its HBM traffic (weights,
    activations, KV reads, slot copies) take at the GPU's peak rates, and the seconds of each term of
    TIME_TERMS (`t_<term>`), which add up to the step's duration."""
    shape = step_shape(steps)
    f = cost.features(shape, padded=False)
    b = cost.breakdown(shape)
    out = pd.DataFrame(index=steps.index)
    out["flops_s"] = f["linear_compute_prefill"] + f["linear_compute_decode"] + f["attn_compute"]
    out["bytes_s"] = f["linear_memory"] + f["attn_memory"] + f["copy"]
    device = b["linear"] + b["attention"] + b["copy"] + b["swap"] + b["allreduce"]
    for term in ("linear", "attention", "copy", "allreduce", "swap"):
        out[f"t_{term}"] = np.asarray(b[term], dtype=float) * np.ones(len(steps))
    out["t_overhead"] = np.asarray(b["total"] - device, dtype=float) * np.ones(len(steps))   # async: the part not hidden
    duration = steps["duration_s"].to_numpy(float)
    out["t_rest"] = np.maximum(duration - np.asarray(b["total"], dtype=float), 0.0)
    return out


def run_cost_model(run: RunRecord):
    """The cost model the run was priced with (from its config.yaml; a real-backend replay's with the
    model it ran: its layers and tensor dtype), or None when it cannot be rebuilt."""
    from kvsim.sim.config import SimConfig
    from kvsim.sim.crosscheck.recorded import replay_model_spec
    from kvsim.sim.engine.resolved_run import resolve_hardware, with_engine_defaults

    if not run.config:
        return None
    try:
        cfg = with_engine_defaults(SimConfig.model_validate(run.config))
        return resolve_hardware(cfg, replay_model_spec(cfg, run.summary) if run.summary.get("backend") == "real"
                                else None).cost
    except Exception:  # a replay's model file, a profile no longer there: no cost panels
        return None


def time_series(run: RunRecord, num_bins: int = 120, cost=None) -> pd.DataFrame:
    """Every time-series panel's data, one row per window (see request_series, bin_steps, step_costs).
    `mfu` / `mbu`: model FLOPs and bandwidth utilisation of the busy time (the peak-rate seconds of
    the steps started in a window over their duration); `share_<term>`: each term's share of it."""
    edges = time_edges(run, num_bins)
    out = request_series(run.requests, edges)
    out = pd.concat([out, grafana_series(run, edges)], axis=1)
    if not len(run.steps):
        return out
    b = bin_steps(run.steps, num_bins, span=(float(edges[0]), float(edges[-1])))
    for c in ("num_running", "num_waiting", "batch_size", "fragmentation", "busy_s", "steps", "preemptions_per_s",
              "bin_s"):
        if c in b:
            out[c] = b[c].to_numpy()
    out["kv_usage"] = b["blocks_used"].to_numpy() / max(run.pool_blocks, 1)
    w = window_of(run.steps["time_s"].to_numpy(float), edges)
    steps_in = np.maximum(out["steps"].to_numpy(float), 1)
    tokens = (run.steps["prefill_tokens"] + run.steps["decode_tokens"]).to_numpy(float)
    out["batched_tokens"] = np.where(out["steps"] > 0, np.bincount(w, weights=tokens, minlength=num_bins) / steps_in,
                                     np.nan)
    out["batch_size_per_step"] = np.where(out["steps"] > 0, np.bincount(
        w, weights=run.steps["batch_size"].to_numpy(float), minlength=num_bins) / steps_in, np.nan)
    if cost is not None:
        c = step_costs(run.steps, cost)
        busy = out["busy_s"].to_numpy(float)
        share = lambda col: np.where(busy > 0, np.bincount(w, weights=c[col].to_numpy(float), minlength=num_bins)  # noqa: E731
                                     / np.where(busy > 0, busy, 1), np.nan)
        out["mfu"], out["mbu"] = share("flops_s"), share("bytes_s")
        for term in TIME_TERMS:
            out[f"share_{term}"] = share(f"t_{term}")
    return out


# ---- the panels of vLLM's Grafana dashboard (examples/online_serving/prometheus_grafana) -------------
# vLLM's histogram buckets for request lengths (vllm:request_prompt_tokens / request_generation_tokens:
# 1-2-5 steps up to the model length), as the heatmaps bucket them
LENGTH_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1_000, 2_000, 5_000, 10_000, 20_000, 50_000, 100_000,
                  200_000, 500_000, 1_000_000)


def _quantiles_by_window(w: np.ndarray, v: np.ndarray, n: int, scale: float) -> dict[str, np.ndarray]:
    """p50/p90/p99 (linear interpolation, as numpy's default) of `v` per window index `w`; NaN where none.
    A value whose window is `n` is left out (how a caller drops values without copying the arrays).
    The inter-token gaps of a large run are millions: one stable (radix) sort by window, then per window
    only the two order statistics each percentile needs (np.partition), not a full sort."""
    out = {f"p{q}": np.full(n, np.nan) for q in WINDOW_PERCENTILES}
    if not len(v):
        return out
    order = np.argsort(w.astype(np.int32 if n >= 32_767 else np.int16, copy=False), kind="stable")
    v = v[order]
    counts = np.bincount(w, minlength=n)[:n]
    ends = np.cumsum(counts)
    for window in np.flatnonzero(counts):
        part = v[ends[window] - counts[window]:ends[window]]
        pos = {q: (len(part) - 1) * (q / 100) for q in WINDOW_PERCENTILES}
        ranks = sorted({r for p in pos.values() for r in (int(np.floor(p)), min(int(np.floor(p)) + 1, len(part) - 1))})
        ordered = np.partition(part, ranks)
        for q, p in pos.items():
            lo = int(np.floor(p))
            hi = min(lo + 1, len(part) - 1)
            frac = p - lo
            out[f"p{q}"][window] = ordered[lo] * scale * (1 - frac) + ordered[hi] * scale * frac
    return out


def finish_category(requests: pd.DataFrame) -> pd.Series:
    """Why each request ended, in a few words: `finished` (it produced its output length: vLLM's
    finish reason `length`, as a benchmark with ignore_eos and max_tokens reports it), `rejected:` and
    why it can never fit (the scheduler's reject_reason, without its numbers), or `unfinished` (a
    partial run)."""
    status = requests["status"].astype(str)
    reason = requests["reject_reason"].astype(str) if "reject_reason" in requests else pd.Series("", index=requests.index)
    why = np.select([reason.str.contains("max_model_len"), reason.str.contains("KV pool"),
                     reason.str.contains("max_num_batched_tokens")],
                    ["rejected: prompt over max_model_len", "rejected: larger than the KV pool",
                     "rejected: over max_num_batched_tokens"], default="rejected")
    return pd.Series(np.where(status == "finished", "finished (length)",
                              np.where(status == "rejected", why, status)), index=requests.index)


def grafana_series(run: RunRecord, edges: np.ndarray) -> pd.DataFrame:
    """Per window, the vLLM Grafana panels request_series does not cover: token throughput (prompt
    tokens computed per second from the step log, generation tokens from the token timestamps),
    inter-token latency percentiles (each gap observed when its token came), the mean prefill and
    decode time of the requests finished in the window (vLLM's request_prefill_time / decode_time:
    first schedule to first token, first token to finish), finishes per second by reason."""
    n = len(edges) - 1
    width = np.diff(edges)
    out = pd.DataFrame(index=range(n))
    tokens = run.tokens()
    times, gaps = tokens.values, run.memo("token_gaps", tokens.gaps)
    token_window = windows_small(times, edges)
    out["generation_tok_s"] = np.bincount(token_window, minlength=n)[:n] / width if len(times) else 0.0
    if len(run.steps):
        w = window_of(run.steps["time_s"].to_numpy(float), edges)
        out["prompt_tok_s"] = np.bincount(w, weights=run.steps["prefill_tokens"].to_numpy(float), minlength=n) / width
    token_window[np.isnan(gaps)] = n     # a request's first token has no gap: left out of the percentiles
    for name, values in _quantiles_by_window(token_window, gaps, n, 1e3).items():
        out[f"itl_ms_{name}"] = values
    done = run.requests[run.requests["status"] == "finished"]
    w = window_of(done["finish_s"].to_numpy(float), edges)
    count = np.bincount(w, minlength=n).astype(float)
    for name, start, end in (("prefill_s", "first_scheduled_s", "first_token_s"), ("decode_s", "first_token_s", "finish_s")):
        spent = (done[end] - done[start]).to_numpy(float)
        out[f"{name}_mean"] = np.where(count > 0, np.bincount(w, weights=np.nan_to_num(spent), minlength=n)
                                       / np.where(count > 0, count, 1), np.nan)
    ended = run.requests[run.requests["status"].isin(["finished", "rejected"])]
    category = finish_category(ended)
    at = ended["finish_s"].fillna(ended["arrival_s"]).to_numpy(float)    # a rejection happens on arrival
    for name in sorted(category.unique()):
        mask = (category == name).to_numpy()
        out[f"finish:{name}"] = np.bincount(window_of(at[mask], edges), minlength=n) / width
    return out


def length_heatmap(requests: pd.DataFrame, column: str, edges: np.ndarray) -> tuple[np.ndarray, list[str]]:
    """(buckets x windows) counts of finished requests by `column` (prompt_tokens, output_tokens) in
    vLLM's length buckets, each request counted in the window it finished (when vLLM observes it);
    the buckets' labels ('<= 100'). Buckets that hold no request length between the shortest and the
    longest are left out."""
    done = requests[requests["status"] == "finished"]
    values = done[column].to_numpy(float)
    low, top = (float(values.min()), float(values.max())) if len(values) else (1.0, 1.0)
    bounds = [b for b in LENGTH_BUCKETS if b < top] + [next((b for b in LENGTH_BUCKETS if b >= top), top)]
    bounds = bounds[int(np.searchsorted(bounds, low, side="left")):]       # from the shortest request's bucket
    b = np.searchsorted(np.asarray(bounds, dtype=float), values, side="left")
    w = window_of(done["finish_s"].to_numpy(float), edges)
    n = len(edges) - 1
    counts = np.zeros((len(bounds), n))
    np.add.at(counts, (b, w), 1)
    return counts, [f"<= {x:,}" for x in bounds]


# ---- what decided a capacity search's answer ---------------------------------------------------
def capacity_bracket(result) -> tuple[float | None, float | None]:
    """(the highest load meeting the SLO, the lowest load above it that fails) of a rate search, or
    (the fewest replicas meeting it, the most that fail) of a replica search: the answer's range."""
    curve = result.curve
    if curve is None or not len(curve):
        return None, None
    passing = curve.loc[curve["meets_slo"].astype(bool), "searched_value"]
    failing = curve.loc[~curve["meets_slo"].astype(bool), "searched_value"]
    if result.mode == "rate":
        lo = float(passing.max()) if len(passing) else None
        above = failing[failing > lo] if lo is not None else failing
        return lo, float(above.min()) if len(above) else None
    hi = float(passing.min()) if len(passing) else None
    below = failing[failing < hi] if hi is not None else failing
    return hi, float(below.max()) if len(below) else None


def capacity_stop_reason(result, search) -> str:
    """Why a capacity search (sim.capacity.find_capacity with `search`, a CapacitySearch) stopped where
    it did: the bracket closed within its tolerance, the simulation limit, or a load limit."""
    n = 0 if result.curve is None else len(result.curve)
    answer, other = capacity_bracket(result)
    if result.mode == "replicas":
        if answer is None:
            return f"no replica count up to {search.max_replicas} meets the SLO ({n} simulations)"
        if other is None:
            return f"{answer:g} replica(s) meet the SLO and no fewer were tried below ({n} simulations)"
        return f"{answer:g} replicas meet the SLO and {other:g} fail: the answer is exact ({n} simulations)"
    if answer is None:
        limit = "the simulation limit" if n >= search.max_evals else f"the smallest rate scale tried ({search.min_scale:g})"
        return f"no load meets the SLO down to {limit} ({n} simulations)"
    if other is None:
        why = f"the simulation limit ({search.max_evals})" if n >= search.max_evals else \
            f"the largest rate scale allowed ({search.max_scale:g})"
        return f"every load tried meets the SLO up to {why}: the answer is a lower bound ({n} simulations)"
    if other - answer <= search.rel_tol * answer:
        return (f"the bracket [{answer:g}, {other:g}] closed within the search's tolerance "
                f"({search.rel_tol:.0%} of the answer) after {n} simulations")
    if n >= search.max_evals:
        return f"the simulation limit ({search.max_evals}) was reached with the bracket [{answer:g}, {other:g}] still open"
    return f"the bracket [{answer:g}, {other:g}] cannot be split further at 6 significant digits ({n} simulations)"


# ---- comparing runs ------------------------------------------------------------------------------
def deltas_against(table: pd.DataFrame, baseline: str, label: str = "run") -> pd.DataFrame:
    """Each run's figures relative to the `baseline` run's, in percent ((run - baseline) / |baseline|;
    NaN where the baseline's figure is 0 or missing); the baseline's own row is left out."""
    numeric = [c for c in table.columns if c != label and pd.api.types.is_numeric_dtype(table[c])]
    base = table.loc[table[label] == baseline, numeric].iloc[0].astype(float)
    others = table[table[label] != baseline]
    rel = (others[numeric].astype(float) - base) / base.abs().where(base != 0)
    return pd.concat([others[[label]], 100 * rel], axis=1).reset_index(drop=True)


def flat_metric_notes(runs: list[RunRecord]) -> list[str]:
    """Why a compared figure that is the same in every run is flat, where the runs themselves say so: a
    trace without shared prefixes (no prefix hit anywhere), prefix caching off, no preemption (the pool
    never ran out), nothing evicted (the budget never reached), no rejection."""
    if len(runs) < 2:
        return []
    s = [r.summary for r in runs]
    flat = lambda key: all((x.get(key) or 0) == 0 for x in s)   # noqa: E731
    notes = []
    if flat("prefix_hit_rate"):
        caching = [bool(used_config(r).get("engine.enable_prefix_caching", True)) for r in runs]
        cached = any(int(r.requests["cached_tokens"].sum()) > 0 for r in runs if "cached_tokens" in r.requests)
        if not any(caching):
            notes.append("Prefix hit rate is 0 in every run: prefix caching is off in all of them.")
        elif not cached:
            notes.append("Prefix hit rate is 0 in every run: no request's prompt shares a full block with an earlier "
                         "one in this trace, so prefix caching has nothing to hit (a trace with shared system prompts "
                         "or conversation turns would show a difference).")
    if flat("preemptions"):
        notes.append("Preemptions are 0 in every run: no run ran out of KV blocks, so the pool size and preemption "
                     "settings change nothing here.")
    if any(x.get("evicted_tokens") is not None for x in s) and flat("evicted_tokens"):
        notes.append("Evicted tokens are 0 in every run: no request reached the policy's budget, so the runs differ "
                     "only in the policy's bookkeeping (raise the load or lower kv.budget).")
    if flat("num_rejected") is False and len({x.get("num_rejected") for x in s}) == 1:
        notes.append(f"Every run rejected the same {s[0].get('num_rejected'):,} requests (they can never fit).")
    return notes
