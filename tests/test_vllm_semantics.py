"""vLLM's defaults and engine-loop semantics kvsim models beyond the scheduler itself: batch limits by
GPU and entry point, prefix caching and async scheduling defaults, async scheduling's one-step lag,
arrivals by engine step."""
import numpy as np
import pytest

from kvsim.sim.model.catalog import get_gpu
from kvsim.sim.config import load_config
from kvsim.sim.core.step import BatchShape
from kvsim.sim.model.cost_model import CostModel
from kvsim.sim.model.defaults import batch_defaults, resolve_engine
from kvsim.sim.simulator.simulate import run_simulation
from kvsim.traces import Trace


@pytest.mark.parametrize("gpu, entry, expected", [
    ("h100", "serve", (8192, 1024)), ("h100", "offline", (16384, 1024)), ("h200", "serve", (8192, 1024)),
    ("a100-80gb", "serve", (2048, 256)), ("l4", "serve", (2048, 256)), ("l4", "offline", (8192, 256)),
    ("t4", "serve", (2048, 256)), ("cpu-2core", "serve", (2048, 128)), ("cpu-2core", "offline", (4096, 256)),
])
def test_batch_defaults_follow_vllm_by_device_and_entry_point(gpu, entry, expected):
    assert batch_defaults(get_gpu(gpu), entry) == expected


def test_unset_engine_options_resolve_to_vllms_defaults_and_explicit_ones_win():
    eng = resolve_engine(load_config(None, {"gpu": "h100"}))
    assert (eng.max_num_batched_tokens, eng.max_num_seqs) == (8192, 1024)
    assert eng.enable_prefix_caching is True and eng.async_scheduling is True
    assert resolve_engine(load_config(None, {"gpu": "cpu-2core"})).async_scheduling is False
    assert resolve_engine(load_config(None, {"kv.policy": "h2o"})).enable_prefix_caching is False
    eng = resolve_engine(load_config(None, {"engine.max_num_seqs": 64, "engine.enable_prefix_caching": False,
                                            "engine.async_scheduling": False}))
    assert (eng.max_num_seqs, eng.enable_prefix_caching, eng.async_scheduling) == (64, False, False)
    no_chunking = resolve_engine(load_config(None, {"gpu": "l4", "engine.enable_chunked_prefill": False}))
    assert no_chunking.max_num_batched_tokens == 131072       # raised to max_model_len, as vLLM does


def test_a_step_budget_below_the_sequence_cap_is_refused_as_vllm_refuses_it():
    from kvsim.sim.config import ConfigError
    with pytest.raises(ConfigError, match=r"max_num_batched_tokens \(512\) must be at least "
                                          r"engine.max_num_seqs \(1024, vLLM's default for H100"):
        resolve_engine(load_config(None, {"gpu": "h100", "engine.max_num_batched_tokens": 512}))
    eng = resolve_engine(load_config(None, {"gpu": "h100", "engine.max_num_batched_tokens": 512,
                                            "engine.max_num_seqs": 512}))
    assert (eng.max_num_batched_tokens, eng.max_num_seqs) == (512, 512)     # equal is allowed


def test_a_run_writes_the_resolved_engine_settings(tmp_path):
    trace = Trace.from_columns(arrival_time_s=[0.0], prompt_tokens=[64], output_tokens=[4])
    run_simulation(load_config(None, {"gpu": "l4"}), tmp_path, trace=trace)
    saved = load_config(tmp_path / "config.yaml").engine
    assert (saved.max_num_batched_tokens, saved.max_num_seqs, saved.async_scheduling) == (2048, 256, True)


def first_steps(result) -> list[int]:
    """The engine step in which each request was first scheduled."""
    times = result.steps.sort_values("step")["time_s"].to_numpy()
    return [int(np.searchsorted(times, t)) for t in result.requests.sort_values("request_id")["first_scheduled_s"]]


def run(trace, **engine):
    cfg = load_config(None, {"model": "llama-3.1-8b", "gpu": "h100", "fast_forward": False,
                             "engine": {"enable_prefix_caching": False, **engine}})
    return run_simulation(cfg, trace=trace)


def test_async_scheduling_sees_an_arrival_one_step_later():
    # request 1 arrives while step 0 (request 0's prefill) runs
    trace = Trace.from_columns(arrival_time_s=[0.0, 1e-4], prompt_tokens=[2000, 100], output_tokens=[50, 5])
    assert first_steps(run(trace, async_scheduling=False)) == [0, 1]
    assert first_steps(run(trace, async_scheduling=True)) == [0, 2]


def test_async_scheduling_returns_a_finished_requests_blocks_one_schedule_later():
    # 11 usable blocks of 16 tokens: requests 0 and 1 take 7; request 2's 5 blocks come free only when
    # request 0 (3 blocks by then) finishes in step 3
    trace = Trace.from_columns(arrival_time_s=[0.0, 0.0, 0.0], prompt_tokens=[32, 80, 80],
                               output_tokens=[4, 40, 5])
    sync = run(trace, async_scheduling=False, num_gpu_blocks=12, block_size=16)
    lagged = run(trace, async_scheduling=True, num_gpu_blocks=12, block_size=16)
    assert first_steps(sync)[2] == 4 and first_steps(lagged)[2] == 5
    assert lagged.summary["num_finished"] == 3


def test_async_scheduling_hides_the_cpu_overhead_behind_the_device():
    sync = CostModel("llama-3.1-8b", "h100")
    overlapped = CostModel("llama-3.1-8b", "h100", async_scheduling=True)
    shape = BatchShape(num_seqs=4, num_decode_tokens=4, kv_tokens_read=4000, block_table_entries=250)
    parts = sync.breakdown(shape)
    device = parts["total"] - parts["overhead"]
    assert sync.predict(shape) == pytest.approx(device + parts["overhead"])
    assert overlapped.predict(shape) == pytest.approx(max(device, parts["overhead"]))
    seqs = np.array([4.0, 64.0]); kv = np.array([4000.0, 64000.0]); entries = np.array([250.0, 4000.0])
    run_prices = overlapped.predict_decode(seqs, kv, entries)
    for i in range(2):                  # the fast-forward's pricing is bit-identical to a step's
        step = BatchShape(num_seqs=seqs[i], num_decode_tokens=seqs[i], kv_tokens_read=kv[i],
                          block_table_entries=entries[i])
        assert run_prices[i] == overlapped.predict(step)


def test_arrivals_by_engine_step():
    """Step k: before the k-th step; an idle engine takes the next arrivals at once."""
    trace = Trace.from_columns(arrival_time_s=[0.0, 0.0, 3.0, 500.0], prompt_tokens=[40, 60, 30, 20],
                               output_tokens=[8, 8, 4, 3])
    cfg = load_config(None, {"gpu": "h100", "trace_options.arrival_unit": "step"})
    r = run_simulation(cfg, trace=trace)
    assert first_steps(r) == [0, 0, 3, 8]          # requests 0-1 finish in step 7: the engine idles
    with pytest.raises(Exception, match=r"replicas \(and dp\) must be 1"):
        run_simulation(load_config(None, {"trace_options.arrival_unit": "step", "replicas": 2}), trace=trace)
