"""kvsim sweep: spec validation, the resumable store, failure isolation, local vs Dask executors."""
from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import yaml
from typer.testing import CliRunner

from kvsim.sim.model.catalog import get_gpu
from kvsim.sim.config import files_under, load_config
from kvsim.sim.simulator.simulate import run_simulation
from kvsim.sim.planning.sweep import SpecError, SweepRunOptions, load_spec, parse_spec, read_store, run_sweep

SMALL = {"trace_options.max_requests": 60, "engine.num_gpu_blocks": 1500}
SPEC = {"fixed": SMALL,
        "grid": {"engine.block_size": [16, 32], "engine.max_num_seqs": [8, 64], "trace_options.rate_scale": [1, 4]}}
NONDETERMINISTIC = ["wall_s"]   # host timing; everything else must match bit for bit


def write_spec(path: Path, spec: dict) -> Path:
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def comparable(df: pd.DataFrame) -> pd.DataFrame:
    return df.drop(columns=NONDETERMINISTIC).reset_index(drop=True)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> pd.DataFrame:
    """The spec run serially in this process: the store every other executor must reproduce."""
    store = tmp_path_factory.mktemp("reference")
    result = run_sweep(parse_spec(SPEC), store, SweepRunOptions(jobs=1), progress=False)
    assert (result.ran, result.failed) == (8, 0)
    return read_store(store)


# ---- spec parsing and validation ---------------------------------------------------------------

def test_grid_is_cartesian_product_in_spec_order_last_key_fastest():
    plan = parse_spec(SPEC)
    assert len(plan.runs) == 8
    assert plan.axis_keys == ["engine.block_size", "engine.max_num_seqs", "trace_options.rate_scale"]
    assert [tuple(r.axes.values()) for r in plan.runs[:3]] == [(16, 8, 1), (16, 8, 4), (16, 64, 1)]
    assert [r.config["engine"]["block_size"] for r in plan.runs] == [16] * 4 + [32] * 4
    assert all(r.config["trace_options"]["max_requests"] == 60 for r in plan.runs)
    assert len({r.run_id for r in plan.runs}) == 8


def test_a_kv_option_the_runs_policy_never_reads_is_refused_before_any_run():
    spec = {"fixed": SMALL, "runs": [{"kv.policy": "h2o", "kv.budget": 64, "kv.fast_rows": 4},
                                     {"kv.policy": "h2o", "kv.budget": 64, "kv.mode": "fast", "kv.fast_rows": 4}]}
    with pytest.raises(SpecError, match=r"run 0 \(kv.policy='h2o', kv.budget=64, kv.fast_rows=4\): kv.fast_rows=4: "
                                        "only kv.mode=fast samples rows"):
        parse_spec(spec)
    assert len(parse_spec({**spec, "runs": spec["runs"][1:]}).runs) == 1


def write_trace(path: Path, n: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(f'{{"arrival_time_s": {i}, "prompt_tokens": 50, "output_tokens": 5}}\n' for i in range(n)))
    return path


