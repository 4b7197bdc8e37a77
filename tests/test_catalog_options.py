"""Small catalog models, the weight-dtype and compression-rate options, the renamed ShareGPT trace."""
import json
import warnings

import pytest
from typer.testing import CliRunner

from kvsim.sim.model.catalog import get_model
from kvsim.sim.cli import app
from kvsim.sim.config import load_config
from kvsim.sim.model.memory import PoolSizing, num_gpu_blocks
from kvsim.sim.model.catalog import get_gpu
from kvsim.traces.errors import TraceWarning
from kvsim.traces.loaders import load_trace


@pytest.mark.parametrize("name", ["llama-3.2-1b", "llama-3.2-3b", "opt-125m", "opt-1.3b"])
def test_small_models_fit_a_16gb_t4(name):
    assert num_gpu_blocks(get_model(name), get_gpu("t4"), PoolSizing(block_size=16)).num_blocks > 1000


def test_opt_is_fp16_with_a_two_matrix_mlp_and_biases():
    m = get_model("opt-125m")
    assert (m.weight_dtype, m.kv_dtype, m.mlp_matrices, m.linear_bias, m.norm) == ("fp16", "fp16", 2, True, "layernorm")


def test_weight_dtype_option_shrinks_weights_and_grows_the_kv_pool(tmp_path):
    runner = CliRunner()
    base = ["simulate", "--trace", "sharegpt-8k-filtered", "--model", "llama-3.1-8b", "--gpu", "l4",
            "--max-requests", "3", "-q"]
    r16 = runner.invoke(app, base + ["--out", str(tmp_path / "a")])
    r8 = runner.invoke(app, base + ["--weight-dtype", "fp8", "--out", str(tmp_path / "b")])
    assert r16.exit_code == 0 and r8.exit_code == 0, r8.output
    a = json.loads((tmp_path / "a" / "summary.json").read_text())
    b = json.loads((tmp_path / "b" / "summary.json").read_text())
    assert b["num_gpu_blocks"] > 1.5 * a["num_gpu_blocks"]
    assert load_config(tmp_path / "b" / "config.yaml").weight_dtype == "fp8"     # a config key, reproducible
    bad = runner.invoke(app, base + ["--weight-dtype", "fp7", "--out", str(tmp_path / "c")])
    assert bad.exit_code == 2 and "fp7" in bad.output


def test_compression_rate_option_is_the_policy_parameter(tmp_path):
    runner = CliRunner()
    args = ["simulate", "--trace", "sharegpt-8k-filtered", "--model", "smollm2-135m", "--gpu", "l4",
            "--max-requests", "4", "--policy", "kvcompress", "--layout", "per_head", "--slot-strategy", "compact",
            "--kv-mode", "fast", "-q"]
    r = runner.invoke(app, args + ["--compression-rate", "8", "--out", str(tmp_path / "r8")])
    assert r.exit_code == 0, r.output
    assert load_config(tmp_path / "r8" / "config.yaml").kv.params["compression_rate"] == 8
    s8 = json.loads((tmp_path / "r8" / "summary.json").read_text())
    runner.invoke(app, args + ["--compression-rate", "2", "--out", str(tmp_path / "r2")])
    s2 = json.loads((tmp_path / "r2" / "summary.json").read_text())
    assert s8["compression_ratio"] > 2 * s2["compression_ratio"] / 1.5


def test_old_sharegpt_name_is_an_alias_with_a_notice():
    with pytest.warns(TraceWarning, match="sharegpt-8k-filtered"):
        old = load_trace("sharegpt")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        new = load_trace("sharegpt-8k-filtered")
    assert old.df.equals(new.df)
    assert new.df["prompt_tokens"].mean() > 2000          # 8K-filtered conversations, not short chats
