"""LeanKV's decode step for one request, compiled (numba): what the token-level manager does for it.

`leankv_decode` runs, on a request's token-level arrays (sim/kv/slots.py `RequestKV` and its
`TokenState`), exactly the steps of `EvictingKVManager` for one decode token of a `leankv` request
with the `every_step` trigger and the noop / free_block / slot_reuse / compact slot strategies:

1. write the token (`_needs`, `_add_pages`, `_place`: the tail page or the first hole of a high page);
2. the importance model's decode attention of the new query over the live tokens
   (`SyntheticImportance.decode_scores`: sink + local + content terms, renormalized over live tokens)
   and LeanKV's `observe` (score += attention, queries seen += 1);
3. LeanKV's `compress` (the token leaving the window is placed high, low or pruned by
   significance x N against alpha_h / alpha_l, and `_make_room` demotes / prunes the least
   significant placed tokens below the bar);
4. `_apply`: evictions leave holes, tier moves go hole-first into low pages (`_retier`), then the
   slot strategy (free empty pages; compact each tier).

Its twin is the token-level manager itself (tests/test_fast_leankv.py runs both on the same sampled
rows). Differences are float rounding only: sums are taken in float64 (numpy sums float32
pairwise), and the local term exp(-age / tau) is taken as 0 beyond 30 tau (below 1e-13 of it).
Block ids come from and return to the `ArrayBlockPool` stack arrays in the same order.
"""
from __future__ import annotations

import numpy as np

try:
    from numba import njit
except ImportError:          # pragma: no cover - exercised where numba is absent
    njit = None

HIGH, LOW = 1, 2
NOOP, FREE_BLOCK, SLOT_REUSE, COMPACT = 0, 1, 2, 3
STRATEGY_CODES = {"noop": NOOP, "free_block": FREE_BLOCK, "slot_reuse": SLOT_REUSE, "compact": COMPACT}
KMAX = 8                       # tokens a row may demote / prune in one decode step (one leaves the window)
LOCAL_CUTOFF = 30.0            # ages beyond 30 tau: exp(-age / tau) < 1e-13, taken as 0
NUM_SINK = 4
# out[...] of leankv_decode
OUT_LIVE, OUT_ALLOC, OUT_READ, OUT_PAGES, OUT_STORED, OUT_MASS, OUT_EVICTED, OUT_FREED, OUT_MOVED, \
    OUT_MOVED_BYTES, OUT_COMPACT_BYTES, OUT_NEED, OUT_ENTRIES, OUT_ERROR = range(14)
OUT_SIZE = 16


def _pop(pool_free, pool_owned, pool_count, n, ids):
    """ArrayBlockPool.get_new_blocks (stack order) into ids[:n]."""
    c = pool_count[0]
    for i in range(n):
        b = pool_free[c - 1 - i]
        ids[i] = b
        pool_owned[b] = True
    pool_count[0] = c - n


def _push(pool_free, pool_owned, pool_count, n, ids):
    """ArrayBlockPool.free_blocks(ids[:n]) (stack order: ids pushed reversed)."""
    c = pool_count[0]
    for i in range(n):
        b = ids[n - 1 - i]
        pool_owned[b] = False
        pool_free[c + i] = b
    pool_count[0] = c + n


def _clear(live, pos, score, tier, imp_w, seen, placed, r, s):
    live[r, s] = False
    pos[r, s] = -1
    score[r, s] = 0
    tier[r, s] = 0
    imp_w[r, s] = 0
    seen[r, s] = 0
    placed[r, s] = False


def _move(live, pos, score, tier, imp_w, seen, placed, r, src, dst):
    live[r, dst] = live[r, src]
    pos[r, dst] = pos[r, src]
    score[r, dst] = score[r, src]
    tier[r, dst] = tier[r, src]
    imp_w[r, dst] = imp_w[r, src]
    seen[r, dst] = seen[r, src]
    placed[r, dst] = placed[r, src]
    _clear(live, pos, score, tier, imp_w, seen, placed, r, src)


