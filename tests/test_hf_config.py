"""Models from Hugging Face config.json files (`--model path/config.json` or its directory)."""
import json

import pytest
from typer.testing import CliRunner

from kvsim.sim.model.catalog import CatalogError, get_model
from kvsim.sim.cli import app
from kvsim.sim.config import ConfigError, load_config
from kvsim.sim.simulator.simulate import run_simulation
from kvsim.sim.model import hf_config


@pytest.fixture(autouse=True)
def core_install(monkeypatch):
    """The reader of the core install (no transformers: its own defaults). Where transformers is installed the
    keys a file leaves out come from its config class instead: tests/test_hf_config_transformers.py."""
    monkeypatch.setattr(hf_config, "transformers_defaults", lambda model_type, data: {})
    hf_config._cached.cache_clear()

# config.json as published in each Hugging Face repository (keys kvsim does not read included)
QWEN25_05B_INSTRUCT = {
    "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151645, "hidden_act": "silu", "hidden_size": 896, "initializer_range": 0.02,
    "intermediate_size": 4864, "max_position_embeddings": 32768, "max_window_layers": 21, "model_type": "qwen2",
    "num_attention_heads": 14, "num_hidden_layers": 24, "num_key_value_heads": 2, "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "transformers_version": "4.43.1", "use_cache": True, "use_sliding_window": False, "vocab_size": 151936}
QWEN3_06B = {
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 1024,
    "initializer_range": 0.02, "intermediate_size": 3072, "max_position_embeddings": 40960,
    "max_window_layers": 28, "model_type": "qwen3", "num_attention_heads": 16, "num_hidden_layers": 28,
    "num_key_value_heads": 8, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000,
    "sliding_window": None, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0", "use_cache": True, "use_sliding_window": False, "vocab_size": 151936}
LLAMA31_8B = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "bos_token_id": 128000, "eos_token_id": 128001,
    "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
    "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama", "num_attention_heads": 32,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 128256}
GEMMA_2B = {   # no tie_word_embeddings key: GemmaConfig's default (tied) applies; head_dim 256 explicit
    "architectures": ["GemmaForCausalLM"], "bos_token_id": 2, "eos_token_id": 1, "head_dim": 256,
    "hidden_act": "gelu", "hidden_size": 2048, "intermediate_size": 16384, "max_position_embeddings": 8192,
    "model_type": "gemma", "num_attention_heads": 8, "num_hidden_layers": 18, "num_key_value_heads": 1,
    "rms_norm_eps": 1e-06, "rope_theta": 10000.0, "torch_dtype": "bfloat16", "vocab_size": 256000}
MISTRAL_7B_V02 = {
    "architectures": ["MistralForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
    "max_position_embeddings": 32768, "model_type": "mistral", "num_attention_heads": 32, "num_hidden_layers": 32,
    "num_key_value_heads": 8, "rope_theta": 1000000.0, "sliding_window": None, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "vocab_size": 32000}


def write(tmp_path, config, folder="model"):
    d = tmp_path / folder
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(config, indent=2))
    return d


FIELDS = ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size", "vocab_size",
          "tied_embeddings", "qkv_bias", "qk_norm", "max_position", "weight_dtype", "kv_dtype", "activation_dtype")


@pytest.mark.parametrize("config, catalog", [(QWEN25_05B_INSTRUCT, "qwen2.5-0.5b"), (QWEN3_06B, "qwen3-0.6b"),
                                             (LLAMA31_8B, "llama-3.1-8b"), (MISTRAL_7B_V02, "mistral-7b")])
def test_config_json_gives_the_catalog_entry(tmp_path, config, catalog):
    from_file = get_model(write(tmp_path, config) / "config.json")
    entry = get_model(catalog)
    assert {f: getattr(from_file, f) for f in FIELDS} == {f: getattr(entry, f) for f in FIELDS}
    assert from_file.param_count == entry.param_count and from_file.weight_bytes == entry.weight_bytes


