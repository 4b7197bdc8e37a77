"""kvsim traces: the canonical request trace, loaders for public trace formats, synthetic
generators, transforms and statistics.

    from kvsim.traces import load_trace
    t = load_trace("azure-conv-2023")             # shipped short name or any supported file
    t = load_trace("sharegpt-8k-filtered", rate=2.0, seed=0)  # length-only stats + Poisson arrivals
"""
from kvsim.traces.errors import TraceError, TraceWarning
from kvsim.traces.loaders import DATA_DIR, DATA_TRACES, FORMATS, detect_format, load_trace
from kvsim.traces.stats import trace_stats
from kvsim.traces.trace import COLUMNS, Trace

__all__ = ["COLUMNS", "DATA_DIR", "DATA_TRACES", "FORMATS", "Trace", "TraceError", "TraceWarning",
           "detect_format", "load_trace", "trace_stats"]
