"""A profile's client-side terms (sim/simulator/client.py): what `vllm bench serve` measures beyond the engine."""
import json

import numpy as np
import pytest
from typer.testing import CliRunner

from kvsim.sim.cli import app
from kvsim.sim.simulator.client import Frontend, _serial_server
from kvsim.sim.config import SimConfig
from kvsim.sim.model.cost_model import ClientLatency, load_profile
from kvsim.sim.simulator.simulate import run_simulation
from kvsim.traces.synthetic import closed_batch


def test_serial_server_delivers_each_step_after_the_work_before_it():
    # steps at t=0 (2 tokens), 1 (3), 1.05 (1), 3 (1); 0.1 s per token
    times = np.array([0.0, 0.0, 1.0, 1.0, 1.0, 1.05, 3.0])
    np.testing.assert_allclose(_serial_server(times, 0.1), [0.2, 0.2, 1.3, 1.3, 1.3, 1.4, 3.1])


def test_a_burst_of_requests_queues_at_the_api_server():
    entry = Frontend(ClientLatency(request_s=0.010, request_serial_s=0.001))
    assert [entry.enter(i, 0.0) for i in range(3)] == pytest.approx([0.011, 0.012, 0.013])
    assert entry.enter(3, 1.0) == pytest.approx(1.011)          # an idle server: no queue
    assert entry.sent == {0: 0.0, 1: 0.0, 2: 0.0, 3: 1.0}


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    path = tmp_path_factory.mktemp("client") / "batch.jsonl"
    closed_batch(12, 200, 20).save(path)
    return path


def simulate(trace, tmp_path, client=None, **options):
    profile = load_profile("auto", gpu="l4").model_copy(update={"client": client or ClientLatency()})
    profile.to_yaml(tmp_path / "p.yaml")
    cfg = SimConfig.model_validate({"trace": str(trace), "model": "qwen2.5-0.5b", "gpu": "l4", "client_latency": True,
                                    "profile": str(tmp_path / "p.yaml"), **options})
    return run_simulation(cfg, None)


def test_a_fixed_request_latency_adds_to_ttft_and_e2e_only(trace, tmp_path):
    engine = simulate(trace, tmp_path, trace_options={"request_rate": 5.0})
    client = simulate(trace, tmp_path, ClientLatency(request_s=0.02), trace_options={"request_rate": 5.0})
    np.testing.assert_allclose(client.requests["ttft_s"], engine.requests["ttft_s"] + 0.02, atol=1e-9)
    np.testing.assert_allclose(client.requests["e2e_s"], engine.requests["e2e_s"] + 0.02, atol=1e-9)
    np.testing.assert_allclose(client.requests["tpot_s"], engine.requests["tpot_s"], atol=1e-12)
    assert client.summary["client_latency"] and not engine.summary["client_latency"]


def test_output_token_work_stretches_itl_when_the_server_is_the_bottleneck(trace, tmp_path):
    engine = simulate(trace, tmp_path)
    slow = simulate(trace, tmp_path, ClientLatency(output_token_s=0.002))     # 12 seqs x 2 ms > a step
    assert engine.summary["itl_p50_s"] < 0.024 <= slow.summary["itl_p50_s"] + 1e-9
    assert slow.summary["itl_p50_s"] == pytest.approx(0.024, rel=0.05)


def test_closed_loop_sends_wait_for_the_api_server(trace, tmp_path):
    opts = {"trace_options": {"max_concurrency": 4}}
    engine = simulate(trace, tmp_path, **opts)
    client = simulate(trace, tmp_path, ClientLatency(request_s=0.05, request_serial_s=0.01), **opts)
    assert client.summary["makespan_s"] > engine.summary["makespan_s"] + 2 * 0.05     # three waves, each later
    assert client.summary["ttft_p50_s"] > engine.summary["ttft_p50_s"] + 0.05


@pytest.mark.parametrize("flag, on", [([], False), (["--engine-only"], False), (["--client-latency"], True)])
def test_client_terms_are_opt_in(tmp_path, flag, on):
    run = tmp_path / "run"
    res = CliRunner().invoke(app, ["simulate", "--trace", "azure-conv-2023", "--max-requests", "10", "--gpu", "l4",
                                   "--model", "qwen2.5-0.5b", *flag, "-q", "--out", str(run)])
    assert res.exit_code == 0, res.output
    summary = json.loads((run / "summary.json").read_text())
    assert summary["client_latency"] is on
    assert (summary["ttft_p50_s"] > 0.0282) is on       # the L4 host's fixed request latency
