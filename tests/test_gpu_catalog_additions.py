"""The GPUs users deploy beyond the fitted ones (B200, GB200, H20, L40S, A10G, RTX 4090, RTX PRO 6000, MI300X,
MI325X): datasheet figures, a derived profile that says its source and error band, no silent fallback to the
hand-set `default` profile, `--profile h100` as the H100's profile, and your own price per GPU-hour."""
import warnings

import pytest
from typer.testing import CliRunner

from kvsim.sim.model.catalog import get_gpu
from kvsim.sim.cli import app
from kvsim.sim.config import ConfigError, load_config
from kvsim.sim.model.cost_model import load_profile, profile_for_gpu
from kvsim.sim.planning.sweep import cost_metrics

NEW = {"B200": "h100-sxm", "GB200": "h100-sxm", "H20": "h100-sxm", "MI300X": "h100-sxm", "MI325X": "h100-sxm",
       "L40S": "a40", "A10G": "a40", "RTX-4090": "a40", "RTX-PRO-6000": "a40"}


@pytest.mark.parametrize("gpu, source", sorted(NEW.items()))
def test_new_gpu_has_a_derived_profile_naming_source_and_error_band(gpu, source):
    spec = get_gpu(gpu)
    assert spec.memory_gib > 20 and spec.memory_bw_gbps > 500 and spec.tflops["bf16"] > 100
    with warnings.catch_warnings():
        warnings.simplefilter("error")                      # its own profile: no fallback warning
        name = profile_for_gpu(gpu)
    profile = load_profile(name)
    assert name == spec.name.lower() and profile.meta["derived_from"] == source
    assert profile.meta["fit_errors"]["step"]["mape"] > 0            # the band plan/capacity search
    assert "MAPE" in profile.meta["error_band"] and "transfer" in profile.meta["error_band"]


def test_datasheet_figures_order_the_generations():
    # dense BF16: Blackwell doubles Hopper; the H20 is a cut-down Hopper; MI325X has the MI300X's compute, more HBM
    assert get_gpu("b200").tflops["bf16"] == pytest.approx(2 * 1125)
    assert get_gpu("h20").tflops["bf16"] < get_gpu("h100").tflops["bf16"] / 6
    assert get_gpu("mi325x").tflops == get_gpu("mi300x").tflops
    assert get_gpu("mi325x").memory_gib > get_gpu("mi300x").memory_gib > get_gpu("h200").memory_gib


def test_a_custom_gpu_file_says_which_profile_it_gets(tmp_path):
    (tmp_path / "mine.yaml").write_text(
        "name: my-h100\nkind: gpu\nmemory_gib: 79.11\nmemory_bw_gbps: 3350\n"
        "tflops: {fp32: 67, bf16: 989.4, fp16: 989.4, fp8: 1978.9}\ninterconnect_gbps: 450\npcie_gbps: 64\n"
        "usd_per_hour: 2.5\n")
    with pytest.warns(UserWarning, match="GPU my-h100 has no profile of its own: its step times use the hand-set "
                                         "'default' profile"):
        assert profile_for_gpu(str(tmp_path / "mine.yaml")) == "default"


def test_profile_accepts_a_catalog_gpu_name(tmp_path):
    assert load_profile("h100") == load_profile("h100-sxm")
    assert load_profile("nvidia-b200") == load_profile("b200")
    runs = []
    for profile in ("h100", "h100-sxm"):
        out = tmp_path / profile
        result = CliRunner().invoke(app, ["simulate", "--trace", "random", "--num-prompts", "20", "--profile", profile,
                                          "-q", "-o", str(out)])
        assert result.exit_code == 0, result.output
        runs.append((out / "requests.parquet").read_bytes())
    assert runs[0] == runs[1]


def test_your_price_per_gpu_hour():
    summary = {"throughput_output_tok_s": 1000.0, "goodput_req_s": 1.0, "ttft_p99_s": 0.1, "tpot_p99_s": 0.01}
    catalog = cost_metrics(load_config(None, {"tp": 2}), summary)
    mine = cost_metrics(load_config(None, {"tp": 2, "usd_per_hour": 2.5}), summary)
    assert catalog["usd_per_hour"] == pytest.approx(2 * get_gpu("h100").usd_per_hour)
    assert mine["usd_per_hour"] == pytest.approx(5.0)
    by_gpu = load_config(None, {"usd_per_hour": "h100=2.5,l40s=1.2"})
    assert by_gpu.gpu_usd_per_hour() == 2.5 and by_gpu.gpu_usd_per_hour("L40S") == 1.2
    assert by_gpu.gpu_usd_per_hour("a100") == get_gpu("a100").usd_per_hour
    assert "usd_per_hour" not in load_config(None, {}).model_dump()          # unset: configs unchanged
    with pytest.raises(ConfigError, match="usd_per_hour"):
        load_config(None, {"usd_per_hour": "h100=-1"})
    with pytest.raises(ConfigError, match="unknown gpu 'h900'"):
        load_config(None, {"usd_per_hour": "h900=2"})
    result = CliRunner().invoke(app, ["plan", "--slo", "ttft_p99<=2s", "--models", "llama-3.1-8b", "--gpus",
                                      "h100,l40s", "--usd-per-hour", "2.5", "-j", "1"])
    assert result.exit_code == 2 and "one price for 2 GPUs; give GPU=PRICE" in result.output
