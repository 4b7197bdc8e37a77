"""Dashboard pages driven through streamlit's AppTest: widgets, small real runs, bad input."""
from __future__ import annotations

import base64
import json
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from streamlit.testing.v1 import AppTest

from kvsim.dashboard.data import DATA_ROOT_ENV, bin_steps, fidelity_table, pareto_front, pool_map
from kvsim.dashboard.ui import fmt_share
from kvsim.sim.config import SimConfig, load_config
from kvsim.sim.simulator.simulate import run_simulation

APP = str(Path(__file__).resolve().parents[1] / "dashboard" / "app.py")
TIMEOUT = 60
SMALL = {"trace": "azure-conv-2023", "trace_options.max_requests": 50, "engine.num_gpu_blocks": 300}


def app() -> AppTest:
    at = AppTest.from_file(APP, default_timeout=TIMEOUT)
    at.run()
    assert not at.exception
    return at


def small_config(at: AppTest, prefix: str, requests: int = 50, blocks: int = 300) -> None:
    at.text_input(key=f"{prefix}max_requests").set_value(str(requests))
    at.text_input(key=f"{prefix}num_gpu_blocks").set_value(str(blocks))


def charts(at: AppTest) -> list[dict]:
    return [json.loads(c.proto.spec) for c in at.get("plotly_chart")]


def chart(at: AppTest, title: str) -> dict:
    found = [c for c in charts(at) if c["layout"].get("title", {}).get("text", "").startswith(title)]
    assert found, f"no chart titled {title!r}"
    return found[0]


def values(array) -> np.ndarray:
    """Plotly JSON arrays arrive as lists or as {'dtype', 'bdata'} (base64)."""
    if isinstance(array, dict):
        flat = np.frombuffer(base64.b64decode(array["bdata"]), dtype=np.dtype(array["dtype"]))
        shape = [int(n) for n in str(array.get("shape", flat.size)).split(",")]
        return flat.reshape(shape)
    return np.asarray(array, dtype=float)


def errors(at: AppTest) -> list[str]:
    assert not at.exception, [e.value for e in at.exception]
    return [e.value for e in at.error]


def frame_with(at: AppTest, column: str) -> pd.DataFrame:
    return next(d.value for d in at.dataframe if column in d.value.columns)


def metric(at: AppTest, label: str) -> str:
    return next(m.value for m in at.metric if m.label == label)


@pytest.fixture(autouse=True)
def data_root(tmp_path, monkeypatch, request):
    """The dashboard reads and writes only under its data root: each test's tmp_path, or the root of
    the module-scoped app the test uses (its runs are run directories there)."""
    uses_shared = any(n in request.fixturenames for n in ("simulated", "per_head"))
    root = request.getfixturevalue("module_root") if uses_shared else tmp_path
    monkeypatch.setenv(DATA_ROOT_ENV, str(root))
    return root


@pytest.fixture(scope="module")
def expected():
    return run_simulation(load_config(None, SMALL))


@pytest.fixture(scope="module")
def module_root(tmp_path_factory):
    """A data root for a module-scoped app; tests using the app point the dashboard at it again."""
    import os
    root = tmp_path_factory.mktemp("data")
    before = os.environ.get(DATA_ROOT_ENV)
    os.environ[DATA_ROOT_ENV] = str(root)
    yield root
    if before is None:
        os.environ.pop(DATA_ROOT_ENV, None)
    else:
        os.environ[DATA_ROOT_ENV] = before


@pytest.fixture(scope="module")
def simulated(module_root):
    """The app after one small simulation on the Simulate page (shared by the read-only checks)."""
    at = app()
    small_config(at, "cfg_")
    at.button(key="sim_run").click().run()
    assert not errors(at)
    at.kvsim_root = module_root
    return at


# ---- Simulate --------------------------------------------------------------------------------
def test_simulate_page_has_its_inputs():
    at = app()
    assert at.title[0].value == "Simulate"
    labels = {w.label for w in [*at.selectbox, *at.text_input, *at.radio, *at.checkbox]}
    for label in ("Trace", "Shipped trace", "Model", "GPU", "Block size (tokens)", "KV pool (blocks)",
                  "max_num_seqs", "max_num_batched_tokens", "Prefix caching", "Max requests (first N)"):
        assert label in labels
    assert at.selectbox(key="cfg_trace_name").options[0] == "azure-conv-2023"
    if "kv" in SimConfig.model_fields:   # eviction policy / slot strategy widgets come from the config
        assert any(k.startswith("cfg_kv.") for k in at.session_state)
    assert at.button(key="sim_run").disabled is False


def test_simulate_run_shows_the_engine_figures(simulated, expected):
    s = expected.summary
    assert metric(simulated, "Finished / rejected") == f"{s['num_finished']} / {s['num_rejected']}" == "50 / 0"
    assert metric(simulated, "Output throughput") == f"{s['throughput_output_tok_s']:,.0f} tok/s"
    assert metric(simulated, "Preemptions") == str(s["preemptions"])
    ttft = chart(simulated, "TTFT CDF")["data"][0]
    done = expected.requests[expected.requests["status"] == "finished"]
    np.testing.assert_allclose(values(ttft["x"]), np.sort(done["ttft_s"].to_numpy()) * 1e3)
    np.testing.assert_allclose(values(ttft["y"])[-1], 1.0)
    titles = [c["layout"]["title"]["text"] for c in charts(simulated)]
    assert titles == ["TTFT CDF", "TPOT CDF", "E2E CDF", "Throughput over time",
                      "Scheduler State: running and waiting requests", "Batch size"]
    batch = chart(simulated, "Batch size")["data"][0]
    assert values(batch["y"]).max() <= expected.steps["batch_size"].max()


