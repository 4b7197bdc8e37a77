"""`kvsim simulate` of a disaggregated fleet (config `fleet:`, docs/disaggregation.md): a prefill pool
and a decode pool, each resolved once through its own run plan (GPU, TP, profile, engine settings,
KV pool size), joined by a link of the catalog behind vLLM's disaggregated-serving proxy
(sim/cluster/fleet.py). Writes the usual outputs: requests.parquet with the pools, replicas and the
TTFT split of each request, steps.parquet (every replica of both pools), summary.json with a
`pools` section (per pool utilisation, queue, KV use; the hand-off links' bytes, time, utilisation).
"""
from __future__ import annotations

import math
import time
from typing import NamedTuple

import numpy as np
import pandas as pd

from ..cluster.fleet import DisaggregatedProxy, Fleet, Handoff, PoolSpec, build_disaggregated, feed
from ..cluster.links import LinkSpec, get_link, handoff_link
from ..config import ConfigError, EngineConfig, SimConfig
from ..engine.assembly import EngineRun, trace_to_requests
from ..engine.loop import EngineClock, ReplicaOptions
from ..engine.resolved_run import ResolvedRun, resolve_run
from ..model.memory import check_memory
from ..results.metrics import SUMMARY_STEP_COLUMNS, StepLog, request_table
from ..results.outputs import run_summary, write_outputs
from .executor import replica_parts

# requests.parquet's extra columns in a disaggregated run: the pools and the TTFT split
# (prefill_queue_s + prefill_s + kv_wait_s + transfer_s + first_decode_s = ttft_s for a handed-off request)
FLEET_REQUEST_COLUMNS = {
    "pool": "decode pool's name (every request finishes there)",
    "disaggregated": "prefilled on the prefill pool and handed off (false: prefilled locally on the decode pool)",
    "prefill_replica": "prefill replica of its prefill leg (-1: none)",
    "prefill_queue_s": "arrival to the leg's first step on the prefill pool",
    "prefill_s": "the leg's first step to its end (its prompt computed)",
    "kv_wait_s": "prefill end to the start of the KV pull (decode admission, then the link's queue)",
    "transfer_s": "the KV pull on the link (latency + bytes / bandwidth)",
    "first_decode_s": "the pull's end to the first token (the decode side's first step)",
    "transfer_tokens": "prompt tokens whose KV was pulled",
    "transfer_bytes": "bytes pulled over the link",
}


class FleetPlans(NamedTuple):
    prefill: ResolvedRun
    decode: ResolvedRun


def pool_config(cfg: SimConfig, role: str) -> SimConfig:
    """The run's config as one pool of its fleet sees it: the pool's GPU, TP, profile, replicas, router
    and engine settings over the run's."""
    pool = getattr(cfg.fleet, role)
    engine = EngineConfig.model_validate({**cfg.engine.model_dump(exclude_unset=True), **pool.engine})
    return cfg.model_copy(update={"gpu": pool.gpu or cfg.gpu, "tp": pool.tp or cfg.tp, "profile": pool.profile or cfg.profile,
                                  "replicas": pool.replicas, "router": pool.router or cfg.router, "engine": engine,
                                  "fleet": None})


def fleet_plans(cfg: SimConfig, trace) -> FleetPlans:
    """Each pool's run plan, resolved once; a pool that cannot run (its TP does not fit the model or the
    GPU's memory) is refused naming it."""
    refuse_unsupported(cfg)
    plans = []
    for role in ("prefill", "decode"):
        try:
            plan = resolve_run(pool_config(cfg, role), trace=trace)
        except (ConfigError, ValueError) as exc:
            raise ConfigError(f"fleet.{role}: {exc}") from None
        plans.append(plan)
    return FleetPlans(*plans)


def refuse_unsupported(cfg: SimConfig) -> None:
    """What a disaggregated run does not model (yet): said, not ignored."""
    opts = cfg.trace_options
    if cfg.replicas != 1:
        raise ConfigError(f"replicas ({cfg.replicas}): a fleet's pools give their replicas (fleet.prefill.replicas, "
                          "fleet.decode.replicas); drop replicas")
    if opts.max_concurrency is not None or opts.arrival_unit == "step":
        raise ConfigError("fleet: a disaggregated fleet runs open-loop trace arrivals; drop "
                          "trace_options.max_concurrency / arrival_unit: step")
    if not cfg.kv.is_default:
        raise ConfigError(f"fleet: KV policy {cfg.kv.policy!r}: a disaggregated fleet runs vLLM's plain KV manager "
                          "(the hand-off of an evicted or compressed KV is not modelled); drop kv.policy")
    if cfg.frontend_name != "none":
        raise ConfigError("fleet: client_latency / frontend: the proxy's client-side terms are not modelled; drop it")
    if cfg.kv_offload is not None:
        raise ConfigError("fleet: kv_offload: a disaggregated fleet's replicas have no CPU KV tier yet (their KV "
                          "connectors are the prefill-to-decode hand-off); drop kv_offload / --kv-offload")


