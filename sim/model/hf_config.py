"""Models from Hugging Face `config.json` files: `--model path/config.json` or a directory holding one.

A config.json is translated to the catalog's `ModelSpec` with the figures vLLM would size the model by:
layers, widths, heads, KV heads, head_dim (explicit, else hidden / heads), vocabulary, tied embeddings,
q/k/v biases (Qwen2 always; Llama-style `attention_bias`), per-head q/k norms (Qwen3, Gemma 3),
the model's length as vLLM derives max_model_len (`max_position_embeddings` times `rope_scaling.factor` for
the RoPE types vLLM scales by it: _max_len_fields), the dtype (`torch_dtype`, or `dtype` in newer
files; float32 checkpoints run in bf16 as vLLM's `--dtype auto` does on GPUs) and a quantization
(`quantization_config`: fp8, int8/int4 via compressed-tensors, GPTQ, AWQ; mxfp4 for gpt-oss's experts).
Mixture-of-experts (Mixtral, Qwen2/3-MoE, DeepSeek-V2/V3, gpt-oss), multi-head latent attention
(DeepSeek `kv_lora_rank`) and sliding-window layers (`sliding_window` with `layer_types`, Gemma 2/3's
patterns, Mistral v0.1's all-layer window) are read into the fields docs/models.md describes. Multimodal
configs are read through their `text_config`. Every problem is one line naming the file and the field.
"""
from __future__ import annotations

import json
import os
from functools import lru_cache
from pathlib import Path
from typing import Any

from ..io.safe_io import InputError, read_input_text, safe_json_loads


class HFConfigError(ValueError):
    """A config.json that cannot be read as a model (sim.model.catalog raises it as a CatalogError)."""

# model_type -> (tie_word_embeddings default, q/k/v bias default, per-head q/k norm); the defaults are those
# of the transformers config class (used when the file leaves the key out)
DENSE_TYPES: dict[str, tuple[bool, bool, bool]] = {
    "llama": (False, False, False), "mistral": (False, False, False), "qwen2": (False, True, False),
    "qwen3": (False, False, True), "gemma": (True, False, False), "gemma2": (True, False, False),
    "gemma3_text": (True, False, True), "phi3": (False, False, False), "granite": (True, False, False),
    "olmo2": (True, False, True), "smollm3": (True, False, False),
    # mixture of experts / multi-head latent attention (read by _moe_fields / _mla_fields)
    "mixtral": (False, False, False), "qwen2_moe": (False, True, False), "qwen3_moe": (False, False, True),
    "deepseek_v2": (False, False, False), "deepseek_v3": (False, False, False), "gpt_oss": (False, True, False),
}
_GENERATIVE = ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")
_DTYPES = {"float32": "bf16", "float": "bf16", "bfloat16": "bf16", "float16": "fp16", "half": "fp16"}


def hf_config_path(name_or_path: Any) -> Path | None:
    """The config.json a `--model` value names (a `.json` path or a directory holding config.json), or None
    for a catalog name or a YAML file."""
    if not isinstance(name_or_path, (str, os.PathLike)):
        return None
    text = os.fspath(name_or_path)
    if text.endswith(".json"):
        return Path(text)
    path = Path(text)
    if path.is_dir():
        if (path / "config.json").is_file():
            return path / "config.json"
        raise HFConfigError(f"--model {text}: is a directory without config.json; expected a Hugging Face model "
                           "directory, a config.json, a catalog name or a model YAML file")
    return None


def model_fields_from_hf_config(path: str | os.PathLike) -> dict:
    """The ModelSpec fields of a Hugging Face config.json (cached per file version; a copy each call)."""
    path = Path(path)
    try:
        stat = path.stat()
    except FileNotFoundError:
        raise HFConfigError(f"{path}: no such file; expected a Hugging Face config.json") from None
    return dict(_cached(str(path), str(path.resolve()), stat.st_mtime_ns, stat.st_size))


