"""Summary metrics of eviction-aware runs (added to the simulation summary)."""
from __future__ import annotations

import math

import numpy as np


def kv_summary(managers, requests, steps) -> dict:
    """Compression, attention mass kept and eviction counts of a run of eviction-aware `managers`."""
    logical = sum(m.logical_token_steps for m in managers)
    stored = sum(m.stored_token_steps for m in managers)
    mass = requests["attention_mass_retained"].dropna() if "attention_mass_retained" in requests else []
    out = {
        "compression_ratio": logical / stored if stored else math.nan,
        "attention_mass_retained_mean": float(np.mean(mass)) if len(mass) else math.nan,
        "attention_mass_retained_p10": float(np.percentile(mass, 10)) if len(mass) else math.nan,
        "evicted_tokens": float(requests["evicted_tokens"].sum()) if "evicted_tokens" in requests else 0.0,
    }
    if len(steps):
        out["bytes_moved"] = int(steps["bytes_moved"].sum())
        out["blocks_freed_by_eviction"] = int(steps["blocks_freed_by_eviction"].sum())
        out["evicted_token_rows"] = int(steps["evicted_tokens"].sum())
    return out
