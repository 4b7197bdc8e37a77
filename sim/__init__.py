"""kvsim's engine core and simulator (installed as `kvsim.sim`).

Run from a checkout that was not installed (`python -m sim.cli ...`, e.g. on a GPU machine where
nothing can be downloaded), this package is imported as top-level `sim`: it then makes the
checkout importable as `kvsim` (the repository root is the `kvsim` namespace), so every
`kvsim.*` import resolves to these folders.
"""
import sys as _sys
import types as _types
from pathlib import Path as _Path

if __name__ == "sim":
    try:
        import kvsim.sim as _installed  # noqa: F401 - an installed kvsim wins
    except ImportError:
        _kvsim = _types.ModuleType("kvsim", "kvsim run from a checkout")
        _kvsim.__path__ = [str(_Path(__file__).resolve().parent.parent)]
        _sys.modules["kvsim"] = _kvsim
