"""Progress of a simulation over its simulated work, with an ETA; the hook that can cancel it.

`run_simulation(cfg, progress=callback)` calls `callback(SimProgress)` after every engine step (a
fast-forwarded stretch of decode steps is one call). The work is the tokens the engine computes
(prefill + decode) against the workload's prompt + output tokens, so a closed batch of long prompts
moves the bar from its first step, long before any request finishes. The callback may raise (for
example `Cancelled`) to stop the simulation: the exception propagates out of `run_simulation`.
`progress=True` shows `TokenBar` (tqdm on stderr: tokens, ETA, requests done).

Code that runs simulations through other layers (a capacity search, an in-process sweep) can set
the callback for every simulation of its thread with `with reporting_to(callback): ...`.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

_AMBIENT: ContextVar = ContextVar("kvsim_progress_callback", default=None)


class Cancelled(BaseException):
    """Raised by a progress callback to stop a simulation. A BaseException (like KeyboardInterrupt):
    a stop request, not a failure, so layers that turn a failed simulation into a result row let it
    through."""


@contextmanager
def reporting_to(callback):
    """Every run_simulation in this context (thread) without its own `progress` reports to `callback`."""
    token = _AMBIENT.set(callback)
    try:
        yield
    finally:
        _AMBIENT.reset(token)


def ambient_callback():
    return _AMBIENT.get()


@dataclass
class SimProgress:
    tokens_total: int                 # prompt + output tokens of the workload's requests
    requests_total: int
    tokens_done: int = 0              # prefill + decode tokens computed (recomputation after preemption counts)
    requests_done: int = 0            # finished or rejected
    steps: int = 0                    # engine steps, all replicas
    sim_time_s: float = 0.0           # simulated clock
    finished: bool = False            # the simulation has ended
    started: float = field(default_factory=time.perf_counter)

    @property
    def elapsed_s(self) -> float:
        return time.perf_counter() - self.started

    @property
    def fraction(self) -> float:
        if self.finished or self.tokens_total <= 0:
            return 1.0 if self.finished else 0.0
        return min(self.tokens_done / self.tokens_total, 0.999)   # recomputation can overshoot the total

    @property
    def eta_s(self) -> float | None:
        """Seconds left at the rate so far; None before any work is done."""
        f = self.fraction
        if f <= 0:
            return None
        return 0.0 if f >= 1 else self.elapsed_s * (1 - f) / f

    def describe(self) -> str:
        eta = self.eta_s
        left = "ETA -" if eta is None else f"ETA {format_duration(eta)}"
        return (f"{self.fraction:.0%} of {self.tokens_total:,} tokens, {self.requests_done}/{self.requests_total} "
                f"requests, {self.steps:,} steps, {format_duration(self.elapsed_s)} elapsed, {left}")


def format_duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.0f} s"
    if seconds < 3600:
        return f"{int(seconds // 60)} min {int(seconds % 60):02d} s"
    return f"{int(seconds // 3600)} h {int(seconds % 3600 // 60):02d} min"


class ProgressTracker:
    """The engine's per-step hook: refreshes a SimProgress from the replicas, then calls back."""

    def __init__(self, requests: list, replicas: list, callback):
        self.progress = SimProgress(sum(r.prompt_tokens + r.max_output_tokens for r in requests), len(requests))
        self.replicas = replicas
        self.callback = callback

    def __call__(self, _steps: int = 1) -> None:
        p, reps = self.progress, self.replicas
        p.tokens_done = sum(r.tokens_computed for r in reps)
        p.steps = sum(r.num_steps for r in reps)
        p.requests_done = sum(len(r.scheduler.finished) + len(r.scheduler.rejected) for r in reps)
        p.sim_time_s = max(r.now for r in reps)
        self.callback(p)

    def finish(self) -> None:
        self.progress.finished = True
        self()


class TokenBar:
    """The CLI's bar: a tqdm bar over tokens (rate and ETA) with requests and steps done."""

    def __init__(self, min_interval_s: float = 0.5):
        self.bar = None
        self.min_interval_s = min_interval_s
        self._next = 0.0

    def __call__(self, p: SimProgress) -> None:
        now = time.perf_counter()
        if now < self._next and not p.finished:
            return
        self._next = now + self.min_interval_s
        if self.bar is None:
            from tqdm import tqdm
            self.bar = tqdm(total=p.tokens_total, unit="tok", unit_scale=True, desc="simulating",
                            mininterval=0, smoothing=0.1)
        done = p.tokens_total if p.finished else min(p.tokens_done, p.tokens_total)
        self.bar.set_postfix_str(f"{p.requests_done}/{p.requests_total} req, {p.steps:,} steps", refresh=False)
        self.bar.update(done - self.bar.n)
        if p.finished:
            self.bar.close()
