"""Eviction / compression / selection policies: the plug-in interface and registry.

A policy decides *which tokens go* (or which precision group they keep, or which ones a decode step
reads). It never allocates memory or moves data: the KV manager (`sim.kv.manager`) owns blocks and
slots and applies the policy's decisions through its slot strategy. The same policy objects run in
the simulator (scores from `sim.kv.importance`) and in the real backend (scores from the attention
kernels), so a policy sees only numpy arrays.

State a policy sees — `TokenState` (`sim.kv.state`), one per request
-----------------------------------------------------------------------
All arrays are `[rows, num_slots]`, vectorized over rows (never loop over heads in Python):

- rows: `ctx.rows` = layers * kv_heads in the `per_head` layout (row = layer * kv_heads + head,
  `ctx.row_layer[row]` / `ctx.row_head[row]` give them); 1 in the `shared` layout (scores are then
  averaged over all layers and heads and a decision applies to every head at once).
- columns are SLOTS, not positions. `state.pos[r, s]` is the position of the token in slot s
  (-1 = empty slot), `state.live[r, s]` whether it is resident and attended to. Slots of evicted
  tokens have `live == False` but may keep `pos` until the slot is reused or freed. Slot order is
  arbitrary (tokens move under compaction / slot reuse): select by `pos`, `live`, `score`, never
  by column index.
- `state.num_tokens` = T, positions 0..T-1 exist (the newest token has pos T-1).
- `state.score` float32: attention each token received, summed over every query observed so far
  (the manager adds the prefill observation window and each decode step's scores before calling
  `compress`; override `observe` to change that, e.g. squared attention or a decayed sum).
- `state.precision group` int8: PRECISION_FULL=0 (cache dtype), PRECISION_HIGH=1, PRECISION_LOW=2 (LeanKV).
- policy-specific per-slot arrays: `state.add_field(name, dtype, fill)` once (e.g. in `on_admit`),
  then `state.field(name)`; they move with their tokens. The request: `state.request_id` and
  `state.prompt_tokens` (set at admission); per-request values a policy keeps live in the policy,
  keyed by `state.request_id` (as `recorded` keeps its pressure-call counts).

Scores (`scores` arguments)
---------------------------
Attention probabilities as float32 `[rows, num_slots]` (0 at non-live slots), already aggregated
over the query heads of each GQA group onto their KV head by `ctx.gqa_reduce(...)` with the
policy's `gqa_reduce` ("sum" | "max" | "mean"), and, in the shared layout, averaged over rows.
- prefill observation: `[window, rows, num_slots]`, the attention of the last `obs_window` prompt
  queries (one slice per query, oldest first) over the prompt.
- decode: `[rows, num_slots]`, the attention of this step's single query over the live tokens
  (each row sums to 1 over live slots).
The importance source (`sim.kv.importance`: synthetic model, recorded Parquet, or real attention)
supplies them; a policy with `needs_scores = False` gets `None`.

Calls a policy receives (all optional to override; defaults do nothing / keep everything)
-------------------------------------------------------------------------------------------
- `on_admit(state, ctx)`: once per (re)admission, before any token is written.
- `observe(state, ctx, scores, phase)`: every step the request computes; phase "prefill" (once,
  after the last prompt token, scores [window, rows, S]) or "decode" (scores [rows, S]). Default:
  accumulate into `state.score`.
- `compress(state, ctx, reason, scores) -> Decision | None`: when the manager's trigger fires.
  reason: "prefill" (right after prefill), "decode" (a decode step; trigger `every_step` /
  `every_n` / `threshold`). Returning None = no change.
- `reclaim(state, ctx, num_tokens) -> Decision | None`: memory pressure (the scheduler would
  otherwise preempt): evict about `num_tokens` token-rows (sum over rows) from this request.
  Default: None (the policy cannot help; the scheduler preempts).
- `read_tokens(state, ctx) -> np.ndarray | None`: selection policies (quest): tokens attention
  reads this step per row (int [rows]); None = all live tokens. Reads only; memory is unchanged.
- `prefill_pairs(start, num_new, ctx) -> float | None`: selection policies: the query-key pairs
  (token-pair equivalents, mean over rows) of a prefill chunk of `num_new` tokens at positions
  start.. (the step cost's `attn_pairs_prefill`); None = the engine's count, `num_new x (KV read
  before + (num_new + 1) / 2)`.
- `prefill_cost(start, num_new, ctx) -> SelectionStepCost | None` and `decode_op_bytes(context, ctx)`:
  a selection policy that prices its selection kernels itself (TokenSelect,
  sim/kv/policies/selection_work.py): a prefill chunk's pairs, KV reads and op bytes, and a decoding
  request's op bytes; None = `prefill_pairs` and the engine's reads.

Decision
--------
`Decision(evict=bool [rows, S] | None, precision group=int8 [rows, S] | None)`. `evict` marks live slots
to drop (the manager ignores non-live ones). `precision group` gives the new precision group of each live slot (the
manager moves tokens whose precision group changes into pages of that precision group; -1 or the current value = no
change). Masks are over the state's current slots (shape must match `state.live`).

The default trigger of a policy is its `default_trigger` ("never", "every_step",
"after_prefill", "after_prefill+pressure"); `kv.trigger` in the config overrides it.

Writing a policy
----------------
    from kvsim.sim.kv.policy import EvictionPolicy, Decision, register_policy

    @register_policy("mypolicy")
    class MyPolicy(EvictionPolicy):
        default_trigger = "every_step"
        def __init__(self, budget: int = 256, window: int = 32): ...   # params from kv.params
        def compress(self, state, ctx, reason, scores):
            over = state.live_counts() - self.budget          # [rows]
            ...
            return Decision(evict=mask)

Where kvsim finds it: a module imported before the run (the Python API), a module named in
$KVSIM_PLUGINS (comma-separated; the CLI, the dashboard and sweep workers import them), or an
installed package's entry point in the group `kvsim.policies`
(`[project.entry-points."kvsim.policies"] mypolicy = "mypkg.mypolicy"`). The config then accepts its
name like a built-in one.

Unknown parameters raise `PolicyError` naming the policy and its accepted parameters. The constructor's
signature declares the parameters (`policy_parameter_specs` lists them with their defaults); an optional
`parameter_help = {"window": "..."}` gives each a line of help (the dashboard shows it), and a parameter
named `path` or ending in `_path`, `_file` or `_dir` names a file (the dashboard confines it to its data
directory). Helpers:
`lowest_k_mask(values, k, candidates)` selects, per row, the k candidates with the smallest value
(vectorized; ties broken deterministically).
`fast_mode_profile` (optional) tells the block-occupancy fast mode where evictions fall (see
`sim.kv.fast`).
"""
from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import import_module
from typing import Any, NamedTuple

