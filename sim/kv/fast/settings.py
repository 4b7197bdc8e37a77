"""Fast mode's run constants: what a policy's fast-mode profile and the options resolve to, once.

Every component of the fast manager reads the fields it needs from one frozen `FastSettings`; none
reads the profile or the options again.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..base import FastOptions, sample_row_count
from ..policy import EvictionPolicy, FastModeProfile, PolicyContext, PolicyError
from ..slots import SLOT_STRATEGIES

BUDGET_SENTINEL = 1 << 30      # the decode kernel's budget when re-cuts do the evicting
APPEND = {"noop", "free_block", "sparse_copy", "holed_copy"}


@dataclass(frozen=True)
class FastSettings:
    """A fast-mode run's constants (sizes, the policy's shape, the slot strategy)."""
    block_size: int
    rows: int                    # simulated rows (a divisor of the real rows)
    unit: int                    # real rows each simulated row stands for
    strategy: str                # the slot strategy
    tracks_columns: bool         # False (noop): counts decide every metric, rows are identical
    budget: int | None           # decode budget per row (None: decode never evicts; BUDGET_SENTINEL: re-cuts do)
    window: int                  # newest tokens decode never evicts (0 for prompt-only policies)
    sink: int                    # oldest tokens the prompt cut never evicts
    age_weight: str              # where evictions fall: "oldest" | "uniform" | "young" (H2O)
    cut_budget: int | None       # the prompt cut's uniform budget (None: per-row budgets, or no cut)
    cut_window: int              # the window the prompt cut protects
    prompt_cut: bool             # False: the prompt is listed whole, decode evicts one a step (h2o per step)
    prompt_only: bool            # the prompt cut keeps the budget, decode never evicts (SnapKV)
    recut: str | None            # decode-time re-cuts: "every_n" | "over_budget"
    recut_interval: int
    scored: bool                 # decode evictions by H2O's closed-form score
    cut_scored: bool             # ... and the prompt cut's
    bytes_per_token_row: float
    copy_threshold: int = 0      # copy strategies: a row is rewritten once it holds more holes than this

    @property
    def append(self) -> bool:
        return self.strategy in APPEND

    @property
    def evict_leaving(self) -> bool:
        """"oldest": the token leaving the window is the one evicted."""
        return self.age_weight == "oldest"

    @property
    def scores(self) -> bool:
        """Closed-form score state is kept (decode or prompt cut)."""
        return self.scored or self.cut_scored

    @property
    def list_cap(self) -> int:
        """Heavy-list entries per row to start with (re-cuts grow them as lists lengthen)."""
        return 64 if self.recut else max(self.cut_budget or 0, self.budget or 0) + 2


def resolve_settings(block_size: int, ctx: PolicyContext, policy: EvictionPolicy, options: FastOptions) -> FastSettings:
    """The run's constants, with a one-line error for a policy fast mode cannot run."""
    if options.slot_strategy not in SLOT_STRATEGIES:
        raise ValueError(f"kv.slot_strategy must be one of {SLOT_STRATEGIES}, got {options.slot_strategy!r}")
    profile = policy.fast_mode_profile()
    if profile is None:
        raise PolicyError(f"kv.mode=fast: policy {policy.name!r} has no fast-mode profile; use kv.mode=token")
    tracks_columns = options.slot_strategy != "noop"
    sample_rows = options.sample_rows if tracks_columns else 1
    rows = sample_row_count(ctx.rows, sample_rows) if sample_rows > 0 else ctx.rows
    budget, window = profile.budget, int(profile.protect_recent)
    cut_budget = budget
    if not profile.prompt_cut:
        _check_per_step(policy, profile)
        cut_budget = None
    if profile.prompt_only:
        budget, window = None, 0
    _check_profile(policy, profile)
    if profile.recut:                     # re-cuts evict; the kernel only keeps the lists
        budget = BUDGET_SENTINEL
    young = profile.age_weight == "young"
    return FastSettings(
        block_size=block_size, rows=rows, unit=ctx.rows // rows, strategy=options.slot_strategy,
        tracks_columns=tracks_columns, budget=budget, window=window, sink=int(profile.protect_first),
        age_weight=profile.age_weight, cut_budget=cut_budget, cut_window=int(profile.protect_recent),
        prompt_cut=bool(profile.prompt_cut), prompt_only=bool(profile.prompt_only), recut=profile.recut,
        recut_interval=int(profile.recut_interval), scored=young and budget is not None,
        cut_scored=young and (cut_budget is not None or profile.cut_budgets is not None or not profile.prompt_cut),
        bytes_per_token_row=options.bytes_per_token_row, copy_threshold=int(options.copy_threshold))


def _check_per_step(policy: EvictionPolicy, profile: FastModeProfile) -> None:
    if profile.age_weight != "young":
        raise PolicyError(f"kv.mode=fast: policy {policy.name!r} with kv.params.evict_per_step evicts the oldest "
                          f"tokens of a per-request window fast mode does not track; use kv.mode=token")
    if int(profile.per_step) != 1:
        raise PolicyError(f"kv.mode=fast: policy {policy.name!r}: kv.params.evict_per_step must be 1 in fast "
                          f"mode (got {profile.per_step}); use kv.mode=token for more")


def _check_profile(policy: EvictionPolicy, profile: FastModeProfile) -> None:
    if profile.cut_sharing not in (None, "layer", "blocks"):
        raise ValueError(f"fast mode: unknown cut_sharing {profile.cut_sharing!r}")
    if profile.recut not in (None, "every_n", "over_budget"):
        raise ValueError(f"fast mode: unknown recut {profile.recut!r}")
    if profile.cut_budgets is not None and not (profile.prompt_only or profile.recut):
        raise PolicyError(f"kv.mode=fast: policy {policy.name!r}: per-row cut budgets need a prompt-only profile")
