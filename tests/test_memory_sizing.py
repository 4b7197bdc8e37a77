import pytest

from kvsim.sim.model.catalog import get_model
from kvsim.sim.model.memory import GiB, ModelDoesNotFitError, PoolSizing, activation_peak_bytes, num_gpu_blocks


def test_llama31_8b_on_h100_by_hand():
    # Every constant written out: H100 reports 79.11 GiB; 8,030,261,248 bf16 parameters; the
    # profiled activation peak for 8192 batched tokens (4 hidden + 3 intermediate bf16 buffers per
    # token) plus 2 fp32 copies of 256 x 128256 sampler logits; 0.5 GiB non-torch overhead;
    # a block = 16 tokens x 2 (K,V) x 32 layers x 8 KV heads x 128 dims x 2 bytes = 2 MiB.
    usable = int(79.11 * 2**30 * 0.9)
    weights = 8_030_261_248 * 2
    activations = 8192 * 2 * (4 * 4096 + 3 * 14336) + 2 * 4 * 256 * 128256
    available = usable - weights - activations - 2**29
    expected = available // (16 * 2 * 32 * 8 * 128 * 2)
    assert expected == 27_950

    pool = num_gpu_blocks("llama-3.1-8b", "h100")
    assert pool.num_blocks == expected and pool.bytes_per_block == 2 * 2**20
    assert pool.weight_bytes == weights and pool.activation_bytes == activations
    # ~447k tokens of KV (~54.6 GiB): the order vLLM logs for this model/GPU ("GPU KV cache size: ~450k tokens").
    assert pool.token_capacity == 447_200
    assert 54 * GiB < pool.kv_bytes_available < 55 * GiB


def test_per_head_layout_has_layers_times_kv_heads_more_blocks():
    shared = num_gpu_blocks("llama-3.1-8b", "h100")
    per_head = num_gpu_blocks("llama-3.1-8b", "h100", PoolSizing(layout="per_head"))
    assert per_head.num_blocks_per_head == shared.num_blocks * 32 * 8 == per_head.pool_blocks
    assert shared.pool_blocks == shared.num_blocks
    assert per_head.bytes_per_head_block == 16 * 2 * 128 * 2


