"""Token counts of text (ShareGPT conversations) with the Hugging Face `tokenizers` library.

The default is the shipped SmolLM2 tokenizer (`traces/data/tokenizers/smollm2-135m.json`, a GPT-2
byte-level BPE of 49,152 tokens built from the SmolLM2-135M-Instruct GGUF the real backend runs; see
`build_smollm2_tokenizer`). It is an approximation of the served model's tokenizer: give that model's
own `tokenizer.json` (or the directory holding it) for its exact counts.
"""
from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path

from kvsim.traces.errors import TraceError

DATA_DIR = Path(__file__).resolve().parent / "data" / "tokenizers"
DEFAULT_TOKENIZER = DATA_DIR / "smollm2-135m.json"


def load_tokenizer(source: str | os.PathLike | None = None):
    """A `tokenizers.Tokenizer` from a tokenizer.json, a directory holding one, or (None) the shipped SmolLM2."""
    path = DEFAULT_TOKENIZER if source is None else Path(source)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise TraceError(path, None, "no such tokenizer file; expected a Hugging Face tokenizer.json or the "
                                     "model directory holding one")
    return _load(str(path.resolve()), path.stat().st_mtime_ns)


@lru_cache(maxsize=4)
def _load(path: str, mtime_ns: int):
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise TraceError(None, None, "counting tokens of text needs the `tokenizers` package: "
                                     "pip install tokenizers") from None
    try:
        return Tokenizer.from_file(path)
    except Exception as exc:  # noqa: BLE001 - the library raises a bare Exception for a bad file
        raise TraceError(path, None, f"not a Hugging Face tokenizer.json ({str(exc).splitlines()[0][:120]})") \
            from None


def count_tokens(tokenizer, texts: list[str]) -> list[int]:
    """Tokens of each text, without special tokens (as vllm bench serve counts a ShareGPT prompt)."""
    return [len(e.ids) for e in tokenizer.encode_batch(texts, add_special_tokens=False)]


def build_smollm2_tokenizer(gguf_path: str | os.PathLike, out: str | os.PathLike = DEFAULT_TOKENIZER) -> Path:
    """Write SmolLM2's tokenizer.json from the GGUF's tables (regenerates the shipped file; needs `gguf`).

    The GGUF's `smollm` pre-tokenizer is Hugging Face's Sequence(Digits(individual), ByteLevel(GPT-2
    regex, no prefix space)); the vocabulary and merges are the GGUF's own; control tokens (type 3)
    become special added tokens."""
    from gguf import GGUFReader
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    reader = GGUFReader(str(gguf_path))

    def field(key):
        return reader.fields[key].contents()

    tokens, merges = list(field("tokenizer.ggml.tokens")), list(field("tokenizer.ggml.merges"))
    types = [int(t) for t in field("tokenizer.ggml.token_type")]
    if field("tokenizer.ggml.pre") != "smollm":
        raise ValueError(f"{gguf_path}: pre-tokenizer {field('tokenizer.ggml.pre')!r}, expected 'smollm'")
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges],
                               fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([t for t, kind in zip(tokens, types, strict=True) if kind == 3])
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(out), pretty=False)
    return out
