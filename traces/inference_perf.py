"""An inference-perf config file read as the workload it sends (`kvsim simulate --workload config.yml`): its
`load` (type constant / poisson / concurrent, its stages) and its synthetic `data` (random / synthetic
lengths, shared_prefix groups), the way inference-perf (kubernetes-sigs/inference-perf) builds them:

- lengths from `input_distribution` / `output_distribution` (`min`, `max`, `mean`, `std_dev`, `total_count`,
  `type` normal (default) | lognormal | uniform | fixed | poisson), drawn, clipped to [min, max] and rounded
  as its `sample_from_distribution` does; `total_count` prompts are drawn once and the requests cycle
  through them (request i sends prompt i mod total_count);
- shared_prefix: `num_groups` system prompts of `system_prompt_len` tokens, `num_prompts_per_group`
  questions each (`question_len` / `question_distribution`, `output_len` / `output_distribution`), the
  prompts shuffled, request i sending prompt i mod (groups x prompts per group); a prompt is its group's
  system prompt then its question, so requests of a group share the system prompt's blocks;
- load: each stage sends int(rate x duration) requests at `rate` requests/s (constant: evenly spaced;
  poisson: exponential gaps), stage after stage (the next one from the later of the stage's end and its
  last send); `concurrent`: one stage's `num_requests` with `concurrency_level` in flight (closed loop).

Each stage is reported as its own client class (`stage-0`, `stage-1`, ...: summary.json's
`workload_classes`). The draws come from `load.base_seed` (else the run's --seed) through numpy's
default_rng: the same distributions as inference-perf, not its exact numbers. Everything else in the file
(api, server, metrics, report, storage, tokenizer) is about the client and is not read; data types that
are datasets (shareGPT, cnn_dailymail, ..., trace replays) are refused: give the dataset itself as --trace.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from kvsim.traces.errors import TraceError
from kvsim.traces.trace import Trace
from kvsim.traces.workload import MAX_WORKLOAD_REQUESTS, WorkloadClasses, _key_lines, read_yaml

MAX_TOKENS = 100_000_000


class _Loose(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


class Distribution(_Loose):
    min: int = Field(default=1, ge=0, le=MAX_TOKENS)
    max: int = Field(default=MAX_TOKENS, ge=1, le=MAX_TOKENS)
    mean: float = Field(default=1.0, ge=0, allow_inf_nan=False)
    std_dev: float = Field(default=0.0, ge=0, allow_inf_nan=False)
    total_count: int | None = Field(default=None, ge=1, le=MAX_WORKLOAD_REQUESTS)
    type: Literal["normal", "lognormal", "uniform", "fixed", "poisson"] = "normal"

    @model_validator(mode="after")
    def _bounds(self) -> Distribution:
        if self.min > self.max:
            raise ValueError(f"min ({self.min}) cannot be greater than max ({self.max})")
        if self.type == "lognormal" and self.mean <= 0:
            raise ValueError("a lognormal distribution needs mean > 0")
        return self

    def draw(self, n: int, rng: np.random.Generator) -> np.ndarray:
        """inference-perf's sample_from_distribution: drawn, clipped to [min, max], rounded (at least 1 here:
        a request has a token)."""
        if self.type == "fixed":
            values = np.full(n, float(int(self.mean)))
        elif self.type == "normal":
            values = rng.normal(self.mean, self.std_dev, size=n)
        elif self.type == "lognormal":
            if self.std_dev <= 0:
                values = np.full(n, self.mean)
            else:
                sigma2 = math.log(1.0 + (self.std_dev / self.mean) ** 2)
                values = rng.lognormal(math.log(self.mean) - sigma2 / 2, math.sqrt(sigma2), size=n)
        elif self.type == "uniform":
            values = rng.uniform(self.min, self.max + 1, size=n)
        else:
            values = rng.poisson(self.mean if self.mean > 0 else 1.0, size=n).astype(np.float64)
        if self.type != "fixed":
            values = np.clip(np.round(np.clip(values, self.min, self.max)), self.min, self.max)
        return np.maximum(values, 1).astype(np.int64)


def _fixed(length: int) -> Distribution:
    return Distribution(min=length, max=length, mean=float(length), type="fixed")


class SharedPrefix(_Loose):
    num_groups: int = Field(ge=1, le=100_000)
    num_prompts_per_group: int = Field(ge=1, le=100_000)
    system_prompt_len: int | Distribution = 100
    question_len: int | None = None
    output_len: int | None = None
    question_distribution: Distribution | None = None
    output_distribution: Distribution | None = None


class Data(_Loose):
    type: str = "random"
    input_distribution: Distribution | None = None
    output_distribution: Distribution | None = None
    shared_prefix: SharedPrefix | None = None


class Stage(_Loose):
    rate: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    duration: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    concurrency_level: int | None = Field(default=None, ge=1)
    num_requests: int | None = Field(default=None, ge=1, le=MAX_WORKLOAD_REQUESTS)


class Load(_Loose):
    type: Literal["constant", "poisson", "concurrent"] = "constant"
    stages: list[Stage] = Field(min_length=1)
    base_seed: int | None = None

    @model_validator(mode="after")
    def _stages(self) -> Load:
        for i, s in enumerate(self.stages):
            need = ("concurrency_level", "num_requests") if self.type == "concurrent" else ("rate", "duration")
            missing = [k for k in need if getattr(s, k) is None]
            if missing:
                raise ValueError(f"stage {i}: a {self.type} load needs {' and '.join(need)}")
            if self.type != "concurrent" and s.rate * s.duration > MAX_WORKLOAD_REQUESTS:
                raise ValueError(f"stage {i}: {s.rate * s.duration:,.0f} requests; expected at most "
                                 f"{MAX_WORKLOAD_REQUESTS:,}")
        if self.type == "concurrent" and len(self.stages) > 1:
            raise ValueError("a concurrent load of several stages is not read (one concurrency for the whole run)")
        return self


class InferencePerfConfig(_Loose):
    load: Load
    data: Data = Field(default_factory=Data)

    @model_validator(mode="after")
    def _data(self) -> InferencePerfConfig:
        kind = self.data.type
        if kind in ("random", "synthetic"):
            if self.data.input_distribution is None or self.data.output_distribution is None:
                raise ValueError(f"data type {kind} needs input_distribution and output_distribution")
        elif kind == "shared_prefix":
            if self.data.shared_prefix is None:
                raise ValueError("data type shared_prefix needs its shared_prefix section")
        else:
            raise ValueError(f"data type {kind!r} is a dataset or trace replay, not read from this file; expected "
                             "random, synthetic or shared_prefix (give a dataset itself as --trace)")
        return self


def is_inference_perf_config(path: Path) -> bool:
    """A YAML file with top-level `load:` and `data:` keys (inference-perf's config)."""
    if Path(path).suffix.lower() not in (".yaml", ".yml"):
        return False
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            top = {line.split(":", 1)[0] for line in f if line[:1].isalpha() and ":" in line}
    except OSError:
        return False
    return {"load", "data"} <= top


def read_inference_perf(path: Path) -> InferencePerfConfig:
    data, text = read_yaml(path, "inference-perf config")
    try:
        return InferencePerfConfig.model_validate(data if isinstance(data, dict) else {})
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = tuple(err["loc"])
        lines = _key_lines(text)
        line = next((lines[loc[:n]] for n in range(len(loc), 0, -1) if loc[:n] in lines), None)
        msg = err["msg"].removeprefix("Value error, ")
        raise TraceError(path, line, f"{'.'.join(map(str, loc)) or '(file)'}: {msg} (an inference-perf config; "
                                     "see docs/traces.md#inference-perf-configs)") from None


def _prompts(data: Data, rng: np.random.Generator, block_tokens: int) -> tuple[np.ndarray, np.ndarray, list]:
    """The prompt pool inference-perf draws once: (input tokens, output tokens, prefix block ids or None)."""
    if data.type != "shared_prefix":
        n = data.input_distribution.total_count or data.output_distribution.total_count or 1000
        return data.input_distribution.draw(n, rng), data.output_distribution.draw(n, rng), [None] * n
    sp = data.shared_prefix
    system = sp.system_prompt_len if isinstance(sp.system_prompt_len, Distribution) else _fixed(sp.system_prompt_len)
    question = sp.question_distribution or _fixed(sp.question_len if sp.question_len is not None else 50)
    output = sp.output_distribution or _fixed(sp.output_len if sp.output_len is not None else 50)
    system_lens = system.draw(sp.num_groups, rng)
    q, o = [], []
    for _ in range(sp.num_groups):
        q.append(question.draw(sp.num_prompts_per_group, rng))
        o.append(output.draw(sp.num_prompts_per_group, rng))
    group = np.repeat(np.arange(sp.num_groups), sp.num_prompts_per_group)
    prompt = system_lens[group] + np.concatenate(q)
    out = np.concatenate(o)
    shared_blocks = system_lens // block_tokens            # a group's whole system-prompt blocks are shared
    start = np.concatenate([[0], np.cumsum(shared_blocks)])
    fresh = int(start[-1])
    ids = []
    for g, p in zip(group, prompt, strict=True):
        own = -(-int(p) // block_tokens) - int(shared_blocks[g])
        ids.append(list(range(int(start[g]), int(start[g + 1]))) + list(range(fresh, fresh + own)))
        fresh += own
    order = rng.permutation(len(prompt))
    return prompt[order], out[order], [ids[i] for i in order]


def load_inference_perf(path: Path, *, seed: int = 0, block_tokens: int = 16) -> Trace:
    """The trace an inference-perf config sends (traces.loaders' `inference-perf` format)."""
    cfg = read_inference_perf(path)
    rng = np.random.default_rng(cfg.load.base_seed if cfg.load.base_seed is not None else seed)
    prompt_pool, output_pool, id_pool = _prompts(cfg.data, rng, block_tokens)
    times, stage_of, start = [], [], 0.0
    for i, s in enumerate(cfg.load.stages):
        if cfg.load.type == "concurrent":
            t = np.zeros(s.num_requests)
        else:
            n = int(s.rate * s.duration)             # the stage's requests, sent at its timer's times
            t = start + (np.arange(n) / s.rate if cfg.load.type == "constant" else
                         np.concatenate([[0.0], np.cumsum(rng.exponential(1.0 / s.rate, size=max(n - 1, 0)))])[:n])
            start = max(start + s.duration, float(t[-1]) if n else start)     # the next stage after this one
        times.append(t)
        stage_of += [f"stage-{i}"] * len(t)
    arrival = np.concatenate(times)
    if len(arrival) == 0:
        raise TraceError(path, None, "load: no request is sent (rate x duration < 1 in every stage)")
    pick = np.arange(len(arrival)) % len(prompt_pool)
    has_prefix = id_pool[0] is not None
    trace = Trace.from_columns(arrival_time_s=arrival, prompt_tokens=prompt_pool[pick], output_tokens=output_pool[pick],
                               prefix_hash_ids=[id_pool[i] for i in pick] if has_prefix else None,
                               prefix_block_tokens=block_tokens if has_prefix else None,
                               name=Path(path).stem, source="inference-perf")
    trace.workload_classes = WorkloadClasses(dict(enumerate(stage_of)),
                                             {f"stage-{i}": (None, None) for i in range(len(cfg.load.stages))})
    if cfg.load.type == "concurrent":
        trace.bench_load = {"max_concurrency": cfg.load.stages[0].concurrency_level}
    trace.notices.append(f"inference-perf config: {len(arrival)} requests, {cfg.load.type} load in "
                         f"{len(cfg.load.stages)} stage(s), {cfg.data.type} data ({len(prompt_pool)} prompts)")
    return trace