def test_a_specs_relative_file_paths_name_files_beside_it_from_any_directory(tmp_path, monkeypatch):
    """As `base:`, a trace (and any file a config key names) written relative in the spec is the file beside
    the spec, whatever the working directory; the run labels keep the paths as written."""
    exp = tmp_path / "exp"
    write_trace(exp / "traces" / "three.jsonl", 3)
    write_trace(exp / "four.jsonl", 4)
    (exp / "base.yaml").write_text("engine:\n  num_gpu_blocks: 1500\n")
    spec = write_spec(exp / "spec.yaml", {
        "base": "base.yaml", "fixed": {"kv": {"importance": "imp/model.yaml"}},
        "runs": [{"trace": "traces/three.jsonl"}, {"trace": "four.jsonl"}, {"trace": "azure-conv-2023"}],
        "grid": {"profile": ["default", "prof.yaml*1.5"], "model": ["llama-3.1-8b", "../cat.yaml#Mine"]}})
    elsewhere = tmp_path / "elsewhere"
    write_trace(elsewhere / "four.jsonl", 9)             # a file of the same name in the working directory
    monkeypatch.chdir(elsewhere)
    given = {"kv": {"importance": "imp/model.yaml"}, "profile": "prof.yaml*1.5", "model": "../cat.yaml#Mine",
             "gpu": "h100", "trace_options.tokenizer": "/abs/tok.json", "trace": "azure-conv-2023"}
    assert files_under(given, exp) == {"kv": {"importance": f"{exp}/imp/model.yaml"}, "profile": f"{exp}/prof.yaml*1.5",
                                       "model": f"{tmp_path}/cat.yaml#Mine", "gpu": "h100",
                                       "trace_options.tokenizer": "/abs/tok.json", "trace": "azure-conv-2023"}
    with pytest.raises(SpecError, match=f"grid.model.1. = '../cat.yaml#Mine': model: cannot read {tmp_path}/cat.yaml"):
        load_spec(spec)
    spec = write_spec(exp / "spec.yaml", {"base": "base.yaml", "fixed": {"trace_options.max_requests": 60},
                                          "runs": [{"trace": "traces/three.jsonl"}, {"trace": "four.jsonl"},
                                                   {"trace": "azure-conv-2023"}]})
    plan = load_spec(spec)
    assert [r.config["trace"] for r in plan.runs] == [str(exp / "traces" / "three.jsonl"), str(exp / "four.jsonl"),
                                                      "azure-conv-2023"]
    assert [r.axes["trace"] for r in plan.runs] == ["traces/three.jsonl", "four.jsonl", "azure-conv-2023"]
    from kvsim.sim.cli import app
    r = CliRunner().invoke(app, ["sweep", "../exp/spec.yaml", "--out", "store", "-q"])
    assert r.exit_code == 0, r.output
    rows = read_store(elsewhere / "store").set_index("trace")
    assert rows.loc[str(exp / "four.jsonl"), "num_finished"] == 4       # the spec's file, not the cwd's
    assert rows.loc[str(exp / "traces" / "three.jsonl"), "num_finished"] == 3


def test_explicit_runs_are_crossed_with_grid_and_nested_keys_equal_dotted(tmp_path):
    base = tmp_path / "base.yaml"
    base.write_text("engine:\n  num_gpu_blocks: 1500\ntrace_options:\n  max_requests: 60\n")
    spec = write_spec(tmp_path / "spec.yaml", {
        "base": "base.yaml",
        "runs": [{"model": "llama-3.1-8b", "tp": 1}, {"model": "llama-3.1-70b", "tp": 4}],
        "grid": {"trace_options": {"rate_scale": [1, 2]}}})
    plan = load_spec(spec)
    assert [(r.config["model"], r.config["tp"], r.config["trace_options"]["rate_scale"]) for r in plan.runs] == [
        ("llama-3.1-8b", 1, 1), ("llama-3.1-8b", 1, 2), ("llama-3.1-70b", 4, 1), ("llama-3.1-70b", 4, 2)]
    dotted = parse_spec({"fixed": SMALL, "runs": [{"model": "llama-3.1-8b", "tp": 1}],
                         "grid": {"trace_options.rate_scale": [1, 2]}})
    assert [r.run_id for r in dotted.runs] == [r.run_id for r in plan.runs[:2]]


def test_points_resolving_to_the_same_config_run_once():
    plan = parse_spec({"fixed": SMALL, "grid": {"engine.block_size": [16, 16, 32], "seed": [0]}})
    assert len(plan.runs) == 2 and plan.duplicates == 1


@pytest.mark.parametrize("spec, expected", [
    ({"grid": {"engine.block_size": [16]}, "gird": {}}, "unknown key 'gird'"),
    ({"grid": {"engine.blocksize": [16, 32]}}, "grid.engine.blocksize[0] = 16: engine.blocksize: Extra inputs"),
    ({"grid": {"engine.block_size": [16, 24]}}, "grid.engine.block_size[1] = 24"),
    ({"grid": {"engine.block_size": []}}, "grid.engine.block_size: empty list"),
    ({"grid": {"engine.block_size": 16}}, "grid.engine.block_size: expected a list"),
    ({"runs": []}, "runs: empty list"),
    ({"fixed": {"tp": 0}}, "fixed: tp: Input should be greater than 0"),
    ({"runs": [{"model": "llama-9000"}]}, "model='llama-9000'"),
    ({"grid": {"trace": ["azure-conv-2023", "no-such-trace"]}}, "trace='no-such-trace'"),
    ({"grid": {"engine.block_size": [16]}, "save_outputs": "no"}, "save_outputs: expected true or false, got 'no'"),
    ({"grid": {"engine.block_size": [16]}, "name": ["a"]}, "name: expected a string"),
    ({"grid": {"gpu": ["h100", "t4"], "model": ["llama-3.1-8b"]}},
     "run 1 (gpu='t4', model='llama-3.1-8b'): model='llama-3.1-8b' gpu='t4' tp=1: Llama-3.1-8B does not fit"),
])
def test_bad_specs_are_rejected_naming_key_and_value(spec, expected):
    with pytest.raises(SpecError) as exc:
        parse_spec({**spec, "fixed": {**SMALL, **spec.get("fixed", {})}})
    assert expected in str(exc.value)


