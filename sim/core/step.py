"""What one engine step asks of the hardware (the input of every executor's cost) and what it took.

Fields are plain numbers for one step, or equal-length float64 numpy arrays for a run of
steps (the simulator's decode fast-forward); the cost model must broadcast over both and give
bit-identical results either way.
"""
from __future__ import annotations

from dataclasses import dataclass
from operator import attrgetter
from typing import TYPE_CHECKING

import numpy as np

from .kv_manager import KVCacheManager

if TYPE_CHECKING:
    from .protocols import KVManager
    from .scheduler import SchedulerOutput

ArrayLike = float | int | np.ndarray
_REQUEST = attrgetter("request")


@dataclass
class BatchShape:
    num_seqs: ArrayLike = 0              # sequences in the batch (prefill chunks + decodes)
    num_prefill_tokens: ArrayLike = 0    # new prompt tokens computed this step
    num_decode_tokens: ArrayLike = 0     # one per decoding sequence
    attn_pairs_prefill: ArrayLike = 0    # sum over prefill chunks of chunk * (context_before + (chunk + 1) / 2)
    kv_tokens_read: ArrayLike = 0        # KV token-equivalents (fp16/bf16) read by attention, all seqs
    bytes_moved: ArrayLike = 0           # bytes copied/moved by sparse copy / compaction
    swap_bytes: ArrayLike = 0            # bytes over PCIe for swap preemption
    block_table_entries: ArrayLike = 0   # block-table entries touched (grows x layers x heads in per_head)
    op_bytes: ArrayLike = 0              # bytes read + written by KV-policy operations (metric, sort, table
    op_flops: ArrayLike = 0              # rewrite, quantization; sim.kv) and their FLOPs, all KV heads
    op_kernels: ArrayLike = 0            # small kernels a KV policy launches on each GPU (TokenSelect's selection),
    #                                      each at the profile's gemm_latency_s
    # KV token-equivalents a padded decode attention scans: every decoding sequence padded to the widest
    # block table of the step (whole blocks, holes included). Paged GPU kernels do not pad (their
    # profiles give it no cost); a dense gather over [seqs, widest table] (the real backend's CPU
    # attention) does. None = not computed: priced as kv_tokens_read in steps without prefill tokens.
    kv_tokens_padded: ArrayLike | None = None
    # Query-key pairs of prefill chunks when each chunk attends over the widest block table of the
    # step (dead slots masked) plus itself: sum of chunk * (widest table slots + chunk). The CPU
    # attention computes these; None = not computed: priced as attn_pairs_prefill.
    attn_pairs_prefill_padded: ArrayLike | None = None
    # Rows the LM head computes logits for: one per sequence, plus one per draft token a speculative
    # decoding step verifies (vLLM computes the logits of every verified position). None = num_seqs.
    num_logit_rows: ArrayLike | None = None

    @property
    def num_tokens(self) -> ArrayLike:
        return self.num_prefill_tokens + self.num_decode_tokens


@dataclass
class StepResult:
    """What an executor reports of one step (a row of the step log with the scheduler's counts)."""
    duration_s: float
    predicted_s: float = float("nan")
    evicted_tokens: int = 0
    blocks_freed_by_eviction: int = 0
    bytes_moved: int = 0
    shape: BatchShape | None = None      # what the step asked of the hardware (as priced), for the log


def batch_shape(out: SchedulerOutput, kv: KVManager, kv_bytes_per_token: float = 0.0) -> BatchShape:
    """The cost-relevant shape of one scheduled step (shared by every executor); `bytes_moved` and
    the policy-operation fields are the executor's to fill in (they come from the KV manager's plan)."""
    if out.decode_contexts is not None and type(kv) is KVCacheManager:
        return _decodes_shape(out, kv, out.decode_contexts, kv_bytes_per_token)
    prefill_tokens = decode_tokens = 0
    attn_pairs = 0.0
    kv_read: float = 0
    num_decode = 0
    chunk_sq = 0
    drafts = 0
    for s in out.scheduled:
        n = s.num_new_tokens
        if s.is_prefill:
            prefill_tokens += n
            attn_pairs += n * (s.context_before + (n + 1) / 2)
            chunk_sq += n * n
        else:
            decode_tokens += n
            num_decode += 1
            if n > 1:
                # speculative decoding's verification: n queries (the sampled token and the drafts) over
                # the context, causally; the attention reads the context once (kv_read below) and its
                # compute grows by the query-key pairs beyond one query's (counted with the prefill pairs)
                c = s.context_before
                attn_pairs += n * (c + (n + 1) / 2) - (c + n)
                drafts += s.num_spec_tokens
        kv_read += s.context_before + n
    reqs = list(map(_REQUEST, out.scheduled))
    # the plain manager's for the whole batch at once (no call per request), as its block_table_entries
    sizes = kv.block_table_entries_of(reqs) if type(kv) is KVCacheManager else list(map(kv.block_table_entries, reqs))
    entries = sum(sizes)
    widest = max(sizes, default=0)
    swap_tokens = out.swap_out_tokens + out.swap_in_tokens
    widest_slots = widest * kv.block_size / kv.table_rows
    return BatchShape(
        num_seqs=len(out.scheduled),
        num_prefill_tokens=prefill_tokens,
        num_decode_tokens=decode_tokens,
        attn_pairs_prefill=attn_pairs,
        kv_tokens_read=kv_read,
        swap_bytes=swap_tokens * kv_bytes_per_token,
        block_table_entries=entries,
        kv_tokens_padded=num_decode * widest_slots,
        attn_pairs_prefill_padded=prefill_tokens * widest_slots + chunk_sq,
        num_logit_rows=len(out.scheduled) + drafts if drafts else None,
    )



def _decodes_shape(out: SchedulerOutput, kv: KVCacheManager, contexts: list, kv_bytes_per_token: float) -> BatchShape:
    """`batch_shape` of a step whose requests each decode one token (`out.decode_contexts`: the plain
    manager's contexts, whole token counts, so their sum is the loop's exactly), without the loop."""
    n = len(contexts)
    sizes = kv.block_table_entries_of(list(map(_REQUEST, out.scheduled)))
    widest_slots = max(sizes, default=0) * kv.block_size / kv.table_rows
    swap_tokens = out.swap_out_tokens + out.swap_in_tokens
    return BatchShape(
        num_seqs=n,
        num_prefill_tokens=0,
        num_decode_tokens=n,
        attn_pairs_prefill=0.0,
        kv_tokens_read=sum(contexts) + n,
        swap_bytes=swap_tokens * kv_bytes_per_token,
        block_table_entries=sum(sizes),
        kv_tokens_padded=n * widest_slots,
        attn_pairs_prefill_padded=0 * widest_slots + 0,
        num_logit_rows=None,
    )
