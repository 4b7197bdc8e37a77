"""A resolved run (`ResolvedRun`): everything a simulation or a replay needs, resolved once from a validated SimConfig.

`resolve_run` is the one place a run is resolved: the engine defaults (sim/model/defaults.py), the model
and GPU specs, the cost model with its profile, the KV pool size, the scheduler's settings, the KV
policy (built once), the host-memory estimate, and which KV manager and executor each replica runs.
It is immutable; the simulator (`sim.simulator.simulate`) and the real backend (`gpu.replay`) build
their replicas from it (`build_kv_manager` here, each executor's own factory) and assemble the same
engine (`sim.engine.assembly.build_engine`).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal, NamedTuple

from .assembly import scheduler_config
from .routers import RouterError, build_router
from ..model.catalog import GPUSpec, ModelSpec, get_gpu, get_model
from ..config import ConfigError, RouterOptions, SimConfig
from ..core.scheduler import SchedulerConfig
from ..model.cost_model import CostModel, load_profile
from ..model.parallel import DPAttentionPricing, ParallelismError, PipelineCostModel
from ..model.defaults import resolve_engine
from ..kv.build import build_kv_manager as _build_manager, build_policy
from ..kv.policy import EvictionPolicy, FastModeProfile
from ..model.spec_decode import ResolvedSpec, SpecConfigError, resolve_spec
from ..model.memory import PoolSizing, RunMemoryEstimate, check_pool_fits_gpu, estimate_run_memory, num_gpu_blocks

KVKind = Literal["plain", "evicting", "hybrid"]  # vLLM's KVCacheManager | eviction-aware | sliding-window layers
ExecutorKind = Literal["cost_model", "kv_policy", "pipeline"]    # sim.simulator.executor's; the backend has its own


class Hardware(NamedTuple):
    """What a run's config resolves to on the hardware side."""
    model: ModelSpec
    gpu: GPUSpec
    cost: CostModel
    num_blocks: int            # vLLM's num_gpu_blocks (one of them the null block)
    max_model_len: int
    spec: ResolvedSpec | None = None    # speculative decoding (sim/model/spec_decode.py); None: off


@dataclass(frozen=True)
class ResolvedRun:
    cfg: SimConfig             # engine defaults resolved: what config.yaml records
    hardware: Hardware
    scheduler: SchedulerConfig
    policy: EvictionPolicy | None    # the configured policy, built once; None unless kv_kind is evicting
    kv_kind: KVKind
    executor_kind: ExecutorKind
    memory: RunMemoryEstimate  # host memory the run needs (checked by the driver: it knows what is available)

    @property
    def model(self) -> ModelSpec:
        return self.hardware.model

    @property
    def gpu(self) -> GPUSpec:
        return self.hardware.gpu

    @property
    def cost(self) -> CostModel:
        return self.hardware.cost

    @property
    def num_blocks(self) -> int:
        return self.hardware.num_blocks

    @property
    def max_model_len(self) -> int:
        return self.hardware.max_model_len

    @property
    def spec(self) -> ResolvedSpec | None:
        return self.hardware.spec


def resolve_run(cfg: SimConfig, *, trace=None, model: ModelSpec | None = None) -> ResolvedRun:
    """The plan of a run of `cfg` over `trace` (sized into the memory estimate when given). `model`
    replaces `cfg.model`'s catalog entry (the real backend passes the spec of the model it runs)."""
    cfg = cfg.model_copy(update={"engine": resolve_engine(cfg)})     # with_engine_defaults
    check_router(cfg.router, cfg.router_options)
    hardware = resolve_hardware(cfg, model)
    # a model with sliding-window layers runs the hybrid manager, which refuses policies when built
    kv_kind: KVKind = "hybrid" if hardware.model.num_sliding_layers else "plain" if cfg.kv.is_default else "evicting"
    policy = build_policy(cfg.kv) if kv_kind == "evicting" else None
    profile = (policy.fast_mode_profile() or FastModeProfile()) if policy is not None and cfg.kv.mode == "fast" else None
    return ResolvedRun(
        cfg=cfg, hardware=hardware, scheduler=scheduler_config(cfg, hardware.cost, hardware.max_model_len),
        policy=policy, kv_kind=kv_kind, executor_kind=executor_kind(kv_kind, cfg.pp),
        memory=estimate_run_memory(cfg, hardware.model, hardware.cost, hardware.num_blocks, trace, profile))


def executor_kind(kv_kind: KVKind, pp: int) -> ExecutorKind:
    """The simulator's executor of a run: the KV-policy one with an eviction-aware manager, the pipeline one for
    `pp` > 1 pipeline stages (in-flight batches: sim/simulator/executor.py PipelineExecutor), else the plain one."""
    if kv_kind == "evicting":
        return "kv_policy"
    return "pipeline" if pp > 1 else "cost_model"


