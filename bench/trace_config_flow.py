"""Follow one simulation's configuration from the CLI to the engine's first step: stops and climbs.

Runs a kvsim command in-process (default: the main command on a 200-request slice of its trace)
under `sys.setprofile`, from the CLI entry (the typer app's call) to the first call of the engine's
step (`Scheduler.schedule`), and measures the path a reader follows when tracing the run's
configuration through the code (issue 27's data-flow figure).

Definitions (all over kvsim's own frames: a frame counts when its module is `kvsim.*`; typer,
click, pydantic and the standard library are not counted, in depth or in stops):

- configuration object: an instance of a pydantic model defined in `kvsim.sim.config` (SimConfig
  and its sections: EngineConfig, KVConfig, TraceOptions, SLO), of `RunPlan` (sim/engine/run_plan.py, the
  resolved plan, where it exists) or of `SchedulerConfig` (the scheduler's engine settings, derived
  from the config). Resolved copies (the config with engine defaults filled in) are instances of
  the same classes and count the same.
- stop: a call of a kvsim function that receives a configuration object as an argument (a named
  parameter other than self/cls, or an element of *args / a value of **kwargs). Every call counts
  (a function called twice with it is two stops); resuming a generator is not a call, and code
  without a source file (a dataclass's generated `__init__`) is not a stop (its frame still counts
  in the depth).
- depth of a stop: the number of kvsim frames on the stack, its own included (the command's
  function is depth 1 when it is the first kvsim frame).
- climb: stop k+1 is a climb when, between the calls of stop k (depth d) and stop k+1, control
  returned to a kvsim depth below d - 1: not only stop k but also the kvsim function that called it
  had returned, so a reader following the configuration climbs back up the call stack to find where
  it goes next. A stop called from inside stop k (descent), or by stop k's caller right after stop k
  returned (a sibling: depth d - 1 reached, not less), is not a climb. The levels of a climb are
  (d - 1) - the lowest depth reached.

Prints stops (calls and distinct functions), modules, climbs (and levels), then the list: depth,
climb mark (^levels), module:function and the configuration arguments.

    python bench/trace_config_flow.py [--until MODULE:QUALNAME | --until end] [-- kvsim arguments]

`--until end` follows the configuration through the whole command (outputs and summary included).
"""
from __future__ import annotations

import importlib
import inspect
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

MAIN = ["simulate", "--trace", "azure-conv-2023", "--model", "llama-3.1-8b", "--gpu", "h100",
        "--max-requests", "200", "-q"]
UNTIL = "kvsim.sim.core.scheduler:Scheduler.schedule"
GENERATOR = inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR


def config_types() -> tuple[type, ...]:
    """The configuration classes of the checkout being measured (RunPlan only where it exists)."""
    from pydantic import BaseModel

    config = importlib.import_module("kvsim.sim.config")
    types = [c for c in vars(config).values()
             if isinstance(c, type) and issubclass(c, BaseModel) and c.__module__ == config.__name__]
    for module, name in (("kvsim.sim.engine.run_plan", "RunPlan"), ("kvsim.sim.core.scheduler", "SchedulerConfig")):
        try:
            types.append(getattr(importlib.import_module(module), name))
        except (ImportError, AttributeError):
            pass
    return tuple(types)


@dataclass
class Stop:
    module: str
    function: str
    depth: int
    args: list[str]            # "name: Type" of each configuration argument
    climb: int = 0             # levels climbed before this stop (0: none)


@dataclass
class Tracer:
    types: tuple[type, ...]
    until: tuple[str, str]
    stops: list[Stop] = field(default_factory=list)
    depth: int = 0
    low: int = 0               # the lowest kvsim depth returned to since the last stop
    started: set = field(default_factory=set)     # ids of generator frames already entered
    done: bool = False

    def config_args(self, frame) -> list[str]:
        code, values = frame.f_code, frame.f_locals
        n = code.co_argcount + code.co_kwonlyargcount
        names = list(code.co_varnames[:n])
        if code.co_flags & inspect.CO_VARARGS:
            names.append(code.co_varnames[n])
            n += 1
        if code.co_flags & inspect.CO_VARKEYWORDS:
            names.append(code.co_varnames[n])
        out = []
        for name in names:
            if name in ("self", "cls"):
                continue
            value = values.get(name)
            items = value.values() if isinstance(value, dict) else value if isinstance(value, tuple) else (value,)
            out += [f"{name}: {type(v).__name__}" for v in items if isinstance(v, self.types)]
        return out

    def __call__(self, frame, event, arg):
        if self.done or event not in ("call", "return"):
            return
        module = frame.f_globals.get("__name__", "")
        if not module.startswith("kvsim."):
            return
        if event == "return":
            self.depth -= 1
            self.low = min(self.low, self.depth)
            return
        self.depth += 1
        code = frame.f_code
        if code.co_flags & GENERATOR:
            if id(frame) in self.started:          # a resumed generator: not a new call
                return
            self.started.add(id(frame))
        if (module, code.co_qualname) == self.until:
            self.done = True
            sys.setprofile(None)
            return
        args = [] if code.co_filename.startswith("<") else self.config_args(frame)
        if args:
            previous = self.stops[-1].depth if self.stops else None
            climb = previous - 1 - self.low if previous is not None and self.low < previous - 1 else 0
            self.stops.append(Stop(module, code.co_qualname, self.depth, args, climb))
            self.low = self.depth


def trace(argv: list[str], until: str = UNTIL) -> Tracer:
    from kvsim.sim.cli import app

    module, _, qualname = until.partition(":")
    tracer = Tracer(config_types(), (module, qualname))
    sys.setprofile(tracer)
    try:
        app(argv, standalone_mode=False)
    finally:
        sys.setprofile(None)
    if not tracer.done and until != "end":
        raise SystemExit(f"error: {until} was never called (the run took no engine step?)")
    return tracer


def report(tracer: Tracer, argv: list[str]) -> None:
    stops = tracer.stops
    modules = {s.module for s in stops}
    functions = {(s.module, s.function) for s in stops}
    climbs = [s for s in stops if s.climb]
    print(f"kvsim {' '.join(argv)}")
    print(f"from the CLI entry to {'the end' if tracer.until[0] == 'end' else 'the first call of ' + ':'.join(tracer.until)}:")
    print(f"stops: {len(stops)} calls of {len(functions)} functions in {len(modules)} modules; "
          f"climbs: {len(climbs)} ({sum(s.climb for s in climbs)} levels)")
    for s in stops:
        mark = f"^{s.climb}" if s.climb else ""
        print(f"  {s.depth:2d} {mark:>3} {'  ' * (s.depth - 1)}{s.module.removeprefix('kvsim.')}:{s.function}"
              f"  ({', '.join(s.args)})")


def main() -> None:
    args = sys.argv[1:]
    until = UNTIL
    if args[:1] == ["--until"]:
        until, args = args[1], args[2:]
    argv = args[1:] if args[:1] == ["--"] else args
    with tempfile.TemporaryDirectory() as tmp:
        argv = argv or MAIN + ["--out", str(Path(tmp) / "run")]
        tracer = trace(argv, until)
    report(tracer, argv)


if __name__ == "__main__":
    main()
