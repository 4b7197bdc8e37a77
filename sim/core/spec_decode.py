"""Speculative decoding as vLLM v1's scheduler runs it (the engine core's part: drafts, acceptance, counters).

vLLM (v1 scheduler, `vllm/v1/core/sched/scheduler.py`): after a step in which a request sampled a
token, the drafter proposes up to k draft tokens for it (`request.spec_token_ids`; the n-gram drafter
proposes none when the context has no match). The next schedule gives the running request
`num_tokens_with_spec - num_computed_tokens` = 1 + drafts new tokens, capped by the token budget (the
drafts are trimmed to what was scheduled); `allocate_slots(..., num_lookahead_tokens)` reserves k more
slots for EAGLE-style drafters, whose own KV for the drafts lives in the same blocks. After the step the
rejection sampler accepts a prefix of the drafts: the request gains 1 + accepted tokens (the stop check
truncates at max_tokens) and `num_computed_tokens -= rejected`, so the rejected tokens' slots are
rewritten by the next step; no block is freed then (the request keeps them for its next 1 + k tokens)
and every block returns when the request finishes or is preempted.

`SpecDecoder` holds what the scheduler needs of a resolved speculative config (sim/model/spec_decode.py
resolves it from `speculative_config`): k, the lookahead slots, the per-position conditional acceptance
probabilities and the n-gram drafter's proposal rate, with one seeded generator per replica (same seed,
same draws, in scheduling order), and vLLM's spec-decode counters (`vllm:spec_decode_num_drafts`,
`_num_draft_tokens`, `_num_accepted_tokens`, `_num_accepted_tokens_per_pos`).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SpecDecodeSettings:
    """The scheduler's view of a speculative config (resolved once per run)."""
    num_speculative_tokens: int                 # k: drafts proposed per request per step
    num_lookahead_tokens: int                   # extra KV slots reserved beyond the scheduled tokens
    conditional: tuple[float, ...]              # P(draft i accepted | drafts 0..i-1 accepted), i < k
    propose_rate: float = 1.0                   # share of proposals that find drafts (n-gram: a match)

    def __post_init__(self) -> None:
        k = self.num_speculative_tokens
        if k <= 0:
            raise ValueError(f"num_speculative_tokens must be > 0, got {k}")
        if len(self.conditional) != k or not all(0.0 <= p <= 1.0 for p in self.conditional):
            raise ValueError(f"expected {k} conditional acceptance probabilities in [0, 1], got {self.conditional}")
        if not 0.0 <= self.propose_rate <= 1.0:
            raise ValueError(f"propose_rate must be in [0, 1], got {self.propose_rate}")

    @property
    def per_position(self) -> tuple[float, ...]:
        """Unconditional acceptance rate of each draft position (vLLM's per-position acceptance rate)."""
        out, p = [], 1.0
        for c in self.conditional:
            p *= c
            out.append(p)
        return tuple(out)

    @property
    def mean_acceptance_length(self) -> float:
        """Expected tokens per verification step with all k drafts proposed: 1 + sum of per-position rates."""
        return 1.0 + sum(self.per_position)


class SpecDecoder:
    """One replica's drafts and acceptance draws (seeded), and its counters."""

    def __init__(self, settings: SpecDecodeSettings, seed: int = 0, replica: int = 0):
        self.settings = settings
        self.k = settings.num_speculative_tokens
        self.lookahead = settings.num_lookahead_tokens
        self._cond = np.array(settings.conditional, dtype=np.float64)
        self._propose_rate = settings.propose_rate
        self.rng = np.random.default_rng([seed, replica, 0x5EC0DE])
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * self.k
        # this step's figures (the step log's columns), reset by `accept`
        self.step_drafts = 0
        self.step_draft_tokens = 0
        self.step_accepted = 0

    def proposals(self, n: int) -> list[int]:
        """Drafts proposed for `n` requests that sampled a token this step (k each; the n-gram drafter
        finds a match with `propose_rate`, else proposes none)."""
        if self._propose_rate >= 1.0:
            return [self.k] * n
        if not n:
            return []
        hits = self.rng.random(n) < self._propose_rate
        return [self.k if h else 0 for h in hits.tolist()]

    def accept(self, drafts: list[int], conditionals: list[tuple[float, ...] | None] | None = None) -> list[int]:
        """Accepted drafts of each verified request (`drafts`: its scheduled draft tokens, > 0): the
        leading run of positions whose draw falls under the position's conditional probability. Counts
        them into the counters (vLLM counts a draft per verified request). `conditionals`: per request,
        its own k conditional probabilities (`Request.spec_conditional`, e.g. its workload class's
        measured acceptance) or None for the run's; the draws are the same either way."""
        n = len(drafts)
        self.step_drafts = n
        self.step_draft_tokens = self.step_accepted = 0
        if not n:
            return []
        k = self.k
        cond = self._cond
        if conditionals is not None and any(c is not None for c in conditionals):
            cond = np.array([self.settings.conditional if c is None else c for c in conditionals], dtype=np.float64)
        draws = self.rng.random((n, k)) < cond                # one row per request, k positions
        rejected = ~draws
        first_reject = np.where(rejected.any(axis=1), rejected.argmax(axis=1), k).tolist()
        accepted = [a if a < d else d for a, d in zip(first_reject, drafts, strict=True)]
        per_pos = self.accepted_per_pos
        for a in accepted:
            for i in range(a):
                per_pos[i] += 1
        tokens = sum(drafts)
        total = sum(accepted)
        self.num_drafts += n
        self.num_draft_tokens += tokens
        self.num_accepted_tokens += total
        self.step_draft_tokens, self.step_accepted = tokens, total
        return accepted

    def summary(self) -> dict:
        """vLLM's spec-decode counters and what follows from them (summary.json's `spec_decode`)."""
        drafts = self.num_drafts
        return {
            "num_drafts": drafts, "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "num_accepted_tokens_per_pos": list(self.accepted_per_pos),
            "acceptance_rate": self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None,
            "acceptance_rate_per_pos": [a / drafts for a in self.accepted_per_pos] if drafts else None,
            "mean_acceptance_length": 1.0 + self.num_accepted_tokens / drafts if drafts else None,
        }
