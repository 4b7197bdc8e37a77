"""Fast mode's compiled kernels against their numpy twins (same decisions, same state)."""
import os
import subprocess
import sys

import numpy as np
import pytest

from kvsim.sim.kv.fast.compiled import kernels as fk, reference as ref
from kvsim.sim.kv.fast.compiled.layout import NUM_CANDIDATES, DecodeRows, PromptRows, RowConsts, ScoreArrays, StepFlags
from test_kv_manager import H2O, run

pytestmark = pytest.mark.skipif(fk.njit is None, reason="numba not installed: the twins are the only path")


def _random_rows(rng, rows=6, Hc=24, W=4):
    st = {
        "hn": rng.integers(3, 14, rows).astype(np.int32),
        "sigma": rng.uniform(0.5, 3.0, rows), "norm": rng.uniform(50, 80, rows), "hsum": rng.uniform(0.1, 0.3, rows),
        "eref": rng.uniform(0, 40, rows), "ring_static": rng.random(rows * W), "ring_content": rng.random(rows * W),
        "heavy": rng.integers(0, 30, rows * Hc).astype(np.int32), "terms": rng.random((rows * Hc, 3)),
        "cand": np.zeros((rows, NUM_CANDIDATES, 4)), "thr": np.full(rows, -np.inf),
    }
    st["cand"][:, :, 0] = -1
    st["eref"][0] = -40000.0                       # row 0 is due for a rebase of its local terms
    return st


def _score_arrays(st, consts):
    return ScoreArrays(*consts, st["sigma"], st["norm"], st["hsum"], st["eref"], st["ring_static"],
                       st["ring_content"], st["terms"], st["cand"], st["thr"])


def _flags(W, Hc):
    return StepFlags(block_size=16, window=W, budget=10, track=True, append=True, reuse=False, frees=True,
                     sparse=False, compact=False, evict_leaving=False, scored=True, list_cap=Hc)


def _kernel_rows(rows: DecodeRows, consts: RowConsts, flags: StepFlags, hn, heavy, sc):
    """The decode kernel's scored part, row by row (`_scored_exit` then `_evict_lowest_row`, as
    decode_rows calls them), with scored_step_np's arguments."""
    q, Hc = rows.q, flags.list_cap
    out = np.empty(q.size, heavy.dtype)
    buf, top = np.empty(Hc), np.empty(fk.K, np.int64)
    for i in range(q.size):
        H, g, s_exit, exits, A_e, cw_e, E_e = fk._scored_exit(q[i], rows.t_new[i], rows.z[i], consts.local[i],
                                                               consts.inv_tau[i], consts.content[i], flags.window,
                                                               Hc, rows.exits[i], sc)
        out[i], hn[i] = fk._evict_lowest_row(q[i], hn[i], Hc, rows.over[i], exits, H, g, s_exit, rows.exit_col[i],
                                             A_e, cw_e, E_e, heavy, sc, buf, top)
    return out


def _step(fn, st, q, t, z, consts, over, ex, ec, W, Hc):
    rows = DecodeRows(q, t, z, over, ex, ec)
    return fn(rows, RowConsts(*consts), _flags(W, Hc), st["hn"], st["heavy"], _score_arrays(st, consts))


@pytest.mark.parametrize("W", [4, 0])
def test_scored_step_kernel_rows_match_their_numpy_twin(W):
    rng = np.random.default_rng(7)
    rows, Hc = 6, 24
    kernel, twin = _random_rows(rng, rows, Hc, max(W, 1)), None
    twin = {k: v.copy() for k, v in kernel.items()}
    q = np.arange(rows, dtype=np.int64)
    consts = (rng.uniform(0.1, 0.5, rows), 1.0 / rng.uniform(4, 64, rows), rng.uniform(0.2, 0.6, rows))
    t = np.full(rows, 60, np.int64)
    for step in range(40):
        z = rng.standard_normal(rows)
        over = kernel["hn"] >= 10
        ex = rng.random(rows) < 0.8
        ec = rng.integers(0, 30, rows).astype(np.int32)
        out_k = _step(_kernel_rows, kernel, q, t, z, consts, over, ex, ec, W, Hc)
        out_t = _step(ref.scored_step_np, twin, q, t, z, consts, over, ex, ec, W, Hc)
        assert np.array_equal(out_k[over], out_t[over]), step            # the evicted columns
        for name in ("hn", "heavy"):
            assert np.array_equal(kernel[name], twin[name]), (step, name)
        for name in ("sigma", "norm", "hsum", "eref", "ring_static", "ring_content"):
            np.testing.assert_allclose(kernel[name], twin[name], rtol=1e-12, err_msg=f"{step} {name}")
        live = np.arange(Hc)[None, :] < kernel["hn"][:, None]           # entries past a row's list are unused
        np.testing.assert_allclose(kernel["terms"].reshape(rows, Hc, 3)[live], twin["terms"].reshape(rows, Hc, 3)[live],
                                   rtol=1e-12)
        t += 1
    assert kernel["eref"][0] > 0                   # the rebase happened (and changed no decision)