def test_all_summary_figures_carry_their_units(simulated, expected):
    """The expander's table of summary.json: vllm bench serve's keys showed max_output_tokens_per_s
    as seconds ('24.0 s'), its *_ms latencies and throughputs without a unit (p99_e2el_ms 1.702e+04)."""
    s = expected.summary
    shown = frame_with(simulated, "figure").set_index("figure")["value"]
    assert shown["max_output_tokens_per_s"].endswith(" tok/s")
    assert shown["output_throughput"] == shown["throughput_output_tok_s"]
    assert shown["request_throughput"] == shown["throughput_req_s"] and shown["request_throughput"].endswith(" req/s")
    assert shown["p99_e2el_ms"] == f"{s['p99_e2el_ms']:,.0f} ms" and shown["median_tpot_ms"].endswith(" ms")
    assert shown["duration"] == shown["makespan_s"]
    assert not [v for v in shown if re.fullmatch(r"-?[\d.]+e[+-]\d+.*", v)]       # no exponents
    from kvsim.dashboard.ui import summary_figures
    replay = summary_figures({"prediction_error": -0.2619, "profile_step_mape": 0.0456}).set_index("figure")["value"]
    assert replay["prediction_error"] == "-26.2%" and replay["profile_step_mape"] == "4.56%"


def test_bad_upload_shows_the_loader_error_without_the_file_content(data_root):
    at = app()
    at.radio(key="cfg_trace_kind").set_value("Upload a file").run()
    at.file_uploader(key="cfg_trace_upload").upload("mine.csv", b"API_TOKEN=s3cr3t,bar\n1,2\n", "text/csv")
    at.run()
    [message] = errors(at)
    assert message.startswith("mine.csv:1:") and "is not a known trace format" in message
    assert "s3cr3t" not in message and "API_TOKEN" not in message     # file content is never quoted
    assert at.button(key="sim_run").disabled
    assert list((data_root / "uploads").rglob("mine.csv"))       # uploads are kept under the data root
    at.file_uploader(key="cfg_trace_upload").clear().upload(
        "azure.csv", b"TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,374,44\n"
        b"2023-11-16 18:15:50.9951690,lots,152\n", "text/csv")
    at.run()
    [message] = errors(at)
    assert message.startswith("azure.csv:3:") and "ContextTokens" in message


def test_uploaded_trace_runs(tmp_path):
    from kvsim.traces import load_trace
    trace = load_trace("mooncake-conversation").head(20)
    trace.save(tmp_path / "mine.jsonl")
    at = app()
    at.radio(key="cfg_trace_kind").set_value("Upload a file").run()
    at.file_uploader(key="cfg_trace_upload").upload("mine.jsonl", (tmp_path / "mine.jsonl").read_bytes())
    small_config(at, "cfg_", blocks=2000)
    at.run()
    assert not errors(at)
    at.button(key="sim_run").click().run()
    assert not errors(at)
    direct = run_simulation(load_config(None, {**SMALL, "trace": str(tmp_path / "mine.jsonl"),
                                               "engine.num_gpu_blocks": 2000})).summary
    assert direct["num_finished"] + direct["num_rejected"] == 20
    assert metric(at, "Finished / rejected") == f"{direct['num_finished']} / {direct['num_rejected']}"
    assert metric(at, "Output throughput") == f"{direct['throughput_output_tok_s']:,.0f} tok/s"


def test_invalid_option_is_named_as_the_page_names_it():
    at = app()
    at.text_input(key="cfg_slo_ttft").set_value("2").run()
    [message] = [m for m in errors(at) if m != "Some fields are invalid; see the message under each."]
    assert message.startswith("TTFT SLO") and "not a duration with a unit" in message and "slo.ttft" not in message
    assert at.button(key="sim_run").disabled


@pytest.mark.parametrize("key, value, message", [
    ("cfg_max_requests", 0, "Max requests (first N): must be at least 1"),
    ("cfg_max_requests", -5, "Max requests (first N): must be at least 1"),
    ("cfg_num_gpu_blocks", 10**9, "KV pool (blocks): must be at most 4,000,000"),
    ("cfg_rate_scale", 0.0, "Arrival-rate scale: must be at least 0.01"),
    ("cfg_kv.budget", 0, "budget: must be at least 1"),           # a generated widget: bounds from the config
])
def test_out_of_range_number_blocks_the_run_with_its_message(key, value, message):
    at = app()
    at.text_input(key=key).set_value(str(value)).run()
    assert message in errors(at) and at.button(key="sim_run").disabled
    assert not any("--" in m for m in errors(at))


def test_per_head_pool_is_bounded_in_pages():
    at = app()
    at.selectbox(key="cfg_kv.layout").set_value("per_head")
    at.text_input(key="cfg_num_gpu_blocks").set_value("100000").run()   # x 32 layers x 8 KV heads of Llama-3.1-8B
    assert any(m.startswith("KV pool (blocks): at most 15,625 blocks") for m in errors(at))
    assert at.button(key="sim_run").disabled


def test_paths_outside_the_data_root_are_refused(tmp_path):
    outside = tmp_path.parent / "elsewhere.csv"
    at = app()
    at.radio(key="cfg_trace_kind").set_value("Path on this machine").run()
    for path in (str(outside), "../elsewhere.csv", "/etc/passwd"):
        at.text_input(key="cfg_trace_path").set_value(path).run()
        [message] = errors(at)
        assert "outside the dashboard's data directory" in message and "root:" not in message


