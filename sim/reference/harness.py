"""Real vLLM as the reference: record its schedule of a trace, simulate the same in kvsim, compare.

vLLM is not a dependency of kvsim: it lives in a virtualenv of its own, and `vllm_driver.py`
runs there as a subprocess (`--vllm-python`). The driver adds each request before the engine
step given by its arrival (traces with `trace_options.arrival_unit: step`), steps the engine and
writes every step's scheduler output as JSON lines; `read_vllm_steps` turns them into a schedule
log (the columns of `SCHEDULE_COLUMNS`), the same as `kvsim_schedule` produces for kvsim.
"""
from __future__ import annotations

import json
import os
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
import yaml

from kvsim.traces import load_trace

from ..config import SimConfig, load_config
from ..model.defaults import resolve_engine
from ..simulator.simulate import run_simulation
from .prompts import prompt_token_ids
from .scenarios import Scenario

DRIVER = Path(__file__).with_name("vllm_driver.py")
CONVERTER = Path(__file__).with_name("convert_smollm2.py")

# Per step: scalar columns named as in kvsim's step log, then the per-request detail.
COUNT_COLUMNS = ("batch_size", "prefill_tokens", "decode_tokens", "preemptions", "finished",
                 "num_running", "num_waiting", "blocks_free")
ID_COLUMNS = ("scheduled_ids", "scheduled_tokens", "new_ids", "resumed_ids", "preempted_ids", "finished_ids")
SCHEDULE_COLUMNS = ("step",) + COUNT_COLUMNS + ID_COLUMNS
# The engine settings a reference run passes to vLLM (kvsim's `engine:` keys).
ENGINE_KEYS = ("block_size", "num_gpu_blocks", "max_num_batched_tokens", "max_num_seqs", "max_model_len",
               "enable_prefix_caching", "enable_chunked_prefill", "long_prefill_token_threshold",
               "scheduling_policy")


class ReferenceError(RuntimeError):
    """The vLLM reference could not be recorded (no vLLM, no model, engine failure)."""


# ----- scenario files ---------------------------------------------------------------------------
def write_scenario(scenario: Scenario, directory: Path) -> None:
    """trace.jsonl (kvsim native trace; arrival_time_s holds the arrival step) and scenario.yaml."""
    directory.mkdir(parents=True, exist_ok=True)
    lines = []
    if scenario.prefix_block_tokens:
        lines.append(json.dumps({"kvsim_trace": {"name": scenario.name,
                                                 "prefix_block_tokens": scenario.prefix_block_tokens}}))
    lines += [json.dumps(r) for r in scenario.trace_records()]
    (directory / "trace.jsonl").write_text("\n".join(lines) + "\n")
    config = {"trace": "trace.jsonl", "trace_options": {"arrival_unit": "step"},
              "model": "smollm2-135m", "gpu": "cpu-2core", "profile": "cpu-2core",
              "engine": scenario.engine_settings(), "fast_forward": True}
    header = f"# vLLM reference scenario {scenario.name}: {scenario.description}\n"
    (directory / "scenario.yaml").write_text(header + yaml.safe_dump(config, sort_keys=False))


def load_scenario(directory: Path) -> tuple[SimConfig, object]:
    """The scenario's config (trace path resolved next to it) and its trace."""

    cfg = load_config(directory / "scenario.yaml")
    cfg = cfg.model_copy(update={"trace": str(directory / cfg.trace)})
    return cfg, load_trace(cfg.trace)


# ----- the vLLM side ----------------------------------------------------------------------------
def driver_spec(cfg: SimConfig, trace, model_dir: str | Path) -> dict:
    """What `vllm_driver.py` needs: engine settings and requests with their prompt token ids."""

    eng = resolve_engine(cfg)
    if eng.num_gpu_blocks is None or eng.max_model_len is None:
        raise ReferenceError("a reference run needs engine.num_gpu_blocks and engine.max_model_len set "
                             "(vLLM's CPU backend sizes its KV cache from them)")
    if cfg.trace_options.arrival_unit != "step":
        raise ReferenceError("a reference run feeds arrivals by engine step: set "
                             "trace_options.arrival_unit: step (arrival_time_s holds the step index)")
    engine = {k: getattr(eng, k) for k in ENGINE_KEYS}
    df = trace.df
    span = trace.prefix_block_tokens
    requests = []
    for row in df.itertuples(index=False):
        ids = row.prefix_hash_ids if isinstance(row.prefix_hash_ids, list) else None
        requests.append({"id": int(row.request_id), "arrival_step": int(row.arrival_time_s),
                         "output_tokens": int(row.output_tokens), "priority": int(row.priority),
                         "prompt_token_ids": prompt_token_ids(int(row.request_id), int(row.prompt_tokens),
                                                              ids, span, seed=cfg.seed)})
    return {"model": str(model_dir), "engine": engine, "requests": requests}


