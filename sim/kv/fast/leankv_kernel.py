"""LeanKV's decode steps, compiled (numba): what the token-level manager does for them.

`leankv_step` runs one decode token for every decoding request of an engine step, on the requests'
token-level arrays (sim/kv/slots.py `RequestKV` and its `TokenState`, by address), the steps of
`EvictingKVManager` for a `leankv` request with the `every_step` trigger and the noop / free_block /
slot_reuse / compact slot strategies:

A. (per request, in parallel) write the token (`_needs`, `_add_pages` with the pages the scheduler
   reserved, `_place`: the append tail, the first hole of a high page, or a new page);
B. (per request and row, in parallel) the importance model's decode attention of the new query over
   the live tokens (`SyntheticImportance.decode_scores`: sink + local + content terms, renormalized
   over the live tokens), LeanKV's `observe` (score += attention) and `compress` (the token leaving
   the window placed high, low or pruned by significance x N against alpha_h / alpha_l; `_make_room`
   demotes / prunes the least significant placed tokens below the bar);
C. (in order: the pool) `_apply`: evictions leave holes, tier moves go hole-first into low pages
   (`_retier`), then the slot strategy (free empty pages; compact each tier);
D. (per request, in parallel) `_stat`.

What the kernel keeps beside the token state: each page's live and written slot counts; per row
three running sums over the live tokens (exp(-age / tau), content weights, live sinks as bits) from
which the attention normalizer follows without a pass; and per token a *settled* flag: a placed
token whose significance cannot fall to its tier's bar before its request ends is not visited again
(`_settles`). Queries seen and whether a token has left the window follow from its position
(`_seen`). Its twin is the token-level manager itself (tests/test_fast_leankv.py runs both on the
same sampled rows): the same decisions; the attention mass differs in the last digits (float64 sums
where numpy sums float32 pairwise). Block ids come from and return to the `ArrayBlockPool` stack
arrays in the same order.
"""
from __future__ import annotations

import os

import numpy as np

from ..importance import CHUNK, NUM_SINK
from ..state import TIER_HIGH, TIER_LOW

try:
    from numba import carray, get_num_threads, njit, prange, set_num_threads
    from numba.core import cgutils, types
    from numba.extending import intrinsic
except ImportError:          # pragma: no cover - exercised where numba is absent
    njit = None
    prange = range
if os.environ.get("KVSIM_NO_NUMBA"):    # fast mode without compiled kernels: the sampled-row manager
    njit = None
if njit is not None:
    @intrinsic
    def _ptr(typingctx, address):
        """The int64 address of a numpy array's data as a pointer (numba.carray views it)."""
        def codegen(context, builder, signature, args):
            return builder.inttoptr(args[0], cgutils.voidptr_t)
        return types.voidptr(types.int64), codegen


def max_threads() -> int:
    """Threads the parallel step may use at most (numba's NUMBA_NUM_THREADS)."""
    return get_num_threads() if njit is not None else 1


