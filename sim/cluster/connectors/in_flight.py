"""Asynchronous transfers of one connector, by completion time."""
from __future__ import annotations

import heapq
from itertools import count


class InFlight:
    """Requests whose transfer ends at a known time; `done(now)` hands back those ended by then,
    in completion order (ties: in the order they were started)."""

    def __init__(self):
        self._heap: list[tuple[float, int, object]] = []
        self._order = count()

    def __len__(self) -> int:
        return len(self._heap)

    def add(self, end_s: float, req) -> None:
        heapq.heappush(self._heap, (end_s, next(self._order), req))

    def done(self, now: float) -> list:
        heap, out = self._heap, []
        while heap and heap[0][0] <= now:
            out.append(heapq.heappop(heap)[2])
        return out

    def next_end(self) -> float:
        return self._heap[0][0] if self._heap else float("inf")
