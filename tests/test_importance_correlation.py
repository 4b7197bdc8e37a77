"""Positional correlation of the synthetic importance model's content weights: absent fields keep the
old weights bit for bit, the correlation has the documented shape and clusters H2O's evictions, bad
values are rejected with file and field, and the fit recovers a known correlation from simulated
'recorded' evictions."""
from __future__ import annotations

import numpy as np
import pytest
import yaml
from typer.testing import CliRunner

from kvsim.sim.calibration.correlation_fit import fit_content_correlation, simulate_evictions
from kvsim.sim.calibration.errors import CalibrationError
from kvsim.sim.cli import app
from kvsim.sim.config import load_config
from kvsim.sim.kv.importance import CHUNK, DATA_DIR, ImportanceError, ImportanceModelSpec, SyntheticImportance
from kvsim.sim.kv.policy import PolicyContext
from kvsim.sim.kv.state import TokenState
from kvsim.traces.trace import Trace

BASE = yaml.safe_load((DATA_DIR / "smollm2-135m.yaml").read_text())
CTX = PolicyContext("per_head", 2, 3, 3, 16, 6)


def spec_file(tmp_path, name="imp", **fields) -> str:
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump({**BASE, **fields}))
    return str(path)


def content_weights(model: SyntheticImportance, req_id: int, positions: np.ndarray) -> np.ndarray:
    state = TokenState(CTX.rows, len(positions))
    slots = np.broadcast_to(np.arange(len(positions)), (CTX.rows, len(positions)))
    model.on_write(req_id, state, np.arange(CTX.rows), slots, positions)
    return state.field("imp_w")[:, :len(positions)].copy()


@pytest.mark.parametrize("fields", [{}, {"content_correlation": 0},
                                    {"content_correlation": 0.0, "correlation_length": 8}])
def test_without_correlation_weights_are_the_uncorrelated_draws_bit_for_bit(tmp_path, fields):
    model = SyntheticImportance(CTX, ImportanceModelSpec.load(spec_file(tmp_path, **fields)), seed=3)
    positions = np.arange(2 * CHUNK + 40)
    got = content_weights(model, 11, positions)
    sigma = model._r(11)["sigma"]
    z = np.concatenate([np.random.default_rng([3, 2, 11, c]).standard_normal((CTX.rows, CHUNK), dtype=np.float32)
                        for c in range(3)], axis=1)[:, :len(positions)]
    assert np.array_equal(got, np.exp(sigma[:, None] * z))


def test_correlation_follows_rho_exp_decay_and_is_independent_of_what_was_drawn_before(tmp_path):
    spec = ImportanceModelSpec.load(spec_file(tmp_path, content_correlation=0.8, correlation_length=10))
    model = SyntheticImportance(CTX, spec, seed=0)
    z = np.concatenate([model._content_z(5, c) for c in range(30)], axis=1).astype(np.float64)
    assert z.std() == pytest.approx(1.0, abs=0.03)
    for lag in (1, 5, 20):
        corr = np.mean([np.corrcoef(row[:-lag], row[lag:])[0, 1] for row in z])
        assert corr == pytest.approx(0.8 * np.exp(-lag / 10), abs=0.04)
    # a chunk depends only on (seed, request, chunk): drawn alone it equals the in-order draw
    alone = SyntheticImportance(CTX, spec, seed=0)._content_z(5, 17)
    assert np.array_equal(alone, z[:, 17 * CHUNK:18 * CHUNK].astype(np.float32))


def h2o_blocks_freed(importance: str) -> int:
    cfg = load_config(None, {"model": "smollm2-135m", "gpu": "cpu-2core", "engine.num_gpu_blocks": 400,
                             "kv.policy": "h2o", "kv.budget": 128, "kv.slot_strategy": "slot_reuse",
                             "kv.importance": importance})
    trace = Trace.from_columns(arrival_time_s=[0.0, 0.0, 0.0], prompt_tokens=[400, 700, 900],
                               output_tokens=[6, 6, 6], name="t")
    steps, decisions = simulate_evictions(cfg, trace)
    assert int(steps["evicted_tokens"].sum()) == len(decisions) > 0
    return int(steps["blocks_freed_by_eviction"].sum())


def test_correlated_content_makes_h2o_empty_more_pages(tmp_path):
    plain = h2o_blocks_freed(spec_file(tmp_path, "plain"))
    clustered = h2o_blocks_freed(spec_file(tmp_path, "clustered", content_correlation=0.9, correlation_length=16))
    assert clustered > 2 * plain + 5


