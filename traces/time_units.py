"""The unit of epoch timestamps in a user's log, told from their size.

Epoch seconds of any date this side of the year 5000 are below 1e11; the same instants in milliseconds
are around 1.7e12, in microseconds 1.7e15 and in nanoseconds 1.7e18. A column of epoch numbers read as
seconds that are 1e11 or more can only be a finer unit: read as seconds, a log of 630 ms of
millisecond stamps would span 630 s."""
from __future__ import annotations

import numpy as np

# (the smallest typical epoch value in the unit, unit), coarsest last: 1e11 s is the year 5138
_EPOCH_FLOORS = ((1e17, "ns"), (1e14, "us"), (1e11, "ms"))


def detect_epoch_unit(values: np.ndarray) -> str | None:
    """'ms', 'us' or 'ns' when epoch numbers given as seconds are too large to be seconds (their median
    is 1e11 or more), else None (seconds, or times that are not epoch stamps)."""
    finite = values[np.isfinite(values)]
    if finite.size == 0:
        return None
    typical = float(np.median(np.abs(finite)))
    return next((unit for floor, unit in _EPOCH_FLOORS if typical >= floor), None)
