"""inference-perf config files read as the workload they send (issue 47 item 9, traces/inference_perf.py)."""
import warnings

import numpy as np
import pytest
import yaml

from kvsim.sim.config import load_config
from kvsim.sim.simulator.simulate import run_simulation
from kvsim.traces import load_trace
from kvsim.traces.errors import TraceError
from kvsim.traces.loaders import detect_format

CLIENT = {"api": {"type": "completion", "streaming": True},
          "server": {"type": "vllm", "model_name": "Qwen/Qwen2.5-0.5B-Instruct", "base_url": "http://0.0.0.0:8000"}}


def config(tmp_path, load, data, name="config.yml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump({"load": load, **CLIENT, "data": data}, sort_keys=False))
    return path


SHARED = {"type": "shared_prefix", "shared_prefix": {"num_groups": 4, "num_prompts_per_group": 10,
                                                     "system_prompt_len": 640, "question_len": 100, "output_len": 30}}


def test_shared_prefix_stages_as_inference_perf_sends_them(tmp_path):
    path = config(tmp_path, {"type": "constant", "stages": [{"rate": 2, "duration": 10}, {"rate": 5, "duration": 10}]},
                  SHARED)
    assert detect_format(path) == "inference-perf"
    t = load_trace(path)
    times = t.df["arrival_time_s"].to_numpy()
    assert len(t) == 20 + 50
    np.testing.assert_allclose(times[:20], np.arange(20) / 2)                   # stage 0: every 0.5 s
    np.testing.assert_allclose(times[20:], 10 + np.arange(50) / 5)              # stage 1 from t = 10 s
    assert (t.df["prompt_tokens"] == 740).all() and (t.df["output_tokens"] == 30).all()
    heads = {tuple(ids[:40]) for ids in t.df["prefix_hash_ids"]}                # 640 tokens = 40 blocks of 16
    assert len(heads) == 4
    first40 = t.df["prefix_hash_ids"].iloc[:40].map(tuple).tolist()
    assert len(set(first40)) == 40                      # the 40 prompts once each, then again (i mod 40)
    assert t.df["prefix_hash_ids"].iloc[40:].map(tuple).tolist() == first40[:30]
    counts = {}
    for c in t.workload_classes.of_request.values():
        counts[c] = counts.get(c, 0) + 1
    assert counts == {"stage-0": 20, "stage-1": 50}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = run_simulation(load_config(None, {"trace": str(path), "model": "qwen2.5-0.5b", "gpu": "l4"}))
    assert res.summary["prefix_hit_rate"] > 0.7
    assert set(res.summary["workload_classes"]) == {"stage-0", "stage-1"}


@pytest.mark.parametrize("kind, mean, std, low, high", [("normal", 300, 100, 100, 400), ("lognormal", 300, 150, 50, 2000),
                                                        ("uniform", 300, 0, 100, 500)])
def test_random_lengths_are_drawn_clipped_and_cycled(tmp_path, kind, mean, std, low, high):
    dist = {"min": low, "max": high, "mean": mean, "std_dev": std, "total_count": 5000, "type": kind}
    path = config(tmp_path, {"type": "poisson", "stages": [{"rate": 100, "duration": 60}], "base_seed": 3},
                  {"type": "random", "input_distribution": dist, "output_distribution": {**dist, "total_count": 5000}})
    t = load_trace(path)
    p = t.df["prompt_tokens"].to_numpy()
    assert len(t) == 6000 and low <= p.min() and p.max() <= high
    np.testing.assert_array_equal(p[5000:], p[:1000])                            # the pool of 5,000, cycled
    # N(300, 100) clipped to [100, 400]: a Phi(-2) + b (1 - Phi(1)) + mu (Phi(1) - Phi(-2)) + sigma (phi(-2) - phi(1))
    expected = {"normal": 292.5, "lognormal": 300, "uniform": 300.5}[kind]
    assert p[:5000].mean() == pytest.approx(expected, rel=0.03)
    gaps = np.diff(t.df["arrival_time_s"].to_numpy())
    assert gaps.mean() == pytest.approx(0.01, rel=0.05) and gaps.std() / gaps.mean() == pytest.approx(1, abs=0.08)
    assert load_trace(path).df.equals(t.df)                                      # base_seed: the same trace


def test_a_concurrent_load_runs_closed_loop(tmp_path):
    path = config(tmp_path, {"type": "concurrent", "stages": [{"concurrency_level": 3, "num_requests": 24}]},
                  {"type": "random", "input_distribution": {"min": 50, "max": 50, "mean": 50, "type": "fixed"},
                   "output_distribution": {"min": 20, "max": 20, "mean": 20, "type": "fixed"}})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = run_simulation(load_config(None, {"trace": str(path), "model": "qwen2.5-0.5b", "gpu": "l4"}))
    assert res.summary["num_requests"] == 24 and res.summary["max_concurrent_requests"] == 3


@pytest.mark.parametrize("load, data, message", [
    ({"type": "constant", "stages": [{"rate": 2, "duration": 5}]}, {"type": "shareGPT", "path": "x.json"},
     "data type 'shareGPT' is a dataset or trace replay"),
    ({"type": "poisson", "stages": [{"rate": 2}]}, SHARED, "stage 0: a poisson load needs rate and duration"),
    ({"type": "constant", "stages": [{"rate": 2, "duration": 5}]},
     {"type": "random", "input_distribution": {"min": 10, "max": 5, "mean": 7}, "output_distribution": {"mean": 5}},
     "min (10) cannot be greater than max (5)"),
])
def test_config_mistakes_are_one_line_naming_file_line_and_field(tmp_path, load, data, message):
    path = config(tmp_path, load, data)
    with pytest.raises(TraceError) as err:
        load_trace(path)
    text = str(err.value)
    assert "\n" not in text and text.startswith(f"{path}:") and message in text, text
