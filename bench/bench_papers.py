"""The papers' headline comparisons: kvsim's figure beside the published one.

SpvLLM (slot strategies under H2O), as its code (github.com/Charlie-XIAO/sparse-vllm, cs243/) runs it:
1,000 requests at t=0 with ShareGPT's length filter of vLLM's benchmark_serving (prompt <= 1,024,
prompt + output <= 2,048; lengths here lognormal, mean 225 / 209 before the filter, CV 1, seed 0),
OPT-125m (the script's default model) on one T4, batch 256, fast mode, budgets 256 / 512 / 1,024. Its
H2O averages the attention over all layers and heads and evicts per sequence (kvsim's `shared`
layout); it accumulates decode attention only, so the first decode step's single query cuts a longer
prompt to the budget (kvsim's prompt cut with `obs_window: 1`), then one token goes per step. Printed:
p99 fragmentation of noop / free_block / slot_reuse and the two ratios (published at budget 256:
slot_reuse 0.79x free_block's and 0.44x noop's; strategies converging at 1,024). The default setup scores
with `smollm2-135m-aged` (the age profile fitted to real head-averaged attention) in token mode (~450 s
CPU); `--setup spvllm-unfitted` is the unfitted model in fast mode (~10 s). `--setup per-step`
gives the earlier per_head, no-cut (`evict_per_step: 1`) reading of the setting. `--only spvllm-code`
replays the workload through SpvLLM's own code path (bench/spvllm_code.py: its kernel's seq_len under
slot reuse, paged_attention_v2's partition-relative score indices), each fact on and off. `--only
spvllm-tail` shows where each strategy's p99 at budget 1,024 comes from (the run's tail; ~160 s CPU,
~5 s with `--setup spvllm-unfitted`). `--only spvllm-copy` puts sparse copy's volume as SpvLLM's code
copies it (bench/spvllm_code.py `copy_lines`: every kept token after each eviction) beside kvsim's (fast
mode) at `kv.copy_threshold` 0 / 16 / 64 / 256, with the copy time kvsim's cost model charges on the T4
(published: 0.18 s of "copy overhead" in 2,007 calls, host time around the asynchronous launch; ~55 s CPU).

TokenSelect (selective attention at long contexts), as the paper's code runs it (n_init 128 + top_k
2,048 + n_local 512 = 2,688 tokens read, selection chunks of 512 queries in engine chunks of 8,192;
sim/kv/policies/selection_work.py): attention time, full over selective with the selection's kernels
(the K read of every key, the soft vote and top-k) as the simulator's step cost prices them, for
Llama-3.1-8B on an A100-80GB (the paper's GPU) and an H100, 8K-1M tokens: one decode step (without
the Selection Cache and with the reuse rate measured on SmolLM2-135M's queries, `--reuse-rate`,
default 0.21 at threshold 0.9), a whole prefill, and one selection chunk at that context (where the
speedup saturates); then the simulator on one request (H100): decode read, prefill steps' time and
end to end (published: up to 23.84x attention, 2.28x end to end).

Throughput headlines (`--only others`, ~100 s CPU, LeanKV's fast mode most of it), each against
`none` on the same workload (closed batches; the workloads are this script's choices where the
papers' exact grids are not restated): KV-Compress, total token throughput at compression rate 8
and 64, 256 x 6,000-token prompts + 500 outputs, Llama-3.1-8B / L4 (bench_kv_policies.py's
workload A; published: up to 5.18x); LeanKV (K8V4 / K4V2 precision groups, per_head, slot_reuse), total
throughput, 64 x 2,000 + 2,000, Qwen2.5-32B / 2x L40 (workload B; published 1.9-2.5x, up to 6.9x);
SnapKV (budget 1,024 per head), decode speed (TPOT) of one request with a 16K-token prompt and 512
outputs, Llama-2-7B shape (the paper's LWM-Text-Chat-1M) / A100-80GB (published 3.6x, against a
HuggingFace eager baseline).

Attention check (`--only attention`, needs torch and the SmolLM2 weights of the real backend): the
share of H2O's evicted slots lying in wholly evicted pages (what free_block gives back) after a
700-token prompt is cut at the first decode query and 300 tokens are decoded, real SmolLM2-135M
attention against the importance model, per sequence on the head-averaged score (SpvLLM) and per head.

    python bench/bench_papers.py                # SpvLLM, TokenSelect, the others (~110 s CPU)
    python bench/bench_papers.py --only tokenselect     # ~2 s CPU
    python bench/bench_papers.py --only spvllm-code    # SpvLLM's own code path (~5 min CPU)
    python bench/bench_papers.py --only spvllm-copy    # sparse copy's volume (~1 min CPU)
    python bench/bench_papers.py --only attention   # ~2 min CPU
"""
from __future__ import annotations

