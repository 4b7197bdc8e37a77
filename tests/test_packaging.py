"""kvsim installs under one import name (`kvsim.*`) and also runs from an uninstalled checkout."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")      # Python 3.11+

ROOT = Path(__file__).resolve().parents[1]
TOP_LEVEL = ("sim", "gpu", "traces", "dashboard")


def test_every_package_folder_is_installed_under_kvsim():
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert setuptools["package-dir"] == {f"kvsim.{name}": name for name in TOP_LEVEL}
    folders = {"kvsim." + str(init.parent.relative_to(ROOT)).replace("/", ".")
               for name in TOP_LEVEL for init in (ROOT / name).rglob("__init__.py")}
    assert set(setuptools["packages"]) == folders


def test_no_generic_top_level_import_names():
    # `traces` is also an unrelated PyPI package: nothing may import the folders by their bare names
    import kvsim.sim.cli
    assert kvsim.sim.cli.__name__ == "kvsim.sim.cli"
    out = subprocess.run([sys.executable, "-c", "import kvsim.sim.cli, sys; "
                          f"print(sorted(m for m in sys.modules if m.split('.')[0] in {TOP_LEVEL!r}))"],
                         capture_output=True, text=True, check=True, cwd="/")
    assert out.stdout.strip() == "[]", out.stdout


def test_an_uninstalled_checkout_runs_as_python_m_sim_cli(tmp_path):
    # as on a GPU machine where nothing can be installed: hide the installed kvsim, import from the checkout
    code = ("import sys\n"
            "sys.meta_path = [f for f in sys.meta_path if 'editable' not in getattr(f, '__module__', '')]\n"
            "sys.path_hooks = [h for h in sys.path_hooks if 'editable' not in str(getattr(h, '__module__', h))]\n"
            "sys.path_importer_cache.clear()\n"
            "for name in [m for m in sys.modules if m.split('.')[0] == 'kvsim']: del sys.modules[name]\n"
            "try:\n    import kvsim.sim\n    sys.exit('kvsim is still importable without the checkout alias')\n"
            "except ImportError:\n    pass\n"
            "import sim\n"
            "from kvsim.sim.config import load_config\n"
            "from kvsim.sim.simulator.simulate import run_simulation\n"
            "cfg = load_config(None, {'trace': 'azure-conv-2023', 'trace_options.max_requests': 5})\n"
            "print(run_simulation(cfg).summary['num_finished'], sys.modules['kvsim.sim.config'].__file__)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    finished, path = out.stdout.split()
    assert finished == "5" and Path(path) == ROOT / "sim" / "config.py"


def test_every_module_says_what_it_is_for():
    import ast
    missing = [str(path.relative_to(ROOT)) for name in TOP_LEVEL for path in sorted((ROOT / name).rglob("*.py"))
               if not ast.get_docstring(ast.parse(path.read_text()))]
    assert missing == []


OPTIONAL = ("torch", "triton", "streamlit", "dask", "distributed", "numba", "gguf", "prometheus_client", "msgspec")


def test_core_dependencies_leave_out_the_heavy_ones_and_use_ranges():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = {re.split(r"[<>=!~\[ ;]", d, maxsplit=1)[0].lower() for d in project["dependencies"]}
    assert not names & set(OPTIONAL)
    assert not [d for d in project["dependencies"] if "==" in d]          # ranges; constraints.txt pins CI
    extras = project["optional-dependencies"]
    everything = {re.split(r"[<>=!~\[ ;]", d, maxsplit=1)[0].lower()
                  for extra in ("backend", "dashboard", "distributed", "fast", "serve") for d in extras[extra]}
    assert set(OPTIONAL) <= everything and extras["all"] == ["kvsim[backend,dashboard,distributed,fast,serve]"]
    pins = {line.split("==")[0] for line in (ROOT / "constraints.txt").read_text().splitlines()
            if line and not line.startswith("#")}
    assert names | everything <= pins


def test_the_core_runs_simulate_without_the_optional_packages(tmp_path):
    """As in a fresh virtualenv holding only the core: importing any optional package fails, and
    `kvsim simulate` (a vLLM bench-style closed loop on a catalog model) still runs."""
    blocker = ("import sys, importlib.abc\n"
               "class Block(importlib.abc.MetaPathFinder):\n"
               "    def find_spec(self, name, path=None, target=None):\n"
               f"        if name.split('.')[0] in {OPTIONAL!r}:\n"
               "            raise ImportError(f'{name} is not installed (core only)')\n"
               "sys.meta_path.insert(0, Block())\n"
               "from kvsim.sim.cli import app\n"
               "app(['simulate', '--trace', 'sharegpt-8k-filtered', '--max-requests', '20', '--model', "
               "'qwen3-0.6b', '--gpu', 'l4', '--max-concurrency', '4', '-q', '-o', sys.argv[1]])\n")
    out = subprocess.run([sys.executable, "-c", blocker, str(tmp_path / "run")], capture_output=True, text=True,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert (tmp_path / "run" / "summary.json").exists()


def _closure(requirements: list[str]) -> dict[str, object]:
    """The installed distributions `requirements` need, transitively (environment markers evaluated,
    extras left out): name -> importlib.metadata Distribution."""
    from importlib import metadata

    from packaging.requirements import Requirement
    found, todo = {}, [Requirement(r) for r in requirements]
    while todo:
        req = todo.pop()
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        key = re.sub(r"[-_.]+", "-", req.name).lower()
        if key in found:
            continue
        found[key] = dist = metadata.distribution(req.name)
        todo.extend(Requirement(r) for r in dist.requires or ())
    return found


def _link_distributions(dists, target: Path) -> None:
    """A site directory holding exactly `dists`: a link to each top-level file or folder they installed
    (their packages and .dist-info, so pip sees them as installed)."""
    target.mkdir()
    for dist in dists:
        for top in {Path(str(f)).parts[0] for f in dist.files or () if not str(f).startswith("..")}:
            link, source = target / top, Path(dist.locate_file(top))
            if source.exists() and not link.exists():
                link.symlink_to(source)


def test_a_fresh_virtualenv_with_only_the_core_dependencies_runs_simulate(tmp_path):
    """A virtualenv without the system's site packages, holding only pyproject's core dependencies (and what
    they require, per their metadata) and kvsim installed with `pip install --no-deps -e .`: `kvsim simulate`
    runs, torch and the other optional packages cannot be imported there, and `pip check` finds every
    requirement met. Offline: the dependencies are the machine's installed ones, linked into the venv's
    site directory (a pip download would need the network)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = _closure(project["dependencies"])
    assert not set(core) & set(OPTIONAL), "a core dependency pulls in an optional package"
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    _link_distributions(core.values(), tmp_path / "core")
    build = _closure(["pip", "setuptools>=68"])          # to install kvsim itself (kvsim does not import them)
    _link_distributions(build.values(), tmp_path / "build")
    Path(purelib, "core.pth").write_text(f"{tmp_path / 'core'}\n{tmp_path / 'build'}\n")
    env = {"PATH": f"{venv / 'bin'}:/usr/bin:/bin", "HOME": str(tmp_path), "PIP_NO_INDEX": "1",
           "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    install = subprocess.run([str(python), "-m", "pip", "install", "--no-deps", "--no-build-isolation", "-e",
                              str(ROOT)], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert install.returncode == 0, install.stdout[-2000:] + install.stderr[-2000:]
    check = subprocess.run([str(python), "-m", "pip", "check"], capture_output=True, text=True, env=env)
    assert check.returncode == 0, check.stdout
    probe = ("import importlib.util, sys\n"
             f"print(sorted(m for m in {OPTIONAL!r} if importlib.util.find_spec(m)), sys.prefix)")
    found, prefix = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, env=env,
                                   check=True).stdout.rsplit(" ", 1)
    assert found == "[]" and Path(prefix.strip()) == venv
    run = subprocess.run([str(venv / "bin" / "kvsim"), "simulate", "--trace", "sharegpt-8k-filtered",
                          "--max-requests", "20", "--model", "qwen3-0.6b", "--gpu", "l4", "--max-concurrency", "4",
                          "-q", "-o", str(tmp_path / "run")], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-2000:]
    assert (tmp_path / "run" / "summary.json").exists()
