"""A run's metrics under `vllm bench serve`'s names and units (its result JSON and printed report).

Computed as vLLM's `calculate_metrics` computes them, from the request table: over completed requests,
TTFT and E2E latency (`e2el`) from the time each request was *sent*; TPOT = (E2EL - TTFT) / (output
tokens - 1) over requests with more than one output token; ITL = every gap between consecutive output
tokens of a request, all requests pooled; mean, median, population std (numpy's default) and the
chosen percentiles (numpy's linear interpolation), in milliseconds. Throughputs divide by the
benchmark's duration: from its start (t=0 of the trace's clock: the first arrival of a trace with
arrival times, or the start of `--request-rate` draws) to the last completion. Failed requests are the
ones the engine rejected (they can never fit) and those the client gave up on (`--request-timeout`:
aborted), as the benchmark counts a request whose response did not complete.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from .metrics import flat_token_times, inter_token_latencies
from .request_log import peak_tokens_per_s

DEFAULT_PERCENTILES = (99.0,)
# (key in the result JSON, name in the printed report, the report's section header)
LATENCIES = (("ttft", "TTFT", "Time to First Token"),
             ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
             ("itl", "ITL", "Inter-token Latency"),
             ("e2el", "E2EL", "End-to-end Latency"))


def percentile_word(p: float) -> str:
    """vLLM's key spelling: 99 -> '99', 99.9 -> '99.9'."""
    return str(int(p)) if int(p) == p else str(p)


def bench_metrics(requests: pd.DataFrame, *, start_s: float, percentiles=DEFAULT_PERCENTILES,
                  slo_ttft_s: float | None = None, slo_tpot_s: float | None = None, tokens=None) -> dict:
    """The `vllm bench serve` result keys of a run (request table of sim.results.metrics.request_table; without
    its token_times_s column, `tokens`: sim.results.request_log.token_stats_from_file's figures)."""
    done = requests[requests["status"] == "finished"]
    end = float(done["finish_s"].max()) if len(done) else start_s
    duration = max(end - start_s, 1e-12)
    n_in, n_out = int(done["prompt_tokens"].sum()), int(done["output_tokens"].sum())
    out: dict = {
        "duration": end - start_s,
        "completed": int(len(done)),
        "failed": int(requests["status"].isin(("rejected", "aborted")).sum()),
        "total_input_tokens": n_in,
        "total_output_tokens": n_out,
        "request_throughput": len(done) / duration,
        "request_goodput": _good(done, slo_ttft_s, slo_tpot_s) / duration,
        "output_throughput": n_out / duration,
        "total_token_throughput": (n_in + n_out) / duration,
        "max_output_tokens_per_s": _peak_tokens_per_s(done) if tokens is None else tokens.peak_tokens_per_s,
        "max_concurrent_requests": _peak_concurrency(done),
    }
    values = {"ttft": done["ttft_s"].to_numpy(), "e2el": done["e2e_s"].to_numpy(),
              "tpot": done.loc[done["output_tokens"] > 1, "tpot_s"].to_numpy(),
              "itl": inter_token_latencies(done["token_times_s"]) if tokens is None else None}
    for key, _, _ in LATENCIES:
        if key == "itl" and tokens is not None and tokens.itl.size:
            out.update(_distribution_ms(key, tokens.itl, percentiles))
            continue
        v = values[key] if values[key] is not None and len(values[key]) else np.zeros(1)   # vLLM: `np.mean(x or 0)` on an empty list
        out[f"mean_{key}_ms"] = float(np.mean(v)) * 1e3
        out[f"median_{key}_ms"] = float(np.median(v)) * 1e3
        out[f"std_{key}_ms"] = float(np.std(v)) * 1e3
        for p in percentiles:
            out[f"p{percentile_word(p)}_{key}_ms"] = float(np.percentile(v, p)) * 1e3
    return out


def _distribution_ms(key: str, dist, percentiles) -> dict:
    """The mean/median/std/percentile keys of a sim.results.request_log.ValueCounts."""
    out = {f"mean_{key}_ms": dist.mean() * 1e3, f"median_{key}_ms": dist.median() * 1e3,
           f"std_{key}_ms": dist.std() * 1e3}
    for p in percentiles:
        out[f"p{percentile_word(p)}_{key}_ms"] = float(dist.percentile(p)) * 1e3
    return out


def _good(done: pd.DataFrame, slo_ttft_s: float | None, slo_tpot_s: float | None) -> int:
    """vLLM's --goodput: requests within every SLO (a one-token request's TPOT counts as 0)."""
    ok = np.ones(len(done), dtype=bool)
    if slo_ttft_s is not None:
        ok &= done["ttft_s"].to_numpy() <= slo_ttft_s
    if slo_tpot_s is not None:
        ok &= np.nan_to_num(done["tpot_s"].to_numpy(), nan=0.0) <= slo_tpot_s
    return int(ok.sum())


def _peak_tokens_per_s(done: pd.DataFrame) -> float:
    """Most output tokens in one whole second counted from the first send (vLLM's per-second buckets)."""
    if not len(done):
        return 0.0
    _, times = flat_token_times(done["token_times_s"])
    return peak_tokens_per_s(times, float(done["arrival_s"].min()))


def _peak_concurrency(done: pd.DataFrame) -> int:
    """Most requests in flight at once, over half-open [sent, finished) intervals."""
    if not len(done):
        return 0
    times = np.concatenate([done["arrival_s"].to_numpy(), done["finish_s"].to_numpy()])
    deltas = np.concatenate([np.ones(len(done), np.int64), -np.ones(len(done), np.int64)])
    order = np.lexsort((deltas, times))                 # a finish before a send at the same instant
    return int(np.cumsum(deltas[order]).max())


def report_lines(s: dict) -> list[str]:
    """The summary as `vllm bench serve` prints it (the keys above; missing ones left out)."""
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="=")]

    def row(label, key, fmt="{:<10.2f}"):
        if s.get(key) is not None:
            lines.append(f"{label:<40} " + fmt.format(s[key]))

    row("Successful requests:", "completed", "{:<10}")
    row("Failed requests:", "failed", "{:<10}")
    row("Maximum request concurrency:", "max_concurrency", "{:<10}")
    row("Request rate configured (RPS):", "request_rate")
    row("Benchmark duration (s):", "duration")
    row("Total input tokens:", "total_input_tokens", "{:<10}")
    row("Total generated tokens:", "total_output_tokens", "{:<10}")
    row("Request throughput (req/s):", "request_throughput")
    row("Request goodput (req/s):", "request_goodput")
    row("Output token throughput (tok/s):", "output_throughput")
    row("Peak output token throughput (tok/s):", "max_output_tokens_per_s")
    row("Peak concurrent requests:", "max_concurrent_requests", "{:<10.2f}")
    row("Total token throughput (tok/s):", "total_token_throughput")
    for key, name, header in LATENCIES:
        if f"mean_{key}_ms" not in s:
            continue
        lines.append("{s:{c}^{n}}".format(s=header, n=50, c="-"))
        row(f"Mean {name} (ms):", f"mean_{key}_ms")
        row(f"Median {name} (ms):", f"median_{key}_ms")
        for k in s:
            if k.startswith("p") and k.endswith(f"_{key}_ms") and k[1:-len(key) - 4].replace(".", "").isdigit():
                row(f"P{k[1:-len(key) - 4]} {name} (ms):", k)
    lines.append("=" * 50)
    return lines
