"""LeanKV's decode steps, compiled (numba): what the token-level manager does for them.

`leankv_step` runs one decode token for every decoding request of an engine step, on the requests'
token-level arrays (sim/kv/slots.py `RequestKV` and its `TokenState`, grouped per request in a
`RequestArrays`), the steps of `EvictingKVManager` for a `leankv` request with the `every_step`
trigger and the noop / free_block / slot_reuse / compact slot strategies:

A. (per request, in parallel) write the token (`_needs`, `_add_pages` with the pages the scheduler
   reserved, `_place`: the append tail, the first hole of a high page, or a new page);
B. (per request, in parallel; row by row) the importance model's decode attention of the new query
   over the live tokens (`SyntheticImportance.decode_scores`: sink + local + content terms,
   renormalized over the live tokens), LeanKV's `observe` (score += attention) and `compress` (the
   token leaving the window placed high, low or pruned by significance x N against alpha_h /
   alpha_l; `_make_room` demotes / prunes the least significant placed tokens below the bar);
C. (in order: the pool) `_apply`: evictions leave holes, tier moves go hole-first into low pages
   (`_retier`), then the slot strategy (free empty pages; compact each tier);
D. (per request, in parallel) `_stat`.

What the kernel keeps beside the token state: each page's live and written slot counts; per row
three running sums over the live tokens (exp(-age / tau), content weights, live sinks as bits) from
which the attention normalizer follows without a pass; per token a *settled* flag: a placed token
whose significance cannot fall to its tier's bar before its request ends is not visited again
(`_settles`); and per row the *active* tokens (live, not settled) packed in an `ActiveTokens` list:
slot, position, content weight, score and page tier side by side, so B reads a few dense arrays
instead of the scattered slots of a row's pages (on the benchmark a third of the live tokens are
active, spread over all pages: walking the slots was bound by cache misses). An active token's score
lives in the list (the token state's copy is written when it settles or is evicted, and by
`sync_scores` before the token-level manager reads it). B visits a row's list in any order: the
candidates are kept by (significance, slot), as a walk in slot order keeps them. Queries seen and
whether a token has left the window follow from its position (`_seen`). Its twin is the token-level
manager itself (tests/test_fast_leankv.py runs both on the same sampled rows): the same decisions;
the attention mass differs in the last digits (float64 sums where numpy sums float32 pairwise).
Block ids come from and return to the `ArrayBlockPool` stack arrays in the same order.

The requests' arrays reach the kernel as a numba typed List of `RequestArrays` indexed by handle
(set when a request enters, its table grows or its next chunk of content weights is drawn); the
per-request scalars and the step's outputs are NamedTuples of arrays indexed by handle
(`RequestMeta`, `StepStats`), as kernels.py takes its groups (layout.py).
"""
from __future__ import annotations

import os
from typing import NamedTuple

import numpy as np

from ...importance import CHUNK, NUM_SINK
from ...state import TIER_HIGH, TIER_LOW

try:
    from numba import get_num_threads, njit, prange, set_num_threads, typed
except ImportError:          # pragma: no cover - exercised where numba is absent
    njit = None
    prange = range
if os.environ.get("KVSIM_NO_NUMBA"):    # fast mode without compiled kernels: the sampled-row manager
    njit = None


class TokenArrays(NamedTuple):
    """A request's per-slot arrays [rows, slots]: its TokenState's and the kernel's settled flags."""
    live: np.ndarray         # bool
    pos: np.ndarray          # int64: position, -1 = never written
    score: np.ndarray        # float32: attention received (an active token's is in ActiveTokens)
    tier: np.ndarray         # int8: precision the token is stored at
    imp_w: np.ndarray        # float32: content weight
    seen: np.ndarray         # int32: queries seen (LeanKV's OBSERVED; restored when leaving, module doc)
    placed: np.ndarray       # bool: left the window and got a tier (LeanKV's PLACED)
    settled: np.ndarray      # bool: not visited again (module doc)


class PageArrays(NamedTuple):
    """A request's block table [rows, entries] and what the kernel counts per page, its append tail [rows]."""
    table: np.ndarray        # int64: block id, -1 = empty entry
    tier: np.ndarray         # int8: the page's tier
    occ: np.ndarray          # int64: live slots
    written: np.ndarray      # int64: written slots (live or holes)
    tail: np.ndarray         # int64 [rows]: entry of the append tail (-1: none)
    tail_off: np.ndarray     # int64 [rows]: its next slot


class ActiveTokens(NamedTuple):
    """Per row, the live tokens not settled, packed in entries 0 .. count[r]-1 (any order)."""
    count: np.ndarray        # int64 [rows]
    slot: np.ndarray         # int32 [rows, slots]: the token's slot
    pos: np.ndarray          # int32 [rows, slots]: its position
    imp_w: np.ndarray        # float32 [rows, slots]: its content weight
    score: np.ndarray        # float32 [rows, slots]: its score (the current one)
    high: np.ndarray         # bool [rows, slots]: its page is a high page
    index: np.ndarray        # int32 [rows, slots]: slot -> entry (-1: not active)


class RequestArrays(NamedTuple):
    """What the kernel reads and writes of one decoding request."""
    tokens: TokenArrays
    pages: PageArrays
    active: ActiveTokens
    wsum: np.ndarray         # float64 [rows]: content weights written so far
    weights: np.ndarray      # float32 [rows, CHUNK]: the current chunk of content weights
    sums: np.ndarray         # float64 [rows, 3]: running sums over the live tokens (module doc)


