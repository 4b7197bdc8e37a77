"""vLLM's multi-turn benchmark configuration (benchmarks/multi_turn's `generate_multi_turn.json`, read by
`benchmark_serving_multi_turn.py --input-file`) as a session trace: the conversations it generates, drawn as
its `bench_dataset.py` draws them (kvsim's own seeded numbers, not vLLM's exact ones).

- `num_conversations` conversations; `prompt_input.num_turns` counts *messages* (user and assistant): at
  least 2, rounded up to an even number, so a conversation has num_turns / 2 user turns;
- the first user message is the common prefix (`common_prefix_num_tokens`, one draw shared by every
  conversation), the conversation's own prefix (`prefix_num_tokens`), then a message of `num_tokens`;
  later user messages `num_tokens`; answers `prompt_output.num_tokens` (at least 1);
- distributions: `constant` (value), `uniform` (min, max: integers inclusive when both are integers),
  `lognormal` (`average` with `median_ratio`, default 0.85, samples scaled to the average; or `mean` and
  `sigma` of the underlying normal), `zipf` (alpha), `poisson` (alpha); each with an optional `max` cap.

The text files (`text_files`) only give the prompts' words: token counts are what kvsim needs, so they
are not read. The clients (`--num-clients`, `--max-active-conversations`, `--request-rate`) are the
benchmark's command line, not this file: give `--max-concurrency` and `--think-time` to kvsim.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from kvsim.traces.errors import TraceError
from kvsim.traces.formats import MULTI_TURN_FILETYPE as FILETYPE
from kvsim.traces.trace import Trace, session_trace

DEFAULT_MEDIAN_RATIO = 0.85          # vLLM's LognormalDistribution when only `average` is given


def load_multi_turn_config(path: str | Path, *, seed: int = 0) -> Trace:
    path = Path(path)
    conf = _read(path)
    n = conf["num_conversations"]
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise TraceError(path, None, f"num_conversations: expected a positive integer, got {n!r}")
    rng = np.random.default_rng(np.random.SeedSequence(seed))
    draw = _Draws(path, conf, rng)
    messages = np.maximum(draw("prompt_input", "num_turns", n), 2)
    turns = (messages + messages % 2) // 2
    common = int(draw("prompt_input", "common_prefix_num_tokens", 1, optional=True)[0])
    prefixes = draw("prompt_input", "prefix_num_tokens", n)
    sessions = []
    for c in range(n):
        k = int(turns[c])
        asked = np.maximum(draw("prompt_input", "num_tokens", k), 1)
        answers = np.maximum(draw("prompt_output", "num_tokens", k), 1)
        asked[0] += common + int(prefixes[c])
        sessions.append([(int(a), int(b)) for a, b in zip(asked, answers, strict=True)])
    trace = session_trace(sessions, np.zeros(n), [np.zeros(len(s)) for s in sessions], path.stem, str(path))
    trace.shared_prefix_tokens = common
    trace.notices.append(f"vLLM multi-turn config: {n} conversations, {len(trace)} user turns, a common prefix of "
                         f"{common} tokens, all conversations ready at t=0 (seed {seed}; the clients are "
                         "--max-concurrency and --think-time)")
    return trace


def _read(path: Path) -> dict:
    try:
        conf = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise TraceError(path, exc.lineno, f"invalid JSON ({exc.msg})") from None
    if not isinstance(conf, dict) or conf.get("filetype") != FILETYPE:
        raise TraceError(path, None, f"expected vLLM's multi-turn config (\"filetype\": \"{FILETYPE}\")")
    for key in ("num_conversations", "prompt_input", "prompt_output"):
        if key not in conf:
            raise TraceError(path, None, f"missing {key!r} (vLLM's generate_multi_turn.json has it)")
    return conf


class _Draws:
    """Samples of the config's distributions, in the file's terms, refused in one line when malformed."""

    def __init__(self, path: Path, conf: dict, rng: np.random.Generator):
        self.path, self.conf, self.rng = path, conf, rng

    def __call__(self, section: str, name: str, size: int, optional: bool = False) -> np.ndarray:
        spec = self.conf.get(section, {}).get(name) if isinstance(self.conf.get(section), dict) else None
        where = f"{section}.{name}"
        if spec is None:
            if optional:
                return np.zeros(size, dtype=np.int64)
            raise TraceError(self.path, None, f"missing {where} (a distribution)")
        if not isinstance(spec, dict) or "distribution" not in spec:
            raise TraceError(self.path, None, f"{where}: expected {{\"distribution\": ..., ...}}, got {spec!r}")
        try:
            values = self._sample(spec, size)
        except (KeyError, TypeError, ValueError) as exc:
            detail = f"missing field {exc}" if isinstance(exc, KeyError) else str(exc)
            raise TraceError(self.path, None, f"{where}: {detail}") from None
        cap = spec.get("max")
        if cap is not None:
            values = np.minimum(values, cap)
        return np.round(values).astype(np.int64)

    def _sample(self, spec: dict, size: int) -> np.ndarray:
        kind, rng = spec["distribution"], self.rng
        if kind == "constant":
            return np.full(size, float(spec["value"]))
        if kind == "uniform":
            lo, hi = spec["min"], spec["max"]
            if not 0 < lo <= hi:
                raise ValueError(f"expected 0 < min <= max, got min {lo}, max {hi}")
            if isinstance(lo, int) and isinstance(hi, int):
                return rng.integers(lo, hi + 1, size).astype(float)
            return rng.uniform(lo, hi, size)
        if kind == "lognormal":
            return self._lognormal(spec, size)
        if kind == "zipf":
            return rng.zipf(spec["alpha"], size).astype(float)
        if kind == "poisson":
            return rng.poisson(spec["alpha"], size).astype(float)
        raise ValueError(f"unknown distribution {kind!r}; expected constant, uniform, lognormal, zipf or poisson")

    def _lognormal(self, spec: dict, size: int) -> np.ndarray:
        average = spec.get("average")
        if average is None:
            mu, sigma = float(spec["mean"]), float(spec["sigma"])
            return self.rng.lognormal(mu, sigma, size)
        ratio = spec.get("median_ratio") or DEFAULT_MEDIAN_RATIO
        if not (average >= 1 and 0 < ratio < 1):
            raise ValueError(f"expected average >= 1 and 0 < median_ratio < 1, got {average}, {ratio}")
        sigma = np.sqrt(2 * np.log(1 / ratio))            # mean / median = exp(sigma^2 / 2)
        samples = self.rng.lognormal(np.log(average * ratio), sigma, size)
        return samples * (average / samples.mean())       # scaled to the average, as vLLM does (then capped)
