"""Seeded synthetic workloads: length distributions, closed batches, synthesized traces.

Every function takes a ``seed`` (int) and returns the same result for the same arguments on any
machine (numpy's PCG64 via ``np.random.default_rng``). ``synthesize`` draws arrivals, prompt
lengths and output lengths from three independent child streams of the seed, so changing the
output distribution does not change the arrivals or prompts.

Length specs (strings, as on the command line, or objects):

- ``fixed:L``                 every request has L tokens
- ``uniform:LO,HI``           integers uniform in [LO, HI]
- ``lognormal:MEAN,CV``       lognormal with that mean and coefficient of variation, rounded, >= 1
  (append ``,MAX`` to cap it, e.g. ``lognormal:1000,1.2,8192``)
- ``resample:NAME_OR_PATH``   (``lengths=``) prompt and output drawn together, with replacement,
  from the rows of a trace (e.g. ``sharegpt-8k-filtered``), keeping their correlation
"""
from __future__ import annotations

import math

import numpy as np

from kvsim.traces.arrivals import arrivals, check_count
from kvsim.traces.errors import TraceError
from kvsim.traces.lengths import (  # noqa: F401 - the length specs live there (re-exported)
    MAX_LENGTH, MAX_LOGNORMAL_CV, Fixed, LengthDist, LogNormal, Uniform, parse_length_spec)
from kvsim.traces.loaders import load_trace
from kvsim.traces.trace import Trace


# bytes per synthesized request at the peak of `synthesize` + `Trace.save`: the peak RSS of `kvsim trace
# synth -n N` grew 212 B (.jsonl) and 156 B (.parquet) per request from N = 1e5 to 1e6 (/usr/bin/time -v,
# 2-core x86 VM, 2026-12-07), rounded up
SYNTH_BYTES_PER_REQUEST = 250


def estimate_synth_bytes(n: int) -> int:
    """Memory `synthesize(n)` and saving its trace need, in bytes (SYNTH_BYTES_PER_REQUEST each)."""
    return int(n) * SYNTH_BYTES_PER_REQUEST


# ---- workloads -------------------------------------------------------------------------------
def closed_batch(n: int, prompt_tokens: int, output_tokens: int, *, name: str | None = None) -> Trace:
    """The closed "batch" workload: ``n`` requests of ``prompt_tokens`` prompt and ``output_tokens``
    output tokens, all arriving at t=0."""
    n = check_count(n)
    for label, value in (("prompt_tokens", prompt_tokens), ("output_tokens", output_tokens)):
        if value < 1:
            raise TraceError(None, None, f"closed_batch: {label} must be >= 1, got {value}")
    return Trace.from_columns(arrival_time_s=np.zeros(n), prompt_tokens=np.full(n, prompt_tokens),
                              output_tokens=np.full(n, output_tokens),
                              name=name or f"batch-{n}x{prompt_tokens}+{output_tokens}", source="synthetic")


def synthesize(n: int, *, rate: float | None = None, cv: float | None = None,
               prompt: str | int | LengthDist = "lognormal:1024,1.0",
               output: str | int | LengthDist = "lognormal:256,1.0",
               lengths: str | None = None, seed: int = 0, name: str | None = None) -> Trace:
    """A seeded synthetic trace of ``n`` requests.

    Arrivals: Poisson at ``rate`` req/s, Gamma with inter-arrival ``cv`` when ``cv`` != 1, or all
    at t=0 when ``rate`` is None. Lengths: ``prompt``/``output`` specs, or ``lengths`` = a trace
    name or path whose (prompt, output) pairs are resampled with replacement.
    """
    n = check_count(n)
    arrival_seed, prompt_seed, output_seed = np.random.SeedSequence(seed).spawn(3)
    times, how = arrivals(n, rate=rate, cv=cv, seed=arrival_seed)
    if lengths is not None:
        prompt_values, output_values = _resample(lengths, n, np.random.default_rng(prompt_seed))
        length_text = f"(prompt, output) resampled from {lengths}"
    else:
        prompt_dist, output_dist = parse_length_spec(prompt), parse_length_spec(output)
        prompt_values = prompt_dist.draw(n, np.random.default_rng(prompt_seed))
        output_values = output_dist.draw(n, np.random.default_rng(output_seed))
        length_text = f"prompt {prompt_dist}, output {output_dist}"
    trace = Trace.from_columns(arrival_time_s=times, prompt_tokens=prompt_values, output_tokens=output_values,
                               name=name or f"synthetic-seed{seed}", source="synthetic")
    trace.notices.append(f"synthetic: {n} requests, arrivals {how}; {length_text}")
    return trace


def _resample(source: str, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    pool = load_trace(source).df
    rows = rng.integers(0, len(pool), size=n)
    return pool["prompt_tokens"].to_numpy()[rows], pool["output_tokens"].to_numpy()[rows]


def vllm_random_dataset(n: int, *, input_len: int = 1024, output_len: int = 128, range_ratio: float = 0.0,
                        prefix_len: int = 0, seed: int = 0) -> Trace:
    """``vllm bench serve --dataset-name random``'s requests as lengths: ``n`` prompts of ``prefix_len``
    shared tokens plus a length uniform on the integers [floor(input_len (1 - r)), ceil(input_len (1 + r))],
    outputs uniform on [max(1, floor(output_len (1 - r))), ceil(output_len (1 + r))], all at t=0 (the
    load options set arrivals). The draws are vLLM's (``numpy.random.default_rng(seed)``: the prefix
    tokens first, then input lengths, then output lengths) for a tokenizer that adds no special token; a
    tokenizer that adds k (Llama's BOS: 1) shifts vLLM's input interval to input_len - k before the server
    adds them back. Requests share the prefix as one prefix block (prefix caching hits it)."""
    n = check_count(n)
    if not 0.0 <= range_ratio < 1.0:
        raise TraceError(None, None, f"random dataset: range_ratio must be in [0, 1) as in vLLM, got {range_ratio:g}")
    for label, value, low in (("input_len", input_len, 1), ("output_len", output_len, 1), ("prefix_len", prefix_len, 0)):
        if int(value) != value or value < low:
            raise TraceError(None, None, f"random dataset: {label} must be an integer >= {low}, got {value}")
    rng = np.random.default_rng(seed)
    if prefix_len:
        rng.integers(0, 2, size=prefix_len)      # vLLM draws the prefix tokens first: keep the stream aligned
    input_low, input_high = math.floor(input_len * (1 - range_ratio)), math.ceil(input_len * (1 + range_ratio))
    output_low = max(math.floor(output_len * (1 - range_ratio)), 1)
    output_high = max(math.ceil(output_len * (1 + range_ratio)), 1)
    inputs = rng.integers(input_low, input_high + 1, size=n)
    outputs = rng.integers(output_low, output_high + 1, size=n)
    prompt = np.maximum(inputs + prefix_len, 1)
    columns = {"prefix_hash_ids": [[0]] * n} if prefix_len else {}
    trace = Trace.from_columns(arrival_time_s=np.zeros(n), prompt_tokens=prompt, output_tokens=outputs,
                               name="random", source="vllm bench serve --dataset-name random",
                               prefix_block_tokens=prefix_len or None, **columns)
    trace.notices.append(f"random dataset (vllm bench serve): {n} requests, input {input_low}-{input_high} + prefix "
                         f"{prefix_len}, output {output_low}-{output_high} tokens, seed {seed}")
    return trace