def record_vllm(spec: dict, vllm_python: str, workdir: Path, timeout_s: float | None = None) -> Path:
    """Run the driver with vLLM's interpreter; returns its JSON-lines step record."""
    workdir.mkdir(parents=True, exist_ok=True)
    spec_path, out_path, log_path = workdir / "vllm_spec.json", workdir / "vllm_steps.jsonl", workdir / "vllm.log"
    spec_path.write_text(json.dumps(spec))
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    with open(log_path, "w") as log:
        try:
            proc = subprocess.run([vllm_python, str(DRIVER), str(spec_path), str(out_path)], stdout=log,
                                  stderr=subprocess.STDOUT, env=env, timeout=timeout_s)
        except FileNotFoundError:
            raise ReferenceError(f"--vllm-python {vllm_python}: no such interpreter") from None
        except subprocess.TimeoutExpired:
            raise ReferenceError(f"vLLM did not finish within {timeout_s:.0f} s; see {log_path}") from None
    if proc.returncode != 0:
        tail = log_path.read_text().strip().splitlines()[-1:] or ["(no output)"]
        raise ReferenceError(f"vLLM driver failed (exit {proc.returncode}): {tail[0][:300]}; full log: {log_path}")
    return out_path


def read_vllm_steps(path: Path) -> tuple[pd.DataFrame, dict]:
    """The driver's record as a schedule log, and its metadata (version, rejected requests)."""
    rows, meta, rejected = [], {}, {}
    for line in Path(path).read_text().splitlines():
        rec = json.loads(line)
        if "meta" in rec:
            meta.update(rec["meta"])
        elif "done" in rec:
            meta.update(rec["done"])
        elif "rejected" in rec:
            rejected[int(rec["rejected"])] = rec["reason"]
        else:
            rows.append(rec)
    meta["rejected"] = rejected
    return _with_counts(pd.DataFrame(rows)), meta


def _with_counts(df: pd.DataFrame) -> pd.DataFrame:
    """The schedule log in column order, with the counts derived from the per-request lists."""
    df["batch_size"] = df["scheduled_ids"].map(len)
    df["preemptions"] = df["preempted_ids"].map(len)
    df["finished"] = df["finished_ids"].map(len)
    return df[list(SCHEDULE_COLUMNS)]


# ----- the kvsim side ---------------------------------------------------------------------------
class _ScheduleTap:
    """Stands in for a replica's executor and keeps what each step scheduled."""

    def __init__(self, executor):
        self.inner = executor
        self.steps: list[tuple[list, list]] = []
        self.supports_fast_forward = False

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def execute(self, out):
        self.steps.append(([(s.request.request_id, s.num_new_tokens) for s in out.scheduled],
                           [r.request_id for r in out.preempted]))
        return self.inner.execute(out)

    def complete(self, result, kv_plan):
        return self.inner.complete(result, kv_plan)


def kvsim_schedule(cfg: SimConfig, trace) -> tuple[pd.DataFrame, dict]:
    """kvsim's schedule of `trace` (stepping one step at a time) and the ids it rejected."""

    taps: list[_ScheduleTap] = []
    kvs = []

    def tap(kv, executor):
        taps.append(_ScheduleTap(executor))
        kvs.append(kv)
        return kv, taps[-1]

    result = run_simulation(cfg.model_copy(update={"fast_forward": False}), trace=trace, wrap_kv=tap)
    steps = result.steps.sort_values("step").reset_index(drop=True)
    reqs = result.requests
    rejected = dict(zip(reqs.loc[reqs["status"] == "rejected", "request_id"].astype(int),
                        reqs.loc[reqs["status"] == "rejected", "reject_reason"]))
    return schedule_log(steps, taps[0].steps, set(reqs.loc[reqs["status"] == "finished", "request_id"])), \
        {"rejected": rejected, "steps": steps, "summary": result.summary, "kv": kvs[0]}


