"""The four pool types behind one protocol (sim.core.protocols.KVPool), and what each pool does
that a KV manager relies on: pages taken are no longer free, pages given back are."""
from __future__ import annotations

import numpy as np
import pytest

from kvsim.sim.core.block_pool import BlockPool
from kvsim.sim.core.protocols import KVPool
from kvsim.sim.kv.fast.sampled.rows import ScaledPoolView
from kvsim.sim.kv.fast.slab import CountPool
from kvsim.sim.kv.pool import ArrayBlockPool


@pytest.mark.parametrize("pool", [BlockPool(16), ArrayBlockPool(16), ArrayBlockPool(16, order="ring"),
                                  CountPool(16, unit=2), ScaledPoolView(ArrayBlockPool(8), 2)],
                         ids=["BlockPool", "ArrayBlockPool", "ArrayBlockPool-ring", "CountPool", "ScaledPoolView"])
def test_every_pool_type_implements_the_pool_protocol(pool):
    assert isinstance(pool, KVPool)
    assert pool.num_blocks == 16 and pool.num_free_blocks == 16 and pool.num_used_blocks == 0
    assert pool.num_cached_free_blocks == 0 and pool.num_cache_evictions == 0
    pool.check_invariants()


def test_count_pool_counts_sampled_pages_as_unit_pool_pages():
    pool = CountPool(12, unit=3)
    pool.take(2)                                  # two simulated pages = six pool pages
    assert (pool.num_free_blocks, pool.num_used_blocks) == (6, 6)
    with pytest.raises(ValueError, match="cannot allocate 9 blocks, only 6 free"):
        pool.take(3)
    pool.give(2)
    assert pool.num_free_blocks == 12
    pool.check_invariants()


def test_array_pool_returns_freed_blocks_and_refuses_foreign_ones():
    pool = ArrayBlockPool(8)
    ids = pool.get_new_blocks(3)
    assert len(set(ids.tolist())) == 3 and pool.num_free_blocks == 5
    pool.free_blocks(ids[:2])
    assert pool.num_free_blocks == 7
    assert pool.get_new_blocks(1)[0] == ids[0]    # stack order: the most recently freed first
    with pytest.raises(AssertionError, match="not owned"):
        pool.free_blocks(np.array([ids[1]]))      # already back in the pool
    pool.check_invariants()


def test_scaled_view_follows_its_pool():
    inner = ArrayBlockPool(10)
    view = ScaledPoolView(inner, 4)
    inner.get_new_blocks(3)
    assert (view.num_blocks, view.num_free_blocks, view.num_used_blocks) == (40, 28, 12)


@pytest.mark.parametrize("order", ["stack", "ring"])
def test_array_pool_invariant_check_catches_a_corrupted_free_list(order):
    pool = ArrayBlockPool(10, order=order)
    ids = pool.get_new_blocks(7)
    pool.free_blocks(ids[:5])          # the ring's free range now wraps past the end
    pool.check_invariants()
    first_free = pool.head if order == "ring" else 0
    pool.free[first_free] = pool._free_ids()[-1]      # one free id listed twice, another lost
    with pytest.raises(AssertionError, match="twice"):
        pool.check_invariants()
    fresh = ArrayBlockPool(10, order=order)
    fresh.owned[3] = True                             # owned, still free-listed, count not updated
    with pytest.raises(AssertionError, match="drifted"):
        fresh.check_invariants()
    fresh.count -= 1
    with pytest.raises(AssertionError, match="owned"):
        fresh.check_invariants()


POOL_TYPES = {"BlockPool", "ArrayBlockPool", "CountPool", "ScaledPoolView"}
COUNTERS = {"num_free_blocks", "num_used_blocks", "num_cached_free_blocks"}


def counters_defined() -> dict[str, set[str]]:
    """Class name -> the pool counters it defines (a method/property, a class attribute or `self.X =`
    in its methods), over sim/ and gpu/."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    out = {}
    for folder in ("sim", "gpu"):
        for path in sorted((root / folder).rglob("*.py")):
            for cls in (n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ClassDef)):
                names = {f.name for f in cls.body if isinstance(f, ast.FunctionDef)}
                names |= {t.id for a in cls.body if isinstance(a, (ast.Assign, ast.AnnAssign))
                          for t in (a.targets if isinstance(a, ast.Assign) else [a.target]) if isinstance(t, ast.Name)}
                names |= {t.attr for n in ast.walk(cls) if isinstance(n, (ast.Assign, ast.AugAssign))
                          for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
                          if isinstance(t, ast.Attribute) and getattr(t.value, "id", "") == "self"}
                if names & COUNTERS:
                    out[cls.name] = names & COUNTERS
    return out


def test_pool_counters_are_defined_by_the_pools_alone():
    """No KV manager repeats its pool's counters: the scheduler, the step log and the fast-forward
    read them on `kv.pool` (the KVPool protocol); only the four pool types define them."""
    found = counters_defined()
    assert set(found) - {"KVPool", "FastForwardPool"} == POOL_TYPES, found
    assert all(found[name] == COUNTERS for name in ("BlockPool", "ArrayBlockPool", "CountPool", "ScaledPoolView"))