import numpy as np
from pathlib import Path

from .names import PLUGIN_ENV, PLUGIN_GROUP, plugin_entry_points
from .state import PRECISION_FULL, PRECISION_HIGH, PRECISION_LOW, TokenState  # noqa: F401 (re-exported)


class PolicyError(ValueError):
    """Unknown policy or invalid policy parameter; the message names it."""


@dataclass(frozen=True)
class FastModeProfile:
    """How the block-occupancy fast mode (sim.kv.fast) models a policy: what each row keeps and
    where evictions fall. Returned by `EvictionPolicy.fast_mode_profile()`; every field has the
    default of a policy that does not use it."""
    budget: int | None = None          # tokens kept per row after prefill and per decode step (None: no cap)
    protect_recent: int = 0            # newest tokens never evicted (the window)
    protect_first: int = 0             # oldest tokens never evicted (sinks)
    # which tokens go among the rest: "uniform", "oldest" (the one leaving the window) or "young"
    # (the lowest accumulated attention under the importance model, H2O)
    age_weight: str = "uniform"
    per_step: int = 1                  # evictions per row per decode step once at budget
    obs_window: int = 8                # prefill queries whose attention scores the prompt cut
    prompt_cut: bool = True            # False: no cut after prefill, decode evicts one a step (h2o evict_per_step)
    prompt_only: bool = False          # the prompt cut keeps the budget, decode never evicts (SnapKV)
    # per-row cut budgets: (prompt tokens, PolicyContext) -> int [rows] (None: `budget` for every row)
    cut_budgets: Callable | None = None
    cut_sharing: str | None = None     # budgets shared among rows at the cut: "layer" (Ada-KV) | "blocks" (KV-Compress)
    floor: float = 0.0                 # "layer" sharing: the share of a row's budget it keeps for itself
    reclaim_target: Callable | None = None   # under memory pressure evict whole blocks down to target(tokens) per row
    recut: str | None = None           # decode re-runs the cut: "every_n" | "over_budget" (SnapKV decode compression)
    recut_interval: int = 1            # "every_n": decode steps between re-cuts
    sampled_rows: bool = False         # the token-level manager on sampled rows instead (LeanKV, sim/kv/fast/sampled/rows.py)