def schedule_log(steps: pd.DataFrame, tapped: list, finished: set) -> pd.DataFrame:
    """Per-step detail from the tapped scheduler outputs plus the step log's counts."""
    last_step = {}
    for j, (sched, _) in enumerate(tapped):
        for rid, _n in sched:
            last_step[rid] = j
    seen, preempted_since = set(), set()
    rows = []
    for j, (sched, preempted) in enumerate(tapped):
        ids = sorted(sched)
        new = sorted(rid for rid, _ in sched if rid not in seen)
        resumed = sorted(rid for rid, _ in sched if rid in preempted_since)
        seen.update(rid for rid, _ in sched)
        preempted_since.difference_update(resumed)
        preempted_since.update(preempted)
        rows.append({"step": j, "scheduled_ids": [rid for rid, _ in ids], "scheduled_tokens": [n for _, n in ids],
                     "new_ids": new, "resumed_ids": resumed, "preempted_ids": sorted(preempted),
                     "finished_ids": sorted(rid for rid, _ in sched if rid in finished and last_step[rid] == j)})
    detail = pd.DataFrame(rows)
    counts = steps[["step", "prefill_tokens", "decode_tokens", "num_running", "num_waiting", "blocks_free"]]
    df = detail.merge(counts, on="step", how="left")
    for c in ("prefill_tokens", "decode_tokens", "num_running", "num_waiting", "blocks_free"):
        df[c] = df[c].astype("int64")
    return _with_counts(df)


# ----- comparison -------------------------------------------------------------------------------
@dataclass
class Agreement:
    reference_steps: int
    kvsim_steps: int
    matching_steps: int                  # steps equal in every column, from step 0 on
    first_difference: dict | None        # {"step", "column", "reference", "kvsim"} or None
    column_agreement: dict = field(default_factory=dict)   # column -> fraction of common steps equal
    rejected_equal: bool = True
    reference_preemptions: int = 0
    kvsim_preemptions: int = 0

    @property
    def identical(self) -> bool:
        return self.first_difference is None and self.rejected_equal

    def to_dict(self) -> dict:
        return {**self.__dict__, "identical": self.identical}


def compare_schedules(ref: pd.DataFrame, sim: pd.DataFrame, ref_rejected=(), sim_rejected=()) -> Agreement:
    n = min(len(ref), len(sim))
    columns = COUNT_COLUMNS + ID_COLUMNS
    first, matching = None, 0
    agree = {c: 0 for c in columns}
    for j in range(n):
        a, b = ref.iloc[j], sim.iloc[j]
        for c in columns:
            equal = _value(a[c]) == _value(b[c])
            agree[c] += equal
            if not equal and first is None:
                first = {"step": j, "column": c, "reference": _value(a[c]), "kvsim": _value(b[c])}
        if first is None:
            matching = j + 1
    if first is None and len(ref) != len(sim):
        first = {"step": n, "column": "steps", "reference": len(ref), "kvsim": len(sim)}
    return Agreement(len(ref), len(sim), matching, first, {c: (v / n if n else 1.0) for c, v in agree.items()},
                     sorted(ref_rejected) == sorted(sim_rejected),
                     int(ref["preemptions"].sum()), int(sim["preemptions"].sum()))


def _value(v):
    return [int(x) for x in v] if hasattr(v, "__len__") else int(v)


