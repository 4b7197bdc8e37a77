"""The dashboard confined to its data root (dashboard/guard.py): path fields outside it are refused
before anything reads them, no message shows another file's keys, and every queued run passes the
form's limits and the command line's memory estimate, through AppTest and through the real server."""
from __future__ import annotations

from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from kvsim.dashboard.browser import Browser, chromium_binary, serve_dashboard
from kvsim.dashboard.guard import check_run, confine_overrides, upload_name
from kvsim.dashboard.ui import JOB_KEY
from kvsim.sim.config import ConfigError, load_config

APP = str(Path(__file__).resolve().parents[1] / "dashboard" / "app.py")
SECRET = "aws_secret_access_key: AKIA-not-a-real-one\ndb_password: hunter2\n"


@pytest.fixture
def setup(tmp_path, monkeypatch):
    """A data root, and beside it (outside) a YAML file of secrets and a link to it from inside."""
    root = tmp_path / "data"
    root.mkdir()
    secret = tmp_path / "secrets.yaml"
    secret.write_text(SECRET)
    (root / "link.yaml").symlink_to(secret)
    monkeypatch.setenv("KVSIM_DATA_ROOT", str(root))
    return root, secret


def errors(at: AppTest) -> list[str]:
    assert not at.exception, [e.value for e in at.exception]
    return [e.value for e in at.error]


OUTSIDE = ("{secret}", "../secrets.yaml", "link.yaml", "/etc/passwd", "../../../../etc/hostname")


@pytest.mark.parametrize("key", ["cfg_profile", "cfg_kv.importance"])     # the shared base form (forms.BASE)
def test_path_fields_outside_the_data_root_are_refused_without_their_content(setup, key):
    root, secret = setup
    at = AppTest.from_file(APP, default_timeout=60)
    at.run()
    for text in OUTSIDE:
        at.text_input(key=key).set_value(text.format(secret=secret)).run()
        shown = " ".join(errors(at))
        assert "outside the dashboard's data directory" in shown, (text, shown)
        assert "aws_secret" not in shown and "db_password" not in shown and "root:" not in shown
        assert at.button(key="sim_run").disabled


def test_a_policy_parameter_error_names_the_policy_and_its_parameters(setup):
    """Without a user file in the configuration no message can quote one: a policy given a parameter
    it lacks said "policy (content not shown) has no parameter(s) (content not shown); it accepts
    (content not shown)", redacted as if it quoted a file."""
    at = AppTest.from_file(APP, default_timeout=60)
    at.run()
    at.text_input(key="cfg_max_requests").set_value("5")
    at.selectbox(key="cfg_kv.policy").set_value("streaming")
    at.text_input(key="cfg_kv.budget").set_value("64").run()
    # the form builds the policy as the CLI does before a run: the error shows before Run, which it blocks
    assert errors(at) == ["kv.budget (--budget): policy 'streaming' has no parameter(s) ['budget']; it accepts "
                          "['sink', 'window', 'evict_per_step']"]
    assert at.button(key="sim_run").disabled


def test_a_path_inside_the_data_root_is_read_from_there(setup):
    root, _ = setup
    (root / "mine.yaml").write_text(SECRET)                  # the user's own file: an honest error is fine
    overrides = confine_overrides({"profile": "mine.yaml", "kv.importance": "smollm2-135m", "model": "llama-3.1-8b"})
    assert overrides == {"profile": str(root / "mine.yaml"), "kv.importance": "smollm2-135m",
                         "model": "llama-3.1-8b"}


def test_compare_axis_values_cannot_bypass_the_pool_limit(setup):
    at = AppTest.from_file(APP, default_timeout=60)
    at.switch_page("pages/compare.py").run()
    at.selectbox(key="cmp_axis").set_value("engine.num_gpu_blocks").run()
    at.text_input(key="cmp_text_engine.num_gpu_blocks").set_value("300, 25000000").run()
    at.button(key="cmp_run").click().run()
    shown = " ".join(errors(at))
    assert "num_gpu_blocks: at most 4,000,000" in shown
    assert JOB_KEY not in at.session_state or at.session_state[JOB_KEY] is None      # nothing was queued


