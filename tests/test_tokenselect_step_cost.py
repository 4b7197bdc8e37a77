"""TokenSelect's and Quest's selection work as the simulator's step cost charges it (sim/simulator/executor.py,
sim/kv/policies/quest.py, sim/kv/policies/selection_work.py): TokenSelect's scoring reads every key's K at
attention's bandwidth, its soft vote and top-k are op bytes, each prefill selection chunk attends to the
selected tokens only; Quest's decode metadata and full prefill. At long context the speedup over full
attention saturates at the bound the selection's read of all K sets."""
import numpy as np
import pandas as pd
import pytest

from kvsim.sim.config import load_config
from kvsim.sim.core.step import BatchShape
from kvsim.sim.engine.resolved_run import resolve_hardware, with_engine_defaults
from kvsim.sim.kv.policies import selection_work as sw
from kvsim.sim.kv.policy import PolicyContext, get_policy
from kvsim.sim.model.cost_model import CostModel
from kvsim.sim.simulator.simulate import run_simulation
from kvsim.traces.synthetic import closed_batch

READ, ENGINE_CHUNK, REUSE = 2688, 8192, 0.21
CONTEXTS = (1 << 17, 1 << 18, 1 << 19)          # 128K, 256K, 512K prompts


@pytest.fixture(autouse=True)
def past_trained_positions(monkeypatch):
    # the prompts go past Qwen2.5-0.5B's 32,768 trained positions (TokenSelect's length extrapolation):
    # allowed, as in vLLM, by VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 (docs/simulate.md)
    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")


def llama(gpu: str, reuse: float = 0.0):
    cost = CostModel("llama-3.1-8b", gpu)
    m = cost.model
    rows = m.num_layers * m.num_kv_heads
    ctx = PolicyContext("per_head", m.num_layers, m.num_kv_heads, m.num_heads, 16, rows, head_dim=m.head_dim,
                        bytes_per_token_row=cost.kv_bytes_per_token / rows)
    return cost, get_policy("tokenselect", budget=READ, dense_layers=0, reuse_rate=reuse), ctx


def attention_s(cost, **shape) -> float:
    """The step cost's attention term plus its policy-operation term (the selection's soft vote and top-k)."""
    b = cost.breakdown(BatchShape(**shape))
    return float(b["attention"] + b["copy"])


def chunk_speedup(cost, policy, ctx, n: int) -> float:
    """Full over selective attention of one selection chunk (512 queries) ending at context n."""
    q = policy.prefill_chunk
    c = policy.prefill_cost(n - q, q, ctx)
    full = attention_s(cost, num_prefill_tokens=q, attn_pairs_prefill=float(sw.causal_pairs(q, n)), kv_tokens_read=n)
    return full / attention_s(cost, num_prefill_tokens=q, attn_pairs_prefill=c.pairs, kv_tokens_read=c.kv_read,
                              op_bytes=c.op_bytes)


def prefill_speedup(cost, policy, ctx, n: int) -> float:
    """Full over selective attention of a whole prefill of n tokens in engine chunks of 8,192."""
    full = sel = 0.0
    for start in range(0, n, ENGINE_CHUNK):
        k = min(ENGINE_CHUNK, n - start)
        full += attention_s(cost, num_prefill_tokens=k, attn_pairs_prefill=k * (start + (k + 1) / 2),
                            kv_tokens_read=start + k)
        c = policy.prefill_cost(start, k, ctx)
        sel += attention_s(cost, num_prefill_tokens=k, attn_pairs_prefill=c.pairs, kv_tokens_read=c.kv_read,
                           op_bytes=c.op_bytes)
    return full / sel


def k_read_bound(cost) -> float:
    """The speedup of a selection chunk as the context grows, from the GPU's specs and profile alone:
    full attention costs c query-key pairs of compute per key (4 x layers x heads x head_dim FLOPs each,
    at attn_compute_eff of the bf16 peak); the selection reads the key's K once (half its KV bytes, at
    attn_bw_eff of the memory bandwidth) and moves 396 bytes of scores per layer (32 heads, at copy_bw_eff)."""
    m, g, p = cost.model, cost.gpu, cost.profile
    # (the cost model also counts the full chunk's read of each key as one more pair of compute: c + 1)
    full = 513 * 4 * m.num_layers * m.num_heads * m.head_dim / (g.peak_flops("bf16") * p.attn_compute_eff)
    k_read = cost.kv_bytes_per_token / 2 / (g.mem_bw * p.attn_bw_eff)
    scores = m.num_layers * (12 * m.num_heads + 12) / (g.mem_bw * p.copy_bw_eff)
    return full / (k_read + scores)


