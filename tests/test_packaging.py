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
                          "print(sorted(m for m in sys.modules if m.split('.')[0] in %r))" % (TOP_LEVEL,)],
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
            "from kvsim.sim.simulate import run_simulation\n"
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


OPTIONAL = ("torch", "triton", "streamlit", "dask", "distributed", "numba", "gguf")


def test_core_dependencies_leave_out_the_heavy_ones_and_use_ranges():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = {re.split(r"[<>=!~\[ ;]", d, maxsplit=1)[0].lower() for d in project["dependencies"]}
    assert not names & set(OPTIONAL)
    assert not [d for d in project["dependencies"] if "==" in d]          # ranges; constraints.txt pins CI
    extras = project["optional-dependencies"]
    everything = {re.split(r"[<>=!~\[ ;]", d, maxsplit=1)[0].lower()
                  for extra in ("backend", "dashboard", "distributed", "fast") for d in extras[extra]}
    assert set(OPTIONAL) <= everything and extras["all"] == ["kvsim[backend,dashboard,distributed,fast]"]
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
