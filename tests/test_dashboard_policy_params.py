"""A KV policy's own parameters (kv.params) on the dashboard: the form draws the selected policy's
declared parameters, reads and checks them as `kvsim simulate --set kv.params.NAME=VALUE` does, and
a run carries them into its config.yaml; Compare varies them. Plus the redaction of what a user's
file holds in every error the dashboard shows from reading one."""
from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
import yaml
from streamlit.testing.v1 import AppTest
from typer.testing import CliRunner

from kvsim.dashboard.data import DATA_ROOT_ENV
from kvsim.dashboard.forms import INVALID_FIELDS, config_axes, parse_axis_values
from kvsim.sim.cli import app as cli
from kvsim.sim.config import load_config
from kvsim.sim.kv.policy import policy_parameter_specs

APP = str(Path(__file__).resolve().parents[1] / "dashboard" / "app.py")
SECRET = "hunter2-not-a-real-password"
SMALL_SETS = ["--trace", "azure-conv-2023", "--model", "llama-3.1-8b", "--gpu", "h100", "--max-requests", "40",
              "--set", "engine.num_gpu_blocks=300"]
# figures of the run's own process (its wall clock), not of the simulated system
_PROCESS = {"wall_time_s", "sim_wall_s", "wall_s", "torch_threads", "steps_per_s", "cpu_s"}


@pytest.fixture(autouse=True)
def root(tmp_path, monkeypatch) -> Path:
    d = tmp_path / "data"
    d.mkdir()
    monkeypatch.setenv(DATA_ROOT_ENV, str(d))
    return d


def app() -> AppTest:
    at = AppTest.from_file(APP, default_timeout=90)
    at.run()
    assert not at.exception
    return at


def errors(at: AppTest) -> list[str]:
    assert not at.exception, [e.value for e in at.exception]
    return [e.value for e in at.error]


def small(at: AppTest, policy: str) -> AppTest:
    at.text_input(key="cfg_max_requests").set_value("40")
    at.text_input(key="cfg_num_gpu_blocks").set_value("300")
    at.selectbox(key="cfg_kv.policy").set_value(policy)
    return at.run()


def param(at: AppTest, policy: str, name: str):
    return at.text_input(key=f"cfg_kv.params.{name}@{policy}")


def cli_run(out: Path, *sets: str) -> dict:
    args = ["simulate", *SMALL_SETS, *(x for s in sets for x in ("--set", s)), "-q", "-o", str(out)]
    r = CliRunner().invoke(cli, args)
    assert r.exit_code == 0, r.output
    return json.loads((out / "summary.json").read_text())


def same_figures(a: dict, b: dict) -> None:
    keys = (set(a) | set(b)) - _PROCESS
    assert {k: a.get(k) for k in keys} == {k: b.get(k) for k in keys}


def cli_error(*sets: str) -> str:
    r = CliRunner().invoke(cli, ["simulate", *SMALL_SETS, *(x for s in sets for x in ("--set", s)), "-q"])
    assert r.exit_code != 0
    return r.output.strip().removeprefix("error: ")


def test_the_form_offers_the_selected_policys_declared_parameters():
    at = small(app(), "streaming")
    for spec in policy_parameter_specs("streaming"):
        field = param(at, "streaming", spec.name)
        assert field.label == spec.name and field.value == ""
        assert field.placeholder == (f"default: {spec.default}" if spec.default is not None else "default: none")
        assert f"--set kv.params.{spec.name}=VALUE" in field.help
    assert "newest tokens kept" in param(at, "streaming", "window").help     # the policy's own help
    at.selectbox(key="cfg_kv.policy").set_value("quest").run()
    shown = {w.key for w in at.text_input if w.key and w.key.startswith("cfg_kv.params.")}
    assert shown == {f"cfg_kv.params.{p.name}@quest" for p in policy_parameter_specs("quest") if p.name != "budget"}


