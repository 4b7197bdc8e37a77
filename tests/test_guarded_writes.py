"""Every command that writes a file or folder goes through one guarded writer (issue 50).

The guarded writer is sim/safe_io.py: `check_output_file` / `results.ResultDir` / `results.claim_out_dir`
decide before the work whether a path may be written (never a pipe, device, system directory or a
user's own file without --overwrite), and `atomic_output` / `ResultDir` write it: into a temporary
`.NAME.kvsim-tmp-PID-*` file or staging directory beside it, renamed into place when whole.

The test walks the command tree of the `kvsim` CLI and runs every command in process (in an empty
directory, on tiny inputs) with a Python audit hook recording each file opened for writing and each
rename. It fails when a command opens a file for writing other than inside a guarded temporary, when a
file appears in the directory other than by a rename from one (pyarrow's writes, invisible to the hook,
are caught by this), or when the CLI has a command the table below does not name (a new command must
be added to it)."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import typer.main
from typer.testing import CliRunner

from kvsim.sim.cli import app
from kvsim.sim.io.safe_io import KVSIM_TMP

BOOKKEEPING = (".kvsim-results", ".kvsim-lock")      # kvsim's own marker and store lock (touched, never data)
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC


class _Recorder:
    """What the audit hook saw while `root` was being recorded: (event, paths)."""

    def __init__(self):
        self.root: Path | None = None
        self.events: list[tuple[str, tuple[Path, ...]]] = []

    def __call__(self, event: str, args: tuple) -> None:
        if self.root is None:
            return
        if event == "open" and isinstance(args[0], (str, bytes, os.PathLike)) and _writes(args[1], args[2]):
            self.events.append(("write", (_abs(args[0]),)))
        elif event == "os.rename":
            self.events.append(("rename", (_abs(args[0]), _abs(args[1]))))


def _writes(mode, flags) -> bool:
    if isinstance(mode, str):
        return any(c in mode for c in "wax+")
    return isinstance(flags, int) and flags >= 0 and bool(flags & _WRITE_FLAGS)


def _abs(path) -> Path:
    path = os.fsdecode(path) if isinstance(path, bytes) else os.fspath(path)
    return Path(os.path.abspath(path))


RECORDER = _Recorder()
sys.addaudithook(RECORDER)            # audit hooks cannot be removed: it records only inside `recording`


def guarded(path: Path, root: Path) -> bool:
    """A path inside a guarded temporary (a component `.NAME.kvsim-tmp-...`) or kvsim's bookkeeping file."""
    parts = path.relative_to(root).parts
    return any(KVSIM_TMP in part for part in parts) or path.name in BOOKKEEPING


def commands() -> list[str]:
    """Every leaf command of the CLI, as 'trace synth'."""
    def walk(cmd, path=()):
        subs = getattr(cmd, "commands", None)
        if subs:
            for name, sub in subs.items():
                yield from walk(sub, (*path, name))
        else:
            yield " ".join(path)
    return sorted(walk(typer.main.get_command(app)))


SPEC = "fixed: {trace_options.max_requests: 5}\ngrid: {seed: [0, 1]}\n"
REPLAY = ["--trace", "t.jsonl", "--max-requests", "3", "--num-gpu-blocks", "64", "--block-size", "16"]
# command -> its arguments (run in order: later ones read what earlier ones wrote), or why it is not run
RUNS: dict[str, list[str] | str] = {
    "trace synth": ["trace", "synth", "t.jsonl", "-n", "20", "--prompt", "fixed:64", "--output", "fixed:4"],
    "trace convert": ["trace", "convert", "t.jsonl", "t.parquet"],
    "trace stats": ["trace", "stats", "t.jsonl"],
    "models": ["models"],
    "gpus": ["gpus"],
    "simulate": ["simulate", "-q", "--max-requests", "5", "-o", "run"],
    "sweep": ["sweep", "spec.yaml", "-o", "st", "-q", "--jobs", "1"],
    "report": ["report", "st"],
    "capacity": ["capacity", "--slo", "ttft_p99<=2s", "--max-requests", "20", "--max-evals", "2", "--repeats", "1",
                 "-q", "-o", "cap"],
    "plan": ["plan", "--slo", "ttft_p99<=2s", "--models", "llama-3.1-8b", "--gpus", "h100", "--window", "0:60",
             "--max-replicas", "2", "--jobs", "1", "-q", "-o", "pl"],
    "calibrate": ["calibrate", "steps.parquet", "-o", "fitted.yaml", "--model", "smollm2", "--trim", "0"],
    "replay": ["replay", *REPLAY, "--layers", "1", "--threads", "1", "-q", "-o", "rp"],
    # passes this walk on a whole-model replay (`--real` of one without --layers), which costs 30 s of CPU
    "crosscheck": "needs a replay of all 30 layers (30 s of CPU); its --out is claimed with "
                  "results.claim_out_dir (tests/test_red_team.py checks it) and each file written with atomic_output",
    "reference vllm": ["reference", "vllm", "--num-gpu-blocks", "64", "--max-requests", "2", "--vllm-python",
                       "/bin/false", "--model-dir", "hf", "-o", "ref"],
    "reference check": "reads the recorded scenarios only (tests/test_vllm_reference.py runs it)",
    "reference record-scenarios": "needs vLLM; its writers (harness.write_scenario, record_scenario) are the "
                                  "guarded ones `reference vllm` runs here",
    "model prepare": "converts the 270 MB GGUF (minutes); its one file is written with atomic_output "
                     "(gpu/weights.py)",
    "dashboard": "a server: its writes (uploads, labels) use atomic_output; tests/test_dashboard_guard.py drives it",
    "serve": "a server: it writes nothing but --record-trace's trace (tests/test_serve.py drives it)",
}