def check_router(router: str, options: RouterOptions | None) -> None:
    """`router` names a registered router, and its `router_options` suit it (one line when not)."""
    try:
        build_router(router, [], options)
    except RouterError as exc:
        raise ConfigError(str(exc)) from None


def with_engine_defaults(cfg: SimConfig) -> SimConfig:
    """`cfg` with its engine defaults resolved (sim/model/defaults.py): what a run writes to config.yaml."""
    return cfg.model_copy(update={"engine": resolve_engine(cfg)})


def resolve_hardware(cfg: SimConfig, model: ModelSpec | None = None) -> Hardware:
    """Model spec, GPU spec, cost model, KV pool size and max_model_len of `cfg`, whose engine
    defaults are resolved (`with_engine_defaults`; a run's config.yaml has them)."""
    model = get_model(cfg.model) if model is None else model
    if cfg.kv_dtype or cfg.weight_dtype:
        model = model.with_dtypes(kv_dtype=cfg.kv_dtype, weight_dtype=cfg.weight_dtype)
    gpu = get_gpu(cfg.gpu)
    eng = cfg.engine
    try:
        cost = _cost_model(cfg, model, gpu)
    except ParallelismError as exc:
        raise ConfigError(str(exc)) from None
    except ValueError as exc:
        if "--enable-expert-parallel" not in str(exc):
            raise
        raise ConfigError(str(exc).replace("--enable-expert-parallel", "engine.enable_expert_parallel")) from None
    spec = None
    if cfg.speculative_config is not None:
        try:
            spec = resolve_spec(cfg.speculative_config, model, gpu, cfg.tp, cost)
        except SpecConfigError as exc:
            raise ConfigError(str(exc)) from None
    if eng.num_gpu_blocks is not None:
        blocks = eng.num_gpu_blocks
        check_pool_fits_gpu(model, gpu, tp=cfg.tp, num_blocks=blocks, block_size=eng.block_size)
    else:
        sizing = PoolSizing.of_engine(eng, tp=cfg.tp, pp=cfg.pp, dp=cfg.dp)
        if spec is not None:
            sizing = replace(sizing, drafter_weight_bytes=spec.weight_bytes,
                             drafter_kv_bytes_per_token=spec.kv_bytes_per_token)
        try:
            blocks = num_gpu_blocks(model, gpu, sizing).num_blocks
        except ParallelismError as exc:
            raise ConfigError(str(exc)) from None
    return Hardware(model, gpu, cost, blocks, eng.max_model_len or model.max_model_len, spec)


def _cost_model(cfg: SimConfig, model: ModelSpec, gpu: GPUSpec) -> CostModel:
    """The cost model of one engine: a TP replica, a TP x PP pipeline (sim/model/parallel.py), or one
    data-parallel attention rank (its own batch at TP; the engine prices the synchronised MoE part)."""
    eng = cfg.engine
    profile = load_profile(cfg.profile, gpu=gpu)
    if cfg.pp > 1:
        if cfg.dp > 1:
            raise ParallelismError("pp > 1 with dp > 1 (pipeline stages of data-parallel attention ranks) is not "
                                   "modelled; give one of them")
        if cfg.kv.layout == "per_head":
            raise ParallelismError("kv.layout per_head with pp > 1 is not modelled (a per-head block is one layer's)")
        return PipelineCostModel(model, gpu, profile, tp=cfg.tp, async_scheduling=bool(eng.async_scheduling),
                                 expert_parallel=eng.enable_expert_parallel, pp=cfg.pp,
                                 batch_tokens=eng.max_num_batched_tokens)
    if cfg.dp > 1:
        cost = CostModel(model, gpu, profile, tp=cfg.tp, async_scheduling=bool(eng.async_scheduling))
        DPAttentionPricing(cost, cfg.dp)        # refuses impossible layouts (fewer experts than GPUs)
        return cost
    return CostModel(model, gpu, profile, tp=cfg.tp, async_scheduling=bool(eng.async_scheduling),
                     expert_parallel=eng.enable_expert_parallel)


def build_kv_manager(plan: ResolvedRun, replica: int = 0):
    """The KV manager of one replica: the plain vLLM manager, or the eviction-aware one of `kv:`.
    Replica 0 runs the resolved run's policy; the others their own instance (a policy may keep per-run
    state, e.g. the recorded policy's counters)."""
    policy = plan.policy if replica == 0 or plan.policy is None else build_policy(plan.cfg.kv)
    return _build_manager(plan.cfg, plan.model, plan.cost, plan.num_blocks, policy=policy)


def check_config_memory(cfg: SimConfig, trace=None) -> RunMemoryEstimate:
    """Estimate and check the host memory of a simulation of `cfg` before running it: the bound
    `kvsim simulate` applies, for other front ends (the dashboard). Raises HostMemoryError (a
    ValueError) when it does not fit; returns the estimate."""
    from ..model.memory import check_memory
    estimate = resolve_run(cfg, trace=trace).memory
    check_memory(estimate)
    return estimate