def test_a_streaming_window_run_from_the_dashboard_is_the_cli_run(root, tmp_path):
    at = small(app(), "streaming")
    param(at, "streaming", "window").set_value("64").run()
    assert not errors(at)
    at.button(key="sim_run").click().run()
    assert not errors(at)
    [config_file] = (root / "dashboard-runs").rglob("config.yaml")
    config = yaml.safe_load(config_file.read_text())
    assert config["kv"]["policy"] == "streaming" and config["kv"]["params"] == {"window": 64}
    summary = json.loads((config_file.parent / "summary.json").read_text())
    by_cli = cli_run(tmp_path / "cli", "kv.policy=streaming", "kv.params.window=64")
    same_figures(summary, by_cli)
    default_window = cli_run(tmp_path / "default", "kv.policy=streaming")
    assert default_window["evicted_tokens"] != by_cli["evicted_tokens"]      # the window changed the run
    rerun = CliRunner().invoke(cli, ["simulate", "--config", str(config_file), "-q", "-o", str(tmp_path / "re")])
    assert rerun.exit_code == 0, rerun.output
    same_figures(summary, json.loads((tmp_path / "re" / "summary.json").read_text()))


@pytest.mark.parametrize("policy, name, text, sets", [
    ("streaming", "window", "0", ["kv.policy=streaming", "kv.params.window=0"]),
    ("streaming", "window", "abc", ["kv.policy=streaming", "kv.params.window=abc"]),
    ("leankv", "alpha_l", "2.0", ["kv.policy=leankv", "kv.params.alpha_l=2.0"]),
])
def test_a_bad_parameter_shows_the_clis_message_and_blocks_the_run(policy, name, text, sets):
    at = small(app(), policy)
    param(at, policy, name).set_value(text).run()
    assert errors(at) == [cli_error(*sets)]
    assert at.button(key="sim_run").disabled


def test_a_parameter_value_yaml_cannot_read_is_named_under_its_field():
    at = small(app(), "streaming")
    param(at, "streaming", "window").set_value("[1, ").run()
    page, message = errors(at)        # the page's line (main area), then the field's (sidebar)
    assert page == INVALID_FIELDS
    assert message.startswith("window: --set 'kv.params.window=[1,'") and "not valid YAML" in message
    assert at.button(key="sim_run").disabled


def test_recorded_needs_its_path_and_reads_it_only_under_the_data_root(root, tmp_path):
    at = small(app(), "recorded")
    assert errors(at) == [cli_error("kv.policy=recorded")]                # path is required
    outside = tmp_path / "replay"
    outside.mkdir()
    for text in (str(outside), "../replay"):
        param(at, "recorded", "path").set_value(text).run()
        page, message = errors(at)
        assert page == INVALID_FIELDS
        assert message.startswith("path: kv.params.path:") and "outside the dashboard's data directory" in message
    param(at, "recorded", "path").set_value("nowhere").run()
    [message] = errors(at)
    assert f"{root / 'nowhere' / 'decisions.parquet'} not found" in message


def test_a_recorded_decisions_file_is_named_but_not_quoted(root):
    replay = root / "replay"
    replay.mkdir()
    rows = {"request_id": [0], "step": [0], "layer": [0], "head": [-1], "position": [3], "action": [SECRET],
            "engine_step": [0], "reason": ["policy"], "num_tokens": [10], "event": [0]}
    pd.DataFrame(rows).to_parquet(replay / "decisions.parquet")
    at = small(app(), "recorded")
    param(at, "recorded", "path").set_value("replay").run()
    [message] = errors(at)
    assert SECRET in cli_error("kv.policy=recorded", f"kv.params.path={replay}")   # the CLI names the value
    assert message.startswith(f"kv.params for policy 'recorded': {replay / 'decisions.parquet'}: action")
    assert SECRET not in message and "cannot be replayed" in message
    assert at.button(key="sim_run").disabled


def test_compare_axes_hold_the_base_policys_parameters():
    base = load_config(None, {"kv.policy": "streaming"})
    axes = config_axes(base)
    assert {"kv.params.sink", "kv.params.window", "kv.params.evict_per_step"} <= set(axes)
    assert not any(k.startswith("kv.params.") for k in config_axes(load_config(None, {})))
    assert parse_axis_values("kv.params.window", "32, 0.5, abc, true") == [32, 0.5, "abc", True]   # as --set reads


def test_compare_varies_the_streaming_window(root, tmp_path):
    at = app()
    at.switch_page("pages/compare.py").run()
    small(at, "streaming")
    at.selectbox(key="cmp_axis").set_value("kv.params.window").run()
    at.text_input(key="cmp_text_kv.params.window").set_value("32, 0").run()
    assert errors(at) == ["kv.params.window=0: " + cli_error("kv.policy=streaming", "kv.params.window=0")]
    at.text_input(key="cmp_text_kv.params.window").set_value("32, 128").run()
    assert not errors(at)
    at.button(key="cmp_run").click().run()
    assert not errors(at)
    runs = {yaml.safe_load(f.read_text())["kv"]["params"]["window"]: f.parent
            for f in (root / "dashboard-runs").rglob("config.yaml")}
    assert set(runs) == {32, 128}
    same_figures(json.loads((runs[32] / "summary.json").read_text()),
                 cli_run(tmp_path / "w32", "kv.policy=streaming", "kv.params.window=32"))