def run_step(threads: int, *args) -> None:
    """`leankv_step(*args)` on at most `threads` threads (sim/kv/fast/threads.py chooses them; no
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
# stats[handle, ...] of leankv_step (all per step but OUT_MASS_SUM)
OUT_LIVE, OUT_ALLOC, OUT_READ, OUT_PAGES, OUT_STORED, OUT_MASS, OUT_EVICTED, OUT_FREED, OUT_MOVED, \
    OUT_MOVED_BYTES, OUT_COMPACT_BYTES, OUT_NEED, OUT_ERROR, OUT_MASS_SUM = range(14)
OUT_SIZE = 16


def _pop(pool, n, ids):
    """ArrayBlockPool.get_new_blocks (stack order) into ids[:n]."""
    free, owned, count = pool
    c = count[0]
    for i in range(n):
        b = free[c - 1 - i]
        ids[i] = b
        owned[b] = True
    count[0] = c - n


def _push(pool, n, ids):
    """ArrayBlockPool.free_blocks(ids[:n]) (stack order: ids pushed reversed)."""
    free, owned, count = pool
    c = count[0]
    for i in range(n):
        b = ids[n - 1 - i]
        owned[b] = False
        free[c + i] = b
    count[0] = c + n


def _clear(T, P, stride, r, s):
    """TokenState.clear_slots of one slot (and its page's live / written counts)."""
    live, pos, score, tier, imp_w, seen, placed, settled = T
    occ, wr = P[2], P[3]
    e = s // stride
    if live[r, s]:
        occ[r, e] -= 1
    if pos[r, s] >= 0:
        wr[r, e] -= 1
    live[r, s] = False
    pos[r, s] = -1
    score[r, s] = 0
    tier[r, s] = 0
    imp_w[r, s] = 0
    seen[r, s] = 0
    placed[r, s] = False
    settled[r, s] = False


def _move(T, P, stride, r, src, dst):
    """TokenState.move of one live token to an empty or evicted slot."""
    live, pos, score, tier, imp_w, seen, placed, settled = T
    occ, wr = P[2], P[3]
    d = dst // stride
    occ[r, d] += 1
    if pos[r, dst] < 0:
        wr[r, d] += 1
    live[r, dst] = live[r, src]
    pos[r, dst] = pos[r, src]
    score[r, dst] = score[r, src]
    tier[r, dst] = tier[r, src]
    imp_w[r, dst] = imp_w[r, src]
    seen[r, dst] = seen[r, src]
    placed[r, dst] = placed[r, src]
    settled[r, dst] = settled[r, src]
    _clear(T, P, stride, r, src)


def _evict(T, P, stride, r, s, q, tau, sums):
    """An eviction: the slot becomes a hole; the row's live sums lose the token (module doc)."""
    if not T[0][r, s]:
        return 0
    T[0][r, s] = False
    P[2][r, s // stride] -= 1
    p = T[1][r, s]
    sums[r, 0] -= np.exp(-(q - p) / tau[r])
    sums[r, 1] -= np.float64(T[4][r, s])
    if p < NUM_SINK:
        sums[r, 2] -= 2.0 ** p
    return 1


def _release_page(T, P, stride, r, e):
    """SlotStrategies._release_entries of one page (its id is collected by the caller)."""
    table, tail, occ, wr = P[0], P[4], P[2], P[3]
    for o in range(stride):
        _clear(T, P, stride, r, e * stride + o)
    table[r, e] = -1
    occ[r, e] = 0
    wr[r, e] = 0
    if tail[r] == e:
        tail[r] = -1


def _add_pages(P, meta, need, tier, pool, ids):
    """RequestKV.grow + SlotStrategies._add_pages: need[r] pages of `tier` per row from the pool.
    False when the physical table is too small (nothing changed; the caller makes room first)."""
    total = need.sum()
    if total == 0:
        return True
    if not _grow(P, meta, need):
        return False
    _pop(pool, total, ids)
    _assign_pages(P, meta[1], need, tier, ids)
    return True


def _grow(P, meta, need):
    """RequestKV.grow when a row has fewer empty entries than pages to add: meta[1] (the table's
    entry count) doubles, or grows by what is missing; False when the physical table is too small."""
    table = P[0]
    ent = meta[1]
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
        meta[1] = new_ent
    return True


def _assign_pages(P, ent, need, tier, ids):
    """Block ids ids[0:] to need[r] empty entries of each row (row by row; high pages take the lowest
    empty entries, low pages the highest — they grow from opposite ends; ids in entry order)."""
    table, page_tier = P[0], P[1]
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


def _first_free(T, P, cap, stride, ent, r, tier, start):
    """Lowest slot >= start of row r that is empty inside a page of `tier` (hole-first order), or -1."""
    table, page_tier, occ = P[0], P[1], P[2]
    live = T[0]
    c = cap[tier]
    e0 = start // stride
    for e in range(e0, ent):
        if table[r, e] < 0 or page_tier[r, e] != tier or occ[r, e] >= c:
            continue
        base = e * stride
        o0 = start - base if e == e0 else 0
        for o in range(max(o0, 0), c):
            if not live[r, base + o]:
                return base + o
    return -1


def _tail_free(P, cap, r):
    page_tier, tail, tail_off = P[1], P[4], P[5]
    t = tail[r]
    return t >= 0 and tail_off[r] < cap[page_tier[r, t]]


def _row_needs_page(P, cap, ent, r, hole_first):
    """Whether row r has no slot for a new (high) token: SlotStrategies._needs for one token."""
    if not hole_first:
        return not _tail_free(P, cap, r)
    table, page_tier, occ = P[0], P[1], P[2]
    c = cap[HIGH]
    for e in range(ent):
        if table[r, e] >= 0 and page_tier[r, e] == HIGH and occ[r, e] < c:
            return False
    return True


def _write(T, P, cap, stride, ent, r, hole_first, position, weight):
    """SlotStrategies._place of one new token (the first hole of a high page, or the append tail, else
    the first slot of a high page never written to) and its write."""
    live, pos = T[0], T[1]
    table, page_tier, tail, tail_off = P[0], P[1], P[4], P[5]
    if hole_first:
        s = _first_free(T, P, cap, stride, ent, r, HIGH, 0)
    else:
        if _tail_free(P, cap, r):
            s = tail[r] * stride + tail_off[r]
        else:                                           # the first slot of a page never written to
            s = -1
            for e in range(ent):
                if table[r, e] >= 0 and page_tier[r, e] == HIGH and P[3][r, e] == 0:
                    s = e * stride
                    break
        tail[r] = s // stride
        tail_off[r] = s % stride + 1
    _clear(T, P, stride, r, s)
    live[r, s] = True
    pos[r, s] = position
    T[3][r, s] = HIGH
    T[4][r, s] = weight
    P[2][r, s // stride] += 1
    P[3][r, s // stride] += 1


def _insert(vals, idx, count, v, i):
    """Keep the KMAX smallest (value, slot) pairs, offered in slot order (ties: the earlier slot first)."""
    if count < KMAX:
        j = count
        count += 1
    elif v < vals[KMAX - 1]:
        j = KMAX - 1
    else:
        return count
    while j > 0 and vals[j - 1] > v:
        vals[j] = vals[j - 1]
        idx[j] = idx[j - 1]
        j -= 1
    vals[j] = v
    idx[j] = i
    return count


def _release_empty(T, P, cap, stride, ent, keep_open_tail, pool, ids):
    """SlotStrategies._free_empty_pages: pages without a live token go back to the pool (free_block
    keeps an append tail that still has unwritten slots)."""
    table, page_tier, occ, tail, tail_off = P[0], P[1], P[2], P[4], P[5]
    n = 0
    for r in range(table.shape[0]):
        for e in range(ent):
            if table[r, e] < 0 or occ[r, e] > 0:
                continue
            if keep_open_tail and tail[r] == e and tail_off[r] < cap[page_tier[r, e]]:
                continue
            ids[n] = table[r, e]
            n += 1
            _release_page(T, P, stride, r, e)
    _push(pool, n, ids)
    return n


def _compact(T, P, cap, stride, ent, tier_bytes, pool, ids, out):
    """SlotStrategies._compact: per tier, the live tokens of a row's pages beyond the first
    ceil(live / capacity) move into the holes of those first pages (slot order); emptied pages go."""
    table, page_tier, occ = P[0], P[1], P[2]
    live, tier = T[0], T[3]
    rows = table.shape[0]
    freed = 0
    for t in range(3):
        c = cap[t]
        present, any_release = False, False
        for r in range(rows):
            n_live, n_pages = 0, 0
            for e in range(ent):
                if table[r, e] >= 0 and page_tier[r, e] == t:
                    present = True
                    n_pages += 1
                    n_live += occ[r, e]
            if n_pages > (n_live + c - 1) // c:
                any_release = True
        if not present or not any_release:
            continue
        moved_bytes = 0.0
        n_ids = 0
        for r in range(rows):
            n_live = 0
            for e in range(ent):
                if table[r, e] >= 0 and page_tier[r, e] == t:
                    n_live += occ[r, e]
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
                    moved_bytes += tier_bytes[tier[r, s]]
                    _move(T, P, stride, r, s, dst)
                    dst += 1
            for e in range(last_kept + 1, ent):
                if table[r, e] >= 0 and page_tier[r, e] == t:
                    ids[n_ids] = table[r, e]
                    n_ids += 1
                    _release_page(T, P, stride, r, e)
        _push(pool, n_ids, ids)
        freed += n_ids
        out[OUT_COMPACT_BYTES] += moved_bytes
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


def page_counts(T, P, stride, ent, q, tau, alpha_h, alpha_l, sums, prompt, obs_window, n_max, fresh):
    """Fill what the kernel keeps beside the token state: the pages' live (occ) and written (wr) slot
    counts, each row's live sums at query position q, and (`fresh`: a request starting its decode
    steps) the settled flags (module doc)."""
    live, pos, score, tier, placed, settled = T[0], T[1], T[2], T[3], T[6], T[7]
    table, occ, wr = P[0], P[2], P[3]
    for r in range(table.shape[0]):
        sums[r, 0] = sums[r, 1] = sums[r, 2] = 0.0
        for s in range(live.shape[1]):
            if fresh:
                bar = (alpha_h if tier[r, s] == HIGH else alpha_l) * SAFE
                p = pos[r, s]
                settled[r, s] = live[r, s] and placed[r, s] and _settles(
                    score[r, s], _seen(p, q, prompt, min(obs_window, prompt)), q + 1, n_max, bar)
            if live[r, s]:
                sums[r, 0] += np.exp(-(q - pos[r, s]) / tau[r])
                sums[r, 1] += np.float64(T[4][r, s])
                if pos[r, s] < NUM_SINK:
                    sums[r, 2] += 2.0 ** pos[r, s]
    for r in range(table.shape[0]):
        for e in range(table.shape[1]):
            occ[r, e] = 0
            wr[r, e] = 0
            if e >= ent or table[r, e] < 0:
                continue
            for o in range(stride):
                if live[r, e * stride + o]:
                    occ[r, e] += 1
                if pos[r, e * stride + o] >= 0:
                    wr[r, e] += 1


def _attend_row(T, P, r, ent, stride, cap, q, window, sink_weights, s32, l32, local_decay, tau, wsum, sums,
                alpha_h, alpha_l, prompt, obs_window, n_max, res, resi):
    """Decode attention of the query at position q over row r's live tokens (SyntheticImportance:
    sink + local + content terms, renormalized over the live tokens), LeanKV's observe (score +=
    attention, queries seen += 1) and compress for the row: the leaving token's tier, the demoted
    token, the pruned ones. Writes resi = [leaving slot, kind (1 high, 2 low, 3 pruned), demoted
    slot, error, pruned slots...] and res = [kept attention mass]. The normalizer comes from the
    row's live sums; settled tokens are skipped (module doc)."""
    live, pos, score, tier, imp_w, seen, placed, settled = T
    table, page_tier = P[0], P[1]
    n = q + 1
    n_sink = min(NUM_SINK, n)
    sink_total = 0.0
    for i in range(n_sink):
        sink_total += sink_weights[i]
    sink = np.zeros(NUM_SINK + 2, np.float32)           # by position + 1: later positions get 0
    live_sinks = np.int64(sums[r, 2])
    sink_kept = 0.0
    for i in range(n_sink):
        sink[i + 1] = np.float32(sink_weights[i] / sink_total)
        if live_sinks >> i & 1:
            sink_kept += sink[i + 1]
    bar = n - window                                    # tokens below it have left the window
    nf = np.float64(np.float32(n))
    decay = np.exp(-1.0 / tau[r])
    zl = np.float32((1 - decay ** (q + 1)) / (1 - decay))
    ws = np.float32(wsum[r])
    sr, lr = s32[r], l32[r]
    cr = np.float32(np.float32(np.float32(1.0) - sr) - lr)
    decay_r = local_decay[r]
    kept32 = np.float32(sr * sink_kept + lr * sums[r, 0] / zl + cr * sums[r, 1] / ws)
    res[0] = kept32
    denom = max(kept32, np.float32(1e-30))
    inv_denom = np.float32(1.0) / denom
    lr_zl = lr / zl
    cr_ws = cr / ws
    live_r, pos_r, imp_r, score_r, settled_r = live[r], pos[r], imp_w[r], score[r], settled[r]
    # a live token has been live since it was written, so the queries it saw and whether it has left
    # the window follow from its position: the prompt's last `observed` queries saw prompt tokens
    # (prefill), every decode query since saw it; tokens below n - window - 1 were placed
    observed = min(obs_window, prompt)
    placed_below = n - window - 1
    hv = np.empty(KMAX, np.float64)
    hi = np.empty(KMAX, np.int64)
    lv = np.empty(KMAX + 1, np.float64)
    li = np.empty(KMAX + 1, np.int64)
    hc, lc = 0, 0
    leave, kind = -1, 0
    for e in range(ent):
        if table[r, e] < 0:
            continue
        base = e * stride
        end = base + cap[page_tier[r, e]]
        high_page = page_tier[r, e] == HIGH
        bar_alpha = (alpha_h if high_page else alpha_l) * SAFE
        for s in range(base, end):
            if not live_r[s] or settled_r[s]:
                continue
            p = pos_r[s]
            a = np.float32(np.float32(sr * sink[min(p + 1, NUM_SINK + 1)] + lr_zl * decay_r[q - p])
                           + cr_ws * imp_r[s])
            sc = np.float32(score_r[s] + a * inv_denom)
            score_r[s] = sc
            k = _seen(p, q, prompt, observed)
            placed_s = p < placed_below
            if placed_s:
                if np.float64(sc) * nf > bar_alpha * k:  # clearly above its tier's bar: not a candidate
                    if _settles(sc, k, n, n_max, bar_alpha):    # ... nor until the request ends
                        settled_r[s] = True
                    continue
            sig = np.float64(sc) / k
            x = sig * nf
            if not placed_s:
                if p < bar:
                    if leave >= 0:
                        resi[3] = 2                     # two tokens left the window in one decode step
                        return
                    leave = s
                    kind = 1 if x > alpha_h else (2 if x > alpha_l else 3)
            elif high_page:
                if x <= alpha_h:
                    hc = _insert(hv, hi, hc, sig, s)
            elif x <= alpha_l:
                lc = _insert(lv, li, lc, sig, s)
    # _make_room: a token entering high demotes the least significant high token below the bar; tokens
    # entering low (placed low, or demoted) prune the least significant low ones below it
    demote = hi[0] if kind == 1 and hc > 0 else -1
    k_low = (1 if kind == 2 else 0) + (1 if demote >= 0 else 0)
    if demote >= 0:                                     # the demoted token is a candidate too
        p = pos[r, demote]
        dsig = np.float64(score[r, demote]) / _seen(p, q, prompt, observed)
        if dsig * nf <= alpha_l:
            j = lc
            while j > 0 and (lv[j - 1] > dsig or (lv[j - 1] == dsig and li[j - 1] > demote)):
                lv[j] = lv[j - 1]
                li[j] = li[j - 1]
                j -= 1
            lv[j] = dsig
            li[j] = demote
            lc += 1
    resi[0], resi[1], resi[2] = leave, kind, demote
    for j in range(KMAX):
        resi[4 + j] = li[j] if j < min(k_low, lc) else -1
    if leave >= 0:
        placed[r, leave] = kind != 3


def _arrays(addr, dims, rows, h):
    """The request's arrays (owned by its RequestKV and importance state) from their addresses."""
    a, S, E = addr[h], (rows, dims[h, 0]), (rows, dims[h, 1])
    T = (carray(_ptr(a[0]), S, np.bool_), carray(_ptr(a[1]), S, np.int64), carray(_ptr(a[2]), S, np.float32),
         carray(_ptr(a[3]), S, np.int8), carray(_ptr(a[4]), S, np.float32), carray(_ptr(a[5]), S, np.int32),
         carray(_ptr(a[6]), S, np.bool_), carray(_ptr(a[15]), S, np.bool_))
    P = (carray(_ptr(a[7]), E, np.int64), carray(_ptr(a[8]), E, np.int8), carray(_ptr(a[9]), E, np.int64),
         carray(_ptr(a[10]), E, np.int64), carray(_ptr(a[11]), rows, np.int64), carray(_ptr(a[12]), rows, np.int64))
    return T, P, carray(_ptr(a[13]), rows, np.float64), carray(_ptr(a[14]), (rows, CHUNK), np.float32)


def leankv_step(handles, reserved, reserved_end, addr, dims, rows, heads, sink_weights, cap, tier_bytes, alpha_h, alpha_l,
                window, obs_window, strategy, pool, ids, meta, stats, sums):
    """One decode token for each request of `handles` (module doc). addr[h] = the addresses of request
    h's arrays (dims[h] = slots, table entries): the token arrays (live, pos, score, tier, imp_w, queries seen, placed) [rows, slots], the
    page arrays (table, page tier, live and written slots per page) [rows, entries], the append tail
    (entry, offset) [rows], wsum [rows] (content weights written so far) and the current chunk of
    content weights [rows, CHUNK]. heads = (s, l as float32, exp(-age / tau) as float32 [rows, ages],
    tau) of the rows. reserved[reserved_end[i-1]:reserved_end[i]] are the pages the scheduler took for
    request i's token, which its write places (ids in the order the pool handed them out);
    pool = (free ids, owned, [count]) of the ArrayBlockPool. meta[h] = [tokens, table entries, decode
    steps, evicted token-rows, error, tokens at the prompt cut, most tokens the request can reach],
    stats[h] = OUT_* of the step (mass summed over steps)."""
    s32, l32, local_decay, tau = heads
    stride = cap.max()
    hole_first = strategy >= SLOT_REUSE
    n_req = handles.shape[0]
    # A. the writes (in parallel: each request takes the pages the scheduler reserved for it, in the
    # order the pool would have handed them out)
    for i in prange(n_req):
        h = handles[i]
        T, P, wsum, w = _arrays(addr, dims, rows, h)
        m = meta[h]
        start = reserved_end[i - 1] if i > 0 else 0
        need = np.zeros(rows, np.int64)
        for r in range(rows):
            if _row_needs_page(P, cap, m[1], r, hole_first):
                need[r] = 1
        if need.sum() != reserved_end[i] - start or not _grow(P, m, need):
            m[4] = 1
            continue
        _assign_pages(P, m[1], need, HIGH, reserved[start:reserved_end[i]])
        q = m[0]
        rs = sums[h]
        for r in range(rows):
            weight = w[r, q % CHUNK]
            _write(T, P, cap, stride, m[1], r, hole_first, q, weight)
            wsum[r] += np.float64(weight)
            rs[r, 0] = rs[r, 0] * np.exp(-1.0 / tau[r]) + 1.0
            rs[r, 1] += np.float64(weight)
            if q < NUM_SINK:
                rs[r, 2] += 2.0 ** q
    for i in range(n_req):
        if meta[handles[i], 4] != 0:
            return
    # B. attention and LeanKV's decision, row by row (independent: in parallel)
    res = np.zeros(n_req * rows)
    resi = np.full((n_req * rows, 4 + KMAX), -1, np.int64)
    for k in prange(n_req * rows):
        i, r = k // rows, k % rows
        h = handles[i]
        T, P, wsum, w = _arrays(addr, dims, rows, h)
        _attend_row(T, P, r, meta[h, 1], stride, cap, meta[h, 0], window, sink_weights, s32, l32, local_decay, tau,
                    wsum, sums[h], alpha_h, alpha_l, meta[h, 5], obs_window, meta[h, 6], res[k:k + 1], resi[k])
    # C. each request's decision applied (evictions, moves to low pages, the slot strategy), in order
    for i in range(n_req):
        h = handles[i]
        T, P, wsum, w = _arrays(addr, dims, rows, h)
        m = meta[h]
        q = m[0]
        out = stats[h]
        mass_sum = out[OUT_MASS_SUM]
        for j in range(OUT_SIZE):
            out[j] = 0.0
        mass = 0.0
        m[0] += 1
        m[2] += 1
        decision = False
        k0 = i * rows
        for r in range(rows):
            if resi[k0 + r, 3] >= 0:
                m[4] = resi[k0 + r, 3]
                return
            mass += res[k0 + r] / rows
            kind = resi[k0 + r, 1]
            if kind >= 2 or resi[k0 + r, 2] >= 0 or resi[k0 + r, 4] >= 0:
                decision = True
        out[OUT_MASS] = mass
        out[OUT_MASS_SUM] = mass_sum + mass
        if decision:
            _apply(T, P, m, cap, stride, tier_bytes, strategy, resi[k0:k0 + rows], pool, ids, out, q, tau, sums[h])
            if out[OUT_ERROR] != 0:
                m[4] = 1
                return
            m[3] += out[OUT_EVICTED]
    for i in prange(n_req):                             # D. each request's counts (in parallel)
        h = handles[i]
        P = _arrays(addr, dims, rows, h)[1]
        _stats(P, cap, meta[h, 1], tier_bytes, hole_first, stats[h])


def _apply(T, P, meta, cap, stride, tier_bytes, strategy, resi, pool, ids, out, q, tau, sums):
    """EvictingKVManager._apply of LeanKV's decision (resi[r] = _attend_row's result of row r):
    evictions, the move to low pages, the slot strategy."""
    table, page_tier, occ = P[0], P[1], P[2]
    tier = T[3]
    rows = table.shape[0]
    ent = meta[1]
    evicted = 0
    src = np.full((rows, 2), -1, np.int64)              # tokens moving to low pages, in slot order
    to_low = np.zeros(rows, np.int64)
    for r in range(rows):
        leave, kind, d = resi[r, 0], resi[r, 1], resi[r, 2]
        for j in range(KMAX):                           # a pruned demoted token is evicted where it is
            s = resi[r, 4 + j]
            if s < 0:
                break
            if s == d:
                d = -1
            evicted += _evict(T, P, stride, r, s, q, tau, sums)
        if kind == 3:
            evicted += _evict(T, P, stride, r, leave, q, tau, sums)
        a = leave if kind == 2 else -1
        if a >= 0 and d >= 0:
            src[r, 0], src[r, 1] = min(a, d), max(a, d)
        elif a >= 0 or d >= 0:
            src[r, 0] = max(a, d)
        to_low[r] = (src[r, 0] >= 0) + (src[r, 1] >= 0)
    out[OUT_EVICTED] = evicted
    if to_low.sum() > 0:
        need = np.zeros(rows, np.int64)
        c = cap[LOW]
        for r in range(rows):
            free_cnt = 0
            for e in range(ent):
                if table[r, e] >= 0 and page_tier[r, e] == LOW:
                    free_cnt += c - occ[r, e]
            need[r] = (max(to_low[r] - free_cnt, 0) + c - 1) // c
        if need.sum() <= pool[2][0]:                    # else no room: the tokens keep their tier
            if not _add_pages(P, meta, need, LOW, pool, ids):
                out[OUT_ERROR] = 1.0
                return
            ent = meta[1]
            moved_bytes = 0.0
            for r in range(rows):
                dst = 0
                for j in range(2):
                    s = src[r, j]
                    if s < 0:
                        continue
                    dst = _first_free(T, P, cap, stride, ent, r, LOW, dst)
                    moved_bytes += tier_bytes[tier[r, s]]
                    _move(T, P, stride, r, s, dst)
                    tier[r, dst] = LOW
                    dst += 1
            out[OUT_MOVED_BYTES] = moved_bytes
            out[OUT_MOVED] = to_low.sum()
    if strategy != NOOP:
        out[OUT_FREED] += _release_empty(T, P, cap, stride, ent, strategy == FREE_BLOCK, pool, ids)
    if strategy == COMPACT:
        out[OUT_FREED] += _compact(T, P, cap, stride, ent, tier_bytes, pool, ids, out)


def _stats(P, cap, ent, tier_bytes, hole_first, out):
    """EvictingKVManager._stat (live and allocated slots, reads and stored bytes in token-equivalents
    summed over rows, pages: a page's written slots all hold its tier) and the next token's pages."""
    table, page_tier, occ, wr = P[0], P[1], P[2], P[3]
    n_live, alloc, pages = 0, 0, 0
    read, stored = 0.0, 0.0
    for r in range(table.shape[0]):
        for e in range(ent):
            if table[r, e] < 0:
                continue
            t = page_tier[r, e]
            pages += 1
            alloc += cap[t]
            n_live += occ[r, e]
            read += wr[r, e] * tier_bytes[t]
            stored += occ[r, e] * tier_bytes[t]
    out[OUT_LIVE] = n_live
    out[OUT_ALLOC] = alloc
    out[OUT_READ] = read
    out[OUT_STORED] = stored
    out[OUT_PAGES] = pages
    out[OUT_NEED] = next_token_pages(P, cap, ent, hole_first)


def next_token_pages(P, cap, ent, hole_first):
    """Rows without a slot for the next new token (the pages it will take)."""
    need = 0
    for r in range(P[0].shape[0]):
        if _row_needs_page(P, cap, ent, r, hole_first):
            need += 1
    return need


if njit is not None:
    for _name in ("_pop", "_push", "_clear", "_move", "_evict", "_release_page", "_add_pages", "_first_free",
                  "_tail_free", "_row_needs_page", "_grow", "_assign_pages", "_seen", "_settles", "_write", "_insert", "_release_empty", "_compact", "page_counts",
                  "_apply", "_stats", "next_token_pages", "_arrays"):
        globals()[_name] = njit(cache=True, nogil=True)(globals()[_name])
    _attend_row = njit(cache=True, nogil=True)(_attend_row)
    leankv_step = njit(cache=True, nogil=True, parallel=True)(leankv_step)