def test_tensor_parallel_shards_weights_and_kv_heads():
    pool = num_gpu_blocks("llama-3.1-70b", "h100", PoolSizing(tp=4))
    m_weights = 70_553_706_496 * 2
    assert pool.weight_bytes == m_weights // 4
    assert pool.bytes_per_block == 16 * 2 * 80 * (8 // 4) * 128 * 2
    assert pool.num_blocks == pool.kv_bytes_available // pool.bytes_per_block
    assert pool.num_blocks_per_head == pool.num_blocks * 80 * 2


def test_kv_heads_replicate_when_fewer_than_ranks():
    pool = num_gpu_blocks("smollm2", "l4", PoolSizing(tp=9))          # 3 KV heads on 9 ranks: one each
    assert pool.bytes_per_block == 16 * 2 * 30 * 1 * 64 * 2
    with pytest.raises(ValueError, match="tp=2 must divide num_heads=9"):
        num_gpu_blocks("smollm2", "l4", PoolSizing(tp=2))


def test_model_that_does_not_fit_reports_missing_gib():
    with pytest.raises(ModelDoesNotFitError) as err:
        num_gpu_blocks("llama-3.1-70b", "h100")
    text = str(err.value)
    need = 70_553_706_496 * 2 + activation_peak_bytes(get_model("llama-3.1-70b")) + 2**29 + 16 * 327680
    missing = (need - int(79.11 * 2**30 * 0.9)) / GiB
    assert f"{missing:.2f} GiB missing" in text and "Llama-3.1-70B does not fit on H100-SXM (tp=1)" in text
    # On two H100s bf16 weights leave ~4 GiB of KV per GPU; FP8 weights leave ~8x more.
    bf16 = num_gpu_blocks("llama-3.1-70b", "h100", PoolSizing(tp=2))
    fp8 = num_gpu_blocks("llama-3.1-70b-fp8", "h100", PoolSizing(tp=2))
    assert 3 * GiB < bf16.kv_bytes_available < 5 * GiB
    assert fp8.num_blocks > 7 * bf16.num_blocks


def test_reserve_kv_dtype_and_utilization():
    base = num_gpu_blocks("llama-3.1-8b", "h100", PoolSizing(activation_reserve_bytes=0, non_torch_overhead_bytes=0))
    assert base.num_blocks == (int(79.11 * 2**30 * 0.9) - 8_030_261_248 * 2) // 2**21
    fp8 = num_gpu_blocks("llama-3.1-8b", "h100", PoolSizing(activation_reserve_bytes=0, non_torch_overhead_bytes=0,
                                                           kv_dtype="fp8"))
    assert fp8.num_blocks == base.kv_bytes_available // 2**20
    lower = num_gpu_blocks("llama-3.1-8b", "h100", PoolSizing(gpu_memory_utilization=0.8))
    assert lower.num_blocks < num_gpu_blocks("llama-3.1-8b", "h100").num_blocks
    bigger_budget = num_gpu_blocks("llama-3.1-8b", "h100", PoolSizing(max_num_batched_tokens=32768))
    assert bigger_budget.activation_bytes > lower.activation_bytes


@pytest.mark.parametrize("kwargs,message", [
    ({"gpu_memory_utilization": 1.2}, "gpu_memory_utilization must be in"),
    ({"block_size": 0}, "block_size must be >= 1"),
    ({"layout": "paged"}, "layout must be 'shared' or 'per_head'"),
])
def test_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        num_gpu_blocks("llama-3.1-8b", "h100", PoolSizing(**kwargs))


# ---- host memory of a simulation run (refused before anything is allocated) ---------------------

def _simulate_cli(tmp_path, *args):
    from typer.testing import CliRunner

    from kvsim.sim.cli import app
    return CliRunner().invoke(app, ["simulate", "--max-requests", "20", "-q", "-o", str(tmp_path / "out"), *args])


def test_a_pool_beyond_host_memory_is_refused_before_it_is_allocated(tmp_path):
    import tracemalloc

    # a GPU of 10^8 GiB: the pool fits it (an H100 refuses it first: test_cli_hygiene), not the host
    gpu = tmp_path / "huge.yaml"
    gpu.write_text("name: Huge-GPU\nmemory_gib: 100000000\nmemory_bw_gbps: 3350\ntflops: {bf16: 989}\n"
                   "pcie_gbps: 64\nusd_per_hour: 1\n")
    tracemalloc.start()
    res = _simulate_cli(tmp_path, "--num-gpu-blocks", "1000000000", "--gpu", str(gpu))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert res.exit_code == 2 and "Traceback" not in res.output
    message = " ".join(res.output.split())
    assert "needs about 129.5 GiB of host memory" in message     # 10^9 blocks x 139 B (prefix caching is on)
    assert "GiB is available" in message and "lower --num-gpu-blocks" in message
    assert peak < 2**30 and not (tmp_path / "out").exists()


def test_a_fast_mode_budget_beyond_host_memory_is_refused(tmp_path):
    res = _simulate_cli(tmp_path, "--policy", "h2o", "--layout", "per_head", "--kv-mode", "fast",
                        "--budget", "1000000000")
    assert res.exit_code == 2 and "Traceback" not in res.output
    message = " ".join(res.output.split())
    assert "fast-mode slabs" in message and "lower --budget (largest part: fast-mode slabs)" in message


def test_run_memory_estimate_is_small_for_ordinary_runs_and_checked_against_what_is_given():
    from kvsim.sim.config import load_config
    from kvsim.sim.model.memory import HostMemoryError, check_memory
    from kvsim.sim.engine.run_plan import build_run_plan, check_config_memory
    from kvsim.sim.simulator.simulate import load_workload

    cfg = load_config(None, {"trace_options.max_requests": 200, "engine.enable_prefix_caching": True})
    trace = load_workload(cfg)
    plan = build_run_plan(cfg, trace=trace)
    blocks = plan.num_blocks
    estimate = check_config_memory(cfg, trace)                   # the dashboard's entry point: passes
    assert estimate.total_bytes == plan.memory.total_bytes
    assert blocks * 139 < estimate.total_bytes < 64 * 2**20
    check_memory(estimate, available=(estimate.total_bytes, "test"))
    with pytest.raises(HostMemoryError, match=r"0\.0 GiB is available \(test\); lower --num-gpu-blocks"):
        check_memory(estimate, available=(estimate.total_bytes - 1, "test"))
    fast = load_config(None, {"kv.policy": "h2o", "kv.budget": 256, "kv.layout": "per_head", "kv.mode": "fast",
                              "trace_options.max_requests": 200})
    slab = dict((p[0], p[3]) for p in build_run_plan(fast, trace=trace).memory.parts)
    bigger = load_config(None, {**fast.model_dump(), "kv": {**fast.kv.model_dump(), "budget": 2560}})
    slab10 = dict((p[0], p[3]) for p in build_run_plan(bigger, trace=trace).memory.parts)
    assert 0 < slab["fast-mode slabs"] < slab10["fast-mode slabs"] < 11 * slab["fast-mode slabs"]