@lru_cache(maxsize=32)
def _cached(shown: str, resolved: str, mtime_ns: int, size: int) -> dict:
    return fields_from_hf_dict(_read(Path(resolved)), Path(shown))


def _read(path: Path) -> dict:
    try:
        data = safe_json_loads(read_input_text(path, what="Hugging Face config.json"), str(path))
    except InputError as exc:       # a FIFO, a device, over 16 MiB, not UTF-8, nested too deeply
        raise HFConfigError(str(exc)) from None
    except OSError as exc:
        raise HFConfigError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        where = f"line {exc.lineno}: {exc.msg}" if isinstance(exc, json.JSONDecodeError) else exc.reason
        raise HFConfigError(f"{path}: not valid JSON ({where}); expected a Hugging Face config.json") from None
    if not isinstance(data, dict):
        raise HFConfigError(f"{path}: expected a JSON object (a Hugging Face config.json)")
    return data


class _Fields:
    """Reads a config dict with one-line errors naming the file and field."""

    def __init__(self, data: dict, path: Path):
        self.data, self.path = data, path

    def error(self, message: str) -> HFConfigError:
        return HFConfigError(f"{self.path}: {message}")

    def int(self, key: str, default: int | None = None, minimum: int = 1) -> int:
        value = self.data.get(key)
        if value is None:             # absent or null: the transformers class's default (DeepSeek-V2-Lite's q_lora_rank)
            value = default
        if value is None:
            raise self.error(f"missing '{key}' (an integer); is this a decoder-only transformer's config.json?")
        maximum = MAX_FIELD.get(key, MAX_INT)
        if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= maximum:
            raise self.error(f"field '{key}': expected an integer in {minimum}..{maximum:,}, got {value!r:.40}")
        return value

    def bool(self, key: str, default: bool) -> bool:
        value = self.data.get(key, default)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self.error(f"field '{key}': expected true or false, got {value!r}")
        return value


# the vocab_size default of the transformers text-config classes multimodal configs embed, where a text_config
# leaves it out: Gemma3TextConfig 262,208, LlamaConfig and MistralConfig 32,000, Qwen2Config 151,936
TEXT_CONFIG_VOCAB = {"gemma3_text": 262208, "gemma3": 262208, "llama": 32000, "mistral": 32000, "qwen2": 151936}


def transformers_defaults(model_type: str, data: dict) -> dict:
    """Where `transformers` is installed (beside vLLM it is), the keys of `data`'s config class as vLLM reads
    the file (AutoConfig: the class built from the file's values, so a default derived from them, such as
    head_dim = hidden_size / heads, is computed from them); the reader takes the ones the file leaves out.
    {} without transformers (the core install: this module's own defaults apply), for a model_type it does not
    know, or a file its class refuses (this reader then reports the field itself)."""
    if not model_type:
        return {}
    try:
        from transformers import AutoConfig
    except Exception:               # not installed, or broken beside another torch: the own reader alone
        return {}
    import warnings

    import copy

    # a copy: the config classes rewrite nested values in place (rope_scaling's factor "4" -> 4.0)
    values = copy.deepcopy({k: v for k, v in data.items() if k not in ("model_type", "architectures", "auto_map")})
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            defaults = AutoConfig.for_model(model_type, **values).to_dict()
    except Exception:
        return {}
    defaults = {k: v for k, v in defaults.items() if v is not None}    # None: unset in the class too
    for key in NEVER_DEFAULTED:
        defaults.pop(key, None)
    for key, renamed in RENAMED_KEYS:          # the file's own spelling is read (its errors name it)
        if key in data:
            defaults.pop(renamed, None)
    return defaults


# the sizes that make a model: a config.json without them is not a model's, and is refused rather than sized
# by a config class's example defaults (LlamaConfig's 4096 x 32 layers)
NEVER_DEFAULTED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
# (key a file may give, the name transformers v5 gives it too)
RENAMED_KEYS = (("rope_scaling", "rope_parameters"), ("torch_dtype", "dtype"), ("dtype", "torch_dtype"))


