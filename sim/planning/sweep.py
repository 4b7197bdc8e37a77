"""Parameter sweeps over `kvsim simulate`: spec parsing/validation, a resumable Parquet results store,
and local-process or Dask executors that run the same task function.

Spec (YAML)::

    base: base.yaml              # optional SimConfig file, relative to the spec
    fixed:                       # applied to every run (dotted or nested SimConfig keys)
      trace_options.max_requests: 500
    runs:                        # optional explicit list; each entry is crossed with the grid
      - {model: llama-3.1-8b, tp: 1}
      - {model: llama-3.1-70b, tp: 4}
    grid:                        # cartesian product, last key varies fastest
      engine.block_size: [16, 32]
      trace_options.rate_scale: [1, 2, 4]
      seed: [0, 1]
    save_outputs: false          # also keep requests/steps/summary of each run under outputs/<run_id>/

Store layout (DIR)::

    runs/<run_id>.parquet        # one row per finished run, written atomically (tmp + rename)
    outputs/<run_id>/            # each run's simulate outputs when save_outputs
    plan.json                    # run ids of the latest spec, in run order (sets the row order)
    spec.yaml                    # the latest spec as given

A run id is a stable hash of the fully resolved SimConfig, so re-running a spec (or a spec that
shares runs with an earlier one) skips the runs already in the store.
"""
from __future__ import annotations

import hashlib
import itertools
import json
import math
import multiprocessing
import os
import threading
import time
import warnings
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from collections.abc import Callable, Iterable, Iterator

import pyarrow as pa
import pyarrow.parquet as pq

from kvsim.traces.errors import TraceError, TraceWarning
from kvsim.traces.loaders import resolve_trace_path, reusing_parsed_traces

from ..model.catalog import CatalogError, get_gpu, get_model
from ..config import (FILE_KEYS, RANDOM_TRACE, SESSIONS_TRACE, ConfigError, SimConfig, build_config, files_under, flatten, read_config_file,
                     read_yaml_file)
from ..model.cost_model import load_profile
from ..model.defaults import resolve_engine
from ..model.memory import ModelDoesNotFitError, PoolSizing, available_memory_bytes, check_memory, num_gpu_blocks
from ..kv.policy import policy_identity
from ..io.result_dirs import holding_store_lock, mark_owned
from ..io.safe_io import pid_alive
from ..io.safe_io import KVSIM_TMP, atomic_output
from ..simulator.simulate import run_simulation

SPEC_KEYS = ("base", "fixed", "grid", "runs", "save_outputs", "name")
# summary keys that repeat a config column; the store keeps the config column
_SUMMARY_DUPLICATES = {"tp", "replicas", "trace", "block_size"}
_SUMMARY_RENAMES = {"model": "model_name", "gpu": "gpu_name"}


class SpecError(ValueError):
    """A sweep spec is malformed or names a configuration that cannot run; the message says where."""


# ---- spec -> validated run plan --------------------------------------------------------------

@dataclass(frozen=True)
class PlannedRun:
    index: int
    run_id: str
    config: dict          # SimConfig.model_dump(mode="json")
    axes: dict            # the values this run sets from `runs` and `grid` (for labels)


@dataclass
class SweepPlan:
    runs: list[PlannedRun]
    save_outputs: bool = False
    name: str | None = None
    axis_keys: list[str] = field(default_factory=list)
    duplicates: int = 0   # grid points that resolved to a config already planned


MAX_SWEEP_RUNS = 100_000          # planned runs of one spec (each is checked and listed before any runs)


