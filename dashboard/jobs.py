"""Run simulations in a worker thread so the page keeps rendering progress (and can cancel).

A Job simulates its runs one after the other with `run_simulation(progress=...)`: after every engine
step the simulator reports a `sim.io.progress.SimProgress` (tokens computed of the workload's total,
requests done, ETA) and the job raises `Cancelled` there once `cancel()` was called, so a cancel takes
effect at the end of the current engine step.
"""
from __future__ import annotations

import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import yaml

from kvsim.sim.config import ConfigError, SimConfig
from kvsim.sim.io.progress import Cancelled, SimProgress, format_duration, reporting_to

from .data import RunRecord, new_run_dir, record_from_result, write_label

__all__ = ["Cancelled", "Job", "capacity_search_task"]


@dataclass
class Job:
    """Simulates each (label, config) in turn; `records` fills in as runs finish. With `out_root`,
    each run is written to a run directory under it (the CLI's layout, sim/io/result_dirs.py) and its
    record points there; labels are made unique among `taken`.

    With `task`, runs task(job) instead and keeps its return value in `value`; the task reports
    progress through `run_done` / `run_total` / `unit` and calls `check_cancel()` between its steps."""
    runs: list[tuple[str, SimConfig]] = field(default_factory=list)
    task: Callable[["Job"], Any] | None = None
    page: str = ""                     # the page that started it (shows its progress and result)
    unit: str = "points"
    value: Any = None
    records: list[RunRecord] = field(default_factory=list)
    error: str | None = None
    run_done: int = 0
    run_total: int = 0
    progress: SimProgress | None = None   # of the run being simulated
    cancel_requested: bool = False
    saved: bool = False                # records handed to the session's run list
    started: float = field(default_factory=time.perf_counter)
    cancel_time: float | None = None
    finished: float | None = None
    out_root: Path | None = None
    taken: set[str] = field(default_factory=set)
    config: SimConfig | None = None    # what a task simulates (its errors are shown as guard.shown_error does)
    _thread: threading.Thread | None = None

    def start(self) -> "Job":
        self._thread = threading.Thread(target=self._work, name="kvsim-dashboard-job", daemon=True)
        self._thread.start()
        return self

    def cancel(self) -> None:
        if not self.cancel_requested:
            self.cancel_requested, self.cancel_time = True, time.perf_counter()

    def check_cancel(self) -> None:
        if self.cancel_requested:
            raise Cancelled()

    def on_progress(self, progress: SimProgress) -> None:
        """run_simulation's per-step callback."""
        self.progress = progress
        self.check_cancel()

    def _work(self) -> None:
        try:
            if self.task is not None:
                with reporting_to(self.on_progress):   # every simulation it runs reports every step
                    self.value = self.task(self)
            self._simulate_runs()
        except Cancelled:
            self.error = "cancelled"
        except (ConfigError, ValueError, FileNotFoundError, RuntimeError) as exc:
            message = self._shown(str(exc))
            self.error = message if len(self.runs) < 2 else f"{self.runs[len(self.records)][0]}: {message}"
        except Exception as exc:  # an engine bug: keep the frames for the report, not a crashed page
            frames = "".join(traceback.format_tb(exc.__traceback__, limit=4))
            self.error = f"internal error: {type(exc).__name__}: {self._shown(str(exc))}\n{frames}"
        finally:
            self.finished = time.perf_counter()

    def _shown(self, message: str) -> str:
        """An error as the page may show it: a run reading a user's file (trace, model, profile, KV
        importance, a policy's file) may have its loader quote the file; that text is redacted."""
        from .guard import shown_error

        cfg = self.runs[len(self.records)][1] if len(self.records) < len(self.runs) else self.config
        return message if cfg is None else shown_error(cfg, message)

    def _simulate_runs(self) -> None:
        from kvsim.sim.simulator.simulate import run_simulation

        from .guard import check_run
        for label, cfg in self.runs:
            check_run(cfg)                  # also for a job built without the page's start_job
            self.progress = None
            if self.out_root is None:
                result = run_simulation(cfg, None, progress=self.on_progress)
                self.records.append(record_from_result(result, cfg, label))
                continue
            out, label = new_run_dir(self.out_root, label, self.taken)
            self.taken.add(label)
            result = run_simulation(cfg, out, progress=self.on_progress)
            write_label(out, label)
            record = record_from_result(result, cfg, label)
            record.config = yaml.safe_load((out / "config.yaml").read_text())   # resolved, as the CLI reruns it
            record.path = out
            self.records.append(record)

    @property
    def done(self) -> bool:
        return self.finished is not None

    @property
    def elapsed_s(self) -> float:
        return (self.finished or time.perf_counter()) - self.started

    @property
    def fraction(self) -> float:
        p = self.progress
        inner = p.fraction if p is not None and not p.finished else 0.0
        if self.task is not None:
            return min(1.0, (self.run_done + inner) / self.run_total) if self.run_total else 0.0
        return min(1.0, (len(self.records) + inner) / max(len(self.runs), 1))

    # The first steps (trace loading, the scheduler's warm-up, JIT compiles) are not representative:
    # the time left is extrapolated only once this much time has passed and work is done.
    ETA_AFTER_S = 3.0
    ETA_AFTER_FRACTION = 0.05

    @property
    def eta_s(self) -> float | None:
        f = self.fraction
        if f < self.ETA_AFTER_FRACTION or self.elapsed_s < self.ETA_AFTER_S:
            return None
        return self.elapsed_s * (1 - f) / f

    def status_text(self) -> str:
        if self.cancel_requested and not self.done:
            return f"Cancelling (ends with the current engine step) - {format_duration(self.elapsed_s)} elapsed"
        eta = "" if self.eta_s is None else f", about {format_duration(self.eta_s)} left"
        return f"{self._what()} - {format_duration(self.elapsed_s)} elapsed{eta}"

    def _what(self) -> str:
        if self.task is not None:
            return f"{self.run_done}/{self.run_total} {self.unit} done" if self.run_total else "starting"
        n, p = len(self.runs), self.progress
        which = f"run {min(len(self.records) + 1, n)} of {n}: " if n > 1 else ""
        if p is None:
            return f"Simulating {which}loading the trace"
        return (f"Simulating {which}{p.fraction:.0%} of {p.tokens_total:,} tokens, "
                f"{p.requests_done}/{p.requests_total} requests done")

    def wait(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)


def capacity_search_task(base: SimConfig, gpus: list[str], constraints, mode: str, max_evals: int,
                         store: str | None) -> Callable[[Job], list]:
    """A Job task: sim.planning.capacity.find_capacity for each GPU -> [(gpu, CapacityResult)]."""
    from kvsim.sim.planning.capacity import CapacitySearch, find_capacity

    from .forms import with_value

    def task(job: Job) -> list:
        job.unit, job.run_total = "simulations", len(gpus) * max_evals
        answers = []
        for i, gpu in enumerate(gpus):
            def progress(row):
                job.run_done += 1
            answers.append((gpu, find_capacity(with_value(base, "gpu", gpu), constraints,
                                               CapacitySearch(mode=mode, max_evals=max_evals), store=store,
                                               progress=progress)))
            job.run_done = (i + 1) * max_evals
        return answers
    return task