def fields_from_hf_dict(data: dict, path: Path) -> dict:
    """ModelSpec fields from a parsed config.json (`path` names it in errors and gives the model's name)."""
    top = data
    if isinstance(data.get("text_config"), dict):        # multimodal wrapper: the language model's config
        data = {**{k: v for k, v in data.items() if k in ("torch_dtype", "dtype", "quantization_config", "vocab_size")},
                **data["text_config"]}
        if data.get("vocab_size") is None and str(data.get("model_type", "")).lower() in TEXT_CONFIG_VOCAB:
            # a text_config written without the fields its transformers class defaults (Gemma 3's vocab_size)
            data["vocab_size"] = TEXT_CONFIG_VOCAB[str(data["model_type"]).lower()]
    model_type = str(data.get("model_type", "")).lower()
    data = {**transformers_defaults(model_type, data), **data}
    f = _Fields(data, path)
    _refuse_unsupported(f, model_type)
    tie_default, bias_default, qk_norm = DENSE_TYPES.get(model_type, (False, False, False))
    hidden, heads = f.int("hidden_size"), f.int("num_attention_heads")
    kv_heads = f.int("num_key_value_heads", heads)
    head_dim = f.int("head_dim", hidden // heads if hidden % heads == 0 else None)
    if heads % kv_heads:
        raise f.error(f"num_attention_heads ({heads}) is not a multiple of num_key_value_heads ({kv_heads})")
    qkv_bias = f.bool("attention_bias", bias_default) or f.bool("qkv_bias", False) or (
        bias_default and model_type != "gpt_oss")
    weight, embedding, activation = _dtypes(f, top)
    layers = f.int("num_hidden_layers")
    fields = dict(
        name=_name(top, path), num_layers=layers, hidden_size=hidden, num_heads=heads,
        num_kv_heads=kv_heads, head_dim=head_dim, intermediate_size=f.int("intermediate_size"),
        vocab_size=f.int("vocab_size"), tied_embeddings=f.bool("tie_word_embeddings", tie_default),
        qkv_bias=qkv_bias, qk_norm=qk_norm, weight_dtype=weight, embedding_dtype=embedding,
        activation_dtype=activation, kv_dtype=activation, mlp_matrices=3)
    fields.update(_max_len_fields(f, model_type))
    fields.update(_moe_fields(f, top, layers))
    fields.update(_mla_fields(f))
    fields.update(_sliding_fields(f, model_type, layers))
    if _quant_method(top, f) == "mxfp4":      # gpt-oss: MXFP4 experts, everything else at the checkpoint dtype
        fields.update(weight_dtype=activation, embedding_dtype=None, expert_dtype="mxfp4")
    block = _fp8_block_size(f, top) if weight == "fp8" else 0
    if block:
        fields.update(weight_block_size=block)
    return fields


def _fp8_block_size(f: _Fields, top: dict) -> int:
    """fp8 `quantization_config.weight_block_size` [n, n] (DeepSeek-V3, Qwen3-*-FP8): n; 0 without one."""
    quant = top.get("quantization_config") or f.data.get("quantization_config")
    block = quant.get("weight_block_size") if isinstance(quant, dict) else None
    if block is None:
        return 0
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise f.error(f"field 'quantization_config.weight_block_size': expected two positive integers, got {block!r}")
    return int(block[0])


# ---- the model's length, as vLLM derives max_model_len ----------------------------------------------
# Followed: vLLM's `_get_and_verify_max_len` in vllm/config/model.py (github.com/vllm-project/vllm, main at
# commit 18ec6629, late 2025) and `patch_rope_parameters_dict` in vllm/transformers_utils/config.py. Older
# releases (vllm/config.py) have the same su/longrope/llama3 exemption and yarn rule; the Gemma 3 skip,
# per-layer-type rope_parameters and LongRoPE's shorter default came later. tokenizer_config.json's
# model_max_length (vLLM takes the minimum) is not read: only config.json is.
_LENGTH_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "model_max_length",
                "max_target_positions", "max_sequence_length", "max_seq_length", "seq_len")
