"""kvsim's schedule against real vLLM's, recorded (tests/data/vllm_reference, see its README)."""
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvsim.sim.cli import app
from kvsim.sim.core.kv_manager import KVCacheManager
from kvsim.sim.core.request import Request
from kvsim.sim.reference.harness import (ReferenceError, check_scenario, compare_schedules, driver_spec,
                                   kvsim_schedule, load_reference, load_scenario, record_vllm)
from kvsim.sim.reference.prompts import prompt_token_ids
from kvsim.sim.reference.scenarios import SCENARIOS

DATA = Path(__file__).parent / "data" / "vllm_reference"
RECORDED = sorted(p.name for p in DATA.iterdir() if (p / "vllm_steps.parquet").exists())


def test_every_scenario_is_recorded():
    assert sorted(s.name for s in SCENARIOS) == RECORDED
    assert len(RECORDED) >= 8


@pytest.mark.parametrize("name", RECORDED)
def test_kvsim_reproduces_vllms_schedule_step_for_step(name):
    a = check_scenario(DATA / name)
    assert a.identical, f"{name}: first difference {a.first_difference}; rejected equal: {a.rejected_equal}"
    assert a.kvsim_steps == a.reference_steps > 0


def test_the_recorded_references_exercise_what_they_claim():
    steps = {name: load_reference(DATA / name) for name in RECORDED}
    assert steps["memory_pressure_preemption"][0]["preemptions"].sum() >= 1
    assert steps["priority_preemption"][0]["preemptions"].sum() >= 1
    assert steps["max_num_seqs_cap"][0]["num_running"].max() == 3
    assert len(steps["max_model_len_limits"][1]["rejected"]) == 2
    assert steps["max_model_len_limits"][0]["finished_ids"].map(len).sum() == 4
    assert steps["max_model_len_limits"][0]["scheduled_ids"].map(len).max() <= 4
    chunks = steps["long_prefill_threshold"][0]["scheduled_tokens"]
    assert any(96 in t for t in chunks)                              # capped while others wait or run
    assert max(max(t) for t in chunks) > 96                          # the lone request's chunk is not


def test_the_prefix_scenario_hits_revives_and_evicts_cached_blocks():
    cfg, trace = load_scenario(DATA / "prefix_caching_eviction")
    _, info = kvsim_schedule(cfg, trace)
    assert info["summary"]["prefix_hit_rate"] > 0.3
    assert (info["steps"]["blocks_cached"] > 0).any()          # freed prefixes stay findable
    assert info["kv"].pool.num_cache_evictions > 0             # until the allocator needs their blocks


def test_a_changed_schedule_is_reported_at_its_first_step_and_column():
    ref, _ = load_reference(DATA / "memory_pressure_preemption")
    sim = ref.copy()
    sim.loc[7, "num_waiting"] += 1
    sim.at[9, "scheduled_tokens"] = [2] + list(sim.at[9, "scheduled_tokens"])[1:]
    a = compare_schedules(ref, sim)
    assert not a.identical and a.matching_steps == 7
    assert a.first_difference["step"] == 7 and a.first_difference["column"] == "num_waiting"
    assert compare_schedules(ref, ref.iloc[:-1]).first_difference["column"] == "steps"


def test_prompt_tokens_make_vllms_block_hashes_follow_kvsims_block_keys():
    """Equal kvsim block keys <=> equal token blocks, so vLLM's prefix cache hits what kvsim's does."""
    kv = KVCacheManager(100, 32, enable_caching=True)
    reqs = [Request(i, 0.0, p, 4, prefix_hash_ids=ids, prefix_block_tokens=64)
            for i, (p, ids) in enumerate([(230, (1, 2, 3)), (250, (1, 2, 3)), (300, (1, 2, 3, 4)),
                                          (140, (10, 11)), (128, (1, 9)), (200, None)])]
    keys, blocks = {}, {}
    for r in reqs:
        tokens = prompt_token_ids(r.request_id, r.prompt_tokens, r.prefix_hash_ids, 64)
        assert len(tokens) == r.prompt_tokens and min(tokens) >= 1000
        for j in range(r.prompt_tokens // 32):
            keys[(r.request_id, j)] = kv._block_hash(r, j)
            blocks[(r.request_id, j)] = tuple(tokens[:(j + 1) * 32])      # a vLLM hash chains the prefix
    pairs = [(a, b) for a in keys for b in keys if a < b]
    assert all((keys[a] == keys[b]) == (blocks[a] == blocks[b]) for a, b in pairs)
    assert sum(keys[a] == keys[b] for a, b in pairs) > 5


def test_scenario_files_load_as_a_step_indexed_kvsim_config():
    cfg, trace = load_scenario(DATA / "staggered_arrivals")
    assert cfg.trace_options.arrival_unit == "step" and cfg.engine.async_scheduling is False
    spec = driver_spec(cfg, trace, "/nonexistent")
    assert [r["arrival_step"] for r in spec["requests"]][:4] == [0, 0, 1, 3]
    assert spec["engine"]["block_size"] == 32 and spec["engine"]["num_gpu_blocks"] == 200


def test_without_vllm_the_driver_fails_with_a_clear_message(tmp_path):
    cfg, trace = load_scenario(DATA / "closed_batch")
    with pytest.raises(ReferenceError, match="vllm"):
        record_vllm(driver_spec(cfg, trace, tmp_path), sys.executable, tmp_path)
    with pytest.raises(ReferenceError, match="no such interpreter"):
        record_vllm(driver_spec(cfg, trace, tmp_path), str(tmp_path / "nopython"), tmp_path)


def test_cli_check_replays_the_recorded_scenarios():
    result = CliRunner().invoke(app, ["reference", "check", "--dir", str(DATA)])
    assert result.exit_code == 0, result.output
    assert result.output.count("identical") == len(RECORDED) and "differs" not in result.output


def test_cli_vllm_needs_the_vllm_interpreter(monkeypatch):
    monkeypatch.delenv("KVSIM_VLLM_PYTHON", raising=False)
    result = CliRunner().invoke(app, ["reference", "vllm", "--trace", str(DATA / "closed_batch" / "trace.jsonl"),
                                      "--num-gpu-blocks", "100"])
    assert result.exit_code == 2 and "--vllm-python" in result.output


def test_cli_check_finds_the_recorded_scenarios_from_any_directory(tmp_path, monkeypatch):
    """The default --dir was tests/data/vllm_reference under the current directory: from anywhere but
    the repository root `kvsim reference check` said there were no recorded scenarios."""
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["reference", "check"])
    assert result.exit_code == 0, result.output
    assert result.output.count("identical") == len(RECORDED)
    missing = CliRunner().invoke(app, ["reference", "check", "--dir", "nope"])
    assert missing.exit_code == 2 and "--dir nope: no such directory" in missing.output


def test_cli_record_scenarios_refuses_an_unknown_name_before_anything_runs(tmp_path, monkeypatch):
    """--only with a misspelt name recorded nothing, silently, after converting the model."""
    monkeypatch.delenv("KVSIM_VLLM_PYTHON", raising=False)
    result = CliRunner().invoke(app, ["reference", "record-scenarios", "--only", "priority_preemptoin",
                                      "--out", str(tmp_path / "rec")])
    assert result.exit_code == 2 and "--only: unknown scenario 'priority_preemptoin'; known: " in result.output
    assert "priority_preemption" in result.output and not (tmp_path / "rec").exists()