@dataclass
class PolicyContext:
    """What a policy may know about the engine (immutable for a run)."""
    layout: str                  # "shared" | "per_head"
    num_layers: int
    num_kv_heads: int
    num_query_heads: int
    block_size: int              # tokens per block (full-precision pages)
    rows: int                    # rows of TokenState: layers * kv_heads (per_head) or 1 (shared)
    row_layer: np.ndarray = field(default=None)   # int [rows]
    row_head: np.ndarray = field(default=None)    # int [rows]
    precision_bytes: tuple[float, float, float] = (1.0, 0.5, 0.25)   # bytes/token of each precision group / full
    head_dim: int = 64
    bytes_per_token_row: float = 0.0   # bytes of one full-precision token of one row (K and V)
    kv_split: float = 1.0        # KV heads held per GPU / the model's KV heads (the cost model's share of op_bytes)

    def __post_init__(self):
        if self.row_layer is None:
            r = np.arange(self.rows)
            if self.layout == "per_head":
                self.row_layer, self.row_head = r // self.num_kv_heads, r % self.num_kv_heads
            else:
                self.row_layer, self.row_head = np.zeros(self.rows, int), np.zeros(self.rows, int)

    @property
    def heads_per_row(self) -> int:
        """(layer, KV head) pairs one row stands for: 1 per_head, layers x KV heads shared."""
        return 1 if self.layout == "per_head" else self.num_layers * self.num_kv_heads

    @property
    def group_size(self) -> int:
        return self.num_query_heads // self.num_kv_heads

    def gqa_reduce(self, per_query_head: np.ndarray, how: str = "sum") -> np.ndarray:
        """[..., layers * num_query_heads, S] -> [..., rows, S]: query heads of a group onto their KV head
        (query head q belongs to KV head q // group_size); shared layout: then the mean over rows."""
        shape = per_query_head.shape
        x = per_query_head.reshape(shape[:-2] + (self.num_layers * self.num_kv_heads, self.group_size, shape[-1]))
        x = {"sum": np.sum, "max": np.max, "mean": np.mean}[how](x, axis=-2)
        if self.layout == "shared":
            x = x.mean(axis=-2, keepdims=True)
        return x.astype(np.float32, copy=False)


@dataclass(frozen=True)
class SelectionStepCost:
    """What a selection policy's prefill chunk asks of the step (`prefill_cost`), mean over rows: the
    step cost's `attn_pairs_prefill`, its `kv_tokens_read` (fp16 token-equivalents of all layers) and
    `op_bytes` (the policy's own kernels, bytes of all KV heads: the cost model prices the GPU's
    `kv_split` share)."""
    pairs: float
    kv_read: float
    op_bytes: float
    kernels: float = 0.0         # small kernels the policy launches on each GPU (all layers), at gemm_latency_s each


