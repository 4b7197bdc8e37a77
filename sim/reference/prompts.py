"""Prompt token ids for a real engine that make its prefix cache see what kvsim's sees.

kvsim hashes a full block by the trace's prefix ids when the trace has them (Mooncake
`hash_ids`: one id per `prefix_block_tokens` tokens) and by (request, block) otherwise. A real
engine hashes token ids, so each token is drawn from what kvsim's block key depends on: a token
covered by prefix id `h` at offset `o` within its span is a function of (h, o); any other token is
a function of (request, position). Equal kvsim keys then mean equal token blocks and vice versa.
"""
from __future__ import annotations

import numpy as np

FIRST_TOKEN = 1000          # stay clear of special tokens at the start of the vocabulary
TOKEN_RANGE = 40000         # SmolLM2's vocabulary has 49,152 entries


def prompt_token_ids(request_id: int, prompt_tokens: int, prefix_hash_ids=None,
                     prefix_block_tokens: int | None = None, seed: int = 0) -> list[int]:
    rng = np.random.default_rng([seed, request_id])
    tokens = FIRST_TOKEN + rng.integers(0, TOKEN_RANGE, size=prompt_tokens, dtype=np.int64)
    if prefix_hash_ids is not None and prefix_block_tokens:
        span = prefix_block_tokens
        covered = min(prompt_tokens, len(prefix_hash_ids) * span)
        positions = np.arange(covered, dtype=np.int64)
        ids = np.asarray(prefix_hash_ids, dtype=np.int64)[positions // span]
        tokens[:covered] = FIRST_TOKEN + (ids * 1_000_003 + (positions % span) * 7_919) % TOKEN_RANGE
    return tokens.tolist()