@pytest.mark.parametrize("fields, field, expected", [
    ({"content_correlation": 1.0, "correlation_length": 8}, "content_correlation", r"\[0, 1\)"),
    ({"content_correlation": -0.2, "correlation_length": 8}, "content_correlation", r"\[0, 1\)"),
    ({"content_correlation": "high", "correlation_length": 8}, "content_correlation", "finite number"),
    ({"content_correlation": 0.5}, "correlation_length", "needs correlation_length"),
    ({"content_correlation": 0.5, "correlation_length": 0}, "correlation_length", "tokens in"),
    ({"content_correlation": 0.5, "correlation_length": 500}, "correlation_length", "tokens in"),
    ({"correlation_length": 8}, "correlation_length", "without content_correlation"),
])
def test_bad_correlation_fields_name_file_and_field(tmp_path, fields, field, expected):
    path = spec_file(tmp_path, **fields)
    with pytest.raises(ImportanceError, match=expected) as info:
        ImportanceModelSpec.load(path)
    assert path in str(info.value) and field in str(info.value)


def synthetic_replay(tmp_path, name: str, budget: int, importance: str) -> str:
    """A directory shaped like a real h2o replay (config, steps, requests, decisions), produced by the
    simulator with a known importance model."""
    cfg = load_config(None, {"model": "smollm2-135m", "gpu": "cpu-2core", "engine.num_gpu_blocks": 600,
                             "kv.policy": "h2o", "kv.budget": budget, "kv.slot_strategy": "slot_reuse",
                             "kv.importance": importance, "seed": 9})
    trace = Trace.from_columns(arrival_time_s=[0.0, 0.0, 1e4], prompt_tokens=[500, 900, 700], output_tokens=[3] * 3,
                               name=name)
    simulate_evictions(cfg, trace, tmp_path / name)
    return str(tmp_path / name)


def test_fit_recovers_a_known_correlation_from_recorded_evictions(tmp_path):
    truth = spec_file(tmp_path, "truth", content_correlation=0.55, correlation_length=5)
    replays = [synthetic_replay(tmp_path, "b128", 128, truth), synthetic_replay(tmp_path, "b256", 256, truth)]
    fit = fit_content_correlation(replays, BASE, rhos=(0.0, 0.3, 0.6, 0.9), lengths=(2.5, 5.0, 10.0))
    assert fit.content_correlation == pytest.approx(0.55, abs=0.1)
    assert 5 / 1.5 <= fit.correlation_length <= 5 * 1.5
    assert fit.uncorrelated.blocks_freed < fit.measured.blocks_freed
    assert abs(fit.synthetic.blocks_freed - fit.measured.blocks_freed) <= 0.15 * fit.measured.blocks_freed


def test_correlation_fit_rejects_a_replay_without_score_driven_evictions(tmp_path):
    cfg = load_config(None, {"model": "smollm2-135m", "gpu": "cpu-2core", "engine.num_gpu_blocks": 200,
                             "kv.policy": "streaming"})
    simulate_evictions(cfg, Trace.from_columns(arrival_time_s=[0.0], prompt_tokens=[200], output_tokens=[3],
                                               name="s"), tmp_path / "stream")
    with pytest.raises(CalibrationError, match=r"stream.*config\.yaml.*streaming"):
        fit_content_correlation([tmp_path / "stream"], BASE)
    res = CliRunner().invoke(app, ["calibrate", "--decisions", str(tmp_path / "stream"), "--out", str(tmp_path / "x")])
    assert res.exit_code == 2 and "--attention" in res.output


def test_a_heavily_jittered_concentration_gives_finite_scores(tmp_path):
    # fitted models may jitter sigma by e^(±3); exp(sigma z) must saturate, not overflow to inf
    # (inf / inf made the scores nan and H2O's ranking arbitrary)
    heavy = {t: {**BASE["head_types"][t], "sigma": [40.0, 50.0]} for t in BASE["head_types"]}
    model = SyntheticImportance(CTX, ImportanceModelSpec.load(spec_file(tmp_path, head_types=heavy,
                                                                        request_sigma_jitter=1.0)), seed=0)
    w = content_weights(model, 5, np.arange(300))
    assert np.isfinite(w).all()
    state = TokenState.dense(CTX.rows, 300)
    model.on_write(6, state, np.arange(CTX.rows), np.broadcast_to(np.arange(300), (CTX.rows, 300)), np.arange(300))
    scores, kept = model.decode_scores(6, state)
    assert np.isfinite(scores).all() and np.isfinite(kept)


def test_decode_scores_without_a_query_token_are_refused():
    model = SyntheticImportance(CTX, "smollm2-135m", seed=0)
    with pytest.raises(ValueError, match="request 3: decode scores need at least one token"):
        model.decode_scores(3, TokenState.dense(CTX.rows, 0))
