"""The red-team corpus (issue 31): hostile inputs a user (or a script) can hand kvsim, each run as a
real `kvsim` process under an address-space cap and a timeout. Each must end as documented: one
`error:` line naming the option or file and exit status 2 (or the documented status), within 500 MB
of resident memory and a few seconds of CPU, without touching files it does not own."""
from __future__ import annotations

import errno
import json
import os
import resource
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

REPO = Path(__file__).resolve().parents[1]
RSS_LIMIT_MB = 500
CPU_LIMIT_S = 10


class Ran:
    def __init__(self, code: int, out: str, err: str, rss_mb: float, cpu_s: float):
        self.code, self.out, self.err, self.rss_mb, self.cpu_s = code, out, err, rss_mb, cpu_s

    @property
    def lines(self) -> list[str]:
        return [line for line in self.err.splitlines() if line.strip()]


# Runs the kvsim CLI and, at exit, writes the process's own peak RSS (VmHWM of its own address space).
# wait4's ru_maxrss would not do: a forked child starts with the forking pytest worker's high-water mark
# (hundreds of MB once other tests have run in that worker), which survives exec.
PEAK_RSS_WRAPPER = """
import atexit, runpy, sys
peak_file = sys.argv.pop(1)
def write_peak():
    with open('/proc/self/status') as status:
        kb = next(line.split()[1] for line in status if line.startswith('VmHWM:'))
    with open(peak_file, 'w') as out:
        out.write(kb)
atexit.register(write_peak)
sys.argv[0] = 'kvsim'
runpy.run_module('kvsim.sim.cli', run_name='__main__', alter_sys=True)
"""


def kvsim(args: list[str], cwd: Path, *, env: dict | None = None, timeout: float = 60, cap_gb: float = 3,
          stdin=subprocess.DEVNULL) -> Ran:
    """Run `kvsim ARGS` with an address-space cap; its own peak RSS (VmHWM, or wait4's figure when it
    died before writing it) and CPU time (os.wait4)."""
    cap = int(cap_gb * 2**30)

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))

    out, err, peak = cwd / ".stdout", cwd / ".stderr", cwd / ".peak_kb"
    peak.unlink(missing_ok=True)
    with open(out, "w") as fo, open(err, "w") as fe:
        proc = subprocess.Popen([sys.executable, "-c", PEAK_RSS_WRAPPER, str(peak), *args], cwd=cwd, stdout=fo, stderr=fe,
                                stdin=stdin, preexec_fn=limit, env={**os.environ, **(env or {})})
        deadline = time.monotonic() + timeout
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.monotonic() > deadline:
                proc.kill()
                os.wait4(proc.pid, 0)
                pytest.fail(f"kvsim {' '.join(args)}: still running after {timeout} s (a hang)")
            time.sleep(0.02)
    proc.returncode = os.waitstatus_to_exitcode(status)
    rss_kb = int(peak.read_text()) if peak.exists() and peak.read_text().strip() else usage.ru_maxrss
    ran = Ran(proc.returncode, out.read_text(), err.read_text(), rss_kb / 1024, usage.ru_utime + usage.ru_stime)
    for f in (out, err, peak):
        f.unlink(missing_ok=True)
    return ran


def refused(ran: Ran, *fragments: str) -> None:
    """One `error:` line holding every fragment, exit 2, bounded memory and time."""
    assert ran.code == 2, ran.err
    assert len(ran.lines) == 1 and ran.lines[0].startswith("error:"), ran.err
    for fragment in fragments:
        assert fragment in ran.lines[0], ran.lines[0]
    bounded(ran)


def bounded(ran: Ran) -> None:
    assert ran.rss_mb < RSS_LIMIT_MB, f"{ran.rss_mb:.0f} MB"
    assert ran.cpu_s < CPU_LIMIT_S, f"{ran.cpu_s:.1f} s CPU"
    assert "Traceback" not in ran.err


def alias_bomb(levels: int = 8) -> str:
    lines = ['a0: &a0 ["x","x","x","x","x","x","x","x","x"]']
    for i in range(1, levels):
        lines.append(f"a{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * 9) + "]")
    return "\n".join(lines) + "\n"


SIM = ["simulate", "-q", "--max-requests", "5"]


@pytest.fixture
def d(tmp_path) -> Path:
    (tmp_path / "bomb.yaml").write_text(alias_bomb())
    (tmp_path / "zero.yaml").symlink_to("/dev/zero")
    os.mkfifo(tmp_path / "fifo.yaml")
    os.mkfifo(tmp_path / "fifo.jsonl")
    (tmp_path / "deep.yaml").write_text("a: " + "[" * 20_000 + "]" * 20_000 + "\n")
    (tmp_path / "dup.yaml").write_text("seed: 1\nseed: 2\n")
    (tmp_path / "circular.yaml").write_text("engine: &e {max_num_seqs: *e}\n")
    (tmp_path / "digits.yaml").write_text("seed: " + "9" * 5000 + "\n")
    return tmp_path


# (arguments with {d} for the test's directory, fragments the one error line must hold)
CASES = {
    "alias bomb via -c": (SIM + ["-c", "{d}/bomb.yaml", "-o", "{d}/r"], ["bomb.yaml", "expands to more than"]),
    "alias bomb via --set": (SIM + ["--set", "kv.params={" + alias_bomb(7).strip().replace("\n", ", ") + "}",
                                    "-o", "{d}/r"],
                             ["--set kv.params", "expands to more than"]),
    "-c is /dev/zero": (SIM + ["-c", "{d}/zero.yaml", "-o", "{d}/r"], ["zero.yaml", "character device"]),
    "-c is a FIFO": (SIM + ["-c", "{d}/fifo.yaml", "-o", "{d}/r"], ["fifo.yaml", "named pipe"]),
    "--trace is a FIFO": (SIM + ["--trace", "{d}/fifo.jsonl", "-o", "{d}/r"], ["fifo.jsonl", "named pipe"]),
    "--profile is /dev/zero": (SIM + ["--profile", "{d}/zero.yaml", "-o", "{d}/r"], ["zero.yaml", "character device"]),
    "--model is /dev/zero": (SIM + ["--model", "{d}/zero.yaml", "-o", "{d}/r"], ["zero.yaml", "character device"]),
    "importance model is /dev/zero": (SIM + ["--policy", "h2o", "--budget", "64", "--set",
                                             "kv.importance={d}/zero.yaml", "-o", "{d}/r"], ["kv.importance"]),
    "sweep spec is /dev/zero": (["sweep", "{d}/zero.yaml", "-o", "{d}/st", "--dry-run"], ["zero.yaml",
                                                                                       "character device"]),
    "YAML 20k deep": (SIM + ["-c", "{d}/deep.yaml", "-o", "{d}/r"], ["deep.yaml", "nested more than 100"]),
    "circular YAML alias": (SIM + ["-c", "{d}/circular.yaml", "-o", "{d}/r"], ["circular.yaml",
                                                                              "engine.max_num_seqs"]),
    "5000-digit integer in a config file": (SIM + ["-c", "{d}/digits.yaml", "-o", "{d}/r"], ["digits.yaml",
                                                                                            "5000 digits"]),
    "duplicate YAML keys": (SIM + ["-c", "{d}/dup.yaml", "-o", "{d}/r"], ["dup.yaml", "duplicate key 'seed'"]),
    "trace synth 1e12 requests": (["trace", "synth", "{d}/t.jsonl", "-n", "1000000000000"], ["at most 100,000,000"]),
    "--seed -1": (SIM + ["--seed", "-1", "-o", "{d}/r"], ["seed", "greater than or equal to 0"]),
    "--weight-dtype fp3": (SIM + ["--weight-dtype", "fp3", "-o", "{d}/r"], ["weight_dtype", "unknown dtype 'fp3'"]),
    "--rate-scale inf": (SIM + ["--rate-scale", "inf", "-o", "{d}/r"], ["rate_scale", "finite"]),
    "--set 5000-digit integer": (SIM + ["--set", "seed=" + "9" * 5000, "-o", "{d}/r"], ["--set seed"]),
    "capacity --max-evals 0": (["capacity", "--slo", "ttft_p99<=2s", "--max-evals", "0", "-q"], ["--max-evals"]),
    "--out /": (SIM + ["-o", "/"], ["--out /", "system directory"]),
    "--out /etc": (SIM + ["-o", "/etc"], ["--out /etc", "system directory"]),
    "--out /dev": (SIM + ["-o", "/dev"], ["--out /dev", "system directory"]),
}


def test_an_slo_in_seconds_is_accepted_by_capacity(d):
    ran = kvsim(["capacity", "--slo", "ttft_p99<=1000s", "--max-requests", "20", "--max-evals", "2", "--repeats", "1",
                 "-q"], d)
    assert ran.code in (0, 1) and "1e+06" not in ran.err and "pydantic" not in ran.err, ran.err   # 1: no bound found
    assert "rate" in ran.out
    bounded(ran)


def test_an_unreachable_dask_scheduler_is_one_line_exit_1(d):
    (d / "spec.yaml").write_text("grid: {seed: [0]}\n")
    ran = kvsim(["sweep", "spec.yaml", "-o", "st", "--executor", "dask", "--scheduler", "tcp://127.0.0.1:1", "-q"], d)
    assert ran.code == 1 and len(ran.lines) == 1, ran.err
    assert ran.lines[0].startswith("error: --scheduler tcp://127.0.0.1:1: no dask scheduler answered")
    bounded(ran)


@pytest.mark.parametrize("case", list(CASES))
def test_hostile_input_is_one_line_exit_2_in_bounded_memory(case, d):
    args, fragments = CASES[case]
    refused(kvsim([a.replace("{d}", str(d)) for a in args], d), *fragments)
    assert not (d / "r").exists() and not (d / "t.jsonl").exists()