def test_newest_run_is_selected_after_each_run():
    at = app()
    small_config(at, "cfg_")
    for label in ("first", "second"):
        at.text_input(key="sim_label").set_value(label)
        at.button(key="sim_run").click().run()
        assert not errors(at)
        assert at.selectbox(key="sim_pick").value == label and at.subheader[0].value == f"Summary: {label}"
    at.switch_page("pages/memory.py").run()
    assert at.selectbox(key="mem_pick").value == "second"


def test_one_job_per_session_disables_run_on_every_page():
    from kvsim.dashboard.jobs import Job
    at = app()
    job = Job([("long", load_config(None, {"trace": "sharegpt-8k-filtered", "trace_options.max_requests": 5000}))],
              page="Simulate").start()
    try:
        at.session_state["kvsim_job"] = job
        at.switch_page("pages/compare.py").run()
        assert at.button(key="cmp_run").disabled
        assert "started on the Simulate page is running" in at.info[0].value
    finally:
        job.cancel()
        job.wait(10)
    at.run()
    assert not at.button(key="cmp_run").disabled


# ---- Memory ----------------------------------------------------------------------------------
def test_memory_page_charts_the_pool(simulated, expected):
    simulated.switch_page("pages/memory.py").run()
    assert not errors(simulated)
    s = expected.summary
    assert metric(simulated, "KV pool (blocks of 16 tokens)") == "300"
    assert metric(simulated, "KV util mean") == fmt_share(s["kv_util_mean"])
    assert metric(simulated, "KV util max") == fmt_share(s["kv_util_max"])
    pool = chart(simulated, "Block pool over time")["data"][0]
    codes = values(pool["z"])
    assert codes.shape == (120, 200) and set(np.unique(codes)) <= {0, 1, 2, 3}
    assert (codes == 3).any() and (codes == 0).any()   # some live tokens, some free blocks
    util = chart(simulated, "KV utilization")["data"][0]
    assert 0 < values(util["y"]).max() <= s["kv_util_max"] + 1e-9


def test_memory_page_reads_a_cli_run_directory(tmp_path):
    result = run_simulation(load_config(None, SMALL), tmp_path / "run")
    at = app()
    at.switch_page("pages/memory.py").run()
    at.selectbox(key="mem_pick").set_value("Load a run directory...").run()
    at.text_input(key="mem_run_dir").set_value(str(tmp_path / "nowhere")).run()
    [message] = errors(at)
    assert "nowhere: not a directory" in message
    at.text_input(key="mem_run_dir").set_value(str(tmp_path / "run")).run()
    assert not errors(at)
    assert metric(at, "Fragmentation mean") == fmt_share(result.summary["fragmentation_mean"])
    assert metric(at, "Fragmentation p99") == fmt_share(result.summary["fragmentation_p99"])


PER_HEAD = {"trace": "sharegpt-8k-filtered", "gpu": "l4", "trace_options.max_requests": 40, "kv.policy": "h2o", "kv.budget": 128,
            "kv.layout": "per_head", "kv.slot_strategy": "slot_reuse", "kv.mode": "fast"}


def per_head_config(at: AppTest, prefix: str) -> None:
    at.selectbox(key=f"{prefix}trace_name").set_value("sharegpt-8k-filtered")
    at.selectbox(key=f"{prefix}gpu").set_value("L4")
    at.text_input(key=f"{prefix}max_requests").set_value("40")
    for name in ("policy", "layout", "slot_strategy", "mode"):
        at.selectbox(key=f"{prefix}kv.{name}").set_value(PER_HEAD[f"kv.{name}"])
    at.text_input(key=f"{prefix}kv.budget").set_value("128")


@pytest.fixture(scope="module")
def per_head(module_root):
    """An H2O + slot_reuse per-head run (fast mode) simulated directly and on the Simulate page."""
    result = run_simulation(load_config(None, PER_HEAD))
    at = app()
    at.kvsim_root = module_root
    per_head_config(at, "cfg_")
    at.run()
    at.button(key="sim_run").click().run()
    assert not errors(at)
    return result, at


def test_an_interrupted_run_is_marked_partial_on_every_page(tmp_path):
    """A run stopped by Ctrl-C (summary.json partial: true) was shown as if complete: its headline
    said max_requests=200 with 23 requests arrived and no word of the interruption."""
    steps = [0]

    def ctrl_c(progress):
        steps[0] += 1
        if steps[0] == 50:
            raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        run_simulation(load_config(None, {"trace_options.max_requests": 200, "fast_forward": False}),   # step by step
                       tmp_path / "stopped", progress=ctrl_c)
    s = json.loads((tmp_path / "stopped" / "summary.json").read_text())
    expected = (f"stopped: partial result (interrupted (Ctrl-C)): the run stopped after {s['num_requests']} requests "
                f"of the workload's 200 had arrived, {s['num_finished']} finished; every figure covers the run up to then.")
    for page in ("simulate", "memory", "timeseries"):
        at = AppTest.from_file(APP, default_timeout=TIMEOUT)
        at.query_params["run"] = "stopped"
        at.switch_page(f"pages/{page}.py").run()
        assert expected in [w.value for w in at.warning], page
    at.switch_page("pages/compare.py").run()
    at.multiselect(key="cmp_selected").set_value(["stopped"]).run()
    assert expected in [w.value for w in at.warning]