import argparse
import os
import time
from contextlib import contextmanager

import numpy as np

SPV_PUBLISHED = {256: (0.79, 0.44)}            # slot_reuse / free_block, slot_reuse / noop (p99 fragmentation)
SPV_COPY_PUBLISHED = (0.18, 2007)              # sparse copy: copy overhead (s, summed), calls (cs243/analyze.py)
TOKENSELECT_PUBLISHED = 23.84                  # attention speedup, the paper's best at long context
TOKENSELECT_READ = 128 + 2048 + 512            # n_init + top_k + n_local
TOKENSELECT_ENGINE_CHUNK = 8192                 # the config's chunk_size: SGLang's chunked_prefill_size
TOKENSELECT_CONTEXTS = tuple(1 << k for k in range(13, 21))     # 8K .. 1M


@contextmanager
def past_trained_positions():
    """TokenSelect's prompts (to 256K on Llama-3.1-8B, trained to 131,072) and SnapKV's 16K prompt on the
    Llama-2-7B shape (LWM-Text-Chat-1M's; Llama-2-7B is trained to 4,096) go past the stand-in model's
    max_position_embeddings: allowed as vLLM allows it, with VLLM_ALLOW_LONG_MAX_MODEL_LEN=1."""
    from kvsim.sim.model.defaults import ALLOW_LONG_MAX_MODEL_LEN as key
    before = os.environ.get(key)
    os.environ[key] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = before


def spvllm_trace(n: int = 1000, seed: int = 0):
    """`n` requests at t=0: lognormal lengths (mean 225 / 209, CV 1) kept where benchmark_serving keeps a
    ShareGPT pair (4 <= prompt <= 1,024, output >= 4, prompt + output <= 2,048)."""
    from kvsim.traces.synthetic import synthesize
    from kvsim.traces.trace import Trace

    df = synthesize(3 * n, prompt="lognormal:225,1.0,2048", output="lognormal:209,1.0,2048", seed=seed).df
    p, o = df["prompt_tokens"].to_numpy(), df["output_tokens"].to_numpy()
    keep = (p >= 4) & (o >= 4) & (p <= 1024) & (p + o <= 2048)
    return Trace.from_columns(arrival_time_s=np.zeros(n), prompt_tokens=p[keep][:n], output_tokens=o[keep][:n],
                              name=f"spvllm-seed{seed}", source="synthetic")


SETUPS = {      # model, layout, H2O parameters, importance model, kv.mode
    "spvllm": ("opt-125m", "shared", {"obs_window": 1}, "smollm2-135m-aged", "token"),
    "spvllm-unfitted": ("opt-125m", "shared", {"obs_window": 1}, "smollm2-135m", "fast"),
    "per-step": ("opt-1.3b", "per_head", {"evict_per_step": 1}, "smollm2-135m", "fast"),
}


def spvllm(budget: int, strategy: str, setup: str = "spvllm", n: int = 1000) -> dict:
    from kvsim.sim.config import load_config
    from kvsim.sim.simulator.simulate import run_simulation

    model, layout, params, importance, mode = SETUPS[setup]
    kv = {"policy": "h2o", "budget": budget, "layout": layout, "slot_strategy": strategy, "mode": mode,
          "params": params, "importance": importance}
    cfg = load_config(None, {"model": model, "gpu": "t4", "kv": kv, "engine": {"max_num_seqs": 256}})
    return run_simulation(cfg, trace=spvllm_trace(n)).summary