def test_json_nested_100k_deep_in_a_trace(d):
    (d / "deep.jsonl").write_text('{"arrival_time_s": 0, "prompt_tokens": 5, "output_tokens": 2}\n'
                                  + "[" * 100_000 + "]" * 100_000 + "\n")
    refused(kvsim(SIM[:2] + ["--trace", str(d / "deep.jsonl"), "-o", str(d / "r")], d), "deep.jsonl:2", "nested")


def test_arrival_time_1e300_is_refused_naming_line_and_field(d):
    (d / "far.jsonl").write_text('{"arrival_time_s": 0, "prompt_tokens": 5, "output_tokens": 2}\n'
                                 '{"arrival_time_s": 1e300, "prompt_tokens": 5, "output_tokens": 2}\n')
    refused(kvsim(SIM[:2] + ["--trace", str(d / "far.jsonl"), "-o", str(d / "r")], d),
            "far.jsonl:2", "arrival_time_s", "at most 1e+09")


def test_bad_parquet_metadata_names_the_file(d):
    table = pa.table({"arrival_time_s": [0.0], "prompt_tokens": [5], "output_tokens": [2]})
    pq.write_table(table.replace_schema_metadata({"kvsim_trace": "{not json"}), d / "meta.parquet")
    refused(kvsim(SIM[:2] + ["--trace", str(d / "meta.parquet"), "-o", str(d / "r")], d), "meta.parquet", "metadata")


def test_max_requests_reads_only_the_start_of_a_2_gb_trace(d):
    trace = d / "big.jsonl"
    with open(trace, "w") as f:
        for i in range(10):
            f.write(json.dumps({"arrival_time_s": i * 0.5, "prompt_tokens": 100, "output_tokens": 8}) + "\n")
        f.truncate(2 * 2**30)                      # sparse: 2 GiB the loader must not read
    ran = kvsim(SIM[:2] + ["--max-requests", "5", "--trace", str(trace), "-o", str(d / "r")], d)
    assert ran.code == 0, ran.err
    bounded(ran)
    assert json.loads((d / "r" / "summary.json").read_text())["num_finished"] == 5


def test_sweep_grid_is_counted_before_it_is_expanded(d):
    spec = d / "huge.yaml"
    spec.write_text("grid:\n  seed: [" + ", ".join(map(str, range(2000))) + "]\n"
                    "  engine.max_num_seqs: [" + ", ".join(map(str, range(1, 2001))) + "]\n"
                    "  replicas: [" + ", ".join(map(str, range(1, 1601))) + "]\n")   # 6.4e9 points
    refused(kvsim(["sweep", str(spec), "-o", str(d / "st"), "--dry-run"], d), "huge.yaml", "at most 100,000")


def test_out_in_a_folder_of_the_users_own_files_leaves_them_alone(d):
    mine = d / "project"
    mine.mkdir()
    files = {"config.yaml": "my config\n", "summary.json": '{"mine": 1}', "decisions.parquet": "not kvsim's"}
    for name, text in files.items():
        (mine / name).write_text(text)
    refused(kvsim(SIM + ["-o", "."], mine), "--out .", "holds files kvsim did not write", "--overwrite")
    assert {p.name: p.read_text() for p in mine.iterdir()} == files
    ran = kvsim(SIM + ["-o", "run"], mine)                 # a new directory is fine, and is kvsim's from now on
    assert ran.code == 0 and (mine / "run" / ".kvsim-results").exists()
    assert kvsim(SIM + ["-o", "run", "--seed", "2"], mine).code == 0


def test_replay_refuses_a_pool_that_does_not_fit_before_allocating(d):
    ran = kvsim(["replay", "--num-gpu-blocks", "1000000000", "--max-requests", "2", "-q", "-o", str(d / "r")], d,
                cap_gb=8, timeout=120)
    assert ran.code == 2 and len(ran.lines) == 1, ran.err
    # refused by the GPU-memory check (the pool beside the weights) before the host-memory one
    assert "KV cache per GPU" in ran.lines[0] and "num_gpu_blocks" in ran.lines[0]
    bounded(ran)                                              # torch and the model, not the pool


HUGE_GPU = "name: Huge-GPU\nmemory_gib: 100000000\nmemory_bw_gbps: 3350\ntflops: {bf16: 989}\npcie_gbps: 64\nusd_per_hour: 1\n"


@pytest.mark.parametrize("command", ["sweep", "capacity", "reference"])
def test_every_command_refuses_a_pool_beyond_host_memory_before_allocating(d, command):
    """10^9 blocks (129 GiB of the simulator's pool) on a GPU large enough to hold them: refused by the
    host-memory estimate, naming --num-gpu-blocks, before any run starts. `reference` runs on the CPU
    profile, whose memory is the host's: its run plan refuses vLLM's 687 TiB CPU KV cache first, before
    vLLM is called (`--vllm-python /bin/false` is never run) or the model converted."""
    (d / "huge.yaml").write_text(HUGE_GPU)
    if command == "sweep":
        # profile: default named, as it is the only one a GPU of one's own has (auto would say so in a warning)
        (d / "spec.yaml").write_text(f"fixed: {{gpu: {d}/huge.yaml, profile: default, engine.num_gpu_blocks: 1000000000}}\n"
                                     "grid: {seed: [0, 1]}\n")
        args, fragments = ["sweep", "spec.yaml", "-o", "st", "-q"], ["spec.yaml: run 0", "host memory"]
    elif command == "capacity":
        args = ["capacity", "--slo", "ttft_p99<=2s", "--gpu", str(d / "huge.yaml"), "--num-gpu-blocks", "1000000000",
                "--max-requests", "5", "-q", "-o", "st", "--set", "profile=default"]
        fragments = ["host memory"]
    else:
        args = ["reference", "vllm", "--num-gpu-blocks", "1000000000", "--max-requests", "2", "--vllm-python",
                "/bin/false", "-o", "st"]
        fragments = ["engine.num_gpu_blocks: 1000000000 blocks", "of KV cache per GPU", "cpu-2core"]
    refused(kvsim(args, d), *fragments, *(["lower --num-gpu-blocks"] if command != "reference" else []))
    assert not list((d / "st").glob("runs/*.parquet")) and not (d / "st" / "agreement.json").exists()


def test_reference_counts_vllms_cpu_kv_cache_beside_the_simulation_in_host_memory(monkeypatch):
    """A pool that fits the CPU profile alone, but not beside vLLM's own CPU KV cache of the same blocks
    in the host memory left: refused naming vLLM's cache and --num-gpu-blocks."""
    from kvsim.sim.model import memory
    from kvsim.sim.config import load_config
    from kvsim.sim.reference.harness import check_reference_memory
    from kvsim.sim.simulator.simulate import load_workload

    cfg = load_config(None, {"model": "smollm2-135m", "gpu": "cpu-2core", "profile": "cpu-2core",
                             "engine.block_size": 32, "engine.num_gpu_blocks": 4000, "engine.max_model_len": 2048,
                             "trace_options.max_requests": 2})
    trace = load_workload(cfg)
    vllm_kv = 4000 * 32 * 22.5 * 1024                                  # 2.7 GiB of bf16 KV (22.5 KiB per token)
    monkeypatch.setattr(memory, "available_memory_bytes", lambda: (int(vllm_kv * 4), "test"))
    check_reference_memory(cfg, trace)                                  # fits with room to spare
    monkeypatch.setattr(memory, "available_memory_bytes", lambda: (int(vllm_kv * 0.9), "test"))
    with pytest.raises(memory.HostMemoryError, match=r"vLLM's CPU KV cache.*lower --num-gpu-blocks"):
        check_reference_memory(cfg, trace)


PLUGIN_EXIT = "import sys\nsys.exit(0)\n"
PLUGIN_H2O = ("from kvsim.sim.kv.policy import EvictionPolicy, register_policy\n"
              "@register_policy('h2o')\nclass Mine(EvictionPolicy):\n    pass\n")


@pytest.mark.parametrize("source, fragments", [(PLUGIN_EXIT, ["evil_plugin", "called exit(0)"]),
                                               ("import os\nos._exit(0)\n", ["evil_plugin", "called os._exit(0)"]),
                                               ("raise KeyboardInterrupt\n", ["evil_plugin", "KeyboardInterrupt"]),
                                               (PLUGIN_H2O, ["evil_plugin", "register_policy('h2o')", "taken"])])
def test_a_misbehaving_plugin_is_an_error_naming_it(d, source, fragments):
    (d / "evil_plugin.py").write_text(source)
    ran = kvsim(SIM + ["-o", str(d / "r")], d, env={"KVSIM_PLUGINS": "evil_plugin", "PYTHONPATH": str(d)})
    refused(ran, *fragments)
    assert not (d / "r").exists()


def test_nan_is_never_written_into_summary_json(d):
    (d / "one.jsonl").write_text("".join(json.dumps({"arrival_time_s": i, "prompt_tokens": 10, "output_tokens": 1})
                                         + "\n" for i in range(3)))
    ran = kvsim(SIM[:2] + ["--trace", str(d / "one.jsonl"), "-o", str(d / "r")], d)
    assert ran.code == 0, ran.err

    def no_constants(name):
        raise AssertionError(f"summary.json holds {name}")
    summary = json.loads((d / "r" / "summary.json").read_text(), parse_constant=no_constants)
    assert summary["tpot_p50_s"] is None and "tpot_p50_s" in summary["null_reasons"]


def _sweep_spec(d: Path, runs: int, requests: int = 200) -> Path:
    spec = d / "spec.yaml"
    spec.write_text(f"fixed: {{trace_options.max_requests: {requests}}}\ngrid:\n  seed: ["
                    + ", ".join(map(str, range(runs))) + "]\n")
    return spec


@pytest.mark.parametrize("command, sig, reason", [("sweep", signal.SIGTERM, "terminated (SIGTERM)"),
                                                  ("sweep", signal.SIGINT, "interrupted (Ctrl-C)"),
                                                  ("capacity", signal.SIGTERM, "terminated (SIGTERM)"),
                                                  ("capacity", signal.SIGINT, "interrupted (Ctrl-C)")])