def test_a_damaged_run_directory_is_an_error_naming_its_file_not_a_crash(tmp_path):
    """One run directory whose summary.json was cut short (newest, so selected) crashed Simulate,
    Memory and Time series with an exception box, and Compare as soon as it was selected."""
    import os
    run_simulation(load_config(None, {"trace_options.max_requests": 10}), tmp_path / "good")
    (tmp_path / "damaged").mkdir()
    for name in ("requests.parquet", "steps.parquet"):
        (tmp_path / "damaged" / name).write_bytes((tmp_path / "good" / name).read_bytes())
    (tmp_path / "damaged" / "summary.json").write_text('{"num_requests": 10, "num_fini')
    os.utime(tmp_path / "good" / "summary.json", (1e9, 1e9))            # the damaged run is the newest
    message = f"{tmp_path / 'damaged' / 'summary.json'}:1: not valid JSON"
    for page in ("simulate", "memory", "timeseries"):
        at = app()
        at.switch_page(f"pages/{page}.py").run()
        assert errors(at)[0].startswith(message), page
        pick = next(s for s in at.selectbox if s.key and s.key.endswith("pick"))
        pick.set_value("good").run()
        assert not errors(at) and at.get("plotly_chart"), page
    at.switch_page("pages/compare.py").run()
    at.multiselect(key="cmp_selected").set_value(["damaged", "good"]).run()
    assert [e.startswith(f"damaged: {message}") for e in errors(at)] == [True]
    assert list(frame_with(at, "TTFT p99 ms")["run"]) == ["good"]
    # valid JSON, but not what a kvsim run writes: a KeyError and a TypeError on Simulate and Memory
    summary = json.loads((tmp_path / "good" / "summary.json").read_text())
    for text, why in (("{}", "no num_requests, num_finished, num_rejected"),
                      (json.dumps({**summary, "ttft_p50_s": "n/a"}), "ttft_p50_s: expected a number or null")):
        (tmp_path / "damaged" / "summary.json").write_text(text)
        for page in ("simulate", "memory"):
            at = app()
            at.query_params["run"] = "damaged"
            at.switch_page(f"pages/{page}.py").run()
            assert [e.startswith(f"{tmp_path / 'damaged' / 'summary.json'}: {why}") for e in errors(at)] == [True]


def test_memory_page_draws_a_per_head_run_against_its_pages(per_head):
    result, at = per_head
    at.switch_page("pages/memory.py").run()
    assert not errors(at)
    steps, s = result.steps, result.summary
    pages = int((steps.blocks_used + steps.blocks_free).max())
    assert pages == (result.num_gpu_blocks - 1) * 32 * 8       # Llama-3.1-8B: 32 layers x 8 KV heads; null block
    util = chart(at, "KV utilization")["data"]
    used = values(util[0]["y"])
    binned = bin_steps(steps, 200)
    np.testing.assert_allclose(used, binned["blocks_used"] / pages)
    assert 0 < used.max() <= s["kv_util_max"] + 1e-9 <= 1
    np.testing.assert_allclose(values(util[1]["y"]), binned["fragmentation"])
    pool = chart(at, "Block pool over time")
    assert "256 (layer, KV head) rows" in pool["layout"]["title"]["text"]
    codes = values(pool["data"][0]["z"])
    live, allocated = (codes == 3).sum(axis=0), (codes >= 2).sum(axis=0)
    busy = allocated >= 20                                     # columns with enough rows to measure a share
    map_fragmentation = 1 - live[busy] / allocated[busy]
    assert np.abs(map_fragmentation - binned["fragmentation"][busy]).max() < 0.1
    assert map_fragmentation.mean() == pytest.approx(s["fragmentation_mean"], abs=0.1) and s["fragmentation_mean"] > 0.3
    assert "Per-head layout" in at.info[0].value


def test_compare_page_shares_of_a_per_head_run_stay_within_the_pool(per_head):
    result, at = per_head
    at.switch_page("pages/compare.py").run()
    label = next(o for o in at.multiselect(key="cmp_selected").options if "h2o" in o)
    at.multiselect(key="cmp_selected").set_value([label]).run()
    assert not errors(at)
    util = chart(at, "KV utilization")["data"][0]
    assert values(util["y"]).max() == pytest.approx(
        bin_steps(result.steps, 200)["blocks_used"].max() / ((result.num_gpu_blocks - 1) * 256))


# ---- Compare ---------------------------------------------------------------------------------
def test_compare_block_sizes_side_by_side():
    at = app()
    at.switch_page("pages/compare.py").run()
    small_config(at, "cfg_")
    at.selectbox(key="cmp_axis").set_value("engine.block_size").run()
    at.text_input(key="cmp_text_engine.block_size").set_value("16, abc").run()
    assert "Block size: 'abc' is not a number" in errors(at)[0]
    at.text_input(key="cmp_text_engine.block_size").set_value("16, 24").run()
    assert "block_size must be a power of two" in errors(at)[0]
    at.text_input(key="cmp_text_engine.block_size").set_value("16, 32").run()
    assert not errors(at)
    at.button(key="cmp_run").click().run()
    assert not errors(at)
    table = frame_with(at, "TTFT p99 ms")
    assert list(table["run"]) == ["engine.block_size=16", "engine.block_size=32"]
    assert list(frame_with(at, "engine.block_size")["engine.block_size"]) == ["16", "32"]   # what differs
    direct = run_simulation(load_config(None, {**SMALL, "engine.block_size": 32})).summary
    row = table.set_index("run").loc["engine.block_size=32"]
    assert row["TTFT p99 ms"] == pytest.approx(direct["ttft_p99_s"] * 1e3)
    assert row["fragmentation mean"] == pytest.approx(direct["fragmentation_mean"])
    cdf = chart(at, "TTFT CDF")
    assert [t["name"] for t in cdf["data"]] == ["engine.block_size=16", "engine.block_size=32"]