def test_model_that_fits_only_at_higher_tp_is_accepted_there():
    spec = {"fixed": SMALL, "runs": [{"model": "llama-3.1-70b", "gpu": "h100", "tp": 4}]}
    assert len(parse_spec(spec).runs) == 1
    with pytest.raises(SpecError, match="does not fit"):
        parse_spec({**spec, "runs": [{"model": "llama-3.1-70b", "gpu": "h100", "tp": 1}]})


def test_negative_max_runs_is_refused_not_sliced(tmp_path):
    """--max-runs -1 printed '-1 to run now' and ran all pending runs but the last (a list slice)."""
    from kvsim.sim.cli import app
    spec = write_spec(tmp_path / "spec.yaml", SPEC)
    res = CliRunner().invoke(app, ["sweep", str(spec), "--out", str(tmp_path / "store"), "--max-runs", "-1"])
    assert res.exit_code == 2 and "--max-runs: expected a number of runs >= 0, got -1" in res.output
    assert not (tmp_path / "store").exists()
    with pytest.raises(ValueError, match="max_runs"):
        run_sweep(parse_spec(SPEC), tmp_path / "py", SweepRunOptions(max_runs=-1), progress=False)
    assert not (tmp_path / "py" / "runs").exists()


def test_cli_rejects_bad_spec_before_running_anything(tmp_path):
    from kvsim.sim.cli import app
    spec = write_spec(tmp_path / "bad.yaml", {"fixed": SMALL, "grid": {"engine.max_num_seqs": [8, -1]}})
    out = tmp_path / "store"
    res = CliRunner().invoke(app, ["sweep", str(spec), "--out", str(out)])
    assert res.exit_code == 2
    assert "grid.engine.max_num_seqs[1] = -1" in res.output
    assert not out.exists()


# ---- the store ----------------------------------------------------------------------------------

def test_rows_hold_config_and_the_same_metrics_as_kvsim_simulate(reference):
    assert list(reference["run_index"]) == list(range(8))
    assert reference["run_id"].is_unique and set(reference["status"]) == {"ok"}
    row = reference.iloc[5]
    cfg = load_config(None, {**SMALL, "engine.block_size": int(row["engine.block_size"]),
                             "engine.max_num_seqs": int(row["engine.max_num_seqs"]),
                             "trace_options.rate_scale": float(row["trace_options.rate_scale"])})
    summary = run_simulation(cfg).summary
    for key in ("throughput_output_tok_s", "ttft_p99_s", "tpot_p99_s", "goodput_req_s", "kv_util_mean",
                "fragmentation_p99", "preemptions", "num_finished"):
        assert row[key] == summary[key], key
    assert row["model_name"] == summary["model"] and row["gpu"] == "h100"
    price = get_gpu("h100").usd_per_hour
    assert row["num_gpus"] == 1 and row["usd_per_hour"] == price
    assert row["usd_per_m_output_tok"] == pytest.approx(price / 3600 / summary["throughput_output_tok_s"] * 1e6)
    # more load on the same hardware: cheaper per token, never slower TTFT
    by_rate = reference.groupby("trace_options.rate_scale")
    assert by_rate["usd_per_m_output_tok"].mean()[4] < by_rate["usd_per_m_output_tok"].mean()[1]


