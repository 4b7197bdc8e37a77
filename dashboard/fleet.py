"""A fleet's figures as tables: per replica (from the run's request and step logs), per pool and the
prefill/decode hand-off (summary.json's `pools`, `handoff`), and the CPU offload tier (`kv_offload`).
A single-replica run without these sections has no fleet view. Over time (the Time series page), per
replica: the requests the router sent it, its running and waiting requests, KV cache use and prefix
hit rate (replica_series)."""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
import pandas as pd

from kvsim.dashboard.data import RunRecord, bin_steps, window_of


class FleetView(NamedTuple):
    replicas: pd.DataFrame | None
    pools: pd.DataFrame | None
    handoff: pd.DataFrame | None
    offload: pd.DataFrame | None


POOL_COLUMNS = {"gpu": "GPU", "tp": "TP", "replicas": "replicas", "utilization": "busy share",
                "mean_waiting": "waiting mean", "max_waiting": "waiting max", "mean_kv_use": "KV use mean",
                "max_kv_use": "KV use max", "prefill_tokens": "prefill tokens", "decode_tokens": "decode tokens"}
# the TTFT of a disaggregated request in its legs (docs/disaggregation.md#outputs), then the link's load
HANDOFF_LEGS = (("prefill queue", "prefill_queue_s"), ("prefill", "prefill_s"), ("KV wait", "kv_wait_s"),
                ("transfer", "transfer_s"), ("first decode", "first_decode_s"))
OFFLOAD_FIGURES = (("external prefix cache hit rate", "external_prefix_cache_hit_rate"),
                   ("external prefix cache queries (tokens)", "external_prefix_cache_queries"),
                   ("external prefix cache hits (tokens)", "external_prefix_cache_hits"),
                   ("blocks stored", "blocks_stored"), ("blocks loaded", "blocks_loaded"),
                   ("blocks evicted", "blocks_evicted"), ("blocks dropped (tier full)", "stores_dropped_blocks"),
                   ("GB to the tier", "bytes_to_tier"), ("GB from the tier", "bytes_from_tier"),
                   ("loads", "num_loads"), ("load wait mean (s)", "mean_load_wait_s"),
                   ("capacity per replica (blocks)", "capacity_blocks_per_replica"), ("host link GB/s", "link_gb_s"),
                   ("MiB per offloaded block", "bytes_per_block"), ("LMCache CPU work (s)", "lmcache_cpu_s"))


def fleet_view(run: RunRecord) -> FleetView | None:
    """The run's fleet tables, or None for one replica with no pools and no offload tier."""
    s = run.summary
    several = int(s.get("replicas", 1) or 1) > 1 or "pools" in s
    if not several and "kv_offload" not in s:
        return None
    return FleetView(replica_table(run, s.get("pools")) if several else None, pool_table(s.get("pools")),
                     handoff_table(s.get("handoff")), offload_table(s.get("kv_offload")))


def replica_table(run: RunRecord, pools: dict | None = None) -> pd.DataFrame:
    """Per replica: the requests that finished on it (a disaggregated request on its decode replica),
    the share of their prompt tokens its prefix cache served, mean running and waiting requests and KV
    blocks used over its steps (each step weighted by its duration). With pools, each replica's pool
    (replicas are numbered pool by pool, in the order of summary.json's `pools`)."""
    reqs, steps = run.requests, run.steps
    routed = reqs.groupby("replica").agg(requests=("request_id", "size"), prompt_tokens=("prompt_tokens", "sum"),
                                         cached_tokens=("cached_tokens", "sum"))
    routed["prefix hit rate"] = routed["cached_tokens"] / routed["prompt_tokens"].where(routed["prompt_tokens"] > 0)
    weighted = steps.assign(**{c: steps[c] * steps["duration_s"] for c in ("num_running", "num_waiting",
                                                                           "blocks_used")})
    per_step = weighted.groupby("replica").agg(steps=("step", "size"), busy_s=("duration_s", "sum"),
                                               running=("num_running", "sum"), waiting=("num_waiting", "sum"),
                                               blocks=("blocks_used", "sum"))
    busy = per_step["busy_s"].where(per_step["busy_s"] > 0)
    table = pd.DataFrame({"steps": per_step["steps"], "busy s": per_step["busy_s"],
                          "running mean": per_step["running"] / busy, "waiting mean": per_step["waiting"] / busy,
                          "KV blocks used mean": per_step["blocks"] / busy})
    table = routed[["requests", "prefix hit rate"]].join(table, how="outer")
    table["requests"] = table["requests"].fillna(0).astype(int)
    table.index.name = "replica"
    table = table.reset_index()
    roles = pool_roles(pools)
    if roles and len(roles) == len(table):
        table.insert(1, "pool", roles)
    return table


