"""What the slot strategies copy and give back, counted from the tokens (issue 53 items 3 and 4): sparse
copy's bytes are the tokens it moves times the bytes of a token, whatever the block size; free_block gives a
page back exactly when every token written to it has been evicted."""
import numpy as np
import pytest

from kvsim.sim.kv.manager import EvictingKVManager
from kvsim.sim.model.cost_model import CostModel
from test_kv_manager import MODEL, run

N, PROMPT, OUTPUT, BUDGET = 2, 120, 60, 60
BYTES_PER_TOKEN = CostModel(MODEL, "l4").kv_bytes_per_token          # SmolLM2-135M: 23,040 (K and V, 30 layers)
ROWS = 30 * 3                                                         # per_head: layers x KV heads
SETUPS = {
    # H2O as its reference code runs it: no prompt cut, one token in and one out a step, so every row holds
    # the prompt's 120 tokens; the step after each eviction rewrites all of them. The first decode step
    # follows no eviction and the last one's is never copied (the request is done): output - 2 copies.
    "per_step": ({"layout": "per_head", "params": {"evict_per_step": 1}}, ROWS * (OUTPUT - 2) * PROMPT),
    # SpvLLM's: one decision per sequence, the prompt cut to the budget, then one token a step: each of the
    # output - 1 decode steps follows an eviction and rewrites the budget's tokens
    "cut": ({"layout": "shared", "params": {"obs_window": 1}}, (OUTPUT - 1) * BUDGET),
}


@pytest.mark.parametrize("mode", ["token", "fast"])
@pytest.mark.parametrize("setup", sorted(SETUPS))
def test_sparse_copy_bytes_are_the_kept_tokens_times_bytes_per_token_whatever_the_block_size(setup, mode):
    kv, token_rows = SETUPS[setup]
    kv = {"policy": "h2o", "budget": BUDGET, "slot_strategy": "sparse_copy", "mode": mode, **kv}
    rows = ROWS if kv["layout"] == "per_head" else 1
    want = N * token_rows * BYTES_PER_TOKEN / rows                     # a row's token is 1 / rows of a token
    for block_size in (8, 32):                                        # 4x the blocks at 8: the same bytes
        s = run(kv, n=N, prompt=PROMPT, output=OUTPUT, num_blocks=64_000 // block_size, block_size=block_size,
                check=True)[0]
        assert s["preemptions"] == 0
        assert s["bytes_moved"] == want, (block_size, s["bytes_moved"], want)


def _page_release_log(monkeypatch, kv: dict, **kw):
    """Run `kv` (token mode) and log, for every applied decision, the request, the (row, position) pairs it
    evicted and the pages the manager gave back for it."""
    log = []
    apply = EvictingKVManager._apply

    def spy(self, req, rk, decision):
        before = len(self.effects.decisions)
        freed = apply(self, req, rk, decision)
        evicted = [(r, p) for _, rows, pos, _, _ in self.effects.decisions[before:] for r, p in zip(rows, pos, strict=True)]
        log.append((req.request_id, evicted, freed))
        return freed

    monkeypatch.setattr(EvictingKVManager, "_apply", spy)
    s = run(kv, **kw)[0]
    return s, log


@pytest.mark.parametrize("kv", [
    {"policy": "h2o", "budget": BUDGET, "layout": "per_head", "params": {"evict_per_step": 1}},
    {"policy": "h2o", "budget": BUDGET, "layout": "shared", "params": {"obs_window": 1}},
    {"policy": "streaming", "layout": "per_head", "params": {"sink": 4, "window": 40}},
], ids=["h2o-per-step", "h2o-cut-shared", "streaming"])
def test_free_block_gives_a_page_back_exactly_when_all_its_tokens_are_evicted(monkeypatch, kv):
    # append-only (free_block never moves a token): page k of a row holds positions 16k .. 16k + 15, so the
    # pages a decision must free are those whose 16 positions have all been evicted by then, counted from
    # the evicted positions alone; the manager's count must be that, decision by decision
    bs = 16
    s, log = _page_release_log(monkeypatch, {**kv, "slot_strategy": "free_block"}, n=N, prompt=PROMPT,
                               output=OUTPUT, num_blocks=4000, check=True)
    evicted: dict[tuple[int, int], np.ndarray] = {}      # (request, row): evicted positions
    whole: dict[tuple[int, int], int] = {}               # (request, row): pages wholly evicted so far
    for req, pairs, freed in log:
        rows = {}
        for r, p in pairs:
            rows.setdefault(int(r), []).append(int(p))
        new_pages = 0
        for r, ps in rows.items():
            e = evicted.setdefault((req, r), np.zeros(PROMPT + OUTPUT + bs, bool))
            e[ps] = True
            pages = int(e[:len(e) // bs * bs].reshape(-1, bs).all(axis=1).sum())
            new_pages += pages - whole.get((req, r), 0)
            whole[req, r] = pages
        assert freed == new_pages, (req, freed, new_pages)
    assert sum(whole.values()) == s["blocks_freed_by_eviction"] > 0