@dataclass
class Decision:
    evict: np.ndarray | None = None     # bool [rows, S]: live slots to evict
    precision: np.ndarray | None = None      # int8 [rows, S]: new precision group per live slot (-1 = unchanged)


class EvictionPolicy:
    name = "base"
    needs_scores = True           # False: the importance source is not queried (cheaper)
    evicts = True                 # False: memory is never reduced (none, quest)
    gqa_reduce = "sum"
    obs_window = 8                # prefill observation queries wanted
    default_trigger = "every_step"
    per_head_only = False         # True: budgets differ per layer and head, so it needs kv.layout=per_head
    new_token_precision = PRECISION_FULL    # precision group the manager writes new tokens at (LeanKV: PRECISION_HIGH)
    # Optional hooks of selection policies (Quest), None when the policy does not select:
    # select_layer(state, ctx, layer, bound) -> the slots one layer's attention reads (the real backend);
    # mean_read(live, ctx) -> mean tokens read per row given live counts (fast mode).
    select_layer = None
    mean_read = None
    # one line of help per constructor parameter (kv.params.NAME): shown by the dashboard's form
    parameter_help: dict[str, str] = {}

    def on_admit(self, state: TokenState, ctx: PolicyContext) -> None:
        pass

    def observe(self, state: TokenState, ctx: PolicyContext, scores, phase: str) -> None:
        if scores is None:
            return
        if phase == "prefill":
            state.score += scores.sum(axis=0)
            state.num_steps_observed += scores.shape[0]
        else:
            state.score += scores
            state.num_steps_observed += 1

    def compress(self, state: TokenState, ctx: PolicyContext, reason: str, scores) -> Decision | None:
        return None

    def reclaim(self, state: TokenState, ctx: PolicyContext, num_tokens: int) -> Decision | None:
        return None

    def read_tokens(self, state: TokenState, ctx: PolicyContext) -> np.ndarray | None:
        return None

    def prefill_pairs(self, start: int, num_new: int, ctx: PolicyContext) -> float | None:
        return None

    def prefill_cost(self, start: int, num_new: int, ctx: PolicyContext) -> SelectionStepCost | None:
        """A selection policy that prices its own prefill (TokenSelect): the pairs, reads and op bytes of
        a prefill chunk of `num_new` tokens at positions start..; None = `prefill_pairs` and the engine's
        reads. A policy that returns one is also asked `decode_op_bytes` for every decoding request."""
        return None

    def decode_op_bytes(self, context: int, ctx: PolicyContext) -> float:
        """Bytes of the policy's own kernels for one decoding request with `context` cached tokens
        (all KV heads; asked only of policies whose `prefill_cost` is not None)."""
        return 0.0

    def decode_op_kernels(self, context: int, ctx: PolicyContext) -> float:
        """Small kernels the policy launches on each GPU for one decoding request with `context` cached
        tokens, all layers (asked only of policies whose `prefill_cost` is not None)."""
        return 0.0

    def op_cost(self, state: TokenState, ctx: PolicyContext, reason: str) -> tuple[float, float] | None:
        """(bytes read + written, FLOPs) of the policy's own work when it compresses for `reason`
        ("prefill", "decode", "reclaim"), from the state BEFORE its decision applies; None = free.
        The manager adds them to the step (the cost model prices them on the GPU's roofline)."""
        return None

    # Fast mode (sim.kv.fast): how many tokens each row keeps and where evictions fall.
    def fast_mode_profile(self) -> FastModeProfile | None:
        """None = not supported in fast mode; else how fast mode models the policy (FastModeProfile)."""
        return None

    def __repr__(self) -> str:
        params = {k: v for k, v in vars(self).items() if not k.startswith("_")}
        return f"{self.name}({', '.join(f'{k}={v}' for k, v in params.items())})"


_REGISTRY: dict[str, type[EvictionPolicy]] = {}


