"""Token counts of text (ShareGPT conversations) with the Hugging Face `tokenizers` library.

The default is the shipped SmolLM2 tokenizer (`traces/data/tokenizers/smollm2-135m.json`, a GPT-2
byte-level BPE of 49,152 tokens built from the SmolLM2-135M-Instruct GGUF the real backend runs; see
`build_smollm2_tokenizer`). It is an approximation of the served model's tokenizer: give that model's
own `tokenizer.json` (or the directory holding it) for its exact counts.
"""
from __future__ import annotations

import os
import re
from functools import lru_cache
from pathlib import Path

from kvsim.sim.io.safe_io import InputError, check_input_file
from kvsim.traces.errors import TraceError

MAX_TOKENIZER_BYTES = 256 * 2**20
DATA_DIR = Path(__file__).resolve().parent / "data" / "tokenizers"
DEFAULT_TOKENIZER = DATA_DIR / "smollm2-135m.json"


_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def load_tokenizer(source: str | os.PathLike | None = None):
    """A `tokenizers.Tokenizer` from a tokenizer.json, a directory holding one, a Hugging Face model id
    (`meta-llama/Llama-3.1-8B-Instruct`: its tokenizer.json from the local Hugging Face cache, else fetched
    by `tokenizers`), or (None) the shipped SmolLM2."""
    path = DEFAULT_TOKENIZER if source is None else Path(source).expanduser()
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file() and source is not None and _HUB_ID.fullmatch(str(source)) and not path.parent.is_dir():
        return _from_hub(str(source))
    if not path.is_file():
        raise TraceError(path, None, "no such tokenizer file; expected a Hugging Face tokenizer.json, the "
                                     "model directory holding one, or a Hugging Face model id (org/name)")
    try:     # real tokenizer.json files are 1-30 MB; the library parses a larger one whole, at ~10x its size
        check_input_file(path, what="tokenizer.json", max_bytes=MAX_TOKENIZER_BYTES)
    except InputError as exc:
        raise TraceError(path, None, str(exc).removeprefix(f"{path}: ")) from None
    return _load(str(path.resolve()), path.stat().st_mtime_ns)


def hub_cache_dir() -> Path:
    """Where huggingface_hub keeps downloads: $HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    return Path(home).expanduser() / "hub"


def cached_tokenizer_file(model_id: str) -> Path | None:
    """The tokenizer.json of `model_id` in the Hugging Face cache (the snapshot refs/main names, else any)."""
    repo = hub_cache_dir() / ("models--" + model_id.replace("/", "--"))
    ref = repo / "refs" / "main"
    snapshots = [repo / "snapshots" / ref.read_text().strip()] if ref.is_file() else []
    snapshots += sorted((repo / "snapshots").glob("*")) if (repo / "snapshots").is_dir() else []
    return next((snap / "tokenizer.json" for snap in snapshots if (snap / "tokenizer.json").is_file()), None)


def _from_hub(model_id: str):
    cached = cached_tokenizer_file(model_id)
    if cached is not None:
        return _load(str(cached.resolve()), cached.stat().st_mtime_ns)
    where = f"not in the Hugging Face cache ({hub_cache_dir()})"
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
        raise TraceError(None, None, f"tokenizer {model_id}: {where}, and HF_HUB_OFFLINE forbids fetching it; "
                                     f"download it first (huggingface-cli download {model_id} tokenizer.json) or "
                                     "give its tokenizer.json path")
    try:
        from tokenizers import Tokenizer
        return Tokenizer.from_pretrained(model_id)
    except Exception as exc:  # noqa: BLE001 - the library raises bare Exceptions (no network, gated, unknown)
        reason = str(exc).splitlines()[0][:120] if str(exc) else type(exc).__name__
        raise TraceError(None, None, f"tokenizer {model_id}: {where}, and it could not be fetched ({reason}); "
                                     f"download it (huggingface-cli download {model_id} tokenizer.json) or give "
                                     "its tokenizer.json path") from None


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