class Heads(NamedTuple):
    """The importance model's per-row constants."""
    s: np.ndarray            # float32 [rows]: sink share
    l: np.ndarray            # float32 [rows]: local share
    local_decay: np.ndarray  # float32 [rows, ages]: exp(-age / tau)
    tau: np.ndarray          # float64 [rows]: local decay length
    sink_weights: np.ndarray  # float64 [NUM_SINK]


class StepParams(NamedTuple):
    """Constants of a run's steps: the sampled rows, the pages, LeanKV's parameters, the slot strategy."""
    rows: int
    stride: int              # slots per table entry (the largest tier capacity)
    cap: np.ndarray          # int64 [tiers]: slots a page of each tier holds
    tier_bytes: np.ndarray   # float64 [tiers]: bytes of a token per tier, in token-equivalents
    alpha_h: float
    alpha_l: float
    window: int
    obs_window: int
    strategy: int            # NOOP / FREE_BLOCK / SLOT_REUSE / COMPACT
    hole_first: bool         # new tokens fill the first hole of a high page


class PoolArrays(NamedTuple):
    """The ArrayBlockPool's stack: free ids, ownership, [count]."""
    free: np.ndarray
    owned: np.ndarray
    count: np.ndarray


class StepBatch(NamedTuple):
    """The requests of a step and the pages the scheduler reserved for their tokens."""
    handles: np.ndarray      # int64 [n]
    reserved: np.ndarray     # int64: block ids, request i's at [ends[i-1]:ends[i]] in the pool's order
    ends: np.ndarray         # int64 [n]


class RequestMeta(NamedTuple):
    """Per-request scalars, arrays indexed by handle (int64)."""
    tokens: np.ndarray       # tokens written
    entries: np.ndarray      # table entries in use
    steps: np.ndarray        # decode steps
    evicted: np.ndarray      # evicted token-rows
    error: np.ndarray        # != 0: the step failed (AssertionError in the manager)
    prompt: np.ndarray       # tokens at the prompt cut
    most: np.ndarray         # most tokens the request can reach (prompt + max output tokens)


class StepStats(NamedTuple):
    """What a step leaves per request (float64 arrays indexed by handle; mass_sum sums over steps)."""
    live: np.ndarray         # live slots
    alloc: np.ndarray        # allocated slots
    read: np.ndarray         # tokens read, token-equivalents summed over rows
    pages: np.ndarray        # pages held
    stored: np.ndarray       # tokens stored, token-equivalents summed over rows
    mass: np.ndarray         # attention mass kept this step (mean over rows)
    evicted: np.ndarray      # token-rows evicted this step
    freed: np.ndarray        # pages freed this step
    moved: np.ndarray        # tokens moved to low pages
    moved_bytes: np.ndarray  # ... their bytes, token-equivalents
    compact_bytes: np.ndarray  # bytes compaction moved, token-equivalents
    need: np.ndarray         # pages the next token takes
    mass_sum: np.ndarray     # attention mass summed over the steps


def new_meta(n: int) -> RequestMeta:
    return RequestMeta(*(np.zeros(n, np.int64) for _ in RequestMeta._fields))


def new_stats(n: int) -> StepStats:
    return StepStats(*(np.zeros(n) for _ in StepStats._fields))


def grown(group, extra: int):
    """A NamedTuple of arrays with `extra` zero entries appended to each."""
    return type(group)(*(np.concatenate([a, np.zeros(extra, a.dtype)]) for a in group))


def new_active(rows: int, slots: int) -> ActiveTokens:
    return ActiveTokens(np.zeros(rows, np.int64), np.zeros((rows, slots), np.int32),
                        np.zeros((rows, slots), np.int32), np.zeros((rows, slots), np.float32),
                        np.zeros((rows, slots), np.float32), np.zeros((rows, slots), bool),
                        np.full((rows, slots), -1, np.int32))


def empty_request(rows: int) -> RequestArrays:
    """A free handle's entry of the typed List (holds no request's arrays)."""
    z = (rows, 0)
    tokens = TokenArrays(np.zeros(z, bool), np.zeros(z, np.int64), np.zeros(z, np.float32), np.zeros(z, np.int8),
                         np.zeros(z, np.float32), np.zeros(z, np.int32), np.zeros(z, bool), np.zeros(z, bool))
    pages = PageArrays(np.zeros(z, np.int64), np.zeros(z, np.int8), np.zeros(z, np.int64), np.zeros(z, np.int64),
                       np.zeros(rows, np.int64), np.zeros(rows, np.int64))
    return RequestArrays(tokens, pages, new_active(rows, 0), np.zeros(rows), np.zeros((rows, CHUNK), np.float32),
                         np.zeros((rows, 3)))


def request_list(first: RequestArrays):
    """A typed List of `RequestArrays` (the kernel's arrays by handle), `first` at 0. Made and changed by
    compiled functions only (`store`): from Python, a typed List's methods compile at every start."""
    reqs = typed.List()
    reqs.append(first)
    return reqs


def store(reqs, h, arrays):
    """reqs[h] = arrays (the list grows to h + 1 with `arrays`)."""
    while len(reqs) <= h:
        reqs.append(arrays)
    reqs[h] = arrays


def max_threads() -> int:
    """Threads the parallel step may use at most (numba's NUMBA_NUM_THREADS)."""
    return get_num_threads() if njit is not None else 1


def run_step(threads: int, *args) -> None:
    """`leankv_step(*args)` on at most `threads` threads (sim/kv/fast/compiled/threads.py chooses them; no
    result depends on it), the caller's thread count restored after."""
    before = get_num_threads()
    n = min(threads, before)
    if n == before:
        leankv_step(*args)
        return
    set_num_threads(n)
    try:
        leankv_step(*args)
    finally:
        set_num_threads(before)


