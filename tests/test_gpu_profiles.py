"""GPU profiles fitted to measured kernel times (sim/calibration/operator_fit.py), one per catalog GPU."""
import json

import numpy as np
import pytest
import yaml
from typer.testing import CliRunner

from kvsim.sim.calibration import regenerate_gpu_profiles as regen
from kvsim.sim.calibration.errors import CalibrationError
from kvsim.sim.calibration.operator_fit import (
    SHIPPED_OPERATORS, fit_operator_profile, load_operator_tables, predict_layers,
)
from kvsim.sim.model.catalog import list_gpus
from kvsim.sim.cli import app
from kvsim.sim.core.step import BatchShape
from kvsim.sim.model.cost_model import CostModel, load_profile, profile_fit_error


@pytest.fixture(scope="module")
def fits():
    return regen.fitted_profiles()


def test_shipped_profiles_are_what_the_fit_produces():
    """The files in sim/data/profiles are the regeneration's output, byte for byte: no hand edits."""
    assert regen.main(["--check"]) == 0


@pytest.mark.parametrize("gpu", regen.FITTED)
def test_held_out_model_step_error_is_at_most_5_percent(fits, gpu):
    fit = fits[gpu]
    assert fit.holdout == "Llama-2-7b-hf" and "Llama-2-7b-hf" not in fit.models
    assert fit.errors["step"]["count"] > 1000
    assert fit.errors["step"]["mape"] <= 0.05
    assert abs(fit.errors["step"]["bias"]) <= 0.04


def test_small_and_large_matmuls_scale_with_bandwidth_and_compute(fits):
    """Measured on Llama-2-7B layers (held out): an H100 runs few-token layers ~1.6x faster than an
    A100 (HBM3 vs HBM2e) and 1-4k-token ones over 3x (tensor-core peak). The fits reproduce both."""
    sums = {}
    for gpu in ("A100-80GB", "H100-SXM"):
        tables = load_operator_tables(SHIPPED_OPERATORS, gpu)
        layers = tables.layers[tables.layers["model"] == "Llama-2-7b-hf"]
        pred = predict_layers(fits[gpu].profile, layers, tables.gpu)["linear_s"]
        small, large = layers["num_tokens"] <= 8, layers["num_tokens"] >= 1024
        sums[gpu] = {"small": (layers["linear_s"][small].sum(), pred[small].sum()),
                     "large": (layers["linear_s"][large].sum(), pred[large].sum())}
    ratio = {k: [a / h for a, h in zip(sums["A100-80GB"][k], sums["H100-SXM"][k])] for k in ("small", "large")}
    for measured, predicted in ratio.values():
        assert predicted == pytest.approx(measured, rel=0.05)
    assert 1.4 < ratio["small"][0] < 1.9 and ratio["large"][0] > 3.0     # bandwidth 1.64x, bf16 peak 3.17x


def test_every_catalog_gpu_gets_its_own_profile_automatically():
    names = set()
    for gpu in list_gpus():
        cm = CostModel("smollm2", gpu.name)
        names.add(cm.profile.name)
        if gpu.kind == "gpu":
            assert cm.profile.operator_form, gpu.name
            assert profile_fit_error(cm.profile) is not None
    assert len(names) == len(list_gpus())           # one profile per GPU, not one for all
    assert CostModel("llama-3.1-8b", "h200").profile.meta["derived_from"] == "h100-sxm"
    assert CostModel("llama-3.1-8b", "l4").profile.meta["derived_from"] == "a40"


def test_operator_form_decode_runs_match_single_steps_bit_for_bit():
    cm = CostModel("llama-3.1-8b", "h100", async_scheduling=True)
    rng = np.random.default_rng(5)
    seqs = rng.integers(1, 300, 200).astype(np.float64)
    kv = seqs * rng.uniform(10, 4000, 200)
    entries = np.ceil(kv / 16)
    run = cm.predict_decode(seqs, kv, entries)
    for i in range(200):
        one = cm.predict(BatchShape(num_seqs=seqs[i], num_decode_tokens=seqs[i], kv_tokens_read=kv[i],
                                    block_table_entries=entries[i]))
        assert one == run[i]


