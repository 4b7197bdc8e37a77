"""The lazy command line (issue 47 item 10): `kvsim --help` and `kvsim models` start without the modules of
the commands they do not run, and the root help lists each command with its own docstring's summary."""
import subprocess
import sys

import pytest
import typer
from typer.testing import CliRunner

from kvsim.sim.cli import COMMANDS, app, listed_help, unwrapped

HEAVY = ("numpy", "pandas", "pyarrow", "simpy", "kvsim.sim.config", "kvsim.sim.cli.simulate", "kvsim.sim.cli.planning")


def imported_after(*args: str) -> set[str]:
    """The HEAVY modules a fresh `kvsim ARGS` process has imported when it finishes."""
    code = ("import sys\nfrom kvsim.sim.cli import app\ntry:\n    app(sys.argv[1:], prog_name='kvsim')\n"
            "except SystemExit:\n    pass\n"
            f"print('HEAVY=' + ','.join(m for m in {HEAVY!r} if m in sys.modules))")
    run = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    return set(filter(None, run.stdout.rsplit("HEAVY=", 1)[1].strip().split(",")))


def test_help_and_models_import_no_heavy_module():
    assert imported_after("--help") == set()
    assert imported_after("models", "llama-3.1-8b") == set()
    assert "kvsim.sim.config" in imported_after("simulate", "--help")     # the command's own imports still come


@pytest.mark.parametrize("name", list(COMMANDS))
def test_the_root_help_lists_each_commands_own_summary(name):
    root = typer.main.get_command(app)
    command = root.get_command(None, name)
    assert command.name == name
    assert listed_help(name) == command.help.split("\n\n")[0]


def test_root_help_lists_every_command_and_a_command_runs():
    out = CliRunner().invoke(app, ["--help"], prog_name="kvsim", env={"COLUMNS": "300"}).output
    for name in COMMANDS:
        assert f"│ {name} " in out
    assert "Usage: kvsim simulate" in CliRunner().invoke(app, ["simulate", "--help"], prog_name="kvsim").output


def test_help_paragraphs_are_unwrapped_but_lists_keep_their_lines():
    text = "Fit the factors\nto step times.\n\nUse:\n- one\n- two\n  indented\n1. first"
    assert unwrapped(text) == "Fit the factors to step times.\n\nUse:\n- one\n- two\n  indented\n1. first"
