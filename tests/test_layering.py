"""The package layers import one way; each folder of sim/, gpu/, traces/ and dashboard/ belongs to one layer.

Layers, lowest first (a module may import its own layer and the layers below it):

- data: the inputs of a run and the files it reads and writes — kvsim.traces (loaders, synthetic
  generators, stats) and kvsim.sim.io (safe reads and writes, result directories, YAML errors,
  progress). No engine logic.
- core: the engine core both executors share — kvsim.sim.core (request, block pool, KV manager,
  scheduler, step shape, the KVManager/Executor protocols, the KV connector interface), kvsim.sim.kv
  (eviction-aware managers, policies, importance, fast mode, LeanKV precision groups), the model of
  the hardware in kvsim.sim.model (catalog, cost model, memory sizing, engine defaults) and the run
  config schema kvsim.sim.config (it validates policy and slot-strategy names against the core's
  registries).
- engine: the engine loop both executors drive and its bulk steps (kvsim.sim.engine: loop, run plan,
  assembly, engine/bulk), and what a run measures and writes (kvsim.sim.results).
- cluster: pools of replicas, the router, links and routes (kvsim.sim.cluster); it drives engines.
- executors, two of them that must not import each other: the simulator (kvsim.sim.simulator) and
  the real backend (kvsim.gpu, torch/Triton).
- analysis: tools that run and compare executors — kvsim.sim.planning (sweeps, capacity, the fleet
  planner, reports), kvsim.sim.calibration, kvsim.sim.crosscheck, the vLLM reference harness
  kvsim.sim.reference.
- interfaces: every CLI (the kvsim.sim.cli package, or any module whose name ends in `cli`), the
  console script that runs it (kvsim.sim.entry), the dashboard and `kvsim serve`'s HTTP server
  (kvsim.sim.serve: it drives the simulator's engine on the wall clock).

Rules name folders (a folder's rule places every module under it, so a new module of a folder needs
no rule) and the few modules at the top of sim/. A package's __init__ belongs to the layer of its
contents (a submodule's import runs it). Imports are read with ast, module level and inside functions
alike (a lazy import still couples the two modules); only `if TYPE_CHECKING:` blocks are left out
(they never run). The test fails on an import of a higher layer, on simulator <-> backend imports, on
any import cycle between modules, on a module no rule places (give its folder a layer here), and on
a folder of sim/ with more than MAX_MODULES_PER_FOLDER modules at its top (split it by what it holds).
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("sim", "gpu", "traces", "dashboard")
RANK = {"data": 0, "core": 1, "engine": 2, "cluster": 3, "simulator": 4, "backend": 4, "analysis": 5,
        "interface": 6}
MAX_MODULES_PER_FOLDER = 12

# folder (package) -> layer: the rule of the deepest folder that holds a module places it
FOLDER_RULES = {
    "kvsim.traces": "data",
    "kvsim.sim.io": "data",
    "kvsim.sim.core": "core",
    "kvsim.sim.kv": "core",
    "kvsim.sim.model": "core",
    "kvsim.sim.engine": "engine",
    "kvsim.sim.results": "engine",
    "kvsim.sim.cluster": "cluster",
    "kvsim.sim.simulator": "simulator",
    "kvsim.gpu": "backend",
    "kvsim.sim.planning": "analysis",
    "kvsim.sim.calibration": "analysis",
    "kvsim.sim.crosscheck": "analysis",
    "kvsim.sim.reference": "analysis",
    "kvsim.sim.cli": "interface",
    "kvsim.sim.serve": "interface",      # kvsim serve: the HTTP server around the simulator's engine
    "kvsim.dashboard": "interface",
}
# the modules at the top of sim/ (exact names: a new top-level module gets no layer until it has a rule)
MODULE_RULES = {
    "kvsim.sim": "data",             # the package's own (empty) __init__: below everything in it
    "kvsim.sim.config": "core",      # the run config schema
    "kvsim.sim.entry": "interface",  # the console script around the CLI
}


def module_files() -> dict[str, Path]:
    """kvsim module name -> file, for every .py file of the packaged folders."""
    out = {}
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(("kvsim",) + parts)] = path
    return out


def is_interface(name: str) -> bool:
    parts = name.split(".")
    return "cli" in parts or parts[-1].endswith("cli")


def layer_of(name: str) -> str | None:
    if is_interface(name):
        return "interface"
    if name in MODULE_RULES:
        return MODULE_RULES[name]
    folder = name
    while folder:
        if folder in FOLDER_RULES:
            return FOLDER_RULES[folder]
        folder = folder.rpartition(".")[0]
    return None


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


class _Imports(ast.NodeVisitor):
    """(module, names) of every import statement that can run (not under `if TYPE_CHECKING:`)."""

    def __init__(self):
        self.found: list[tuple[int, str, list[str]]] = []     # (level, module, imported names)

    def visit_If(self, node: ast.If) -> None:
        if _is_type_checking(node.test):
            for child in node.orelse:
                self.visit(child)
        else:
            self.generic_visit(node)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self.found.append((0, alias.name, []))

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        self.found.append((node.level, node.module or "", [a.name for a in node.names]))


def imported_modules(name: str, path: Path, known: set[str]) -> set[str]:
    """The kvsim modules `name` (at `path`) imports: `from pkg import sub` counts sub when it is a module."""
    visitor = _Imports()
    visitor.visit(ast.parse(path.read_text(), filename=str(path)))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for level, module, names in visitor.found:
        if level:
            base = package.split(".")
            base = base[:len(base) - (level - 1)]
            module = ".".join(base + ([module] if module else []))
        if not module.startswith("kvsim"):
            continue
        subs = {f"{module}.{n}" for n in names} & known
        out |= subs or ({module} & known)
    out.discard(name)
    return out


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    files = module_files()
    known = set(files)
    return {name: imported_modules(name, path, known) for name, path in files.items()}


def test_every_module_has_a_layer(graph):
    unplaced = sorted(m for m in graph if layer_of(m) is None)
    assert not unplaced, f"modules no layer rule places (add a rule in tests/test_layering.py): {unplaced}"


def test_no_module_imports_a_higher_layer(graph):
    bad = [f"{src} ({layer_of(src)}) imports {dst} ({layer_of(dst)})"
           for src, targets in sorted(graph.items()) for dst in sorted(targets)
           if layer_of(src) and layer_of(dst) and RANK[layer_of(dst)] > RANK[layer_of(src)]]
    assert not bad, "imports against the layering:\n" + "\n".join(bad)


def test_simulator_and_backend_do_not_import_each_other(graph):
    executors = {"simulator", "backend"}
    bad = [f"{src} ({layer_of(src)}) imports {dst} ({layer_of(dst)})"
           for src, targets in sorted(graph.items()) for dst in sorted(targets)
           if {layer_of(src), layer_of(dst)} == executors]
    assert not bad, "the two executors import each other:\n" + "\n".join(bad)


def test_the_engine_core_reads_no_run_config(graph):
    # sim/core (scheduler, pools, KV managers, connector) takes typed settings: the run config and the
    # hardware model are resolved above it (sim/kv/build.py, the run plan)
    bad = [f"{src} imports {dst}" for src, targets in sorted(graph.items()) if src.startswith("kvsim.sim.core")
           for dst in sorted(targets) if dst == "kvsim.sim.config" or dst.startswith("kvsim.sim.model")]
    assert not bad, "the engine core imports the run config or the hardware model:\n" + "\n".join(bad)


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    cycles.append(sorted(component))
    return cycles


def test_no_import_cycles(graph):
    cycles = import_cycles(graph)
    assert not cycles, "modules that import each other (directly or through others):\n" + "\n".join(
        " <-> ".join(c) for c in cycles)


def test_cycle_finder_finds_a_cycle_and_ignores_a_chain():
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_imports_are_read_at_any_depth_except_type_checking_blocks(tmp_path):
    src = tmp_path / "mod.py"
    src.write_text("from typing import TYPE_CHECKING\nfrom . import a\nif TYPE_CHECKING:\n    from .b import X\n"
                   "def f():\n    from ..pkg2 import c\n    import kvsim.pkg.d\n")
    known = {"kvsim.pkg.a", "kvsim.pkg.b", "kvsim.pkg2.c", "kvsim.pkg.d"}
    assert imported_modules("kvsim.pkg.mod", src, known) == {"kvsim.pkg.a", "kvsim.pkg2.c", "kvsim.pkg.d"}


def test_layer_rules_place_split_packages_and_every_cli():
    assert layer_of("kvsim.sim.kv.fast.compiled.kernels") == "core"
    assert layer_of("kvsim.sim.calibration.fit") == "analysis"
    assert layer_of("kvsim.sim.crosscheck.compare") == "analysis"
    assert layer_of("kvsim.sim.cli.simulate") == "interface"
    assert layer_of("kvsim.gpu.replay_cli") == "interface"
    assert layer_of("kvsim.traces.cli") == "interface"
    assert layer_of("kvsim.gpu.kernels.paged_attention") == "backend"
    assert layer_of("kvsim.sim.simulator.simulate") == "simulator"
    assert layer_of("kvsim.sim.engine.bulk.decode_runs") == "engine"
    assert layer_of("kvsim.sim.core.connector") == "core"          # the KV connector interface
    assert layer_of("kvsim.sim.cluster.router") == "cluster"       # any module of the cluster layer
    assert layer_of("kvsim.sim.new_top_level_module") is None      # a top module of sim/ needs its own rule


def test_cluster_sits_between_engine_and_executors():
    assert RANK["core"] < RANK["engine"] < RANK["cluster"] < RANK["simulator"] == RANK["backend"]


def test_no_folder_of_sim_holds_too_many_modules():
    crowded = {}
    for folder in [ROOT / "sim", *(p.parent for p in (ROOT / "sim").rglob("__init__.py"))]:
        modules = [p.name for p in folder.glob("*.py") if p.name != "__init__.py"]
        if len(modules) > MAX_MODULES_PER_FOLDER:
            crowded[str(folder.relative_to(ROOT))] = len(modules)
    assert not crowded, f"folders with more than {MAX_MODULES_PER_FOLDER} modules at their top: {crowded}"


def test_pyproject_lists_every_package():
    text = (ROOT / "pyproject.toml").read_text()
    listed = set(re.findall(r'"(kvsim\.[\w.]+)"', text.split("packages = [", 1)[1].split("]", 1)[0]))
    packages = {name for name, path in module_files().items() if path.name == "__init__.py"}
    assert packages == listed, f"pyproject.toml packages: missing {sorted(packages - listed)}, " \
                               f"stale {sorted(listed - packages)}"