def test_first_free_scan_matches_its_numpy_twin():
    rng = np.random.default_rng(3)
    bs, P = 16, 40
    occ = rng.choice([0, bs, 5], size=(12, P), p=[0.1, 0.8, 0.1]).astype(np.int32)
    occ[:, -1] = 3                                  # every row has a free slot in range
    qP = np.arange(12, dtype=np.int64) * P
    start = rng.integers(0, 20, 12)
    occ[np.arange(P)[None, :] < start[:, None]] = bs     # the pointer invariant: pages before start are full
    stop = np.full(12, P)
    kernel = [fk._scan_free(occ[i], start[i], stop[i], bs) for i in range(12)]
    assert kernel == ref.first_free_np(occ, qP, start, stop, bs).tolist()


@pytest.mark.parametrize("L, cand, keep", [(300, 260, 30), (50, 10, 10), (40, 0, 0), (300, 260, (0, 30, 7, 260))])
def test_prompt_scoring_kernel_matches_its_numpy_twin(L, cand, keep):
    rng = np.random.default_rng(5)
    R = 4
    keep = np.broadcast_to(np.asarray(keep, np.int64), R).copy()       # one keep per row, or all alike
    w, decay = np.exp(rng.standard_normal((R, L)) * 2), np.exp(-rng.random((R, L)) * 5)
    prompt = PromptRows(w, decay, rng.uniform(0.1, 0.5, R), rng.uniform(0.2, 0.6, R), rng.uniform(1, 3, R), rng.random(R))
    args = (prompt, 8, cand, keep, 4, 6)
    got, want = fk.prompt_cut(*args), ref.prompt_cut_np(*args)
    most = int(np.minimum(keep, cand).max())
    assert got[2].shape == (R, most) and np.array_equal(got[2], want[2])        # the kept positions
    assert ((got[2] >= 0).sum(axis=1) == np.minimum(keep, cand)).all()           # -1 past a row's keep
    assert got[3].shape == (R, most, 3) and got[4].shape == (R, 6)
    for g, w_ in zip(got, want, strict=True):
        assert np.array_equal(g, w_)


def test_prompt_cut_keeps_the_highest_scores_and_breaks_ties_by_position():
    z = np.zeros((1, 12))                  # equal content: scores tie except for the local term and sinks
    weight, decay, top, shift = fk.prompt_inputs(z, np.ones(1), np.full(1, 4.0), 1)
    prompt = PromptRows(weight, decay, np.zeros(1), np.full(1, 0.5), top, shift)
    got = fk.prompt_cut(prompt, 1, 10, np.array([6]), 4, 2)[2]
    assert got.tolist() == [[0, 1, 2, 3, 4, 5]]                 # the 4 sinks, then the lowest positions


STREAMING = {"policy": "streaming", "params": {"sink": 4, "window": 40}, "layout": "per_head"}


@pytest.mark.parametrize("policy,strategy", [(H2O, s) for s in ("noop", "free_block", "slot_reuse", "sparse_copy", "holed_copy",
                                                                 "compact")] + [(STREAMING, "free_block"),
                                                                                (STREAMING, "slot_reuse")]
                         + [({**H2O, "copy_threshold": 8}, s) for s in ("sparse_copy", "holed_copy")])
def test_fast_mode_runs_identically_on_the_numpy_twins(monkeypatch, policy, strategy):
    cfg = {**policy, "slot_strategy": strategy, "mode": "fast"}
    kw = dict(n=3, prompt=120, output=80, num_blocks=4000)
    compiled = run(cfg, **kw)[1]
    monkeypatch.setattr(fk, "decode_rows", None)          # the whole step in numpy
    monkeypatch.setattr(fk, "prompt_cut", ref.prompt_cut_np)
    twins = run(cfg, **kw)[1]
    for col in ("blocks_used", "live_slots", "allocated_slots", "evicted_tokens", "blocks_freed_by_eviction",
                "block_table_entries", "bytes_moved", "duration_s"):
        assert np.array_equal(compiled[col].to_numpy(), twins[col].to_numpy()), col


def test_kvsim_no_numba_selects_the_numpy_twins():
    code = ("import kvsim.sim.kv.fast.compiled.kernels as fk\n"
            "assert fk.decode_rows is None and fk.prompt_cut is fk.prompt_cut_np\n")
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "KVSIM_NO_NUMBA": "1"})


def test_without_numba_the_numpy_twins_run():
    code = ("import sys; sys.modules['numba'] = None\n"
            "import kvsim.sim.kv.fast.compiled.kernels as fk\n"
            "assert fk.decode_rows is None and fk.prompt_cut is fk.prompt_cut_np\n")
    subprocess.run([sys.executable, "-c", code], check=True)