# ---- errors from reading a user's file: named, never quoted -----------------------------------------
def test_a_run_stopped_by_a_users_importance_file_names_it_without_its_content(root):
    bad = root / "importance.yaml"
    bad.write_text(f"head_mix: {{{SECRET}: 1.0}}\nhead_types: {{}}\n")
    assert SECRET in cli_error("kv.policy=h2o", f"kv.importance={bad}")       # the CLI user wants the value
    at = small(app(), "h2o")
    at.text_input(key="cfg_kv.importance").set_value("importance.yaml").run()
    assert not errors(at)
    at.button(key="sim_run").click().run()
    [message] = errors(at)
    assert message.startswith(f"Simulation stopped: kv.importance: {bad}: head_mix: unknown head type(s)")
    assert SECRET not in message


def test_a_task_jobs_error_is_redacted_when_its_configuration_reads_a_users_file(root):
    from kvsim.dashboard.jobs import Job

    (root / "profile.yaml").write_text("gpu: x\n")
    quoting = f"{root / 'profile.yaml'}:1: gpu: expected a GPU name, got '{SECRET}'"

    def task(job):
        raise ValueError(quoting)
    with_file = load_config(None, {"profile": str(root / "profile.yaml")})
    job = Job(task=task, config=with_file).start()
    job.wait(10)
    assert job.error.startswith(f"{root / 'profile.yaml'}:1: gpu: expected a GPU name") and SECRET not in job.error
    job = Job(task=task, config=load_config(None, {})).start()       # no user file: nothing to hide
    job.wait(10)
    assert job.error == quoting


def crosscheck_dir(root: Path, figures: bytes) -> Path:
    d = root / "cc"
    d.mkdir()
    (d / "crosscheck.json").write_bytes(figures)
    pd.DataFrame({"kind": ["decode"] * 3, "measured_s": [0.01, 0.02, 0.03],
                  "predicted_s": [0.011, 0.019, 0.03]}).to_parquet(d / "step_times.parquet")
    return d


@pytest.mark.parametrize("figures, fragment", [
    (b"\xff\xfe" + SECRET.encode(), "not UTF-8 text"),
    (json.dumps({"step_errors": {"all": {"count": 3, "mape": 0.1}},
                 "throughput": [{"metric": "throughput_total_tok_s", "rel_error": SECRET}]}).encode(),
     "a figure has an unexpected shape or type (ValueError)"),
])
def test_a_damaged_crosscheck_is_one_error_naming_its_file_not_its_content(root, figures, fragment):
    d = crosscheck_dir(root, figures)
    at = app()
    at.switch_page("pages/fidelity.py").run()
    at.text_input(key="fid_path").set_value("cc").run()
    [message] = errors(at)
    assert message.startswith(str(d / "crosscheck.json")) and fragment in message and SECRET not in message


def test_a_recorded_runs_broken_config_yaml_beside_its_decisions_is_named_not_quoted(root):
    replay = root / "replay"
    replay.mkdir()
    rows = {"request_id": [0], "step": [0], "layer": [0], "head": [-1], "position": [3], "action": ["evict"],
            "engine_step": [0], "reason": ["policy"], "num_tokens": [10], "event": [0]}
    pd.DataFrame(rows).to_parquet(replay / "decisions.parquet")
    (replay / "config.yaml").write_text(f"kv: {{policy: {SECRET}\n")            # not YAML
    assert f"{replay / 'config.yaml'}: cannot be read as YAML" in cli_error(
        "kv.policy=recorded", f"kv.params.path={replay / 'decisions.parquet'}")
    (replay / "config.yaml").write_text(f"kv: {{policy: '{SECRET}'}}\n")          # a policy with no trigger
    assert SECRET in cli_error("kv.policy=recorded", f"kv.params.path={replay / 'decisions.parquet'}")
    at = small(app(), "recorded")
    param(at, "recorded", "path").set_value("replay/decisions.parquet").run()
    [message] = errors(at)
    assert message.startswith(f"kv.params for policy 'recorded': {replay}")
    assert "has no known default trigger" in message and SECRET not in message
