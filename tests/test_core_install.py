"""The core install (`pip install -e .`, no extras) beside vLLM: `simulate`, `plan` and `report` run, and the
commands that need an extra name it. Each test runs kvsim in a subprocess whose imports of the extras'
packages fail, as they do where those packages are not installed (a sitecustomize that refuses them)."""
import os
import subprocess
import sys
import textwrap

import pytest

EXTRA_PACKAGES = "torch,triton,gguf,streamlit,distributed,dask,numba"

BLOCKER = textwrap.dedent("""
    import os, sys
    _blocked = set(filter(None, os.environ.get("KVSIM_TEST_BLOCK", "").split(",")))

    class _Absent:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in _blocked:
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, _Absent())
""")


@pytest.fixture
def core_install(tmp_path):
    """Run `kvsim ARGS...` as in a core install (the extras' packages cannot be imported)."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(BLOCKER)

    def run(*args, blocked=EXTRA_PACKAGES):
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]),
               "KVSIM_TEST_BLOCK": blocked, "COLUMNS": "200"}
        code = "import sys; from kvsim.sim.cli import app; sys.argv = ['kvsim', *sys.argv[1:]]; app()"
        return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env,
                              cwd=tmp_path, timeout=300)
    return run


def test_dashboard_names_its_extra(core_install):
    result = core_install("dashboard", "--port", "8599")
    assert result.returncode == 2
    assert "kvsim dashboard needs streamlit, which the core install leaves out: pip install 'kvsim[dashboard]'" \
        in result.stderr


def test_plan_and_report_run_without_dask(core_install, tmp_path):
    plan = core_install("plan", "--slo", "ttft_p99<=2s", "--models", "llama-3.1-8b", "--gpus", "h100", "--tps", "1",
                        "--trace", "random", "--set", "trace_options.max_requests=40",
                        "--set", "trace_options.request_rate=4", "--max-replicas", "2", "--no-band", "--repeats", "1",
                        "-j", "2", "-q", "--out", "store")
    assert plan.returncode == 0, plan.stderr
    assert "note: Dask is not installed (the 'distributed' extra): the plan runs on a local process pool" in plan.stderr
    assert "llama-3.1-8b: cheapest h100 TP1" in plan.stdout
    report = core_install("report", "store")
    assert report.returncode == 0, report.stderr
    assert (tmp_path / "store" / "report.html").stat().st_size > 0
    remote = core_install("plan", "--slo", "ttft_p99<=2s", "--models", "llama-3.1-8b", "--gpus", "h100",
                          "--trace", "random", "--scheduler", "tcp://127.0.0.1:9", "-q")
    assert remote.returncode == 2
    assert "needs Dask's distributed package, which the core install leaves out: pip install 'kvsim[distributed]'" \
        in remote.stderr


def test_simulate_runs_and_replay_names_its_extra(core_install, tmp_path):
    sim = core_install("simulate", "--trace", "random", "--num-prompts", "20", "--out", "run", "-q")
    assert sim.returncode == 0, sim.stderr
    assert (tmp_path / "run" / "summary.json").is_file()
    replay = core_install("replay", "--trace", "random", "--max-requests", "2", "--out", "replayed")
    assert replay.returncode == 2
    assert replay.stderr.strip().splitlines()[-1] == \
        "error: kvsim replay needs torch, which the core install leaves out: pip install 'kvsim[backend]'"


def test_calibrate_bench_runs_in_the_core_install(core_install, tmp_path):
    """kvsim calibrate --bench (a fit to vllm bench serve results) needs no extra, nor transformers."""
    from test_calibrate_bench import measured

    files = measured(tmp_path, 1.2, 0.03)
    result = core_install("calibrate", *(a for f in files for a in ("--bench", str(f))), "--gpu", "l4", "-o", "p.yaml",
                          blocked=EXTRA_PACKAGES + ",transformers")
    assert result.returncode == 0, result.stderr
    assert "held-out error (leave-one-out" in result.stdout and (tmp_path / "p.yaml").is_file()