def test_stop_after_n_runs_then_resume_gives_the_same_store(tmp_path, reference):
    plan = parse_spec(SPEC)
    first = run_sweep(plan, tmp_path, SweepRunOptions(jobs=1, max_runs=3), progress=False)
    assert first.ran == 3 and len(read_store(tmp_path)) == 3
    second = run_sweep(plan, tmp_path, SweepRunOptions(jobs=1), progress=False)
    assert (second.skipped, second.ran) == (3, 5)
    pd.testing.assert_frame_equal(comparable(read_store(tmp_path)), comparable(reference))
    mtimes = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "runs").iterdir()}
    third = run_sweep(plan, tmp_path, SweepRunOptions(jobs=1), progress=False)
    assert third.ran == 0
    assert mtimes == {p.name: p.stat().st_mtime_ns for p in (tmp_path / "runs").iterdir()}


def test_killed_sweep_resumes_without_loss_or_duplicates(tmp_path, reference):
    spec = write_spec(tmp_path / "spec.yaml", SPEC)
    store = tmp_path / "store"
    script = ("import typer; from kvsim.sim.cli.planning import sweep; typer.run(sweep)")
    proc = subprocess.Popen([sys.executable, "-c", script, str(spec), "--out", str(store), "--jobs", "1", "-q"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    runs = store / "runs"
    deadline = time.monotonic() + 60
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            if runs.is_dir() and len(list(runs.glob("[!.]*.parquet"))) >= 2:
                break
            time.sleep(0.02)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    done = len(list(runs.glob("[!.]*.parquet")))
    assert 2 <= done < 8, "the kill should land mid-sweep"
    resumed = run_sweep(load_spec(spec), store, SweepRunOptions(jobs=1), progress=False)
    assert resumed.ran == 8 - done
    assert not list(runs.glob(".tmp-*"))
    pd.testing.assert_frame_equal(comparable(read_store(store)), comparable(reference))


def test_a_failing_run_is_recorded_and_the_sweep_goes_on(tmp_path):
    # `rate` applies only to length-only traces: on the Azure trace the loader refuses it at run time
    spec = {"fixed": {**SMALL, "trace_options.max_requests": 30},
            "grid": {"trace_options.rate": [None, 5.0], "engine.block_size": [16, 32]}}
    result = run_sweep(parse_spec(spec), tmp_path, SweepRunOptions(jobs=1), progress=False)
    assert (result.ran, result.failed) == (4, 2)
    df = read_store(tmp_path)
    assert list(df["status"]) == ["ok", "ok", "failed", "failed"]
    assert df.loc[2, "error"].startswith("TraceError") and "length-only" in df.loc[2, "error"]
    assert df.loc[2, "trace_options.rate"] == 5.0 and pd.isna(df.loc[2, "throughput_req_s"])
    assert df.loc[:1, "throughput_req_s"].gt(0).all()
    assert run_sweep(parse_spec(spec), tmp_path, SweepRunOptions(jobs=1), progress=False).ran == 0
    retried = run_sweep(parse_spec(spec), tmp_path, SweepRunOptions(jobs=1, retry_failed=True), progress=False)
    assert (retried.ran, retried.failed) == (2, 2)
    assert len(read_store(tmp_path)) == 4


def test_save_outputs_keeps_each_runs_simulate_files(tmp_path):
    plan = parse_spec({**SPEC, "grid": {"engine.block_size": [16]}, "save_outputs": True})
    run_sweep(plan, tmp_path, SweepRunOptions(jobs=1), progress=False)
    out = tmp_path / "outputs" / plan.runs[0].run_id
    assert {p.name for p in out.iterdir()} == {"requests.parquet", "steps.parquet", "summary.json", "config.yaml",
                                               ".kvsim-results"}
    assert len(pd.read_parquet(out / "requests.parquet")) == 60


# ---- executors ----------------------------------------------------------------------------------

def test_process_pool_store_equals_serial(tmp_path, reference):
    result = run_sweep(parse_spec(SPEC), tmp_path, SweepRunOptions(jobs=2), progress=False)
    assert result.ran == 8
    pd.testing.assert_frame_equal(comparable(read_store(tmp_path)), comparable(reference))


def test_dask_cluster_store_equals_local(tmp_path, reference):
    from distributed import Client, LocalCluster

    # in-process workers (inproc:// transport): fast to start, same task function as a real cluster
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=False, dashboard_address=None) as cluster, \
            Client(cluster) as client:
        result = run_sweep(parse_spec(SPEC), tmp_path, SweepRunOptions("dask", scheduler=client.scheduler.address),
                           progress=False)
    assert (result.ran, result.failed) == (8, 0)
    pd.testing.assert_frame_equal(comparable(read_store(tmp_path)), comparable(reference))


def test_dask_executor_needs_a_scheduler(tmp_path):
    from kvsim.sim.cli import app
    spec = write_spec(tmp_path / "spec.yaml", SPEC)
    res = CliRunner().invoke(app, ["sweep", str(spec), "--out", str(tmp_path / "s"), "--executor", "dask"])
    assert res.exit_code == 2 and "--scheduler" in res.output


# ---- robustness ---------------------------------------------------------------------------------

def test_an_unreadable_run_file_is_run_again_and_reports_still_work(tmp_path, reference):
    from kvsim.sim.cli import app
    from kvsim.sim.planning.report import build_report
    spec = write_spec(tmp_path / "spec.yaml", SPEC)
    store = tmp_path / "store"
    run_sweep(load_spec(spec), store, SweepRunOptions(jobs=1), progress=False)
    broken = sorted((store / "runs").glob("*.parquet"))[3]
    broken.write_bytes(broken.read_bytes()[:100])                 # a copy cut short
    df = read_store(store)
    assert len(df) == 7 and df.attrs["unreadable"] == [broken.name]
    assert "1 unreadable run files left out" in build_report(store).read_text()
    res = CliRunner().invoke(app, ["sweep", str(spec), "--out", str(store), "-q", "-j", "1"])
    assert res.exit_code == 0
    assert f"8 runs; in {store}: 7 finished, 1 unreadable (run again); 1 to run now" in " ".join(res.output.split())
    assert "ran 1 runs" in res.output and "run again: 1 unreadable" in res.output
    pd.testing.assert_frame_equal(comparable(read_store(store)), comparable(reference))


def test_retry_failed_says_what_it_runs(tmp_path):
    from kvsim.sim.cli import app
    spec = write_spec(tmp_path / "spec.yaml", {"fixed": {**SMALL, "trace_options.max_requests": 30},
                                               "grid": {"trace_options.rate": [None, 5.0],
                                                        "engine.block_size": [16, 32]}})
    store = tmp_path / "store"
    first = CliRunner().invoke(app, ["sweep", str(spec), "--out", str(store), "-q", "-j", "1"])
    assert first.exit_code == 1                                   # two runs failed, each named with its error
    failed = [" ".join(line.split()) for line in first.output.splitlines() if line.startswith("failed:")]
    assert len(failed) == 2 and failed[0].startswith("failed: run 2 (trace_options.rate=5.0, engine.block_size=16)")
    assert all("TraceError" in line and "length-only" in line for line in failed)
    again = CliRunner().invoke(app, ["sweep", str(spec), "--out", str(store), "-q", "-j", "1"])
    assert "2 finished, 2 failed (kept; --retry-failed runs them again); 0 to run now" in " ".join(again.output.split())
    retry = CliRunner().invoke(app, ["sweep", str(spec), "--out", str(store), "-q", "-j", "1", "--retry-failed"])
    text = " ".join(retry.output.split())
    assert "2 finished, 2 failed (run again); 2 to run now" in text
    assert "ran 2 runs" in text and "run again: 2 failed before" in text and "skipped 2" in text


def _descendants(pid: int) -> set[int]:
    """Processes whose parent chain leads to `pid` (from /proc)."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rpartition(")")[2].split()[1])
            except (OSError, ValueError, IndexError):
                pass
    found, frontier = set(), {pid}
    while frontier:
        frontier = {p for p, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads the process tree from /proc")
def test_sweep_workers_forkserver_and_tracker_end_with_a_killed_sweep(tmp_path):
    spec = write_spec(tmp_path / "spec.yaml", {"fixed": {"gpu": "l4"}, "grid": {"seed": [0, 1, 2, 3]}})
    proc = subprocess.Popen([sys.executable, "-m", "kvsim.sim.cli", "sweep", str(spec), "--out", str(tmp_path / "s"),
                             "-j", "2", "-q"], cwd=Path(__file__).resolve().parents[1],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    children: set[int] = set()
    while time.monotonic() < deadline and len(children) < 4:        # tracker, forkserver, 2 workers
        time.sleep(0.2)
        children = _descendants(proc.pid)
    assert len(children) >= 4, "the sweep should have started its workers"
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and any(Path(f"/proc/{p}").exists() for p in children):
        time.sleep(0.2)
    alive = [p for p in children if Path(f"/proc/{p}").exists()
             and Path(f"/proc/{p}/stat").read_text().rpartition(")")[2].split()[0] != "Z"]
    for p in alive:                                               # do not leave them behind either way
        os.kill(p, signal.SIGKILL)
    assert not alive, "processes of the killed sweep are still running"


def test_cost_columns_count_only_runs_meeting_the_slo(reference, tmp_path):
    """An SLO failure is never the cheapest: its $/token is NaN, its $/hour (the price) stays."""
    from kvsim.sim.config import parse_duration
    cfg = load_config(None, SMALL)
    ttft, tpot = parse_duration(cfg.slo.ttft), parse_duration(cfg.slo.tpot)
    meets = (reference["ttft_p99_s"] <= ttft) & (reference["tpot_p99_s"] <= tpot)
    assert list(reference["meets_slo"]) == list(meets) and meets.any()
    assert reference["usd_per_m_output_tok"].notna().tolist() == list(meets)
    assert reference["usd_per_k_good_req"].notna().tolist() == list(meets)
    assert reference["usd_per_hour"].notna().all()
    # a tight SLO fails every run: no run has a cost per token, so none ranks cheapest
    run_sweep(parse_spec({"fixed": {**SMALL, "slo.ttft": "1ms"}, "grid": {"trace_options.rate_scale": [4]}}),
              tmp_path, SweepRunOptions(jobs=1), progress=False)
    row = read_store(tmp_path).iloc[0]
    assert not row["meets_slo"] and math.isnan(row["usd_per_m_output_tok"]) and row["usd_per_hour"] > 0


def test_a_trace_file_rewritten_in_place_is_run_again_not_reused(tmp_path):
    """The run id hashed the config only, so a trace file regenerated under the same name (or another
    file of that relative name in another directory) reused the old file's rows: a store answered for
    a workload that no longer exists. The id now covers the named files' content."""
    from kvsim.traces.synthetic import synthesize
    trace = tmp_path / "t.jsonl"
    synthesize(20, rate=4.0, prompt="fixed:100", output="fixed:8", seed=1).save(trace)
    spec = {"fixed": {"trace": str(trace), "engine.num_gpu_blocks": 1500}, "grid": {"engine.block_size": [16, 32]}}
    first = parse_spec(spec)
    assert run_sweep(first, tmp_path / "store", SweepRunOptions(jobs=1), progress=False).ran == 2
    assert [r.run_id for r in parse_spec(spec).runs] == [r.run_id for r in first.runs]    # same content: same ids
    synthesize(30, rate=4.0, prompt="fixed:200", output="fixed:8", seed=2).save(trace)
    again = parse_spec(spec)
    assert not {r.run_id for r in again.runs} & {r.run_id for r in first.runs}
    assert run_sweep(again, tmp_path / "store", SweepRunOptions(jobs=1), progress=False).ran == 2
    rows = read_store(tmp_path / "store").set_index("run_id")
    assert list(rows.loc[[r.run_id for r in again.runs], "num_requests"]) == [30, 30]


def test_a_profile_file_and_its_scaled_band_variant_are_hashed_by_content(tmp_path):
    """capacity's profile band runs 'FILE*K': its id must follow the file's content as FILE's does."""
    from kvsim.sim.planning.sweep import input_file_digests, run_id_of
    profile = tmp_path / "p.yaml"
    profile.write_text((Path(__file__).resolve().parents[1] / "sim" / "data" / "profiles" / "cpu-2core.yaml").read_text())
    cfg = load_config(None, {"model": "smollm2", "gpu": "cpu-2core", "profile": f"{profile}*0.95"})
    before = (input_file_digests(cfg), run_id_of(cfg))
    assert set(before[0]) == {"profile"}
    profile.write_text(profile.read_text() + "\n# edited\n")
    after = (input_file_digests(cfg), run_id_of(cfg))
    assert after[0]["profile"] != before[0]["profile"] and after[1] != before[1]
