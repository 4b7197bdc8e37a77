"""Fast mode's components alone (issue 27): each is built from what it declares and does its part
without the manager; and no component reads an attribute of itself that it never sets."""
import ast
from pathlib import Path

import numpy as np
import pytest

from kvsim.sim.core.request import Request
from kvsim.sim.kv.base import FastOptions
from kvsim.sim.kv.fast.budgets import CutBudgets
from kvsim.sim.kv.fast.scoring import Scorer
from kvsim.sim.kv.fast.settings import BUDGET_SENTINEL, resolve_settings
from kvsim.sim.kv.fast.slab import CountPool, FastSlab, Ledger
from kvsim.sim.kv.fast.slots import SlotStrategy
from kvsim.sim.kv.policy import PolicyContext, PolicyError, get_policy

ROOT = Path(__file__).resolve().parent.parent
COMPONENT_MODULES = ("manager", "settings", "slab", "budgets", "scoring", "slots", "step", "recut", "reclaim")
CTX = PolicyContext("per_head", 2, 2, 2, 16, 4)


def _parts(policy, strategy: str, bytes_per_token_row: float = 2.0):
    """Settings, slab, ledger and slot strategy of a small unscored run (4 real rows, 2 simulated)."""
    cfg = resolve_settings(16, CTX, policy, FastOptions(slot_strategy=strategy, sample_rows=2,
                                                        bytes_per_token_row=bytes_per_token_row))
    strata = np.arange(CTX.rows).reshape(cfg.rows, cfg.unit)
    budgets = CutBudgets(cfg, policy.fast_mode_profile(), CTX, strata)
    slab = FastSlab(cfg, None, None)
    ledger = Ledger(CountPool(1000, cfg.unit), cfg.bytes_per_token_row)
    scorer = Scorer(cfg, slab, None, np.random.default_rng(0), budgets)
    return cfg, slab, ledger, SlotStrategy(cfg, slab, ledger, scorer)


def _row(slab, s: int, r: int, occ: list[int], tail_w: int) -> None:
    """Row r of slot s holds pages with these live counts (written densely; the tail written to tail_w)."""
    n = len(occ)
    slab.occ[s, r, :n] = occ
    slab.alive[s, r, :n] = True
    slab.pages[s, r] = slab.ncol[s, r] = n
    slab.tail[s, r], slab.tail_w[s, r] = n - 1, tail_w
    slab.live[s, r] = sum(occ)


def test_settings_resolve_the_profile_once():
    snap = get_policy("snapkv", budget=48, decode_compression="every_n", decode_interval=16)
    cfg = resolve_settings(16, CTX, snap, FastOptions())
    assert cfg.recut == "every_n" and cfg.budget == BUDGET_SENTINEL and cfg.list_cap == 64
    noop = resolve_settings(16, CTX, get_policy("h2o", budget=60), FastOptions(slot_strategy="noop"))
    assert not noop.tracks_columns and noop.rows == 1 and noop.unit == CTX.rows and noop.scored
    with pytest.raises(ValueError, match="kv.slot_strategy must be one of"):
        resolve_settings(16, CTX, snap, FastOptions(slot_strategy="bogus"))
    with pytest.raises(PolicyError, match="evict_per_step must be 1"):
        resolve_settings(16, CTX, get_policy("h2o", evict_per_step=2), FastOptions())


def test_ledger_gives_pages_back_and_charges_moved_bytes_per_call():
    ledger = Ledger(CountPool(100, 2), 1.5)
    ledger.pool.take(10)
    ledger.free_evicted(3)
    ledger.charge_moved(3)            # 4.5 -> 4
    ledger.charge_moved(3)
    assert ledger.pool.num_free_blocks == 100 - 20 + 6
    plan = ledger.take_effects()
    assert (plan.blocks_freed_by_eviction, plan.bytes_moved) == (3, 8)
    assert ledger.effects is not plan and ledger.effects.bytes_moved == 0


def test_cut_budgets_fire_every_n_decode_steps_after_the_cut():
    snap = get_policy("snapkv", budget=48, decode_compression="every_n", decode_interval=16)
    cfg = resolve_settings(16, CTX, snap, FastOptions(sample_rows=2))
    budgets = CutBudgets(cfg, snap.fast_mode_profile(), CTX, np.arange(4).reshape(2, 2))
    budgets.cut_len[3] = 100
    never = lambda s: pytest.fail("every_n never asks for the listed counts")    # noqa: E731
    assert budgets.recut_keep(3, 117, never) is None
    keep = budgets.recut_keep(3, 116, never)
    assert keep.tolist() == budgets.row_keep(116, cfg.window).tolist() and keep.shape == (cfg.rows,)


