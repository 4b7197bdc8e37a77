"""The result files of a run (requests.parquet, summary.json, config.yaml) and its summary.

Written alike by the simulator (`sim.simulator.simulate`) and the real backend's replay (`gpu.replay`), so
both produce the same schemas; steps.parquet is written by `sim.results.metrics.StepLog` as the run goes.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

import pandas as pd
import pyarrow.parquet as pq
import yaml

from kvsim.traces.loaders import DATA_TRACES

from ..config import FILE_KEYS, SimConfig, config_section, names_a_file, split_file_value
from ..core.prefix_lookups import PrefixLookups
from ..model.cost_model import profile_fit_error
from ..kv.metrics import kv_summary
from ..model.memory import vllm_kv_cache_report
from .metrics import summarize
from .request_log import requests_arrow, token_stats
from ..io.safe_io import dumps_json
from .saturation import saturation
from .vllm_metrics import bench_metrics

if TYPE_CHECKING:
    from ..engine.resolved_run import ResolvedRun


def managed_pool_blocks(kvs: list, num_blocks: int) -> int:
    """Blocks of the pool actually managed (per_head pools count one-head blocks)."""
    return kvs[0].pool.num_blocks if kvs else num_blocks


def run_summary(plan: ResolvedRun, req_df: pd.DataFrame, steps_df: pd.DataFrame | dict, kvs: list,
                client_latency: bool = False, tokens=None, step_variance_sigma: float = 0.0) -> dict:
    """summary.json of a run (simulated or replayed) from its plan and its request and step tables (a
    streamed run: its step figures, sim.results.request_log.step_figures_from_file, and token figures,
    sim.results.request_log.TokenStats). `step_variance_sigma`: the simulation's step-time variance (0 for a
    replay: its steps take the time they take)."""
    cfg, num_blocks, profile = plan.cfg, plan.num_blocks, plan.cost.profile
    if tokens is None and "token_times_s" in req_df:       # the token figures once for both summaries
        done = req_df[req_df["status"] == "finished"]
        tokens = token_stats(done["token_times_s"], float(done["arrival_s"].min()) if len(done) else 0.0)
    lookups = PrefixLookups.total(kv.prefix_lookups for kv in kvs)
    summary = summarize(req_df, steps_df, num_blocks_total=managed_pool_blocks(kvs, num_blocks),
                        slo_ttft_s=cfg.slo.ttft_s, slo_tpot_s=cfg.slo.tpot_s,
                        prefix_queries=lookups.queries, prefix_hits=lookups.hits, tokens=tokens)
    summary["prefix_hit_rate_preempted"] = (lookups.hits_preempted / lookups.queries_preempted
                                            if lookups.queries_preempted else 0.0)
    if not cfg.kv.is_default:
        totals = pd.DataFrame({k: [v] for k, v in steps_df.items()}) if isinstance(steps_df, dict) else steps_df
        summary.update(kv_summary(kvs, req_df, totals))
    summary.update(run_bench_metrics(cfg, req_df, tokens))
    kv_tokens, concurrency = vllm_kv_cache_report(plan.model, num_blocks, cfg.engine.block_size, plan.max_model_len,
                                                  plan.scheduler.max_num_batched_tokens)

    summary.update(saturation(req_df))
    summary.update({"num_gpu_blocks": num_blocks, "block_size": cfg.engine.block_size,
                    "kv_cache_tokens": kv_tokens, "kv_max_concurrency": concurrency,
                    "max_model_len": plan.max_model_len, "model": plan.model.name, "gpu": plan.gpu.name,
                    "tp": cfg.tp, "replicas": cfg.replicas, "trace": cfg.trace,
                    # the profile that priced the steps (the replay's predicted_s) and its measured error
                    "profile": profile.name if profile else None,
                    "profile_step_mape": profile_fit_error(profile) if profile else None,
                    "client_latency": client_latency, "step_variance_sigma": step_variance_sigma})
    if cfg.pp > 1 or cfg.dp > 1:          # parallelism beyond TP (docs/parallelism.md): keys only when used
        summary.update({"pp": cfg.pp, "dp": cfg.dp, "gpus_per_replica": cfg.gpus_per_replica})
    return summary


def run_bench_metrics(cfg: SimConfig, req_df: pd.DataFrame, tokens=None) -> dict:
    """`vllm bench serve`'s result keys (sim/results/vllm_metrics.py), and the load options it echoes when set."""
    opts = cfg.trace_options
    start = 0.0 if opts.request_rate is not None or not len(req_df) else float(
        req_df.get("client_arrival_s", req_df["arrival_s"]).min())
    out = bench_metrics(req_df, start_s=start, percentiles=cfg.metric_percentiles,
                        slo_ttft_s=cfg.slo.ttft_s, slo_tpot_s=cfg.slo.tpot_s, tokens=tokens)
    if opts.request_rate is not None:
        out.update(request_rate=opts.request_rate, burstiness=opts.burstiness)
    if opts.max_concurrency is not None:
        out["max_concurrency"] = opts.max_concurrency
    return out


def write_outputs(out: Path, cfg: SimConfig, req_df: pd.DataFrame | None, summary: dict) -> None:
    """requests.parquet (unless `req_df` is None: sim.results.request_log.RequestLog streamed it), summary.json
    and config.yaml (steps.parquet is written by the StepLog)."""
    if req_df is not None:
        pq.write_table(requests_arrow(req_df), out / "requests.parquet", use_dictionary=False)
    # an infinite configured rate is a setting, not a division by zero: "inf", as vllm bench serve writes it
    summary = {**summary, **{key: "inf" for key in ("request_rate", "burstiness")
                             if isinstance(summary.get(key), float) and math.isinf(summary[key])}}
    # NaN (e.g. a percentile of no finished request) becomes null with a reason: JSON has no NaN
    (out / "summary.json").write_text(dumps_json(summary, indent=2, default=float))
    data = cfg.model_dump(mode="json")
    for section in ("kv_offload", "router_options"):
        if data.get(section) is None:
            data.pop(section, None)           # off: the section is absent, as before it existed
    (out / "config.yaml").write_text(yaml.safe_dump(portable_config(data), sort_keys=False))


# a FILE_KEYS value is read relative to the working directory, so config.yaml keeps it absolute
def portable_config(data: dict) -> dict:
    """`data` with each relative file path of FILE_KEYS made absolute, so `kvsim simulate -c OUT/config.yaml`
    reads the same files from any directory (names of shipped traces, catalog entries and profiles stay)."""
    for *sections, key in (dotted.split(".") for dotted in FILE_KEYS):
        parent = config_section(data, sections)
        value = parent.get(key) if isinstance(parent, dict) else None
        if not isinstance(value, str):
            continue
        head, sep, tail = split_file_value(value)     # file.yaml#Name, file.yaml*1.2: the path is file.yaml
        path = Path(head)
        if names_a_file(head) and not path.is_absolute() and path.exists() and value not in DATA_TRACES:
            parent[key] = str(path.resolve()) + sep + tail
    return data