def handoff_of(cfg: SimConfig, plans: FleetPlans) -> Handoff:
    """The hand-off: the link between a prefill and a decode instance (each decode replica has its own),
    and the bytes a prompt token moves: what the decode side's GPUs hold (its KV dtype; a KV head that
    its TP replicates is pulled by each GPU that holds it)."""
    fleet = cfg.fleet
    one = get_link(fleet.link, bandwidth_gb_s=fleet.link_bandwidth_gb_s, latency_s=fleet.link_latency_s)
    link: LinkSpec = handoff_link(one, plans.prefill.cfg.tp, plans.decode.cfg.tp)
    decode_cost = plans.decode.cost
    return Handoff(link, decode_cost.kv_bytes_per_token_per_gpu * plans.decode.cfg.tp,
                   abort_timeout_s=fleet.abort_timeout_s, local_prefill_tokens=fleet.local_prefill_tokens,
                   layerwise_layers=plans.decode.model.num_layers if fleet.layerwise_overlap else 0)


def checked_plans(cfg: SimConfig, trace) -> FleetPlans:
    """The pools' plans, refused (ConfigError) where a pool cannot run or the two disagree, and their
    host memory checked: before anything is written."""
    plans = fleet_plans(cfg, trace)
    check_pools_agree(plans)
    for plan in plans:
        check_memory(plan.memory)
    return plans


def check_pools_agree(plans: FleetPlans) -> None:
    p, d = plans.prefill, plans.decode
    if p.cfg.engine.block_size != d.cfg.engine.block_size:
        raise ConfigError(f"fleet: engine.block_size differs between the pools ({p.cfg.engine.block_size} and "
                          f"{d.cfg.engine.block_size}); NIXL moves whole blocks: expected one block size")
    if p.max_model_len != d.max_model_len:
        raise ConfigError(f"fleet: max_model_len differs between the pools ({p.max_model_len} and {d.max_model_len}); "
                          "expected one (a request the decode pool refuses was prefilled for nothing)")


def run_fleet(cfg: SimConfig, plans: FleetPlans, trace, staging, t0: float) -> tuple:
    """Simulate `cfg`'s disaggregated fleet over `trace`; write into `staging` (a ResultDir) if given. The
    fields of sim.simulator.simulate.SimulationResult, in its order. `plans`: `checked_plans`."""
    out = staging.path if staging else None
    step_log = StepLog(out / "steps.parquet" if out else None)
    requests = trace_to_requests(trace)
    env = EngineClock()
    specs = [PoolSpec(role, role, plan.cfg.replicas, plan.scheduler, plan.cfg.router)
             for role, plan in zip(("prefill", "decode"), plans, strict=True)]
    by_role = dict(zip(("prefill", "decode"), plans, strict=True))
    fleet, proxy = build_disaggregated(
        env, *specs, handoff_of(cfg, plans), step_log, lambda spec, i, index: replica_parts(by_role[spec.role], index),
        ReplicaOptions(fast_forward=cfg.fast_forward, check_invariants=cfg.check_invariants))
    feed(fleet, requests, proxy)
    run = EngineRun(env, fleet.replicas, fleet.arrivals, None, None)
    stop = run.drive()
    step_log.close()
    if stop:
        requests = run.arrived(requests)
    req_df = fleet_request_table(requests, proxy)
    steps_df = step_log.to_pandas()
    summary = fleet_summary(cfg, plans, fleet, proxy, req_df, steps_df)
    summary["partial"] = stop is not None
    if stop:
        summary["partial_reason"] = stop[0]
        summary["num_trace_requests"] = len(trace)
    wall = time.perf_counter() - t0
    summary["wall_s"] = wall
    if staging:
        write_outputs(out, cfg, req_df, summary)
        staging.publish()
    if stop:
        raise stop[1]
    return summary, req_df, steps_df, staging.shown if staging else None, plans.decode.num_blocks, wall


def fleet_request_table(requests: list, proxy: DisaggregatedProxy) -> pd.DataFrame:
    """request_table's columns plus FLEET_REQUEST_COLUMNS."""
    df = request_table(requests)
    rows = {r.request_id: _split(r, proxy) for r in requests}
    split = pd.DataFrame([rows[i] for i in df["request_id"].tolist()], columns=list(FLEET_REQUEST_COLUMNS))
    return pd.concat([df.reset_index(drop=True), split], axis=1)