def test_a_pool_sized_from_memory_shows_its_block_count_not_none():
    """Compare's table of what differs, and every headline, show the KV pool a run used: a run whose
    pool was sized from GPU memory (engine.num_gpu_blocks unset) showed `num_gpu_blocks None`."""
    from kvsim.dashboard.data import config_headline, record_from_result, used_config
    cfg = load_config(None, {"trace": "azure-conv-2023", "trace_options.max_requests": 20})
    assert cfg.engine.num_gpu_blocks is None
    run = record_from_result(run_simulation(cfg), cfg, "memory-sized")
    blocks = run.summary["num_gpu_blocks"]
    assert blocks > 0 and used_config(run)["engine.num_gpu_blocks"] == blocks
    assert f"num_gpu_blocks={blocks}" in config_headline(run)


def test_compare_values_are_read_as_the_form_reads_numbers():
    """The values field refused 5e2 and 2.0 for a whole-number key ('is not an integer') while every
    number field of the form reads them (docs/dashboard.md); nan and inf are refused, named as the page names the key."""
    at = app()
    at.switch_page("pages/compare.py").run()
    at.selectbox(key="cmp_axis").set_value("engine.max_num_seqs").run()
    at.text_input(key="cmp_text_engine.max_num_seqs").set_value("5e2, 1_000, 64.0").run()
    assert not errors(at) and at.button(key="cmp_run").label == "Run 3 simulations"
    at.text_input(key="cmp_text_engine.max_num_seqs").set_value("64, 2.5").run()
    assert errors(at) == ["max_num_seqs: 2.5 is not a whole number"]
    at.selectbox(key="cmp_axis").set_value("trace_options.rate_scale").run()
    at.text_input(key="cmp_text_trace_options.rate_scale").set_value("1, inf").run()
    assert errors(at) == ["Arrival-rate scale: 'inf' is not a finite number"]
    assert at.button(key="cmp_run").disabled


# ---- Capacity --------------------------------------------------------------------------------
def test_capacity_search_then_reload_its_store(tmp_path):
    at = app()
    at.switch_page("pages/capacity.py").run()
    small_config(at, "cfg_", requests=40, blocks=2000)
    at.radio(key="cap_load").set_value("first").run()
    at.text_input(key="cap_slo").set_value("ttft_p99<=fast").run()
    assert "ttft_p99" in errors(at)[0]
    at.text_input(key="cap_slo").set_value("ttft_p99<=500ms").run()
    at.number_input(key="cap_evals").set_value(4)
    at.text_input(key="cap_store").set_value(str(tmp_path / "store"))
    at.button(key="cap_run").click().run()
    assert not errors(at)
    answers = frame_with(at, "boundary found")
    assert list(answers["gpu"]) == ["H100-SXM"]
    assert {"Capacity curve", "Cost per million output tokens (USD)"} <= {
        c["layout"]["title"]["text"] for c in charts(at)}
    from kvsim.sim.planning.sweep import read_store
    store = read_store(tmp_path / "store")
    assert len(store) == 4 or answers["boundary found"][0]
    at.radio(key="cap_source").set_value("Load a sweep store").run()
    at.text_input(key="cap_path").set_value(str(tmp_path)).run()
    assert "not a sweep store" in errors(at)[0]
    at.text_input(key="cap_path").set_value(str(tmp_path / "store")).run()
    assert not errors(at)
    curve = chart(at, "Capacity curve")["data"][0]
    assert len(values(curve["x"])) == len(store)
    best = at.dataframe[-2].value   # best-first table, then "All points"
    assert (best["ttft_p99_s"] <= 0.5).all()
    assert best["usd_per_m_output_tok"].is_monotonic_increasing


def test_capacity_page_cheapest_configuration_with_one_slo_and_stale_marking():
    at = app()
    at.switch_page("pages/capacity.py").run()
    small_config(at, "cfg_", requests=40, blocks=2000)      # the shared base form (forms.BASE)
    at.radio(key="cap_load").set_value("first").run()
    assert at.number_input(key="cap_evals").value == 24                   # the CLI's --max-evals
    at.radio(key="cap_mode").set_value("plan").run()
    at.multiselect(key="cap_tps").set_value([1, 2])
    at.text_input(key="cap_slo").set_value("ttft_p99<=2s, tpot_p99<=100ms")
    at.button(key="cap_run").click().run()
    assert not errors(at)
    assert any("Llama-3.1-8B: H100-SXM TP1 x 1 replicas" in m.value for m in at.success)
    assert "Views judged against the SLO ttft_p99<=2s, tpot_p99<=100ms" in [c.value for c in at.caption]
    assert not any(w.value.startswith("Stale") for w in at.warning)
    at.text_input(key="cap_slo").set_value("ttft_p99<=1ms").run()
    stale = [w.value for w in at.warning if w.value.startswith("Stale")]
    assert stale and "ttft_p99<=2s, tpot_p99<=100ms" in stale[0]
    # the views keep the search's SLO until it runs again
    assert "Views judged against the SLO ttft_p99<=2s, tpot_p99<=100ms" in [c.value for c in at.caption]


def test_capacity_search_cancels_within_a_second():
    import time
    from kvsim.dashboard.jobs import Job, capacity_search_task
    from kvsim.sim.planning.capacity import parse_slo
    base = load_config(None, {"trace_options.max_requests": 19_366})       # seconds per simulation
    job = Job(task=capacity_search_task(base, ["H100-SXM"], parse_slo("ttft_p99<=2s"), "rate", 8, None),
              page="Capacity").start()
    while not job.done and not (job.progress is not None and job.progress.tokens_done > 0):
        time.sleep(0.02)
    job.cancel()
    job.wait(5)
    assert job.done and job.finished - job.cancel_time < 1.0
    assert job.error == "cancelled" and job.run_done == 0                  # stopped inside the first simulation