@pytest.mark.parametrize("over, fragment", [
    ({"replicas": 1000}, "replicas: at most 64"),
    ({"engine.num_gpu_blocks": 25_000_000}, "engine.num_gpu_blocks: at most 4,000,000"),
    ({"kv.layout": "per_head", "kv.policy": "h2o", "kv.budget": 64, "engine.num_gpu_blocks": 100_000},
     "at most 15,625 blocks"),
])
def test_every_queued_run_passes_the_forms_limits(setup, over, fragment):
    with pytest.raises(ConfigError, match=fragment):
        check_run(load_config(None, over))


def test_every_queued_run_passes_the_memory_estimate(setup, monkeypatch):
    from kvsim.sim.model import memory

    monkeypatch.setattr(memory, "available_memory_bytes", lambda: (2**20, "a tiny test budget"))
    with pytest.raises(ConfigError, match="host memory"):
        check_run(load_config(None, {"engine.num_gpu_blocks": 30_000}))     # fits an H100 beside the weights


@pytest.mark.parametrize("name, stored", [("trace.csv", "trace.csv"), ("a\x00b.csv", "ab.csv"),
                                          ("../../etc/passwd", "passwd"), ("x" * 300 + ".jsonl", "x" * 94 + ".jsonl"),
                                          ("..", "upload"), (".hidden.csv", "hidden.csv")])
def test_upload_names_are_safe(name, stored):
    assert upload_name(name) == stored


@pytest.mark.skipif(chromium_binary() is None, reason="chromium is not installed")
def test_the_real_server_refuses_a_profile_outside_its_data_root(setup):
    root, secret = setup
    with serve_dashboard(data_root=root) as url, Browser(1200, 1600) as browser:
        browser.navigate(url)
        browser.wait_for("document.body.innerText.includes('Run simulation')", 90, "the Simulate page")
        browser.eval("document.querySelectorAll('details summary').forEach(s => s.click())")   # open the expanders
        browser.type_into("profile", str(secret), timeout=60)
        browser.wait_for("document.body.innerText.includes(\"outside the dashboard's data directory\")", 60,
                         "the refusal")
        text = browser.text()
    assert "aws_secret" not in text and "hunter2" not in text


@pytest.mark.parametrize("key", ["cfg_profile", "cfg_kv.importance"])
def test_a_pipe_or_device_inside_the_data_root_is_refused_without_reading_it(setup, key):
    """A named pipe in the data root (reading it would hang the job) and a link there to /dev/zero (reading
    it would fill the server's memory): each refused in one message, at once."""
    import os

    root, _ = setup
    os.mkfifo(root / "pipe.yaml")
    (root / "zero.yaml").symlink_to("/dev/zero")
    at = AppTest.from_file(APP, default_timeout=60)
    at.run()
    for name, fragment in (("pipe.yaml", "named pipe"), ("zero.yaml", "outside the dashboard's data directory")):
        at.text_input(key=key).set_value(name).run()
        shown = " ".join(errors(at))
        assert fragment in shown, (name, shown)
        assert at.button(key="sim_run").disabled


def test_a_job_of_more_runs_than_the_limit_is_refused_before_any_is_checked(setup):
    from kvsim.dashboard.guard import MAX_RUNS_PER_JOB, check_runs

    cfg = load_config(None, {})
    with pytest.raises(ConfigError, match=f"{MAX_RUNS_PER_JOB + 1} simulations in one job; at most {MAX_RUNS_PER_JOB}"):
        check_runs([(str(i), cfg) for i in range(MAX_RUNS_PER_JOB + 1)])
    check_runs([(str(i), cfg) for i in range(2)])


@pytest.mark.parametrize("name", ["a\x00b.jsonl", "x" * 300 + ".jsonl", "../../../etc/cron.d/x.jsonl"],
                         ids=["NUL byte", "300 characters", "a path out"])
def test_a_hostile_upload_name_is_stored_safely_under_the_data_root(setup, name):
    root, _ = setup
    body = b'{"arrival_time_s": 0, "prompt_tokens": 5, "output_tokens": 2}\n'
    at = AppTest.from_file(APP, default_timeout=60)
    at.run()
    at.radio(key="cfg_trace_kind").set_value("Upload a file").run()
    at.file_uploader(key="cfg_trace_upload").upload(name, body)
    at.run()
    assert errors(at) == []                                      # no uncaught exception, no refusal
    stored = [p for p in (root / "uploads").rglob("*") if p.is_file()]
    assert [p.name for p in stored] == [upload_name(name)] and stored[0].read_bytes() == body
