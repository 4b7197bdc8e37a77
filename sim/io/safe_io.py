"""Reading user files with limits: every YAML/JSON file a user (or a dashboard page) names goes through here.

- `check_input_file`: the path must be a regular file (not a FIFO, device, socket or directory, also
  behind a symlink: `/dev/zero` and named pipes are refused before they are opened) of bounded size.
- `safe_yaml_load`: YAML with at most `MAX_YAML_ALIASES` aliases, `MAX_NESTING` levels and no
  duplicate keys, checked on the parser's event stream before anything is built (an alias "billion
  laughs" document is refused in microseconds instead of expanding to gigabytes).
- `safe_json_loads`: JSON nested at most `MAX_NESTING` levels (deeper input would raise RecursionError).

Errors are `InputError` (a ValueError) with one line naming the file (or option) and the limit; they
never quote the file's content, so a page that reads a file cannot leak another file's keys.
"""
from __future__ import annotations

import errno
import fcntl
import itertools
import json
import os
import signal
import stat
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from collections.abc import Callable, Iterator

import yaml


MAX_YAML_BYTES = 16 * 2**20     # configs, profiles, catalog entries, sweep specs, importance models
MAX_YAML_ALIASES = 100          # anchors are fine for sharing a few sections; a bomb needs thousands
MAX_YAML_VALUES = 1_000_000     # values after aliases are expanded
MAX_NESTING = 100               # mappings/lists (YAML) or objects/arrays (JSON) inside each other
MAX_SET_VALUE_CHARS = 10_000    # one --set KEY=VALUE item
# directories no output may go into (or, for the second group, under)
SYSTEM_DIRS = ("/", "/bin", "/boot", "/dev", "/etc", "/home", "/lib", "/lib32", "/lib64", "/opt", "/proc", "/root",
               "/run", "/sbin", "/srv", "/sys", "/tmp", "/usr", "/var")
SYSTEM_TREES = ("/bin", "/boot", "/dev", "/etc", "/lib", "/lib32", "/lib64", "/proc", "/sbin", "/sys", "/usr")

_CParser = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class InputError(ValueError):
    """A user file or value is unsafe to read (not a regular file, too large, too nested, a bomb)."""


def file_kind(mode: int) -> str:
    """What a non-regular file is, in words (\"a named pipe (FIFO)\", \"a character device\", ...)."""
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a named pipe (FIFO)"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def check_input_file(path: str | os.PathLike, *, what: str = "file", max_bytes: int | None = MAX_YAML_BYTES,
                     option: str = "") -> Path:
    """`path` if it is a regular file (after symlinks) of at most `max_bytes`; InputError otherwise.
    FileNotFoundError passes through (callers say which names they know)."""
    path = Path(path)
    where = f"{option}{path}"
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise InputError(f"{where}: cannot be read ({exc.strerror}); expected a {what}") from None
    if not stat.S_ISREG(st.st_mode):
        if stat.S_ISDIR(st.st_mode):
            raise IsADirectoryError(21, "Is a directory", str(path))
        raise InputError(f"{where}: is {file_kind(st.st_mode)}; expected a {what} (a regular file)")
    if max_bytes is not None and st.st_size > max_bytes:
        raise InputError(f"{where}: is {st.st_size / 2**20:.1f} MiB; a {what} may be at most "
                         f"{max_bytes / 2**20:.0f} MiB")
    return path


def read_input_text(path: str | os.PathLike, *, what: str = "file", max_bytes: int = MAX_YAML_BYTES,
                    option: str = "") -> str:
    """The text of a checked regular file; reads at most `max_bytes` (+1 to see a file that grew)."""
    path = check_input_file(path, what=what, max_bytes=max_bytes, option=option)
    with open(path, "rb") as f:
        raw = f.read(max_bytes + 1)
    if len(raw) > max_bytes:
        raise InputError(f"{option}{path}: a {what} may be at most {max_bytes / 2**20:.0f} MiB")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(f"{option}{path}: not UTF-8 text ({exc.reason} at byte {exc.start}); "
                         f"expected a {what}") from None