def print_spvllm(setup: str) -> None:
    model, _, _, importance, mode = SETUPS[setup]
    print(f"SpvLLM: p99 fragmentation, H2O ({setup} setup, {mode} mode, importance {importance}, 1,000 requests, "
          f"{model}, T4)")
    print(f"{'budget':>7}{'noop':>8}{'free_block':>12}{'slot_reuse':>12}{'sr/fb':>8}{'sr/noop':>9}{'published':>18}")
    for budget in (256, 512, 1024):
        p99 = {st: spvllm(budget, st, setup)["fragmentation_p99"] for st in ("noop", "free_block", "slot_reuse")}
        pub = SPV_PUBLISHED.get(budget)
        pub_s = f"{pub[0]:.2f} / {pub[1]:.2f}" if pub else "converge" if budget == 1024 else "-"
        print(f"{budget:>7}{p99['noop']:>8.3f}{p99['free_block']:>12.3f}{p99['slot_reuse']:>12.3f}"
              f"{p99['slot_reuse'] / p99['free_block']:>8.2f}{p99['slot_reuse'] / p99['noop']:>9.2f}{pub_s:>18}",
              flush=True)


def spvllm_tail(budget: int, setup: str = "spvllm") -> dict:
    """Where the p99 of each strategy comes from: {strategy: (p99, mean, steps, steps of <= 3 sequences,
    live and allocated slots of the steps at or over the p99, evicted tokens, blocks freed)}."""
    from kvsim.sim.config import load_config
    from kvsim.sim.simulator.simulate import run_simulation

    model, layout, params, importance, mode = SETUPS[setup]
    out = {}
    for strategy in ("noop", "free_block", "slot_reuse"):
        kv = {"policy": "h2o", "budget": budget, "layout": layout, "slot_strategy": strategy, "mode": mode,
              "params": params, "importance": importance}
        cfg = load_config(None, {"model": model, "gpu": "t4", "kv": kv, "engine": {"max_num_seqs": 256}})
        r = run_simulation(cfg, trace=spvllm_trace())
        steps, frag = r.steps, r.steps["fragmentation"].to_numpy()
        p99 = float(np.percentile(frag, 99))
        top = steps[frag >= p99]
        out[strategy] = {"p99": p99, "mean": float(frag.mean()), "frag": frag, "steps": len(steps),
                         "small_batch_steps": int((steps["batch_size"] <= 3).sum()),
                         "top_batch": float(top["batch_size"].mean()), "top_live": float(top["live_slots"].mean()),
                         "top_allocated": float(top["allocated_slots"].mean()),
                         "evicted": int(r.summary["evicted_tokens"]),
                         "blocks_freed": int(r.summary["blocks_freed_by_eviction"])}
    return out


def spvllm_p99_requests(budget: int = 256, strategy: str = "free_block", setup: str = "spvllm-unfitted") -> list[int]:
    """Ids of the requests running in the steps at or over the run's p99 fragmentation (the sequences whose
    tables make `strategy`'s p99 in SpvLLM's setting)."""
    from kvsim.sim.config import load_config
    from kvsim.sim.simulator.simulate import run_simulation

    model, layout, params, importance, mode = SETUPS[setup]
    kv = {"policy": "h2o", "budget": budget, "layout": layout, "slot_strategy": strategy, "mode": mode,
          "params": params, "importance": importance}
    cfg = load_config(None, {"model": model, "gpu": "t4", "kv": kv, "engine": {"max_num_seqs": 256}})
    r = run_simulation(cfg, trace=spvllm_trace())
    steps, req = r.steps, r.requests
    frag = steps["fragmentation"].to_numpy()
    ids: set[int] = set()
    for end, dur in steps.loc[frag >= np.percentile(frag, 99), ["time_s", "duration_s"]].itertuples(index=False):
        running = (req["first_scheduled_s"] <= end - dur + 1e-12) & (req["finish_s"] >= end - 1e-12)
        ids |= set(req.loc[running, "request_id"].tolist())
    return sorted(ids)