def _add_pages(table, page_tier, meta, need, tier, pool_free, pool_owned, pool_count, ids):
    """RequestKV growth + SlotStrategies._add_pages: need[r] pages of `tier` per row (high: lowest
    empty entries, low: highest); meta[1] is the table's entry count. Returns False when the
    physical table is too small (the caller grows it; nothing was changed)."""
    rows = table.shape[0]
    total = 0
    ent = meta[1]
    extra = 0
    for r in range(rows):
        total += need[r]
        free_e = 0
        for e in range(ent):
            if table[r, e] < 0:
                free_e += 1
        extra = max(extra, need[r] - free_e)
    if total == 0:
        return True
    if extra > 0:
        new_ent = max(ent + extra, 2 * ent)
        if new_ent > table.shape[1]:
            return False
        meta[1] = ent = new_ent
    _pop(pool_free, pool_owned, pool_count, total, ids)
    k = 0
    for r in range(rows):
        left = need[r]
        if tier == LOW:
            for e in range(ent - 1, -1, -1):          # highest empty entries, ids in entry order below
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
    return True


def _first_free(table, page_tier, live, cap, stride, ent, r, tier, start):
    """Lowest slot >= start of row r that is empty inside a page of `tier` (hole-first order), or -1."""
    e0 = start // stride
    for e in range(e0, ent):
        if table[r, e] < 0 or page_tier[r, e] != tier:
            continue
        c = cap[tier]
        base = e * stride
        o0 = start - base if e == e0 else 0
        for o in range(max(o0, 0), c):
            if not live[r, base + o]:
                return base + o
    return -1


def _tail_free(table, page_tier, tail, tail_off, cap, r):
    t = tail[r]
    return t >= 0 and tail_off[r] < cap[page_tier[r, t]]


def _row_needs_page(table, page_tier, live, tail, tail_off, cap, stride, ent, r, hole_first):
    if hole_first:
        return _first_free(table, page_tier, live, cap, stride, ent, r, HIGH, 0) < 0
    return not _tail_free(table, page_tier, tail, tail_off, cap, r)


def _write(table, page_tier, tail, tail_off, live, pos, score, tier, imp_w, seen, placed, cap, stride, ent, r,
           hole_first, position, weight):
    if hole_first:
        s = _first_free(table, page_tier, live, cap, stride, ent, r, HIGH, 0)
    else:
        if _tail_free(table, page_tier, tail, tail_off, cap, r):
            s = tail[r] * stride + tail_off[r]
        else:                                           # first never-written slot of a high page
            s = -1
            for e in range(ent):
                if table[r, e] < 0 or page_tier[r, e] != HIGH:
                    continue
                for o in range(cap[HIGH]):
                    if not live[r, e * stride + o] and pos[r, e * stride + o] < 0:
                        s = e * stride + o
                        break
                if s >= 0:
                    break
        tail[r] = s // stride
        tail_off[r] = s % stride + 1
    _clear(live, pos, score, tier, imp_w, seen, placed, r, s)
    live[r, s] = True
    pos[r, s] = position
    tier[r, s] = HIGH
    imp_w[r, s] = weight


def _insert(vals, idx, count, v, i):
    """Keep the KMAX smallest (value, slot) pairs seen in slot order (ties: earlier slot first)."""
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


def _release_empty(table, page_tier, tail, tail_off, live, pos, score, tier, imp_w, seen, placed, cap, stride,
                   ent, keep_open_tail, pool_free, pool_owned, pool_count, ids):
    """SlotStrategies._free_empty_pages: pages without a live token go back to the pool."""
    rows = table.shape[0]
    n = 0
    for r in range(rows):
        for e in range(ent):
            if table[r, e] < 0:
                continue
            if keep_open_tail and tail[r] == e and tail_off[r] < cap[page_tier[r, e]]:
                continue
            empty = True
            for o in range(stride):
                if live[r, e * stride + o]:
                    empty = False
                    break
            if not empty:
                continue
            ids[n] = table[r, e]
            n += 1
            for o in range(stride):
                _clear(live, pos, score, tier, imp_w, seen, placed, r, e * stride + o)
            table[r, e] = -1
            if tail[r] == e:
                tail[r] = -1
    _push(pool_free, pool_owned, pool_count, n, ids)
    return n