@pytest.mark.parametrize("gpu", ["h100", "a100-80gb"])
def test_attention_speedup_saturates_at_the_bound_of_the_selections_k_read(gpu):
    cost, policy, ctx = llama(gpu)
    bound = k_read_bound(cost)
    chunk = np.array([chunk_speedup(cost, policy, ctx, n) for n in (1 << 14, 1 << 16, 1 << 18, 1 << 20, 1 << 22)])
    assert (np.diff(chunk) > 0).all() and (chunk < bound).all() and chunk[-1] > 0.98 * bound
    whole = np.array([prefill_speedup(cost, policy, ctx, n) for n in (1 << 15, 1 << 17, 1 << 19, 1 << 20)])
    assert (np.diff(whole) > 0).all() and (whole < bound).all()
    assert whole[-1] / whole[-2] < 1.15          # saturated: doubling 512K to 1M adds little
    # without the selection's kernels (the pairs alone) the speedup would grow without bound
    q = policy.prefill_chunk
    pairs_only = [float(sw.causal_pairs(q, n)) / policy.prefill_cost(n - q, q, ctx).pairs for n in (1 << 18, 1 << 20)]
    assert pairs_only[1] > 3.9 * pairs_only[0] and pairs_only[0] > bound


def test_the_bound_follows_the_gpus_bandwidth_to_compute_ratio():
    # A100: 2.0 TB/s for 312 TFLOP/s; H100: 3.35 TB/s for 989 TFLOP/s -- the K read costs relatively more
    # on the H100, so selection saves less there
    h100, a100 = k_read_bound(CostModel("llama-3.1-8b", "h100")), k_read_bound(CostModel("llama-3.1-8b", "a100-80gb"))
    assert 20 < h100 < 35 and 40 < a100 < 65 and a100 > 1.5 * h100


@pytest.mark.parametrize("reuse", [0.0, REUSE])
def test_decode_speedup_is_bounded_by_the_k_read_and_the_reuse_rate(reuse):
    cost, policy, ctx = llama("h100", reuse)
    m, p = cost.model, cost.profile
    s = []
    for n in (1 << 16, 1 << 18, 1 << 20):
        full = attention_s(cost, num_seqs=1, num_decode_tokens=1, kv_tokens_read=n)
        sel = attention_s(cost, num_seqs=1, num_decode_tokens=1, kv_tokens_read=float(policy.mean_read([n], ctx)[0]),
                          op_bytes=policy.decode_op_bytes(n, ctx))
        s.append(full / sel)
    # per key: full reads K and V; the selection reads K and moves the score bytes, on the (1 - r) share
    scores = m.num_layers * 396 / p.copy_bw_eff / (cost.kv_bytes_per_token / p.attn_bw_eff)
    bound = 1 / ((1 - reuse) * (0.5 + scores))
    assert (np.diff(s) > 0).all() and (np.array(s) < bound).all() and s[-1] > 0.97 * bound
    assert bound < 2 / (1 - reuse)                # the score passes cost more than nothing


def config(prompt: int, kv: dict, **engine):
    return load_config(None, {"model": "qwen2.5-0.5b", "gpu": "h100", "kv": kv, "engine": {
        "max_num_batched_tokens": ENGINE_CHUNK, "max_model_len": prompt + 64, **engine}})


def steps(tmp_path, prompt: int, kv: dict, output: int = 4, **engine) -> pd.DataFrame:
    out = tmp_path / f"{kv['policy']}-{prompt}"
    run_simulation(config(prompt, kv, **engine), out, trace=closed_batch(1, prompt, output))
    return pd.read_parquet(out / "steps.parquet")


def tokenselect(reuse: float, dense_layers: int = 0) -> dict:
    return {"policy": "tokenselect", "layout": "per_head", "mode": "fast",
            "params": {"budget": READ, "dense_layers": dense_layers, "reuse_rate": reuse}}


def qwen_policy(prompt: int, reuse: float, **engine):
    """The run's cost model and the policy with its context."""
    cost = resolve_hardware(with_engine_defaults(config(prompt, tokenselect(reuse), **engine))).cost
    m = cost.model
    rows = m.num_layers * m.num_kv_heads
    ctx = PolicyContext("per_head", m.num_layers, m.num_kv_heads, m.num_heads, 16, rows, head_dim=m.head_dim,
                        bytes_per_token_row=cost.kv_bytes_per_token / rows)
    return cost, get_policy("tokenselect", budget=READ, dense_layers=0, reuse_rate=reuse), ctx