def print_spvllm_tail(budget: int = 1024, setup: str = "spvllm") -> None:
    """Why the strategies do not converge at 1,024: the trace's long requests and the run's tail."""
    df = spvllm_trace().df
    total = (df["prompt_tokens"] + df["output_tokens"]).to_numpy()
    print(f"\nSpvLLM at budget {budget} ({setup}): {int((total > budget).sum())} of {len(df)} requests exceed "
          f"the budget ({int((df['prompt_tokens'] > budget).sum())} prompts), longest {total.max()} tokens")
    print(f"{'strategy':>11}{'p99':>7}{'mean':>7}{'steps':>7}{'<=3 seqs':>9}{'p99 steps: batch':>18}"
          f"{'live':>9}{'allocated':>11}{'evicted':>9}{'freed':>7}")
    tail = spvllm_tail(budget, setup)
    for st, t in tail.items():
        print(f"{st:>11}{t['p99']:>7.3f}{t['mean']:>7.3f}{t['steps']:>7}{t['small_batch_steps']:>9}"
              f"{t['top_batch']:>18.1f}{t['top_live']:>9.0f}{t['top_allocated']:>11.0f}{t['evicted']:>9,}"
              f"{t['blocks_freed']:>7}")
    apart = tail["noop"]["frag"] - tail["slot_reuse"]["frag"] > 0.01
    print(f"steps where slot_reuse is more than 0.01 below noop: {int(apart.sum())} of {len(apart)} "
          f"(from step {int(np.argmax(apart))})")


def print_spvllm_code() -> None:
    """The same workload through SpvLLM's own code path (bench/spvllm_code.py): its kernel's seq_len under
    slot reuse and paged_attention_v2's partition-relative score indices, each on and off at 256."""
    code = _spvllm_code()
    df = spvllm_trace().df
    prompts, outputs = df["prompt_tokens"].to_numpy(), df["output_tokens"].to_numpy()
    print("\nSpvLLM as its code computes it (cs243 lines: decode steps, first 200 dropped; importance "
          "smollm2-135m-aged, shared)")
    print(f"{'budget':>7}{'seq_len':>9}{'v2 idx':>8}{'noop':>8}{'free_block':>12}{'slot_reuse':>12}{'sr/fb':>8}"
          f"{'sr/noop':>9}")
    runs = [(b, code.CodePath()) for b in (256, 512, 1024)]
    runs += [(256, code.CodePath(s, v)) for s, v in ((False, False), (True, False), (False, True))]
    for budget, path in runs:
        p99 = {st: code.fragmentation_p99(code.fragmentation_lines(prompts, outputs, budget, st, path=path))
               for st in ("noop", "free_block", "slot_reuse")}
        print(f"{budget:>7}{'code' if path.seq_len_prefix else 'table':>9}{'on' if path.v2_relative_index else 'off':>8}"
              f"{p99['noop']:>8.3f}{p99['free_block']:>12.3f}{p99['slot_reuse']:>12.3f}"
              f"{p99['slot_reuse'] / p99['free_block']:>8.2f}{p99['slot_reuse'] / p99['noop']:>9.2f}", flush=True)


def _spvllm_code():
    import importlib.util
    import sys
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("spvllm_code", Path(__file__).with_name("spvllm_code.py"))
    code = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = code
    spec.loader.exec_module(code)
    return code


