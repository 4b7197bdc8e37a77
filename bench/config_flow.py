"""Where a run's configuration travels (issue 27's data-flow measure), and the largest files and functions.

Runs a kvsim command in-process under `sys.setprofile` and records every call of a kvsim function
that receives the run's configuration (a `SimConfig`, its `EngineConfig` / `KVConfig`, or the
resolved `RunPlan`) as an argument:

- stops: distinct functions reached by the configuration; modules: distinct modules among them;
- re-entries: in the order the stops are first reached, how often the flow comes back to a module
  it had already left (A -> B -> A counts one) — a module consulted again for what it could have
  resolved once;
- readers: distinct functions that read a field of the configuration objects themselves (SimConfig,
  EngineConfig, KVConfig; reads of the resolved RunPlan are not counted): where settings are looked
  up and interpreted;
- then the ten largest files of sim/ and gpu/ (lines) and the ten longest functions (lines).

    python bench/config_flow.py [-- kvsim arguments]   (default: the README's main command, 2,000 requests)
"""
from __future__ import annotations

import ast
import sys
import tempfile
from collections import Counter
from pathlib import Path

DEFAULT = ["simulate", "--trace", "azure-conv-2023", "--model", "llama-3.1-8b", "--gpu", "h100",
           "--max-requests", "2000", "-q", "--out", str(Path(tempfile.gettempdir()) / "kvsim-config-flow")]


def config_types() -> tuple[type, ...]:
    from kvsim.sim.config import EngineConfig, KVConfig, SimConfig
    try:
        from kvsim.sim.engine.run_plan import RunPlan
    except ImportError:            # a checkout from before the run plan (to measure the before)
        return SimConfig, EngineConfig, KVConfig
    return SimConfig, EngineConfig, KVConfig, RunPlan


def source_root() -> Path:
    """The checkout the installed kvsim runs from (its sim/ and gpu/ folders)."""
    import kvsim.sim
    return Path(kvsim.sim.__file__).resolve().parents[1]


def trace_stops(argv: list[str]) -> list[tuple[str, str]]:
    """(module, qualified function) of each config-receiving call, in first-reached order."""
    from kvsim.sim.cli import app
    types = config_types()
    seen: dict[tuple[str, str], None] = {}
    calls = Counter()

    def profile(frame, event, arg):
        if event != "call":
            return
        module = frame.f_globals.get("__name__", "")
        if not module.startswith("kvsim."):
            return
        code = frame.f_code
        names = code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]
        if any(isinstance(frame.f_locals.get(n), types) for n in names if n != "self"):
            seen.setdefault((module, code.co_qualname), None)
            calls[(module, code.co_qualname)] += 1

    sys.setprofile(profile)
    try:
        app(argv, standalone_mode=False)
    finally:
        sys.setprofile(None)
    repeated = {f"{m}.{f}": n for (m, f), n in calls.items() if n > 1}
    print("called more than once with the configuration:", repeated or "none")
    return list(seen)


def trace_readers(argv: list[str]) -> list[tuple[str, str]]:
    """(module, function) of each kvsim function that reads a configuration field, first-read order."""
    from kvsim.sim.cli import app
    readers: dict[tuple[str, str], None] = {}
    classes = config_types()[:3]
    originals = {}

    def recording(cls):
        fields = set(cls.model_fields)
        base = cls.__getattribute__

        def getattribute(obj, name):
            if name in fields:
                frame = sys._getframe(1)
                module = frame.f_globals.get("__name__", "")
                if module.startswith("kvsim.") and not module.startswith("kvsim.sim.config"):
                    readers.setdefault((module, frame.f_code.co_qualname), None)
            return base(obj, name)
        return getattribute

    for cls in classes:
        originals[cls] = cls.__dict__.get("__getattribute__")
        cls.__getattribute__ = recording(cls)
    try:
        app(argv, standalone_mode=False)
    finally:
        for cls, original in originals.items():
            if original is None:
                del cls.__getattribute__
            else:
                cls.__getattribute__ = original
    return list(readers)


def re_entries(modules: list[str]) -> int:
    left, count = set(), 0
    for prev, cur in zip(modules, modules[1:]):
        if cur != prev:
            if cur in left:
                count += 1
            left.add(prev)
    return count


def largest(folders=("sim", "gpu")) -> tuple[list[tuple[int, str]], list[tuple[int, str]]]:
    files, functions = [], []
    root = source_root()
    for folder in folders:
        for path in (root / folder).rglob("*.py"):
            text = path.read_text()
            rel = path.relative_to(root).as_posix()
            files.append((len(text.splitlines()), rel))
            for node in ast.walk(ast.parse(text)):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    functions.append((node.end_lineno - node.lineno + 1, f"{rel}:{node.name}"))
    return sorted(files, reverse=True)[:10], sorted(functions, reverse=True)[:10]


def main() -> None:
    argv = sys.argv[1:]
    argv = argv[1:] if argv[:1] == ["--"] else argv
    stops = trace_stops(argv or DEFAULT)
    modules = [m for m, _ in stops]
    print(f"kvsim {' '.join(argv or DEFAULT)}")
    print(f"configuration reaches {len(stops)} functions in {len(set(modules))} modules; "
          f"re-entries into a module already left: {re_entries(modules)}")
    for module, count in Counter(modules).most_common():
        print(f"  {count:3d}  {module}")
    readers = trace_readers(argv or DEFAULT)
    reader_modules = [m for m, _ in readers]
    print(f"configuration fields read by {len(readers)} functions in {len(set(reader_modules))} modules; "
          f"re-entries: {re_entries(reader_modules)}")
    for module, count in Counter(reader_modules).most_common():
        print(f"  {count:3d}  {module}")
    files, functions = largest()
    print("\nlargest files (lines):")
    for n, name in files:
        print(f"  {n:5d}  {name}")
    print("longest functions (lines):")
    for n, name in functions:
        print(f"  {n:5d}  {name}")


if __name__ == "__main__":
    main()