def _compact(table, page_tier, tail, live, pos, score, tier, imp_w, seen, placed, cap, stride, ent, tier_bytes,
             pool_free, pool_owned, pool_count, ids, out):
    """SlotStrategies._compact: per tier, survivors of a row's pages beyond ceil(live / capacity) move
    into the holes of its first pages (in slot order); the emptied pages are freed."""
    rows = table.shape[0]
    freed = 0
    for t in range(3):
        c = cap[t]
        any_release = False
        present = False
        for r in range(rows):
            n_live, n_pages = 0, 0
            for e in range(ent):
                if table[r, e] >= 0 and page_tier[r, e] == t:
                    present = True
                    n_pages += 1
                    for o in range(c):
                        if live[r, e * stride + o]:
                            n_live += 1
            if n_pages - (n_live + c - 1) // c > 0:
                any_release = True
        if not present or not any_release:
            continue
        moved_bytes = 0.0
        n_ids = 0
        for r in range(rows):
            n_live = 0
            for e in range(ent):
                if table[r, e] >= 0 and page_tier[r, e] == t:
                    for o in range(c):
                        if live[r, e * stride + o]:
                            n_live += 1
            keep = (n_live + c - 1) // c
            # kept pages: the first `keep` pages of tier t; sources: live slots of later pages, in order
            kept = 0
            last_kept = -1
            for e in range(ent):
                if table[r, e] >= 0 and page_tier[r, e] == t:
                    if kept < keep:
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
                    # next hole of a kept page
                    while True:
                        de = dst // stride
                        if de > last_kept:
                            break
                        if table[r, de] >= 0 and page_tier[r, de] == t and dst % stride < c and not live[r, dst]:
                            break
                        dst += 1
                    moved_bytes += tier_bytes[tier[r, s]]
                    _move(live, pos, score, tier, imp_w, seen, placed, r, s, dst)
                    dst += 1
            for e in range(last_kept + 1, ent):
                if table[r, e] >= 0 and page_tier[r, e] == t:
                    ids[n_ids] = table[r, e]
                    n_ids += 1
                    for o in range(stride):
                        _clear(live, pos, score, tier, imp_w, seen, placed, r, e * stride + o)
                    table[r, e] = -1
                    if tail[r] == e:
                        tail[r] = -1
        _push(pool_free, pool_owned, pool_count, n_ids, ids)
        freed += n_ids
        out[OUT_COMPACT_BYTES] += moved_bytes
    return freed


