"""Requests on shared documents, for the tests of prefix reuse across a fleet (the connector, the CPU
tier, the routers): each request is one of a few documents (chunks of 256 tokens, ids as Mooncake's
hash_ids) plus a question of its own (20-199 tokens), arriving as a Poisson process; and what those tests
compare between two runs of them (`request_frame`)."""
from __future__ import annotations

import numpy as np
import pandas as pd

from kvsim.sim.core.request import Request


def document_requests(n: int, seed: int, *, documents: int, chunks: tuple[int, int], mean_gap_s: float,
                      max_output: int) -> list[Request]:
    """`n` requests over `documents` documents of chunks[0]..chunks[1]-1 chunks each, a mean gap of
    `mean_gap_s` between arrivals and 8..max_output-1 output tokens."""
    rng = np.random.default_rng(seed)
    docs = [tuple(range(100 * d, 100 * d + int(rng.integers(*chunks)))) for d in range(documents)]
    reqs, t = [], 0.0
    for i in range(n):
        doc = docs[int(rng.integers(len(docs)))]
        t += float(rng.exponential(mean_gap_s))
        reqs.append(Request(request_id=i, arrival_time=t, prompt_tokens=256 * len(doc) + int(rng.integers(20, 200)),
                            max_output_tokens=int(rng.integers(8, max_output)), prefix_hash_ids=doc + (10_000 + i,),
                            prefix_block_tokens=256))
    return reqs


def request_frame(requests: list[Request]) -> pd.DataFrame:
    """What two runs of the same requests must agree on (stepped against fast-forwarded, ...): each request's
    status, replica, first token and finish times, its external and cached tokens and its KV transfers."""
    return pd.DataFrame([{"id": r.request_id, "status": int(r.status), "replica": r.replica,
                          "first": r.token_times[0] if r.token_times else None, "finish": r.finish_time,
                          "external": r.num_external_computed_tokens, "cached": r.num_cached_tokens,
                          "transfers": r.route.transfers if r.route else None} for r in requests])
