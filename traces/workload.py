"""A workload spec: clients and load described the way users describe them, read from YAML
(`kvsim simulate --workload FILE`, or `--trace FILE`: a YAML file whose top key is `workload:`).

    workload:
      seed: 7                      # optional; default: the run's --seed
      duration_s: 120              # how long the rate-driven classes send (or `requests:` per class)
      block_tokens: 16             # tokens per shared-prefix block id (prefix caching's unit; default 16)
      classes:
        - name: chat
          arrival: {process: poisson, rate: 4}          # constant | poisson | gamma (cv) | bursts
          prompt_tokens: lognormal:800,1.0,8192         # fixed:L | uniform:LO,HI | lognormal:MEAN,CV[,MAX]
          output_tokens: uniform:50,400
          shared_prefix: {tokens: 1000, groups: 4}      # a system prompt: one of 4, before the prompt
          slo: {ttft: 500ms, tpot: 50ms}
        - name: batch
          requests: 40
          arrival: {process: bursts, size: 20, every_s: 60}
          prompt_tokens: fixed:4000
          output_tokens: fixed:200
          priority: 1                                   # with engine.scheduling_policy=priority
          slo: {ttft: 30s}

Each class is drawn from its own child stream of the seed (traces/lengths.py's length distributions,
traces/arrivals.py's processes), so adding a class or changing one never changes the others' requests.
The classes are merged by arrival time into one trace; `Trace.workload_classes` keeps which request is
which class and each class's SLOs, and a run reports every class's latencies and SLO attainment
(sim/results/metrics.py `class_figures`; summary.json `workload_classes`).

Arrival processes (rate in requests/s, the first request at `start_s`, default 0):
- constant: a request every 1/rate s;
- poisson: exponential gaps of mean 1/rate;
- gamma: Gamma gaps of mean 1/rate and coefficient of variation `cv` (> 1 burstier than Poisson);
- bursts: `size` requests at once every `every_s` s (`spread_s`: spread over that many seconds, uniform).

Not in the spec yet: multi-turn `sessions` (a session's next turn sent after the previous answer, its
context reused) are added by a separate change; the key is refused with a one-line error until then, and
`_build_class` is where a class's session turns go (see SESSIONS_HOOK).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from kvsim.traces.arrivals import gamma_arrivals, poisson_arrivals
from kvsim.traces.durations import EXAMPLES as DURATION_EXAMPLES
from kvsim.traces.durations import duration_seconds
from kvsim.traces.errors import TraceError
from kvsim.traces.lengths import MAX_LENGTH, parse_length_spec
from kvsim.traces.trace import Trace

MAX_WORKLOAD_REQUESTS = 10_000_000
SESSIONS_HOOK = ("sessions: multi-turn sessions are not in the workload spec yet (a separate change adds them); "
                 "expected a class without 'sessions', or a trace file with session ids")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Arrival(_Strict):
    process: Literal["constant", "poisson", "gamma", "bursts"]
    rate: float | None = Field(default=None, gt=0, allow_inf_nan=False)       # requests/s
    cv: float | None = Field(default=None, gt=0, le=100, allow_inf_nan=False)  # gamma
    size: int | None = Field(default=None, ge=1)                               # bursts
    every_s: float | None = Field(default=None, gt=0, allow_inf_nan=False)     # bursts
    spread_s: float = Field(default=0.0, ge=0, allow_inf_nan=False)            # bursts
    start_s: float = Field(default=0.0, ge=0, allow_inf_nan=False)

    @model_validator(mode="after")
    def _fields_of_the_process(self) -> Arrival:
        needs = {"constant": ("rate",), "poisson": ("rate",), "gamma": ("rate", "cv"), "bursts": ("size", "every_s")}
        missing = [f for f in needs[self.process] if getattr(self, f) is None]
        if missing:
            raise ValueError(f"process {self.process} needs {' and '.join(missing)}")
        extra = [f for f in ("rate", "cv", "size", "every_s") if f not in needs[self.process] and getattr(self, f) is not None]
        if extra or (self.spread_s and self.process != "bursts"):
            raise ValueError(f"process {self.process} takes no {', '.join(extra or ['spread_s'])}")
        return self

    @property
    def mean_rate(self) -> float:
        return self.rate if self.rate is not None else self.size / self.every_s


class SharedPrefix(_Strict):
    tokens: int = Field(ge=1, le=MAX_LENGTH)      # tokens of the shared prefix (a system prompt, a document)
    groups: int = Field(default=1, ge=1)          # distinct prefixes; each request uses one, chosen uniformly


class Slo(_Strict):
    ttft: float | None = None       # seconds, from a duration with its unit
    tpot: float | None = None

    @field_validator("ttft", "tpot", mode="before")
    @classmethod
    def _duration(cls, value):
        if value is None:
            return None
        seconds = duration_seconds(value, unit_required=True)
        if seconds is None or not seconds > 0:
            raise ValueError(f"{value!r} is not a duration > 0 with a unit ({DURATION_EXAMPLES})")
        return seconds


class ClientClass(_Strict):
    name: str = Field(min_length=1)
    arrival: Arrival
    prompt_tokens: str | int
    output_tokens: str | int
    requests: int | None = Field(default=None, ge=1, le=MAX_WORKLOAD_REQUESTS)
    shared_prefix: SharedPrefix | None = None
    slo: Slo = Field(default_factory=Slo)
    priority: int = 0
    sessions: dict | None = None
    # speculative decoding: this class's measured per-position acceptance rates (vLLM's `Per-position
    # acceptance rate`, non-increasing in [0, 1]); a run with speculative_config draws its requests'
    # acceptance from them instead of the method's default (docs/speculative-decoding.md)
    spec_acceptance_rates: list[float] | None = None

    @field_validator("prompt_tokens", "output_tokens")
    @classmethod
    def _length(cls, value):
        try:
            parse_length_spec(value)
        except TraceError as exc:
            raise ValueError(exc.message if hasattr(exc, "message") else str(exc)) from None
        return value

    @field_validator("spec_acceptance_rates")
    @classmethod
    def _rates(cls, value):
        if value is None:
            return None
        if not value or not all(0.0 <= r <= 1.0 for r in value) or any(b > a for a, b in zip(value, value[1:], strict=False)):
            raise ValueError(f"expected a non-empty list of non-increasing rates in [0, 1] (vLLM's per-position "
                             f"acceptance rates), got {value}")
        return value

    @field_validator("sessions")
    @classmethod
    def _no_sessions_yet(cls, value):
        if value is not None:
            raise ValueError(SESSIONS_HOOK)
        return value


class WorkloadSpec(_Strict):
    classes: list[ClientClass] = Field(min_length=1)
    duration_s: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    seed: int | None = None
    block_tokens: int = Field(default=16, ge=1)

    @model_validator(mode="after")
    def _sizes(self) -> WorkloadSpec:
        names = [c.name for c in self.classes]
        if len(set(names)) != len(names):
            raise ValueError(f"class names must differ, got {names}")
        for c in self.classes:
            if c.requests is None and self.duration_s is None:
                raise ValueError(f"class {c.name}: give its 'requests' or the workload's 'duration_s'")
        return self


@dataclass(frozen=True)
class WorkloadClasses:
    """What a built workload keeps beside its trace: each request's class and the classes' SLOs."""
    of_request: dict[int, str]                          # request_id -> class name
    slos: dict[str, tuple[float | None, float | None]]  # class -> (TTFT s, TPOT s)
    # class -> its measured per-position acceptance rates (classes that give spec_acceptance_rates)
    acceptance: dict[str, tuple[float, ...]] = field(default_factory=dict)


def is_workload_spec(path: Path) -> bool:
    """A YAML file whose first key is `workload:` (what format detection asks)."""
    if Path(path).suffix.lower() not in (".yaml", ".yml"):
        return False
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                stripped = line.strip()
                if stripped and not stripped.startswith(("#", "---")):
                    return stripped.startswith("workload:")
    except OSError:
        return False
    return False


def read_yaml(path: Path, what: str) -> tuple[object, str]:
    """(parsed YAML, its text) of a spec file; a file that cannot be read or parsed is one TraceError."""
    import yaml

    from kvsim.sim.io.safe_io import InputError, read_input_text, safe_yaml_load
    from kvsim.sim.io.yaml_errors import yaml_problem

    try:
        text = read_input_text(Path(path), what=what)
        return safe_yaml_load(text, str(path)), text
    except InputError as exc:
        raise TraceError(path, None, str(exc).removeprefix(f"{path}: ")) from None
    except OSError as exc:
        raise TraceError(path, None, f"cannot be read ({exc.strerror or exc})") from None
    except yaml.YAMLError as exc:
        raise TraceError(path, None, f"invalid YAML: {yaml_problem(exc)}") from None


def read_workload_spec(path: Path) -> WorkloadSpec:
    """The spec in `path`; a mistake is one TraceError naming the file, line and field."""
    data, text = read_yaml(path, "workload spec YAML")
    if not isinstance(data, dict) or not isinstance(data.get("workload"), dict):
        raise TraceError(path, None, "expected a mapping under the top key 'workload:' (classes, duration_s, ...)")
    try:
        return WorkloadSpec.model_validate(data["workload"])
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ("workload", *err["loc"])
        lines = _key_lines(text)
        line = next((lines[loc[:n]] for n in range(len(loc), 0, -1) if loc[:n] in lines), None)
        msg = "unknown field" if err["type"] == "extra_forbidden" else err["msg"].removeprefix("Value error, ")
        raise TraceError(path, line, f"{'.'.join(map(str, loc))}: {msg}; see docs/traces.md#workload-specs") \
            from None


def _key_lines(text: str) -> dict[tuple, int]:
    """Key path (keys and list indices) -> its 1-based line in the YAML text (for error messages only)."""
    import yaml

    lines: dict[tuple, int] = {}

    def walk(node, prefix: tuple) -> None:
        lines.setdefault(prefix, node.start_mark.line + 1)
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                lines[prefix + (key.value,)] = key.start_mark.line + 1
                walk(value, prefix + (key.value,))
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                walk(item, prefix + (i,))

    root = yaml.compose(text)
    if root is not None:
        walk(root, ())
    return lines


def build_workload(spec: WorkloadSpec, seed: int = 0, name: str = "workload") -> Trace:
    """The trace of `spec` (its own seed if it gives one, else `seed`)."""
    root = np.random.SeedSequence(spec.seed if spec.seed is not None else seed)
    parts, class_of, prefix_offset = [], [], 0
    for c, stream in zip(spec.classes, root.spawn(len(spec.classes)), strict=True):
        arrival, prompt, output, prefix_ids, prefix_offset = _build_class(c, spec, stream, prefix_offset)
        parts.append((arrival, prompt, output, prefix_ids, np.full(len(arrival), c.priority)))
        class_of += [c.name] * len(arrival)
    arrival = np.concatenate([p[0] for p in parts])
    order = np.argsort(arrival, kind="stable")
    pick = lambda i: np.concatenate([p[i] for p in parts])[order]     # noqa: E731
    ids = [x for p in parts for x in p[3]]
    has_prefix = any(x is not None for x in ids)
    trace = Trace.from_columns(arrival_time_s=arrival[order] - arrival.min(), prompt_tokens=pick(1),
                               output_tokens=pick(2), priority=pick(4),
                               prefix_hash_ids=[ids[i] for i in order] if has_prefix else None,
                               prefix_block_tokens=spec.block_tokens if has_prefix else None,
                               name=name, source="workload")
    trace.workload_classes = WorkloadClasses({int(rid): class_of[i] for rid, i in enumerate(order)},
                                             {c.name: (c.slo.ttft, c.slo.tpot) for c in spec.classes},
                                             {c.name: tuple(c.spec_acceptance_rates) for c in spec.classes
                                              if c.spec_acceptance_rates is not None})
    counts = {c.name: class_of.count(c.name) for c in spec.classes}
    trace.notices.append("workload spec: " + ", ".join(
        f"{c.name} {counts[c.name]} requests ({c.arrival.process}, {c.arrival.mean_rate:g} req/s)" for c in spec.classes))
    return trace


def _build_class(c: ClientClass, spec: WorkloadSpec, stream: np.random.SeedSequence, prefix_offset: int):
    """(arrival s, prompt tokens, output tokens, prefix block ids per request, next free block id) of one
    class. A class's multi-turn sessions would be built here (SESSIONS_HOOK): its turns, each sent after
    the previous answer, with the conversation so far as their shared prefix."""
    arrival_seed, prompt_seed, output_seed, prefix_seed = stream.spawn(4)
    times = _arrivals(c, spec, arrival_seed)
    n = len(times)
    if n == 0:
        raise TraceError(None, None, f"workload class {c.name}: no request arrives within duration_s "
                                     f"{spec.duration_s:g} s; expected a longer duration or a higher rate")
    prompt = parse_length_spec(c.prompt_tokens).draw(n, np.random.default_rng(prompt_seed))
    output = parse_length_spec(c.output_tokens).draw(n, np.random.default_rng(output_seed))
    ids: list = [None] * n
    if c.shared_prefix is not None:
        blocks = c.shared_prefix.tokens // spec.block_tokens      # the prefix's whole blocks are shared
        group = np.random.default_rng(prefix_seed).integers(0, c.shared_prefix.groups, size=n)
        prompt = prompt + c.shared_prefix.tokens
        fresh = prefix_offset + c.shared_prefix.groups * blocks   # ids past every group's prefix: unique per request
        ids = []
        for i in range(n):
            shared = [prefix_offset + int(group[i]) * blocks + b for b in range(blocks)]
            own = -(-int(prompt[i]) // spec.block_tokens) - blocks
            ids.append(shared + list(range(fresh, fresh + own)))
            fresh += own
        prefix_offset = fresh
    return times, prompt, output, ids, prefix_offset


def _arrivals(c: ClientClass, spec: WorkloadSpec, seed: np.random.SeedSequence) -> np.ndarray:
    """The class's arrival times: traces/arrivals.py's Poisson and Gamma processes, constant gaps, or bursts."""
    a = c.arrival
    if c.requests is None:         # as many as arrive within the duration: draw enough, keep those before it
        expected = a.mean_rate * spec.duration_s
        n = int(math.ceil(expected * 1.5 + 10 * math.sqrt(expected) + 10))
        if n > MAX_WORKLOAD_REQUESTS:
            raise TraceError(None, None, f"workload class {c.name}: about {n:,} requests; expected at most "
                                         f"{MAX_WORKLOAD_REQUESTS:,} (a lower rate or a shorter duration_s)")
    else:
        n = c.requests
    if a.process == "constant":
        times = np.arange(n) / a.rate
    elif a.process == "poisson":
        times = poisson_arrivals(n, a.rate, seed)
    elif a.process == "gamma":
        times = gamma_arrivals(n, a.rate, a.cv, seed)
    else:
        times = (np.arange(n) // a.size) * a.every_s
        if a.spread_s:
            times = np.sort(times + np.random.default_rng(seed).uniform(0, a.spread_s, size=n))
    times = times + a.start_s
    if c.requests is None:
        times = times[times < spec.duration_s]
    return times


def load_workload_spec(path: Path, *, seed: int = 0) -> Trace:
    """The trace a workload spec file describes (traces.loaders' `workload` format)."""
    spec = read_workload_spec(path)
    try:
        trace = build_workload(spec, seed=seed, name=Path(path).stem)
    except TraceError as exc:            # a whole-spec problem found while building: name the file
        if exc.path is not None:
            raise
        raise TraceError(path, None, exc.reason) from None
    return trace
