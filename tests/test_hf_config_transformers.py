"""config.json read where `transformers` is installed (beside vLLM it is): the keys a file leaves out come from
its transformers config class, built from the file's values as vLLM's AutoConfig builds it (issue 47 item 4).
Skipped in the core install (no transformers), where tests/test_hf_config.py checks the reader's own defaults."""
import json

import pytest

pytest.importorskip("transformers")

from kvsim.sim.model import hf_config  # noqa: E402
from kvsim.sim.model.catalog import CatalogError, get_model  # noqa: E402

from test_hf_config import GEMMA_2B, LLAMA31_8B, QWEN25_05B_INSTRUCT, QWEN3_06B  # noqa: E402


def spec(tmp_path, config, folder):
    d = tmp_path / folder
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config))
    return get_model(d / "config.json")


@pytest.mark.parametrize("config", [QWEN25_05B_INSTRUCT, QWEN3_06B, LLAMA31_8B, GEMMA_2B])
def test_complete_files_read_the_same_with_and_without_transformers(tmp_path, monkeypatch, config):
    with_tf = spec(tmp_path, config, "a")
    monkeypatch.setattr(hf_config, "transformers_defaults", lambda model_type, data: {})
    hf_config._cached.cache_clear()
    assert spec(tmp_path, config, "b").model_dump(exclude={"name"}) == with_tf.model_dump(exclude={"name"})


def test_a_left_out_key_takes_the_config_class_default_as_vllm_sees_it(tmp_path):
    no_length = {k: v for k, v in QWEN25_05B_INSTRUCT.items() if k != "max_position_embeddings"}
    assert spec(tmp_path, no_length, "q").max_position == 32768              # Qwen2Config's default, not 2,048
    no_kv = {k: v for k, v in LLAMA31_8B.items() if k not in ("num_key_value_heads", "tie_word_embeddings")}
    llama = spec(tmp_path, no_kv, "l")
    assert llama.num_kv_heads == 32 and not llama.tied_embeddings            # LlamaConfig: MHA, untied
    assert llama.head_dim == 128                                             # derived from the file's sizes


def test_the_model_sizes_are_never_defaulted_and_rope_errors_name_the_files_key(tmp_path):
    with pytest.raises(CatalogError, match="missing 'num_hidden_layers'"):
        spec(tmp_path, {k: v for k, v in LLAMA31_8B.items() if k != "num_hidden_layers"}, "n")
    bad = {**QWEN25_05B_INSTRUCT, "rope_scaling": {"type": "linear", "factor": "4"}}
    with pytest.raises(CatalogError, match="field 'rope_scaling.factor': expected a number > 0"):
        spec(tmp_path, bad, "r")


def test_a_minimal_config_reads_with_transformers_unset_defaults_left_to_the_reader(tmp_path):
    """LlamaConfig leaves dtype unset (None): the reader's own default (bf16) applies, not a refused None."""
    minimal = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4,
               "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 1000, "max_position_embeddings": 2048}
    m = spec(tmp_path, minimal, "m")
    assert m.weight_dtype == "bf16" and m.head_dim == 64 and m.num_kv_heads == 2