def test_a_signal_to_a_store_command_exits_130_keeping_the_finished_runs(d, command, sig, reason):
    store = d / "st"
    # each run long enough that the command is still going when the signal comes, one run written
    # (on 200-300 requests a whole sweep or capacity search could finish between the first run's file and
    # the signal once runs got fast, on a loaded machine)
    args = (["sweep", str(_sweep_spec(d, 40, requests=2000)), "--jobs", "1"] if command == "sweep" else
            ["capacity", "--slo", "ttft_p99<=2s", "--max-requests", "3000", "--repeats", "1"])
    proc = subprocess.Popen([sys.executable, "-m", "kvsim.sim.cli", *args, "-o", str(store), "-q"], cwd=d,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not list(store.glob("runs/*.parquet")):
        time.sleep(0.05)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert err.strip() == f"{reason}; the store {store} keeps the finished runs (run again to resume)"
    assert list((store / "runs").glob("*.parquet"))


@pytest.mark.parametrize("command", ["sweep", "capacity"])
def test_a_second_store_command_on_a_busy_store_is_refused(d, command):
    from kvsim.sim.io.result_dirs import store_lock

    store = d / "st"
    args = (["sweep", str(_sweep_spec(d, 2))] if command == "sweep" else
            ["capacity", "--slo", "ttft_p99<=2s", "--max-requests", "20"])
    with store_lock(store):
        refused(kvsim([*args, "-o", str(store), "-q"], d), "another kvsim process is writing")
    assert not list(store.glob("runs/*.parquet"))


# ---- in-process checks (no memory risk) ---------------------------------------------------------
def _disk_full(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def test_a_full_disk_leaves_no_trace_file_that_loads(tmp_path, monkeypatch):
    from kvsim.traces import synthetic, trace as trace_module

    t = synthetic.synthesize(50, rate=1.0, seed=0)
    out = tmp_path / "t.jsonl"

    def half_then_full(trace, path):
        Path(path).write_text('{"arrival_time_s": 0, "prompt_tokens": 5, "output_tokens": 2}\n')
        _disk_full()
    monkeypatch.setattr(trace_module, "_write_jsonl", half_then_full)
    with pytest.raises(OSError, match="disk full"):
        t.save(out)
    assert list(tmp_path.iterdir()) == []


def test_a_full_disk_leaves_no_empty_report(tmp_path, monkeypatch):
    from kvsim.sim.planning import report
    from kvsim.sim.planning.sweep import SweepRunOptions, parse_spec, run_sweep

    plan = parse_spec({"fixed": {"trace_options.max_requests": 20}, "grid": {"seed": [0]}})
    run_sweep(plan, tmp_path, SweepRunOptions(jobs=1), progress=False)
    monkeypatch.setattr(Path, "write_text", _disk_full)
    with pytest.raises(OSError, match="disk full"):
        report.build_report(tmp_path)
    assert not (tmp_path / "report.html").exists() and not list(tmp_path.glob(".report.html*"))


def test_a_plugin_policy_changes_the_run_id(monkeypatch):
    from kvsim.sim.config import load_config
    from kvsim.sim.kv import policy
    from kvsim.sim.planning.sweep import run_id_of

    cfg = load_config(None, {"kv.policy": "h2o", "kv.budget": 64})
    builtin = run_id_of(cfg)
    monkeypatch.setattr(policy, "_REGISTRY", dict(policy._REGISTRY))
    with pytest.raises(policy.PolicyError, match="taken"):
        policy.register_policy("h2o")(type("Mine", (policy.EvictionPolicy,), {}))

    @policy.register_policy("h2o", override=True)
    class Replacement(policy.EvictionPolicy):
        pass
    assert policy.policy_identity("h2o").startswith(f"{__name__}.")
    assert run_id_of(cfg) != builtin


def test_json_safe_keeps_finite_values_and_explains_nulls():
    from kvsim.sim.io.safe_io import dumps_json, restore_nan

    text = dumps_json({"a": 1.5, "b": float("nan"), "c": {"d": float("inf")}})
    data = json.loads(text)
    assert data["a"] == 1.5 and data["b"] is None and data["c"]["d"] is None
    assert set(data["null_reasons"]) == {"b", "c.d"}
    assert restore_nan(data)["b"] != restore_nan(data)["b"]         # NaN again after reading


# ---- outputs: empty names, racing runs ------------------------------------------------------------
@pytest.mark.parametrize("args", [SIM + ["-o", ""], ["sweep", "spec.yaml", "-o", ""], ["report", "st", "-o", ""],
                                  ["capacity", "--slo", "ttft_p99<=2s", "-o", " "], ["trace", "synth", ""]])
def test_an_empty_output_name_is_refused_even_in_an_empty_folder(tmp_path, args):
    empty = tmp_path / "empty"
    empty.mkdir()
    refused(kvsim(args, empty), "''", "empty name")
    assert [p.name for p in empty.iterdir()] == []


def _start_simulate(args: list[str], cwd: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "kvsim.sim.cli", "simulate", "-q", *args], cwd=cwd,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.parametrize("out", ["run", "."])
def test_racing_simulate_runs_into_one_out_each_finish_whole(tmp_path, out):
    """N runs started together into one --out (a new directory, or the current one): each exits 0 (or
    with one error line, exit 2); the directory ends holding one run's files, all of that run; no
    staging directory is left behind."""
    (tmp_path / "run").mkdir()
    cwd = tmp_path / "run" if out == "." else tmp_path
    procs = [_start_simulate(["--max-requests", str(20 + i), "-o", out], cwd) for i in range(6)]
    done = [(p.wait(timeout=120), p.communicate()[1]) for p in procs]
    for code, err in done:
        assert code == 0 or (code == 2 and len(err.strip().splitlines()) == 1 and err.startswith("error:")), err
    assert sum(code == 0 for code, _ in done) >= 1
    run = tmp_path / "run"
    assert sorted(p.name for p in run.iterdir()) == [".kvsim-results", "config.yaml", "requests.parquet",
                                                     "steps.parquet", "summary.json"]
    assert [p.name for p in tmp_path.iterdir()] == ["run"]             # no staging directory left
    s = json.loads((run / "summary.json").read_text())
    winner = s["num_requests"]
    assert s["partial"] is False and done[winner - 20][0] == 0          # the run whose files these are succeeded
    assert f"max_requests: {winner}" in (run / "config.yaml").read_text()
    assert pq.read_metadata(run / "requests.parquet").num_rows == winner
    assert pq.read_metadata(run / "steps.parquet").num_rows == s["num_steps"]


@pytest.mark.parametrize("existing", [False, True])
def test_runs_publishing_into_one_out_at_once_take_turns(tmp_path, monkeypatch, existing):
    """The publishing step itself, six at once, with every rename slowed down so that their windows
    overlap for certain: the lock on --out's parent makes them take turns; the directory ends holding
    one run's files, whole."""
    import threading

    from kvsim.sim.io import result_dirs as results

    out, names = tmp_path / "run", ("summary.json", "config.yaml", "steps.parquet")
    if existing:
        first = results.ResultDir(out)
        (first.path / "summary.json").write_text("previous")
        first.publish()
    staged = []
    for i in range(6):
        rd = results.ResultDir(out)
        for name in names:
            (rd.path / name).write_text(f"run {i}")
        staged.append(rd)
    real_replace = os.replace

    def slow_replace(src, dst):
        time.sleep(0.02)
        real_replace(src, dst)
    monkeypatch.setattr(os, "replace", slow_replace)
    barrier, failures = threading.Barrier(len(staged)), []

    def publish(rd):
        barrier.wait()
        try:
            rd.publish()
        except Exception as exc:         # noqa: BLE001 - a failing publish is what this test looks for
            failures.append(exc)
    threads = [threading.Thread(target=publish, args=(rd,)) for rd in staged]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert failures == []
    assert len({(out / name).read_text() for name in names}) == 1          # one run's files, not a mix
    assert sorted(p.name for p in out.iterdir()) == sorted([*names, ".kvsim-results"])
    assert [p.name for p in tmp_path.iterdir()] == ["run"]


# ---- calibrate's output: checked before the fit, written to a temporary file and renamed ----------
@pytest.mark.parametrize("target, fragment", [("{d}", "is a directory"), ("{d}/fifo.yaml", "named pipe"),
                                              ("/dev/full", "character device"), ("/etc/kvsim.yaml", "system directory"),
                                              ("{d}/dup.yaml/x.yaml", "Not a directory")])
def test_calibrate_refuses_an_output_it_cannot_write_before_fitting(d, target, fragment):
    refused(kvsim(["calibrate", "no-such-log", "-o", target.format(d=d)], d), "--out", fragment)


def _step_log(d: Path) -> Path:
    from test_calibrate import synthetic_steps

    synthetic_steps(n=200, padded=False).to_parquet(d / "steps.parquet")
    return d / "steps.parquet"


def test_calibrate_on_a_full_disk_keeps_the_previous_profile(tmp_path, monkeypatch):
    """In process: the profile writer fails half-way with ENOSPC (monkeypatched write)."""
    from typer.testing import CliRunner

    from kvsim.sim.cli import app
    from kvsim.sim.model.cost_model import HardwareProfile

    log, out = _step_log(tmp_path), tmp_path / "fitted.yaml"
    out.write_text("the previous profile\n")

    def half_then_full(self, path):
        Path(path).write_text("name: half")
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(HardwareProfile, "to_yaml", half_then_full)
    res = CliRunner().invoke(app, ["calibrate", str(log), "-o", str(out), "--model", "smollm2", "--trim", "0"])
    assert res.exit_code == 1
    assert res.output.strip().splitlines()[-1] == (f"error: --out {out}: disk full (No space left on device); "
                                                   "nothing was written")
    assert out.read_text() == "the previous profile\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fitted.yaml", "steps.parquet"]


def _unshare_tmpfs_works() -> bool:
    try:
        return subprocess.run(["unshare", "-Urm", "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.mark.skipif(not _unshare_tmpfs_works(), reason="no unprivileged user namespaces (unshare -Urm) for a tmpfs")
def test_calibrate_on_a_real_full_disk_leaves_nothing_half_written(tmp_path):
    """A real ENOSPC: a 16 KiB tmpfs (mounted in a user namespace, no root needed) already holding the
    previous profile and a filler; kvsim calibrate in there says the disk is full (exit 1), and the
    folder afterwards holds exactly what it held before."""
    log, mnt = _step_log(tmp_path), tmp_path / "mnt"
    mnt.mkdir()
    script = (f"mount -t tmpfs -o size=16k tmpfs {mnt} && printf 'previous\\n' > {mnt}/fitted.yaml && "
              f"head -c 12288 /dev/zero > {mnt}/filler; "
              f"{sys.executable} -m kvsim.sim.cli calibrate {log} -o {mnt}/fitted.yaml --model smollm2 --trim 0 "
              f">/dev/null 2>{tmp_path}/err; echo \"rc=$?\"; ls -A {mnt}; cat {mnt}/fitted.yaml")
    ran = subprocess.run(["unshare", "-Urm", "sh", "-c", script], capture_output=True, text=True, timeout=120)
    err = (tmp_path / "err").read_text()
    assert ran.stdout.split() == ["rc=1", "filler", "fitted.yaml", "previous"], (ran.stdout, ran.stderr, err)
    assert err.strip() == f"error: --out {mnt}/fitted.yaml: disk full (No space left on device); nothing was written"


# ---- partial results: a Ctrl-C while the step log writes a row group -------------------------------
def test_ctrl_c_while_the_step_log_flushes_keeps_every_table_consistent(tmp_path, monkeypatch):
    """Ctrl-C (a real SIGINT to this process) arriving while StepLog.flush writes a row group: the
    partial result's step log has every step up to where the run stopped (none dropped), matching the
    summary, and reaches as far in simulated time as the requests do."""
    import pandas as pd

    from kvsim.sim.results import metrics
    from kvsim.sim.config import load_config
    from kvsim.sim.simulator.simulate import run_simulation

    monkeypatch.setattr(metrics.StepLog.__init__, "__defaults__", (256,))        # row groups of 256 steps
    write, calls = metrics.StepLog._write, []

    def interrupted_write(self, columns):
        calls.append(len(columns["step"]))
        if len(calls) == 3:
            os.kill(os.getpid(), signal.SIGINT)          # delivered at the next bytecode, inside the flush
        write(self, columns)
    monkeypatch.setattr(metrics.StepLog, "_write", interrupted_write)
    with pytest.raises(KeyboardInterrupt):
        run_simulation(load_config(None, {"trace_options.max_requests": 200}), tmp_path / "run")
    out = tmp_path / "run"
    s = json.loads((out / "summary.json").read_text())
    steps, reqs = pd.read_parquet(out / "steps.parquet"), pd.read_parquet(out / "requests.parquet")
    assert s["partial"] is True and s["partial_reason"] == "interrupted (Ctrl-C)"
    assert len(steps) == s["num_steps"] >= 3 * 256
    assert (steps["step"].to_numpy() == range(len(steps))).all()                 # no step dropped
    steps_end = (steps["time_s"] + steps["duration_s"]).max()
    latest_event = reqs[["first_token_s", "finish_s"]].max().max()                # the requests' last event
    assert latest_event <= steps_end + 1e-9, (latest_event, steps_end)


# ---- a real full disk: a small tmpfs in a user namespace ------------------------------------------
def in_full_tmpfs(tmp_path: Path, args: list[str], size_kb: int = 32) -> tuple[int, str, Path]:
    """Run `kvsim ARGS` (with {mnt} for the tmpfs) in a user and mount namespace where {mnt} is a fresh
    tmpfs of `size_kb`; (exit status, stderr, a copy of the tmpfs's content afterwards)."""
    mnt, after = tmp_path / "mnt", tmp_path / "after"
    mnt.mkdir()
    after.mkdir()
    command = " ".join(shlex.quote(a.replace("{mnt}", str(mnt))) for a in args)
    script = (f"mount -t tmpfs -o size={size_kb}k tmpfs {mnt} || exit 99; cd {tmp_path}; "
              f"{shlex.quote(sys.executable)} -m kvsim.sim.cli {command} >/dev/null 2>{tmp_path}/err; "
              f"echo $? > {tmp_path}/rc; cp -a {mnt}/. {after}/")
    subprocess.run(["unshare", "-Urm", "sh", "-c", script], timeout=120, check=True)
    return int((tmp_path / "rc").read_text()), (tmp_path / "err").read_text(), after


@pytest.mark.skipif(not _unshare_tmpfs_works(), reason="no unprivileged user namespaces (unshare -Urm) for a tmpfs")
@pytest.mark.parametrize("command", ["sweep", "capacity", "plan", "simulate", "trace synth"])
def test_a_real_full_disk_is_reported_as_such_leaving_nothing_half_written(tmp_path, command):
    (tmp_path / "spec.yaml").write_text("fixed: {trace_options.max_requests: 20}\ngrid: {seed: [0, 1, 2]}\n")
    args, code, says = {
        "sweep": (["sweep", "spec.yaml", "-o", "{mnt}/st", "-q", "--jobs", "1"], 1, "disk full"),
        "capacity": (["capacity", "--slo", "ttft_p99<=2s", "--max-requests", "20", "--max-evals", "4", "-q",
                      "-o", "{mnt}/st"], 1, "disk full"),
        "plan": (["plan", "--slo", "ttft_p99<=2s", "--models", "llama-3.1-8b", "--gpus", "h100", "--window", "0:60",
                  "--max-replicas", "2", "--jobs", "1", "-q", "-o", "{mnt}/st"], 1, "disk full"),
        "simulate": (["simulate", "--max-requests", "20", "-q", "-o", "{mnt}/run"], 1, "No space left on device"),
        "trace synth": (["trace", "synth", "{mnt}/t.jsonl", "-n", "5000"], 2, "disk full"),
    }[command]
    rc, err, after = in_full_tmpfs(tmp_path, args)
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == code and len(lines) == 1 and lines[0].startswith("error: --out" if command != "trace synth"
                                                                    else "error: "), err
    assert says in lines[0] and "Traceback" not in err
    left = [p for p in after.rglob("*") if p.is_file()]
    assert not [p for p in left if "tmp" in p.name], left                         # no temporary file left
    for p in left:                                                                # what is there is whole
        if p.suffix == ".parquet":
            pq.read_table(p)
        elif p.suffix == ".json":
            json.loads(p.read_text())
        elif p.suffix == ".jsonl":
            [json.loads(line) for line in p.read_text().splitlines()]
    assert not (after / "run").exists() and not (after / "t.jsonl").exists()


@pytest.mark.parametrize("after_s", [0.0, 4.0])
def test_sigterm_to_replay_exits_130_with_a_marked_partial_result_or_none(tmp_path, after_s):
    """SIGTERM while the model loads (0 s) or while steps run (4 s after its staging directory appears):
    exit 130 without a traceback, and either no result or one marked partial whose tables agree."""
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "kvsim.sim.cli", "replay", "--layers", "1", "--max-requests", "50",
                             "--num-gpu-blocks", "2000", "-q", "-o", str(out)], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not list(tmp_path.glob(".run.kvsim-tmp-*")):
        time.sleep(0.05)
    time.sleep(after_s)
    proc.send_signal(signal.SIGTERM)
    stdout, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "Traceback" not in err, err
    if out.exists():
        s = json.loads((out / "summary.json").read_text())
        steps = out / "steps.parquet"
        logged = pq.read_metadata(steps).num_rows if steps.exists() else 0
        assert s["partial"] is True and logged == s.get("num_steps", 0)
        assert s["partial_reason"] == "terminated (SIGTERM)"
        assert "interrupted: partial result" in " ".join(stdout.split())
    else:
        assert err.strip() == "terminated (SIGTERM): no results written"


# ---- issue 50: tracebacks, silently wrong input, data loss, memory, the dashboard's zip --------------
def _bench(d: Path, name: str, **changes) -> str:
    """A `vllm bench serve --save-result --save-detailed` JSON of three requests, with `changes`."""
    data = {"backend": "vllm", "request_rate": "inf", "burstiness": 1.0, "max_concurrency": None, "duration": 2.0,
            "input_lens": [10, 20, 30], "output_lens": [5, 5, 5], "ttfts": [0.1, 0.2, 0.3],
            "itls": [[0.01] * 4] * 3, "latencies": [1.0, 1.0, 1.0], "start_times": [0.0, 0.1, 0.2],
            "errors": ["", "", ""], **changes}
    (d / name).write_text(json.dumps(data))          # NaN is written as NaN, as Python's json (and vLLM's) does
    return str(d / name)


def _epoch_ms_csv(d: Path) -> Path:
    """100 requests 6.3 ms apart, stamped in epoch milliseconds (a gateway log): 0.63 s of arrivals."""
    path = d / "epoch.csv"
    path.write_text("ts,p,o\n" + "".join(f"{1_700_000_000_000 + 6.3 * i:.1f},100,10\n" for i in range(100)))
    return path


GENERIC = ["--trace-format", "csv", "--trace-columns", "arrival=ts,prompt_tokens=p,output_tokens=o"]
PROFILE = (REPO / "sim" / "data" / "profiles" / "default.yaml").read_text()
HF_MOE0 = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 1024,
           "intermediate_size": 2048, "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 8,
           "vocab_size": 32000, "max_position_embeddings": 4096, "num_local_experts": 0, "num_experts_per_tok": 5,
           "torch_dtype": "bfloat16"}


@pytest.fixture
def h(d) -> Path:
    """`d` with the hostile files of issue 50."""
    _bench(d, "itls.json", itls=[1, 2, 3])
    _bench(d, "conc.json", max_concurrency=-5)
    _bench(d, "negttft.json", ttfts=[-2.0, 0.2, 0.3])
    _bench(d, "nanttft.json", ttfts=[float("nan"), 0.2, 0.3])
    (d / "deep.jsonl").write_text('{"a": ' + "[" * 5000 + "]" * 5000 + ', "t": 0, "p": 5, "o": 2}\n')
    _epoch_ms_csv(d)
    for name, value in (("inf", ".inf"), ("huge", "1.0e300")):
        (d / f"p{name}.yaml").write_text(PROFILE.replace("step_overhead_s: 8.0e-4", f"step_overhead_s: {value}"))
    (d / "moe0").mkdir()
    (d / "moe0" / "config.json").write_text(json.dumps(HF_MOE0))
    (d / "wide").mkdir()
    (d / "wide" / "config.json").write_text(json.dumps({**HF_MOE0, "architectures": ["LlamaForCausalLM"],
                                                        "model_type": "llama", "num_local_experts": None,
                                                        "hidden_size": 10**30}))
    return d


JSONL = ["--trace-format", "jsonl", "--trace-columns", "arrival=t,prompt_tokens=p,output_tokens=o"]
CASES_50 = {
    "bench itls not lists": (SIM[:2] + ["--trace", "{d}/itls.json", "-o", "{d}/r"], ["itls.json", "'itls'[0]"]),
    "bench max_concurrency -5": (SIM[:2] + ["--trace", "{d}/conc.json", "-o", "{d}/r"],
                                 ["conc.json", "'max_concurrency'", ">= 1"]),
    "bench negative TTFT": (SIM[:2] + ["--trace", "{d}/negttft.json", "-o", "{d}/r"], ["'ttfts'[0]", ">= 0, got -2.0"]),
    "bench NaN TTFT": (SIM[:2] + ["--trace", "{d}/nanttft.json", "-o", "{d}/r"], ["'ttfts'[0]", "got nan"]),
    "generic JSONL 5000 deep (simulate)": (SIM[:2] + ["--trace", "{d}/deep.jsonl", *JSONL, "-o", "{d}/r"],
                                           ["deep.jsonl:1", "nested more than 100"]),
    "generic JSONL 5000 deep (trace stats)": (["trace", "stats", "{d}/deep.jsonl", *JSONL],
                                              ["deep.jsonl:1", "nested more than 100"]),
    "synth fixed:1e30": (["trace", "synth", "{d}/t.jsonl", "--prompt", "fixed:1e30"], ["fixed:1e30"]),
    "synth lognormal:100,1e300": (["trace", "synth", "{d}/t.jsonl", "--prompt", "lognormal:100,1e300"],
                                  ["lognormal:100,1e+300", "cv of at most 100"]),
    "synth --seed -1": (["trace", "synth", "{d}/t.jsonl", "--seed", "-1"], ["--seed", "greater than or equal to 0"]),
    "column mapped twice": (SIM[:2] + ["--trace", "{d}/epoch.csv", "--trace-format", "csv", "--trace-columns",
                                       "arrival=ts,prompt_tokens=p,output_tokens=o,arrival=p", "-o", "{d}/r"],
                            ["arrival is mapped twice (ts and p)"]),
    "profile step_overhead_s inf": (SIM + ["--profile", "{d}/pinf.yaml", "-o", "{d}/r"],
                                    ["pinf.yaml:", "step_overhead_s", "less than or equal to 10"]),
    "profile step_overhead_s 1e300": (SIM + ["--profile", "{d}/phuge.yaml", "-o", "{d}/r"],
                                      ["phuge.yaml:", "step_overhead_s"]),
    "profile default*1e-320": (SIM + ["--profile", "default*1e-320", "-o", "{d}/r"], ["default*1e-320", "0.001..1000"]),
    "profile default*2*3": (SIM + ["--profile", "default*2*3", "-o", "{d}/r"], ["default*2*3", "not several"]),
    "HF config: 0 experts, top-k 5": (SIM + ["--model", "{d}/moe0/config.json", "-o", "{d}/r"],
                                      ["num_local_experts' is 0", "num_experts_per_tok"]),
    "HF config: hidden_size 1e30 (models)": (["models", "{d}/wide/config.json"], ["hidden_size", "1..1,048,576"]),
    "synth 1e8 requests: memory estimate": (["trace", "synth", "{d}/t.jsonl", "-n", "100000000"],
                                            ["--requests 100,000,000", "GiB of memory", "available"]),
}


@pytest.mark.parametrize("case", list(CASES_50))
def test_issue_50_hostile_input_is_one_line_exit_2(case, h):
    args, fragments = CASES_50[case]
    refused(kvsim([a.replace("{d}", str(h)) for a in args], h), *fragments)
    assert not (h / "r").exists() and not (h / "t.jsonl").exists()


def test_replay_on_an_unknown_device_is_one_line(d):
    refused(kvsim(["replay", "--device", "tpu", "--max-requests", "2", "-q", "-o", str(d / "r")], d, cap_gb=8),
            "--device", "'tpu'")


def test_replay_random_weights_of_a_70b_are_refused_by_their_estimate_before_drawing(d):
    ran = kvsim(["replay", "--weights", "random", "--model", "llama-3.1-70b", "--max-requests", "2", "-q",
                 "-o", str(d / "r")], d, cap_gb=8, timeout=120)
    refused(ran, "random weights", "GiB", "lower --layers")
    assert not (d / "r").exists()


def test_epoch_milliseconds_in_a_generic_csv_are_read_as_milliseconds(d):
    ran = kvsim(["trace", "stats", str(_epoch_ms_csv(d)), *GENERIC, "--json"], d)
    assert ran.code == 0, ran.err
    assert abs(json.loads(ran.out)[0]["span_s"] - 0.6237) < 1e-3          # 99 gaps of 6.3 ms, not 624 s
    bounded(ran)
    ran = kvsim(["trace", "stats", str(d / "epoch.csv"), *GENERIC, "--time-unit", "ms", "--json"], d)
    assert abs(json.loads(ran.out)[0]["span_s"] - 0.6237) < 1e-3
    ran = kvsim(["trace", "stats", str(d / "epoch.csv"), *GENERIC], d)
    assert "read as ms" in " ".join(ran.out.split())                      # says so


def test_a_large_valid_save_detailed_bench_json_is_read(d):
    """300,000 requests (9 MB of JSON on one line, output_lens far past the first 64 KiB): read whole."""
    n = 300_000
    data = {"backend": "vllm", "request_rate": "inf", "burstiness": 1.0, "max_concurrency": None, "duration": 100.0,
            "input_lens": [10 + i % 500 for i in range(n)], "output_lens": [1 + i % 100 for i in range(n)],
            "ttfts": [0.001 * (i % 997) for i in range(n)], "latencies": [1.0 + 0.001 * (i % 991) for i in range(n)],
            "errors": [""] * n}
    (d / "bench.json").write_text(json.dumps(data))
    ran = kvsim(["trace", "stats", str(d / "bench.json"), "--json"], d)
    assert ran.code == 0, ran.err
    assert json.loads(ran.out)[0]["requests"] == n
    bounded(ran)


# -- memory: a file is refused by what reading it whole would need, before it is read
def _sparse(path: Path, head: str, size: int) -> Path:
    with open(path, "w") as f:
        f.write(head)
        f.truncate(size)                 # sparse: takes no disk, but a reader would parse every byte
    return path


@pytest.mark.parametrize("args", [
    ["simulate", "-q", "--trace", "{d}/big.csv", *GENERIC, "-o", "{d}/r"],
    ["trace", "stats", "{d}/big.csv", *GENERIC],
    ["trace", "stats", "{d}/big.jsonl"],
    ["simulate", "-q", "--trace", "{d}/big.csv", "-o", "{d}/r"],             # a native CSV
])
def test_a_trace_too_large_to_parse_is_refused_before_reading(d, args):
    _sparse(d / "big.csv", "ts,p,o\n1,2,3\n", 4 * 2**30)
    _sparse(d / "big.jsonl", '{"arrival_time_s": 0, "prompt_tokens": 5, "output_tokens": 2}\n', 2**30)
    if "--trace-format" not in args and "big.csv" in " ".join(args):
        _sparse(d / "big.csv", "arrival_time_s,prompt_tokens,output_tokens\n0,5,2\n", 4 * 2**30)
    refused(kvsim([a.replace("{d}", str(d)) for a in args], d), "GiB of memory to read whole", "available")


def test_a_tokenizer_too_large_is_refused_before_reading(d):
    _sparse(d / "tokenizer.json", "{", 8 * 2**30)
    (d / "chat.json").write_text(json.dumps([{"conversations": [{"from": "human", "value": "hello there"},
                                                                {"from": "gpt", "value": "hi"}]}]))
    refused(kvsim(["trace", "stats", str(d / "chat.json"), "--tokenizer", str(d / "tokenizer.json")], d),
            "tokenizer.json", "at most 256 MiB")


# -- data loss: no command replaces a file or folder of the user's without --overwrite
@pytest.fixture
def mine(d) -> Path:
    """A user's folder of their own files, a kvsim trace and a named pipe."""
    folder = d / "mine"
    folder.mkdir()
    for name in ("report.html", "requests.parquet", "steps.parquet", "notes.jsonl"):
        (folder / name).write_text(f"the user's {name}\n")
    os.mkfifo(folder / "fifo.jsonl")
    assert kvsim(["trace", "synth", str(d / "t.jsonl"), "-n", "20"], d).code == 0
    return folder


def _untouched(folder: Path) -> None:
    for name in ("report.html", "requests.parquet", "steps.parquet", "notes.jsonl"):
        assert (folder / name).read_text() == f"the user's {name}\n"
    assert sorted(p.name for p in folder.iterdir()) == ["fifo.jsonl", "notes.jsonl", "report.html",
                                                        "requests.parquet", "steps.parquet"]


@pytest.mark.parametrize("args, fragments", [
    (["report", "{d}", "-o", "{m}/report.html"], ["{m}/report.html", "kvsim did not write it", "--overwrite"]),
    (["report", "{m}"], ["{m}/report.html", "kvsim did not write it"]),
    (["trace", "convert", "{d}/t.jsonl", "{m}/requests.parquet"], ["{m}/requests.parquet", "kvsim did not write it"]),
    (["trace", "convert", "{d}/t.jsonl", "{m}/notes.jsonl"], ["{m}/notes.jsonl", "kvsim did not write it"]),
    (["trace", "synth", "{m}/steps.parquet"], ["{m}/steps.parquet", "kvsim did not write it"]),
    (["trace", "convert", "{d}/t.jsonl", "{m}/fifo.jsonl"], ["{m}/fifo.jsonl", "named pipe"]),
    (["trace", "synth", "{m}/fifo.jsonl"], ["{m}/fifo.jsonl", "named pipe"]),
    (["crosscheck", "--trace", "{d}/t.jsonl", "--profile", "cpu-2core", "--num-gpu-blocks", "100", "-o", "{m}"],
     ["--out {m}", "holds files kvsim did not write"]),
])
def test_no_command_replaces_a_users_file_without_overwrite(d, mine, args, fragments):
    fill = {"{d}": str(d), "{m}": str(mine)}

    def filled(text: str) -> str:
        for key, value in fill.items():
            text = text.replace(key, value)
        return text
    refused(kvsim([filled(a) for a in args], d, timeout=30), *map(filled, fragments))
    _untouched(mine)


def test_kvsims_own_outputs_are_replaced_and_overwrite_replaces_a_users_file(d, mine):
    for _ in range(2):                          # a trace kvsim wrote is kvsim's to replace
        assert kvsim(["trace", "synth", str(d / "t.jsonl"), "-n", "10"], d).code == 0
        assert kvsim(["trace", "synth", str(d / "t.parquet"), "-n", "10"], d).code == 0
    ran = kvsim(["trace", "convert", str(d / "t.jsonl"), str(mine / "notes.jsonl"), "--overwrite"], d)
    assert ran.code == 0, ran.err
    assert (mine / "notes.jsonl").read_text().startswith('{"kvsim_trace"')


def test_ctrl_c_keeps_the_previous_complete_result_until_the_new_one_is_complete(d):
    """A complete run in --out, then a second run into it interrupted (SIGINT, SIGTERM): --out keeps the
    first run's files byte for byte; the partial result goes beside it (OUT.partial), and the message
    says both; the next complete run removes OUT.partial."""
    out = d / "run"
    assert kvsim(SIM + ["-o", str(out)], d).code == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    for sig in (signal.SIGINT, signal.SIGTERM):
        proc = subprocess.Popen([sys.executable, "-m", "kvsim.sim.cli", "simulate", "-q", "--max-requests", "3000",
                                 "--seed", "2", "-o", str(out)], cwd=d, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not list(d.glob(".run.kvsim-tmp-*/steps.parquet")):
            time.sleep(0.02)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 130, err
        assert {p.name: p.read_bytes() for p in out.iterdir()} == before
        assert f"partial results in {out}.partial" in err and f"{out} keeps the previous complete result" in err
        assert json.loads((d / "run.partial" / "summary.json").read_text())["partial"] is True
    assert kvsim(SIM + ["-o", str(out), "--seed", "3"], d).code == 0
    assert sorted(p.name for p in d.iterdir() if not p.name.startswith(".")) == [
        "bomb.yaml", "circular.yaml", "deep.yaml", "digits.yaml", "dup.yaml", "fifo.jsonl", "fifo.yaml", "run",
        "zero.yaml"]


def test_leftovers_of_a_killed_run_are_removed_even_when_its_pid_is_reused(d):
    """kill -9 leaves `.NAME.kvsim-tmp-PID-*` staging directories and temporary files; their PID may belong
    to another live process by the next run (PIDs are reused; a container has its own). The next run
    writing NAME removes every one no live kvsim holds."""
    live_pid = os.getpid()                           # a live process that is not a kvsim writer
    staged = d / f".run.kvsim-tmp-{live_pid}-abc"
    staged.mkdir()
    (staged / "steps.parquet").write_text("half")
    tmp_file = d / f".t.jsonl.kvsim-tmp-{live_pid}-0"
    tmp_file.write_text("half a trace")
    old = time.time() - 3600
    for p in (staged, tmp_file):
        os.utime(p, (old, old))
    assert kvsim(SIM + ["-o", str(d / "run")], d).code == 0
    assert kvsim(["trace", "synth", str(d / "t.jsonl"), "-n", "10"], d).code == 0
    assert not staged.exists() and not tmp_file.exists()
    assert not list(d.glob(".*kvsim-tmp*"))


def test_a_live_writers_temporary_files_are_left_alone(tmp_path):
    """What a live writer holds (its flock) is never removed, whatever its age."""
    from kvsim.sim.io.safe_io import atomic_output, remove_dead_leftovers

    with atomic_output(tmp_path / "t.jsonl") as tmp:
        old = time.time() - 3600
        os.utime(tmp, (old, old))
        remove_dead_leftovers(tmp_path / "t.jsonl")
        assert tmp.exists()
        tmp.write_text("{}\n")
    assert (tmp_path / "t.jsonl").read_text() == "{}\n" and [p.name for p in tmp_path.iterdir()] == ["t.jsonl"]


# -- the dashboard (in process: its guard and its download)
def test_the_run_zip_ships_only_regular_files_inside_the_run(tmp_path):
    import io
    import zipfile

    from kvsim.dashboard.data import run_zip

    run, outside = tmp_path / "run", tmp_path / "outside"
    run.mkdir()
    outside.mkdir()
    (outside / "secret.txt").write_text("secret")
    (run / "summary.json").write_text("{}")
    (run / "sub").mkdir()
    (run / "sub" / "steps.parquet").write_text("steps")
    (run / "passwd").symlink_to("/etc/passwd")
    (run / "secret").symlink_to(outside / "secret.txt")
    (run / "outside").symlink_to(outside, target_is_directory=True)
    (run / "inside-link").symlink_to(run / "summary.json")
    os.mkfifo(run / "pipe")
    names = zipfile.ZipFile(io.BytesIO(run_zip(run))).namelist()
    assert sorted(names) == ["run/sub/steps.parquet", "run/summary.json"]


@pytest.mark.parametrize("key", ["trace", "model", "gpu", "profile", "kv.importance"])
@pytest.mark.parametrize("value", ["a" * 300, "a" * 300 + ".yaml", "dir/" + "a" * 300, "a" * 300 + "#Entry"])
def test_a_name_over_255_bytes_in_a_dashboard_path_field_is_refused_by_the_guard(key, value, tmp_path, monkeypatch):
    from kvsim.dashboard import data
    from kvsim.dashboard.guard import confine_overrides

    monkeypatch.setattr(data, "data_root", lambda: tmp_path)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(data.DataError, match=f"^{key}: a name in it is longer than 255 bytes"):
        confine_overrides({key: value})


# ---- issue 50, the features landed since: fleets, routers, KV offload, sessions, workload specs, ---------
# calibrate --bench, plan --disaggregated, --frontend. Each runs in-process (typer's CliRunner: the same
# command code and error handling as the console script, without a process start) and must end as the
# corpus above: one `error:` line holding every fragment, exit 2, nothing written.
def _pool_fleet(extra: str = "", prefill: str = "{gpu: h100}") -> str:
    return f"fleet:\n  prefill: {prefill}\n  decode: {{gpu: h100}}\n{extra}"


def _workload(arrival: str = "{process: poisson, rate: 1}", extra: str = "      requests: 5\n", top: str = "") -> str:
    return (f"workload:\n{top}  classes:\n    - name: a\n      arrival: {arrival}\n{extra}"
            "      prompt_tokens: fixed:10\n      output_tokens: fixed:5\n")


LANDED_FILES = {
    "fleet_list.yaml": "fleet: [1, 2]\n",
    "fleet_text.yaml": _pool_fleet(prefill="{gpu: h100, replicas: two}"),
    "fleet_negbw.yaml": _pool_fleet("  link_bandwidth_gb_s: -5\n"),
    "fleet_nanbw.yaml": _pool_fleet("  link_bandwidth_gb_s: .nan\n"),
    "fleet_inflat.yaml": _pool_fleet("  link_latency_s: .inf\n"),
    "fleet_zero.yaml": _pool_fleet(prefill="{gpu: h100, replicas: 0}"),
    "fleet_neglocal.yaml": _pool_fleet("  local_prefill_tokens: -3\n"),
    "fleet_link.yaml": _pool_fleet("  link: carrier-pigeon\n"),
    "turns_ooo.csv": "t,p,o,s,n\n0,100,10,a,1\n1,200,10,a,0\n2,50,5,b,0\n",
    "turns_dup.csv": "t,p,o,s,n\n0,100,10,a,0\n1,200,10,a,0\n",
    "turns_neg.csv": "t,p,o,s,n\n0,100,10,a,0\n1,200,10,a,-1\n",
    "turns_short.csv": "t,p,o,s,n\n0,100,10,a,0\n1,50,10,a,1\n",
    "w_broken.yaml": "workload: [\n",
    "w_empty.yaml": "",
    "w_nokey.yaml": "classes:\n  - name: a\n",
    "w_list.yaml": "- 1\n- 2\n",
    "w_second.yaml": "seed: 1\n" + _workload(),
    "w_negrate.yaml": _workload("{process: poisson, rate: -3}"),
    "w_textrate.yaml": _workload("{process: poisson, rate: fast}"),
    "w_noclasses.yaml": "workload:\n  classes: []\n",
    "w_requests.yaml": _workload(extra="      requests: 100000000000\n"),
    "w_duration.yaml": _workload("{process: poisson, rate: 1000}", extra="", top="  duration_s: 1.0e12\n"),
    "w_slo.yaml": _workload(extra="      requests: 5\n      slo: {ttft: -5ms}\n"),
    "b_empty.json": "",
    "b_trunc.json": '{"ttfts": [0.1',
    "b_obj.json": "{}",
    "b_partial.json": '{"ttfts": [0.1], "input_lens": [10], "output_lens": [5]}',
    "azure.csv": "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,100,10\n",
}
SESSION_COLUMNS = ["--trace-format", "csv", "--trace-columns",
                   "arrival=t,prompt_tokens=p,output_tokens=o,session_id=s,turn=n", "--sessions"]
SIM5 = ["simulate", "-q", "--max-requests", "5", "-o", "r"]
PD = ["--prefill-pool", "h100", "--decode-pool", "h100"]
CAL = ["calibrate", "--gpu", "h100", "--out", "cal.yaml"]
PLAN_PD = ["plan", "--trace", "azure-conv-2023", "--slo", "ttft_p99<=2s", "--models", "llama-3.1-8b", "--gpus", "h100",
           "--out", "pl", "--disaggregated"]
BENCH = "expected a vllm bench serve result JSON"
# (arguments, fragments the one error line must hold); "new" marks cases kvsim got wrong before issue 50's fix
CASES_LANDED = {
    # fleets / disaggregation
    "fleet: a list": (SIM5 + ["-c", "fleet_list.yaml"], ["fleet_list.yaml", "fleet:", "valid dictionary"]),
    "fleet replicas as text": (SIM5 + ["-c", "fleet_text.yaml"], ["fleet.prefill.replicas", "valid integer", "'two'"]),
    "fleet negative link bandwidth": (SIM5 + ["-c", "fleet_negbw.yaml"], ["fleet.link_bandwidth_gb_s",
                                                                         "greater than 0", "-5"]),
    "fleet NaN link bandwidth": (SIM5 + ["-c", "fleet_nanbw.yaml"], ["fleet.link_bandwidth_gb_s", "finite"]),
    "fleet infinite link latency": (SIM5 + ["-c", "fleet_inflat.yaml"], ["fleet.link_latency_s", "finite"]),
    "fleet 0 replicas": (SIM5 + ["-c", "fleet_zero.yaml"], ["fleet.prefill.replicas", "greater than 0"]),
    "fleet negative local_prefill_tokens": (SIM5 + ["-c", "fleet_neglocal.yaml"], ["fleet.local_prefill_tokens"]),
    "fleet unknown link (file)": (SIM5 + ["-c", "fleet_link.yaml"], ["fleet.link", "unknown link 'carrier-pigeon'",
                                                                     "ib-ndr"]),
    "--link unknown": (SIM5 + PD + ["--link", "nope"], ["fleet.link", "unknown link 'nope'"]),
    "--set negative link bandwidth": (SIM5 + PD + ["--set", "fleet.link_bandwidth_gb_s=-1"],
                                      ["fleet.link_bandwidth_gb_s", "greater than 0"]),
    "--set link bandwidth as text": (SIM5 + PD + ["--set", "fleet.link_bandwidth_gb_s=fast"],
                                     ["fleet.link_bandwidth_gb_s", "valid number", "'fast'"]),
    "--prefill-pool bad TP": (SIM5 + ["--prefill-pool", "h100:tpx", "--decode-pool", "h100"],
                              ["--prefill-pool 'h100:tpx'", "GPU[:tpN][:xN]"]),
    "--prefill-pool unknown GPU": (SIM5 + ["--prefill-pool", "tpu", "--decode-pool", "h100"],
                                   ["fleet.prefill.gpu", "unknown gpu 'tpu'"]),
    "--prefill-pool alone": (SIM5 + ["--prefill-pool", "h100"], ["fleet.decode", "Field required"]),
    "--prefill-pool twice, one unknown GPU (xPyD)": (SIM5 + ["--prefill-pool", "h100", "--prefill-pool", "tpu"] + PD[2:],
                                                    ["fleet.prefill.1.gpu", "unknown gpu 'tpu'"]),
    "--pool-choice unknown (xPyD)": (SIM5 + ["--prefill-pool", "h100", "--prefill-pool", "h200"] + PD[2:]
                                     + ["--pool-choice", "nope"], ["fleet.pool_choice", "unknown pool choice 'nope'",
                                                                   "least_work"]),
    "pair_links naming no pair (xPyD)": (SIM5 + PD + ["--set", "fleet.pair_links={prefill-0>decode: nvlink4}"],
                                         ["fleet", "pair_links", "PREFILL_POOL>DECODE_POOL", "prefill>decode"]),
    "--decode-pool twice, TP not dividing (xPyD)": (SIM5 + PD[:2] + ["--decode-pool", "h100", "--decode-pool", "h100:tp3"],
                                                    ["fleet.decode.1", "tp=3 must divide"]),
    "fleet with --kv-offload (new)": (SIM5 + PD + ["--kv-offload", "cpu:4GiB"], ["fleet: kv_offload",
                                                                             "no CPU KV tier yet"]),
    # routers
    "--router unknown": (SIM5 + ["--replicas", "2", "--router", "nope"], ["router", "unknown router 'nope'"]),
    "router weight as text": (SIM5 + ["--replicas", "2", "--router", "weighted", "--set",
                                      "router_options.weights.kv_usage=heavy"],
                              ["router_options.weights.kv_usage", "valid number", "'heavy'"]),
    "router unknown scorer": (SIM5 + ["--replicas", "2", "--router", "weighted", "--set", "router_options.weights.x=1"],
                              ["router_options.weights", "unknown scorer 'x'"]),
    "router negative refresh": (SIM5 + ["--replicas", "2", "--router", "kv_usage", "--set",
                                        "router_options.refresh_s=-1"], ["router_options.refresh_s",
                                                                         "greater than or equal to 0"]),
    "router unknown option": (SIM5 + ["--replicas", "2", "--set", "router_options.foo=1"],
                              ["router_options.foo", "Extra inputs"]),
    "router negative weight (new)": (SIM5 + ["--replicas", "2", "--router", "weighted", "--set",
                                             "router_options.weights.kv_usage=-1"],
                                     ["router_options.weights.kv_usage", "expected a weight >= 0"]),
    "router weights all 0 (new)": (SIM5 + ["--replicas", "2", "--router", "weighted", "--set",
                                           "router_options.weights={queue: 0, kv_usage: 0}"],
                                   ["router_options.weights", "no scorer has a weight > 0"]),
    "router weights {} (new)": (SIM5 + ["--replicas", "2", "--router", "weighted", "--set",
                                        "router_options.weights={}"], ["router_options.weights", "no scorer"]),
    # KV offload
    "--kv-offload negative": (SIM5 + ["--kv-offload", "cpu:-5GiB"], ["--kv-offload 'cpu:-5GiB'", "0 (no offload) or"]),
    "--kv-offload garbage": (SIM5 + ["--kv-offload", "cpu:lots"], ["--kv-offload 'cpu:lots'", "64GiB"]),
    "--kv-offload NaN": (SIM5 + ["--kv-offload", "cpu:nanGiB"], ["--kv-offload 'cpu:nanGiB'"]),
    "--kv-offload unknown tier": (SIM5 + ["--kv-offload", "gpu:5GiB"], ["--kv-offload 'gpu:5GiB'", "cpu:SIZE"]),
    "swap preemption with an offload tier (new)": (SIM5 + ["--kv-offload", "cpu:4GiB", "--set",
                                                          "engine.preemption_mode=swap"],
                                                  ["vLLM v1 has no swap", "expected recompute, got swap"]),
    "--kv-offload disk without cpu (new)": (SIM5 + ["--kv-offload", "disk:1TiB"], ["--kv-offload 'disk:1TiB'",
                                                                                   "give cpu:SIZE first"]),
    "offload chunk not whole blocks (new)": (SIM5 + ["--kv-offload", "cpu:4GiB", "--set", "kv_offload.chunk_tokens=100"],
                                             ["kv_offload.chunk_tokens: 100 is not a multiple of engine.block_size"]),
    "remote store over an unknown link (new)": (SIM5 + ["--kv-offload", "cpu:4GiB,remote:1TiB", "--set",
                                                        "kv_offload.remote_link=wifi"], ["kv_offload.remote_link",
                                                                                         "unknown link 'wifi'"]),
    "--kv-offload 1e30 GiB (new)": (SIM5 + ["--kv-offload", "cpu:1e30GiB"], ["--kv-offload 'cpu:1e30GiB'",
                                                                            "at most 1 PiB"]),
    "kv_offload.cpu_gib 1e30 (new)": (SIM5 + ["--set", "kv_offload.cpu_gib=1e30"], ["kv_offload.cpu_gib",
                                                                                   "less than or equal to 1048576"]),
    "offload tier with 0 bandwidth": (SIM5 + ["--kv-offload", "cpu:4GiB", "--set", "kv_offload.bandwidth_gb_s=0"],
                                      ["kv_offload.bandwidth_gb_s", "greater than 0"]),
    "offload bandwidth as text": (SIM5 + ["--kv-offload", "cpu:4GiB", "--set", "kv_offload.bandwidth_gb_s=fast"],
                                  ["kv_offload.bandwidth_gb_s", "valid number"]),
    # sessions
    "session turns out of order": (SIM5 + ["--trace", "turns_ooo.csv", *SESSION_COLUMNS],
                                   ["turns_ooo.csv:3", "session 'a' turn 0 arrives after its turn 1"]),
    "session turn repeated": (SIM5 + ["--trace", "turns_dup.csv", *SESSION_COLUMNS], ["turns_dup.csv:3", "turn 0"]),
    "session turn negative": (SIM5 + ["--trace", "turns_neg.csv", *SESSION_COLUMNS],
                              ["turns_neg.csv:3", "integer >= 0", "'-1'"]),
    "session turn shorter than its history": (SIM5 + ["--trace", "turns_short.csv", *SESSION_COLUMNS],
                                              ["trace_options.sessions", "shorter than the conversation"]),
    "--think-time negative": (SIM5 + ["--sessions", "--think-time", "-1"], ["--think-time -1", "0..1e9"]),
    "--think-time NaN": (SIM5 + ["--sessions", "--think-time", "nan"], ["--think-time nan"]),
    "--think-time inf": (SIM5 + ["--sessions", "--think-time", "inf"], ["--think-time inf", "0..1e9"]),
    "--think-time 1e300 (new)": (SIM5 + ["--sessions", "--think-time", "1e300"], ["--think-time 1e+300", "0..1e9"]),
    "think_time_s 1e300 (new)": (SIM5 + ["--sessions", "--set", "trace_options.sessions.think_time_s=1e300"],
                                 ["trace_options.sessions.think_time_s", "less than or equal to 1000000000"]),
    "sessions history unknown": (SIM5 + ["--sessions", "--set", "trace_options.sessions.history=bogus"],
                                 ["trace_options.sessions.history", "'in_prompt' or 'append'"]),
    # workload specs
    "--workload missing": (SIM5 + ["--workload", "nope.yaml"], ["nope.yaml", "no such file"]),
    "--workload broken YAML": (SIM5 + ["--workload", "w_broken.yaml"], ["w_broken.yaml", "invalid YAML",
                                                                            "line 2"]),
    "--workload empty (new)": (SIM5 + ["--workload", "w_empty.yaml"], ["w_empty.yaml", "expected a workload spec",
                                                                     "got an empty file"]),
    "--workload without workload: (new)": (SIM5 + ["--workload", "w_nokey.yaml"],
                                           ["w_nokey.yaml", "expected a workload spec", "'classes'"]),
    "--workload a YAML list (new)": (SIM5 + ["--workload", "w_list.yaml"], ["w_list.yaml", "a YAML list"]),
    "--workload key not first (new)": (SIM5 + ["--workload", "w_second.yaml"], ["w_second.yaml",
                                                                              "must be the file's first key"]),
    "workload negative rate": (SIM5 + ["--workload", "w_negrate.yaml"], ["w_negrate.yaml:4",
                                                                       "workload.classes.0.arrival.rate"]),
    "workload rate as text": (SIM5 + ["--workload", "w_textrate.yaml"], ["w_textrate.yaml:4", "valid number"]),
    "workload no classes": (SIM5 + ["--workload", "w_noclasses.yaml"], ["w_noclasses.yaml:2", "at least 1"]),
    "workload 1e11 requests": (SIM5 + ["--workload", "w_requests.yaml"], ["w_requests.yaml:5", "10000000"]),
    "workload 1e12 s duration (new: file named)": (SIM5 + ["--workload", "w_duration.yaml"],
                                                   ["w_duration.yaml:", "workload class a", "at most 10,000,000"]),
    "workload negative SLO": (SIM5 + ["--workload", "w_slo.yaml"], ["w_slo.yaml:6", "'-5ms'"]),
    "--workload and --trace": (SIM5 + ["--workload", "w_slo.yaml", "--trace", "azure-conv-2023"], ["give one"]),
    # calibrate --bench
    "--bench empty file (new)": (CAL + ["--bench", "b_empty.json"], ["--bench b_empty.json:1", "empty file", BENCH]),
    "--bench truncated JSON (new)": (CAL + ["--bench", "b_trunc.json"], ["--bench b_trunc.json:1", "invalid JSON",
                                                                        BENCH]),
    "--bench {} (new)": (CAL + ["--bench", "b_obj.json"], ["--bench b_obj.json:1", BENCH]),
    "--bench a folder (new)": (CAL + ["--bench", "."], ["--bench .", "is a directory", BENCH]),
    "--bench a named pipe (new)": (CAL + ["--bench", "fifo.jsonl"], ["--bench fifo.jsonl", "not a regular file"]),
    "--bench an Azure trace (new)": (CAL + ["--bench", "azure.csv", "--model", "llama-3.1-8b"],
                                     ["--bench azure.csv", "'azure' format", BENCH]),
    "--bench missing": (CAL + ["--bench", "nope.json"], ["--bench nope.json", "no such file"]),
    "--bench without model_id, --model given (new)": (CAL + ["--bench", "b_partial.json", "--model", "llama-3.1-8b"],
                                                      ["b_partial.json", "nothing to fit the step times to"]),
    # plan --disaggregated
    "plan --link unknown": (PLAN_PD + ["--link", "nope"], ["--link", "unknown link 'nope'"]),
    "plan --prefill-gpus unknown": (PLAN_PD + ["--prefill-gpus", "tpu"], ["--prefill-gpus", "unknown gpu 'tpu'"]),
    "plan --prefill-tps 0": (PLAN_PD + ["--prefill-tps", "0"], ["--prefill-tps", "positive integers", "'0'"]),
    "plan --decode-tps text": (PLAN_PD + ["--decode-tps", "x"], ["--decode-tps", "'x'"]),
    "plan --max-pool-replicas -1": (PLAN_PD + ["--max-pool-replicas", "-1"], ["--max-pool-replicas", "positive"]),
    "plan pool option without --disaggregated": (PLAN_PD[:-1] + ["--prefill-gpus", "h100"],
                                                 ["--prefill-gpus", "add --disaggregated"]),
    # the frontend
    "--frontend unknown": (SIM5 + ["--frontend", "nope"], ["frontend", "unknown frontend 'nope'", "vllm-api"]),
    # speculative decoding (issue 48)
    "--speculative-config k 0": (SIM5 + ["--speculative-config", '{"method": "eagle3", "num_speculative_tokens": 0}'],
                                 ["speculative_config.num_speculative_tokens", "greater than 0"]),
    "--speculative-config k -3": (SIM5 + ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": -3}'],
                                  ["speculative_config.num_speculative_tokens", "greater than 0"]),
    "--speculative-config unknown method": (SIM5 + ["--speculative-config", '{"method": "medusa", '
                                                    '"num_speculative_tokens": 2}'],
                                            ["speculative_config.method", "unknown method 'medusa'", "eagle3"]),
    "--speculative-config draft model larger than the GPU": (
        SIM5 + ["--speculative-config", '{"model": "llama-3.1-70b", "num_speculative_tokens": 3}'],
        ["speculative_config.model", "Llama-3.1-70B needs 131.4 GiB", "H100-SXM has"]),
    "--speculative-config unknown draft model": (
        SIM5 + ["--speculative-config", '{"method": "draft_model", "model": "nope-1b", "num_speculative_tokens": 3}'],
        ["nope-1b"]),
    "--speculative-config not JSON": (SIM5 + ["--speculative-config", "{method: eagle3"],
                                      ["--speculative-config: invalid JSON", "expected an object"]),
    "--speculative-config a list": (SIM5 + ["--speculative-config", "[3]"], ["--speculative-config", "JSON object"]),
    "--speculative-config unknown key": (SIM5 + ["--speculative-config", '{"method": "ngram", "k": 3}'],
                                         ["speculative_config.k", "Extra inputs"]),
    "--speculative-config mtp without MTP modules": (
        SIM5 + ["--speculative-config", '{"method": "mtp", "num_speculative_tokens": 1}'],
        ["speculative_config.method", "multi-token-prediction"]),
    "--speculative-config k 1e9": (SIM5 + ["--speculative-config", '{"method": "eagle", "num_speculative_tokens": 1e9}'],
                                   ["speculative_config.num_speculative_tokens"]),
    "plan --speculative-variant k 0": (PLAN_PD[:-1] + ["--speculative-variant", '{"method": "eagle3", '
                                                       '"num_speculative_tokens": 0}'],
                                       ["speculative_config.num_speculative_tokens", "greater than 0"]),
    "plan --speculative-variant not JSON": (PLAN_PD[:-1] + ["--speculative-variant", "eagle3"],
                                            ["--speculative-config: invalid JSON"]),
}


@pytest.fixture
def landed(d, monkeypatch) -> Path:
    for name, text in LANDED_FILES.items():
        (d / name).write_text(text)
    monkeypatch.chdir(d)
    return d


@pytest.mark.parametrize("case", list(CASES_LANDED))
def test_hostile_input_to_the_landed_features_is_one_line_exit_2(case, landed):
    from typer.testing import CliRunner

    from kvsim.sim.cli import app

    args, fragments = CASES_LANDED[case]
    result = CliRunner().invoke(app, args)
    lines = [line for line in result.stderr.splitlines() if line.strip() and not line.startswith("fitting ")]
    assert result.exit_code == 2, (result.exit_code, result.stderr, result.exception)
    assert len(lines) == 1 and lines[0].startswith("error:"), result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    assert "Traceback" not in result.stderr + result.stdout
    assert not any((landed / name).exists() for name in ("r", "cal.yaml", "pl"))


SERVE = ["serve", "--model", "llama-3.1-8b", "--port", "0"]


@pytest.mark.parametrize("args, fragments", [
    # new (issue 50): emptied the user's file when the server started
    (SERVE + ["--record-trace", "{d}/notes.jsonl"], ["--record-trace", "notes.jsonl", "kvsim did not write it",
                                                     "--overwrite"]),
    # new: "Application startup failed" after a traceback, exit 3
    (SERVE + ["--record-trace", "{d}"], ["--record-trace", "is a directory"]),
    # new: a server that blocked on the pipe's reader before listening
    (SERVE + ["--record-trace", "{d}/fifo.jsonl"], ["--record-trace", "named pipe"]),
    # new: OverflowError traceback from bind()
    (["serve", "--model", "llama-3.1-8b", "--port", "70000"], ["--port 70000", "0..65535"]),
    # new: a server at "infx real time"
    (SERVE + ["--time-scale", "inf"], ["--time-scale inf", "finite number > 0"]),
    # new: served as one pool, the fleet ignored
    (SERVE + ["-c", "{d}/fleet.yaml"], ["fleet: kvsim serve runs one pool", "not served yet"]),
    # new: served without the CPU tier
    (SERVE + ["--set", "kv_offload.cpu_gib=4"], ["kv_offload: kvsim serve's engine has no CPU KV tier"]),
])
def test_serve_refuses_a_bad_option_before_it_listens(d, args, fragments):
    (d / "notes.jsonl").write_text("my notes\n")
    (d / "fleet.yaml").write_text(_pool_fleet())
    refused(kvsim([a.replace("{d}", str(d)) for a in args], d, timeout=20), *fragments)
    assert (d / "notes.jsonl").read_text() == "my notes\n"