def test_configuration_survives_navigation():
    at = app()
    at.text_input(key="cfg_max_requests").set_value("77")
    at.selectbox(key="cfg_gpu").set_value("L4")
    at.selectbox(key="cfg_kv.policy").set_value("h2o").run()
    at.switch_page("pages/memory.py").run()
    at.switch_page("pages/simulate.py").run()
    assert not errors(at)
    assert at.text_input(key="cfg_max_requests").value == "77" and at.selectbox(key="cfg_gpu").value == "L4"
    assert at.selectbox(key="cfg_kv.policy").value == "h2o"


def test_configuration_survives_switching_between_pages_that_show_the_form():
    """Simulate -> Compare -> Simulate directly (no page without the form in between) put the form
    back to its defaults, in AppTest and in Chromium: the same key on another page is another widget."""
    at = app()
    at.text_input(key="cfg_max_requests").set_value("77")
    at.selectbox(key="cfg_gpu").set_value("L4")
    at.selectbox(key="cfg_engine.enable_prefix_caching").set_value("off").run()
    for page in ("compare", "simulate", "capacity", "compare"):
        at.switch_page(f"pages/{page}.py").run()
        assert not errors(at), page
        assert at.text_input(key="cfg_max_requests").value == "77" and at.selectbox(key="cfg_gpu").value == "L4", page
        assert at.selectbox(key="cfg_engine.enable_prefix_caching").value == "off", page
    at.text_input(key="cfg_max_requests").set_value("90").run()      # an edit on the new page sticks
    at.switch_page("pages/simulate.py").run()
    assert at.text_input(key="cfg_max_requests").value == "90"


def test_capacity_gpu_choice_survives_navigation():
    at = app()
    at.switch_page("pages/capacity.py").run()
    at.multiselect(key="cap_gpus").set_value(["H100-SXM", "L4"]).run()
    at.switch_page("pages/simulate.py").run()
    at.switch_page("pages/capacity.py").run()
    assert at.multiselect(key="cap_gpus").value == ["H100-SXM", "L4"]


def test_a_replay_run_offers_the_replay_command_that_reruns_it(small_crosscheck, monkeypatch, tmp_path):
    """A real-backend replay's directory (here the cross-check's) was offered `kvsim simulate -c ...`,
    which simulates instead of replaying; it gets `kvsim replay` with the replay's own options."""
    import shlex

    from typer.testing import CliRunner

    from kvsim.sim.cli import app as cli
    monkeypatch.setenv(DATA_ROOT_ENV, str(small_crosscheck.parent))
    at = app()
    at.query_params["run"] = "cc/real"
    at.switch_page("pages/memory.py").run()
    assert not errors(at)
    command = next(c.value for c in at.code if c.value.startswith("kvsim "))
    words = shlex.split(command)
    assert words[:2] == ["kvsim", "replay"] and "--clock cpu" in command and "--threads 1" in command
    out = tmp_path / "rerun"
    words[words.index("--out") + 1] = str(out)
    torch = pytest.importorskip("torch")
    threads = torch.get_num_threads()
    try:
        result = CliRunner().invoke(cli, [*words[1:], "-q"])
    finally:
        torch.set_num_threads(threads)
    assert result.exit_code == 0, result.output
    again = json.loads((out / "summary.json").read_text())
    first = json.loads((small_crosscheck / "real" / "summary.json").read_text())
    assert again["replay"] == first["replay"] and again["num_finished"] == first["num_finished"] == 3


def test_time_series_of_a_replay_prices_the_model_it_ran(small_crosscheck, monkeypatch):
    """A replay's time-series panels rebuilt the catalog model (bf16; all layers even for --layers N):
    MBU of an fp32 CPU replay halved, and 251% MFU with terms stacking to 945% for a 2-layer replay.
    Its terms now add up to the replay's own predicted_s, and the page says what they mean."""
    from kvsim.dashboard.data import TIME_TERMS, load_run_dir, run_cost_model, step_costs
    run = load_run_dir(small_crosscheck / "real")
    assert run.summary["dtype"] == "float32"
    costs = step_costs(run.steps, run_cost_model(run))
    predicted = sum(costs[f"t_{term}"] for term in TIME_TERMS if term != "rest")
    np.testing.assert_allclose(predicted, run.steps["predicted_s"], rtol=1e-9)
    monkeypatch.setenv(DATA_ROOT_ENV, str(small_crosscheck.parent))
    at = AppTest.from_file(APP, default_timeout=TIMEOUT)
    at.query_params["run"] = "cc/real"
    at.switch_page("pages/timeseries.py").run()
    assert not errors(at) and any(i.value.startswith("A real-backend replay") for i in at.info)


# ---- Fidelity --------------------------------------------------------------------------------
def test_fidelity_page_measures_prediction_error(tmp_path, expected):
    replay = expected.steps.copy()
    replay["duration_s"] = replay["predicted_s"] * 1.25      # measured 25% slower than predicted
    replay.to_parquet(tmp_path / "steps.parquet")
    pd.DataFrame({"duration_s": [1.0]}).to_parquet(tmp_path / "bad_steps.parquet")
    at = app()
    at.switch_page("pages/fidelity.py").run()
    at.text_input(key="fid_path").set_value(str(tmp_path / "bad_steps.parquet")).run()
    assert "missing column(s) predicted_s" in errors(at)[0]
    at.text_input(key="fid_path").set_value(str(tmp_path / "steps.parquet")).run()
    assert not errors(at)
    assert metric(at, "Per-step time MAPE") == "20.0%"
    assert metric(at, "Total predicted / measured") == "0.800"
    scatter = chart(at, "Predicted vs measured")
    assert sum(len(values(t["x"])) for t in scatter["data"][:-1]) == len(replay)