def pool_roles(pools: dict | None) -> list[str]:
    """Each replica's pool name (prefill / decode; prefill-0, decode-1, ... with several pools of a role):
    replicas are numbered pool by pool, in the order of summary.json's `pools`; [] without pools."""
    return [name for name, p in (pools or {}).items() for _ in range(int(p["replicas"]))]


# the per-replica series of the Time series page: (column prefix, what it is); a column is `PREFIX:REPLICA`
REPLICA_SERIES = (("routed_per_s", "requests routed / s"), ("num_running", "running"), ("num_waiting", "waiting"),
                  ("kv_usage", "KV cache usage"), ("prefix_hit_rate", "prefix hit rate"))


def is_fleet_run(run: RunRecord) -> bool:
    return int(run.summary.get("replicas", 1) or 1) > 1 or "pools" in run.summary


def replica_labels(run: RunRecord) -> dict[int, str]:
    """replica number -> its legend name ("replica 2", "replica 0 (prefill)" in a disaggregated fleet)."""
    ids = sorted(set(run.steps["replica"].astype(int)) | set(run.requests["replica"].dropna().astype(int))) \
        if "replica" in run.steps else []
    roles = pool_roles(run.summary.get("pools"))
    return {r: f"replica {r}" + (f" ({roles[r]})" if 0 <= r < len(roles) else "") for r in ids if r >= 0}


def replica_series(run: RunRecord, edges: np.ndarray) -> pd.DataFrame:
    """Per window (`edges`, as the Time series page's) and replica: the requests the router sent it per
    second (by arrival; a disaggregated request counts on its decode replica), its running and waiting
    requests and KV blocks used (duration-weighted means, as bin_steps gives the fleet's: the replicas'
    columns add up to the fleet's), KV cache usage over its own pool and the prefix-cache hit rate of
    the prompt tokens it admitted in the window. Columns `PREFIX:REPLICA` (REPLICA_SERIES)."""
    n = len(edges) - 1
    width = np.diff(edges)
    reqs, steps = run.requests, run.steps
    columns: dict[str, np.ndarray] = {"time_s": 0.5 * (edges[:-1] + edges[1:])}
    for r in replica_labels(run):
        mine = reqs[reqs["replica"] == r]
        columns[f"routed_per_s:{r}"] = np.bincount(window_of(mine["arrival_s"].to_numpy(float), edges),
                                                   minlength=n)[:n] / width
        own = steps[steps["replica"] == r]
        b = bin_steps(own, n, span=(float(edges[0]), float(edges[-1])))
        pool = float((own["blocks_used"] + own["blocks_free"]).max()) if len(own) else 0.0
        for c in ("num_running", "num_waiting", "blocks_used"):
            columns[f"{c}:{r}"] = b[c].to_numpy(float) if c in b else np.zeros(n)
        columns[f"kv_usage:{r}"] = columns[f"blocks_used:{r}"] / pool if pool > 0 else np.zeros(n)
        admitted = mine[mine["first_scheduled_s"].notna()]
        w = window_of(admitted["first_scheduled_s"].to_numpy(float), edges)
        prompt = np.bincount(w, weights=admitted["prompt_tokens"].to_numpy(float), minlength=n)[:n]
        cached = np.bincount(w, weights=admitted["cached_tokens"].to_numpy(float), minlength=n)[:n]
        columns[f"prefix_hit_rate:{r}"] = np.where(prompt > 0, cached / np.where(prompt > 0, prompt, 1), np.nan)
    return pd.DataFrame(columns)


