"""GPT-2 byte-level BPE tokenizer read from the GGUF (llama.cpp `smollm` pre-tokenizer).

Pre-tokenization follows llama.cpp for `tokenizer.ggml.pre = smollm`: first every numeric
character (\\p{N}) becomes its own piece, then each piece is split by the GPT-2 pattern
`'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)` (anything the
pattern leaves is its own piece). Control tokens such as `<|im_start|>` written in the text are
recognised as single tokens. No BOS is added.
"""
from __future__ import annotations

import functools
import unicodedata
from collections.abc import Iterable

CONTROL_TOKEN_TYPE = 3
_CONTRACTIONS = ("'s", "'t", "'re", "'ve", "'m", "'ll", "'d")


@functools.lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars), strict=True))


@functools.lru_cache(maxsize=4096)
def _char_class(ch: str) -> str:
    if ch.isspace():
        return "S"
    category = unicodedata.category(ch)[0]
    return category if category in "LN" else "P"


def _split_digits(text: str) -> list[str]:
    pieces, start = [], 0
    for i, ch in enumerate(text):
        if _char_class(ch) == "N":
            if start < i:
                pieces.append(text[start:i])
            pieces.append(ch)
            start = i + 1
    if start < len(text):
        pieces.append(text[start:])
    return pieces


def _split_gpt2(text: str) -> list[str]:
    pieces, i, n = [], 0, len(text)
    while i < n:
        if text[i] == "'":
            match = next((c for c in _CONTRACTIONS if text.startswith(c, i)), None)
            if match:
                pieces.append(match)
                i += len(match)
                continue
        k = i + 1 if text[i] == " " and i + 1 < n and _char_class(text[i + 1]) != "S" else i
        cls = _char_class(text[k])
        if cls != "S":                           # ' ?\p{L}+', ' ?\p{N}+', ' ?[^\s\p{L}\p{N}]+'
            j = k + 1
            while j < n and _char_class(text[j]) == cls:
                j += 1
        else:                                    # '\s+(?!\S)', leftovers are single pieces
            j = i + 1
            while j < n and _char_class(text[j]) == "S":
                j += 1
            if j < n and j - i > 1:
                j -= 1
        pieces.append(text[i:j])
        i = j
    return pieces


def pre_tokenize(text: str) -> list[str]:
    return [p for piece in _split_digits(text) for p in _split_gpt2(piece)]


class Tokenizer:
    def __init__(self, tokens: list[str], merges: list[str], token_types: list[int], bos_id: int, eos_id: int):
        self.tokens = list(tokens)
        self.token_to_id = {t: i for i, t in enumerate(self.tokens)}
        self.merge_rank = {tuple(m.split(" ", 1)): rank for rank, m in enumerate(merges)}
        self.bos_id, self.eos_id = bos_id, eos_id
        self.special = sorted((t for t, kind in zip(self.tokens, token_types, strict=True) if kind == CONTROL_TOKEN_TYPE),
                              key=len, reverse=True)
        self.byte_encoder = bytes_to_unicode()
        self.byte_decoder = {c: b for b, c in self.byte_encoder.items()}
        self._bpe_cache: dict[str, list[int]] = {}

    @classmethod
    def from_prepared(cls, data: dict) -> Tokenizer:
        t = data["tokenizer"]
        return cls(t["tokens"], t["merges"], t["token_types"], t["bos_id"], t["eos_id"])

    @classmethod
    def smollm2(cls) -> Tokenizer:
        from kvsim.gpu.weights import load_prepared     # here: it loads torch; tokenizing needs none
        return cls.from_prepared(load_prepared())

    @property
    def vocab_size(self) -> int:
        return len(self.tokens)

    def _bpe(self, piece: str) -> list[int]:
        cached = self._bpe_cache.get(piece)
        if cached is not None:
            return cached
        word = [self.byte_encoder[b] for b in piece.encode("utf-8")]
        while len(word) > 1:
            ranks = [self.merge_rank.get(pair, 1 << 30) for pair in zip(word, word[1:], strict=False)]
            best = min(range(len(ranks)), key=ranks.__getitem__)
            if ranks[best] == 1 << 30:
                break
            first, second = word[best], word[best + 1]
            merged, i = [], 0
            while i < len(word):
                if i + 1 < len(word) and word[i] == first and word[i + 1] == second:
                    merged.append(first + second)
                    i += 2
                else:
                    merged.append(word[i])
                    i += 1
            word = merged
        ids = [self.token_to_id[w] for w in word]
        self._bpe_cache[piece] = ids
        return ids

    def _split_special(self, text: str) -> Iterable[tuple[str, bool]]:
        start = i = 0
        while i < len(text):
            match = next((s for s in self.special if text.startswith(s, i)), None) if text[i] == "<" else None
            if match:
                if start < i:
                    yield text[start:i], False
                yield match, True
                i = start = i + len(match)
            else:
                i += 1
        if start < len(text):
            yield text[start:], False

    def encode(self, text: str, parse_special: bool = True) -> list[int]:
        ids: list[int] = []
        parts = self._split_special(text) if parse_special else [(text, False)]
        for part, is_special in parts:
            if is_special:
                ids.append(self.token_to_id[part])
            else:
                for piece in pre_tokenize(part):
                    ids.extend(self._bpe(piece))
        return ids

    def decode(self, ids: Iterable[int]) -> str:
        out = bytearray()
        for i in ids:
            token = self.tokens[int(i)]
            if token in self.special:
                out.extend(token.encode("utf-8"))
            else:
                out.extend(self.byte_decoder[c] for c in token)
        return out.decode("utf-8", errors="replace")