def test_qwen25_05b_and_qwen3_06b_hand_computed_figures(tmp_path):
    q25 = get_model(write(tmp_path, QWEN25_05B_INSTRUCT, "Qwen2.5-0.5B-Instruct"))      # a directory
    assert q25.name == "Qwen2.5-0.5B-Instruct"
    assert (q25.num_layers, q25.hidden_size, q25.num_heads, q25.num_kv_heads, q25.head_dim) == (24, 896, 14, 2, 64)
    assert q25.tied_embeddings and q25.qkv_bias
    assert q25.kv_bytes_per_token() == 2 * 24 * 2 * 64 * 2 == 12288
    # 151936x896 embedding (tied) + 24 x (896x(896+2x128) + 896x896 + 3x896x4864) + q/k/v biases + norms:
    # the published 494,032,768
    assert q25.param_count == 494_032_768
    q3 = get_model(write(tmp_path, QWEN3_06B, "Qwen3-0.6B") / "config.json")
    assert q3.head_dim == 128 and q3.q_size == 2048             # explicit head_dim, not 1024 / 16
    assert q3.kv_bytes_per_token() == 2 * 28 * 8 * 128 * 2 == 114688
    linear = 28 * (1024 * (2048 + 2 * 1024) + 2048 * 1024 + 3 * 1024 * 3072)
    norms = 28 * (2 * 1024 + 2 * 128) + 1024                    # input/post norms, q/k norms, final norm
    assert q3.param_count == 151936 * 1024 + linear + norms == 596_049_920
    assert q3.weight_bytes == 2 * q3.param_count                # bf16, LM head tied


def test_gemma_defaults_to_tied_embeddings_and_its_published_size(tmp_path):
    gemma = get_model(write(tmp_path, GEMMA_2B) / "config.json")
    assert gemma.tied_embeddings and gemma.head_dim == 256
    assert gemma.param_count == 2_506_172_416                   # google/gemma-2b, published


def test_quantized_and_float32_checkpoints(tmp_path):
    fp8 = get_model(write(tmp_path, {**LLAMA31_8B, "quantization_config": {
        "quant_method": "fp8", "activation_scheme": "dynamic"}}, "fp8") / "config.json")
    assert (fp8.weight_dtype, fp8.embedding_dtype, fp8.kv_dtype) == ("fp8", "bf16", "bf16")
    awq = get_model(write(tmp_path, {**LLAMA31_8B, "torch_dtype": "float16", "quantization_config": {
        "quant_method": "awq", "bits": 4, "group_size": 128}}, "awq") / "config.json")
    assert (awq.weight_dtype, awq.kv_dtype) == ("int4", "fp16")
    fp32 = get_model(write(tmp_path, {**LLAMA31_8B, "torch_dtype": "float32"}, "fp32") / "config.json")
    assert fp32.weight_dtype == "bf16"                          # vLLM's --dtype auto on a GPU


@pytest.mark.parametrize("change, message", [
    ({"num_hidden_layers": None}, "missing 'num_hidden_layers'"),
    ({"num_key_value_heads": 3}, "not a multiple of num_key_value_heads"),
    ({"hidden_size": "896"}, "field 'hidden_size': expected an integer"),
    ({"torch_dtype": "int8"}, "field 'torch_dtype'"),
    ({"num_local_experts": 8}, "mixture-of-experts config but .num_experts_per_tok."),
    ({"quantization_config": {"quant_method": "hqq"}}, "quant_method 'hqq'"),
    # checked by the model entry, not the reader: was pydantic's last line, its documentation link
    ({"num_local_experts": 8, "num_experts_per_tok": 9}, r"experts_per_token \(9\) must be in 1..num_experts \(8\)$"),
])
def test_bad_config_json_is_one_line_naming_file_and_field(tmp_path, change, message):
    config = {**QWEN25_05B_INSTRUCT, **change}
    config = {k: v for k, v in config.items() if v is not None}
    path = write(tmp_path, config) / "config.json"
    with pytest.raises(CatalogError, match=message) as err:
        get_model(path)
    assert str(path) in str(err.value) and "\n" not in str(err.value)


def test_missing_file_and_directory_without_config(tmp_path):
    with pytest.raises(CatalogError, match="no such file"):
        get_model(tmp_path / "nope" / "config.json")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CatalogError, match="directory without config.json"):
        get_model(tmp_path / "empty")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(CatalogError, match="not valid JSON"):
        get_model(tmp_path / "bad.json")