def test_fidelity_page_shows_a_crosscheck_as_its_report_does(small_crosscheck, monkeypatch):
    import re
    monkeypatch.setenv("KVSIM_DATA_ROOT", str(small_crosscheck.parent))
    report = (small_crosscheck / "report.md").read_text()
    at = app()
    at.switch_page("pages/fidelity.py").run()
    at.text_input(key="fid_path").set_value("cc").run()
    assert not errors(at)
    mape = re.search(r"per-step time MAPE: \*\*([0-9.]+%)\*\*", report).group(1)
    total = re.search(r"cost model on the replay's own batches [0-9.]+ s \(([+-][0-9.]+%)\)", report).group(1)
    assert metric(at, "Per-step time MAPE") == mape
    assert metric(at, "Step time, model vs measured") == total
    ttft = re.search(r"TTFT p50 error: \*\*([0-9.]+%)\*\*", report).group(1)
    figures = json.loads((small_crosscheck / "crosscheck.json").read_text())
    signed = next(r["rel_error"] for r in figures["latency"] if r["metric"] == "ttft" and r["percentile"] == 50)
    assert metric(at, "TTFT p50 error") == f"{signed:+.1%}" and metric(at, "TTFT p50 error").lstrip("+-") == ttft
    table = frame_with(at, "median_bias_%").set_index("group")
    rows = re.findall(r"^\| (prefill|decode|mixed|all) \| (\d+) \| ([0-9.]+)% \| [0-9.]+% \| [0-9.]+% \| "
                      r"([+-][0-9.]+)% \|$", report, re.M)
    assert len(rows) >= 2
    for kind, steps, ape, bias in rows:
        row = table.loc["all steps" if kind == "all" else f"{kind} steps"]
        assert (row["steps"], f"{row['MAPE_%']:.1f}", f"{row['median_bias_%']:+.1f}") == (int(steps), ape, bias)
    at.text_input(key="fid_path").set_value("cc/step_times.parquet").run()     # the report's table itself
    assert not errors(at) and metric(at, "Per-step time MAPE") == mape
    # the replay's own step log prices the steps with the profile the replay ran with: not the report's figures
    at.text_input(key="fid_path").set_value("cc/real/steps.parquet").run()
    assert "part of a cross-check" in at.info[0].value


# ---- data shaping ----------------------------------------------------------------------------
def test_binning_keeps_event_totals_and_pool_size(expected):
    steps = expected.steps
    b = bin_steps(steps, 37)
    assert len(b) == 37
    for col in ("prefill_tokens", "decode_tokens", "preemptions", "bytes_moved"):
        assert b[col].sum() == pytest.approx(steps[col].sum())
    assert (b["blocks_used"] <= 300 + 1e-9).all()
    codes, edges = pool_map(b, 300, 16, rows=60)
    used_rows = (codes >= 2).sum(axis=0) * 5            # 5 blocks per row
    assert np.all(np.abs(used_rows - b["blocks_used"].to_numpy()) <= 5)


def test_fidelity_table_and_pareto():
    steps = pd.DataFrame({"duration_s": [1.0, 2.0, 4.0, 1.0], "predicted_s": [1.1, 1.8, 4.0, np.nan],
                          "num_prefill_seqs": [1, 0, 1, 0], "num_decode_seqs": [0, 2, 3, 1],
                          "batch_size": [1, 2, 4, 1]})
    t = fidelity_table(steps).set_index("group")
    assert t.loc["all steps", "steps"] == 3
    assert t.loc["all steps", "MAPE_%"] == pytest.approx(100 * (0.1 + 0.1 + 0) / 3)
    assert t.loc["all steps", "median_bias_%"] == pytest.approx(0.0)
    assert t.loc["prefill steps", "steps"] == 1 and t.loc["mixed steps", "steps"] == 1
    df = pd.DataFrame({"cost": [1.0, 2.0, 2.0, 3.0], "good": [5.0, 4.0, 7.0, 6.0]})
    assert list(pareto_front(df, "cost", "good")) == [True, False, True, False]


def test_background_job_reports_progress_with_eta_and_cancels_within_a_second():
    import time
    from kvsim.dashboard.jobs import Job
    # long enough (~10 s) for the ETA (after 3 s) to show: stepped one by one, since with the decode
    # fast-forward the whole trace now takes ~4 s and can end before three partway readings
    cfg = load_config(None, {"trace": "azure-conv-2023", "fast_forward": False})
    job = Job([("long", cfg)]).start()
    seen = []
    while not job.done and len(seen) < 3:
        time.sleep(0.05)
        p = job.progress
        if p is not None and 0 < job.fraction < 1 and job.eta_s is not None:
            seen.append((p.tokens_done, job.fraction))
    assert len(seen) == 3, "no partway progress seen"
    assert [f for _, f in seen] == sorted(f for _, f in seen)            # moves forward with the tokens computed
    assert seen[0][1] == pytest.approx(seen[0][0] / job.progress.tokens_total, abs=0.01)
    assert "tokens" in job.status_text() and "left" in job.status_text()
    job.cancel()
    job.wait(5)
    assert job.done and job.finished - job.cancel_time < 1.0
    assert job.error == "cancelled" and job.records == []


@pytest.mark.parametrize("address, local", [("127.0.0.1", True), ("localhost", True), ("::1", True),
                                            ("0.0.0.0", False), ("", False), ("192.168.1.20", False)])