def test_the_table_names_every_command_of_the_cli():
    assert sorted(RUNS) == commands()


@pytest.fixture(scope="module")
def walked(tmp_path_factory) -> dict[str, tuple[int, str, list, set]]:
    """Each runnable command's (exit status, output, audit events, paths that appeared), in one directory."""
    from test_calibrate import synthetic_steps

    root = tmp_path_factory.mktemp("walk").resolve()
    (root / "spec.yaml").write_text(SPEC)
    (root / "hf").mkdir()
    (root / "hf" / "config.json").write_text("{}")          # a converted model, as far as the CLI looks
    synthetic_steps(n=200, padded=False).to_parquet(root / "steps.parquet")
    results = {}
    cwd = os.getcwd()
    os.chdir(root)
    try:
        for name, args in RUNS.items():
            if isinstance(args, str):
                continue
            before = {p for p in root.rglob("*")}
            RECORDER.root, RECORDER.events = root, []
            try:
                res = CliRunner().invoke(app, args)
            finally:
                RECORDER.root = None
            after = {p for p in root.rglob("*")}
            results[name] = (res.exit_code, res.output, RECORDER.events, after - before)
    finally:
        os.chdir(cwd)
    return results | {"root": root}


@pytest.mark.parametrize("name", [n for n, a in RUNS.items() if not isinstance(a, str)])
def test_every_command_writes_only_through_the_guarded_writer(walked, name):
    root = walked["root"]
    code, output, events, appeared = walked[name]
    if name == "reference vllm":            # /bin/false as vLLM: the files before vLLM's record, no result
        assert code == 2 and "vLLM driver failed" in output and (root / "ref" / ".kvsim-results").exists(), output
        assert any(p.name == "vllm_spec.json" for e, (p, *_) in events if e == "write")
    else:
        assert code == 0, output
    inside = [(e, paths) for e, paths in events if all(p == root or root in p.parents for p in paths)]
    unguarded = [p for e, (p, *_) in inside if e == "write" and not guarded(p, root)]
    assert not unguarded, f"{name} opened for writing outside the guarded writer: {unguarded}"
    renamed_into = {dst for e, (src, *rest) in inside if e == "rename" for dst in rest
                    if guarded(src, root) and not guarded(dst, root)}
    bad_renames = [(src, dst) for e, (src, *rest) in inside if e == "rename" for dst in rest
                   if not guarded(src, root)]
    assert not bad_renames, f"{name} renamed a file that no guarded writer made: {bad_renames}"
    for path in appeared:
        if path.is_dir() or guarded(path, root):
            continue
        placed = any(path == d or d in path.parents for d in renamed_into)
        assert placed, f"{name} wrote {path.relative_to(root)} other than by renaming a guarded temporary"


def test_commands_that_write_nothing_leave_the_directory_as_it_was(walked):
    for name in ("trace stats", "models", "gpus"):
        code, output, events, appeared = walked[name]
        assert code == 0 and not appeared and not [e for e in events if e[0] != "write" or
                                                   walked["root"] in e[1][0].parents], output