def spvllm_copy(budget: int = 256, thresholds=(0, 16, 64, 256), setup: str = "spvllm-unfitted") -> dict:
    """Sparse copy's volume in SpvLLM's setting: SpvLLM's code replayed (slots its migrate kernel copies,
    launches) against kvsim (fast mode; bytes moved, steps with a copy, the copy time its cost model
    charges on the T4) at each kv.copy_threshold."""
    from kvsim.sim.config import load_config
    from kvsim.sim.model.cost_model import CostModel
    from kvsim.sim.simulator.simulate import run_simulation

    model, layout, params, importance, mode = SETUPS[setup]
    df = spvllm_trace().df
    copied = _spvllm_code().copy_lines(df["prompt_tokens"].to_numpy(), df["output_tokens"].to_numpy(), budget,
                                       importance=importance)
    cost = CostModel(model, "t4")
    out = {"code": {"tokens": int(copied.sum()), "launches": int((copied > 0).sum()), "steps": len(copied),
                    "bytes_per_token": cost.kv_bytes_per_token}}
    for h in thresholds:
        kv = {"policy": "h2o", "budget": budget, "layout": layout, "slot_strategy": "sparse_copy", "mode": mode,
              "params": params, "importance": importance, "copy_threshold": h}
        cfg = load_config(None, {"model": model, "gpu": "t4", "kv": kv, "engine": {"max_num_seqs": 256}})
        r = run_simulation(cfg, trace=spvllm_trace())
        moved = r.steps["bytes_moved"].to_numpy(np.float64)
        copy_s = float(moved.sum() * cost._c["copy_byte_s"] / cost.profile.copy_bw_eff)
        out[h] = {"bytes": float(moved.sum()), "launches": int((moved > 0).sum()), "steps": len(moved),
                  "copy_s": copy_s, "duration_s": float(r.steps["duration_s"].sum()),
                  "p99": r.summary["fragmentation_p99"]}
    return out


def print_spvllm_copy(budget: int = 256) -> None:
    res = spvllm_copy(budget)
    code = res.pop("code")
    bpt = code["bytes_per_token"]
    print(f"\nSpvLLM sparse copy, budget {budget}, OPT-125m / T4 ({bpt:,.0f} B a token): SpvLLM's code replayed "
          f"copies {code['tokens']:,} tokens = {code['tokens'] * bpt / 1e12:.2f} TB in {code['launches']:,} launches "
          f"({code['steps']:,} decode steps); published {SPV_COPY_PUBLISHED[0]} s in {SPV_COPY_PUBLISHED[1]:,} "
          f"calls (host time around the launch, cs243/analyze.py)")
    print(f"{'copy_threshold':>15}{'TB copied':>11}{'tokens':>15}{'copy steps':>12}{'copy s (model)':>16}"
          f"{'run s':>8}{'p99 frag':>10}")
    for h, r in res.items():
        print(f"{h:>15}{r['bytes'] / 1e12:>11.3f}{r['bytes'] / bpt:>15,.0f}{r['launches']:>12,}{r['copy_s']:>16.2f}"
              f"{r['duration_s']:>8.1f}{r['p99']:>10.3f}", flush=True)


def tokenselect_policy(reuse_rate: float, cost):
    """TokenSelect as the paper's code runs it (2,688 read, selection chunks of 512, no dense layers) and
    its context for `cost`'s model (per_head rows)."""
    from kvsim.sim.kv.policy import PolicyContext, get_policy

    m = cost.model
    rows = m.num_layers * cost.kv_heads_per_gpu
    ctx = PolicyContext("per_head", m.num_layers, cost.kv_heads_per_gpu, m.num_heads * cost.kv_heads_per_gpu // m.num_kv_heads,
                        16, rows, head_dim=m.head_dim, bytes_per_token_row=cost.kv_bytes_per_token / rows,
                        kv_split=cost.kv_split)
    return get_policy("tokenselect", budget=TOKENSELECT_READ, dense_layers=0, reuse_rate=reuse_rate), ctx


