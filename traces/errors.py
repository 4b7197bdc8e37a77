"""Errors and notices raised while reading or building traces."""
from __future__ import annotations

import os


class TraceError(ValueError):
    """A trace file or trace parameter is invalid.

    The message reads ``path:line: what was found; what was expected`` for text files,
    ``path: row N: ...`` for Parquet files and ``path: ...`` for whole-file problems.
    """

    def __init__(self, path: str | os.PathLike | None, line: int | None, message: str):
        self.path = None if path is None else str(path)
        self.line = line
        self.reason = message
        where = self.path or "<trace>"
        if line is not None:
            where = f"{where}:{line}"
        super().__init__(f"{where}: {message}")


class TraceWarning(UserWarning):
    """Something in a trace was repaired while loading (unsorted arrivals, zero output lengths)."""
