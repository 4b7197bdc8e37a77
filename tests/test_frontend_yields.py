"""A new request's handler yielding to the shared loop (sim/simulator/client.py `Frontend.yield_waits`,
`handler_yields` / `stream_s` in sim/data/frontends.yaml; issue 54): each later resumption queues behind
one engine step's streaming of the streams in flight."""
import pytest

from kvsim.sim.config import SimConfig
from kvsim.sim.model.cost_model import ClientLatency, frontend_presets
from kvsim.sim.simulator.client import Frontend
from kvsim.sim.simulator.simulate import run_simulation
from kvsim.traces.synthetic import closed_batch

TERMS = dict(request_s=0.010, request_serial_s=0.001, output_token_s=0.0001, shared_loop=True)


def test_each_later_yield_waits_behind_one_steps_streaming():
    one = Frontend(ClientLatency(**TERMS))
    four = Frontend(ClientLatency(**TERMS, handler_yields=4, stream_s=0.0002))
    for f in (one, four):
        assert f.enter(0, 0.0, 0) == pytest.approx(0.011)             # nothing streams yet: no wait
        f.outputs(0, 0.020, 10, 8)                                     # 10 tokens, 8 requests stream on
    # the step's 10 tokens are streamed by 21 ms; the entry's serial ms after that, then the fixed 10 ms;
    # with 4 yields, 3 more waits of 8 streams x 0.2 ms
    assert one.enter(1, 0.020, 0) == pytest.approx(0.021 + 0.001 + 0.010)
    assert four.enter(1, 0.020, 0) == pytest.approx(0.021 + 0.001 + 3 * 8 * 0.0002 + 0.010)
    four.outputs(1, 0.030, 4)                                          # another replica: one API server
    assert four.yield_waits() == pytest.approx(3 * (8 + 4) * 0.0002)
    four.outputs(0, 0.040, 8, 0)                                       # replica 0's streams all finished
    four.outputs(1, 0.040, 4, 0)
    assert four.yield_waits() == 0.0


def test_yields_need_the_shared_loop():
    with pytest.raises(ValueError, match="handler_yields and stream_s need shared_loop"):
        ClientLatency(request_s=0.01, handler_yields=4)
    with pytest.raises(ValueError, match="handler_yields"):
        ClientLatency(**TERMS, handler_yields=0)


def test_the_named_sets_with_yields_are_their_hosts_sets_plus_the_two_terms():
    presets = frontend_presets()
    for name in ("vllm-api", "vllm-api-4vcpu"):
        base, yields = presets[name].terms, presets[f"{name}-yields"].terms
        assert yields.handler_yields > 1 and yields.stream_s > 0
        assert yields.model_copy(update={"handler_yields": 1, "stream_s": 0.0}) == base


def test_a_closed_loop_with_yields_enters_later_and_repeats(tmp_path):
    path = tmp_path / "batch.jsonl"
    closed_batch(32, 256, 32).save(path)

    def run(frontend):
        cfg = SimConfig.model_validate({"trace": str(path), "model": "qwen2.5-0.5b", "gpu": "l4",
                                        "frontend": frontend, "trace_options": {"max_concurrency": 8}})
        return run_simulation(cfg, None).requests.sort_values("request_id")
    base, yields, again = run("vllm-api-4vcpu"), run("vllm-api-4vcpu-yields"), run("vllm-api-4vcpu-yields")
    assert yields[["first_token_s", "finish_s"]].equals(again[["first_token_s", "finish_s"]])
    # the first wave enters a loop with nothing streaming: alike; later requests wait behind the streams
    assert yields["first_token_s"].iloc[:8].tolist() == base["first_token_s"].iloc[:8].tolist()
    assert yields["ttft_s"].iloc[8:].mean() > base["ttft_s"].iloc[8:].mean()
