"""Token-level KV state of one request, indexed by (row, slot) and vectorized over rows.

A *row* is one (layer, KV head) in the `per_head` layout (`rows = layers * kv_heads`, row
`l * kv_heads + h`), or the whole request in the `shared` layout (`rows = 1`: a token is kept or
evicted for every layer and head at once, as one vLLM block slot holds all of them).

Columns are *slots*, not positions: slot `s` of a row lives in page-table entry
`s // slot_stride` at offset `s % slot_stride`. A token carries its position with it (`pos`), so
slot managers may move tokens (compaction, sparse copy, slot reuse) and policies never care where a
token sits. Per-slot arrays (`live`, `pos`, `score`, `precision group` and every array a policy registers with
`add_field`) are permuted together whenever tokens move.
"""
from __future__ import annotations

import numpy as np

PRECISION_FULL = 0      # the cache dtype (fp16/bf16)
PRECISION_HIGH = 1      # LeanKV high precision (e.g. K8V4)
PRECISION_LOW = 2       # LeanKV low precision (e.g. K4V2)


class TokenState:
    """Per-request token state. Arrays are [rows, num_slots]; empty slots have pos == -1."""

    def __init__(self, rows: int, num_slots: int = 0):
        self.rows = rows
        self.num_tokens = 0                  # positions 0 .. num_tokens-1 were written
        self.num_steps_observed = 0          # queries whose scores were accumulated into `score`
        self.live = np.zeros((rows, num_slots), dtype=bool)
        self.pos = np.full((rows, num_slots), -1, dtype=np.int64)
        self.score = np.zeros((rows, num_slots), dtype=np.float32)   # attention received, summed
        self.precision = np.zeros((rows, num_slots), dtype=np.int8)
        self._fields: dict[str, tuple[np.ndarray, object]] = {}
        # the request, as the eviction-aware manager tags it at admission (None in standalone use)
        self.request_id: int | None = None
        self.prompt_tokens: int | None = None     # a recompute prefills generated tokens too
        self.decode_compressions = 0              # decode steps a policy has been asked to compress at

    # ----- per-slot arrays -----------------------------------------------------------------
    @property
    def num_slots(self) -> int:
        return self.live.shape[1]

    def add_field(self, name: str, dtype, fill=0) -> np.ndarray:
        """Register a per-slot array that moves with its tokens; returns it (re-fetch with `field`)."""
        if name not in self._fields:
            self._fields[name] = (np.full((self.rows, self.num_slots), fill, dtype=dtype), fill)
        return self._fields[name][0]

    def field(self, name: str) -> np.ndarray:
        return self._fields[name][0]

    def has_field(self, name: str) -> bool:
        return name in self._fields

    def _arrays(self):
        yield "live", False
        yield "pos", -1
        yield "score", 0
        yield "precision", 0

    def resize(self, num_slots: int) -> None:
        """Grow (or shrink) the slot dimension; new slots are empty."""
        old = self.num_slots
        if num_slots == old:
            return
        for name, fill in self._arrays():
            setattr(self, name, _resized(getattr(self, name), num_slots, fill))
        for name, (arr, fill) in self._fields.items():
            self._fields[name] = (_resized(arr, num_slots, fill), fill)

    def move(self, rows: np.ndarray, src: np.ndarray, dst: np.ndarray) -> None:
        """Move tokens at (rows, src) slots to (rows, dst) slots; the sources become empty."""
        if len(rows) == 0:
            return
        arrays = [(self.live, False), (self.pos, -1), (self.score, 0), (self.precision, 0)]
        arrays += list(self._fields.values())
        for arr, fill in arrays:
            vals = arr[rows, src]
            arr[rows, src] = fill
            arr[rows, dst] = vals

    def clear_slots(self, rows: np.ndarray, slots: np.ndarray) -> None:
        """Empty the given slots (a freed block)."""
        self.live[rows, slots] = False
        self.pos[rows, slots] = -1
        self.score[rows, slots] = 0
        self.precision[rows, slots] = 0
        for arr, fill in self._fields.values():
            arr[rows, slots] = fill

    # ----- views policies use --------------------------------------------------------------
    def live_counts(self) -> np.ndarray:
        """Live tokens per row, int64 [rows]."""
        return self.live.sum(axis=1)

    def age(self) -> np.ndarray:
        """num_tokens - 1 - pos: 0 for the newest token (meaningless where not live)."""
        return self.num_tokens - 1 - self.pos

    @classmethod
    def dense(cls, rows: int, num_tokens: int) -> TokenState:
        """A state with tokens 0..num_tokens-1 in slots 0..num_tokens-1 of every row (tests, tools)."""
        st = cls(rows, num_tokens)
        st.live[:] = True
        st.pos[:] = np.arange(num_tokens)
        st.num_tokens = num_tokens
        return st


def _resized(arr: np.ndarray, n: int, fill) -> np.ndarray:
    out = np.full((arr.shape[0], n), fill, dtype=arr.dtype)
    m = min(n, arr.shape[1])
    out[:, :m] = arr[:, :m]
    return out