def test_simulate_runs_a_config_json_model(tmp_path):
    d = write(tmp_path, QWEN3_06B, "Qwen3-0.6B")
    res = run_simulation(load_config(None, {"model": str(d), "trace_options.max_requests": 30}), tmp_path / "out")
    assert res.summary["model"] == "Qwen3-0.6B" and res.summary["num_finished"] == 30
    catalog = run_simulation(load_config(None, {"model": "qwen3-0.6b", "trace_options.max_requests": 30}))
    assert catalog.summary["ttft_p50_s"] == res.summary["ttft_p50_s"]      # same figures, same run
    r = CliRunner().invoke(app, ["simulate", "--model", str(d / "config.json"), "--max-requests", "5", "-q",
                                 "-o", str(tmp_path / "cli")])
    assert r.exit_code == 0, r.output
    with pytest.raises(ConfigError, match="model"):
        load_config(None, {"model": str(tmp_path / "missing.json")})


def test_an_encoder_config_is_refused(tmp_path):
    bert = {"architectures": ["BertForMaskedLM"], "model_type": "bert", "hidden_size": 768, "num_attention_heads": 12,
            "num_hidden_layers": 12, "intermediate_size": 3072, "vocab_size": 30522}
    with pytest.raises(CatalogError, match="not a text-generation model"):
        get_model(write(tmp_path, bert))


# ---- the model's length: vLLM's _get_and_verify_max_len (max_position_embeddings x the RoPE factor) ----
META_LLAMA3_8B = {   # meta-llama/Meta-Llama-3-8B: Llama 3.1's shapes, 8,192 positions, no RoPE scaling
    **{k: v for k, v in LLAMA31_8B.items() if k != "rope_scaling"}, "max_position_embeddings": 8192,
    "rope_scaling": None}
PHI3_MINI_128K = {   # microsoft/Phi-3-mini-128k-instruct (factor lists shortened, its 262,144 sliding_window left out)
    "architectures": ["Phi3ForCausalLM"], "hidden_size": 3072, "intermediate_size": 8192,
    "max_position_embeddings": 131072, "model_type": "phi3", "num_attention_heads": 32, "num_hidden_layers": 32,
    "num_key_value_heads": 32, "original_max_position_embeddings": 4096,
    "rope_scaling": {"long_factor": [1.0, 1.1], "short_factor": [1.0, 1.0], "type": "longrope"},
    "rope_theta": 10000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "vocab_size": 32064}


def lengths(tmp_path, config, folder="m"):
    spec = get_model(write(tmp_path, config, folder) / "config.json")
    return spec.max_position, spec.max_model_len