def check_yaml_limits(text: str, source: str, *, fast: bool = False) -> None:
    """Refuse a YAML document with too many aliases, too deep nesting, or that expands (aliases
    counted at their full size) to more than MAX_YAML_VALUES values, from its events alone."""
    sizes: list[int] = [0]                  # values so far in each open collection
    anchors: list[str | None] = [None]
    anchored: dict[str, int] = {}           # anchor -> values it expands to
    aliases = 0
    try:
        for event in yaml.parse(text, Loader=_CParser if fast else yaml.SafeLoader):
            if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
                if len(sizes) > MAX_NESTING:
                    raise InputError(f"{source}: nested more than {MAX_NESTING} levels deep at line "
                                     f"{event.start_mark.line + 1}")
                sizes.append(1)
                anchors.append(event.anchor)
            elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
                size, anchor = sizes.pop(), anchors.pop()
                if anchor is not None:
                    anchored[anchor] = size
                sizes[-1] += size
            elif isinstance(event, yaml.ScalarEvent):
                sizes[-1] += 1
                if event.anchor is not None:
                    anchored[event.anchor] = 1
            elif isinstance(event, yaml.AliasEvent):
                aliases += 1
                if aliases > MAX_YAML_ALIASES:
                    raise InputError(f"{source}: more than {MAX_YAML_ALIASES} YAML aliases (*name) at line "
                                     f"{event.start_mark.line + 1}; expected a plain document")
                sizes[-1] += anchored.get(event.anchor, 1)
            else:
                continue
            if sum(sizes) > MAX_YAML_VALUES:
                raise InputError(f"{source}: expands to more than {MAX_YAML_VALUES:,} values (YAML aliases "
                                 f"repeat their anchor's content) at line {event.start_mark.line + 1}")
    except RecursionError:
        raise InputError(f"{source}: nested too deeply") from None


class _NoDuplicateKeys:
    """Refuses a key given twice in one mapping (YAML would keep the last silently)."""

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            if isinstance(key_node, yaml.ScalarNode):
                key = (key_node.tag, key_node.value)
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"duplicate key {key_node.value!r} (first at line {seen[key]})",
                        key_node.start_mark)
                seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


class _StrictLoader(_NoDuplicateKeys, yaml.SafeLoader):
    pass


class _FastStrictLoader(_NoDuplicateKeys, _CParser):
    pass


def safe_yaml_load(text: str, source: str, *, fast: bool = False) -> Any:
    """Parse YAML text from `source` (a file name or option, for messages) with the limits above.
    yaml.YAMLError passes through for callers' own messages; InputError for a limit. `fast`: libyaml's
    C parser (large files; its error messages differ from the pure-Python parser's)."""
    check_yaml_limits(text, source, fast=fast)
    return yaml.load(text, Loader=_FastStrictLoader if fast else _StrictLoader)


def load_yaml_file(path: str | os.PathLike, *, what: str = "YAML file", option: str = "",
                   max_bytes: int = MAX_YAML_BYTES) -> Any:
    """A checked file's YAML (see check_input_file, safe_yaml_load)."""
    return safe_yaml_load(read_input_text(path, what=what, max_bytes=max_bytes, option=option),
                          f"{option}{path}")


