"""The vLLM offloading blog's check (bench/vllm_offloading_blog.py) on small sizes: a prompt loaded from the CPU tier
reaches its first token sooner than a computed one, by more the longer the prompt (the blog's X2..X22); a batch of
prefill requests whose prompts the CPU holds runs several times faster than without offloading (the blog's "up to
X9", PCIe-bound), and offloading with no hits costs nothing (stores are asynchronous)."""
import importlib.util
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def bench():
    path = Path(__file__).resolve().parent.parent / "bench" / "vllm_offloading_blog.py"
    spec = importlib.util.spec_from_file_location("vllm_offloading_blog", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_loading_a_prompt_cuts_ttft_more_the_longer_the_prompt(bench):
    rows = bench.ttft_check([1024, 8192, 32768])
    cuts = [computed / loaded for _, computed, loaded in rows]
    assert all(c > 1.5 for c in cuts) and cuts == sorted(cuts) and cuts[-1] > 3 * cuts[0]


def test_full_cpu_hits_multiply_prefill_throughput_and_no_hits_cost_nothing(bench):
    base = bench.throughput(300, 0.0, offload=False)
    assert bench.throughput(300, 0.0, offload=True) == pytest.approx(base, rel=0.01)
    half = bench.throughput(300, 0.5, offload=True)
    full = bench.throughput(300, 1.0, offload=True)
    assert base < half < full and full > 5 * base