def tokenselect_attention(gpu: str, n: int, reuse_rate: float) -> dict[str, float]:
    """Seconds of one request's attention, Llama-3.1-8B on `gpu`, as the simulator's step cost prices it
    (attention term, plus the `policy_ops` term of TokenSelect's soft vote and top-k and its small kernels'
    fixed time, `op_kernels`): a decode step at
    context n and the prefill of n tokens in engine chunks of 8,192, full and with TokenSelect; and one
    selection chunk (512 queries) at context n, full and selective."""
    from kvsim.sim.core.step import BatchShape
    from kvsim.sim.kv.policies.selection_work import causal_pairs
    from kvsim.sim.model.cost_model import CostModel

    cost = CostModel("llama-3.1-8b", gpu)
    policy, ctx = tokenselect_policy(reuse_rate, cost)

    def seconds(**shape) -> float:
        b = cost.breakdown(BatchShape(**shape))
        return float(b["attention"] + b["copy"])

    out = {"decode_full": seconds(num_seqs=1, num_decode_tokens=1, kv_tokens_read=n),
           "decode_sel": seconds(num_seqs=1, num_decode_tokens=1, kv_tokens_read=float(policy.mean_read([n], ctx)[0]),
                                 op_bytes=policy.decode_op_bytes(n, ctx), op_kernels=policy.decode_op_kernels(n, ctx))}
    full = sel = 0.0
    for start in range(0, n, TOKENSELECT_ENGINE_CHUNK):
        k = min(TOKENSELECT_ENGINE_CHUNK, n - start)
        full += seconds(num_prefill_tokens=k, attn_pairs_prefill=k * (start + (k + 1) / 2), kv_tokens_read=start + k)
        c = policy.prefill_cost(start, k, ctx)
        sel += seconds(num_prefill_tokens=k, attn_pairs_prefill=c.pairs, kv_tokens_read=c.kv_read, op_bytes=c.op_bytes,
                       op_kernels=c.kernels)
    out["prefill_full"], out["prefill_sel"] = full, sel
    q = policy.prefill_chunk
    c = policy.prefill_cost(n - q, q, ctx)
    out["chunk_full"] = seconds(num_prefill_tokens=q, attn_pairs_prefill=float(causal_pairs(q, n)), kv_tokens_read=n)
    out["chunk_sel"] = seconds(num_prefill_tokens=q, attn_pairs_prefill=c.pairs, kv_tokens_read=c.kv_read,
                               op_bytes=c.op_bytes, op_kernels=c.kernels)
    return out


def tokenselect_bound(gpu: str) -> float:
    """Where the attention speedup saturates (a selection chunk as the context grows), from the GPU's specs
    and profile: c + 1 query-key pairs of compute per key for full attention (the step cost also counts
    the chunk's read of each key as a pair) against the selection's read of the key's K (attn_bw_eff)
    and its score bytes per layer (sim/kv/policies/selection_work.py, at copy_bw_eff)."""
    from kvsim.sim.kv.policies.selection_work import PREFILL_CHUNK_SIZE, score_bytes_per_key
    from kvsim.sim.model.cost_model import CostModel

    cost = CostModel("llama-3.1-8b", gpu)
    m, g, p = cost.model, cost.gpu, cost.profile
    full = (PREFILL_CHUNK_SIZE + 1) * m.attention_flops_per_pair() / (g.peak_flops(m.activation_dtype) * p.attn_compute_eff)
    k_read = cost.kv_bytes_per_token / 2 / (g.mem_bw * p.attn_bw_eff)
    scores = m.num_layers * float(score_bytes_per_key(m.num_heads, 1 << 20)) / (g.mem_bw * p.copy_bw_eff)
    return full / (k_read + scores)


