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
from ..cluster.pool_choice import make_pool_choice, pool_choice_names
from ..cluster.links import LinkSpec, get_link, handoff_link
from ..config import ConfigError, EngineConfig, PoolConfig, SimConfig
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


class PoolPlan(NamedTuple):
    role: str                   # prefill | decode
    name: str                   # the pool's name: its role, or ROLE-i when the role has several pools
    path: str                   # where the config gives it (fleet.prefill, fleet.prefill.1): errors name it
    plan: ResolvedRun


class FleetPlans(NamedTuple):
    """Every pool's run plan, resolved once, prefill pools first."""
    pools: list[PoolPlan]

    def of(self, role: str) -> list[PoolPlan]:
        return [p for p in self.pools if p.role == role]

    @property
    def prefill(self) -> ResolvedRun:
        """The first prefill pool's plan (the only one with one pool a role)."""
        return self.of("prefill")[0].plan

    @property
    def decode(self) -> ResolvedRun:
        return self.of("decode")[0].plan

    def __iter__(self):          # the plans, in pool order
        return iter([p.plan for p in self.pools])


def pool_config(cfg: SimConfig, pool: PoolConfig) -> SimConfig:
    """The run's config as one pool of its fleet sees it: the pool's GPU, TP, profile, replicas, router
    and engine settings over the run's."""
    engine = EngineConfig.model_validate({**cfg.engine.model_dump(exclude_unset=True), **pool.engine})
    return cfg.model_copy(update={"gpu": pool.gpu or cfg.gpu, "tp": pool.tp or cfg.tp, "profile": pool.profile or cfg.profile,
                                  "replicas": pool.replicas, "router": pool.router or cfg.router, "engine": engine,
                                  "fleet": None})


def fleet_plans(cfg: SimConfig, trace) -> FleetPlans:
    """Each pool's run plan, resolved once; a pool that cannot run (its TP does not fit the model or the
    GPU's memory) is refused naming it."""
    refuse_unsupported(cfg)
    if cfg.fleet.pool_choice not in pool_choice_names():
        raise ConfigError(f"fleet.pool_choice: unknown pool choice {cfg.fleet.pool_choice!r}; known: "
                          f"{', '.join(pool_choice_names())}")
    plans = []
    for role, name, pool in cfg.fleet.all_pools():
        given = getattr(cfg.fleet, role)
        path = f"fleet.{role}" if isinstance(given, PoolConfig) else f"fleet.{role}.{name.rsplit('-', 1)[1]}"
        try:
            plan = resolve_run(pool_config(cfg, pool), trace=trace)
        except (ConfigError, ValueError) as exc:
            raise ConfigError(f"{path}: {exc}") from None
        plans.append(PoolPlan(role, name, path, plan))
    return FleetPlans(plans)


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
    its TP replicates is pulled by each GPU that holds it). With several pools of a role, per pool pair:
    the pair's link type (`fleet.pair_links`, default `fleet.link`) with min(TP prefill, TP decode) lanes,
    and each decode pool's bytes a token."""
    fleet = cfg.fleet
    one = get_link(fleet.link, bandwidth_gb_s=fleet.link_bandwidth_gb_s, latency_s=fleet.link_latency_s)
    link: LinkSpec = handoff_link(one, plans.prefill.cfg.tp, plans.decode.cfg.tp)
    per_token = {d.name: d.plan.cost.kv_bytes_per_token_per_gpu * d.plan.cfg.tp for d in plans.of("decode")}
    pairs = None
    if len(plans.pools) > 2 or fleet.pair_links:
        pairs = {}
        for p in plans.of("prefill"):
            for d in plans.of("decode"):
                kind = fleet.pair_links.get(f"{p.name}>{d.name}", fleet.link)
                base = one if kind == fleet.link else get_link(kind)
                lanes = handoff_link(base, p.plan.cfg.tp, d.plan.cfg.tp)
                pairs[(p.name, d.name)] = LinkSpec(base.name, lanes.bandwidth_gb_s, lanes.latency_s)
    return Handoff(link, per_token[plans.of("decode")[0].name],
                   abort_timeout_s=fleet.abort_timeout_s, local_prefill_tokens=fleet.local_prefill_tokens,
                   layerwise_layers=plans.decode.model.num_layers if fleet.layerwise_overlap else 0,
                   pairs=pairs, pool_kv_bytes=per_token if pairs is not None else None)


