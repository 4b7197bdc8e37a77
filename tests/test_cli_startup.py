"""The lazy command line (issue 47 item 10, issue 49's start-up): `kvsim --help` and `kvsim models` start without
the modules of the commands they do not run, `kvsim simulate --help` without numpy, the config schema or the
policy registry (its options list the registries' names from kvsim.sim.kv.names), and the root help lists each
command with its own docstring's summary."""
import os
import subprocess
import sys

import pytest
import typer
from typer.testing import CliRunner

from kvsim.sim.cli import COMMANDS, app, listed_help, unwrapped

HEAVY = ("numpy", "pandas", "pyarrow", "simpy", "kvsim.sim.config", "kvsim.sim.cli.simulate", "kvsim.sim.cli.planning")



def imported_after(*args: str, modules: tuple[str, ...] = HEAVY, env: dict | None = None) -> set[str]:
    """The MODULES a fresh `kvsim ARGS` process has imported when it finishes."""
    code = ("import sys\nfrom kvsim.sim.cli import app\ntry:\n    app(sys.argv[1:], prog_name='kvsim')\n"
            "except SystemExit:\n    pass\n"
            f"print('HEAVY=' + ','.join(m for m in {modules!r} if m in sys.modules))")
    run = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120,
                         env={**os.environ, **(env or {})})
    assert run.returncode == 0, run.stderr
    return set(filter(None, run.stdout.rsplit("HEAVY=", 1)[1].strip().split(",")))


def test_help_and_models_import_no_heavy_module():
    assert imported_after("--help") == set()
    assert imported_after("models", "llama-3.1-8b") == set()


SIMULATE_HELP_HEAVY = ("numpy", "pandas", "pyarrow", "simpy", "kvsim.sim.config", "kvsim.sim.kv.policy",
                       "kvsim.sim.kv.slots", "kvsim.sim.model.catalog", "kvsim.sim.cli.simulate")


def test_simulate_help_imports_its_command_but_not_the_config_numpy_or_the_policies():
    assert imported_after("simulate", "--help", modules=SIMULATE_HELP_HEAVY) == {"kvsim.sim.cli.simulate"}


PLUGIN = """from kvsim.sim.kv.policy import EvictionPolicy, register_policy


@register_policy("startup-plugin-policy")
class StartupPlugin(EvictionPolicy):
    pass
"""


def test_simulate_help_lists_a_plugin_policy_from_kvsim_plugins(tmp_path):
    (tmp_path / "startup_plugin.py").write_text(PLUGIN)
    env = {**os.environ, "KVSIM_PLUGINS": "startup_plugin", "PYTHONPATH": str(tmp_path), "COLUMNS": "400"}
    run = subprocess.run([sys.executable, "-m", "kvsim.sim.cli", "simulate", "--help"], capture_output=True,
                         text=True, timeout=120, env=env)
    assert run.returncode == 0, run.stderr
    assert "startup-plugin-policy" in run.stdout and "h2o" in run.stdout


def test_the_static_registry_names_are_the_registries():
    from kvsim.sim.cli.options import policy_names_for_help
    from kvsim.sim.kv import names, policy, slots

    policy.policy_names()           # loads the built-ins
    builtin = {name for name, cls in policy._REGISTRY.items() if cls.__module__.startswith(policy._BUILTIN_PREFIX)}
    assert set(names.BUILTIN_POLICIES) == builtin
    assert slots.SLOT_STRATEGIES is names.SLOT_STRATEGIES
    assert names.may_have_plugins()                   # the registry is imported here: ask it
    assert policy_names_for_help() == policy.policy_names()


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


FEATURE_MODULES = ("psutil", "kvsim.sim.simulator.fleet_run", "kvsim.sim.cluster.fleet",
                   "kvsim.sim.cluster.connectors.offload", "rich.markdown")


def test_a_single_engine_run_starts_without_the_fleet_offload_modules_and_psutil(tmp_path):
    run = imported_after("simulate", "--trace", "azure-conv-2023", "--max-requests", "5", "--model", "llama-3.1-8b",
                         "--gpu", "h100", "-q", "-o", str(tmp_path / "r"), modules=FEATURE_MODULES + ("pandas",))
    assert run == {"pandas"}                       # the run ran (its results are written with pandas)
    assert (tmp_path / "r" / "requests.parquet").exists()


def test_host_memory_reads_memavailable_on_linux_and_psutil_elsewhere(monkeypatch):
    from kvsim.sim.io import safe_io

    if sys.platform.startswith("linux"):
        assert safe_io._meminfo_available() > 0
    monkeypatch.setattr(safe_io, "_meminfo_available", lambda: 12345)
    monkeypatch.setattr(safe_io, "_cgroup_room", lambda: None)
    monkeypatch.setattr(safe_io, "_address_space_room", lambda: None)
    assert safe_io.host_memory_room() == (12345, "available system memory")
    psutil = pytest.importorskip("psutil")
    monkeypatch.setattr(safe_io, "_meminfo_available", lambda: None)
    monkeypatch.setattr(psutil, "virtual_memory", lambda: type("VM", (), {"available": 678})())
    assert safe_io.host_memory_room() == (678, "available system memory")


def test_the_plugin_entry_points_are_read_once_a_process(monkeypatch):
    import importlib.metadata

    from kvsim.sim.kv import names

    calls = []
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda **kw: calls.append(kw) or [])
    names.plugin_entry_points.cache_clear()
    try:
        assert names.plugin_entry_points() == () and names.plugin_entry_points() == ()
        assert calls == [{"group": names.PLUGIN_GROUP}]
    finally:
        names.plugin_entry_points.cache_clear()
