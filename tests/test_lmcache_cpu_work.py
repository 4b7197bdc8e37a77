"""LMCache's CPU work inside the step (connector lmcache, sim/cluster/connectors/offload.py `LMCacheCPUWork`): a
lookup hashes the whole prompt, hit or miss, before the step's forward; a save hashes the request's chunks from its
first token up to what it saves and puts each new chunk, after it. Priced on the step as the transfers are; off
(zero) it changes nothing; the options are refused with vLLM's connector."""
import pytest

from kvsim.sim.cluster.connectors.offload import LMCacheCPUWork, OffloadingConnector
from kvsim.sim.cluster.links import Link, LinkSpec
from kvsim.sim.cluster.tiers import BlockTier, TierSpec
from kvsim.sim.config import ConfigError, load_config
from kvsim.sim.core.request import Request

HASH, PUT = 1e-6, 1e-4      # round figures, so the sums below are exact to read


NOW = [0.0]


def lmcache_connector(work):
    NOW[0] = 0.0
    spec = TierSpec("cpu", 100, 1e6, LinkSpec("pcie", 1.0, 0.0))
    return OffloadingConnector(BlockTier(spec), Link(spec.link), Link(spec.link), 256, lambda: NOW[0], lmcache=work)


def step(req, computed: int, new: int):
    """The scheduler's output of a step that gives `req` `new` tokens after `computed` (one second after the last:
    the link is idle again)."""
    req.num_computed_tokens = computed
    NOW[0] += 1.0

    class Out:
        preempted: list = []
        scheduled = [type("S", (), {"request": req, "num_new_tokens": new})()]
    return Out


def test_a_miss_costs_the_lookups_hashing_then_each_saves_hashing_from_the_first_token_and_its_puts():
    conn = lmcache_connector(LMCacheCPUWork(HASH, PUT))
    req = Request(request_id=1, arrival_time=0.0, prompt_tokens=1100, max_output_tokens=4)
    assert conn.get_num_new_matched_tokens(req, 0) == (0, False)          # a miss: nothing stored yet
    conn.update_state_after_alloc(req, 0)
    first = conn.build_connector_meta(step(req, 0, 600))                  # chunked prefill: 600 tokens, 2 chunks
    copy = 2 * 1e6 / 1e9                                                  # two chunks over the 1 GB/s link
    assert first.load_s == pytest.approx(HASH * 1100)                     # the lookup hashed the prompt
    assert first.save_s == pytest.approx(copy + HASH * 512 + PUT * 2)
    second = conn.build_connector_meta(step(req, 600, 500))               # the rest: chunks 3 and 4 full
    assert second.load_s == 0.0
    assert second.save_s == pytest.approx(copy + HASH * 1024 + PUT * 2)  # hashed again from token 0
    assert conn.cpu_s == pytest.approx(HASH * (1100 + 512 + 1024) + PUT * 4)


def test_without_cpu_work_the_step_waits_for_the_copies_only():
    conn = lmcache_connector(LMCacheCPUWork(0.0, 0.0))
    req = Request(request_id=1, arrival_time=0.0, prompt_tokens=1100, max_output_tokens=4)
    conn.update_state_after_alloc(req, 0)
    first, second = conn.build_connector_meta(step(req, 0, 600)), conn.build_connector_meta(step(req, 600, 500))
    assert first.load_s == second.load_s == 0.0
    assert first.save_s == pytest.approx(2e-3) and second.save_s == pytest.approx(2e-3)   # the copies only
    assert conn.cpu_s == 0.0


def test_a_simulated_miss_workload_spends_the_cpu_work_and_it_slows_the_run(tmp_path):
    from kvsim.sim.simulator.simulate import run_simulation
    rand = {"trace": "random", "trace_options.random.input_len": 2048, "trace_options.random.output_len": 16,
            "trace_options.max_requests": 20, "seed": 1, "kv_offload.cpu_gib": 8, "kv_offload.connector": "lmcache"}
    with pytest.warns(UserWarning):
        on = run_simulation(load_config(None, rand), tmp_path / "on").summary
    with pytest.warns(UserWarning):
        off = run_simulation(load_config(None, {**rand, "kv_offload.lmcache_hash_s_per_token": 0,
                                                "kv_offload.lmcache_put_s_per_chunk": 0}), tmp_path / "off").summary
    assert "lmcache_cpu_s" not in off["kv_offload"] or off["kv_offload"]["lmcache_cpu_s"] == 0
    chunks = on["kv_offload"]["blocks_stored"]
    # at least every prompt hashed at its lookup and every stored chunk put
    assert on["kv_offload"]["lmcache_cpu_s"] >= 3.2e-8 * 20 * 2048 + 1.8e-5 * chunks
    assert on["duration"] > off["duration"]


def test_lmcache_cpu_options_are_refused_with_vllms_connector_in_one_line():
    with pytest.raises(ConfigError, match=r"kv_offload\.lmcache_put_s_per_chunk: only kv_offload\.connector lmcache"):
        load_config(None, {"kv_offload.cpu_gib": 4, "kv_offload.lmcache_put_s_per_chunk": 1e-5})
    with pytest.raises(ConfigError, match=r"kv_offload\.lmcache_hash_s_per_token"):
        load_config(None, {"kv_offload.cpu_gib": 4, "kv_offload.connector": "lmcache",
                           "kv_offload.lmcache_hash_s_per_token": -1})