def leankv_decode(table, page_tier, tail, tail_off, live, pos, score, tier, imp_w, seen, placed, meta,
                  weight, wsum, s32, l32, tau32, tau, sink_weights, cap, tier_bytes, alpha_h, alpha_l, window,
                  strategy, reserved, pool_free, pool_owned, pool_count, scratch, ids, out):
    """One decode token of one request (module doc). meta = [num_tokens, table entries]; weight [rows]
    the new token's content weight, wsum [rows] the content weights written so far (updated here);
    `reserved` pages were taken for the token by the scheduler's allocation and are returned to the
    pool first. Fills out[OUT_*]."""
    rows, stride = table.shape[0], cap.max()
    hole_first = strategy >= SLOT_REUSE
    for i in range(OUT_SIZE):
        out[i] = 0.0
    ent = meta[1]
    # the reserved pages return to the pool, and the write takes them again (same ids, same order)
    _push(pool_free, pool_owned, pool_count, reserved.shape[0], reserved)
    need = np.zeros(rows, np.int64)
    for r in range(rows):
        if _row_needs_page(table, page_tier, live, tail, tail_off, cap, stride, ent, r, hole_first):
            need[r] = 1
    if not _add_pages(table, page_tier, meta, need, HIGH, pool_free, pool_owned, pool_count, ids):
        out[OUT_ERROR] = 1.0
        return
    ent = meta[1]
    q = meta[0]
    for r in range(rows):
        _write(table, page_tier, tail, tail_off, live, pos, score, tier, imp_w, seen, placed, cap, stride, ent, r,
               hole_first, q, weight[r])
        wsum[r] += np.float64(weight[r])
    n = q + 1
    meta[0] = n

    # decode attention of the query at position q over the live tokens, and LeanKV's observe + compress
    n_sink = min(NUM_SINK, q + 1)
    sink_total = 0.0
    for i in range(n_sink):
        sink_total += sink_weights[i]
    bar = n - window                                    # tokens below it have left the window
    decision = False
    evict = np.zeros(rows, np.int64)                    # per row: a slot to evict (leaving), or -1
    leave_slot = np.full(rows, -1, np.int64)
    leave_kind = np.zeros(rows, np.int64)               # 1 high, 2 low, 3 evict
    demote = np.full(rows, -1, np.int64)
    prune = np.full((rows, KMAX), -1, np.int64)
    hv = np.empty(KMAX, np.float64)
    hi = np.empty(KMAX, np.int64)
    lv = np.empty(KMAX, np.float64)
    li = np.empty(KMAX, np.int64)
    mass = 0.0
    nf = np.float64(np.float32(n))
    for r in range(rows):
        decay = np.exp(-1.0 / tau[r])
        zl = np.float32((1 - decay ** (q + 1)) / (1 - decay))
        ws = np.float32(wsum[r])
        sr, lr, tr = s32[r], l32[r], tau32[r]
        cr = np.float32(np.float32(np.float32(1.0) - sr) - lr)
        cut = LOCAL_CUTOFF * tr
        kept = 0.0
        for e in range(ent):
            if table[r, e] < 0:
                continue
            base = e * stride
            for o in range(cap[page_tier[r, e]]):
                s = base + o
                if not live[r, s]:
                    continue
                p = pos[r, s]
                age = np.float32(q - p)
                local = np.float32(0.0)
                if age < cut:
                    local = np.float32(np.exp(-age / tr) / zl)
                sink = np.float32(0.0)
                if p < n_sink:
                    sink = np.float32(sink_weights[p] / sink_total)
                a = np.float32(np.float32(sr * sink + lr * local) + cr * np.float32(imp_w[r, s] / ws))
                scratch[s] = a
                kept += a
        kept32 = np.float32(kept)
        mass += kept32
        denom = max(kept32, np.float32(1e-30))
        hc = 0
        lc = 0
        for e in range(ent):
            if table[r, e] < 0:
                continue
            base = e * stride
            for o in range(cap[page_tier[r, e]]):
                s = base + o
                if not live[r, s]:
                    continue
                score[r, s] = np.float32(score[r, s] + np.float32(scratch[s] / denom))
                seen[r, s] += 1
                sig = np.float64(score[r, s]) / max(seen[r, s], 1)
                x = sig * nf
                if not placed[r, s]:
                    if pos[r, s] < bar:
                        if leave_slot[r] >= 0:
                            out[OUT_ERROR] = 2.0      # two tokens left the window in one decode step
                            return
                        leave_slot[r] = s
                        leave_kind[r] = 1 if x > alpha_h else (2 if x > alpha_l else 3)
                elif tier[r, s] == HIGH:
                    if x <= alpha_h:
                        hc = _insert(hv, hi, hc, sig, s)
                elif tier[r, s] == LOW:
                    if x <= alpha_l:
                        lc = _insert(lv, li, lc, sig, s)
        # _make_room: a token entering high demotes the least significant high token below the bar;
        # tokens entering low (placed low or demoted) prune the least significant low ones below it
        kind = leave_kind[r]
        evict[r] = leave_slot[r] if kind == 3 else -1
        if kind == 1 and hc > 0:
            demote[r] = hi[0]
        k_low = (1 if kind == 2 else 0) + (1 if demote[r] >= 0 else 0)
        if k_low > 0:
            # candidates: the low tier's tokens below the bar, and the demoted token if below it too
            if demote[r] >= 0:
                d = demote[r]
                dsig = np.float64(score[r, d]) / max(seen[r, d], 1)
                if dsig * nf <= alpha_l:
                    # merge in slot order for ties: rebuild from the tracked set plus d
                    lc2 = 0
                    tv = np.empty(KMAX + 1, np.float64)
                    ti = np.empty(KMAX + 1, np.int64)
                    inserted = False
                    for j in range(lc):
                        if not inserted and (dsig < lv[j] or (dsig == lv[j] and d < li[j])):
                            lc2 = _insert_at(tv, ti, lc2, dsig, d)
                            inserted = True
                        lc2 = _insert_at(tv, ti, lc2, lv[j], li[j])
                    if not inserted:
                        lc2 = _insert_at(tv, ti, lc2, dsig, d)
                    lc = min(lc2, KMAX)
                    for j in range(lc):
                        lv[j] = tv[j]
                        li[j] = ti[j]
            for j in range(min(k_low, lc)):
                prune[r, j] = li[j]
        if leave_slot[r] >= 0:
            placed[r, leave_slot[r]] = kind != 3
        if kind == 2 or kind == 3 or demote[r] >= 0 or prune[r, 0] >= 0:
            decision = True
    out[OUT_MASS] = mass / rows
    if decision:
        _apply(table, page_tier, tail, tail_off, live, pos, score, tier, imp_w, seen, placed, meta, cap, stride,
               tier_bytes, strategy, evict, leave_slot, leave_kind, demote, prune, pool_free, pool_owned,
               pool_count, ids, out)
        if out[OUT_ERROR] != 0:
            return
    _stats(table, page_tier, tail, tail_off, live, pos, tier, cap, stride, meta[1], tier_bytes, hole_first, out)


