"""Real-text prompts: seeded windows of a tokenized public-domain text (gpu/data/)."""
from __future__ import annotations

import functools
from importlib import resources

import numpy as np

from kvsim.gpu.tokenizer import Tokenizer

TEXT_FILE = "shakespeare_coriolanus.txt"


def corpus_text() -> str:
    return resources.files("kvsim.gpu").joinpath("data", TEXT_FILE).read_text(encoding="utf-8")


@functools.lru_cache(maxsize=1)
def corpus_token_ids() -> np.ndarray:
    return np.asarray(Tokenizer.smollm2().encode(corpus_text()), dtype=np.int64)


def prompt_token_ids(n_tokens: int, seed: int) -> list[int]:
    """`n_tokens` consecutive token ids of the corpus starting at a seeded offset.

    Longer than the corpus (~13.8k tokens) wraps around (the text is re-read from the start).
    """
    if n_tokens < 1:
        raise ValueError(f"n_tokens must be >= 1, got {n_tokens}")
    ids = corpus_token_ids()
    start = int(np.random.default_rng(seed).integers(len(ids)))
    return np.take(ids, np.arange(start, start + n_tokens), mode="wrap").tolist()
