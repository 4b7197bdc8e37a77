"""The one-command GPU validation (bench/gpu_validation.sh) end to end on CPU at tiny sizes: the
same steps a lent GPU runs, so the script cannot rot before one is lent."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_validation_script_runs_end_to_end_on_cpu(tmp_path):
    out = tmp_path / "validation"
    env = dict(os.environ, PYTHON=sys.executable)
    env.pop("TRITON_INTERPRET", None)   # as a user runs it: the script sets up the interpreter itself
    proc = subprocess.run(["bash", str(ROOT / "bench" / "gpu_validation.sh"), str(out), "--tiny"],
                          capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    kernels = pd.read_csv(out / "kernels.csv")
    assert kernels.ok.all() and json.loads((out / "kernels_ok.json").read_text()) is True
    assert {"paged_decode_attention", "mixed_decode_attention", "reshape_and_cache", "copy_slots"} <= set(kernels.kernel)
    assert {"unsplit", "split-kv x4"} <= set(kernels.variant)
    bench = pd.read_csv(out / "decode_bandwidth.csv")
    assert (bench.time_us > 0).all() and (bench.mbytes > 0).all()
    for name in ("calibration", "heldout", "heldout-2"):        # the held-out trace twice: its timing noise
        steps = pd.read_parquet(out / f"replay-{name}" / "steps.parquet")
        assert len(steps) > 0 and (steps.duration_s > 0).all()
    policies = pd.read_csv(out / "policies.csv")          # each replayed with the cache checked every step
    assert policies.ok.all() and set(policies.policy) == {"h2o free_block", "h2o slot_reuse", "streaming",
                                                          "leankv", "quest"}
    assert (policies.finished == 2).all() and policies.set_index("policy").evicted_tokens["h2o free_block"] > 0
    from kvsim.sim.model.cost_model import load_profile
    assert load_profile(out / "profile.yaml").meta                  # the fitted profile loads
    for report in ("crosscheck", "crosscheck-2"):
        assert "MAPE" in (out / report / "report.md").read_text()
    summary = (out / "summary.md").read_text()
    for r in (1, 2):                                                # simulator and each replay: same batches
        line = next(ln for ln in summary.splitlines() if ln.startswith(f"held-out replay {r}: per-step MAPE"))
        assert "memory identical (recorded): True" in line
    medians = next(ln for ln in summary.splitlines() if ln.startswith("median pure-decode step (ms):"))
    assert [part.split()[0] for part in medians.split(":")[1].split(",")] == ["calibration", "heldout", "heldout-2"]
    assert "## Kernels vs torch twins" in summary and "## Decode attention" in summary
    assert "; torch " in summary and summary.splitlines()[-1].startswith("total ")   # finished, versions named


def test_a_stopped_validation_keeps_a_summary_of_the_sections_it_finished(tmp_path):
    from kvsim.gpu.validate import _write_summary
    _write_summary(tmp_path, ["## Kernels vs torch twins", "", "| kernel |"], time.time(), done=False)
    lines = (tmp_path / "summary.md").read_text().splitlines()
    assert lines[0] == "## Kernels vs torch twins" and lines[-1].startswith("incomplete: still running after")


def test_gpu_validation_script_refuses_a_python_without_the_backend(tmp_path):
    env = dict(os.environ, PYTHON=str(tmp_path / "no-python"))
    proc = subprocess.run(["bash", str(ROOT / "bench" / "gpu_validation.sh"), str(tmp_path / "o")],
                          capture_output=True, text=True, env=env)
    assert proc.returncode != 0


def test_gpu_validation_script_takes_options_without_out(tmp_path):
    """`bench/gpu_validation.sh --tiny` (OUT left out, as the usage line allows) took --tiny for OUT
    and ran `validate --out --tiny`, which argparse refused. The interpreter here only records the
    arguments it is given (the validation itself is run by the test above)."""
    record = tmp_path / "argv"
    python = tmp_path / "python"
    python.write_text(f'#!/usr/bin/env bash\n[ "$1" = -c ] && exit 0\necho "$@" > {record}\n')
    python.chmod(0o755)
    env = dict(os.environ, PYTHON=str(python))
    for args, expected in ((["--tiny", "--gpu", "h100"], "--out runs/gpu-validation --tiny --gpu h100"),
                           ([str(tmp_path / "o"), "--tiny"], f"--out {tmp_path / 'o'} --tiny"),
                           ([], "--out runs/gpu-validation")):
        proc = subprocess.run(["bash", str(ROOT / "bench" / "gpu_validation.sh"), *args], capture_output=True,
                              text=True, env=env, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr
        assert record.read_text().split() == ["-m", "kvsim.gpu.validate", *expected.split()]


def test_a_validation_step_past_its_time_limit_is_stopped_and_reported(tmp_path):
    """A slow policy replay must not starve the rest of the validation: it is stopped and named."""
    from kvsim.gpu.validate import _kvsim
    log = tmp_path / "slow.log"
    with pytest.raises(RuntimeError, match="stopped after 1 s"):
        _kvsim(["simulate", "--trace", "azure-conv-2023", "--model", "llama-3.1-8b", "--gpu", "h100", "-q",
                "--no-fast-forward", "--out", str(tmp_path / "run")], log, timeout_s=1)
    assert log.read_text().startswith("$ kvsim simulate")


def test_a_misspelt_gpu_is_refused_before_the_first_step(tmp_path, capsys):
    """--gpu nosuch ran the kernel checks (15 s on CPU, minutes of a lent GPU) and then ended in a
    CatalogError traceback at the first replay; it is one usage line before anything runs."""
    from kvsim.gpu.validate import main
    with pytest.raises(SystemExit) as stop:
        main(["--out", str(tmp_path / "v"), "--tiny", "--gpu", "nosuch"])
    assert stop.value.code == 2 and "--gpu: unknown gpu 'nosuch'" in capsys.readouterr().err
    assert not (tmp_path / "v").exists()
