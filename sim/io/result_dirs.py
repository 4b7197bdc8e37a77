"""Result directories written atomically: a run's files are staged beside `--out` and moved in at the end.

`ResultDir(out)` checks that `out` can be a results directory (not a file, not under a file, its
parent writable), removes the staging directories of runs that died (kill -9) and creates a fresh
staging directory `.<name>.kvsim-tmp-<pid>-*` beside `out`. `publish()` moves the staged files into
place: a reused `out` loses every kvsim result file of the previous run (whichever command wrote
it), so the directory never mixes two runs; other files in it are left alone. A run that is
interrupted or fails publishes what it has, marked `partial: true` in summary.json by the caller,
into `out` unless `out` holds a complete result: then into `OUT.partial` beside it (Ctrl-C never
costs a user a finished result).

`--out` owns only what kvsim created: every results directory (and sweep/capacity store) gets a
marker file `.kvsim-results`; a non-empty directory without it (the user's own folder, `.`) is
refused unless `--overwrite` is given, and system directories (/, /etc, /dev, ...) are always refused.
"""
from __future__ import annotations

import fcntl
import functools
import inspect
import itertools
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

from .safe_io import KVSIM_TMP, SYSTEM_DIRS, SYSTEM_TREES, hold_while_writing, remove_dead_leftovers

# every file `kvsim simulate` or `kvsim replay` writes into --out
RESULT_FILES = ("requests.parquet", "steps.parquet", "summary.json", "config.yaml", "tokens.parquet",
                "decisions.parquet", "attention_stats.parquet")
_STAGING = KVSIM_TMP
OWNER_MARKER = ".kvsim-results"


class OutputDirError(ValueError):
    """--out cannot hold results; the message names the path and what is wrong."""


def check_out_dir(out: Path, option: str = "--out") -> None:
    """Refuse an `out` that is a file, lies under a file, or cannot be written (nor staged beside)."""
    shown, out = out, Path(out).absolute()
    if str(shown).strip() == "":
        raise OutputDirError(f"{option}: empty; expected a directory name")
    if out.exists() and not out.is_dir():
        raise OutputDirError(f"{option} {shown}: is a file; expected a directory (existing or to be created)")
    ancestor = out.parent
    while not ancestor.exists() and not ancestor.is_symlink():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise OutputDirError(f"{option} {shown}: {ancestor} is a file, so no directory can be created under it")
    for d in (ancestor, out) if out.is_dir() else (ancestor,):
        if not os.access(d, os.W_OK | os.X_OK):
            raise OutputDirError(f"{option} {shown}: {d} is not writable; expected a writable directory")
    _refuse_system_dir(out, shown, option)


def _refuse_system_dir(out: Path, shown: Path, option: str) -> None:
    real = Path(os.path.realpath(out))
    home = Path.home().resolve()
    trees = tuple(Path(t) for t in SYSTEM_TREES)
    if str(real) in SYSTEM_DIRS or real == home or any(t in real.parents for t in trees):
        raise OutputDirError(f"{option} {shown}: is a system directory ({real}); expected a directory of its own "
                             "for the results, e.g. runs/NAME")


def check_out_owner(out: Path, option: str = "--out", overwrite: bool = False,
                    legacy: tuple[str, ...] = ()) -> None:
    """Refuse an existing non-empty `out` that kvsim did not create (no OWNER_MARKER; nor, for stores
    written before markers, any of the `legacy` names) unless `overwrite`."""
    real = Path(os.path.realpath(out))
    if overwrite or not real.is_dir() or (real / OWNER_MARKER).exists():
        return
    if any((real / name).exists() for name in legacy):
        return
    entries = [p.name for p in itertools.islice((p for p in real.iterdir() if p.name not in _OWN_NAMES), 4)]
    if entries:
        shown = ", ".join(entries[:3]) + (", ..." if len(entries) > 3 else "")
        raise OutputDirError(f"{option} {out}: holds files kvsim did not write ({shown}); expected a new or empty "
                             f"directory or one of kvsim's (it has a {OWNER_MARKER} file); pass --overwrite to "
                             f"write kvsim's files into it anyway")


_OWN_NAMES = (OWNER_MARKER, ".kvsim-lock")       # kvsim's own bookkeeping files (the marker, a store's lock)


def claim_out_dir(out: Path, option: str = "--out", overwrite: bool = False) -> None:
    """An output directory a command writes several files into (crosscheck, reference), before its work:
    not a file or a system directory, not a folder of the user's own files (unless `overwrite`); then
    created and marked kvsim's. OutputDirError otherwise."""
    check_out_dir(Path(out), option)
    check_out_owner(Path(out), option, overwrite)
    try:
        Path(out).mkdir(parents=True, exist_ok=True)
        mark_owned(Path(out))
    except OSError as exc:
        raise OutputDirError(f"{option} {out}: cannot be written ({exc.strerror or exc})") from None


def mark_owned(directory: Path) -> None:
    """Record that kvsim created `directory` (check_out_owner accepts it from now on)."""
    (Path(directory) / OWNER_MARKER).touch()