_LAYER_TYPES = {"full_attention", "sliding_attention", "chunked_attention", "linear_attention"}
_UNSCALED_ROPE = ("longrope", "llama3")       # their max_position_embeddings already counts the scaling


def _max_len_fields(f: _Fields, model_type: str) -> dict:
    """max_position (the longest max_model_len vLLM accepts) and, for LongRoPE, default_max_model_len."""
    lengths = {k: f.int(k) for k in _LENGTH_KEYS if f.data.get(k) is not None}
    derived: float = lengths.get("model_max_length") or min(lengths.values(), default=2048)   # vLLM: 2048
    key, rope = _rope_parameters(f)
    if rope and "gemma3" not in model_type:      # Gemma 3's 128K is already scaled (vLLM skips it too)
        factor = 1.0
        for rp in rope:
            if rp["rope_type"] not in _UNSCALED_ROPE:
                factor = _factor(f, key, rp.get("factor", factor))
                if rp["rope_type"] == "yarn":
                    derived = _original_len(f, key, rp)
        derived *= factor
    out = {"max_position": int(derived)}
    if any(rp["rope_type"] == "longrope" for rp in rope):   # vLLM: LongRoPE defaults to the unscaled length
        out["default_max_model_len"] = int(f.data.get("original_max_position_embeddings") or derived)
    return out


def _rope_parameters(f: _Fields) -> tuple[str, list[dict]]:
    """`rope_parameters` (transformers v5) or `rope_scaling`, one dict per layer type, each with its
    `rope_type` (the legacy `type` accepted; `su` is `longrope`, `mrope` is `default`, as vLLM patches them)."""
    key = "rope_parameters" if f.data.get("rope_parameters") else "rope_scaling"
    raw = f.data.get(key)
    if not raw:
        return key, []
    if not isinstance(raw, dict):
        raise f.error(f"field '{key}': expected an object, got {raw!r}")
    nested = set(raw) <= _LAYER_TYPES and all(isinstance(v, dict) for v in raw.values())
    out = []
    for rp in (raw.values() if nested else [raw]):
        modern, legacy = rp.get("rope_type"), rp.get("type")
        if modern and legacy and modern != legacy and (legacy, modern) not in (("su", "longrope"), ("mrope", "default")):
            raise f.error(f"field '{key}': rope_type {modern!r} and type {legacy!r} disagree; expected one of them")
        rope_type = modern or legacy
        if not isinstance(rope_type, str):
            raise f.error(f"field '{key}': no 'rope_type' (or 'type'); expected e.g. linear, dynamic, yarn, llama3")
        out.append({**rp, "rope_type": {"su": "longrope", "mrope": "default"}.get(rope_type, rope_type)})
    return key, out


