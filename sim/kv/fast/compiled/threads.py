"""How many threads a parallel compiled kernel may use: from its work size and the cores actually free.

A numba `parallel=True` kernel splits each `prange` over all its threads and waits for the slowest at
the loop's end. On a machine where another process keeps a core busy, the thread placed on that core
gets a time slice now and then, and every parallel loop of every step waits for it: LeanKV's compiled
decode steps went from 6.5 s to 75-82 s when the second of two cores was busy. `ThreadBudget` gives a
kernel call the threads it can use without that: serial below `min_work` items, else the cores of the
process's affinity that other processes left idle over the last `interval` seconds (from /proc/stat's
busy time less this process's own CPU time; the 1-minute load average where /proc/stat is absent),
never more than numba's NUMBA_NUM_THREADS. The kernels write each item's result to its own slot, so the
thread count changes no result.
"""
from __future__ import annotations

import os
import time
from typing import NamedTuple


class CpuSample(NamedTuple):
    """One reading: wall clock, the machine's busy CPU seconds (all cores), this process's CPU seconds."""
    wall: float
    busy: float
    own: float


def read_sample() -> CpuSample | None:
    """Now, from /proc/stat (None where it cannot be read)."""
    try:
        with open("/proc/stat", "rb") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != b"cpu" or len(fields) < 8:
        return None
    ticks = [int(x) for x in fields[1:]]
    busy = sum(ticks[:8]) - ticks[3] - ticks[4]          # all but idle and iowait (guest time is in user)
    return CpuSample(time.monotonic(), busy / os.sysconf("SC_CLK_TCK"), time.process_time())


def free_cores(before: CpuSample, after: CpuSample, cores: int) -> float:
    """Cores other processes left idle between two samples (this process's own use counts as free)."""
    wall = after.wall - before.wall
    if wall <= 0:
        return float(cores)
    others = (after.busy - before.busy) - (after.own - before.own)
    return min(float(cores), max(cores - others / wall, 0.0))


def threads_for(free: float, cores: int, work: int, min_work: int, slack: float = 0.25) -> int:
    """Threads for `work` items: 1 below `min_work`, else the whole cores free (a core busy more than
    1 - slack of the time counts as taken), between 1 and `cores`."""
    if work < min_work or cores <= 1:
        return 1
    return max(1, min(cores, int(free + slack)))


def _affinity() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:                               # pragma: no cover - not Linux
        return os.cpu_count() or 1


class ThreadBudget:
    """Threads for each call of a parallel kernel (module doc); samples the machine every `interval` s
    (until the first interval has passed: the load average)."""

    def __init__(self, max_threads: int, min_work: int = 64, interval: float = 0.2):
        self.cores = max(1, min(max_threads, _affinity()))
        self.min_work = min_work
        self.interval = interval
        self._last = read_sample()
        self._free = self._free_from_load()

    def _free_from_load(self) -> float:
        try:
            load = os.getloadavg()[0]
        except OSError:                                  # pragma: no cover
            return float(self.cores)
        return max(float(self.cores) - max(load - 1.0, 0.0), 0.0)   # the 1.0: this process itself

    def _refresh(self) -> None:
        if self._last is None or time.monotonic() - self._last.wall < self.interval:
            return
        sample = read_sample()
        if sample is not None:
            self._free = free_cores(self._last, sample, self.cores)
            self._last = sample

    def threads(self, work: int) -> int:
        """Threads for a call over `work` independent items."""
        if work < self.min_work or self.cores <= 1:
            return 1
        self._refresh()
        return threads_for(self._free, self.cores, work, self.min_work)
