"""The importance model's age profile (the shared layout's head-averaged row, sim/kv/importance.py):
fitted to real SmolLM2-135M attention, where H2O's evictions then fall, and what free_block gives back."""
import numpy as np
import pytest
import yaml

from kvsim.sim.calibration.age_profile import AGE_BINS, age_stats, head_averaged_rows, model_rows
from kvsim.sim.calibration.attention_profile import eviction_profile, real_attention, synthetic_attention
from kvsim.sim.kv.importance import ImportanceError, ImportanceModelSpec, SyntheticImportance
from kvsim.sim.kv.policy import PolicyContext
from test_kv_manager import run

SHARED = PolicyContext("shared", 30, 3, 9, 16, 1)          # SmolLM2-135M, one row per sequence
AGED = "smollm2-135m-aged"
T, PROMPT, BUDGET = 600, 400, 128


def implied(spec: str, requests: int = 3):
    """The model's own figure, without the KV manager: H2O's prompt cut at the first decode query
    (obs_window 1), then one eviction a step, on the model's full attention matrices (the oracle)."""
    profiles = [eviction_profile(synthetic_attention(SHARED, spec, T - 1, request=r), PROMPT, BUDGET, obs_window=1,
                                 prompt_cut=True, shared=True) for r in range(requests)]
    evicted = sum(p.evictions for p in profiles)
    return evicted, sum(p.pages_freed_share * p.evictions for p in profiles) / evicted


def test_free_block_frees_the_share_of_pages_the_fitted_model_implies():
    evicted, share = implied(AGED)
    kv = {"policy": "h2o", "budget": BUDGET, "layout": "shared", "slot_strategy": "free_block",
          "importance": AGED, "params": {"obs_window": 1}}
    s = run(kv, n=3, prompt=PROMPT, output=T - PROMPT, num_blocks=400)[0]
    assert s["evicted_token_rows"] == evicted
    got = s["blocks_freed_by_eviction"] * 16 / s["evicted_token_rows"]
    assert got == pytest.approx(share, abs=0.02), (got, share)


def test_the_age_profile_concentrates_evictions_in_whole_pages():
    # the unfitted shared row (the mean head: flat past a few dozen tokens, log-spread ~2.5) scatters
    # evictions; the fitted power law puts them in the oldest tokens (real SmolLM2-135M, 1,000 tokens,
    # 700-token prompt: 0.66-0.80 of evicted slots in wholly evicted pages)
    assert implied(AGED)[1] > implied("smollm2-135m")[1] + 0.1


def test_fitted_profile_follows_real_head_averaged_attention():
    torch = pytest.importorskip("torch")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        attn = real_attention(T, seed=0)[0]
    finally:
        torch.set_num_threads(threads)
    real = age_stats(head_averaged_rows(attn))
    fitted = age_stats(model_rows(ImportanceModelSpec.load(AGED), T, requests=3))
    unfitted = age_stats(model_rows(ImportanceModelSpec.load("smollm2-135m"), T, requests=3))
    old = slice(int(np.searchsorted(AGE_BINS, 64)), len(AGE_BINS) - 2)      # ages 64-512: where H2O evicts
    # median log attention by age: the fit within 0.5 nats, the mean head off by ~2.5
    assert np.abs(fitted.median_log[old] - real.median_log[old]).max() < 0.5
    assert np.abs(unfitted.median_log[old] - real.median_log[old]).min() > 1.5
    # the spread around the age trend: real ~0.8, the mean head's row ~2.5
    assert np.abs(fitted.log_sd[old] - real.log_sd[old]).max() < 0.4
    # attention falls with age: ~0.8 nats per doubling past 64 tokens, the mean head's flat
    assert np.diff(real.median_log[old]).max() < -0.2 and np.diff(fitted.median_log[old]).max() < -0.2


def test_per_head_rows_and_models_without_the_section_are_unchanged():
    per_head = PolicyContext("per_head", 30, 3, 9, 16, 90)
    a, b = SyntheticImportance(per_head, AGED), SyntheticImportance(per_head, "smollm2-135m")
    assert (a.s == b.s).all() and (a.sigma == b.sigma).all() and a.age_exponent == 0.0
    assert SyntheticImportance(SHARED, "smollm2-135m").age_exponent == 0.0
    assert SyntheticImportance(SHARED, AGED).age_exponent > 0


def test_fast_mode_refuses_an_age_profile_in_the_shared_layout():
    from kvsim.sim.config import ConfigError, load_config
    from kvsim.sim.simulator.simulate import run_simulation
    from kvsim.traces.synthetic import closed_batch
    cfg = load_config(None, {"model": "opt-125m", "gpu": "t4", "kv": {
        "policy": "h2o", "budget": 64, "layout": "shared", "mode": "fast", "importance": AGED}})
    with pytest.raises(ConfigError, match="age_profile .*kv.mode=token"):
        run_simulation(cfg, trace=closed_batch(1, 100, 10))


@pytest.mark.parametrize("section, match", [
    ("[1, 2]", "age_profile: expected a mapping"),
    ("{exponent: 0.8, sigma: 0.9, sink_share: 0.3, local_share: 0.1}", "age_profile.tau"),
    ("{exponent: 0.8, sigma: 0.9, sink_share: 0.3, local_share: 0.1, tau: 2, alpha: 1}", "unknown field"),
    ("{exponent: -1, sigma: 0.9, sink_share: 0.3, local_share: 0.1, tau: 2}", r"age_profile.exponent: expected"),
    ("{exponent: 0.8, sigma: 0.9, sink_share: 0.6, local_share: 0.5, tau: 2}", "sink_share \\+ local_share"),
])
def test_bad_age_profile_is_refused_naming_the_field(tmp_path, section, match):
    from kvsim.sim.kv.importance import DATA_DIR
    text = (DATA_DIR / "smollm2-135m.yaml").read_text() + f"age_profile: {section}\n"
    yaml.safe_load(text)
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ImportanceError, match=match):
        ImportanceModelSpec.load(path)
