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
    copy_threshold: int = 0  # copy strategies: holes a row holds before its rewrite (0: rewrite any holed row)


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


class RowConsts(NamedTuple):
    """The scored rows' head constants, one entry per flat row of a step (gathered from ScoreArrays'
    local, inv_tau and content by each flat row's row)."""
    local: np.ndarray        # local share l
    inv_tau: np.ndarray      # 1 / local decay tau
    content: np.ndarray      # content share c


class DecodeRows(NamedTuple):
    """The rows a decode step scores, one entry per (slot, row) pair: what the numpy twins of the
    kernel's per-row parts (`scored_step_np`, `evict_lowest_np`) read per row."""
    q: np.ndarray            # int: flat row (slot * rows + row)
    t_new: np.ndarray        # int: position of the newest token (the step's query)
    z: np.ndarray            # its content draw ~ N(0, 1)
    over: np.ndarray         # bool: the row is over its budget (evicts one token)
    exits: np.ndarray        # bool: a token leaves the recent window
    exit_col: np.ndarray     # int: the leaving token's page column


class ExitScores(NamedTuple):
    """Per row, what the scoring of the new token hands to the eviction (the kernel's `_scored_exit`
    returns the same): H and g after the query, and the leaving token's score and terms."""
    h_now: np.ndarray        # H: running sum of 1 / Zw
    decay_now: np.ndarray    # g = d^(t_q + 1 - eref): a listed token's local part is E g
    score: np.ndarray        # the leaving token's score (inf when none leaves)
    terms: np.ndarray        # [rows, 3]: its A, CW, E


class PromptRows(NamedTuple):
    """The prompt cut's per-row inputs (`kernels.prompt_inputs` and the heads): what `prompt_cut` and
    its numpy twins score."""
    weight: np.ndarray       # [rows, L]: content weights exp(sigma z)
    decay: np.ndarray        # [rows, L]: d^(L - 1 - t)
    local: np.ndarray        # [rows]: local share l
    content: np.ndarray      # [rows]: content share c
    top: np.ndarray          # [rows]: d^-(obs - 1)
    shift: np.ndarray        # [rows]: d


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