HIGH, LOW = TIER_HIGH, TIER_LOW
NOOP, FREE_BLOCK, SLOT_REUSE, COMPACT = 0, 1, 2, 3
STRATEGY_CODES = {"noop": NOOP, "free_block": FREE_BLOCK, "slot_reuse": SLOT_REUSE, "compact": COMPACT}
SAFE = 1.0 + 1e-9              # sc N > alpha (1 + 1e-9) seen implies (sc / seen) N > alpha after rounding
KMAX = 8                       # tokens a row may demote / prune in one decode step (one leaves the window)
# _attend_rows' integer results per row: the leaving slot, its kind (1 high, 2 low, 3 pruned), the
# demoted slot, an error code, then the pruned slots
R_LEAVE, R_KIND, R_DEMOTE, R_ERROR, R_PRUNED = range(5)


def _pop(pool, n, ids):
    """ArrayBlockPool.get_new_blocks (stack order) into ids[:n]."""
    c = pool.count[0]
    for i in range(n):
        b = pool.free[c - 1 - i]
        ids[i] = b
        pool.owned[b] = True
    pool.count[0] = c - n


def _push(pool, n, ids):
    """ArrayBlockPool.free_blocks(ids[:n]) (stack order: ids pushed reversed)."""
    c = pool.count[0]
    for i in range(n):
        b = ids[n - 1 - i]
        pool.owned[b] = False
        pool.free[c + i] = b
    pool.count[0] = c + n


def _activate(A, r, s, p, weight, score, high):
    """Token at slot s of row r joins the row's active list."""
    j = A.count[r]
    A.slot[r, j] = s
    A.pos[r, j] = p
    A.imp_w[r, j] = weight
    A.score[r, j] = score
    A.high[r, j] = high
    A.index[r, s] = j
    A.count[r] = j + 1


def _deactivate(A, r, s):
    """Token at slot s of row r leaves the active list (the list's last entry takes its place)."""
    j = A.index[r, s]
    if j < 0:
        return
    last = A.count[r] - 1
    if j != last:
        t = A.slot[r, last]
        A.slot[r, j] = t
        A.pos[r, j] = A.pos[r, last]
        A.imp_w[r, j] = A.imp_w[r, last]
        A.score[r, j] = A.score[r, last]
        A.high[r, j] = A.high[r, last]
        A.index[r, t] = j
    A.index[r, s] = -1
    A.count[r] = last


def _clear(R, stride, r, s):
    """TokenState.clear_slots of one slot (and its page's live / written counts)."""
    T, P = R.tokens, R.pages
    e = s // stride
    if T.live[r, s]:
        P.occ[r, e] -= 1
        _deactivate(R.active, r, s)
    if T.pos[r, s] >= 0:
        P.written[r, e] -= 1
    T.live[r, s] = False
    T.pos[r, s] = -1
    T.score[r, s] = 0
    T.tier[r, s] = 0
    T.imp_w[r, s] = 0
    T.seen[r, s] = 0
    T.placed[r, s] = False
    T.settled[r, s] = False


def _move(R, stride, r, src, dst):
    """TokenState.move of one live token to an empty or evicted slot (an active one's list entry follows)."""
    T, P, A = R.tokens, R.pages, R.active
    d = dst // stride
    P.occ[r, d] += 1
    if T.pos[r, dst] < 0:
        P.written[r, d] += 1
    j = A.index[r, src]
    if j >= 0:
        A.slot[r, j] = dst
        A.high[r, j] = P.tier[r, d] == HIGH
        A.index[r, dst] = j
        A.index[r, src] = -1
    T.live[r, dst] = T.live[r, src]
    T.pos[r, dst] = T.pos[r, src]
    T.score[r, dst] = T.score[r, src]
    T.tier[r, dst] = T.tier[r, src]
    T.imp_w[r, dst] = T.imp_w[r, src]
    T.seen[r, dst] = T.seen[r, src]
    T.placed[r, dst] = T.placed[r, src]
    T.settled[r, dst] = T.settled[r, src]
    _clear(R, stride, r, src)