def pool_table(pools: dict | None) -> pd.DataFrame | None:
    if not pools:
        return None
    # the pool's name (its role when a role has one pool; prefill-0, prefill-1, ... with several)
    return pd.DataFrame([{"pool": name, **{label: p.get(key) for key, label in POOL_COLUMNS.items()}}
                         for name, p in pools.items()])


def handoff_table(handoff: dict | None) -> pd.DataFrame | None:
    """The TTFT legs of the disaggregated requests (mean and p99), then the transfers over the link."""
    if not handoff:
        return None
    rows = [{"figure": f"{name} (s)", "mean": handoff.get(f"mean_{key}"), "p99": handoff.get(f"p99_{key}")}
            for name, key in HANDOFF_LEGS]
    rows += [{"figure": "transfers", "mean": handoff.get("transfers"), "p99": None},
             {"figure": "GB moved", "mean": handoff.get("transfer_bytes", 0) / 1e9, "p99": None},
             {"figure": f"link busy share ({handoff.get('links')} x {handoff.get('link')})",
              "mean": handoff.get("link_utilization"), "p99": None},
             {"figure": "prefilled on the decode pool (conditional)", "mean": handoff.get("local_prefills"),
              "p99": None}]
    return pd.DataFrame(rows)


def offload_table(offload: dict | None) -> pd.DataFrame | None:
    if not offload:
        return None
    scale = {"bytes_to_tier": 1e-9, "bytes_from_tier": 1e-9, "bytes_per_block": 2**-20}
    return pd.DataFrame([{"figure": name, "CPU tier": offload[key] * scale.get(key, 1)}
                         for name, key in OFFLOAD_FIGURES if key in offload])


# the hand-off's panels of the Time series page: (column, what it is)
HANDOFF_SERIES = (("transfers_per_s", "pulls started / s"), ("gb_per_s", "GB pulled / s"),
                  ("kv_wait_ms", "KV wait (mean)"), ("transfer_ms", "transfer (mean)"))


def handoff_series(run: RunRecord, edges: np.ndarray) -> pd.DataFrame | None:
    """Per window, the prefill-to-decode hand-offs of a disaggregated run whose KV pull started in it (the
    prefill leg's end plus the KV wait): pulls and GB a second, and their mean KV wait and transfer time;
    None for a run without hand-offs."""
    reqs = run.requests
    if "transfer_bytes" not in reqs:
        return None
    moved = reqs[reqs["transfer_s"].notna()]
    start = (moved["arrival_s"] + moved["prefill_queue_s"] + moved["prefill_s"] + moved["kv_wait_s"]).to_numpy(float)
    n, width = len(edges) - 1, np.diff(edges)
    w = window_of(start, edges)
    count = np.bincount(w, minlength=n)[:n].astype(float)
    mean = lambda col: np.where(count > 0, np.bincount(w, weights=moved[col].to_numpy(float), minlength=n)[:n]  # noqa: E731
                                / np.where(count > 0, count, 1) * 1e3, np.nan)
    return pd.DataFrame({"time_s": 0.5 * (edges[:-1] + edges[1:]), "transfers_per_s": count / width,
                         "gb_per_s": np.bincount(w, weights=moved["transfer_bytes"].to_numpy(float),
                                                 minlength=n)[:n] / width / 1e9,
                         "kv_wait_ms": mean("kv_wait_s"), "transfer_ms": mean("transfer_s")})
