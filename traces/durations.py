"""The one duration parser of every option that takes a time (SLOs, windows, --goodput's milliseconds aside):
'100ms', '2s', '1.5min', '10m', '1h', '500us'."""
from __future__ import annotations

import re

UNITS = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0}
DURATION = re.compile(r"\s*([0-9]*\.?[0-9]+(?:[eE][-+]?\d+)?)\s*(ns|us|ms|s|min|m|h)?\s*")
EXAMPLES = "e.g. 500us, 200ms, 2s, 10m (minutes), 1h"


def duration_seconds(text: str | float, *, unit_required: bool) -> float | None:
    """Seconds of `text`, or None when it is not a duration. Without a unit: seconds, unless `unit_required`
    (an SLO: a bare number is ambiguous there, so it is not a duration)."""
    m = DURATION.fullmatch(str(text))
    if not m or (m.group(2) is None and unit_required):
        return None
    return float(m.group(1)) * UNITS[m.group(2) or "s"]