def print_tokenselect(reuse_rate: float) -> None:
    print(f"\nTokenSelect: attention speedup (full over selective, the selection's kernels included), Llama-3.1-8B, "
          f"{TOKENSELECT_READ:,} tokens read, selection chunk 512 in engine chunks of {TOKENSELECT_ENGINE_CHUNK:,}; "
          f"published: up to {TOKENSELECT_PUBLISHED}x (A100-80GB)")
    for gpu in ("a100-80gb", "h100"):
        print(f"{gpu} (prefill saturates at {tokenselect_bound(gpu):.1f}x):")
        print(f"{'context':>9}{'decode':>9}{f'decode r={reuse_rate:g}':>15}{'prefill':>10}{'one chunk':>11}")
        for n in TOKENSELECT_CONTEXTS:
            t = tokenselect_attention(gpu, n, 0.0)
            r = tokenselect_attention(gpu, n, reuse_rate)
            print(f"{n // 1024:>8}K{t['decode_full'] / t['decode_sel']:>9.2f}{r['decode_full'] / r['decode_sel']:>15.2f}"
                  f"{t['prefill_full'] / t['prefill_sel']:>10.2f}{t['chunk_full'] / t['chunk_sel']:>11.2f}", flush=True)


def tokenselect_simulated(prompt: int, reuse_rate: float, output: int = 256) -> tuple[float, float, float]:
    """The simulator, TokenSelect (the paper's read, its code's selection chunk of 512, no dense layers)
    against `none` on one request of `prompt` + `output` tokens, Llama-3.1-8B / H100, 8,192-token
    prefill chunks: (decode attention read, prefill steps' time (TTFT), end-to-end time) of none over
    tokenselect."""
    import tempfile

    import pandas as pd

    from kvsim.sim.config import load_config
    from kvsim.sim.simulator.simulate import run_simulation
    from kvsim.traces.synthetic import closed_batch

    kvs = ({"policy": "none"}, {"policy": "tokenselect", "layout": "per_head", "mode": "fast", "params": {
        "budget": TOKENSELECT_READ, "dense_layers": 0, "reuse_rate": reuse_rate}})
    steps = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, kv in enumerate(kvs):
            cfg = load_config(None, {"model": "llama-3.1-8b", "gpu": "h100", "kv": kv, "engine": {
                "max_num_batched_tokens": TOKENSELECT_ENGINE_CHUNK, "max_model_len": prompt + output}})
            with past_trained_positions():
                run_simulation(cfg, f"{tmp}/{i}", trace=closed_batch(1, prompt, output))
            steps.append(pd.read_parquet(f"{tmp}/{i}/steps.parquet"))
    full, sel = steps

    def ttft(s):
        return s.loc[s["prefill_tokens"] > 0, "duration_s"].sum()

    return (full["kv_tokens_read"].iloc[-1] / sel["kv_tokens_read"].iloc[-1], ttft(full) / ttft(sel),
            full["duration_s"].sum() / sel["duration_s"].sum())


def print_tokenselect_simulated(reuse_rate: float) -> None:
    print(f"\nTokenSelect in the simulator (Llama-3.1-8B / H100, one request, prompt + 256 outputs, "
          f"reuse rate {reuse_rate:g}); published: up to {TOKENSELECT_PUBLISHED}x attention, 2.28x end to end")
    print(f"{'prompt':>9}{'decode read':>13}{'prefill (TTFT)':>16}{'end to end':>12}")
    for n in (1 << 15, 1 << 16, 1 << 17, 1 << 18):      # 512K and more do not fit one H100's KV pool
        d, p, e = tokenselect_simulated(n, reuse_rate)
        print(f"{n // 1024:>8}K{d:>12.2f}x{p:>15.2f}x{e:>11.2f}x", flush=True)


def _summary(model: str, gpu: str, kv: dict, n: int, prompt: int, output: int, tp: int = 1, **engine) -> dict:
    from kvsim.sim.config import load_config
    from kvsim.sim.simulator.simulate import run_simulation
    from kvsim.traces.synthetic import closed_batch

    cfg = load_config(None, {"model": model, "gpu": gpu, "tp": tp, "kv": kv, "engine": {"max_num_seqs": 256, **engine}})
    with past_trained_positions():
        return run_simulation(cfg, trace=closed_batch(n, prompt, output)).summary


