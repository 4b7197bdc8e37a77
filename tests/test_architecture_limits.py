"""Two limits of the code's shape (issue 27), read with ast over sim/ and gpu/:

- no function takes more than 8 parameters (self/cls not counted), outside compiled kernels
  (`@triton.jit`, `@numba.njit`/`@njit`) and outside CLI commands (a typer command's parameters are
  its command-line options, declared in its signature);
- no class has more than two bases besides Protocol/Generic (composition over deep mixing).

Kernels compiled by assignment (`f = njit(...)(f)`, or a loop over names doing the same, as
sim/kv/fast/ does) count as compiled. The functions still over the limit are listed in
`KNOWN_LONG`, each with its count, and the classes still over the base limit in `KNOWN_WIDE`: the
tests fail when one grows, when a new one appears, and when one is fixed and still listed (so the
lists only shrink).
"""
from __future__ import annotations

import ast
import inspect
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("sim", "gpu")
EXCLUDED: tuple[str, ...] = ()
MAX_PARAMS = 8
MAX_BASES = 2
COMPILED = {"jit", "njit", "vectorize", "guvectorize"}       # triton.jit, numba.njit, ...
EXEMPT_BASES = {"Protocol", "Generic"}

# path:function -> parameters, still over the limit (to be cut; never to grow)
KNOWN_LONG: dict[str, int] = {}

# path:class -> bases besides Protocol/Generic, still over the limit
KNOWN_WIDE: dict[str, int] = {}


def _files():
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if not rel.startswith(EXCLUDED):
                yield rel, ast.parse(path.read_text(), filename=rel)


def _assigned_kernels(tree) -> set[str]:
    """Names a module compiles by assignment: `f = njit(...)(f)` or `for n in ("f", ...): globals()[n] = njit(...)(...)`."""
    def compiles(call) -> bool:
        return (isinstance(call, ast.Call) and isinstance(call.func, ast.Call)
                and _callee_name(call.func) in COMPILED)

    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and compiles(node.value) and node.value.args:
            arg = node.value.args[0]
            if isinstance(arg, ast.Name):
                out.add(arg.id)
        elif isinstance(node, ast.For) and isinstance(node.iter, (ast.Tuple, ast.List)) and any(
                isinstance(n, ast.Assign) and compiles(n.value) for n in ast.walk(node)):
            out |= {e.value for e in node.iter.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)}
    return out


def _callee_name(call) -> str:
    f = call.func
    return f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")


def _decorator_names(node) -> set[str]:
    names = set()
    for d in node.decorator_list:
        d = d.func if isinstance(d, ast.Call) else d
        names.add(d.attr if isinstance(d, ast.Attribute) else getattr(d, "id", ""))
    return names


def cli_commands() -> set[str]:
    """path:function of every command the `kvsim` CLI registers (its typer apps, read at runtime)."""
    from kvsim.sim.cli import full_app

    out, apps = set(), [full_app()]
    while apps:
        a = apps.pop()
        callbacks = [c.callback for c in a.registered_commands]
        if a.registered_callback is not None:
            callbacks.append(a.registered_callback.callback)
        apps.extend(g.typer_instance for g in a.registered_groups)
        for fn in filter(None, callbacks):
            fn = inspect.unwrap(fn)          # a command wrapped by the CLI (needs_extras) is its own function
            rel = Path(fn.__code__.co_filename).resolve().relative_to(ROOT).as_posix()
            out.add(f"{rel}:{fn.__qualname__}")
    return out


def _param_count(fn) -> int:
    a = fn.args
    positional = a.posonlyargs + a.args
    n = len(positional) + len(a.kwonlyargs) + (a.vararg is not None) + (a.kwarg is not None)
    return n - (1 if positional and positional[0].arg in ("self", "cls") else 0)


def _functions(tree):
    """(qualified name, node) of every function, methods named Class.method."""
    def walk(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield prefix + child.name, child
                yield from walk(child, prefix + child.name + ".")
            elif isinstance(child, ast.ClassDef):
                yield from walk(child, prefix + child.name + ".")
            else:
                yield from walk(child, prefix)
    yield from walk(tree, "")


def long_functions() -> dict[str, int]:
    out, commands = {}, cli_commands()
    for rel, tree in _files():
        kernels = _assigned_kernels(tree)
        for name, fn in _functions(tree):
            if _decorator_names(fn) & COMPILED or name in kernels or f"{rel}:{name}" in commands:
                continue
            n = _param_count(fn)
            if n > MAX_PARAMS:
                out[f"{rel}:{name}"] = n
    return out


def test_no_function_takes_more_than_eight_parameters():
    found = long_functions()
    new = {k: v for k, v in found.items() if k not in KNOWN_LONG}
    grown = {k: (KNOWN_LONG[k], v) for k, v in found.items() if k in KNOWN_LONG and v > KNOWN_LONG[k]}
    fixed = sorted(set(KNOWN_LONG) - set(found))
    assert not new, f"functions over {MAX_PARAMS} parameters (group them in a dataclass/NamedTuple): {new}"
    assert not grown, f"functions whose parameter lists grew (was, now): {grown}"
    assert not fixed, f"now within the limit: remove from KNOWN_LONG: {fixed}"


def test_no_class_has_more_than_two_bases_besides_protocols():
    wide = {}
    for rel, tree in _files():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                bases = [ast.unparse(b) for b in node.bases]
                kept = [b for b in bases if b.split("[")[0].split(".")[-1] not in EXEMPT_BASES]
                if len(kept) > MAX_BASES:
                    wide[f"{rel}:{node.name}"] = len(kept)
    new = {k: v for k, v in wide.items() if KNOWN_WIDE.get(k, MAX_BASES) < v}
    fixed = sorted(set(KNOWN_WIDE) - set(wide))
    assert not new, f"classes with more than {MAX_BASES} bases besides Protocol/Generic (or more than listed): {new}"
    assert not fixed, f"now within the limit: remove from KNOWN_WIDE: {fixed}"


def test_the_checks_see_what_they_check():
    """The scan reaches the engine and the backend, and recognises kernels and CLI commands."""
    names = {f"{rel}:{name}" for rel, tree in _files() for name, _ in _functions(tree)}
    assert "sim/engine/loop.py:EngineReplica.run" in names and "gpu/replay.py:run_replay" in names
    assert "sim/kv/fast/manager.py:FastKVManager.__init__" in names
    kernels = _assigned_kernels(ast.parse((ROOT / "sim/kv/fast/sampled/leankv_kernel.py").read_text()))
    assert {"leankv_step", "_attend_rows", "page_counts"} <= kernels
    assert {"sim/cli/simulate.py:simulate", "sim/cli/replay.py:replay"} <= cli_commands() <= names
    tree = ast.parse("@triton.jit\ndef k(a, b, c, d, e, f, g, h, i): pass\n"
                     "class A:\n    def f(self, a, b, c, d, e, f, g, h): pass\n"
                     "    def g(self, a, b, c, d, e, f, g, h, i): pass\n")
    kinds = [(name, _decorator_names(fn) & COMPILED, _param_count(fn)) for name, fn in _functions(tree)]
    assert kinds == [("k", {"jit"}, 9), ("A.f", set(), 8), ("A.g", set(), 9)]
