"""SpvLLM's fragmentation with real attention (bench/spvllm_real_attention.py) and where a p99 at a budget
above most requests comes from (the run's tail)."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def real():
    return _load("spvllm_real_attention")


@pytest.fixture(scope="module")
def smollm2_one_layer(request):
    pytest.importorskip("torch")
    request.getfixturevalue("one_thread")            # conftest: one torch thread for this module
    from kvsim.gpu.replay import ReplayOptions, build_model

    from kvsim.sim.config import load_config

    return build_model(load_config(None, {"model": "smollm2-135m"}), ReplayOptions(layers=1))


def test_real_attention_fragmentation_is_the_simulators_on_the_same_step_log(real, smollm2_one_layer):
    from kvsim.gpu.replay import model_spec_for
    from kvsim.sim.model.catalog import get_model

    trace = real.spvllm_trace(2, max_len=160)
    assert len(trace.df) == 2 and (trace.df["prompt_tokens"] + trace.df["output_tokens"] > 32).all()
    spec = model_spec_for(smollm2_one_layer.config, get_model("smollm2-135m"), smollm2_one_layer.dtype)
    p99 = {}
    for strategy in ("noop", "slot_reuse"):
        rep = real.real_run(trace, 32, strategy, "per-step", smollm2_one_layer)
        steps = rep.steps
        assert steps["evicted_tokens"].sum() > 0
        alloc = steps["allocated_slots"].to_numpy()
        np.testing.assert_allclose(steps["fragmentation"][alloc > 0],
                                   1 - steps["live_slots"][alloc > 0] / alloc[alloc > 0])
        assert real.step_p99(steps) == pytest.approx(rep.summary["fragmentation_p99"], abs=1e-12)
        sim = real.sim_run(trace, 32, strategy, "per-step", "smollm2-135m-aged", spec)
        assert real.step_p99(sim.steps) == pytest.approx(sim.summary["fragmentation_p99"], abs=1e-12)
        np.testing.assert_array_equal(sim.steps["batch_size"], steps["batch_size"])     # the same steps
        p99[strategy] = real.step_p99(steps)
    assert p99["slot_reuse"] < 0.5 * p99["noop"]          # one in, one out: the holes are refilled


def test_compare_prints_every_strategy_for_real_attention_and_the_models(real, smollm2_one_layer, capsys):
    trace = real.spvllm_trace(2, max_len=160)
    res = real.compare(trace, 32, "code", layers=1, log=lambda *a, **k: None)
    real.print_table(res, trace, 32, "code")
    out = capsys.readouterr().out
    assert set(res) == set(real.STRATEGIES)
    for row in res.values():
        assert set(row) >= {"real", *real.MODELS}
        assert all(0 <= row[c] < 1 for c in ("real", *real.MODELS))
    assert res["slot_reuse"]["real"] <= res["noop"]["real"]
    assert "slot_reuse / noop" in out and "smollm2-135m-aged" in out


def test_a_budget_above_most_requests_the_tail_decides_the_p99():
    """SpvLLM's setting at budget 1,024 in miniature: most requests stay under the budget, one outlives
    them and decodes alone past it. Its steps are the p99: noop and free_block keep the scattered holes
    (1 - budget / length), slot_reuse refills one hole per step and stays at the budget."""
    from kvsim.sim.config import load_config
    from kvsim.sim.simulator.simulate import run_simulation
    from kvsim.traces.trace import Trace

    n = 40
    prompts, outputs = np.full(n, 60), np.full(n, 40)
    outputs[-1] = 400                                      # 60 + 400 tokens, budget 128
    trace = Trace.from_columns(arrival_time_s=np.zeros(n), prompt_tokens=prompts, output_tokens=outputs,
                               name="tail", source="synthetic")
    p99, top = {}, {}
    for strategy in ("noop", "free_block", "slot_reuse"):
        kv = {"policy": "h2o", "budget": 128, "layout": "shared", "slot_strategy": strategy, "mode": "token",
              "params": {"evict_per_step": 1}}
        cfg = load_config(None, {"model": "smollm2-135m", "gpu": "t4", "kv": kv, "engine": {"max_num_seqs": 256}})
        steps = run_simulation(cfg, trace=trace).steps
        frag = steps["fragmentation"].to_numpy()
        p99[strategy] = float(np.percentile(frag, 99))
        top[strategy] = steps[frag >= p99[strategy]]
    assert (top["noop"]["batch_size"] == 1).all() and (top["noop"]["live_slots"] == 128).all()
    assert p99["noop"] == pytest.approx(1 - 128 / 16 / -(-459 // 16), abs=0.02)
    assert p99["free_block"] > 0.5                         # scattered evictions free few whole pages
    assert p99["slot_reuse"] < 0.15                         # one in, one out: the table stays at the budget


def test_pages_wholly_evicted_counts_pages_whose_positions_are_all_evicted(real):
    import pandas as pd
    # request 0, shared layout: positions 0-15 all evicted (page 0), 16-30 not all (page 1); request 1, one
    # per_head row: 32-47 (page 2), and a duplicate decision does not count twice; "high" moves are not evictions
    rows = [(0, -1, -1, p, "evict") for p in range(31)] + [(1, 2, 0, p, "evict") for p in range(32, 48)]
    rows += [(1, 2, 0, 40, "evict"), (1, 2, 1, 5, "high")]
    df = pd.DataFrame(rows, columns=["request_id", "layer", "head", "position", "action"])
    assert real.pages_wholly_evicted(df) == 2
    assert real.pages_wholly_evicted(df, block=8) == 3 + 2