def print_others() -> None:
    print("\nThroughput headlines, kvsim vs published (each against `none` on the same workload)")
    print(f"{'paper, figure':<52}{'kvsim':>10}{'published':>22}")
    a = ("llama-3.1-8b", "l4")
    base = _summary(*a, {"policy": "none"}, 256, 6000, 500)["total_token_throughput"]
    for rate in (8, 64):
        kv = {"policy": "kvcompress", "layout": "per_head", "slot_strategy": "compact", "mode": "fast",
              "trigger": "after_prefill+pressure", "params": {"compression_rate": rate}}
        r = _summary(*a, kv, 256, 6000, 500)["total_token_throughput"] / base
        print(f"{f'KV-Compress, total throughput, rate {rate}':<52}{r:>9.2f}x{'up to 5.18x':>22}", flush=True)
    b = ("qwen2.5-32b", "l40")
    base = _summary(*b, {"policy": "none"}, 64, 2000, 2000, tp=2)["total_token_throughput"]
    kv = {"policy": "leankv", "layout": "per_head", "slot_strategy": "slot_reuse", "mode": "fast"}
    r = _summary(*b, kv, 64, 2000, 2000, tp=2)["total_token_throughput"] / base
    print(f"{'LeanKV, total throughput (K8V4 / K4V2)':<52}{r:>9.2f}x{'1.9-2.5x, up to 6.9x':>22}", flush=True)
    c = ("llama-2-7b", "a100-80gb")
    tpot = [_summary(*c, kv, 1, 16384, 512, max_model_len=32768)["tpot_mean_s"]
            for kv in ({"policy": "none"}, {"policy": "snapkv", "layout": "per_head", "budget": 1024, "mode": "fast"})]
    print(f"{'SnapKV, decode speed at 16K, one request':<52}{tpot[0] / tpot[1]:>9.2f}x{'3.6x':>22}", flush=True)


def print_attention_check(tokens: int = 1000, prompt: int = 700) -> None:
    from kvsim.sim.calibration.attention_profile import eviction_profile, real_attention, synthetic_attention
    from kvsim.sim.kv.policy import PolicyContext

    smollm2 = PolicyContext("per_head", 30, 3, 9, 16, 90)
    print(f"\nH2O prompt cut at the first decode query ({prompt}-token prompt, {tokens} tokens): pages-freed "
          f"share, real SmolLM2-135M / importance model")
    print(f"{'seed':>5}{'budget':>8}{'shared real':>13}{'model':>8}{'per_head real':>15}{'model':>8}")
    for seed in (0, 1):
        real = real_attention(tokens, seed)[0]
        model = synthetic_attention(smollm2, "smollm2-135m", tokens, seed=seed)
        for budget in (64, 128, 256):
            f = [eviction_profile(a, prompt, budget, obs_window=1, prompt_cut=True, shared=sh).pages_freed_share
                 for sh in (True, False) for a in (real, model)]
            print(f"{seed:>5}{budget:>8}{f[0]:>13.3f}{f[1]:>8.3f}{f[2]:>15.3f}{f[3]:>8.3f}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=("spvllm", "spvllm-code", "spvllm-tail", "spvllm-copy", "tokenselect",
                                       "others", "attention"))
    ap.add_argument("--setup", choices=tuple(SETUPS), default="spvllm", help="SpvLLM: how H2O is run")
    ap.add_argument("--reuse-rate", type=float, default=0.21, help="TokenSelect Selection Cache reuse rate")
    args = ap.parse_args()
    t0 = time.process_time()
    if args.only in (None, "spvllm"):
        print_spvllm(args.setup)
    if args.only in (None, "spvllm-tail"):
        print_spvllm_tail(setup=args.setup)
    if args.only in (None, "spvllm-code"):
        print_spvllm_code()
    if args.only in (None, "spvllm-copy"):
        print_spvllm_copy()
    if args.only in (None, "tokenselect"):
        print_tokenselect(args.reuse_rate)
        print_tokenselect_simulated(args.reuse_rate)
    if args.only in (None, "others"):
        print_others()
    if args.only == "attention":
        print_attention_check()
    print(f"\nCPU time {time.process_time() - t0:.1f} s")


if __name__ == "__main__":
    main()
