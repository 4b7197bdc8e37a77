"""KV figures as vLLM prints them ("GPU KV cache size: N tokens", "Maximum concurrency for L tokens per request:
Cx"), hybrid models' KV per token, and HF configs vLLM reads that the reader refused (a null q_lora_rank, a
multimodal text_config without vocab_size, one bad file in a `kvsim models` listing)."""
import json

import pytest
from typer.testing import CliRunner

from kvsim.sim.model.catalog import get_model
from kvsim.sim.cli import app
from kvsim.sim.config import load_config
from kvsim.sim.model.memory import vllm_kv_cache_report
from kvsim.sim.simulator.simulate import run_simulation
from test_moe_mla_sliding import DEEPSEEK_V3_CONFIG, from_hf


def test_dense_model_report_is_blocks_times_block_size_and_blocks_per_max_len_request():
    tokens, concurrency = vllm_kv_cache_report(get_model("llama-3.1-8b"), 27574, 16, 131072, 8192)
    assert tokens == 27574 * 16 and concurrency == pytest.approx(27574 / 8192)


def test_hybrid_model_report_counts_groups_and_the_window():
    # gpt-oss-20b: 12 full + 12 sliding (window 128) layers = two groups of 12; a block holds one group
    model = get_model("gpt-oss-20b")
    assert model.kv_cache_groups() == (12, 1, 1)
    tokens, concurrency = vllm_kv_cache_report(model, 100_001, 16, 131072, 8192)
    assert tokens == 100_001 // 2 * 16
    per_request = 131072 // 16 + (-(-(128 - 1 + 8192) // 16) + 1)         # full blocks + window blocks + 1
    assert concurrency == pytest.approx(100_001 / per_request)


def test_summary_and_table_carry_vllms_figures(tmp_path):
    res = run_simulation(load_config(None, {"trace": "random", "trace_options.max_requests": 5}))
    s = res.summary
    assert s["kv_cache_tokens"] == s["num_gpu_blocks"] * s["block_size"]
    assert s["kv_max_concurrency"] == pytest.approx(s["num_gpu_blocks"] / (s["max_model_len"] // 16))
    out = CliRunner().invoke(app, ["simulate", "--trace", "random", "--num-prompts", "5", "-o", str(tmp_path / "r")],
                             env={"COLUMNS": "200"})
    assert f"{s['kv_cache_tokens']:,} tokens" in out.output and f"{s['kv_max_concurrency']:.2f}x" in out.output


def test_models_lists_hybrid_kv_per_token_and_survives_a_bad_file(tmp_path):
    (tmp_path / "bad.json").write_text(json.dumps({"x": 1}))
    result = CliRunner().invoke(app, ["models", "llama-3.1-8b", str(tmp_path / "bad.json"), "gpt-oss-20b", "--json"])
    assert result.exit_code == 2
    rows = json.loads(result.stdout)
    assert [r["name"] for r in rows] == ["Llama-3.1-8B", "gpt-oss-20b"]                  # the good ones listed
    assert "bad.json: missing 'num_hidden_layers'" in result.stderr
    oss = rows[1]
    assert oss["kv_bytes_per_token_full_attention"] == oss["kv_bytes_per_token"] / 2    # 12 of 24 layers
    assert rows[0]["kv_bytes_per_token_full_attention"] == rows[0]["kv_bytes_per_token"]


def test_null_q_lora_rank_and_text_config_without_vocab(tmp_path):
    lite = from_hf(tmp_path, {**DEEPSEEK_V3_CONFIG, "q_lora_rank": None})   # DeepSeek-V2-Lite writes null
    assert lite.q_lora_rank == 0
    gemma = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "torch_dtype": "bfloat16",
             "text_config": {"model_type": "gemma3_text", "hidden_size": 2560, "intermediate_size": 10240,
                             "num_attention_heads": 8, "num_hidden_layers": 34, "num_key_value_heads": 4,
                             "head_dim": 256, "sliding_window": 1024, "max_position_embeddings": 131072}}
    path = tmp_path / "gemma"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(gemma))
    assert get_model(path / "config.json").vocab_size == 262208        # Gemma3TextConfig's default
