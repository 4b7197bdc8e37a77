"""Build a replica's KV manager from a run's config (shared by the simulator and the real backend)."""
from __future__ import annotations

import warnings

from ..config import ConfigError, KVConfig, SimConfig
from ..core.kv_manager import KVCacheManager
from ..core.protocols import KVManager
from ..core.sliding_window import HybridKVManager
from .base import EvictingManagerBase, FastOptions
from .importance import ImportanceError, ImportanceModelSpec, SyntheticImportance
from .manager import EvictingKVManager, EvictingOptions
from .slots import COPY_STRATEGIES
from .policy import EvictionPolicy, PolicyContext, PolicyError, get_policy
from .state import PRECISION_FULL
from .precision import PRECISION_FORMATS


def precision_layout(model, block_size: int, high: str, low: str) -> tuple[tuple[float, float, float], tuple[int, int, int]]:
    """(bytes per token of each precision group / full-precision bytes, tokens per page of each precision group) for pages of
    the byte size of one full-precision block of one (layer, KV head) — LeanKV's fixed-size pages."""
    full_bytes = model.kv_bytes_per_token() / (model.num_layers * model.num_kv_heads)
    page_bytes = block_size * full_bytes
    ratios, caps = [1.0], [block_size]
    for name, what in ((high, "kv.high_tier"), (low, "kv.low_tier")):
        if name not in PRECISION_FORMATS:
            raise ConfigError(f"{what}: unknown precision format {name!r}; known: {sorted(PRECISION_FORMATS)}")
        b = PRECISION_FORMATS[name].bytes_per_token(model.head_dim)
        ratios.append(b / full_bytes)
        caps.append(int(page_bytes // b))
    return tuple(ratios), tuple(caps)


def stored_token_bytes_ratio(kv: KVConfig, model, policy: EvictionPolicy | None) -> float:
    """Bytes of a KV token as the run's KV manager writes it into its pages, over the cache dtype's bytes
    (`model`: the cost model's, with the run's KV dtype): 1 for the plain cache and for policies that write
    tokens at full precision (eviction policies drop tokens later, a written block is whole); a
    mixed-precision policy (LeanKV) writes new tokens at its high precision group (`kv.high_tier`, e.g.
    K8V4: 8-bit keys, 4-bit values and their scales). What a block copied off the GPU (the CPU tier's
    stores and loads) weighs: docs/kv-tiers.md#compressed-and-quantized-blocks."""
    if policy is None or policy.new_token_precision == PRECISION_FULL:
        return 1.0
    ratios, _ = precision_layout(model, 1, kv.high_tier, kv.low_tier)
    return ratios[policy.new_token_precision]


def build_kv_manager(cfg: SimConfig, model, cost, num_blocks: int, policy=None) -> KVManager:
    """The KV manager of one replica: the plain vLLM manager unless `kv:` asks for more. `num_blocks`
    is vLLM's num_gpu_blocks (one of them the null block); `policy`: the built `kv.policy`, if it is."""
    eng = cfg.engine
    if model.num_sliding_layers:
        return sliding_window_manager(cfg, model, num_blocks)
    if cfg.kv.is_default:
        refuse_ignored_kv_options(cfg.kv, get_policy("none") if policy is None else policy)
        return KVCacheManager(num_blocks, eng.block_size, enable_caching=bool(eng.enable_prefix_caching))
    if eng.enable_prefix_caching:
        raise ConfigError("engine.enable_prefix_caching: not supported with kv.policy/kv.layout other than "
                          "none/shared (evicted tokens break shared prefix blocks)")
    # like vLLM's pool, one block of the memory is the null block
    return build_evicting_manager(cfg.kv, model, cost, num_blocks - 1, eng.block_size, cfg.seed, policy)


def sliding_window_manager(cfg: SimConfig, model, num_blocks: int) -> HybridKVManager:
    """The hybrid manager of a model with sliding-window layers (`num_blocks` of its group-sized
    blocks); the combinations it does not model are refused in one line."""
    if not cfg.kv.is_default:
        raise ConfigError(f"kv.policy/kv.layout: {model.name} has sliding-window layers; KV eviction and compression "
                          "policies are not modelled with them (use kv.policy none, kv.layout shared)")
    if cfg.engine.preemption_mode == "swap":
        raise ConfigError(f"engine.preemption_mode: swap is not modelled for {model.name}'s sliding-window layers; "
                          "use recompute")
    if cfg.engine.enable_prefix_caching:
        warnings.warn(f"{model.name} has sliding-window layers: prefix caching is not modelled for them (no "
                      "prefix hits in this run)", UserWarning, stacklevel=3)
    _, full_groups, sliding_groups = model.kv_cache_groups()
    return HybridKVManager(num_blocks, cfg.engine.block_size, window=model.sliding_window, full_groups=full_groups,
                           sliding_groups=sliding_groups,
                           sliding_layer_fraction=model.num_sliding_layers / model.num_layers)


def build_evicting_manager(kv, model, cost, num_blocks: int, block_size: int, seed: int,
                           policy=None) -> EvictingManagerBase:
    """The eviction-aware manager of a `KVConfig` (token-level, or fast mode). `num_blocks` is the
    shared-layout pool size; per_head pools hold the same bytes as num_blocks x layers x (KV heads per
    GPU) one-head blocks."""
    kv_heads = cost.kv_heads_per_gpu
    rows = model.num_layers * kv_heads if kv.layout == "per_head" else 1
    precision_bytes, precision_caps = precision_layout(model, block_size, kv.high_tier, kv.low_tier)
    ctx = PolicyContext(kv.layout, model.num_layers, kv_heads, max(1, model.num_heads * kv_heads // model.num_kv_heads),
                        block_size, rows, precision_bytes=precision_bytes, head_dim=model.head_dim,
                        bytes_per_token_row=cost.kv_bytes_per_token / rows, kv_split=cost.kv_split)
    policy = policy if policy is not None else build_policy(kv)
    refuse_ignored_kv_options(kv, policy)
    if policy.per_head_only and kv.layout != "per_head":
        raise ConfigError(f"kv.layout: policy {kv.policy!r} sets different budgets per layer and head; it needs "
                          f"kv.layout=per_head, got {kv.layout!r}")
    pool_blocks = num_blocks * rows
    bytes_per_row = cost.kv_bytes_per_token / rows
    if kv.copy_threshold and kv.slot_strategy not in COPY_STRATEGIES:
        raise ConfigError(f"kv.copy_threshold applies to the copy strategies ({', '.join(sorted(COPY_STRATEGIES))}); "
                          f"kv.slot_strategy is {kv.slot_strategy!r}")
    token = EvictingOptions(slot_strategy=kv.slot_strategy, trigger=kv.trigger, trigger_interval=kv.trigger_interval,
                            trigger_threshold=kv.trigger_threshold, bytes_per_token_row=bytes_per_row,
                            precision_capacity=precision_caps, new_token_precision=policy.new_token_precision,
                            copy_threshold=kv.copy_threshold)
    fast = FastOptions(slot_strategy=kv.slot_strategy, bytes_per_token_row=bytes_per_row, seed=seed,
                       copy_threshold=kv.copy_threshold,
                       sample_rows=kv.fast_rows, importance=kv.importance)
    try:
        if kv.mode == "fast" and kv.layout == "shared" and policy.needs_scores:
            _check_fast_age_profile(kv.importance)
        if kv.mode == "fast" and (profile := policy.fast_mode_profile()) is not None and profile.sampled_rows:
            from .fast.sampled.leankv import BatchedLeanKVManager, batched_leankv_supported
            from .fast.sampled.rows import SampledRowsKVManager
            cls = BatchedLeanKVManager if batched_leankv_supported(policy, kv.slot_strategy, kv.trigger) \
                else SampledRowsKVManager
            return cls(pool_blocks, block_size, ctx, policy, fast, token)
        if kv.mode == "fast":
            _check_fast_trigger(kv, policy)
            from .fast import FastKVManager     # here: it loads numba (its kernels), which token mode never needs
            return FastKVManager(pool_blocks, block_size, ctx, policy, fast)
        importance = SyntheticImportance(ctx, kv.importance, seed) if (policy.needs_scores or policy.evicts) else None
    except ImportanceError as exc:
        raise ConfigError(f"kv.importance: {exc}") from None
    return EvictingKVManager(pool_blocks, block_size, ctx, policy, importance, token)


def build_policy(kv: KVConfig) -> EvictionPolicy:
    """The `kv.policy` of a `KVConfig` with its parameters (a bad one is a ConfigError)."""
    try:
        return get_policy(kv.policy, **kv.policy_params())
    except PolicyError as exc:
        raise ConfigError(str(exc)) from None


def refuse_ignored_kv_options(kv: KVConfig, policy: EvictionPolicy) -> None:
    """KV options that `policy` in this mode never reads: accepted, they would change nothing, so each is
    refused naming what would read it (simulate and replay check them before the run; every front end
    when the manager is built). A value equal to the default is no request (config.yaml lists them all)."""
    def given(name: str):
        value = getattr(kv, name)
        return None if value == KVConfig.model_fields[name].default else value

    trigger = policy.default_trigger if kv.trigger == "policy" else kv.trigger
    for name, reader in (("trigger_interval", "every_n"), ("trigger_threshold", "threshold")):
        if given(name) is not None and trigger != reader:
            whose = f" (policy {kv.policy}'s default)" if kv.trigger == "policy" else ""
            raise ConfigError(f"kv.{name}={given(name)}: only kv.trigger={reader} reads it, and this run's trigger "
                              f"is {trigger}{whose}; set kv.trigger={reader} or drop kv.{name}")
    for name in ("high_tier", "low_tier"):
        if given(name) is not None and policy.new_token_precision == PRECISION_FULL:
            raise ConfigError(f"kv.{name}={given(name)}: policy {kv.policy!r} keeps every token at full precision; "
                              f"the precision groups apply to a mixed-precision policy (leankv); drop kv.{name}")
    if given("fast_rows") is not None and kv.mode != "fast":
        raise ConfigError(f"kv.fast_rows={given('fast_rows')}: only kv.mode=fast samples rows, and this run is "
                          f"kv.mode={kv.mode} (every row simulated); drop kv.fast_rows or set kv.mode=fast")
    if given("slot_strategy") is not None and not policy.evicts:
        raise ConfigError(f"--slot-strategy {kv.slot_strategy} (kv.slot_strategy): policy {kv.policy!r} evicts "
                          "nothing (the whole cache stays resident), so no slot strategy applies; drop it")


def _check_fast_trigger(kv, policy) -> None:
    """Fast mode evicts where the policy's `fast_mode_profile` says, on the policy's own trigger; another one
    would be ignored."""
    if kv.trigger not in ("policy", policy.default_trigger):
        raise ConfigError(f"kv.trigger={kv.trigger}: fast mode runs policy {kv.policy!r} on its own trigger "
                          f"({policy.default_trigger}); use kv.mode=token for another trigger")


def _check_fast_age_profile(importance: str) -> None:
    """Fast mode scores H2O in closed form (one exponential age term); an age profile's power law needs token mode."""
    spec = ImportanceModelSpec.load(importance)
    if spec.age_profile is not None:
        raise ConfigError(f"kv.importance: {spec.name!r} has an age_profile (the shared layout's head-averaged row, a "
                          f"power law in token age) that fast mode's closed-form scoring cannot represent; use "
                          f"kv.mode=token, or kv.layout=per_head (whose rows it does not change)")
