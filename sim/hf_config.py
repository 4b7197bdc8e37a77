"""Models from Hugging Face `config.json` files: `--model path/config.json` or a directory holding one.

A config.json is translated to the catalog's `ModelSpec` with the figures vLLM would size the model by:
layers, widths, heads, KV heads, head_dim (explicit, else hidden / heads), vocabulary, tied embeddings,
q/k/v biases (Qwen2 always; Llama-style `attention_bias`), per-head q/k norms (Qwen3, Gemma 3),
`max_position_embeddings` (vLLM's default max_model_len), the dtype (`torch_dtype`, or `dtype` in newer
files; float32 checkpoints run in bf16 as vLLM's `--dtype auto` does on GPUs) and a quantization
(`quantization_config`: fp8, int8/int4 via compressed-tensors, GPTQ, AWQ). Multimodal configs are read
through their `text_config`. Every problem is one line naming the file and the field.
"""
from __future__ import annotations

import json
import os
from functools import lru_cache
from pathlib import Path
from typing import Any

from .catalog import CatalogError, ModelSpec

# model_type -> (tie_word_embeddings default, q/k/v bias default, per-head q/k norm); the defaults are those
# of the transformers config class (used when the file leaves the key out)
DENSE_TYPES: dict[str, tuple[bool, bool, bool]] = {
    "llama": (False, False, False), "mistral": (False, False, False), "qwen2": (False, True, False),
    "qwen3": (False, False, True), "gemma": (True, False, False), "gemma2": (True, False, False),
    "gemma3_text": (True, False, True), "phi3": (False, False, False), "granite": (True, False, False),
    "olmo2": (True, False, True), "smollm3": (True, False, False),
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
        raise CatalogError(f"--model {text}: is a directory without config.json; expected a Hugging Face model "
                           "directory, a config.json, a catalog name or a model YAML file")
    return None


def model_from_hf_config(path: str | os.PathLike) -> ModelSpec:
    """The ModelSpec of a Hugging Face config.json (cached per file version)."""
    path = Path(path)
    try:
        stat = path.stat()
    except FileNotFoundError:
        raise CatalogError(f"{path}: no such file; expected a Hugging Face config.json") from None
    return _cached(str(path), str(path.resolve()), stat.st_mtime_ns, stat.st_size)


@lru_cache(maxsize=32)
def _cached(shown: str, resolved: str, mtime_ns: int, size: int) -> ModelSpec:
    return spec_from_hf_dict(_read(Path(resolved)), Path(shown))


def _read(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise CatalogError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        where = f"line {exc.lineno}: {exc.msg}" if isinstance(exc, json.JSONDecodeError) else exc.reason
        raise CatalogError(f"{path}: not valid JSON ({where}); expected a Hugging Face config.json") from None
    if not isinstance(data, dict):
        raise CatalogError(f"{path}: expected a JSON object (a Hugging Face config.json)")
    return data


class _Fields:
    """Reads a config dict with one-line errors naming the file and field."""

    def __init__(self, data: dict, path: Path):
        self.data, self.path = data, path

    def error(self, message: str) -> CatalogError:
        return CatalogError(f"{self.path}: {message}")

    def int(self, key: str, default: int | None = None, minimum: int = 1) -> int:
        value = self.data.get(key, default)
        if value is None:
            raise self.error(f"missing '{key}' (an integer); is this a decoder-only transformer's config.json?")
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise self.error(f"field '{key}': expected an integer >= {minimum}, got {value!r}")
        return value

    def bool(self, key: str, default: bool) -> bool:
        value = self.data.get(key, default)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self.error(f"field '{key}': expected true or false, got {value!r}")
        return value


def spec_from_hf_dict(data: dict, path: Path) -> ModelSpec:
    """ModelSpec from a parsed config.json (`path` names it in errors and gives the model's name)."""
    top = data
    if isinstance(data.get("text_config"), dict):        # multimodal wrapper: the language model's config
        data = {**{k: v for k, v in data.items() if k in ("torch_dtype", "dtype", "quantization_config")},
                **data["text_config"]}
    f = _Fields(data, path)
    model_type = str(data.get("model_type", "")).lower()
    _refuse_unsupported(f, model_type)
    tie_default, bias_default, qk_norm = DENSE_TYPES.get(model_type, (False, False, False))
    hidden, heads = f.int("hidden_size"), f.int("num_attention_heads")
    kv_heads = f.int("num_key_value_heads", heads)
    head_dim = f.int("head_dim", hidden // heads if hidden % heads == 0 else None)
    if heads % kv_heads:
        raise f.error(f"num_attention_heads ({heads}) is not a multiple of num_key_value_heads ({kv_heads})")
    qkv_bias = bias_default or f.bool("attention_bias", False) or f.bool("qkv_bias", False)
    weight, embedding, activation = _dtypes(f, top)
    try:
        return ModelSpec(
            name=_name(top, path), num_layers=f.int("num_hidden_layers"), hidden_size=hidden, num_heads=heads,
            num_kv_heads=kv_heads, head_dim=head_dim, intermediate_size=f.int("intermediate_size"),
            vocab_size=f.int("vocab_size"), tied_embeddings=f.bool("tie_word_embeddings", tie_default),
            qkv_bias=qkv_bias, qk_norm=qk_norm, max_position=f.int("max_position_embeddings", 2048),
            weight_dtype=weight, embedding_dtype=embedding, activation_dtype=activation, kv_dtype=activation,
            mlp_matrices=3)
    except ValueError as exc:       # pydantic's ValidationError is one
        raise f.error(str(exc).splitlines()[-1].strip()) from None


def _refuse_unsupported(f: _Fields, model_type: str) -> None:
    moe = [k for k in ("num_local_experts", "num_experts", "n_routed_experts") if f.data.get(k)]
    if moe:
        raise f.error(f"'{moe[0]}': mixture-of-experts configs are not supported yet (dense models only)")
    if f.data.get("kv_lora_rank"):
        raise f.error("'kv_lora_rank': multi-head latent attention is not supported yet (dense models only)")
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
    if not quant:
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