def _evict(R, stride, r, s, q, tau):
    """An eviction: the slot becomes a hole (keeping its score); the row's live sums lose the token."""
    T, A, sums = R.tokens, R.active, R.sums
    if not T.live[r, s]:
        return 0
    j = A.index[r, s]
    if j >= 0:
        T.score[r, s] = A.score[r, j]
        _deactivate(A, r, s)
    T.live[r, s] = False
    R.pages.occ[r, s // stride] -= 1
    p = T.pos[r, s]
    sums[r, 0] -= np.exp(-(q - p) / tau[r])
    sums[r, 1] -= np.float64(T.imp_w[r, s])
    if p < NUM_SINK:
        sums[r, 2] -= 2.0 ** p
    return 1


def _release_page(R, stride, r, e):
    """SlotStrategies._release_entries of one page (its id is collected by the caller): its slots
    cleared as `_clear` does, the request's arrays unpacked once (a `_clear` per slot would count
    references to each of them)."""
    T, P = R.tokens, R.pages
    live, pos, score, tier, imp_w, seen, placed, settled = T
    for s in range(e * stride, (e + 1) * stride):
        if live[r, s]:                              # (a released page holds no live token)
            _deactivate(R.active, r, s)
        live[r, s] = False
        pos[r, s] = -1
        score[r, s] = 0
        tier[r, s] = 0
        imp_w[r, s] = 0
        seen[r, s] = 0
        placed[r, s] = False
        settled[r, s] = False
    P.table[r, e] = -1
    P.occ[r, e] = 0
    P.written[r, e] = 0
    if P.tail[r] == e:
        P.tail[r] = -1


def _add_pages(P, meta, h, need, tier, pool, ids):
    """RequestKV.grow + SlotStrategies._add_pages: need[r] pages of `tier` per row from the pool.
    False when the physical table is too small (nothing changed; the caller makes room first)."""
    total = need.sum()
    if total == 0:
        return True
    if not _grow(P, meta, h, need):
        return False
    _pop(pool, total, ids)
    _assign_pages(P, meta.entries[h], need, tier, ids)
    return True


def _grow(P, meta, h, need):
    """RequestKV.grow when a row has fewer empty entries than pages to add: the table's entry count
    (meta.entries[h]) doubles, or grows by what is missing; False when the physical table is too small."""
    table = P.table
    ent = meta.entries[h]
    extra = 0
    for r in range(table.shape[0]):
        if need[r] == 0:
            continue
        free_e = 0
        for e in range(ent):
            if table[r, e] < 0:
                free_e += 1
        extra = max(extra, need[r] - free_e)
    if extra > 0:
        new_ent = max(ent + extra, 2 * ent)
        if new_ent > table.shape[1]:
            return False
        meta.entries[h] = new_ent
    return True


def _assign_pages(P, ent, need, tier, ids):
    """Block ids ids[0:] to need[r] empty entries of each row (row by row; high pages take the lowest
    empty entries, low pages the highest — they grow from opposite ends; ids in entry order)."""
    table, page_tier = P.table, P.tier
    k = 0
    for r in range(table.shape[0]):
        left = need[r]
        if left == 0:
            continue
        if tier == LOW:
            for e in range(ent - 1, -1, -1):
                if left == 0:
                    break
                if table[r, e] < 0:
                    table[r, e] = -2
                    left -= 1
            for e in range(ent):
                if table[r, e] == -2:
                    table[r, e] = ids[k]
                    page_tier[r, e] = tier
                    k += 1
        else:
            for e in range(ent):
                if left == 0:
                    break
                if table[r, e] < 0:
                    table[r, e] = ids[k]
                    page_tier[r, e] = tier
                    k += 1
                    left -= 1


def _first_free(R, cap, stride, ent, r, tier, start):
    """Lowest slot >= start of row r that is empty inside a page of `tier` (hole-first order), or -1."""
    P, live = R.pages, R.tokens.live
    c = cap[tier]
    e0 = start // stride
    for e in range(e0, ent):
        if P.table[r, e] < 0 or P.tier[r, e] != tier or P.occ[r, e] >= c:
            continue
        base = e * stride
        o0 = start - base if e == e0 else 0
        for o in range(max(o0, 0), c):
            if not live[r, base + o]:
                return base + o
    return -1


def _tail_free(P, cap, r):
    t = P.tail[r]
    return t >= 0 and P.tail_off[r] < cap[P.tier[r, t]]


def _row_needs_page(P, cap, ent, r, hole_first):
    """Whether row r has no slot for a new (high) token: SlotStrategies._needs for one token."""
    if not hole_first:
        return not _tail_free(P, cap, r)
    c = cap[HIGH]
    for e in range(ent):
        if P.table[r, e] >= 0 and P.tier[r, e] == HIGH and P.occ[r, e] < c:
            return False
    return True


def _insert(vals, idx, count, v, i):
    """Keep the KMAX smallest (value, slot) pairs, offered in any order."""
    if count < KMAX:
        j = count
        count += 1
    elif v < vals[KMAX - 1] or (v == vals[KMAX - 1] and i < idx[KMAX - 1]):
        j = KMAX - 1
    else:
        return count
    while j > 0 and (vals[j - 1] > v or (vals[j - 1] == v and idx[j - 1] > i)):
        vals[j] = vals[j - 1]
        idx[j] = idx[j - 1]
        j -= 1
    vals[j] = v
    idx[j] = i
    return count


def _release_empty(R, prm, ent, keep_open_tail, pool, ids):
    """SlotStrategies._free_empty_pages: pages without a live token go back to the pool (free_block
    keeps an append tail that still has unwritten slots)."""
    P = R.pages
    n = 0
    for r in range(P.table.shape[0]):
        for e in range(ent):
            if P.table[r, e] < 0 or P.occ[r, e] > 0:
                continue
            if keep_open_tail and P.tail[r] == e and P.tail_off[r] < prm.cap[P.tier[r, e]]:
                continue
            ids[n] = P.table[r, e]
            n += 1
            _release_page(R, prm.stride, r, e)
    _push(pool, n, ids)
    return n


def _compact_tier(R, prm, ent, t, ids):
    """One tier of SlotStrategies._compact: the live tokens of a row's pages beyond the first
    ceil(live / capacity) move into the holes of those first pages (slot order); the emptied pages'
    ids go to ids[:n]. Returns (n, bytes moved); (0, 0) when no row has a page to spare."""
    P, live, tier = R.pages, R.tokens.live, R.tokens.tier
    table, page_tier, stride = P.table, P.tier, prm.stride
    rows = table.shape[0]
    c = prm.cap[t]
    any_release = False
    for r in range(rows):
        n_live, n_pages = 0, 0
        for e in range(ent):
            if table[r, e] >= 0 and page_tier[r, e] == t:
                n_pages += 1
                n_live += P.occ[r, e]
        if n_pages > (n_live + c - 1) // c:
            any_release = True
    if not any_release:
        return 0, 0.0
    moved_bytes = 0.0
    n_ids = 0
    for r in range(rows):
        n_live = 0
        for e in range(ent):
            if table[r, e] >= 0 and page_tier[r, e] == t:
                n_live += P.occ[r, e]
        keep = (n_live + c - 1) // c
        kept, last_kept = 0, -1
        for e in range(ent):
            if table[r, e] >= 0 and page_tier[r, e] == t and kept < keep:
                kept += 1
                last_kept = e
        dst = 0
        for e in range(last_kept + 1, ent):
            if table[r, e] < 0 or page_tier[r, e] != t:
                continue
            for o in range(c):
                s = e * stride + o
                if not live[r, s]:
                    continue
                while True:                     # the next empty slot of a kept page
                    de = dst // stride
                    if table[r, de] >= 0 and page_tier[r, de] == t and dst % stride < c and not live[r, dst]:
                        break
                    dst += 1
                moved_bytes += prm.tier_bytes[tier[r, s]]
                _move(R, stride, r, s, dst)
                dst += 1
        for e in range(last_kept + 1, ent):
            if table[r, e] >= 0 and page_tier[r, e] == t:
                ids[n_ids] = table[r, e]
                n_ids += 1
                _release_page(R, stride, r, e)
    return n_ids, moved_bytes


def _compact(R, prm, ent, pool, ids, stats, h):
    """SlotStrategies._compact, tier by tier; returns the pages freed."""
    freed = 0
    for t in range(3):
        n, moved_bytes = _compact_tier(R, prm, ent, t, ids)
        if n:
            _push(pool, n, ids)
            freed += n
            stats.compact_bytes[h] += moved_bytes
    return freed


def _seen(p, q, prompt, observed):
    """Queries a token at position p live since it was written has seen by query position q: the
    prompt's last `observed` queries (prefill) and every decode query since."""
    return min(max(prompt - p, 0), observed) + q - max(prompt, p) + 1


def _settles(sc, k, n, n_max, bar_alpha):
    """Whether a placed token (score sc, k queries seen, n tokens cached) stays above its tier's bar
    until the request ends (n_max tokens): its significance x N' >= sc N' / (k + N' - n), which only
    falls as N' grows (k <= n) — so at N' = n_max — and its score only grows."""
    return np.float64(sc) * n_max > bar_alpha * (k + n_max - n)


def page_counts(R, prm, tau, ent, q, prompt, n_max, fresh):
    """Fill what the kernel keeps beside the token state: the pages' live (occ) and written slot
    counts, each row's live sums at query position q, (`fresh`: a request starting its decode steps)
    the settled flags, and the active lists (from the token state, whose scores must be current)."""
    T, P, A, sums = R.tokens, R.pages, R.active, R.sums
    live, pos = T.live, T.pos
    stride = prm.stride
    observed = min(prm.obs_window, prompt)
    for r in range(P.table.shape[0]):
        sums[r, 0] = sums[r, 1] = sums[r, 2] = 0.0
        for s in range(live.shape[1]):
            if fresh:
                bar = (prm.alpha_h if T.tier[r, s] == HIGH else prm.alpha_l) * SAFE
                p = pos[r, s]
                T.settled[r, s] = live[r, s] and T.placed[r, s] and _settles(
                    T.score[r, s], _seen(p, q, prompt, observed), q + 1, n_max, bar)
            if live[r, s]:
                sums[r, 0] += np.exp(-(q - pos[r, s]) / tau[r])
                sums[r, 1] += np.float64(T.imp_w[r, s])
                if pos[r, s] < NUM_SINK:
                    sums[r, 2] += 2.0 ** pos[r, s]
    A.count[:] = 0
    A.index[:] = -1
    for r in range(P.table.shape[0]):
        for e in range(P.table.shape[1]):
            P.occ[r, e] = 0
            P.written[r, e] = 0
            if e >= ent or P.table[r, e] < 0:
                continue
            for o in range(stride):
                s = e * stride + o
                if live[r, s]:
                    P.occ[r, e] += 1
                    if not T.settled[r, s]:
                        _activate(A, r, s, pos[r, s], T.imp_w[r, s], T.score[r, s], P.tier[r, e] == HIGH)
                if pos[r, s] >= 0:
                    P.written[r, e] += 1


def sync_scores(score, A):
    """The token state's scores of the active tokens from their list (before the token-level manager
    reads them, or the lists are rebuilt)."""
    for r in range(A.count.shape[0]):
        for j in range(A.count[r]):
            score[r, A.slot[r, j]] = A.score[r, j]


def _drop(j, last, slot_r, pos_r, imp_r, score_r, high_r, index_r):
    """Entry j of a row's active list leaves it: the last entry takes its place (`_deactivate` on one
    row's views)."""
    index_r[slot_r[j]] = -1
    if j != last:
        t = slot_r[last]
        slot_r[j] = t
        pos_r[j] = pos_r[last]
        imp_r[j] = imp_r[last]
        score_r[j] = score_r[last]
        high_r[j] = high_r[last]
        index_r[t] = j


def _attend_rows(R, heads, prm, q, prompt, n_max, res, resi):
    """Decode attention of the query at position q over each row's live tokens (SyntheticImportance:
    sink + local + content terms, renormalized over the live tokens), LeanKV's observe (score +=
    attention) and compress for the row: the leaving token's tier, the demoted token, the pruned
    ones. Writes resi[r, R_*] (the pruned slots from R_PRUNED, -1 after the last) and res[r] = the
    kept attention mass. The normalizer comes from the row's live sums; only the active list is
    visited: a token that settles leaves it (module doc). The request's arrays are unpacked once
    here: a call per row or per token passing them would count references to each."""
    T, A, sums = R.tokens, R.active, R.sums
    settled, score, placed, pos = T.settled, T.score, T.placed, T.pos
    sink_weights, tau, local_decay = heads.sink_weights, heads.tau, heads.local_decay
    n = q + 1
    n_sink = min(NUM_SINK, n)
    sink_total = 0.0
    for i in range(n_sink):
        sink_total += sink_weights[i]
    sink = np.zeros(NUM_SINK + 2, np.float32)           # by position + 1: later positions get 0
    for i in range(n_sink):
        sink[i + 1] = np.float32(sink_weights[i] / sink_total)
    bar = n - prm.window                                # tokens below it have left the window
    nf = np.float64(np.float32(n))
    alpha_h, alpha_l = prm.alpha_h, prm.alpha_l
    bar_h, bar_l = alpha_h * SAFE, alpha_l * SAFE
    # a live token has been live since it was written, so the queries it saw and whether it has left
    # the window follow from its position: the prompt's last `observed` queries saw prompt tokens
    # (prefill), every decode query since saw it; tokens below n - window - 1 were placed
    observed = min(prm.obs_window, prompt)
    placed_below = n - prm.window - 1
    hv = np.empty(KMAX, np.float64)
    hi = np.empty(KMAX, np.int64)
    lv = np.empty(KMAX + 1, np.float64)
    li = np.empty(KMAX + 1, np.int64)
    for r in range(prm.rows):
        live_sinks = np.int64(sums[r, 2])
        sink_kept = 0.0
        for i in range(n_sink):
            if live_sinks >> i & 1:
                sink_kept += sink[i + 1]
        decay = np.exp(-1.0 / tau[r])
        zl = np.float32((1 - decay ** (q + 1)) / (1 - decay))
        ws = np.float32(R.wsum[r])
        sr, lr = heads.s[r], heads.l[r]
        cr = np.float32(np.float32(np.float32(1.0) - sr) - lr)
        decay_r = local_decay[r]
        kept32 = np.float32(sr * sink_kept + lr * sums[r, 0] / zl + cr * sums[r, 1] / ws)
        res[r] = kept32
        denom = max(kept32, np.float32(1e-30))
        inv_denom = np.float32(1.0) / denom
        lr_zl = lr / zl
        cr_ws = cr / ws
        slot_r, pos_r, imp_r, score_r = A.slot[r], A.pos[r], A.imp_w[r], A.score[r]
        high_r, index_r = A.high[r], A.index[r]
        hc, lc = 0, 0
        leave, kind = -1, 0
        j, count = 0, A.count[r]
        while j < count:
            p = np.int64(pos_r[j])
            a = np.float32(np.float32(sr * sink[min(p + 1, NUM_SINK + 1)] + lr_zl * decay_r[q - p])
                           + cr_ws * imp_r[j])
            sc = np.float32(score_r[j] + a * inv_denom)
            score_r[j] = sc
            k = _seen(p, q, prompt, observed)
            if p < placed_below:
                high = high_r[j]
                bar_alpha = bar_h if high else bar_l
                if np.float64(sc) * nf > bar_alpha * k:     # clearly above its tier's bar: not a candidate
                    if _settles(sc, k, n, n_max, bar_alpha):    # ... nor until the request ends
                        s = slot_r[j]
                        settled[r, s] = True
                        score[r, s] = sc
                        count -= 1
                        _drop(j, count, slot_r, pos_r, imp_r, score_r, high_r, index_r)
                        continue                        # entry j is now the list's last one
                    j += 1
                    continue
                sig = np.float64(sc) / k
                x = sig * nf
                if high:
                    if x <= alpha_h:
                        hc = _insert(hv, hi, hc, sig, slot_r[j])
                elif x <= alpha_l:
                    lc = _insert(lv, li, lc, sig, slot_r[j])
            elif p < bar:                               # the token leaving the window
                if leave >= 0:
                    A.count[r] = count
                    resi[r, R_ERROR] = 2                # two tokens left the window in one decode step
                    return
                leave = slot_r[j]
                x = np.float64(sc) / k * nf
                kind = 1 if x > alpha_h else (2 if x > alpha_l else 3)
            j += 1
        A.count[r] = count
        demote = hi[0] if kind == 1 and hc > 0 else -1
        demote_score = np.float64(score_r[index_r[demote]]) if demote >= 0 else 0.0
        _make_room(resi[r], kind, leave, demote, demote_score, lv, li, lc,
                   _seen(pos[r, demote], q, prompt, observed) if demote >= 0 else 1, nf, alpha_l)
        if leave >= 0:
            placed[r, leave] = kind != 3


def _make_room(out, kind, leave, demote, demote_score, lv, li, lc, demote_seen, nf, alpha_l):
    """LeanKV's _make_room for one row: a token entering high demotes the least significant high token
    below the bar (`demote`, -1 if none); tokens entering low (placed low, or demoted) prune the least
    significant low ones below it. Writes the row's results to out[R_*]."""
    k_low = (1 if kind == 2 else 0) + (1 if demote >= 0 else 0)
    if demote >= 0:                                     # the demoted token is a candidate too
        dsig = demote_score / demote_seen
        if dsig * nf <= alpha_l:
            j = lc
            while j > 0 and (lv[j - 1] > dsig or (lv[j - 1] == dsig and li[j - 1] > demote)):
                lv[j] = lv[j - 1]
                li[j] = li[j - 1]
                j -= 1
            lv[j] = dsig
            li[j] = demote
            lc += 1
    out[R_LEAVE], out[R_KIND], out[R_DEMOTE] = leave, kind, demote
    for j in range(KMAX):
        out[R_PRUNED + j] = li[j] if j < min(k_low, lc) else -1


def _place(P, live, cap, stride, ent, r, hole_first):
    """SlotStrategies._place of one new token in row r: the first hole of a high page, or the append
    tail, else the first slot of a high page never written to (the tail follows)."""
    if hole_first:
        c = cap[HIGH]
        for e in range(ent):
            if P.table[r, e] < 0 or P.tier[r, e] != HIGH or P.occ[r, e] >= c:
                continue
            for o in range(c):
                if not live[r, e * stride + o]:
                    return e * stride + o
        return -1
    if _tail_free(P, cap, r):
        s = P.tail[r] * stride + P.tail_off[r]
    else:
        s = -1
        for e in range(ent):
            if P.table[r, e] >= 0 and P.tier[r, e] == HIGH and P.written[r, e] == 0:
                s = e * stride
                break
    P.tail[r] = s // stride
    P.tail_off[r] = s % stride + 1
    return s


def _write_tokens(R, prm, heads, meta, h, reserved):
    """Part A for one request: the pages its token needs (the scheduler reserved them: `reserved`, in
    the pool's order) and the token's write in every row, where `_place` puts it (an empty slot or a
    hole, cleared as TokenState.clear_slots does); it joins the row's active list. False on a
    mismatch (meta.error set)."""
    T, P, A = R.tokens, R.pages, R.active
    live, pos, score, tier, imp_w, seen, placed, settled = T
    occ, written = P.occ, P.written
    cap, stride, rows = prm.cap, prm.stride, prm.rows
    need = np.zeros(rows, np.int64)
    for r in range(rows):
        if _row_needs_page(P, cap, meta.entries[h], r, prm.hole_first):
            need[r] = 1
    if need.sum() != reserved.shape[0] or not _grow(P, meta, h, need):
        meta.error[h] = 1
        return False
    ent = meta.entries[h]
    _assign_pages(P, ent, need, HIGH, reserved)
    q = meta.tokens[h]
    sums, tau = R.sums, heads.tau
    for r in range(rows):
        weight = R.weights[r, q % CHUNK]
        s = _place(P, live, cap, stride, ent, r, prm.hole_first)
        e = s // stride
        if pos[r, s] >= 0:
            written[r, e] -= 1
        score[r, s] = 0
        seen[r, s] = 0
        placed[r, s] = False
        settled[r, s] = False
        live[r, s] = True
        pos[r, s] = q
        tier[r, s] = HIGH
        imp_w[r, s] = weight
        occ[r, e] += 1
        written[r, e] += 1
        j = A.count[r]
        A.slot[r, j], A.pos[r, j], A.imp_w[r, j], A.score[r, j], A.high[r, j] = s, q, weight, 0.0, True
        A.index[r, s] = j
        A.count[r] = j + 1
        R.wsum[r] += np.float64(weight)
        sums[r, 0] = sums[r, 0] * np.exp(-1.0 / tau[r]) + 1.0
        sums[r, 1] += np.float64(weight)
        if q < NUM_SINK:
            sums[r, 2] += 2.0 ** q
    return True


def _reset_step(stats, h):
    """The per-step outputs of request h back to 0 (mass_sum keeps summing)."""
    stats.live[h] = stats.alloc[h] = stats.read[h] = stats.pages[h] = stats.stored[h] = 0.0
    stats.mass[h] = stats.evicted[h] = stats.freed[h] = stats.moved[h] = 0.0
    stats.moved_bytes[h] = stats.compact_bytes[h] = stats.need[h] = 0.0


def leankv_step(reqs, batch, heads, prm, pool, ids, meta, stats):
    """One decode token for each request of `batch` (module doc). reqs[h] = request h's arrays,
    meta / stats: per-request scalars and outputs by handle; ids: scratch for block ids."""
    handles = batch.handles
    n_req = handles.shape[0]
    rows = prm.rows
    # A. the writes (in parallel: each request takes the pages the scheduler reserved for it, in the
    # order the pool would have handed them out)
    for i in prange(n_req):
        h = handles[i]
        start = batch.ends[i - 1] if i > 0 else 0
        _write_tokens(reqs[h], prm, heads, meta, h, batch.reserved[start:batch.ends[i]])
    for i in range(n_req):
        if meta.error[handles[i]] != 0:
            return
    # B. attention and LeanKV's decision, row by row (requests independent: in parallel)
    res = np.zeros(n_req * rows)
    resi = np.full((n_req * rows, R_PRUNED + KMAX), -1, np.int64)
    for i in prange(n_req):
        h = handles[i]
        k = i * rows
        _attend_rows(reqs[h], heads, prm, meta.tokens[h], meta.prompt[h], meta.most[h], res[k:k + rows],
                     resi[k:k + rows])
    # C. each request's decision applied (evictions, moves to low pages, the slot strategy), in order
    for i in range(n_req):
        h = handles[i]
        q = meta.tokens[h]
        _reset_step(stats, h)
        meta.tokens[h] += 1
        meta.steps[h] += 1
        decision = False
        mass = 0.0
        k0 = i * rows
        for r in range(rows):
            if resi[k0 + r, R_ERROR] >= 0:
                meta.error[h] = resi[k0 + r, R_ERROR]
                return
            mass += res[k0 + r] / rows
            if resi[k0 + r, R_KIND] >= 2 or resi[k0 + r, R_DEMOTE] >= 0 or resi[k0 + r, R_PRUNED] >= 0:
                decision = True
        stats.mass[h] = mass
        stats.mass_sum[h] += mass
        if decision:
            if not _apply(reqs[h], prm, meta, stats, h, resi[k0:k0 + rows], pool, ids, q, heads.tau):
                meta.error[h] = 1
                return
            meta.evicted[h] += np.int64(stats.evicted[h])
    for i in prange(n_req):                             # D. each request's counts (in parallel)
        h = handles[i]
        _stats(reqs[h].pages, prm, meta.entries[h], stats, h)


def _apply(R, prm, meta, stats, h, resi, pool, ids, q, tau):
    """EvictingKVManager._apply of LeanKV's decision (resi[r] = _attend_rows' result for row r):
    evictions, the move to low pages, the slot strategy. False when the table is too small."""
    P, tier = R.pages, R.tokens.tier
    stride = prm.stride
    rows = P.table.shape[0]
    ent = meta.entries[h]
    evicted = 0
    src = np.full((rows, 2), -1, np.int64)              # tokens moving to low pages, in slot order
    to_low = np.zeros(rows, np.int64)
    for r in range(rows):
        leave, kind, d = resi[r, R_LEAVE], resi[r, R_KIND], resi[r, R_DEMOTE]
        for j in range(KMAX):                           # a pruned demoted token is evicted where it is
            s = resi[r, R_PRUNED + j]
            if s < 0:
                break
            if s == d:
                d = -1
            evicted += _evict(R, stride, r, s, q, tau)
        if kind == 3:
            evicted += _evict(R, stride, r, leave, q, tau)
        a = leave if kind == 2 else -1
        if a >= 0 and d >= 0:
            src[r, 0], src[r, 1] = min(a, d), max(a, d)
        elif a >= 0 or d >= 0:
            src[r, 0] = max(a, d)
        to_low[r] = (src[r, 0] >= 0) + (src[r, 1] >= 0)
    stats.evicted[h] = evicted
    if to_low.sum() > 0:
        need = np.zeros(rows, np.int64)
        c = prm.cap[LOW]
        for r in range(rows):
            free_cnt = 0
            for e in range(ent):
                if P.table[r, e] >= 0 and P.tier[r, e] == LOW:
                    free_cnt += c - P.occ[r, e]
            need[r] = (max(to_low[r] - free_cnt, 0) + c - 1) // c
        if need.sum() <= pool.count[0]:                 # else no room: the tokens keep their tier
            if not _add_pages(P, meta, h, need, LOW, pool, ids):
                return False
            ent = meta.entries[h]
            moved_bytes = 0.0
            for r in range(rows):
                dst = 0
                for j in range(2):
                    s = src[r, j]
                    if s < 0:
                        continue
                    dst = _first_free(R, prm.cap, stride, ent, r, LOW, dst)
                    moved_bytes += prm.tier_bytes[tier[r, s]]
                    _move(R, stride, r, s, dst)
                    tier[r, dst] = LOW
                    dst += 1
            stats.moved_bytes[h] = moved_bytes
            stats.moved[h] = to_low.sum()
    if prm.strategy != NOOP:
        stats.freed[h] += _release_empty(R, prm, ent, prm.strategy == FREE_BLOCK, pool, ids)
    if prm.strategy == COMPACT:
        stats.freed[h] += _compact(R, prm, ent, pool, ids, stats, h)
    return True


def _stats(P, prm, ent, stats, h):
    """EvictingKVManager._stat (live and allocated slots, reads and stored bytes in token-equivalents
    summed over rows, pages: a page's written slots all hold its tier) and the next token's pages."""
    cap, tier_bytes = prm.cap, prm.tier_bytes
    n_live, alloc, pages = 0, 0, 0
    read, stored = 0.0, 0.0
    for r in range(P.table.shape[0]):
        for e in range(ent):
            if P.table[r, e] < 0:
                continue
            t = P.tier[r, e]
            pages += 1
            alloc += cap[t]
            n_live += P.occ[r, e]
            read += P.written[r, e] * tier_bytes[t]
            stored += P.occ[r, e] * tier_bytes[t]
    stats.live[h] = n_live
    stats.alloc[h] = alloc
    stats.read[h] = read
    stats.stored[h] = stored
    stats.pages[h] = pages
    stats.need[h] = next_token_pages(P, cap, ent, prm.hole_first)


def next_token_pages(P, cap, ent, hole_first):
    """Rows without a slot for the next new token (the pages it will take)."""
    need = 0
    for r in range(P.table.shape[0]):
        if _row_needs_page(P, cap, ent, r, hole_first):
            need += 1
    return need


if njit is not None:
    # the per-slot helpers are inlined: a call passing a request's arrays would count references to
    # each of them (atomic increments and decrements that cost more than the helper)
    for _name in ("_pop", "_push", "_activate", "_deactivate", "_clear", "_move", "_evict", "_first_free",
                  "_tail_free", "_row_needs_page", "_seen", "_settles", "_insert", "_drop", "_place"):
        globals()[_name] = njit(cache=True, nogil=True, error_model="numpy", inline="always")(globals()[_name])
    for _name in ("_release_page", "_add_pages", "_grow", "_assign_pages", "_release_empty", "_attend_rows", "_make_room",
                  "_compact_tier", "_compact", "page_counts", "sync_scores", "_write_tokens", "_reset_step", "_apply",
                  "_stats", "next_token_pages", "request_list", "store"):
        globals()[_name] = njit(cache=True, nogil=True, error_model="numpy")(globals()[_name])
    leankv_step = njit(cache=True, nogil=True, error_model="numpy", parallel=True)(leankv_step)
