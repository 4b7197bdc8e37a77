"""Fast mode's data layout: the per-row scalar fields of the slab and the named groups of arrays the
decode kernel and its numpy twins take (numba compiles NamedTuples of arrays and scalars)."""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

# per-row scalars, fields of one [slots, rows, fields] array so a step gathers / scatters them at once
TAIL, TAIL_WRITTEN, NCOL, PAGES, LIVE, HOLE, HOLED, LIST_LEN = range(8)
ROW_FIELDS = {"tail": TAIL, "tail_w": TAIL_WRITTEN, "ncol": NCOL, "pages": PAGES, "live": LIVE, "hole_col": HOLE,
              "holed": HOLED, "hn": LIST_LEN}

NUM_CANDIDATES = 8           # candidates the kernel keeps per scored row between full list scans
A, CW, E = range(3)          # fields of a listed token's score terms (terms[..., field])
REBASE = 500.0               # rebase a row's local terms when (t - eref) / tau passes this (exp(500) fits)


class SlabArrays(NamedTuple):
    """The slab, flattened to rows (flat row q = slot * rows + row): what a decode step updates."""
    row_state: np.ndarray    # int32 [rows, len(ROW_FIELDS)]
    occ: np.ndarray          # int32 [rows, cols]: live tokens per page column
    win: np.ndarray          # int32 [rows, cols]: ... of which in the recent window
    alive: np.ndarray        # bool [rows, cols]: the column holds a page
    ring: np.ndarray         # int32 [rows, window]: page column of position p at p % window
    num_tokens: np.ndarray   # int64 [slots]: tokens written per slot
    heavy: np.ndarray        # int32 [rows * list_cap]: columns of each row's listed (non-window) tokens


class StepFlags(NamedTuple):
    """Constants of a run's decode step: sizes, the policy's shape and the slot strategy."""
    block_size: int
    window: int              # protected recent tokens (0 = none)
    budget: int              # tokens kept per row (-1 = no decode eviction)
    track: bool              # page columns tracked (False: noop, counts only)
    append: bool             # append strategies write at the tail page
    reuse: bool              # reuse strategies fill the first hole
    frees: bool              # an emptied page is freed
    sparse: bool             # sparse / holed copy rewrite holed pages
    compact: bool            # compaction strategies
    evict_leaving: bool      # "oldest": the token leaving the window is evicted
    scored: bool             # "young" (H2O): evict the lowest closed-form accumulated attention
    list_cap: int            # entries of each row's heavy list


class ScoreArrays(NamedTuple):
    """H2O's closed-form scores of the scored rows (see scoring.py Scorer.pick_scored); empty when unscored."""
    local: np.ndarray        # [sample rows]: local share l of each head row
    inv_tau: np.ndarray      # [sample rows]: 1 / local decay tau
    content: np.ndarray      # [sample rows]: content share c = 1 - sink share - local share
    sigma: np.ndarray        # [rows]: the request's content concentration
    norm: np.ndarray         # [rows]: content normalizer Zw (sum of content weights so far)
    hsum: np.ndarray         # [rows]: running sum H of 1 / Zw
    eref: np.ndarray         # [rows]: reference position of the listed local terms E
    ring_static: np.ndarray  # [rows * window]: static part A of each window token
    ring_content: np.ndarray  # [rows * window]: content coefficient CW of each window token
    terms: np.ndarray        # [rows * list_cap, 3]: A, CW, E of each listed token
    cand: np.ndarray         # [rows, NUM_CANDIDATES, 4]: the kernel's candidates (list index, A, CW, E)
    thr: np.ndarray          # [rows]: the lowest score an entry had when it was left out of the candidates


class StepOutputs(NamedTuple):
    """What a decode step writes per slot: per slot of S (evicted, left) and per slot id (the rest)."""
    evicted: np.ndarray      # [len(S)]: (token, row) evictions
    left: np.ndarray         # [len(S)]: rows left to the caller's exact path
    need_next: np.ndarray    # [slots]: pages the next one-token write takes
    slot_live: np.ndarray    # [slots]: live tokens over all rows
    slot_pages: np.ndarray   # [slots]: pages over all rows


EMPTY_SCORES = ScoreArrays(np.zeros(0), np.zeros(0), np.zeros(0), np.zeros(0), np.zeros(0), np.zeros(0),
                           np.zeros(0), np.zeros(0), np.zeros(0), np.zeros((0, 3)),
                           np.zeros((0, NUM_CANDIDATES, 4)), np.zeros(0))