def pool_speeds(plans: FleetPlans) -> dict[str, float]:
    """Each pool's tokens a second, for the proxy's least_work choice (sim/cluster/pool_choice.py): a prefill
    pool's replicas x one replica's prompt tokens a second in a prefill step of its full token budget; a decode
    pool's replicas x one replica's output tokens a second in a decode step of min(max_num_seqs, 64) sequences
    of 1,024 tokens of context (a reference point: the choice compares pools, it does not predict a run)."""
    from ..core.step import BatchShape

    speeds = {}
    for p in plans.pools:
        cost, sched, block = p.plan.cost, p.plan.scheduler, p.plan.cfg.engine.block_size
        if p.role == "prefill":
            tokens = int(sched.max_num_batched_tokens)
            rate = tokens / float(cost.predict(BatchShape(num_seqs=1, num_prefill_tokens=tokens)))
        else:
            b, ctx = min(int(sched.max_num_seqs), 64), 1024
            shape = np.array([b], dtype=float)
            rate = b / float(np.asarray(cost.predict_decode(shape, shape * ctx, shape * math.ceil(ctx / block)))[0])
        speeds[p.name] = rate * p.plan.cfg.replicas
    return speeds


def checked_plans(cfg: SimConfig, trace) -> FleetPlans:
    """The pools' plans, refused (ConfigError) where a pool cannot run or the pools disagree, and their
    host memory checked: before anything is written."""
    plans = fleet_plans(cfg, trace)
    check_pools_agree(plans)
    for plan in plans:
        check_memory(plan.memory)
    return plans


def check_pools_agree(plans: FleetPlans) -> None:
    first = plans.pools[0]
    for other in plans.pools[1:]:
        p, d = first.plan, other.plan
        between = "the pools" if len(plans.pools) == 2 else f"{first.path} and {other.path}"
        if p.cfg.engine.block_size != d.cfg.engine.block_size:
            raise ConfigError(f"fleet: engine.block_size differs between {between} ({p.cfg.engine.block_size} and "
                              f"{d.cfg.engine.block_size}); NIXL moves whole blocks: expected one block size")
        if p.max_model_len != d.max_model_len:
            raise ConfigError(f"fleet: max_model_len differs between {between} ({p.max_model_len} and "
                              f"{d.max_model_len}); expected one (a request the decode pool refuses was prefilled "
                              "for nothing)")


def run_fleet(cfg: SimConfig, plans: FleetPlans, trace, staging, t0: float) -> tuple:
    """Simulate `cfg`'s disaggregated fleet over `trace`; write into `staging` (a ResultDir) if given. The
    fields of sim.simulator.simulate.SimulationResult, in its order. `plans`: `checked_plans`."""
    out = staging.path if staging else None
    step_log = StepLog(out / "steps.parquet" if out else None)
    requests = trace_to_requests(trace)
    env = EngineClock()
    specs = {p.role: [] for p in plans.pools}
    for p in plans.pools:
        specs[p.role].append(PoolSpec(p.name, p.role, p.plan.cfg.replicas, p.plan.scheduler, p.plan.cfg.router))
    by_name = {p.name: p.plan for p in plans.pools}
    several = len(plans.pools) > 2
    fleet, proxy = build_disaggregated(
        env, specs["prefill"] if several else specs["prefill"][0], specs["decode"] if several else specs["decode"][0],
        handoff_of(cfg, plans), step_log, lambda spec, i, index: replica_parts(by_name[spec.name], index),
        ReplicaOptions(fast_forward=cfg.fast_forward, check_invariants=cfg.check_invariants),
        make_pool_choice(cfg.fleet.pool_choice, pool_speeds(plans)) if several else None)
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
    pool = proxy.decode_pool_of(req.replica)
    if leg is None:                        # prefilled on the decode pool
        return (pool, False, -1, nan, nan, nan, 0.0, nan, 0, 0.0)
    route = req.route
    hop = route.hops[0] if route and route.hops else None
    xfer = route.transfers[0] if route and route.transfers else None
    leg_start = leg.first_scheduled_time if leg.first_scheduled_time is not None else nan
    leave = hop.leave_s if hop else nan
    start, end = (xfer.start_s, xfer.end_s) if xfer else (nan, nan)
    return (pool, True, leg.replica, leg_start - req.arrival_time, leave - leg_start, start - leave,
            end - start, first - end, xfer.num_tokens if xfer else 0, xfer.nbytes if xfer else 0.0)