def register_policy(name: str, *, override: bool = False):
    """Class decorator registering a policy under `name`. A name already taken by another class is
    refused (PolicyError) unless `override=True`: a plug-in cannot silently replace a built-in."""
    def deco(cls):
        existing = _REGISTRY.get(name)
        if existing is not None and _qualname(existing) != _qualname(cls) and not override:
            raise PolicyError(f"register_policy({name!r}) in {cls.__module__}: the name is taken by "
                              f"{_qualname(existing)}; pick another name, or pass override=True to replace it")
        cls.name = name
        _REGISTRY[name] = cls
        return cls
    return deco


def _qualname(cls) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def policy_identity(name: str) -> str:
    """'' for a built-in policy; for a plug-in's, its class and a hash of its module's source, so run
    ids (sim.planning.sweep.run_id_of) change when a plug-in (or the one overriding a built-in) changes."""
    _load_builtin()
    cls = _REGISTRY.get(name)
    if cls is None or cls.__module__.startswith(_BUILTIN_PREFIX):
        return ""
    import hashlib
    import sys

    source = getattr(sys.modules.get(cls.__module__), "__file__", None)
    try:
        digest = hashlib.sha256(Path(source).read_bytes()).hexdigest()[:12] if source else "unknown"
    except OSError:
        digest = "unknown"
    return f"{_qualname(cls)}@{digest}"


def policy_names() -> list[str]:
    _load_builtin()
    return sorted(_REGISTRY)


def policy_parameters(name: str) -> list[str]:
    """The names of the parameters registered policy `name` takes; [] for an unknown name."""
    return [p.name for p in policy_parameter_specs(name)]


class PolicyParameter(NamedTuple):
    """One parameter a policy takes (`kv.params.NAME`), as its constructor declares it."""
    name: str
    default: Any            # REQUIRED when the constructor has none
    annotation: str         # the declared type, as written ('int | None'); '' when undeclared
    help: str               # the policy's `parameter_help` entry; '' when it gives none

    @property
    def required(self) -> bool:
        return self.default is REQUIRED

    @property
    def is_file(self) -> bool:
        """The value names a file or directory (front ends confine it): `path` or a name ending in
        `_path`, `_file` or `_dir`."""
        return self.name == "path" or self.name.endswith(("_path", "_file", "_dir"))


REQUIRED = inspect.Parameter.empty


def policy_parameter_specs(name: str) -> list[PolicyParameter]:
    """The parameters of registered policy `name` with their defaults, types and help (the
    constructor's signature and the class's optional `parameter_help` mapping); [] for an unknown name."""
    _load_builtin()
    cls = _REGISTRY.get(name)
    if cls is None:
        return []
    helps = getattr(cls, "parameter_help", {}) or {}
    out = []
    for p in list(inspect.signature(cls.__init__).parameters.values())[1:]:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        annotation = "" if p.annotation is p.empty else p.annotation if isinstance(p.annotation, str) else \
            getattr(p.annotation, "__name__", str(p.annotation))
        out.append(PolicyParameter(p.name, p.default, annotation, helps.get(p.name, "")))
    return out


def get_policy(name: str, **params) -> EvictionPolicy:
    """Instantiate a registered policy; unknown names or parameters raise PolicyError."""
    _load_builtin()
    if name not in _REGISTRY:
        raise PolicyError(f"unknown KV policy {name!r}; known: {', '.join(sorted(_REGISTRY))}")
    cls = _REGISTRY[name]
    sig = inspect.signature(cls.__init__)
    accepted = [p for p in sig.parameters if p != "self"]
    unknown = sorted(set(params) - set(accepted))
    if unknown:
        where = "kv.budget (--budget)" if unknown == ["budget"] else "kv.params"    # budget is its own option
        raise PolicyError(f"{where}: policy {name!r} has no parameter(s) {unknown}; "
                          f"it accepts {accepted or 'none'}")
    try:
        return cls(**params)
    except (TypeError, ValueError) as exc:
        raise PolicyError(f"kv.params for policy {name!r}: {exc}") from None