# ----- stored references and whole runs ---------------------------------------------------------
def save_schedule(df: pd.DataFrame, path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.Table.from_pandas(df, preserve_index=False)
    pq.write_table(table, path)


def load_reference(directory: Path) -> tuple[pd.DataFrame, dict]:
    """A recorded scenario's vLLM schedule and its metadata (recorded.json)."""
    meta = json.loads((directory / "recorded.json").read_text())
    meta["rejected"] = {int(k): v for k, v in meta.get("rejected", {}).items()}
    return pd.read_parquet(directory / "vllm_steps.parquet"), meta


def check_scenario(directory: Path) -> Agreement:
    """kvsim's schedule of a recorded scenario against vLLM's."""
    cfg, trace = load_scenario(directory)
    ref, meta = load_reference(directory)
    sim, info = kvsim_schedule(cfg, trace)
    return compare_schedules(ref, sim, meta["rejected"], info["rejected"])


def record_scenario(directory: Path, vllm_python: str, model_dir: Path, timeout_s: float | None = None) -> dict:
    """Record real vLLM's schedule of the scenario stored in `directory` (vllm_steps.parquet +
    recorded.json); returns the metadata."""
    import datetime
    import platform

    cfg, trace = load_scenario(directory)
    with tempfile.TemporaryDirectory(prefix="kvsim-vllm-") as work:
        raw = record_vllm(driver_spec(cfg, trace, model_dir), vllm_python, Path(work), timeout_s)
        ref, meta = read_vllm_steps(raw)
    save_schedule(ref, directory / "vllm_steps.parquet")
    meta.update({"recorded_on": datetime.date.today().isoformat(), "machine": platform.machine(),
                 "steps": len(ref), "preemptions": int(ref["preemptions"].sum())})
    (directory / "recorded.json").write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    return meta


def check_reference_memory(cfg: SimConfig, trace) -> None:
    """Refuse, before vLLM starts or kvsim allocates anything, a reference run whose host memory does not
    fit: vLLM's CPU KV cache (engine.num_gpu_blocks blocks of the model's bf16 KV, sized exactly by
    num_gpu_blocks_override) and weights, beside kvsim's own simulation of the trace (HostMemoryError)."""
    from kvsim.sim.model.catalog import get_model
    from kvsim.sim.model.memory import RunMemoryEstimate, check_memory
    from kvsim.sim.engine.run_plan import build_run_plan

    model, eng = get_model(cfg.model), cfg.engine
    vllm_kv = eng.num_gpu_blocks * eng.block_size * int(model.kv_bytes_per_token("bf16"))
    simulated = build_run_plan(cfg, trace=trace).memory
    check_memory(RunMemoryEstimate((
        ("vLLM's CPU KV cache", f"{eng.num_gpu_blocks} blocks x {eng.block_size} tokens x "
         f"{model.kv_bytes_per_token('bf16') / 1024:g} KiB", "--num-gpu-blocks", vllm_kv),
        ("vLLM's weights", f"{model.name} in bf16", "--num-gpu-blocks", model.weight_bytes),
        *simulated.parts)))


def reference_run(cfg: SimConfig, trace, out: Path, vllm_python: str, model_dir: Path,
                  timeout_s: float | None = None) -> Agreement:
    """Record vLLM's schedule of `trace`, simulate it in kvsim, write both and the agreement to `out`."""
    out.mkdir(parents=True, exist_ok=True)
    raw = record_vllm(driver_spec(cfg, trace, model_dir), vllm_python, out, timeout_s)
    ref, meta = read_vllm_steps(raw)
    sim, info = kvsim_schedule(cfg, trace)
    agreement = compare_schedules(ref, sim, meta["rejected"], info["rejected"])
    save_schedule(ref, out / "vllm_steps.parquet")
    save_schedule(sim, out / "kvsim_steps.parquet")
    result = {**agreement.to_dict(), "vllm": {k: v for k, v in meta.items() if k != "rejected"},
              "rejected": {"vllm": meta["rejected"], "kvsim": info["rejected"]}}
    (out / "agreement.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    (out / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
    return agreement


def steps_from_times(trace, step_s: float):
    """A time-based trace with arrivals mapped to engine steps: step = floor(arrival_time_s / step_s)."""
    df = trace.df.copy()
    df["arrival_time_s"] = (df["arrival_time_s"] // step_s).astype(float)
    return type(trace)(df, name=trace.name, source=trace.source, prefix_block_tokens=trace.prefix_block_tokens)


def convert_model(vllm_python: str, gguf: Path, out_dir: Path) -> None:
    """The SmolLM2 GGUF as a bf16 Hugging Face checkpoint vLLM can load (runs in vLLM's virtualenv)."""
    proc = subprocess.run([vllm_python, str(CONVERTER), str(gguf), str(out_dir)], capture_output=True, text=True)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise ReferenceError(f"model conversion failed: {last[:300]}")


def default_model_dir() -> Path:
    root = Path(os.environ.get("KVSIM_CACHE_DIR", Path.home() / ".cache" / "kvsim"))
    return root / "smollm2-135m-hf"