def test_exposure_is_flagged_for_non_local_addresses(address, local):
    from kvsim.dashboard.server import is_local_address
    assert is_local_address(address) is local


def test_dashboard_command_warns_when_exposed_and_passes_the_data_root(monkeypatch, tmp_path):
    import os
    from typer.testing import CliRunner
    from kvsim.sim.cli import app as kvsim
    started = []
    monkeypatch.setattr(os, "execv", lambda path, argv: started.append(argv))
    out = CliRunner().invoke(kvsim, ["dashboard", "--address", "0.0.0.0", "--data-root", str(tmp_path)])
    assert out.exit_code == 0 and "WARNING: the dashboard is bound to 0.0.0.0" in out.output
    assert os.environ["KVSIM_DATA_ROOT"] == str(tmp_path.resolve())
    assert started and started[0][started[0].index("--client.toolbarMode") + 1] == "minimal"
    out = CliRunner().invoke(kvsim, ["dashboard", "--data-root", str(tmp_path)])
    assert "WARNING" not in out.output


def test_dashboard_command_refuses_a_data_root_that_is_a_file(monkeypatch, tmp_path):
    import os
    from typer.testing import CliRunner
    from kvsim.sim.cli import app as kvsim
    started = []
    monkeypatch.setattr(os, "execv", lambda path, argv: started.append(argv))
    (tmp_path / "runs.txt").write_text("not a directory")
    out = CliRunner().invoke(kvsim, ["dashboard", "--data-root", str(tmp_path / "runs.txt")])
    assert out.exit_code == 2 and "--data-root" in out.output and "not a directory" in out.output
    assert not started                      # no server started on a file


def test_capacity_store_with_a_malformed_capacity_json_is_one_message(tmp_path):
    """The Capacity page's store reader: an edited capacity.json was a KeyError in the page; now a
    message naming the file and the field."""
    from kvsim.dashboard.data import DataError, read_sweep_store
    from kvsim.sim.planning.capacity import CapacitySearch, find_capacity, parse_slo
    find_capacity(load_config(None, {**SMALL, "trace_options.max_requests": 20}), parse_slo("ttft_p99<=1s"),
                  CapacitySearch(max_evals=1), store=tmp_path)
    assert read_sweep_store(tmp_path)[2]["mode"] == "rate"
    (tmp_path / "capacity.json").write_text('{"slo": 5}')
    with pytest.raises(DataError, match=r"capacity\.json: mode: expected 'rate' or 'replicas'"):
        read_sweep_store(tmp_path)


def test_eta_follows_the_recent_pace_of_tokens_and_simulated_time():
    """A run that slowed down (long contexts, a queue) is not promised its early pace: the time left
    is the larger of the tokens left at the recent token rate and the simulated time left to the last
    arrival at the recent pace of simulated time (issue 51: '2 min left' when 4 min 15 s remained)."""
    import time as clock

    from kvsim.dashboard.jobs import Job
    from kvsim.sim.io.progress import SimProgress

    job = Job([("slowing", SimConfig())])
    now = clock.perf_counter()
    job.started = now - 100
    # 8 tokens/s for 50 s, then 2 tokens/s: 500 of 1,000 tokens done after 100 s; 3 simulated s per s
    job._samples = [(now - 100 + t, 8 * t if t <= 50 else 400 + 2 * (t - 50), 3.0 * t) for t in range(0, 101, 5)]
    p = SimProgress(tokens_total=1000, requests_total=10, tokens_done=500, sim_time_s=300.0)
    p.started = now - 100
    job.progress = p
    assert job.elapsed_s * 0.5 / 0.5 == pytest.approx(100, rel=0.01)   # the whole run's pace: 100 s left
    assert job.eta_s == pytest.approx(500 / 2, rel=0.01)                # the recent pace: 250 s left
    job.arrivals_end_s = 1000.0          # 700 simulated s left at 3 per s: 233 s, fewer than the tokens' 250
    assert job.eta_s == pytest.approx(250, rel=0.01)
    job.arrivals_end_s = 3000.0          # arrivals until 3,000 s: 2,700 simulated s left, 900 s
    assert job.eta_s == pytest.approx(2700 / 3, rel=0.01)


def test_capacity_stop_reason_and_range_and_compare_deltas(tmp_path):
    from kvsim.dashboard.data import capacity_bracket, capacity_stop_reason, deltas_against
    from kvsim.sim.planning.capacity import CapacityResult, CapacitySearch

    curve = pd.DataFrame({"searched_value": [1.0, 2.0, 4.0, 3.0], "meets_slo": [True, True, False, False]})
    result = CapacityResult("rate", ["ttft_p99<=2s"], True, True, 2.0, 1.0, "r2", {}, curve)
    assert capacity_bracket(result) == (2.0, 3.0)
    assert "simulation limit (4) was reached with the bracket [2, 3] still open" in capacity_stop_reason(
        result, CapacitySearch(max_evals=4))
    assert "closed within the search's tolerance" in capacity_stop_reason(
        result, CapacitySearch(max_evals=24, rel_tol=0.6))
    open_top = CapacityResult("rate", [], True, False, 4.0, 1.0, "r", {}, curve.assign(meets_slo=True))
    assert "lower bound" in capacity_stop_reason(open_top, CapacitySearch(max_evals=4))
    table = pd.DataFrame({"run": ["a", "b"], "TTFT p99 ms": [100.0, 150.0], "preemptions": [0.0, 3.0]})
    d = deltas_against(table, "a")
    assert list(d["run"]) == ["b"] and d["TTFT p99 ms"].iloc[0] == pytest.approx(50.0)
    assert np.isnan(d["preemptions"].iloc[0])                           # against 0: no percentage