_BUILTIN_PREFIX = __name__.rpartition(".")[0] + ".policies"     # kvsim.sim.kv.policies
_plugins_loaded = False


def _load_builtin() -> None:
    from . import policies  # noqa: F401  (registers the built-in policies)
    _load_plugins()


def _load_plugins() -> None:
    """Import the policy plug-ins outside kvsim: installed packages' `kvsim.policies` entry points and
    the modules named in $KVSIM_PLUGINS (inherited by sweep workers, so they see the same policies).
    Done once it succeeds; a plug-in that fails to import fails every lookup with the same PolicyError."""
    global _plugins_loaded
    if _plugins_loaded:
        return
    for entry in plugin_entry_points():
        _import_plugin(entry.value.partition(":")[0], f"entry point {entry.name!r} of group {PLUGIN_GROUP}")
    for module in filter(None, (m.strip() for m in os.environ.get(PLUGIN_ENV, "").split(","))):
        _import_plugin(module, f"${PLUGIN_ENV}")
    _plugins_loaded = True


class _PluginExited(BaseException):
    """os._exit called by a plug-in while it is imported (raised in its place, so kvsim reports it)."""


def _refuse_exit(code=0):
    raise _PluginExited(code)


def _import_plugin(module: str, source: str) -> None:
    real_exit, os._exit = os._exit, _refuse_exit     # os._exit would end kvsim at once, with its status
    try:
        import_module(module)
    except (SystemExit, _PluginExited) as exc:    # exit() on import: an error naming the plug-in, not a silent exit 0
        code = exc.code if isinstance(exc, SystemExit) else exc.args[0]
        raise PolicyError(f"{source}: policy plug-in module {module!r} called "
                          f"{'exit' if isinstance(exc, SystemExit) else 'os._exit'}({code!r}) while being imported") \
            from None
    except KeyboardInterrupt:
        raise PolicyError(f"{source}: policy plug-in module {module!r} raised KeyboardInterrupt while being imported "
                          "(or kvsim was interrupted while importing it)") from None
    except PolicyError as exc:
        raise PolicyError(f"{source}: policy plug-in module {module!r}: {exc}") from None
    except Exception as exc:
        raise PolicyError(f"{source}: cannot import policy plug-in module {module!r} "
                          f"({type(exc).__name__}: {exc})") from None
    finally:
        os._exit = real_exit


# ----- helpers policies share ---------------------------------------------------------------
def lowest_k_mask(values: np.ndarray, k: np.ndarray, candidates: np.ndarray) -> np.ndarray:
    """Per row, mark the k[row] candidate slots with the smallest `values` (k may differ per row).

    values float [rows, S]; k int [rows] (clipped to the candidate count); candidates bool [rows, S].
    Ties are broken deterministically (same input, same mask).
    """
    rows, S = values.shape
    k = np.minimum(np.maximum(np.asarray(k, dtype=np.int64), 0), candidates.sum(axis=1))
    out = np.zeros((rows, S), dtype=bool)
    if S == 0 or not k.any():
        return out
    keyed = np.where(candidates, values, np.inf)
    kmax = int(k.max())
    if kmax < S // 4:
        idx = np.argpartition(keyed, kmax - 1, axis=1)[:, :kmax] if kmax < S else np.argsort(keyed, axis=1)
        sub = np.take_along_axis(keyed, idx, axis=1)
        order = np.argsort(sub, axis=1, kind="stable")
        idx = np.take_along_axis(idx, order, axis=1)
    else:
        idx = np.argsort(keyed, axis=1, kind="stable")[:, :kmax]
    take = np.arange(idx.shape[1])[None, :] < k[:, None]
    r = np.broadcast_to(np.arange(rows)[:, None], idx.shape)
    out[r[take], idx[take]] = True
    return out


def check_positive_int(name: str, value, minimum: int = 1) -> int:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)