@pytest.mark.parametrize("rope, max_position", [
    # Qwen2.5-7B-Instruct as its model card says to serve 128K: YaRN, original 32,768 x 4
    ({"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}, 131072),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16384}, 65536),   # not x 32,768
    ({"type": "linear", "factor": 2.0}, 65536),
    ({"type": "dynamic", "factor": 2.0}, 65536),
    ({"rope_type": "default", "rope_theta": 1e6}, 32768),            # no factor
    ({"type": "mrope", "mrope_section": [16, 24, 24]}, 32768),       # Qwen2-VL: vLLM reads it as default
    ({"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192}, 32768),   # already counted
    ({"full_attention": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 32768},
      "sliding_attention": {"rope_type": "default"}}, 65536),         # transformers v5: one per layer type
])
def test_rope_scaling_sets_max_position_as_vllm_derives_max_model_len(tmp_path, rope, max_position):
    config = {**QWEN25_05B_INSTRUCT, "rope_scaling": rope}
    assert lengths(tmp_path, config) == (max_position, max_position)
    v5 = {**QWEN25_05B_INSTRUCT, "rope_parameters": rope}           # transformers v5's name for it
    assert lengths(tmp_path, v5, "v5") == (max_position, max_position)


def test_llama3_rope_keeps_llama31_at_131072_and_llama3_8b_is_8192(tmp_path):
    assert lengths(tmp_path, LLAMA31_8B) == (131072, 131072)          # not 8 x 131072
    assert lengths(tmp_path, META_LLAMA3_8B, "l3") == (8192, 8192)
    entry = get_model("llama-3-8b")
    from_file = get_model(write(tmp_path, META_LLAMA3_8B, "l3b") / "config.json")
    assert {f: getattr(from_file, f) for f in FIELDS} == {f: getattr(entry, f) for f in FIELDS}


def test_gemma3_length_is_already_scaled(tmp_path):
    gemma3 = {**QWEN25_05B_INSTRUCT, "model_type": "gemma3_text", "max_position_embeddings": 131072,
              "rope_scaling": {"rope_type": "linear", "factor": 8.0}}
    assert lengths(tmp_path, gemma3) == (131072, 131072)


def test_other_length_keys_and_model_max_length(tmp_path):
    assert lengths(tmp_path, {**QWEN25_05B_INSTRUCT, "seq_length": 4096}) == (4096, 4096)        # the smallest
    assert lengths(tmp_path, {**QWEN25_05B_INSTRUCT, "model_max_length": 65536}, "c") == (65536, 65536)   # Cohere
    no_length = {k: v for k, v in QWEN25_05B_INSTRUCT.items() if k != "max_position_embeddings"}
    assert lengths(tmp_path, no_length, "none") == (2048, 2048)       # vLLM's fallback


def test_longrope_defaults_to_the_original_length_and_accepts_up_to_the_scaled_one(tmp_path):
    d = write(tmp_path, PHI3_MINI_128K, "Phi-3-mini-128k-instruct")
    assert lengths(tmp_path, PHI3_MINI_128K, "p") == (131072, 4096)
    assert lengths(tmp_path, {**PHI3_MINI_128K, "rope_scaling": {"type": "su", "long_factor": [1.0],
                                                                   "short_factor": [1.0]}}, "su") == (131072, 4096)
    overrides = {"model": str(d), "trace_options.max_requests": 3}
    assert run_simulation(load_config(None, overrides)).summary["max_model_len"] == 4096
    longer = run_simulation(load_config(None, {**overrides, "engine.max_model_len": 65536}))
    assert longer.summary["max_model_len"] == 65536                  # below the scaled 131,072: accepted


def test_models_lists_a_longrope_models_default_length_not_only_the_scaled_one(tmp_path):
    """`kvsim models` showed Phi-3-128k's max len as 131,072 while a run defaults to (and rejects
    prompts above) 4,096: the listing now shows vLLM's default and the longest --max-model-len."""
    d = write(tmp_path, PHI3_MINI_128K, "Phi-3-mini-128k-instruct")
    rows = json.loads(CliRunner().invoke(app, ["models", str(d), "llama-3-8b", "--json"]).output)
    assert [(r["max_model_len"], r["max_position"]) for r in rows] == [(4096, 131072), (8192, 8192)]
    table = CliRunner().invoke(app, ["models", str(d), "llama-3-8b"], env={"COLUMNS": "200"}).output
    assert "4,096 (up to 131,072)" in table and "8,192 (up" not in table


@pytest.mark.parametrize("rope, message", [
    ({"factor": 4.0}, r"field 'rope_scaling': no 'rope_type' \(or 'type'\)"),
    ({"type": "yarn", "factor": 4.0}, "field 'rope_scaling.original_max_position_embeddings': yarn scaling needs"),
    ({"type": "linear", "factor": "4"}, "field 'rope_scaling.factor': expected a number > 0, got '4'"),
    ({"type": "linear", "rope_type": "yarn", "factor": 4.0}, "rope_type 'yarn' and type 'linear' disagree"),
    ([4.0], "field 'rope_scaling': expected an object"),
])
def test_bad_rope_scaling_is_one_line(tmp_path, rope, message):
    path = write(tmp_path, {**QWEN25_05B_INSTRUCT, "rope_scaling": rope}) / "config.json"
    with pytest.raises(CatalogError, match=message) as err:
        get_model(path)
    assert str(path) in str(err.value) and "\n" not in str(err.value)
