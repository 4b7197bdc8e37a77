"""Config names are checked against their registries: a KV policy registered from outside the package
runs end to end (CLI and API), unknown names fail naming the field and the valid names, the CLI's help
comes from the registries, and `kvsim simulate` never imports torch."""
import json
import os
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest
import typer
from typer.testing import CliRunner

from kvsim.sim.cli import app
from kvsim.sim.config import ConfigError, load_config, policy_names, registry_choices, slot_strategy_names
from kvsim.sim.kv.policy import Decision, EvictionPolicy, register_policy
from kvsim.sim.simulator.simulate import run_simulation

SMALL = {"trace": "sharegpt-8k-filtered", "model": "smollm2-135m", "gpu": "l4", "trace_options.max_requests": 4}


@register_policy("test-keep-last")
class KeepLast(EvictionPolicy):
    """Keeps only the newest `window` tokens of each request (a plug-in defined outside kvsim)."""
    needs_scores = False
    default_trigger = "every_step"

    def __init__(self, window: int = 32):
        self.window = window

    def compress(self, state, ctx, reason, scores):
        drop = state.live & (state.pos < state.num_tokens - self.window)
        return Decision(evict=drop) if drop.any() else None


def test_a_policy_registered_outside_the_package_runs_through_load_config_and_run_simulation():
    cfg = load_config(None, {**SMALL, "kv.policy": "test-keep-last", "kv.params": {"window": 16}})
    result = run_simulation(cfg)
    assert result.summary["num_finished"] == 4 and result.summary["evicted_tokens"] > 0
    assert run_simulation(load_config(None, SMALL)).summary.get("evicted_tokens", 0) == 0


def test_a_policy_registered_outside_the_package_runs_through_kvsim_simulate(tmp_path):
    args = ["simulate", "--trace", SMALL["trace"], "--model", SMALL["model"], "--gpu", SMALL["gpu"],
            "--max-requests", "4", "--policy", "test-keep-last", "--set", "kv.params.window=16", "-q"]
    res = CliRunner().invoke(app, [*args, "-o", str(tmp_path / "cli")])
    assert res.exit_code == 0, res.output
    summary = json.loads((tmp_path / "cli" / "summary.json").read_text())
    assert summary["evicted_tokens"] > 0
    # the same run through the API gives the same schedule
    api = run_simulation(load_config(tmp_path / "cli" / "config.yaml"))
    cli_requests = pd.read_parquet(tmp_path / "cli" / "requests.parquet")
    assert np.array_equal(api.requests["finish_s"].to_numpy(), cli_requests["finish_s"].to_numpy())


@pytest.mark.parametrize("overrides, message", [
    ({"kv.policy": "h20"}, "kv.policy: unknown KV policy 'h20'; known: "),
    ({"kv.slot_strategy": "compactt"}, "kv.slot_strategy: unknown slot strategy 'compactt'; known: noop, free_block"),
    ({"model": "llama-9"}, "model: unknown model 'llama-9'; known models: "),
    ({"gpu": "h900"}, "gpu: unknown gpu 'h900'; known gpus: "),
])
def test_unknown_names_fail_naming_the_field_and_the_valid_names(overrides, message):
    with pytest.raises(ConfigError) as exc:
        load_config(None, overrides)
    assert message in str(exc.value)
    if "kv.policy" in overrides:
        assert all(name in str(exc.value) for name in policy_names())
        assert "test-keep-last" in str(exc.value)


def test_unknown_policy_on_the_command_line_is_one_error_line(tmp_path):
    res = CliRunner().invoke(app, ["simulate", "--policy", "h20", "-q", "-o", str(tmp_path / "o")])
    assert res.exit_code == 2
    assert res.stderr.startswith("error: config: kv.policy: unknown KV policy 'h20'; known: ada_snapkv, ")


def test_registry_backed_keys_list_their_registry():
    assert registry_choices("kv.policy") == policy_names()
    assert registry_choices("kv.slot_strategy") == slot_strategy_names()
    assert registry_choices("engine.block_size") is None