def test_operator_form_terms():
    """Decode at batch 1 streams the weights at the fitted bandwidth plus the kernel floors; more
    sequences add KV reads; tensor parallel adds the degree's all-reduce terms."""
    cm = CostModel("llama-3.1-8b", "h100")
    p, m = cm.profile, cm.model
    b1 = cm.breakdown(BatchShape(num_seqs=1, num_decode_tokens=1, kv_tokens_read=1))
    stream = m.weight_bytes_read_per_step / (cm.gpu.mem_bw * p.mem_bw_eff)
    floors = (4 * m.num_layers + 1) * p.gemm_latency_s + m.num_layers * p.layer_latency_s
    assert stream + floors < b1["linear"] < 1.01 * (stream + floors)
    tp4 = CostModel("llama-3.1-70b", "h100", tp=4)
    shape = BatchShape(num_seqs=64, num_decode_tokens=64, kv_tokens_read=64 * 2048)
    terms = tp4.profile.allreduce_by_tp[4]
    size = 64 * tp4.model.hidden_size * 2
    expected = 2 * tp4.model.num_layers * (2 * 3 / 4 * size / 450e9 / terms.bw_eff + terms.latency_s)
    assert tp4.breakdown(shape)["allreduce"] == pytest.approx(expected, rel=1e-12)


def test_calibrate_operators_cli_writes_a_profile_simulate_uses(tmp_path):
    out = tmp_path / "a40.yaml"
    res = CliRunner().invoke(app, ["calibrate", "--operators", "shipped", "--gpu", "a40", "--holdout", "phi-2",
                                   "--attention-from", "a100", "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert "held-out model phi-2" in res.output and "step" in res.output
    prof = load_profile(out)
    assert prof.operator_form and prof.meta["fitted_on"]["holdout"] == "phi-2"
    run = tmp_path / "run"
    res = CliRunner().invoke(app, ["simulate", "--trace", "azure-conv-2023", "--max-requests", "20", "--gpu", "a40",
                                   "--model", "llama-3.1-8b", "--profile", str(out), "--out", str(run)])
    assert res.exit_code == 0, res.output
    summary = json.loads((run / "summary.json").read_text())
    assert summary["profile"] == "a40" and summary["profile_step_mape"] == prof.meta["fit_errors"]["step"]["mape"]


def test_calibrate_operators_rejects_bad_tables(tmp_path):
    with pytest.raises(CalibrationError, match="Vidur's profiling layout"):
        load_operator_tables(tmp_path, "h100")
    bad = tmp_path / "compute" / "h100" / "org" / "m"
    bad.mkdir(parents=True)
    (bad / "mlp.csv").write_text("num_tokens,foo\n1,2\n")
    with pytest.raises(CalibrationError, match="mlp.csv: missing column"):
        load_operator_tables(tmp_path, "h100")
    with pytest.raises(CalibrationError, match="holdout model 'nope'"):
        fit_operator_profile(load_operator_tables(SHIPPED_OPERATORS, "h100"), holdout="nope")


def test_default_run_names_its_profile_and_error(tmp_path):
    run = tmp_path / "run"
    res = CliRunner().invoke(app, ["simulate", "--trace", "azure-conv-2023", "--max-requests", "20",
                                   "--out", str(run)])
    assert res.exit_code == 0, res.output
    summary = json.loads((run / "summary.json").read_text())
    assert summary["profile"] == "h100-sxm"
    shipped = yaml.safe_load(open(regen.profile_file("H100-SXM")))
    assert summary["profile_step_mape"] == shipped["meta"]["fit_errors"]["step"]["mape"] <= 0.05