def safe_json_loads(text: str | bytes, source: str) -> Any:
    """json.loads, refusing input nested more than MAX_NESTING levels with InputError naming `source`;
    json.JSONDecodeError passes through."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise InputError(f"{source}: JSON nested too deeply (at most {MAX_NESTING} levels)") from None
    if _json_depth(value) > MAX_NESTING:
        raise InputError(f"{source}: JSON nested more than {MAX_NESTING} levels deep")
    return value


def _json_depth(value: Any) -> int:
    depth, level = 0, [value]
    while level:
        depth += 1
        if depth > MAX_NESTING:
            return depth
        nxt = []
        for v in level:
            if isinstance(v, dict):
                nxt.extend(v.values())
            elif isinstance(v, list):
                nxt.extend(v)
        level = nxt
    return depth - 1 if depth else 0


# ---- host memory: what a reader or a run may still allocate ----------------------------------------
# bytes of memory per byte of file a whole-file reader needs while parsing (Python objects per cell or
# value: a 3-character number becomes a 28-byte int or 50-byte str and its pointer; pandas' copies)
READ_EXPANSION = {"text": 12, "json": 12, "parquet": 6}


def host_memory_room() -> tuple[int, str]:
    """(bytes this process can still allocate, where the figure comes from): the smallest of the system's
    available memory, the room left under a cgroup (container) limit and the room left under the
    process's address-space limit (ulimit -v)."""
    available = _meminfo_available()
    if available is not None:       # Linux: the kernel's MemAvailable, the figure psutil reports there
        figures = [(available, "available system memory")]      # (without psutil's import, ~10 ms a run)
    else:
        try:
            import psutil
            figures = [(int(psutil.virtual_memory().available), "available system memory")]
        except ImportError:
            figures = [(2**62, "unknown system memory")]          # unknown: do not refuse
    for room in (_cgroup_room(), _address_space_room()):
        if room is not None:
            figures.append(room)
    return min(figures)


def _meminfo_available() -> int | None:
    """MemAvailable of /proc/meminfo in bytes; None where there is none (not Linux, a kernel before 3.14)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_room() -> tuple[int, str] | None:
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        with open("/sys/fs/cgroup/memory.current") as f:
            used = int(f.read())
    except (OSError, ValueError):
        return None
    return None if limit == "max" else (max(int(limit) - used, 0), "room under the cgroup memory limit")


def _address_space_room() -> tuple[int, str] | None:
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY:
        return None
    try:
        with open("/proc/self/status") as f:
            size = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    except (OSError, StopIteration, ValueError):
        return None
    return max(soft - size, 0), "room under the address-space limit (ulimit -v)"


def check_read_memory(path: str | os.PathLike, kind: str, *, what: str = "trace file", option: str = "") -> None:
    """Refuse, before parsing, a file that a whole-file reader of `kind` (READ_EXPANSION) could not hold in
    the memory left; its size is what it holds on disk (a sparse file counts at its full length)."""
    size = os.stat(path).st_size
    need = size * READ_EXPANSION[kind]
    room, source = host_memory_room()
    if need > room:
        raise InputError(f"{option}{path}: a {what} of {size / 2**30:.2f} GiB needs about {need / 2**30:.1f} GiB "
                         f"of memory to read whole, but {room / 2**30:.1f} GiB is available ({source}); expected a "
                         "smaller file (split it, or cut it on a larger machine)")


def short_repr(value: Any, limit: int = 120) -> str:
    """repr of a user value for an error message, cut to `limit` characters; a container of more than
    a few dozen items is described, not printed (a shared-alias structure would repr to gigabytes)."""
    if isinstance(value, (dict, list, tuple, set)) and not _small(value, 50):
        return f"a {type(value).__name__} of {len(value)} item(s)"
    if isinstance(value, str) and len(value) > limit:
        value = value[:limit]
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _small(value: Any, budget: int) -> bool:
    """Whether `value` holds at most `budget` items in all (containers walked, stopping early)."""
    stack = [value]
    while stack:
        v = stack.pop()
        budget -= 1
        if budget < 0:
            return False
        if isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, (list, tuple, set)):
            stack.extend(v)
        elif isinstance(v, str) and len(v) > 1000:
            return False
    return True


KVSIM_TMP = ".kvsim-tmp-"        # `.NAME.kvsim-tmp-PID-...`: a file or directory being written beside NAME
_LEFTOVER_AGE_S = 10.0          # an unlocked one younger than this may be a live writer's not yet locked


def hold_while_writing(path: Path) -> int:
    """An open descriptor holding a shared flock on `path` (a temporary file or staging directory) while
    its writer lives: the kernel drops it when the process ends, however it ends (kill -9 too), so
    `remove_dead_leftovers` can tell a dead writer's leftovers from a live one's (a PID cannot: the dead
    writer's PID may belong to another process by then, or to one in another PID namespace)."""
    fd = os.open(path, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_SH)
    return fd


def remove_dead_leftovers(path: Path) -> None:
    """Remove the `.NAME.kvsim-tmp-*` files and directories beside `path` that no live kvsim holds (a run
    killed with kill -9, or a power cut, leaves them); a leftover is removed by the next run writing NAME."""
    import time

    now = time.time()
    for p in path.parent.glob(f".{glob_escape(path.name)}{KVSIM_TMP}*"):
        try:
            fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            continue                        # a live writer holds it
        finally:
            os.close(fd)
        try:
            if now - os.lstat(p).st_mtime < _LEFTOVER_AGE_S and (pid := _pid_of(p, path.name)) > 0 and pid_alive(pid):
                continue                    # just made, perhaps not yet locked
            if p.is_dir() and not p.is_symlink():
                import shutil
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)
        except OSError:
            continue


