"""docs/outputs.md names every column and summary key kvsim writes (the schema reference stays true)."""
from __future__ import annotations

from pathlib import Path

import pytest

from kvsim.sim.config import load_config
from kvsim.sim.results.metrics import REQUEST_COLUMNS, STEP_COLUMNS
from kvsim.sim.simulator.simulate import run_simulation

DOC = (Path(__file__).resolve().parents[1] / "docs" / "outputs.md").read_text()


def _missing(names) -> list[str]:
    return [n for n in names if f"`{n}`" not in DOC]


def test_every_step_and_request_column_is_documented():
    assert _missing(STEP_COLUMNS) == []
    assert _missing(REQUEST_COLUMNS) == []


@pytest.mark.parametrize("kv", [{}, {"kv.policy": "h2o", "kv.budget": 64}], ids=["vanilla", "h2o"])
def test_every_summary_key_of_a_run_is_documented(kv):
    cfg = load_config(None, {"trace": "azure-conv-2023", "trace_options.max_requests": 20, "model": "smollm2-135m",
                             "gpu": "l4", **kv})
    summary = run_simulation(cfg).summary
    assert _missing(summary) == []


def test_replay_only_files_are_documented():
    from kvsim.gpu.executor import ReplayRecorder
    assert _missing(ReplayRecorder.DECISION_COLUMNS) == []
    assert _missing(ReplayRecorder.STATS_COLUMNS) == []
