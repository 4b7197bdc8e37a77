"""kvsim traces: the canonical request trace, loaders for public trace formats, synthetic
generators, transforms and statistics.

    from kvsim.traces import load_trace
    t = load_trace("azure-conv-2023")             # shipped short name or any supported file
    t = load_trace("sharegpt-8k-filtered", rate=2.0, seed=0)  # length-only stats + Poisson arrivals

The names below load on first use (PEP 562), so importing one light submodule (kvsim.traces.formats,
.errors) does not import pandas: the command line's start-up depends on it.
"""
from importlib import import_module

from kvsim.traces.errors import TraceError, TraceWarning
from kvsim.traces.formats import FORMATS

_LAZY = {"DATA_DIR": "loaders", "DATA_TRACES": "loaders", "detect_format": "loaders", "load_trace": "loaders",
         "trace_stats": "stats", "COLUMNS": "trace", "Trace": "trace"}

__all__ = ["COLUMNS", "DATA_DIR", "DATA_TRACES", "FORMATS", "Trace", "TraceError", "TraceWarning",
           "detect_format", "load_trace", "trace_stats"]


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(import_module(f"kvsim.traces.{_LAZY[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'kvsim.traces' has no attribute {name!r}")