def run_id_of(cfg: SimConfig) -> str:
    """Stable hash of the resolved config (every field, defaults included), of the content of the
    files it names (input_file_digests) and, for a plug-in policy, the plug-in's identity (class and
    source hash: sim.kv.policy.policy_identity)."""
    blob = json.dumps(cfg.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
    identity = policy_identity(cfg.kv.policy)
    if identity:
        blob += "|" + identity
    files = input_file_digests(cfg)
    if files:
        blob += "|files:" + json.dumps(files, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def input_file_digests(cfg: SimConfig) -> dict[str, str]:
    """{config key: content hash} of the user files the config names (a trace file, model / GPU /
    profile / importance YAML, a tokenizer), so a run id changes when a file is rewritten in place
    and a store never returns the results of the file's former content. Shipped names have none."""
    from kvsim.traces.loaders import DATA_TRACES, TRACE_ALIASES
    named = {key: _config_value(cfg, key) for key in FILE_KEYS}
    if cfg.trace in DATA_TRACES or cfg.trace in TRACE_ALIASES:
        named["trace"] = None
    named["profile"] = cfg.profile.rpartition("*")[0] or cfg.profile      # NAME*K: a scaled profile file
    out = {}
    for key, value in named.items():
        path = Path(value) if value else None
        if path is not None and path.is_dir():
            path = next((path / f for f in ("config.json", "tokenizer.json") if (path / f).is_file()), None)
        if path is not None and path.is_file():
            out[key] = _file_digest(path)
    return out


def _config_value(cfg: SimConfig, dotted: str):
    value = cfg
    for key in dotted.split("."):
        value = getattr(value, key)
    return value


_DIGESTS: dict[tuple, str] = {}


def _file_digest(path: Path) -> str:
    """sha256 of the file's bytes, cached while its size and modification time stay the same (a
    capacity search asks once per point)."""
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    if key not in _DIGESTS:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        _DIGESTS[key] = h.hexdigest()[:16]
    return _DIGESTS[key]


def _describe(values: dict) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in values.items()) or "(base config)"


def load_spec(path: str | Path) -> SweepPlan:
    path = Path(path)
    try:
        raw = read_yaml_file(path, what="sweep spec", expected="a sweep spec YAML file")
    except ConfigError as exc:
        raise SpecError(str(exc)) from None
    return parse_spec(raw, source=str(path), root=path.parent)


def parse_spec(raw: Any, *, source: str = "spec", root: Path | None = None) -> SweepPlan:  # noqa: C901  one check per spec key, each with its own error message
    """Validate a spec mapping and expand it to the ordered list of distinct runs.

    Everything is checked before anything runs: spec keys, every axis value on its own (so the
    error names the key and value), every combination as a whole, and whether the model fits the
    GPU at that tensor-parallel degree."""
    if not isinstance(raw, dict):
        raise SpecError(f"{source}: expected a mapping with keys {', '.join(SPEC_KEYS)}")
    unknown = sorted(set(raw) - set(SPEC_KEYS))
    if unknown:
        raise SpecError(f"{source}: unknown key {unknown[0]!r}; a spec has {', '.join(SPEC_KEYS)}")
    save_outputs, name = raw.get("save_outputs", False), raw.get("name")
    if not isinstance(save_outputs, bool):
        raise SpecError(f"{source}: save_outputs: expected true or false, got {save_outputs!r}")
    if name is not None and not isinstance(name, str):
        raise SpecError(f"{source}: name: expected a string, got {name!r}")
    base = _load_base(raw.get("base"), source, root)
    fixed = _mapping(raw.get("fixed"), f"{source}: fixed")
    grid = _mapping(raw.get("grid"), f"{source}: grid")
    runs = raw.get("runs")
    runs = [{}] if runs is None else runs
    if not isinstance(runs, list):
        raise SpecError(f"{source}: runs: expected a list of config mappings, got {type(runs).__name__}")
    if not runs:
        raise SpecError(f"{source}: runs: empty list: the sweep has no runs")
    runs = [_mapping(r, f"{source}: runs[{i}]") for i, r in enumerate(runs)]
    _check_size(runs, grid, source)
    for key, values in grid.items():
        if not isinstance(values, list):
            raise SpecError(f"{source}: grid.{key}: expected a list of values, got {values!r}")
        if not values:
            raise SpecError(f"{source}: grid.{key}: empty list: the product has no runs")
    # the spec's relative file paths name files beside it, as `base:` does; labels keep them as written
    files = (lambda d: d) if root is None else (lambda d: files_under(d, root))
    fixed, runs_cfg = files(fixed), [files(r) for r in runs]
    grid_cfg = {key: [files({key: v})[key] for v in values] for key, values in grid.items()}

    _check(base, fixed, f"{source}: fixed")
    for key, values in grid.items():
        for i, value in enumerate(values):
            _check(base, {**fixed, key: grid_cfg[key][i]}, f"{source}: grid.{key}[{i}] = {value!r}")
    for i, run in enumerate(runs):
        _check(base, {**fixed, **runs_cfg[i]}, f"{source}: runs[{i}] ({_describe(run)})")

    planned: list[PlannedRun] = []
    seen: set[str] = set()
    duplicates = 0
    fits = _FitChecker()
    for run, run_cfg in zip(runs, runs_cfg, strict=True):
        for combo, combo_cfg in zip(itertools.product(*grid.values()), itertools.product(*grid_cfg.values()), strict=True):
            axes = {**run, **dict(zip(grid, combo, strict=True))}
            where = f"{source}: run {len(planned) + duplicates} ({_describe(axes)})"
            cfg = _check(base, {**fixed, **run_cfg, **dict(zip(grid, combo_cfg, strict=True))}, where)
            fits.check(cfg, where)
            rid = run_id_of(cfg)
            if rid in seen:
                duplicates += 1
                continue
            seen.add(rid)
            planned.append(PlannedRun(len(planned), rid, cfg.model_dump(mode="json"), axes))
    axis_keys = list(dict.fromkeys([k for r in runs for k in r] + list(grid)))
    return SweepPlan(planned, save_outputs, name, axis_keys, duplicates)


def _check_size(runs: list, grid: dict, source: str) -> None:
    """Count the runs before expanding the product: a spec of a few lines can name billions."""
    total = len(runs)
    for _key, values in grid.items():
        if isinstance(values, list):
            total *= max(len(values), 1)
    if total > MAX_SWEEP_RUNS:
        sizes = " x ".join(f"{len(v)} {k}" for k, v in grid.items() if isinstance(v, list))
        raise SpecError(f"{source}: grid: {total:,} runs ({len(runs)} run(s) x {sizes}); a sweep may have at most "
                        f"{MAX_SWEEP_RUNS:,}; split it into several specs or fewer values")


def _mapping(value: Any, where: str) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise SpecError(f"{where}: expected a mapping of config keys, got {value!r}")
    return flatten(value)


def _load_base(base: Any, source: str, root: Path | None) -> dict:
    if base is None:
        return {}
    if isinstance(base, dict):
        return base if root is None else files_under(base, root)      # build_config copies it
    path = Path(base)
    if not path.is_absolute() and root is not None:
        path = root / path
    try:
        return read_config_file(path, option="")
    except ConfigError as exc:
        raise SpecError(f"{source}: base: {exc}") from None


def _check(base: dict, overrides: dict, where: str) -> SimConfig:
    try:
        return build_config(base, overrides)
    except ConfigError as exc:
        raise SpecError(f"{where}: {exc}") from None


class _FitChecker:
    """Resolves model, GPU, profile and trace names and checks the weights fit, once per combination."""

    def __init__(self):
        self._seen: dict[tuple, str | None] = {}
        self._pools: dict[tuple, tuple | str] = {}
        self._memory: dict[tuple, str | None] = {}
        self._kv: dict[str, str | None] = {}
        self._available: tuple[int, str] | None = None

    def check(self, cfg: SimConfig, where: str) -> None:
        eng = cfg.engine
        key = (cfg.model, cfg.gpu, cfg.tp, cfg.kv_dtype, cfg.weight_dtype, cfg.profile, cfg.trace, eng.block_size,
               eng.gpu_memory_utilization, eng.max_num_batched_tokens, eng.max_num_seqs, cfg.pp, cfg.dp)
        if key not in self._seen:
            self._seen[key] = self._problem(cfg)
        if self._seen[key]:
            raise SpecError(f"{where}: {self._seen[key]}")
        kv_key = cfg.kv.model_dump_json()
        if kv_key not in self._kv:
            self._kv[kv_key] = self._kv_problem(cfg)
        if self._kv[kv_key]:
            raise SpecError(f"{where}: {self._kv[kv_key]}")
        pool_key = key + (eng.num_gpu_blocks,)
        if pool_key not in self._pools:
            self._pools[pool_key] = self._pool(cfg)
        if isinstance(self._pools[pool_key], str):
            raise SpecError(f"{where}: {self._pools[pool_key]}")
        mem_key = pool_key + (cfg.replicas, cfg.check_invariants, cfg.kv.model_dump_json())
        if mem_key not in self._memory:
            self._memory[mem_key] = self._memory_problem(cfg, *self._pools[pool_key])
        if self._memory[mem_key]:
            raise SpecError(f"{where}: {self._memory[mem_key]}")

    # The checks a run makes before it allocates its pool (a hand-given pool fits the GPU; the host-memory
    # estimate fits what is available), made for every configuration before any run starts.
    @staticmethod
    def _pool(cfg: SimConfig):
        """(model, pool blocks) as the run resolves them, or the reason the pool does not fit the GPU."""
        from ..engine.resolved_run import resolve_hardware, with_engine_defaults

        try:
            hw = resolve_hardware(with_engine_defaults(cfg))
            model, blocks = hw.model, hw.num_blocks
        except (CatalogError, ValueError) as exc:
            return str(exc)
        return model, blocks

    @staticmethod
    def _kv_problem(cfg: SimConfig) -> str | None:
        """A KV option the run's policy would never read (refused when the run builds its manager)."""
        from ..kv.build import build_policy, refuse_ignored_kv_options

        try:
            refuse_ignored_kv_options(cfg.kv, build_policy(cfg.kv))
        except ConfigError as exc:
            return str(exc)
        return None

    def _memory_problem(self, cfg: SimConfig, model, blocks: int) -> str | None:
        if self._available is None:
            self._available = available_memory_bytes()
        from ..engine.resolved_run import resolve_run

        try:
            check_memory(resolve_run(cfg).memory, self._available)
        except ValueError as exc:
            return str(exc)
        return None

    @staticmethod
    def _problem(cfg: SimConfig) -> str | None:

        try:
            if cfg.trace not in (RANDOM_TRACE, SESSIONS_TRACE):     # generated workloads: no file
                resolve_trace_path(cfg.trace)
        except TraceError as exc:
            return f"trace={cfg.trace!r}: {exc}"
        try:
            model = get_model(cfg.model)
            if cfg.weight_dtype:
                model = model.with_dtypes(weight_dtype=cfg.weight_dtype)
        except (CatalogError, ValueError) as exc:
            return f"model={cfg.model!r}: {exc}"
        try:
            gpu = get_gpu(cfg.gpu)
        except CatalogError as exc:
            return f"gpu={cfg.gpu!r}: {exc}"
        try:
            load_profile(cfg.profile, gpu=gpu)
        except (CatalogError, ValueError, FileNotFoundError) as exc:
            return f"profile={cfg.profile!r}: {exc}"
        eng = resolve_engine(cfg)
        try:
            num_gpu_blocks(model, gpu, PoolSizing.of_engine(eng, tp=cfg.tp, kv_dtype=cfg.kv_dtype, pp=cfg.pp, dp=cfg.dp))
        except ModelDoesNotFitError as exc:
            return f"model={cfg.model!r} gpu={cfg.gpu!r} tp={cfg.tp}: {exc}"
        except (CatalogError, ValueError) as exc:
            return f"model={cfg.model!r} gpu={cfg.gpu!r} tp={cfg.tp}: {exc}"
        return None


# ---- one run (the task every executor runs) ----------------------------------------------------

@dataclass(frozen=True)
class RunTask:
    run_id: str
    config: dict
    out_dir: str | None = None


def meets_run_slo(cfg: SimConfig, summary: dict) -> bool:
    """The run meets its config's SLO at p99: TTFT p99 <= slo.ttft and TPOT p99 <= slo.tpot (those set),
    with every request finished. An undefined percentile (no request with two output tokens has a
    TPOT) does not fail it, as in SLO attainment."""
    if summary.get("num_unfinished"):
        return False
    for limit, key in ((cfg.slo.ttft_s, "ttft_p99_s"), (cfg.slo.tpot_s, "tpot_p99_s")):
        value = summary.get(key)
        if limit is not None and value is not None and not math.isnan(value) and value > limit:
            return False
    return True


def cost_metrics(cfg: SimConfig, summary: dict) -> dict:
    """GPUs used, $/hour for them and, for a run that meets its SLO (`meets_slo`), $ per million output
    tokens and per thousand good requests at the throughput achieved; NaN for a run that does not,
    so an SLO failure is never the cheapest."""

    if cfg.fleet is None:
        gpus = cfg.gpus_per_replica * cfg.replicas
        usd_per_hour = cfg.gpu_usd_per_hour() * gpus
    else:                               # a disaggregated fleet: both pools' GPUs at their own price
        pools = [(p.gpu or cfg.gpu, (p.tp or cfg.tp) * p.replicas) for _, _, p in cfg.fleet.all_pools()]
        gpus = sum(n for _, n in pools)
        usd_per_hour = sum(cfg.gpu_usd_per_hour(g) * n for g, n in pools)
    meets = meets_run_slo(cfg, summary)
    return {"num_gpus": gpus, "usd_per_hour": usd_per_hour, "meets_slo": meets,
            **slo_costs(usd_per_hour, summary.get("throughput_output_tok_s"), summary.get("goodput_req_s"), meets)}


def slo_costs(usd_per_hour: float, tok_s: float | None, good_req_s: float | None, meets: bool) -> dict:
    ok = bool(meets)
    return {
        "usd_per_m_output_tok": usd_per_hour / 3600 / tok_s * 1e6 if ok and tok_s and tok_s > 0 else math.nan,
        "usd_per_k_good_req": usd_per_hour / 3600 / good_req_s * 1e3 if ok and good_req_s else math.nan,
    }


def execute_run(task: RunTask) -> dict:
    """Run one simulation; return its metric columns. Never raises: a failure becomes a row."""

    try:
        cfg = SimConfig.model_validate(task.config)
        with warnings.catch_warnings(), reusing_parsed_traces():     # the trace's notices, once per run: not news
            warnings.simplefilter("ignore", TraceWarning)
            result = run_simulation(cfg, task.out_dir, progress=False)
        row = {"status": "ok", "error": None}
        for key, value in result.summary.items():
            if key not in _SUMMARY_DUPLICATES:
                row[_SUMMARY_RENAMES.get(key, key)] = value
        arrivals = result.requests["arrival_s"]
        span = float(arrivals.max() - arrivals.min()) if len(arrivals) > 1 else 0.0
        row["offered_rate_req_s"] = (len(arrivals) - 1) / span if span > 0 else math.nan
        row.update(cost_metrics(cfg, result.summary))
        return row
    except Exception as exc:  # noqa: BLE001 - isolate every failure to its own row
        return {"status": "failed", "error": f"{type(exc).__name__}: {exc}"}


# ---- the store -------------------------------------------------------------------------------

def _runs_dir(store: Path) -> Path:
    return store / "runs"


def config_columns(config: dict) -> dict:
    return {k: (json.dumps(v) if isinstance(v, (list, dict)) else v) for k, v in flatten(config).items()}


def make_row(run: PlannedRun | RunTask, metrics: dict) -> dict:
    head = {"run_id": run.run_id, "status": metrics["status"], "error": metrics.get("error")}
    return {**head, **config_columns(run.config), **{k: v for k, v in metrics.items() if k not in head}}


def write_row(store: Path, row: dict) -> Path:
    """Atomically write one run's row: a reader never sees a half-written file."""
    runs = _runs_dir(store)
    runs.mkdir(parents=True, exist_ok=True)
    final = runs / f"{row['run_id']}.parquet"
    with atomic_output(final) as tmp:
        pq.write_table(pa.Table.from_pylist([row]), tmp)
    return final


@dataclass
class StoreState:
    """The runs a store holds: finished ok, recorded as failed, and files that cannot be read (a disk
    error, a copy cut short, an edit): those count as not run, and the next sweep runs them again."""
    ok: set[str] = field(default_factory=set)
    failed: set[str] = field(default_factory=set)
    unreadable: list[Path] = field(default_factory=list)


def store_state(store: str | Path) -> StoreState:
    state = StoreState()
    runs = _runs_dir(Path(store))
    for path in sorted(runs.glob("[!.]*.parquet")) if runs.is_dir() else ():
        table = _read_run_file(path, columns=["run_id", "status"])
        if table is None:
            state.unreadable.append(path)
        else:
            (state.ok if table["status"][0].as_py() == "ok" else state.failed).add(path.stem)
    return state


def _read_run_file(path: Path, columns: list[str] | None = None) -> pa.Table | None:
    """A run file's one row, or None when the file is not a readable row of that run."""
    try:
        table = pq.read_table(path, columns=columns)
    except (OSError, pa.ArrowException, KeyError, ValueError):
        return None
    if table.num_rows != 1 or "run_id" not in table.column_names or "status" not in table.column_names:
        return None
    return table if table["run_id"][0].as_py() == path.stem else None


def finished_runs(store: Path, *, include_failed: bool = True) -> set[str]:
    state = store_state(store)
    return state.ok | state.failed if include_failed else state.ok


def read_store(store: str | Path, *, order: bool = True):
    """All readable rows of a store as one DataFrame, sorted by the latest plan's run order (runs not
    in it follow, by run id). Adds `run_index` (position in the plan, -1 when not in it). Unreadable
    run files are left out and listed in `df.attrs["unreadable"]`."""
    import pandas as pd

    store = Path(store)
    files = sorted(_runs_dir(store).glob("[!.]*.parquet")) if _runs_dir(store).is_dir() else []
    tables = {f: _read_run_file(f) for f in files}
    unreadable = [f.name for f, t in tables.items() if t is None]
    tables = [t for t in tables.values() if t is not None]
    if not tables:
        df = pd.DataFrame(columns=["run_index", "run_id", "status", "error"])
        df.attrs["unreadable"] = unreadable
        return df
    table = pa.concat_tables(tables, promote_options="permissive")
    df = table.to_pandas()
    if order:
        plan = read_plan(store)
        position = {rid: i for i, rid in enumerate(plan)}
        df.insert(0, "run_index", df["run_id"].map(lambda r: position.get(r, -1)).astype("int64"))
        df["_after"] = df["run_index"] < 0
        df = df.sort_values(["_after", "run_index", "run_id"], kind="stable").drop(columns="_after")
        df = df.reset_index(drop=True)
    df.attrs["unreadable"] = unreadable
    return df


class StoreFileError(ValueError):
    """A store's JSON file (plan.json, capacity.json) is malformed; the message names the file and
    what was expected, never its content."""


def read_store_object(path: Path, expected: str) -> dict:
    """A store file's JSON object; not JSON, or not an object, is a StoreFileError naming the file
    (`expected` says what the object holds)."""
    try:
        data = json.loads(path.read_text())
    except ValueError as exc:
        raise StoreFileError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise StoreFileError(f"{path}: expected a JSON object {expected}, got a {type(data).__name__}")
    return data


def read_plan(store: Path) -> list[str]:
    """The run ids of the store's plan.json, in run order ([] without one); a malformed file is a
    StoreFileError naming it."""
    path = Path(store) / "plan.json"
    if not path.exists():
        return []
    data = read_store_object(path, "with run_ids")
    run_ids = data.get("run_ids")
    if not isinstance(run_ids, list) or not all(isinstance(r, str) for r in run_ids):
        raise StoreFileError(f"{path}: run_ids: expected a list of run ids")
    return run_ids


def _write_plan(store: Path, plan: SweepPlan, spec_text: str | None) -> None:
    store.mkdir(parents=True, exist_ok=True)
    mark_owned(store)
    with atomic_output(store / "plan.json") as tmp:
        tmp.write_text(json.dumps({"name": plan.name, "axis_keys": plan.axis_keys,
                                   "run_ids": [r.run_id for r in plan.runs]}, indent=1))
    if spec_text is not None:
        with atomic_output(store / "spec.yaml") as tmp:
            tmp.write_text(spec_text)


def _remove_stale_tmp(store: Path) -> None:
    runs = _runs_dir(store)
    if runs.is_dir():
        for p in runs.glob(".tmp-*.parquet"):       # written by kvsim before the guarded writer
            p.unlink(missing_ok=True)
        for p in runs.glob(f".*.parquet{KVSIM_TMP}*"):      # the store is locked: no live writer holds these
            p.unlink(missing_ok=True)


# ---- executors -------------------------------------------------------------------------------

Completed = Iterator[tuple[RunTask, dict]]


def _serial(tasks: list[RunTask]) -> Completed:
    for task in tasks:
        yield task, execute_run(task)


def _local(tasks: list[RunTask], jobs: int) -> Completed:
    # forkserver: workers fork from a clean process that has already imported the simulator
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["kvsim.sim.planning.sweep", "kvsim.sim.simulator.simulate"])
    with ProcessPoolExecutor(max_workers=jobs, mp_context=ctx, initializer=exit_with_parent,
                             initargs=(os.getpid(),)) as pool:
        futures = {pool.submit(execute_run, t): t for t in tasks}
        try:
            for fut in as_completed(futures):
                yield futures[fut], fut.result()
        finally:
            for fut in futures:
                fut.cancel()