def test_slab_grows_its_slots_and_keeps_their_contents():
    cfg, slab, _, _ = _parts(get_policy("streaming", sink=4, window=32), "free_block")
    reqs = [Request(i, 0.0, 10, 10) for i in range(5)]
    first = slab.slot(reqs[0])
    slab.occ[first, 1, 0] = 7
    slab.slot_live[first] = 7
    slab.mirror_counts()
    size = slab.occ.shape[0]
    slots = [slab.slot(r) for r in reqs]                    # the fifth finds no free slot: the slab doubles
    assert len(set(slots)) == 5 and slots[0] == first and slab.occ.shape[0] == 2 * size
    assert slab.occ[first, 1, 0] == 7 and slab.live_l[first] == 7
    slab.release(reqs[0], first)
    assert reqs[0] not in slab.slot_of and slab.occ[first].sum() == 0 and slab.free_slots[-1] == first
    assert slab.live_l == slab.slot_live.tolist()


def test_free_block_returns_an_emptied_page_but_keeps_an_open_tail():
    cfg, slab, ledger, slots = _parts(get_policy("streaming", sink=4, window=32), "free_block")
    s = slab.slot(Request(0, 0.0, 10, 10))
    ledger.pool.take(3)
    _row(slab, s, 0, [16, 0, 0], tail_w=5)                  # column 2: the open tail, all evicted
    slots.settle_generic(s, np.array([0]))
    assert slab.alive[s, 0, :3].tolist() == [True, False, True] and slab.pages[s, 0] == 2
    assert ledger.effects.blocks_freed_by_eviction == 1 and ledger.pool.num_used_blocks == 2 * cfg.unit


def test_compaction_moves_the_last_pages_survivors_into_holes_and_charges_their_bytes():
    cfg, slab, ledger, slots = _parts(get_policy("streaming", sink=4, window=1), "compact", bytes_per_token_row=2.0)
    s = slab.slot(Request(0, 0.0, 10, 10))
    ledger.pool.take(3)
    _row(slab, s, 0, [16, 4, 8], tail_w=16)                 # 28 live tokens fit 2 pages
    slab.ntok[s] = 40
    slots.compact_rows(s, np.array([0]))
    assert slab.occ[s, 0, :3].tolist() == [16, 12, 0] and slab.alive[s, 0, :3].tolist() == [True, True, False]
    assert slab.pages[s, 0] == 2 and ledger.effects.blocks_freed_by_eviction == 1 and ledger.effects.bytes_moved == 16


def _class_names(cls: ast.ClassDef) -> set[str]:
    """Methods, properties and class attributes of a class."""
    names = {n.name for n in cls.body if isinstance(n, ast.FunctionDef)}
    names |= {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    return names | {t.id for n in cls.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}


def _reads_undeclared(cls: ast.ClassDef, inherited: set[str]) -> set[str]:
    declared = set(inherited) | _class_names(cls)
    read = set()
    for node in ast.walk(cls):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
            (declared if isinstance(node.ctx, ast.Store) else read).add(node.attr)
    return read - declared


def test_no_fast_component_reads_an_attribute_it_never_sets():
    probe = ast.parse("class A:\n    k = 1\n    def __init__(self, x):\n        self.x = x\n"
                      "    def f(self):\n        return self.x + self.k + self.y + self.f()\n").body[0]
    assert _reads_undeclared(probe, set()) == {"y"}
    base = ast.parse((ROOT / "sim/kv/base.py").read_text())
    inherited = set().union(*(_class_names(c) for c in base.body if isinstance(c, ast.ClassDef)))
    seen, undeclared = [], {}
    for name in COMPONENT_MODULES:
        tree = ast.parse((ROOT / f"sim/kv/fast/{name}.py").read_text())
        for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
            seen.append(cls.name)
            assert len(cls.bases) <= 1, f"{cls.name}: a fast component composes, it does not mix in"
            if missing := _reads_undeclared(cls, inherited if cls.bases else set()):
                undeclared[cls.name] = sorted(missing)
    assert {"FastKVManager", "FastSlab", "Ledger", "CutBudgets", "Scorer", "SlotStrategy", "FastStep", "Recut",
            "Reclaim"} <= set(seen)
    assert not undeclared, f"attributes read but never set: {undeclared}"