class ResultDir:
    """A staging directory beside `out`; `publish()` moves its files into `out`, `discard()` drops it."""

    def __init__(self, out: str | Path, option: str = "--out", overwrite: bool = False):
        self._held = None
        check_out_dir(Path(out), option)
        check_out_owner(Path(out), option, overwrite)
        self.shown = Path(out)
        self.out = Path(os.path.abspath(out))          # "." has a name and a parent
        try:
            self.out.parent.mkdir(parents=True, exist_ok=True)
            remove_dead_leftovers(self.out)
            self.path = Path(tempfile.mkdtemp(prefix=f".{self.out.name}{_STAGING}{os.getpid()}-",
                                              dir=self.out.parent))
            self._held = hold_while_writing(self.path)   # a kill -9 drops it: the next run removes the directory
            self.path.chmod(0o777 & ~_umask())      # mkdtemp's 0700 would become the results' mode
            mark_owned(self.path)
        except OSError as exc:
            raise OutputDirError(f"{option} {self.shown}: cannot write beside it ({exc.strerror}); expected "
                                 "a directory whose parent is writable") from None

    def publish(self, partial: bool = False) -> Path:
        """Move the staged files into `out` (replacing the previous run's kvsim files); runs publishing
        into the same directory at once take turns (a lock on its parent directory). A `partial` result
        (an interrupted run) never replaces a complete one: it goes to `OUT.partial` beside it instead
        (None when that name is taken by files kvsim did not write); a complete one removes an earlier
        `OUT.partial`."""
        with _flock(self.out.parent, fcntl.LOCK_EX):
            aside = self.out.with_name(self.out.name + PARTIAL_SUFFIX)
            if partial and holds_complete_result(self.out):
                if aside.exists() and not (aside / OWNER_MARKER).exists():
                    return None
                self.out, self.shown = aside, Path(f"{self.shown}{PARTIAL_SUFFIX}")
            elif not partial and (aside / OWNER_MARKER).is_file() and not aside.is_symlink():
                shutil.rmtree(aside, ignore_errors=True)
            return self._publish()

    def _publish(self) -> Path:
        out = self.out
        if not out.exists():
            os.replace(self.path, out)
            self._release()
            return self.shown
        others = [p for p in out.iterdir() if p.name not in RESULT_FILES and p.name != OWNER_MARKER]
        swappable = not out.is_symlink() and out != Path.cwd()
        if not others and swappable:        # only an earlier run's results: swap whole directories
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}{_STAGING}{os.getpid()}-old-", dir=out.parent))
            os.replace(out, old / "previous")
            os.replace(self.path, out)
            shutil.rmtree(old, ignore_errors=True)
            self._release()
            return self.shown
        for name in RESULT_FILES:           # other files stay: drop the previous run's, then move ours in
            (out / name).unlink(missing_ok=True)
        staged = sorted(self.path.iterdir(), key=lambda p: p.name == "summary.json")   # the summary last
        for f in staged:
            shutil.move(f, out / f.name)    # a rename, or a copy when a link leads to another file system
        self.path.rmdir()
        self._release()
        return self.shown

    def discard(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
        self._release()

    def _release(self) -> None:
        if self._held is not None:
            os.close(self._held)
            self._held = None


PARTIAL_SUFFIX = ".partial"


def holds_complete_result(out: Path) -> bool:
    """Whether `out` holds a finished run's results (summary.json that is not marked partial)."""
    import json

    try:
        return json.loads((Path(out) / "summary.json").read_text()).get("partial") is False
    except (OSError, ValueError, AttributeError):
        return False


def remove_dead_staging(out: Path) -> None:
    """Staging directories beside `out` that no live kvsim holds (a kill -9 leaves them)."""
    remove_dead_leftovers(Path(out))


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextmanager
def _flock(path: Path, how: int):
    """An flock on `path` (a directory or file, opened read-only) for the duration of the block."""
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, how)
        yield fd
    finally:
        os.close(fd)                # releases the lock


STORE_LOCK = ".kvsim-lock"


class StoreBusyError(ValueError):
    """Another process is writing the store."""


@contextmanager
def store_lock(store: Path, option: str = "--out"):
    """Hold the store's lock (sweep and capacity stores): a second kvsim writing the same store is
    refused at once, instead of both running every missing run."""
    store = Path(store)
    store.mkdir(parents=True, exist_ok=True)
    lock = store / STORE_LOCK
    lock.touch()
    try:
        with _flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB):
            yield
    except BlockingIOError:
        raise StoreBusyError(f"{option} {store}: another kvsim process is writing this store; wait for it to "
                             "end (a later run resumes what it leaves) or use another directory") from None


def holding_store_lock(func):
    """Decorator: run `func` holding store_lock of its `store` argument (when it is not None)."""
    sig = inspect.signature(func)

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        store = sig.bind(*args, **kwargs).arguments.get("store")
        if store is None:
            return func(*args, **kwargs)
        with store_lock(Path(store)):
            return func(*args, **kwargs)
    return wrapper