def fleet_summary(cfg: SimConfig, plans: FleetPlans, fleet: Fleet, proxy: DisaggregatedProxy,
                  req_df: pd.DataFrame, steps: pd.DataFrame) -> dict:
    """run_summary of the whole fleet (its request figures; its step figures are the decode pools', its
    hardware figures the first decode pool's), with `pools`: each pool's figures, and `handoff`: the links'
    and the TTFT split's."""
    decode_pools = [p for p in fleet.pools if p.spec.role == "decode"]
    decode_ids = [r.index for p in decode_pools for r in p.replicas]
    decode_steps = steps[steps["replica"].isin(decode_ids)]
    summary = run_summary(plans.decode, req_df, decode_steps[list(SUMMARY_STEP_COLUMNS)],
                          [r.kv for p in decode_pools for r in p.replicas])
    makespan = float(steps["time_s"].add(steps["duration_s"]).max()) if len(steps) else 0.0
    summary["pools"] = {pool.name: pool_figures(pool, p.plan, steps, makespan)
                        for pool, p in zip(fleet.pools, plans.pools, strict=True)}
    summary["handoff"] = handoff_figures(cfg, proxy, req_df, makespan)
    if len(plans.pools) > 2 or cfg.fleet.pair_links:
        summary["handoff"]["pairs"] = pair_figures(handoff_of(cfg, plans), proxy, req_df)
        summary["handoff"]["pool_choice"] = cfg.fleet.pool_choice
    summary.update(gpu="+".join(p.plan.gpu.name for p in plans.pools), tp=None,
                   replicas=sum(p.plan.cfg.replicas for p in plans.pools), fleet=" + ".join(
                       f"{p.plan.cfg.replicas}x {p.plan.gpu.name} TP{p.plan.cfg.tp} {p.name}" for p in plans.pools))
    return summary


def pair_figures(handoff: Handoff, proxy: DisaggregatedProxy, req_df: pd.DataFrame) -> dict:
    """Per pool pair 'PREFILL>DECODE': its link (type, GB/s with the pair's lanes, latency) and the
    transfers, bytes and time of the pulls that crossed it."""
    moved = req_df[req_df["disaggregated"] & (req_df["transfer_tokens"] > 0)]
    source = moved["prefill_replica"].map(lambda r: proxy.pool_name(int(r), ""))
    out = {}
    for (p, d), spec in (handoff.pairs or {}).items():
        mine = moved[(source == p) & (moved["pool"] == d)]
        out[f"{p}>{d}"] = {"link": spec.name, "link_bandwidth_gb_s": spec.bandwidth_gb_s, "link_latency_s": spec.latency_s,
                           "transfers": int(len(mine)), "transfer_bytes": float(mine["transfer_bytes"].sum()),
                           "transfer_s": float(mine["transfer_s"].sum()),
                           "mean_transfer_s": float(mine["transfer_s"].mean()) if len(mine) else None}
    return out


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
    # with several pools of a role each pair has its own bandwidth: `pairs` gives them (fleet_summary)
    paired = any(isinstance(key, tuple) for key in proxy.links)
    spec = links[0].spec if links and not paired else None
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
