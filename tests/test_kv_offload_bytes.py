"""Bytes of an offloaded KV block follow what the block really weighs (issue 44: "bytes moved per block follow
the block's real size under the KV dtype and any compression or quantization policy"): a 4-bit KV dtype moves a
quarter of bf16's bytes for the same blocks and its CPU tier holds four times the blocks; a mixed-precision
policy (LeanKV) offloads its tokens at the precision it writes them (K8V4 and its scales); eviction policies,
which write whole blocks and drop tokens later, offload whole blocks. The KV policies' managers take the tokens
a connector loads (they have no prefix cache of their own), with the engine's invariants checked every step."""
import pytest

from shared_documents import document_requests

from kvsim.sim.cluster.connectors.offload import cpu_tier_spec, offload_connectors
from kvsim.sim.config import load_config
from kvsim.sim.core.request import RequestStatus
from kvsim.sim.engine.assembly import build_engine, load_workload
from kvsim.sim.engine.resolved_run import resolve_run
from kvsim.sim.kv.precision import PRECISION_FORMATS
from kvsim.sim.model.catalog import get_model
from kvsim.sim.results.metrics import StepLog
from kvsim.sim.simulator.executor import replica_parts

BASE = {"engine.num_gpu_blocks": 300, "trace_options.max_requests": 1, "check_invariants": True}


def run_offloaded(cpu_gib: float, n: int = 40, **overrides):
    """`n` requests over 8 shared documents through the engine with a CPU tier of `cpu_gib`: the requests and
    the replica's connector."""
    cfg = load_config(None, {**BASE, "kv_offload.cpu_gib": cpu_gib, **overrides})
    plan = resolve_run(cfg, trace=load_workload(cfg))
    requests = document_requests(n, 3, documents=8, chunks=(4, 12), mean_gap_s=0.15, max_output=64)
    factory = offload_connectors(cpu_tier_spec(plan.cfg.kv_offload, plan), plan.cfg.engine.block_size)
    run = build_engine(plan, requests, StepLog(None), lambda i: replica_parts(plan, i), connector=factory)
    assert run.drive(catch=()) is None
    (conn,) = factory.made
    assert all(r.status == RequestStatus.FINISHED for r in requests)
    return requests, conn


def transfer_bytes_per_block(requests, kind: str) -> set[float]:
    return {t.nbytes / (t.num_tokens // 16) for r in requests for t in r.route.transfers if t.kind == kind}


def test_a_4bit_kv_dtype_moves_a_quarter_of_bf16s_bytes_and_its_tier_holds_four_times_the_blocks():
    bf16_reqs, bf16 = run_offloaded(1.0, **{"engine.enable_prefix_caching": True})
    int4_reqs, int4 = run_offloaded(1.0, **{"engine.enable_prefix_caching": True, "kv_dtype": "int4"})
    full = get_model("llama-3.1-8b").kv_bytes_per_token("bf16") * 16
    assert bf16.tier.spec.bytes_per_block == full == 2 * 2**20
    assert int4.tier.spec.bytes_per_block == full / 4
    assert int4.tier.capacity == 4 * bf16.tier.capacity
    # every transfer moves the block's real bytes, on both links
    assert transfer_bytes_per_block(bf16_reqs, "store") == transfer_bytes_per_block(bf16_reqs, "load") == {full}
    assert transfer_bytes_per_block(int4_reqs, "store") == transfer_bytes_per_block(int4_reqs, "load") == {full / 4}
    assert bf16.to_tier.bytes_moved == bf16.tier.stats.blocks_stored * full
    assert int4.to_tier.bytes_moved == int4.tier.stats.blocks_stored * full / 4
    assert int4.from_tier.bytes_moved == int4.tier.stats.blocks_loaded * full / 4


def test_a_small_tier_holds_more_quantized_blocks_and_so_serves_more_hits():
    # 0.25 GiB: 128 bf16 blocks (about one document), 512 int4 blocks (most of the eight)
    _, bf16 = run_offloaded(0.25, **{"engine.enable_prefix_caching": True})
    _, int4 = run_offloaded(0.25, **{"engine.enable_prefix_caching": True, "kv_dtype": "int4"})
    assert bf16.tier.stats.blocks_evicted > 0 and bf16.tier.stats.stores_dropped > 0   # stores it cannot take
    assert int4.tier.stats.stores_dropped < bf16.tier.stats.stores_dropped
    assert int4.num_hit_tokens > 1.5 * bf16.num_hit_tokens


POLICY = {"engine.enable_prefix_caching": False}


@pytest.mark.parametrize("policy, mode", [("leankv", "token"), ("h2o", "token"), ("h2o", "fast")])
def test_kv_policies_offload_the_bytes_they_write_and_take_loaded_tokens(policy, mode):
    budget = {} if policy == "leankv" else {"kv.budget": 512}
    reqs, conn = run_offloaded(1.0, n=24, **POLICY, **budget, **{"kv.policy": policy, "kv.mode": mode})
    model = get_model("llama-3.1-8b")
    full = model.kv_bytes_per_token("bf16") * 16
    per_head_token = model.kv_bytes_per_token("bf16") / (model.num_layers * model.num_kv_heads)
    expected = full * PRECISION_FORMATS["K8V4"].bytes_per_token(model.head_dim) / per_head_token \
        if policy == "leankv" else full
    assert conn.tier.spec.bytes_per_block == pytest.approx(expected, rel=1e-12)
    if policy == "leankv":
        assert 0.35 < expected / full < 0.4        # 12 bits per K and V element and per-token scales
    assert transfer_bytes_per_block(reqs, "store") == {conn.tier.spec.bytes_per_block}
    # no GPU prefix cache: every reuse of a document is a CPU hit, loaded into the policy's pages
    loaded = [r for r in reqs if r.num_external_computed_tokens]
    assert len(loaded) >= 8
    assert transfer_bytes_per_block(reqs, "load") == {conn.tier.spec.bytes_per_block}
    if policy == "h2o":
        # the loaded prompt is in the policy's pages: H2O cut it to its budget as it cuts a computed one
        assert all(r.kv_evicted_tokens >= r.prompt_tokens - 512 - 16 for r in loaded)