def glob_escape(name: str) -> str:
    import glob
    return glob.escape(name)


def _pid_of(leftover: Path, name: str) -> int:
    head = leftover.name[len(f".{name}{KVSIM_TMP}"):].split("-")[0]
    return int(head) if head.isdigit() else -1


def pid_alive(pid: int) -> bool:
    """Whether a process `pid` exists (one of another user counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextmanager
def atomic_output(path: str | os.PathLike) -> Iterator[Path]:
    """A temporary path beside `path` to write; renamed onto `path` when the block ends without error,
    removed otherwise, so a reader never sees a half-written file (a full disk leaves the previous file
    or none). A full disk is re-raised as OSError whose message says so and names `path`. The
    temporary file is `.NAME.kvsim-tmp-PID-N`, locked while this process lives; a killed writer's is
    removed by the next write of NAME."""
    path = Path(path)
    remove_dead_leftovers(path)
    tmp = path.with_name(f".{path.name}{KVSIM_TMP}{os.getpid()}-{next(_counter)}")
    held = None
    try:
        with open(tmp, "wb"):
            pass
        held = hold_while_writing(tmp)
        yield tmp
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise OSError(exc.errno, f"{path}: disk full ({exc.strerror}); nothing was written") from None
        raise
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    finally:
        if held is not None:
            os.close(held)


_counter = itertools.count()


def check_output_file(path: str | os.PathLike, option: str = "--out", what: str = "file", *,
                      overwrite: bool = True, written_by_kvsim: Callable[[Path], bool] | None = None) -> Path:
    """A file a command is about to write: not a directory, not an existing named pipe, device or socket
    (writing would hang or go nowhere), not in a system directory, and its folder writable (created if
    missing). With `overwrite=False`, an existing file is replaced only when `written_by_kvsim(path)` says
    kvsim wrote it (an earlier run's output); a user's own file is refused. InputError naming `option`
    otherwise; checked before the work that makes the file (then written with atomic_output)."""
    path = Path(path)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        st = None
    except OSError as exc:
        raise InputError(f"{option} {path}: cannot be written ({exc.strerror}); expected a {what} to write") from None
    if st is not None and stat.S_ISDIR(st.st_mode):
        raise InputError(f"{option} {path}: is a directory; expected the {what} to write, e.g. {path / 'out.yaml'}")
    if st is not None and not stat.S_ISREG(st.st_mode):
        raise InputError(f"{option} {path}: is {file_kind(st.st_mode)}; expected a regular {what} to write")
    if st is not None and not overwrite and not (written_by_kvsim is not None and _safely(written_by_kvsim, path)):
        raise InputError(f"{option} {path}: exists and kvsim did not write it; expected a new file name, or "
                         "--overwrite to replace it")
    folder = Path(os.path.realpath(path.absolute().parent))
    if any(folder == Path(t) or Path(t) in folder.parents for t in SYSTEM_TREES):
        raise InputError(f"{option} {path}: is in a system directory ({folder}); expected a {what} of your own")
    existing = folder
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise InputError(f"{option} {path}: {existing} is not a writable directory; expected a {what} in one")
    return path


def _safely(test: Callable[[Path], bool], path: Path) -> bool:
    try:
        return bool(test(path))
    except Exception:  # noqa: BLE001 - a file that cannot be read as kvsim's output is not kvsim's
        return False


def file_starts_with(path: Path, marker: bytes, within: int = 4096) -> bool:
    """Whether `marker` is in the first `within` bytes of `path` (how kvsim's text outputs say they are
    kvsim's: a report's generator tag, a native trace's metadata line)."""
    with open(path, "rb") as f:
        return marker in f.read(within)


def write_error(exc: OSError, path: str | os.PathLike, option: str = "--out") -> tuple[str, int]:
    """(one-line message, exit status) for an OSError writing `path`: a full disk says so (status 1, as a
    run's results), anything else names the file and the reason (status 2)."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        reason = exc.strerror if str(path) in str(exc.strerror) else f"{path}: disk full ({exc.strerror})"
        return f"{option} {reason}", 1
    return f"{option} {path}: cannot be written ({exc.strerror or exc})", 2


@contextmanager
def deferred_interrupts() -> Iterator[None]:
    """Ctrl-C and SIGTERM arriving inside the block take effect when it ends, so the block (a table's
    flush) is done whole or not at all; the previous handlers then run as they would have. Only the
    main thread can set handlers: elsewhere (a dashboard job) the block runs as is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[tuple[int, Any]] = []
    previous = {}
    try:
        for signum in (signal.SIGINT, signal.SIGTERM):
            previous[signum] = signal.signal(signum, lambda n, frame: received.append((n, frame)))
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        if received:
            signum, frame = received[0]
            handler = previous[signum]
            if callable(handler):
                handler(signum, frame)
            elif handler == signal.SIG_DFL:
                signal.raise_signal(signum)


def json_safe(summary: dict, reasons_key: str = "null_reasons") -> dict:
    """`summary` with every non-finite float (top-level or in nested dicts/lists) as null, and under
    `reasons_key` why, per dotted key: JSON has no NaN or Infinity (json.dumps would write invalid JSON)."""
    reasons: dict[str, str] = {}

    def clean(value: Any, key: str) -> Any:
        if isinstance(value, float) and value != value:
            reasons[key] = "not a number: nothing to measure (e.g. no request finished, or none had this event)"
            return None
        if isinstance(value, float) and value in (float("inf"), float("-inf")):
            reasons[key] = f"{'' if value > 0 else 'minus '}infinity: a division by zero (e.g. a zero-length window)"
            return None
        if isinstance(value, dict):
            return {k: clean(v, f"{key}.{k}" if key else str(k)) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [clean(v, f"{key}[{i}]") for i, v in enumerate(value)]
        if hasattr(value, "item") and not isinstance(value, (str, bytes)):      # numpy scalars
            return clean(value.item(), key)
        return value

    out = clean(dict(summary), "")
    if reasons:
        out[reasons_key] = reasons
    return out


def dumps_json(data: Any, **kwargs) -> str:
    """json.dumps of json_safe(data) (mappings) that can never write NaN (allow_nan=False)."""
    if isinstance(data, dict):
        data = json_safe(data)
    return json.dumps(data, allow_nan=False, **kwargs)


def restore_nan(summary: Any, reasons_key: str = "null_reasons") -> Any:
    """A summary read back from JSON with the nulls json_safe wrote (top-level keys) as NaN again, as
    the code that made it had them."""
    if isinstance(summary, dict) and isinstance(summary.get(reasons_key), dict):
        for key in summary[reasons_key]:
            if key in summary and summary[key] is None:
                summary[key] = float("nan")
    return summary
