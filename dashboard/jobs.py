"""Run simulations in a worker thread so the page keeps rendering progress (and can cancel)."""
from __future__ import annotations

import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

from sim.config import ConfigError, SimConfig

from .data import RunRecord, record_from_result

class Cancelled(Exception):
    pass


class _Meter:
    """The progress bar run_simulation advances per finished request (`progress=`), read by the page."""

    def __init__(self, total: int, job: "Job"):
        self.n = 0
        self.total = total
        self.job = job
        job.run_total, job.run_done = total, 0

    def update(self, k: int = 1) -> None:
        if self.job.cancel_requested:
            raise Cancelled()
        self.n += k
        self.job.run_done = self.n

    def close(self) -> None:
        pass


@dataclass
class Job:
    """Simulates each (label, config) in turn; `records` fills in as runs finish.

    With `task`, runs task(job) instead and keeps its return value in `value`; the task reports
    progress through `run_done` / `run_total` / `unit` and checks `cancel_requested`."""
    runs: list[tuple[str, SimConfig]] = field(default_factory=list)
    task: Callable[["Job"], Any] | None = None
    unit: str = "requests"
    value: Any = None
    records: list[RunRecord] = field(default_factory=list)
    error: str | None = None
    run_done: int = 0
    run_total: int = 0
    cancel_requested: bool = False
    started: float = field(default_factory=time.perf_counter)
    finished: float | None = None
    _thread: threading.Thread | None = None

    def start(self) -> "Job":
        self._thread = threading.Thread(target=self._work, name="kvsim-dashboard-job", daemon=True)
        self._thread.start()
        return self

    def _work(self) -> None:
        from sim.simulate import run_simulation
        from traces import TraceError

        try:
            if self.task is not None:
                self.value = self.task(self)
            for label, cfg in self.runs:
                self.run_done, self.run_total = 0, 0
                result = run_simulation(cfg, None, progress=lambda total: _Meter(total, self))
                self.records.append(record_from_result(result, cfg, label))
        except Cancelled:
            self.error = "cancelled"
        except (ConfigError, TraceError, ValueError, FileNotFoundError, RuntimeError) as exc:
            self.error = str(exc)
            if len(self.runs) > 1:
                self.error = f"{self.runs[len(self.records)][0]}: {exc}"
        except Exception as exc:  # an engine bug: keep the trace for the report, not a crashed page
            self.error = f"internal error: {type(exc).__name__}: {exc}\n{traceback.format_exc(limit=4)}"
        finally:
            self.finished = time.perf_counter()

    @property
    def done(self) -> bool:
        return self.finished is not None

    @property
    def fraction(self) -> float:
        if self.task is not None:
            return min(1.0, self.run_done / self.run_total) if self.run_total else 0.0
        inner = self.run_done / self.run_total if self.run_total else 0.0
        return min(1.0, (len(self.records) + inner) / max(len(self.runs), 1))

    def status_text(self) -> str:
        elapsed = (self.finished or time.perf_counter()) - self.started
        n = len(self.runs)
        which = f"run {min(len(self.records) + 1, n)}/{n} - " if n > 1 else ""
        done = f"{self.run_done}/{self.run_total} {self.unit} done" if self.run_total else "starting"
        return f"Simulating: {which}{done} - {elapsed:.1f}s"

    def wait(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

