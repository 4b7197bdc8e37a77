"""bench/trace_config_flow.py's definitions of a stop and a climb, on a call tree written for it, and
on a real simulation (the configuration reaches the run plan and the engine's first step)."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("trace_config_flow", ROOT / "bench" / "trace_config_flow.py")
flow = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = flow
spec.loader.exec_module(flow)

PROBE = '''
class Cfg:
    pass

def run(cfg):
    helper()              # no configuration: not a stop
    a(cfg)                # depth 2
    b(cfg)                # after deep, a1 and a returned: a climb
    c(cfg)                # sibling of b: not a climb
    step()

def helper():
    return 1

def a(cfg):
    a1(cfg)               # descent

def a1(cfg):
    deep(cfg)

def deep(cfg):
    return 0

def b(cfg):
    return 0

def c(cfg, *rest, **named):
    d(*rest, **named)

def d(*rest, **named):
    if "plan" in named:
        gen = g(named["plan"])
        next(gen)
        next(gen, None)   # a resumed generator is not a new call

def g(plan):
    yield 1
    yield 2

def step():
    return 0
'''


def traced_probe(name: str, stop: str, call) -> flow.Tracer:
    """The Tracer of `call(module)` on a fresh module `name` made from PROBE, stopping at `stop`."""
    module = type(sys)(name)
    exec(compile(PROBE, "probe.py", "exec"), module.__dict__)
    tracer = flow.Tracer((module.Cfg,), (name, stop))
    sys.setprofile(tracer)
    try:
        call(module)
    finally:
        sys.setprofile(None)
    return tracer


def run_then_call_c(module) -> None:
    module.run(module.Cfg())
    module.c(module.Cfg(), plan=module.Cfg())      # after `step`: not traced


def test_stops_and_climbs_follow_their_definitions():
    tracer = traced_probe("kvsim._flow_probe", "step", run_then_call_c)
    assert tracer.done
    got = [(s.function, s.depth, s.climb) for s in tracer.stops]
    assert got == [("run", 1, 0), ("a", 2, 0), ("a1", 3, 0), ("deep", 4, 0),
                   ("b", 2, 2),          # deep (4) and a1 (3) and a (2) returned: run at depth 1 < 4 - 1
                   ("c", 2, 0)]          # b returned to run (depth 1 = 2 - 1): a sibling
    assert [s.args for s in tracer.stops][-1] == ["cfg: Cfg"]


def test_varargs_and_generators():
    tracer = traced_probe("kvsim._flow_probe2", "never",
                          lambda module: module.c(module.Cfg(), module.Cfg(), plan=module.Cfg()))
    assert [(s.function, s.args) for s in tracer.stops] == [
        ("c", ["cfg: Cfg", "rest: Cfg", "named: Cfg"]), ("d", ["rest: Cfg", "named: Cfg"]), ("g", ["plan: Cfg"])]


def test_a_simulation_is_followed_to_its_first_engine_step(tmp_path):
    argv = ["simulate", "--trace", "azure-conv-2023", "--model", "llama-3.1-8b", "--gpu", "h100",
            "--max-requests", "20", "-q", "--out", str(tmp_path / "run")]
    tracer = flow.trace(argv)
    names = [s.function for s in tracer.stops]
    assert "resolve_run" in names and names[-1] == "Scheduler.__init__"
    assert names.count("resolve_engine") == 1            # engine defaults resolved once
    assert len(tracer.stops) <= 20, [f"{s.module}:{s.function}" for s in tracer.stops]   # issue 43's bound
    assert all(s.depth >= 1 for s in tracer.stops) and tracer.depth >= 1
