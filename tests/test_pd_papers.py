"""The DistServe and Splitwise checks' measuring rules (bench/bench_pd_papers.py): the papers' TTFT of a split
request (the first token from the prefill instance), the 90% crossing, Splitwise's iso-cost designs and SLOs."""
import importlib.util
import math
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from kvsim.sim.config import load_config
from kvsim.sim.simulator.simulate import run_simulation


@pytest.fixture(scope="module")
def bench():
    path = Path(__file__).resolve().parent.parent / "bench" / "bench_pd_papers.py"
    spec = importlib.util.spec_from_file_location("bench_pd_papers", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module          # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_a_split_requests_first_token_comes_from_its_prefill_leg(bench):
    req = run_simulation(load_config(None, {"trace": "azure-code-2023", "trace_options.max_requests": 30,
                                            "fleet": {"prefill": {"replicas": 1}, "decode": {"replicas": 1}}})).requests
    lat = bench.paper_latencies(req).loc[req["request_id"]]
    split = req.set_index("request_id").loc[req["request_id"]]
    assert split["disaggregated"].all()
    np.testing.assert_allclose(lat["ttft"], split["prefill_queue_s"] + split["prefill_s"], rtol=1e-12)
    # the hand-off and the decode side's first step move from TTFT into the time after the first token
    assert (lat["ttft"] < split["ttft_s"]).all()
    many = split["output_tokens"] > 1
    np.testing.assert_allclose(lat["tbt"][many] * (split["output_tokens"][many] - 1),
                               split["e2e_s"][many] - lat["ttft"][many], rtol=1e-9)
    assert lat["tbt"][~many].isna().all()


def test_attainment_counts_both_limits_and_fails_unfinished_requests(bench):
    req = pd.DataFrame({"request_id": [0, 1, 2, 3], "ttft_s": [0.1, 0.3, 0.1, math.nan],
                        "tpot_s": [0.05, 0.05, 0.2, math.nan], "e2e_s": [1.0, 1.2, 2.0, math.nan],
                        "output_tokens": [19, 19, 10, 5]})
    req["e2e_s"] = req["ttft_s"] + req["tpot_s"] * (req["output_tokens"] - 1)
    assert bench.attainment(req, 0.2, 0.1) == 0.25            # only request 0 meets both; 3 never finished
    assert bench.attainment(req, 1.0, 1.0) == 0.75


def test_the_90_percent_crossing_is_interpolated_as_distserve_reads_it(bench):
    assert bench.crossing([1, 2, 3], [1.0, 0.95, 0.85], 0.9) == pytest.approx(2.5)
    assert math.isnan(bench.crossing([1, 2], [1.0, 0.95], 0.9))     # never crosses


def test_splitwise_designs_are_iso_cost_as_splitwise_sims_configs(bench):
    designs = {d.name: d for d in bench.splitwise_designs(4)}
    base = designs["Baseline-H100"]
    assert designs["Baseline-A100"].mixed == ("a100-80gb", int(4.76 * 4 // 2.21))
    for d in designs.values():
        assert d.cost <= base.cost + 1e-9
        if d.name.startswith("Splitwise-HA"):
            (_, n_h), (_, n_a) = d.prompt, d.token
            assert n_a == int(4.76 * (4 - n_h) // 2.21)


def test_splitwise_slos_compare_percentiles_with_the_requests_alone(bench):
    alone = pd.DataFrame({"request_id": range(100), "ttft_s": np.linspace(0.1, 1.0, 100),
                          "tpot_s": np.full(100, 0.02), "output_tokens": np.full(100, 50)})
    alone["e2e_s"] = alone["ttft_s"] + alone["tpot_s"] * 49
    ref = bench.paper_latencies(alone)
    assert bench.slo_misses(alone, ref) == []
    slow = alone.assign(ttft_s=alone["ttft_s"] * 2.5)                # TTFT P50 over 2x, P90 under 3x
    slow["e2e_s"] = slow["ttft_s"] + slow["tpot_s"] * 49
    misses = bench.slo_misses(slow, ref)
    assert "ttft p50" in misses and "ttft p90" not in misses and "tbt p50" not in misses
    assert bench.slo_misses(alone.assign(e2e_s=math.nan), ref) == ["unfinished"]
