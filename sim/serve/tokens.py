"""Prompt token counts and ids (the model's tokenizer, or the shipped SmolLM2 one), the prefix-cache
block ids of a prompt, and the filler text of the output.

Chat messages are rendered with ChatML (`<|im_start|>role\\ncontent<|im_end|>\\n` per message, then
`<|im_start|>assistant\\n`): SmolLM2-Instruct's own template, and an approximation of other models'
(a template adds a handful of tokens per message; docs/serve.md)."""
from __future__ import annotations

from collections.abc import Sequence

from kvsim.traces.tokenizer import load_tokenizer

# single tokens of the SmolLM2 (GPT-2 byte-level) vocabulary, each a word after a space: n of them
# re-tokenize to n tokens
FILLER_WORDS = (" the", " of", " and", " to", " in", " is", " that", " for", " it", " as", " with", " on", " was",
                " be", " by", " this", " are", " at", " from", " or", " an")
HASH_MASK = (1 << 63) - 1


class PromptTokenizer:
    """Token ids of a completion prompt or of chat messages."""

    def __init__(self, source: str | None = None):
        self.tokenizer = load_tokenizer(source)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def chat_ids(self, messages: Sequence[tuple[str, str]]) -> list[int]:
        rendered = "".join(f"<|im_start|>{role}\n{content}<|im_end|>\n" for role, content in messages)
        return self.encode(rendered + "<|im_start|>assistant\n")


def prefix_block_ids(token_ids: Sequence[int], block_size: int) -> tuple[int, ...]:
    """One id per full `block_size`-token block of the prompt (a hash of its tokens): the engine's KV
    manager chains them into vLLM's block hashes, so prompts sharing a prefix share its cached blocks."""
    full = len(token_ids) // block_size
    return tuple(hash(tuple(token_ids[j * block_size:(j + 1) * block_size])) & HASH_MASK for j in range(full))


def filler(start: int, count: int) -> str:
    """The text of output tokens start..start+count-1: one filler word a token."""
    n = len(FILLER_WORDS)
    return "".join(FILLER_WORDS[i % n] for i in range(start, start + count))
