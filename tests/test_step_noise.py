"""Step-time variance (sim/engine/step_noise.py): seeded, mean-one, identical stepped or fast-forwarded."""
import numpy as np
import pandas as pd
import pytest
import yaml

from kvsim.sim.config import ConfigError, SimConfig, load_config
from kvsim.sim.results.outputs import portable_config
from kvsim.sim.simulator.simulate import run_simulation
from kvsim.sim.engine.step_noise import BLOCK_STEPS, StepNoise, resolve_sigma
from kvsim.traces.synthetic import synthesize


def test_factors_depend_on_seed_replica_and_step_only():
    a, b = StepNoise(0.1, 7, 0), StepNoise(0.1, 7, 0)
    first = BLOCK_STEPS - 5                      # across a block boundary
    bulk = a.factors(first, 20)
    assert bulk.tolist() == [b.factor(i) for i in range(first, first + 20)]
    assert a.factors(3, 4).tolist() == bulk.tolist()[:0] + [a.factor(i) for i in range(3, 7)]
    assert not np.array_equal(StepNoise(0.1, 8, 0).factors(0, 50), a.factors(0, 50))
    assert not np.array_equal(StepNoise(0.1, 7, 1).factors(0, 50), a.factors(0, 50))


def test_factors_are_mean_one_lognormal_with_the_given_sigma():
    f = StepNoise(0.2, 0, 0).factors(0, 200_000)
    assert f.mean() == pytest.approx(1.0, abs=0.005)
    assert np.log(f).std() == pytest.approx(0.2, rel=0.01)


def test_auto_takes_the_gpus_fitted_sigma_and_a_number_is_taken_as_given():
    assert resolve_sigma("auto", "H200") == pytest.approx(0.073)
    assert resolve_sigma("auto", "T4") == resolve_sigma("auto", "default")     # no own measurement
    assert resolve_sigma(0.05, "H200") == 0.05


def test_bad_settings_are_refused_and_the_default_is_left_out_of_config_yaml():
    with pytest.raises(ConfigError, match="step_variance"):
        load_config(None, {"step_variance": -0.1})
    with pytest.raises(ConfigError, match="step_variance"):
        load_config(None, {"step_variance": "sometimes"})
    assert "step_variance" not in portable_config(SimConfig().model_dump(mode="json"))
    assert SimConfig(step_variance="auto").model_dump()["step_variance"] == "auto"


@pytest.fixture(scope="module")
def open_trace(tmp_path_factory):
    path = tmp_path_factory.mktemp("noise") / "open.jsonl"
    synthesize(300, rate=20.0, prompt="lognormal:600,0.8", output="lognormal:80,0.8", seed=3).save(path)
    return path


def run(trace, **options):
    cfg = SimConfig.model_validate({"trace": str(trace), "model": "qwen2.5-0.5b", "gpu": "l4", **options})
    return run_simulation(cfg, None)


@pytest.mark.parametrize("options", [{}, {"trace_options": {"max_concurrency": 12}},
                                     {"replicas": 2, "router": "least_outstanding"},
                                     {"engine": {"async_scheduling": False}}],
                         ids=["open-loop", "closed-loop", "two-replicas", "sync"])
def test_fast_forward_draws_the_factors_stepping_draws(open_trace, options):
    fast = run(open_trace, step_variance=0.15, **options)
    stepped = run(open_trace, step_variance=0.15, fast_forward=False, **options)
    pd.testing.assert_frame_equal(fast.requests, stepped.requests)
    pd.testing.assert_frame_equal(fast.steps, stepped.steps)


def test_variance_spreads_steps_around_the_models_price_and_keeps_means(open_trace):
    plain = run(open_trace)
    noisy = run(open_trace, step_variance=0.15, seed=1)
    again = run(open_trace, step_variance=0.15, seed=1)
    pd.testing.assert_frame_equal(noisy.requests, again.requests)          # seeded: bit for bit
    ratio = noisy.steps["duration_s"] / noisy.steps["predicted_s"]
    assert np.log(ratio).std() == pytest.approx(0.15, rel=0.1)
    assert (plain.steps["duration_s"] == plain.steps["predicted_s"]).all()
    assert noisy.summary["step_variance_sigma"] == 0.15 and plain.summary["step_variance_sigma"] == 0
    # the mean is kept (mean-one factors), the tail widens: on decode-only steps (over all steps the p99 is a
    # prefill step's, and the prefill/decode mix, not the noise, sets p99 / p50)
    assert noisy.summary["e2e_mean_s"] == pytest.approx(plain.summary["e2e_mean_s"], rel=0.05)

    def decode_tail(steps):
        d = steps.loc[steps["prefill_tokens"] == 0, "duration_s"]
        return d.quantile(0.99) / d.quantile(0.5)
    assert decode_tail(noisy.steps) > 1.2 * decode_tail(plain.steps)


def test_config_yaml_of_a_noisy_run_says_so(open_trace, tmp_path):
    cfg = SimConfig.model_validate({"trace": str(open_trace), "model": "qwen2.5-0.5b", "gpu": "l4",
                                    "step_variance": "auto", "trace_options": {"max_requests": 30}})
    run_simulation(cfg, tmp_path / "out")
    assert yaml.safe_load((tmp_path / "out" / "config.yaml").read_text())["step_variance"] == "auto"