def _factor(f: _Fields, key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise f.error(f"field '{key}.factor': expected a number > 0, got {value!r}")
    return float(value)


def _original_len(f: _Fields, key: str, rp: dict) -> int:
    value = rp.get("original_max_position_embeddings", f.data.get("original_max_position_embeddings"))
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise f.error(f"field '{key}.original_max_position_embeddings': yarn scaling needs it as an integer "
                      f">= 1 (vLLM's max_model_len is it times the factor), got {value!r}")
    return value


_EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")
# far above every released model (hidden 16,384 and FFN 53,248 for Llama-3.1-405B; 256 experts of
# DeepSeek-V3; 126 layers): a config beyond is a typo, not a model (1e30 would price a 1e52-parameter one)
MAX_INT = 2**31 - 1
_WIDTH, _COUNT = 1_048_576, 100_000
MAX_FIELD = {"hidden_size": _WIDTH, "intermediate_size": _WIDTH, "moe_intermediate_size": _WIDTH,
             "shared_expert_intermediate_size": _WIDTH, "head_dim": _WIDTH, "kv_lora_rank": _WIDTH,
             "q_lora_rank": _WIDTH, "qk_rope_head_dim": _WIDTH, "qk_nope_head_dim": _WIDTH, "v_head_dim": _WIDTH,
             "num_hidden_layers": _COUNT, "num_attention_heads": _COUNT, "num_key_value_heads": _COUNT,
             "num_local_experts": _COUNT, "num_experts": _COUNT, "n_routed_experts": _COUNT,
             "num_experts_per_tok": _COUNT, "experts_per_token": _COUNT, "vocab_size": 2**27}


def _moe_fields(f: _Fields, top: dict, layers: int) -> dict:
    """Routed experts, top-k, expert width, shared experts and leading dense layers."""
    top_key = "num_experts_per_tok" if "num_experts_per_tok" in f.data else "experts_per_token"
    key = next((k for k in _EXPERT_KEYS if f.data.get(k)), None)
    if key is None:
        zero = next((k for k in _EXPERT_KEYS if f.data.get(k) == 0), None)
        if zero and f.data.get(top_key):      # 0 experts is a dense model only when nothing routes to them
            raise f.error(f"field '{zero}' is 0 but '{top_key}' routes each token to {f.data[top_key]!r:.20}; "
                          "expected the number of experts (a mixture of experts) or a top-k of 0 (dense)")
        return {}
    experts = f.int(key)
    if top_key not in f.data:
        raise f.error(f"'{key}' makes it a mixture-of-experts config but 'num_experts_per_tok' (the top-k) is "
                      "missing")
    out = dict(num_experts=experts, experts_per_token=f.int(top_key))
    if f.data.get("moe_intermediate_size"):
        out["moe_intermediate_size"] = f.int("moe_intermediate_size")
    if f.data.get("n_shared_experts"):
        out["num_shared_experts"] = f.int("n_shared_experts")
    if f.data.get("shared_expert_intermediate_size"):      # Qwen2-MoE: one wide shared expert
        width, expert = f.int("shared_expert_intermediate_size"), out.get("moe_intermediate_size", 0)
        if not expert or width % expert:
            raise f.error(f"field 'shared_expert_intermediate_size' ({width}): kvsim models shared experts as "
                          f"multiples of moe_intermediate_size ({expert or None})")
        out["num_shared_experts"] = width // expert
    if f.data.get("first_k_dense_replace"):
        out["first_dense_layers"] = f.int("first_k_dense_replace")
    if f.data.get("decoder_sparse_step", 1) != 1 or f.data.get("mlp_only_layers") or f.data.get("moe_layer_freq", 1) != 1:
        raise f.error("fields 'decoder_sparse_step' / 'mlp_only_layers' / 'moe_layer_freq': MoE layers interleaved "
                      "with dense ones are not modelled (only the leading first_k_dense_replace layers)")
    return out


def _mla_fields(f: _Fields) -> dict:
    """DeepSeek's multi-head latent attention: one latent (kv_lora_rank) and one RoPE key per token."""
    if not f.data.get("kv_lora_rank"):
        return {}
    rope, nope = f.int("qk_rope_head_dim"), f.int("qk_nope_head_dim")
    return dict(kv_lora_rank=f.int("kv_lora_rank"), q_lora_rank=f.int("q_lora_rank", 0, minimum=0),
                qk_rope_head_dim=rope, qk_nope_head_dim=nope, v_head_dim=f.int("v_head_dim"),
                num_kv_heads=1, head_dim=rope + nope)


def _sliding_fields(f: _Fields, model_type: str, layers: int) -> dict:
    """The sliding window and how many layers use it: `layer_types` when given, else Gemma 2's
    alternation, Gemma 3's `sliding_window_pattern`, otherwise every layer (Mistral v0.1); none when
    `use_sliding_window` is false (Qwen2)."""
    window = f.data.get("sliding_window")
    if not window or f.data.get("use_sliding_window") is False:
        return {}
    window = f.int("sliding_window")
    types = f.data.get("layer_types")
    if isinstance(types, list):
        if len(types) != layers:
            raise f.error(f"field 'layer_types': {len(types)} entries for {layers} layers")
        sliding = sum(1 for t in types if t == "sliding_attention")
    elif model_type == "gemma2":
        sliding = (layers + 1) // 2                  # layers 0, 2, 4, ... slide
    elif model_type == "gemma3_text" or f.data.get("sliding_window_pattern"):
        pattern = f.int("sliding_window_pattern", 6)
        sliding = layers - layers // pattern         # every pattern-th layer is global
    else:
        sliding = layers
    return dict(sliding_window=window, sliding_window_layers=sliding) if sliding else {}


def _quant_method(top: dict, f: _Fields) -> str:
    quant = top.get("quantization_config") or f.data.get("quantization_config")
    return str(quant.get("quant_method", "")).lower() if isinstance(quant, dict) else ""


def _refuse_unsupported(f: _Fields, model_type: str) -> None:
    arch = f.data.get("architectures") or []
    if arch and not any(str(a).endswith(_GENERATIVE) for a in arch):
        raise f.error(f"architectures {arch}: not a text-generation model (expected a ...ForCausalLM config)")
    for key in ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size", "vocab_size"):
        if key not in f.data:
            known = ", ".join(sorted(DENSE_TYPES))
            raise f.error(f"missing '{key}': not a decoder-only transformer config this reader knows "
                          f"(model types {known})")


def _dtypes(f: _Fields, top: dict) -> tuple[str, str | None, str]:
    """(weight, embedding, activation) dtypes: the checkpoint's dtype, and its quantized linears."""
    raw = top.get("torch_dtype", top.get("dtype", f.data.get("torch_dtype", f.data.get("dtype", "bfloat16"))))
    activation = _DTYPES.get(str(raw).removeprefix("torch.").lower())
    if activation is None:
        raise f.error(f"field 'torch_dtype': expected float32, bfloat16 or float16, got {raw!r}")
    quant = top.get("quantization_config") or f.data.get("quantization_config")
    if not quant or _quant_method(top, f) == "mxfp4":       # mxfp4: the experts only (fields_from_hf_dict)
        return activation, None, activation
    weight = _quantized_dtype(f, quant)
    return weight, activation, activation


def _quantized_dtype(f: _Fields, quant: Any) -> str:
    if not isinstance(quant, dict):
        raise f.error(f"field 'quantization_config': expected an object, got {quant!r}")
    method = str(quant.get("quant_method", "")).lower()
    if method in ("fp8", "fbgemm_fp8"):
        return "fp8"
    if method in ("gptq", "awq", "bitsandbytes"):
        bits = quant.get("bits", quant.get("w_bit", 4 if quant.get("load_in_4bit") else 8))
        return _bits(f, bits)
    if method == "compressed-tensors":
        groups = quant.get("config_groups") or {}
        weights = [g.get("weights") or {} for g in groups.values() if isinstance(g, dict)]
        if weights and weights[0].get("type") == "float":
            return "fp8"
        if weights:
            return _bits(f, weights[0].get("num_bits"))
    raise f.error(f"quantization_config.quant_method {method or None!r} is not one kvsim sizes; expected fp8, "
                  "gptq, awq, bitsandbytes or compressed-tensors (or give --weight-dtype)")


def _bits(f: _Fields, bits: Any) -> str:
    if bits in (8, 4):
        return "int8" if bits == 8 else "int4"
    raise f.error(f"quantization_config: {bits!r}-bit weights; expected 4 or 8")


def _name(data: dict, path: Path) -> str:
    """The repository name: `_name_or_path`'s last part, else the folder holding config.json."""
    given = str(data.get("_name_or_path") or "").rstrip("/")
    if given:
        return given.split("/")[-1]
    folder = path.resolve().parent.name
    return folder or path.stem