def test_the_simulator_charges_the_selection_in_every_step(tmp_path):
    n = CONTEXTS[0]
    # synchronous scheduling: a step takes device + host time, so the decode steps' selection shows too
    log = steps(tmp_path, n, tokenselect(REUSE), async_scheduling=False)
    cost, policy, ctx = qwen_policy(n, REUSE, async_scheduling=False)
    prefill = log[log["prefill_tokens"] > 0]
    starts = range(0, n, ENGINE_CHUNK)
    assert len(prefill) == len(starts)
    for (_, row), start in zip(prefill.iterrows(), starts, strict=True):
        c = policy.prefill_cost(start, ENGINE_CHUNK, ctx)
        assert row["attn_pairs_prefill"] == pytest.approx(c.pairs, rel=1e-12)
        assert row["kv_tokens_read"] == int(c.kv_read)       # the step log rounds reads to whole tokens
        shape = dict(num_seqs=1, num_prefill_tokens=ENGINE_CHUNK, attn_pairs_prefill=c.pairs, kv_tokens_read=c.kv_read,
                     block_table_entries=int(row["block_table_entries"]))
        with_ops = float(cost.predict(BatchShape(**shape, op_bytes=c.op_bytes, op_kernels=c.kernels)))
        assert row["duration_s"] == pytest.approx(with_ops, rel=1e-9)
        if start >= 1 << 16:                 # the score passes are a visible share of a long-context step
            assert with_ops > 1.01 * float(cost.predict(BatchShape(**shape, op_kernels=c.kernels)))
        selections = sum(1 for end in range(start + 512, start + ENGINE_CHUNK + 1, 512) if end > READ)
        # every selection chunk's small kernels (selection_work: routing, scoring, the chunk's own) in each layer
        assert c.kernels == ctx.num_layers * selections * 33
        assert with_ops - float(cost.predict(BatchShape(**shape, op_bytes=c.op_bytes))) == pytest.approx(
            c.kernels * cost.profile.gemm_latency_s, rel=1e-9)
    last = log.iloc[-1]                      # a decode step: its selection's score bytes are charged too
    ctx_n = n + 3
    shape = dict(num_seqs=1, num_decode_tokens=1, kv_tokens_read=float(last["kv_tokens_read"]),
                 block_table_entries=int(last["block_table_entries"]))
    kernels = policy.decode_op_kernels(ctx_n, ctx)
    assert kernels == pytest.approx(ctx.num_layers * (18 + (1 - REUSE) * 9))     # routing + the scoring share
    with_ops = float(cost.predict(BatchShape(**shape, op_bytes=policy.decode_op_bytes(ctx_n, ctx), op_kernels=kernels)))
    assert last["duration_s"] == pytest.approx(with_ops, rel=1e-4)    # the log's read is rounded
    assert with_ops > 1.01 * float(cost.predict(BatchShape(**shape, op_kernels=kernels)))


@pytest.mark.parametrize("reuse", [0.0, REUSE])
def test_tokenselect_decode_read_grows_with_context_towards_the_reuse_bound(tmp_path, reuse):
    s = []
    for n in CONTEXTS:
        full, sel = steps(tmp_path, n, {"policy": "none"}), steps(tmp_path, n, tokenselect(reuse))
        s.append(full["kv_tokens_read"].iloc[-1] / sel["kv_tokens_read"].iloc[-1])
    # the last decode step: n + 2 tokens cached before it, its own token read in full
    expected = [(n + 3) / (READ + (1 - reuse) * (n + 2) / 2 + 1) for n in CONTEXTS]
    assert s == pytest.approx(expected, rel=1e-5)       # the step log rounds reads to whole tokens
    assert (np.diff(s) > 0).all() and (np.array(s) < 2 / (1 - reuse)).all()


def test_dense_layers_and_quest_prefill_attend_in_full(tmp_path):
    n = CONTEXTS[0]
    full_pairs = steps(tmp_path, n, {"policy": "none"})["attn_pairs_prefill"].sum()
    sel_pairs = steps(tmp_path, n, tokenselect(REUSE, dense_layers=2))["attn_pairs_prefill"].sum()
    share = 2 / 24                                 # Qwen2.5-0.5B: 24 layers, the first 2 dense
    selective = sum(sw.prefill_selection(s, s + ENGINE_CHUNK, 512, READ).pairs for s in range(0, n, ENGINE_CHUNK))
    assert sel_pairs == pytest.approx(share * full_pairs + (1 - share) * selective)
    quest = steps(tmp_path, n, {"policy": "quest", "layout": "per_head", "mode": "fast",
                                "params": {"budget": READ, "score_interval": 4}})
    assert quest["attn_pairs_prefill"].sum() == pytest.approx(full_pairs)


def test_quest_scoring_interval_divides_the_metadata_read(tmp_path):
    n = CONTEXTS[0]
    reads = {k: steps(tmp_path, n, {"policy": "quest", "layout": "per_head", "mode": "fast",
                                    "params": {"budget": READ, "dense_layers": 0, "score_interval": k}})
             ["kv_tokens_read"].iloc[-1] for k in (1, 4)}
    pages = -(-(n + 2) // 16)                    # the last decode step: n + 2 cached, its own token
    assert reads[1] == pytest.approx(READ + pages + 1, rel=1e-12)
    assert reads[4] == int(READ + pages / 4 + 1)            # the step log rounds reads to whole tokens
