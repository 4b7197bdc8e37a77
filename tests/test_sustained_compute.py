"""Power-limited cards (sim/data/sustained_compute.yaml; docs/gpu-profiles.md "Power-limited cards"): the
72 W L4's and the 70 W T4's derived profiles cap matmul compute at the sustained fraction of peak that
published matmul benchmarks measured; nothing else changes; the cap is checked against MLPerf Inference
figures it was not fitted to."""
from pathlib import Path

import numpy as np
import pytest

from kvsim.sim.calibration import regenerate_gpu_profiles as regen
from kvsim.sim.calibration.errors import CalibrationError
from kvsim.sim.core.step import BatchShape
from kvsim.sim.model.catalog import get_gpu
from kvsim.sim.model.cost_model import CostModel, load_profile


@pytest.fixture(scope="module")
def sustained():
    return regen.load_sustained_compute()


@pytest.fixture(scope="module")
def profiles():
    return regen.all_profiles()


def test_only_the_power_limited_cards_are_capped(sustained, profiles):
    """L4 and T4 have published sustained measurements; every other GPU keeps its fit or its source's
    efficiencies exactly (the shipped files are the regeneration's output: test_gpu_profiles)."""
    caps, _ = sustained
    assert set(caps) == {"L4", "T4"}
    for gpu, profile in profiles.items():
        source = profiles[regen.DERIVED[gpu]] if gpu in regen.DERIVED else profile
        table, src = np.array(profile.gemm_efficiency.efficiency), np.array(source.gemm_efficiency.efficiency)
        if gpu in caps:
            assert np.array_equal(table, np.minimum(src, caps[gpu].cap)) and (table < src).any(), gpu
            assert profile.attn_compute_eff == min(source.attn_compute_eff, caps[gpu].cap)
            assert profile.meta["sustained_compute"]["source"].startswith("https://")
            assert "cap" in profile.meta["error_band"]
        else:
            assert np.array_equal(table, src) and profile.attn_compute_eff == source.attn_compute_eff, gpu
            assert "sustained_compute" not in profile.meta, gpu


def test_l4_sustained_prefill_throughput_sits_in_the_published_band(sustained):
    """A long prefill on the L4 runs its matmuls at the published sustained rate (52.5-59.4 TFLOP/s at
    n >= 4096), not at the ~94 TFLOP/s the A40's efficiencies gave at the L4's boost-clock peak."""
    sc = sustained[0]["L4"]
    peak = get_gpu("l4").peak_flops("bf16")
    low, high = sc.low * peak, sc.high * peak
    cm = CostModel("llama-3.1-8b", "l4")
    for tokens in (1024, 2048, 4096):
        assert low <= cm.gemm_efficiency(tokens) * peak <= high, tokens
        linear = cm.breakdown(BatchShape(num_seqs=1, num_prefill_tokens=tokens))["linear"]
        achieved = tokens * cm.model.linear_flops_per_token / linear      # elementwise kernels and floors included
        assert 0.9 * low <= achieved <= high, (tokens, achieved / 1e12)
    uncapped = regen.derived_profile("L4", load_profile("a40"))
    assert regen.table_efficiency(uncapped, 4096, 416) * peak > 1.5 * high     # what the cap replaces


def test_t4_sustained_rate_is_its_published_figure(sustained):
    cm = CostModel("llama-3.2-1b", "t4")
    assert cm.gemm_efficiency(4096) * get_gpu("t4").peak_flops("fp16") == pytest.approx(24e12, rel=1e-4)


def test_same_tool_on_an_unthrottled_a40_agrees_with_the_a40_fit(sustained):
    """The benchmark tool of the L4 figures measures, on an A40 (300 W), the sustained fraction of peak
    that the A40's fit to Vidur's kernel timings has at 4,096 rows: the tool reads what the profiles mean."""
    tool = sustained[1]
    assert tool.gpu == "A40"
    fit_top = np.array(load_profile("a40").gemm_efficiency.efficiency[-1])
    assert fit_top.min() * 0.95 <= tool.cap <= fit_top.max() * 1.05


def test_mlperf_ratio_check_held_out():
    """MLPerf Inference BERT-99.9 Offline, L4 over H100-SXM (v3.0 and v3.1, not fitted to): the capped
    profile predicts the ratio within 10%; the A40-derived efficiencies were ~60% high."""
    results = regen.sustained_checks()
    assert {r.round for r in results} == {"v3.0", "v3.1"}
    for r in results:
        assert abs(r.error) < 0.10, r
    uncapped = {"L4": regen.derived_profile("L4", load_profile("a40")), "H100-SXM": load_profile("h100")}
    for r in regen.sustained_checks(uncapped):
        assert r.error > 0.4, r


GOOD = """gpus:
  L4:
    power_w: 72
    sustained_min_size: 4096
    measured_tflops: {bf16: {2048: 70.0, 4096: 55.0}}
    source: here
    read: 2026-12-07
"""


@pytest.mark.parametrize("edit, message", [
    (("power_w: 72", "power_watts: 72"), r"bad.yaml:3: field 'gpus.L4.power_watts': unknown field"),
    (("4096: 55.0", "1024: 55.0"), r"bad.yaml:2: gpus.L4: measured_tflops: no size at or above sustained_min_size"),
    (("bf16:", "fp8x:"), r"gpus.L4: measured_tflops.fp8x: the catalog's L4 has no fp8x peak"),
    (("  L4:", "  L5:"), r"bad.yaml:2: gpus.L5: "),
    (("55.0", "500.0"), r"measured_tflops: a value outside \(0, the catalog's peak\]"),
])
def test_bad_sustained_file_names_file_line_and_field(tmp_path, edit, message):
    assert regen.load_sustained_compute(_write(tmp_path, GOOD))[0]["L4"].cap == pytest.approx(55 / 121, abs=1e-5)
    with pytest.raises(CalibrationError, match=message):
        regen.load_sustained_compute(_write(tmp_path, GOOD.replace(*edit), "bad.yaml"))


def _write(tmp_path: Path, text: str, name: str = "good.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path