def _split(req, proxy: DisaggregatedProxy) -> tuple:
    nan = math.nan
    first = req.token_times[0] if req.token_times else nan
    leg = proxy.legs.get(req.request_id)
    if leg is None:                        # prefilled on the decode pool
        return (proxy.decode.name, False, -1, nan, nan, nan, 0.0, nan, 0, 0.0)
    route = req.route
    hop = route.hops[0] if route and route.hops else None
    xfer = route.transfers[0] if route and route.transfers else None
    leg_start = leg.first_scheduled_time if leg.first_scheduled_time is not None else nan
    leave = hop.leave_s if hop else nan
    start, end = (xfer.start_s, xfer.end_s) if xfer else (nan, nan)
    return (proxy.decode.name, True, leg.replica, leg_start - req.arrival_time, leave - leg_start, start - leave,
            end - start, first - end, xfer.num_tokens if xfer else 0, xfer.nbytes if xfer else 0.0)


def fleet_summary(cfg: SimConfig, plans: FleetPlans, fleet: Fleet, proxy: DisaggregatedProxy,
                  req_df: pd.DataFrame, steps: pd.DataFrame) -> dict:
    """run_summary of the whole fleet (its request figures; its step figures are the decode pool's),
    with `pools`: each pool's figures, and `handoff`: the links' and the TTFT split's."""
    decode_ids = [r.index for r in fleet.pools[1].replicas]
    decode_steps = steps[steps["replica"].isin(decode_ids)]
    summary = run_summary(plans.decode, req_df, decode_steps[list(SUMMARY_STEP_COLUMNS)],
                          [r.kv for r in fleet.pools[1].replicas])
    makespan = float(steps["time_s"].add(steps["duration_s"]).max()) if len(steps) else 0.0
    summary["pools"] = {pool.name: pool_figures(pool, plan, steps, makespan) for pool, plan in zip(fleet.pools, plans, strict=True)}
    summary["handoff"] = handoff_figures(cfg, proxy, req_df, makespan)
    summary.update(gpu=f"{plans.prefill.gpu.name}+{plans.decode.gpu.name}", tp=None,
                   replicas=sum(p.cfg.replicas for p in plans), fleet=" + ".join(
                       f"{p.cfg.replicas}x {p.gpu.name} TP{p.cfg.tp} {role}" for role, p in zip(("prefill", "decode"), plans, strict=True)))
    return summary


def pool_figures(pool, plan: ResolvedRun, steps: pd.DataFrame, makespan: float) -> dict:
    mine = steps[steps["replica"].isin([r.index for r in pool.replicas])]
    n = len(pool.replicas)
    busy = float(mine["duration_s"].sum())
    kv_use = mine["blocks_used"].to_numpy() / max(plan.num_blocks - 1, 1)
    return {"role": pool.spec.role, "gpu": plan.gpu.name, "tp": plan.cfg.tp, "replicas": n, "gpus": n * plan.cfg.tp,
            "num_gpu_blocks": plan.num_blocks, "max_num_seqs": plan.cfg.engine.max_num_seqs,
            "max_num_batched_tokens": plan.cfg.engine.max_num_batched_tokens, "steps": len(mine),
            "utilization": busy / (n * makespan) if makespan > 0 else 0.0,
            "mean_waiting": float(mine["num_waiting"].mean()) if len(mine) else 0.0,
            "max_waiting": int(mine["num_waiting"].max()) if len(mine) else 0,
            "mean_kv_use": float(kv_use.mean()) if len(mine) else 0.0,
            "max_kv_use": float(kv_use.max()) if len(mine) else 0.0,
            "prefill_tokens": int(mine["prefill_tokens"].sum()), "decode_tokens": int(mine["decode_tokens"].sum())}


def handoff_figures(cfg: SimConfig, proxy: DisaggregatedProxy, req_df: pd.DataFrame, makespan: float) -> dict:
    links = list(proxy.links.values())
    moved = [r for r in req_df.itertuples() if r.disaggregated and r.transfer_tokens > 0]
    spec = links[0].spec if links else None
    out = {"link": cfg.fleet.link, "link_bandwidth_gb_s": spec.bandwidth_gb_s if spec else None,
           "link_latency_s": spec.latency_s if spec else None, "links": len(links),
           "transfers": sum(link.num_transfers for link in links),
           "transfer_bytes": float(sum(link.bytes_moved for link in links)),
           "link_busy_s": float(sum(link.busy_s for link in links)),
           "link_utilization": (sum(link.busy_s for link in links) / (len(links) * makespan)
                                if links and makespan > 0 else 0.0),
           "local_prefills": int((~req_df["disaggregated"]).sum()) if len(req_df) else 0}
    if cfg.fleet.layerwise_overlap:          # only when on: summaries of plain pulls stay as they were
        out["layerwise_overlap"] = True
    for col in ("prefill_queue_s", "prefill_s", "kv_wait_s", "transfer_s", "first_decode_s"):
        vals = np.array([getattr(r, col) for r in moved], dtype=float)
        vals = vals[np.isfinite(vals)]
        out[f"mean_{col}"] = float(vals.mean()) if len(vals) else None
        out[f"p99_{col}"] = float(np.percentile(vals, 99)) if len(vals) else None
    return out