def exit_with_parent(parent_pid: int, interval_s: float = 0.5) -> None:
    """Worker initializer: end this worker when the sweep process is gone (kill -9 leaves no chance to
    stop the pool). A worker's parent is the forkserver, which lives as long as a worker does, so the
    worker watches the sweep process itself; once the workers are gone the forkserver and the
    resource tracker see their pipes close and exit too."""
    def watch() -> None:
        while _running(parent_pid):
            time.sleep(interval_s)
        os._exit(1)

    threading.Thread(target=watch, name="kvsim-exit-with-parent", daemon=True).start()


def _running(pid: int) -> bool:
    """Whether `pid` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False
    except OSError:                 # no /proc: ask the kernel
        return pid_alive(pid)


class MissingExtra(ImportError):
    """An optional dependency a command needs is not installed; the message names the extra to install."""


DASK_EXTRA = ("a Dask scheduler needs Dask's distributed package, which the core install leaves out: "
              "pip install 'kvsim[distributed]'")


def _distributed():
    """The distributed package, or MissingExtra naming the extra that installs it."""
    try:
        import distributed
    except ImportError:
        raise MissingExtra(DASK_EXTRA) from None
    return distributed


class SchedulerUnreachable(ConnectionError):
    """No dask scheduler answered at the address given; the message names it."""


def connect(address: str, timeout_s: float = 10.0):
    """A distributed.Client of the scheduler at `address`, or SchedulerUnreachable in one line."""
    Client = _distributed().Client

    try:
        return Client(address, timeout=f"{timeout_s:g}s")
    except (OSError, TimeoutError, ValueError, TypeError) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise SchedulerUnreachable(f"--scheduler {address}: no dask scheduler answered within {timeout_s:g} s "
                                   f"({reason[:160]}); start one (dask scheduler) or check the address") from None


def _dask(tasks: list[RunTask], scheduler: Any) -> Completed:
    distributed = _distributed()
    Client, dask_completed = distributed.Client, distributed.as_completed

    client = scheduler if isinstance(scheduler, Client) else connect(scheduler)
    try:
        futures = {client.submit(execute_run, t, key=f"kvsim-run-{t.run_id}", pure=False): t for t in tasks}
        try:
            for fut in dask_completed(list(futures)):
                task = futures[fut]
                try:
                    result = fut.result()
                except Exception as exc:  # noqa: BLE001 - e.g. a worker died while running it
                    result = {"status": "failed", "error": f"{type(exc).__name__}: {exc}"}
                yield task, result
        finally:
            client.cancel(list(futures))
    finally:
        if client is not scheduler:
            client.close()


@dataclass
class SweepResult:
    store: Path
    planned: int
    skipped: int          # already in the store
    ran: int
    failed: int           # of those that ran
    wall_s: float
    retried: int = 0      # of those that ran: recorded as failed before (--retry-failed)
    redone: int = 0       # of those that ran: their run file was unreadable


@dataclass(frozen=True)
class SweepRunOptions:
    """Where and how many of a sweep's pending runs execute (`kvsim sweep`'s --executor, --jobs,
    --scheduler, --max-runs, --retry-failed, --save-outputs)."""
    executor: str = "local"             # 'local' (a process pool) or 'dask' (a running scheduler)
    jobs: int | None = None             # local workers (None: all cores; 1: in this process)
    scheduler: Any = None               # dask: an address such as tcp://host:8786, or a distributed.Client
    max_runs: int | None = None         # run at most this many of the pending runs (the rest on a later call)
    retry_failed: bool = False          # run again the runs the store records as failed
    save_outputs: bool | None = None    # keep each run's requests/steps (None: the spec's save_outputs)


@holding_store_lock
def run_sweep(plan: SweepPlan, store: str | Path, options: SweepRunOptions = SweepRunOptions(), *,
              progress: bool = True, spec_text: str | None = None,
              on_row: Callable[[dict], None] | None = None) -> SweepResult:
    """Run the plan's runs that are not in the store yet, writing each row as it finishes, as
    `options` says (SweepRunOptions)."""
    if options.max_runs is not None and options.max_runs < 0:
        raise ValueError(f"max_runs: expected a number of runs >= 0, got {options.max_runs}")
    t0 = time.perf_counter()
    store = Path(store)
    _write_plan(store, plan, spec_text)
    _remove_stale_tmp(store)
    state = store_state(store)
    done = state.ok if options.retry_failed else state.ok | state.failed
    pending = [r for r in plan.runs if r.run_id not in done]
    if options.max_runs is not None:
        pending = pending[:options.max_runs]
    unreadable = {p.stem for p in state.unreadable}
    keep = plan.save_outputs if options.save_outputs is None else options.save_outputs
    tasks = [RunTask(r.run_id, r.config, str(store / "outputs" / r.run_id) if keep else None) for r in pending]
    by_id = {r.run_id: r for r in pending}

    if not tasks:
        completed: Iterable = ()
    elif options.executor == "dask":
        if options.scheduler is None:
            raise ValueError("executor 'dask' needs a scheduler address (--scheduler tcp://host:8786)")
        completed = _dask(tasks, options.scheduler)
    elif options.executor == "local":
        jobs = options.jobs or os.cpu_count() or 1
        completed = _serial(tasks) if jobs == 1 or len(tasks) == 1 else _local(tasks, min(jobs, len(tasks)))
    else:
        raise ValueError(f"executor must be 'local' or 'dask', got {options.executor!r}")

    skipped = len(plan.runs) - len([r for r in plan.runs if r.run_id not in done])
    bar = _bar(len(plan.runs), skipped, len(tasks)) if progress else None
    failed = ran = 0
    for task, metrics in completed:
        row = make_row(by_id[task.run_id], metrics)
        write_row(store, row)
        ran += 1
        failed += metrics["status"] != "ok"
        if on_row:
            on_row(row)
        if bar:
            bar.update(1)
            bar.set_postfix(failed=failed, refresh=False)
    if bar:
        bar.close()
    return SweepResult(store, len(plan.runs), skipped, ran, failed, time.perf_counter() - t0,
                       retried=sum(r.run_id in state.failed for r in pending),
                       redone=sum(r.run_id in unreadable for r in pending))


def _bar(total: int, skipped: int, todo: int):
    from tqdm import tqdm
    # count only this session's runs so the ETA reflects the current rate
    return tqdm(total=todo, unit="run", desc=f"sweep ({skipped}/{total} already done)",
                mininterval=0.5, smoothing=0.1)