def _insert_at(vals, idx, count, v, i):
    vals[count] = v
    idx[count] = i
    return count + 1


def _apply(table, page_tier, tail, tail_off, live, pos, score, tier, imp_w, seen, placed, meta, cap, stride,
           tier_bytes, strategy, evict, leave_slot, leave_kind, demote, prune, pool_free, pool_owned, pool_count,
           ids, out):
    """EvictingKVManager._apply of LeanKV's decision: evictions, the move to low pages, the strategy."""
    rows = table.shape[0]
    ent = meta[1]
    evicted = 0
    src = np.full((rows, 2), -1, np.int64)              # tokens moving to low pages, in slot order
    to_low = np.zeros(rows, np.int64)
    for r in range(rows):
        d = demote[r]
        for j in range(KMAX):                           # a pruned demoted token is evicted where it is
            s = prune[r, j]
            if s < 0:
                break
            if s == d:
                d = -1
            if live[r, s]:
                live[r, s] = False
                evicted += 1
        if evict[r] >= 0 and live[r, evict[r]]:
            live[r, evict[r]] = False
            evicted += 1
        a = leave_slot[r] if leave_kind[r] == 2 else -1
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
                    for o in range(c):
                        if not live[r, e * stride + o]:
                            free_cnt += 1
            need[r] = (max(to_low[r] - free_cnt, 0) + c - 1) // c
        if need.sum() <= pool_count[0]:                 # else no room: the tokens keep their tier
            if not _add_pages(table, page_tier, meta, need, LOW, pool_free, pool_owned, pool_count, ids):
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
                    dst = _first_free(table, page_tier, live, cap, stride, ent, r, LOW, dst)
                    moved_bytes += tier_bytes[tier[r, s]]
                    _move(live, pos, score, tier, imp_w, seen, placed, r, s, dst)
                    tier[r, dst] = LOW
                    dst += 1
            out[OUT_MOVED_BYTES] = moved_bytes
            out[OUT_MOVED] = to_low.sum()
    if strategy != NOOP:
        out[OUT_FREED] += _release_empty(table, page_tier, tail, tail_off, live, pos, score, tier, imp_w, seen,
                                         placed, cap, stride, ent, strategy == FREE_BLOCK, pool_free, pool_owned,
                                         pool_count, ids)
    if strategy == COMPACT:
        out[OUT_FREED] += _compact(table, page_tier, tail, live, pos, score, tier, imp_w, seen, placed, cap, stride,
                                   ent, tier_bytes, pool_free, pool_owned, pool_count, ids, out)


def _stats(table, page_tier, tail, tail_off, live, pos, tier, cap, stride, ent, tier_bytes, hole_first, out):
    """EvictingKVManager._stat (live and allocated slots, reads and stored bytes in token-equivalents
    summed over rows, pages) and the pages the next token needs."""
    rows = table.shape[0]
    n_live, alloc, pages = 0, 0, 0
    read, stored = 0.0, 0.0
    need = 0
    for r in range(rows):
        for e in range(ent):
            if table[r, e] < 0:
                continue
            pages += 1
            alloc += cap[page_tier[r, e]]
            base = e * stride
            for o in range(stride):
                s = base + o
                if pos[r, s] >= 0:
                    read += tier_bytes[tier[r, s]]
                    if live[r, s]:
                        n_live += 1
                        stored += tier_bytes[tier[r, s]]
        if _row_needs_page(table, page_tier, live, tail, tail_off, cap, stride, ent, r, hole_first):
            need += 1
    out[OUT_LIVE] = n_live
    out[OUT_ALLOC] = alloc
    out[OUT_READ] = read
    out[OUT_STORED] = stored
    out[OUT_PAGES] = pages
    out[OUT_NEED] = need
    out[OUT_ENTRIES] = ent


def next_token_pages(table, page_tier, tail, tail_off, live, cap, stride, ent, hole_first):
    need = 0
    for r in range(table.shape[0]):
        if _row_needs_page(table, page_tier, live, tail, tail_off, cap, stride, ent, r, hole_first):
            need += 1
    return need


if njit is not None:
    for _name in ("_pop", "_push", "_clear", "_move", "_add_pages", "_first_free", "_tail_free", "_row_needs_page",
                  "_write", "_insert", "_insert_at", "_release_empty", "_compact", "_apply", "_stats",
                  "next_token_pages", "leankv_decode"):
        globals()[_name] = njit(cache=True, nogil=True)(globals()[_name])