def test_policy_and_slot_strategy_help_comes_from_the_registries():
    commands = typer.main.get_command(app).commands
    for command in ("simulate", "replay"):
        params = {p.name: p for p in commands[command].params}
        assert all(name in params["policy"].help for name in policy_names() if name != "test-keep-last")
        assert all(name in params["slot_strategy"].help for name in slot_strategy_names())


def test_kvsim_simulate_does_not_import_torch(tmp_path):
    code = ("import sys\nfrom kvsim.sim.cli import main\n"
            f"sys.argv = ['kvsim', 'simulate', '--trace', 'sharegpt-8k-filtered', '--model', 'smollm2-135m', "
            f"'--gpu', 'l4', '--max-requests', '3', '--policy', 'h2o', '--budget', '64', '-q', '-o', '{tmp_path}']\n"
            "try:\n    main()\nexcept SystemExit as exc:\n    assert not exc.code, exc.code\n"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "False", out.stderr


PLUGIN = '''"""A policy plug-in living outside kvsim: keeps the newest `window` tokens."""
from kvsim.sim.kv.policy import Decision, EvictionPolicy, register_policy


@register_policy("plugin-keep-last")
class PluginKeepLast(EvictionPolicy):
    needs_scores = False

    def __init__(self, window: int = 32):
        self.window = window

    def compress(self, state, ctx, reason, scores):
        drop = state.live & (state.pos < state.num_tokens - self.window)
        return Decision(evict=drop) if drop.any() else None
'''


def _plugin_env(tmp_path, modules: str) -> dict:
    (tmp_path / "my_kv_plugin.py").write_text(PLUGIN)
    return {**os.environ, "PYTHONPATH": str(tmp_path), "KVSIM_PLUGINS": modules}


def test_the_kvsim_command_and_parallel_sweep_workers_load_plugins_from_kvsim_plugins(tmp_path):
    env = _plugin_env(tmp_path, "my_kv_plugin")
    run = subprocess.run([sys.executable, "-m", "kvsim.sim.cli", "simulate", "--trace", SMALL["trace"], "--model",
                          SMALL["model"], "--gpu", "l4", "--max-requests", "4", "--policy", "plugin-keep-last",
                          "-q", "-o", str(tmp_path / "one")], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert json.loads((tmp_path / "one" / "summary.json").read_text())["evicted_tokens"] > 0
    spec = tmp_path / "spec.yaml"
    spec.write_text("fixed: {trace: sharegpt-8k-filtered, model: smollm2-135m, gpu: l4, "
                    "trace_options.max_requests: 4, kv.policy: plugin-keep-last}\n"
                    "grid: {kv.params.window: [16, 64]}\n")
    sweep = subprocess.run([sys.executable, "-m", "kvsim.sim.cli", "sweep", str(spec), "--out", str(tmp_path / "s"),
                            "-j", "2"], env=env, capture_output=True, text=True)
    assert sweep.returncode == 0, sweep.stdout + sweep.stderr
    rows = pd.read_parquet(tmp_path / "s" / "runs")
    assert len(rows) == 2 and (rows["status"] == "ok").all() and (rows["evicted_tokens"] > 0).all()


def test_a_plugin_that_cannot_be_imported_is_named_with_its_source(tmp_path):
    env = _plugin_env(tmp_path, "my_kv_plugin, no_such_plugin")
    run = subprocess.run([sys.executable, "-m", "kvsim.sim.cli", "simulate", "--trace", SMALL["trace"], "--model",
                          SMALL["model"], "--max-requests", "2", "-q", "-o", str(tmp_path / "x")],
                         env=env, capture_output=True, text=True)
    assert run.returncode != 0
    assert "error: kv.policy: $KVSIM_PLUGINS: cannot import policy plug-in module 'no_such_plugin'" in run.stderr
    assert "Traceback" not in run.stderr
    # commands that never look a policy up still work
    stats = subprocess.run([sys.executable, "-m", "kvsim.sim.cli", "trace", "stats", SMALL["trace"]],
                           env=env, capture_output=True, text=True)
    assert stats.returncode == 0, stats.stderr
