"""Result directories: staged beside --out and moved in at the end; partial results marked; no mixing."""
import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
from typer.testing import CliRunner

from kvsim.sim.engine import loop as engine
from kvsim.sim.cli import app
from kvsim.sim.config import load_config
from kvsim.sim.simulator.simulate import run_simulation

SMALL = {"trace_options.max_requests": 30}
REPO = Path(__file__).resolve().parents[1]


def simulate(out, overwrite=False, **over):
    return run_simulation(load_config(None, {**SMALL, **over}), out, overwrite=overwrite)


def summary(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text())


def stop_after(monkeypatch, steps: int, exc: BaseException) -> None:
    """Make the engine raise `exc` once it has logged `steps` steps."""
    log_step = engine.EngineReplica._log_step

    def failing(self, *args):
        log_step(self, *args)
        if self.num_steps >= steps:
            raise exc
    monkeypatch.setattr(engine.EngineReplica, "_log_step", failing)


def test_reused_out_holds_only_the_new_runs_files(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    for stale in ("tokens.parquet", "decisions.parquet", "attention_stats.parquet", "steps.parquet"):
        (out / stale).write_text("a replay's file")
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="holds files kvsim did not write"):     # not kvsim's directory
        simulate(out)
    simulate(out, overwrite=True)
    assert {p.name for p in out.iterdir()} == {"requests.parquet", "steps.parquet", "summary.json", "config.yaml",
                                               "notes.txt", ".kvsim-results"}
    assert (out / "notes.txt").read_text() == "mine" and len(pd.read_parquet(out / "steps.parquet")) > 0
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".run.kvsim-tmp-")]


def test_a_failing_run_leaves_a_readable_partial_result_marked_with_its_reason(tmp_path, monkeypatch):
    out = tmp_path / "run"
    full = simulate(tmp_path / "full", seed=2).summary["num_steps"]
    simulate(out, seed=1)
    stop_after(monkeypatch, 5, RuntimeError("invariant broken"))
    with pytest.raises(RuntimeError, match="invariant broken"):
        simulate(out, seed=2)
    s = summary(out)
    assert s["partial"] is True and s["partial_reason"] == "failed: RuntimeError: invariant broken"
    assert 5 <= len(pd.read_parquet(out / "steps.parquet")) == s["num_steps"] < full
    assert len(pd.read_parquet(out / "requests.parquet")) == s["num_requests"] <= 30
    assert "seed: 2" in (out / "config.yaml").read_text()          # every file from the failed run
    assert s["num_finished"] < 30


def test_an_interrupted_cli_run_exits_130_with_its_partial_result(tmp_path, monkeypatch):
    out = tmp_path / "run"
    stop_after(monkeypatch, 3, KeyboardInterrupt())
    res = CliRunner().invoke(app, ["simulate", "--max-requests", "30", "-q", "-o", str(out)])
    assert res.exit_code == 130
    assert f"interrupted (Ctrl-C): partial results in {out}" in " ".join(res.output.split())
    s = summary(out)
    assert s["partial"] is True and s["partial_reason"] == "interrupted (Ctrl-C)"
    assert 3 <= s["num_steps"] == len(pd.read_parquet(out / "steps.parquet"))
    assert s["num_finished"] < 30


def test_complete_runs_say_they_are_not_partial(tmp_path):
    assert summary(simulate(tmp_path / "run").out_dir)["partial"] is False


def test_a_write_error_keeps_the_previous_results_whole(tmp_path, monkeypatch):
    out = tmp_path / "run"
    simulate(out, seed=1)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    import kvsim.sim.results.outputs as outputs_module

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(outputs_module.pq, "write_table", disk_full)
    res = CliRunner().invoke(app, ["simulate", "--max-requests", "30", "-q", "-o", str(out), "--seed", "2"])
    assert res.exit_code == 1
    assert res.output.strip() == f"error: --out {out}: cannot write the results: No space left on device"
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["run"]          # the staging directory is gone


def _start(out: Path, sig_ready: Path) -> subprocess.Popen:
    """`kvsim simulate` on the whole Azure trace (long enough to be stopped mid-run)."""
    cmd = [sys.executable, "-m", "kvsim.sim.cli", "simulate", "--gpu", "l4", "-q", "-o", str(out)]
    proc = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not list(out.parent.glob(f".{out.name}.kvsim-tmp-*/steps.parquet")):
        time.sleep(0.05)
    return proc


@pytest.mark.parametrize("sig, reason", [(signal.SIGINT, "interrupted (Ctrl-C)"),
                                         (signal.SIGTERM, "terminated (SIGTERM)")])
def test_a_signal_mid_run_gives_a_marked_partial_result(tmp_path, sig, reason):
    out = tmp_path / "run"
    proc = _start(out, tmp_path)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert err.strip() == f"{reason}: partial results in {out} (summary.json: partial: true)"
    s = summary(out)
    assert s["partial"] is True and s["partial_reason"] == reason
    assert 0 < len(pd.read_parquet(out / "steps.parquet")) == s["num_steps"]


def test_kill_9_leaves_the_previous_results_and_the_next_run_cleans_up(tmp_path):
    out = tmp_path / "run"
    simulate(out, seed=1)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    proc = _start(out, tmp_path)
    proc.kill()
    proc.communicate()
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert list(tmp_path.glob(".run.kvsim-tmp-*"))                  # the dead run's staging directory
    simulate(out, seed=3)
    assert [p.name for p in tmp_path.iterdir()] == ["run"] and summary(out)["partial"] is False


def test_an_out_that_is_a_link_keeps_the_link_and_gets_the_results(tmp_path):
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / "summary.json").write_text("{}")
    link = tmp_path / "run"
    link.symlink_to(target)
    simulate(link, overwrite=True)
    assert link.is_symlink() and summary(target)["partial"] is False
    assert {p.name for p in target.iterdir()} == {"requests.parquet", "steps.parquet", "summary.json", "config.yaml",
                                                  ".kvsim-results"}
