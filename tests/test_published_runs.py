"""Published vLLM runs on real GPUs (tests/data/published_runs) simulated by kvsim: each figure's error
is pinned, at the issue's bounds (10% TPOT/ITL/throughput, 15% TTFT) where kvsim meets them and at
the documented gap where it does not (docs/gpu-profiles.md explains each gap's cause). A change of
the cost model, a profile or the client terms that moves a figure out of its band fails here."""
from pathlib import Path

import pytest

from kvsim.sim.calibration.published_runs import compare_published, load_published_runs

RUNS = Path(__file__).parent / "data" / "published_runs" / "runs.yaml"
# (run, figure) -> largest |relative error| allowed; keys absent: the bound by figure kind
GAPS = {
    ("l4-qwen2.5-0.5b", "ttft_p50_ms"): 0.35,          # client-side TTFT at c=1/2 (docs: "Remaining gaps" 1)
    ("h100-qwen3-0.6b", "request_throughput"): 0.25,   # a 500-request burst at the API server (gap 2)
    ("h100-qwen3-0.6b", "ttft_mean_ms"): 0.35,
    ("h100-qwen3-0.6b", "tpot_mean_ms"): 0.35,
    ("h200-llama-3.1-8b-latency", "batch_latency_ms"): 0.25,   # vllm bench latency's engine loop (gap 4)
    # the published tails (docs/gpu-profiles.md, gap 3 "Tails"): the sources' spread that kvsim's deterministic
    # client does not make (c=1's p95 of 115 ms is the first requests' warm-up), and the 500-request burst
    ("l4-qwen2.5-0.5b", "ttft_p95_ms"): 0.75,
    ("l4-qwen2.5-0.5b", "e2e_p50_ms"): 0.15,           # follows the TTFT gap at concurrency 16/32
    ("l4-qwen2.5-0.5b", "e2e_p95_ms"): 0.18,
    ("h100-qwen3-0.6b", "ttft_p50_ms"): 0.35,          # as its mean (gap 2)
    ("h100-qwen3-0.6b", "ttft_p99_ms"): 0.35,
    ("h100-qwen3-0.6b", "tpot_p50_ms"): 0.35,
    ("h100-qwen3-0.6b", "tpot_p99_ms"): 0.45,
}


def bound(run: str, figure: str) -> float:
    if (run, figure) in GAPS:
        return GAPS[(run, figure)]
    return 0.15 if figure.startswith("ttft") else 0.10


@pytest.fixture(scope="module")
def comparisons():
    return compare_published(RUNS)


def test_every_published_figure_is_simulated(comparisons):
    expected = sum(len(r.measured) * len(next(iter(r.points.values()))) for r in load_published_runs(RUNS)
                   if r.kind != "kernels") + 4
    assert len(comparisons) == expected
    assert {c.run for c in comparisons} == {r.id for r in load_published_runs(RUNS)}


def test_tails_table_pairs_published_percentiles(comparisons):
    """The percentile table shows each published median and tail beside kvsim's (the L4 page's p95s,
    the kvcached run's p99s); a run without published percentiles (the latency run) is absent."""
    from kvsim.sim.calibration.published_runs import tails_table
    lines = tails_table(comparisons).splitlines()
    h100 = [ln for ln in lines if ln.startswith("h100-qwen3-0.6b") and " ttft " in ln]
    assert len(h100) == 2 and all(" p99 " in ln for ln in h100)
    l4_ttft = [ln for ln in lines if ln.startswith("l4-qwen2.5-0.5b") and " ttft " in ln]
    assert len(l4_ttft) == 6 and all(" p95 " in ln for ln in l4_ttft)
    assert not any(ln.startswith("h200-") for ln in lines)


def test_each_figure_within_its_band(comparisons):
    outside = [f"{c.run} {c.point} {c.figure}: measured {c.measured:.4g}, kvsim {c.predicted:.4g} "
               f"({c.error:+.1%}, band {bound(c.run, c.figure):.0%})"
               for c in comparisons if abs(c.error) > bound(c.run, c.figure)]
    assert not outside, "\n".join(outside)
