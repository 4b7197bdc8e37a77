"""Published checks of prefill/decode disaggregation: kvsim's figures beside the published ones.

Nothing here is fitted to these figures: every run uses the shipped H100 profile (`profile: auto`) and
the setups below; where a setup detail is not published, the assumption is stated and, where it moves
the result, run both ways.

1. vLLM PR #6170 (github.com/vllm-project/vllm/pull/6170, "[Core] implement disaggregated prefilling via
   KV cache transfer"; the back-to-back comparison in its thread, 2024-08, and the script it added,
   benchmarks/disagg_benchmarks/disagg_performance_benchmark.sh). Setup as published: 8x H100,
   meta-llama/Meta-Llama-3.1-70B-Instruct, sonnet dataset with 2,048 input tokens (a 50-token shared
   prefix) and 150 output tokens, 400 prompts, QPS 2 / 4 / 6 / 8 (benchmark_serving's Poisson
   arrivals); "chunked prefill": two TP4 instances with --enable-chunked-prefill behind a round-robin
   proxy; "disagg prefill": two TP4 instances, one prefill and one decode; both --max-model-len 30000
   --gpu-memory-utilization 0.8; the first token is taken from the decode instance (transfer included
   in TTFT). Published direction: disaggregation has lower median TTFT and lower median ITL at QPS <= 6,
   and loses at QPS 8 ("the decode instance is backlogging"); its p99 ITL is worse (attributed to
   occasional failed KV transfers that make the decode instance recompute the prefill: not modelled
   here). Assumptions: the sonnet prompts as vllm bench serve's random dataset with fixed lengths and a
   50-token shared prefix; the KV moves over NVLink (both instances in one 8-GPU node: `nvlink4`); vLLM
   V0 (the PR's engine) ran chunked prefill with a 512-token budget and the non-chunked disaggregated
   instances with max_num_batched_tokens = max_model_len (30,000), max_num_seqs 256 in both: the "v0
   budgets" reading; kvsim's own (V1) defaults for H100 are the other reading.

2. NVIDIA AIConfigurator's published vLLM 0.12 disaggregated point (github.com/ai-dynamo/aiconfigurator;
   the point as quoted in kvsim's issue 45): H100 SXM, ISL 4,000 / OSL 1,000, Qwen3-32B FP8, 8 prefill
   workers at TP1 + 2 decode workers at TP4, decode batch 224: TTFT 368 ms, TPOT 8.75 ms (means: the tool
   reports no percentiles). AIConfigurator models a steady state, not a trace; kvsim runs fixed-length
   requests at constant gaps (burstiness inf). Not published: the arrival rate, whether the batch is
   per decode worker, the KV dtype. Two readings of the batch: "224 per decode worker" (max_num_seqs 224
   each; 2 x 224 requests decoding, each for OSL x TPOT = 8.75 s: 51.2 req/s) and "224 over the decode
   pool" (max_num_seqs 112 each; 25.6 req/s); each with the KV cache in bf16 (vLLM's default
   --kv-cache-dtype auto) and in fp8 (half the bytes moved and read). Also assumed: the pools in
   different nodes (`ib-ndr`). The first and last quarter of the arrivals are left out of the means
   (ramp-up and drain). A third row runs 1 req/s: TTFT and TPOT with no queue and a small batch.

    python bench/bench_disaggregation.py                    # both (~1 min CPU)
    python bench/bench_disaggregation.py --only pr6170      # ~8 s CPU
    python bench/bench_disaggregation.py --only aiconfigurator
"""
from __future__ import annotations

import argparse
import time
import warnings

import numpy as np

PR6170_QPS = (2, 4, 6, 8)
AIC_PUBLISHED = {"ttft_ms": 368.0, "tpot_ms": 8.75, "decode_batch": 224}
AIC_ISL, AIC_OSL = 4000, 1000


def _run(overrides: dict):
    from kvsim.sim.config import load_config
    from kvsim.sim.simulator.simulate import run_simulation

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return run_simulation(load_config(None, overrides))


def pr6170_config(qps: float, form: str, budgets: str, requests: int = 400) -> dict:
    """`form`: aggregated (2x TP4, round robin) or disaggregated (1 prefill TP4 + 1 decode TP4);
    `budgets`: v1 (kvsim's defaults) or v0 (512-token chunks aggregated, 30,000 tokens disaggregated)."""
    cfg = {"trace": "random", "model": "llama-3.1-70b", "gpu": "h100", "tp": 4,
           "trace_options.random": {"input_len": 2048, "output_len": 150, "prefix_len": 50},
           "trace_options.max_requests": requests, "trace_options.request_rate": float(qps),
           "engine.gpu_memory_utilization": 0.8, "engine.max_model_len": 30000, "seed": 0}
    if form == "aggregated":
        cfg["replicas"] = 2
        if budgets == "v0":
            cfg["engine.max_num_batched_tokens"] = 512
            cfg["engine.max_num_seqs"] = 256
    else:
        pool = {"gpu": "h100", "tp": 4, "replicas": 1}
        if budgets == "v0":
            pool["engine"] = {"max_num_batched_tokens": 30000, "max_num_seqs": 256}
        cfg["fleet"] = {"prefill": dict(pool), "decode": dict(pool), "link": "nvlink4"}
    return cfg


def pr6170(requests: int = 400) -> list[dict]:
    rows = []
    for budgets in ("v1", "v0"):
        for qps in PR6170_QPS:
            for form in ("aggregated", "disaggregated"):
                s = _run(pr6170_config(qps, form, budgets, requests)).summary
                rows.append({"budgets": budgets, "qps": qps, "form": form, "ttft_p50_ms": s["ttft_p50_s"] * 1e3,
                             "itl_p50_ms": s["itl_p50_s"] * 1e3, "itl_p99_ms": s["itl_p99_s"] * 1e3,
                             "tpot_mean_ms": s["tpot_mean_s"] * 1e3, "ttft_p99_ms": s["ttft_p99_s"] * 1e3,
                             "handoff": s.get("handoff")})
    return rows


def print_pr6170(rows: list[dict]) -> None:
    print("vLLM PR #6170: 2x TP4 chunked prefill (agg) vs 1 prefill + 1 decode TP4 (dis), Llama-3.1-70B, "
          "2,048 in / 150 out, 400 prompts")
    print("published: dis lower median TTFT and median ITL at QPS <= 6, loses at QPS 8; dis worse p99 ITL")
    head = f"{'budgets':7} {'QPS':>3} | {'TTFT p50 agg':>12} {'dis':>8} | {'ITL p50 agg':>11} {'dis':>6} | " \
           f"{'ITL p99 agg':>11} {'dis':>6} | {'TTFT p99 agg':>12} {'dis':>8} | {'dis transfer ms':>15} | winner (TTFT p50, ITL p50)"
    print(head)
    by = {(r["budgets"], r["qps"], r["form"]): r for r in rows}
    for budgets in ("v1", "v0"):
        for qps in PR6170_QPS:
            a, d = by[(budgets, qps, "aggregated")], by[(budgets, qps, "disaggregated")]
            win = ", ".join("dis" if d[k] < a[k] else "agg" for k in ("ttft_p50_ms", "itl_p50_ms"))
            transfer = (d["handoff"] or {}).get("mean_transfer_s")
            print(f"{budgets:7} {qps:>3} | {a['ttft_p50_ms']:12.0f} {d['ttft_p50_ms']:8.0f} | {a['itl_p50_ms']:11.1f} "
                  f"{d['itl_p50_ms']:6.1f} | {a['itl_p99_ms']:11.1f} {d['itl_p99_ms']:6.1f} | {a['ttft_p99_ms']:12.0f} "
                  f"{d['ttft_p99_ms']:8.0f} | {transfer * 1e3 if transfer is not None else float('nan'):15.2f} | {win}")


def aic_config(rate: float, kv_dtype: str | None, requests: int, batch: int) -> dict:
    cfg = {"trace": "random", "model": "qwen3-32b-fp8", "gpu": "h100", "seed": 0,
           "trace_options.random": {"input_len": AIC_ISL, "output_len": AIC_OSL},
           "trace_options.max_requests": requests, "trace_options.request_rate": rate,
           "trace_options.burstiness": float("inf"),
           "fleet": {"prefill": {"gpu": "h100", "tp": 1, "replicas": 8},
                     "decode": {"gpu": "h100", "tp": 4, "replicas": 2,
                                "engine": {"max_num_seqs": batch}},
                     "link": "ib-ndr"}}
    if kv_dtype:
        cfg["kv_dtype"] = kv_dtype
    return cfg


def aiconfigurator(kv_dtype: str | None = None, requests: int = 2000) -> list[dict]:
    batch, tpot_s = AIC_PUBLISHED["decode_batch"], AIC_PUBLISHED["tpot_ms"] / 1e3
    # reading -> (req/s: the decoding requests over how long each decodes, max_num_seqs per decode worker)
    readings = {"224 per decode worker": (2 * batch / (AIC_OSL * tpot_s), batch),
                "224 over the decode pool": (batch / (AIC_OSL * tpot_s), batch // 2),
                "unloaded (1 req/s)": (1.0, batch // 2)}          # TTFT and TPOT without queues
    rows = []
    for label, (rate, per_worker) in readings.items():
        res = _run(aic_config(rate, kv_dtype, requests, per_worker))
        req = res.requests
        lo, hi = np.quantile(req["arrival_s"], [0.25, 0.75])
        mid = req[(req["arrival_s"] >= lo) & (req["arrival_s"] <= hi) & req["ttft_s"].notna()]
        steps = res.steps
        decode_ids = sorted(steps["replica"].unique())[-2:]          # decode replicas follow the 8 prefill ones
        dsteps = steps[steps["replica"].isin(decode_ids) & (steps["time_s"] >= lo) & (steps["time_s"] <= hi)]
        h = res.summary["handoff"]
        rows.append({"reading": label, "rate": rate, "kv": kv_dtype or "bf16", "ttft_mean_ms": mid["ttft_s"].mean() * 1e3,
                     "ttft_p99_ms": mid["ttft_s"].quantile(0.99) * 1e3, "tpot_mean_ms": mid["tpot_s"].mean() * 1e3,
                     "tpot_p99_ms": mid["tpot_s"].quantile(0.99) * 1e3,
                     "decode_batch_mean": float(dsteps["num_decode_seqs"].mean()) if len(dsteps) else float("nan"),
                     "transfer_mean_ms": (h.get("mean_transfer_s") or float("nan")) * 1e3,
                     "prefill_queue_mean_ms": (h.get("mean_prefill_queue_s") or float("nan")) * 1e3,
                     "prefill_util": res.summary["pools"]["prefill"]["utilization"]})
    return rows


def print_aiconfigurator(rows: list[dict]) -> None:
    print(f"AIConfigurator vLLM 0.12 disagg point: Qwen3-32B FP8, H100 SXM, 8x TP1 prefill + 2x TP4 decode, "
          f"ISL {AIC_ISL} / OSL {AIC_OSL}")
    print(f"published: TTFT {AIC_PUBLISHED['ttft_ms']:.0f} ms, TPOT {AIC_PUBLISHED['tpot_ms']} ms (means), decode batch "
          f"{AIC_PUBLISHED['decode_batch']}")
    print(f"{'reading':26} {'KV':4} {'req/s':>6} | {'TTFT mean':>9} {'p99':>8} | {'TPOT mean':>9} {'p99':>6} | {'decode batch':>12} | "
          f"{'prefill queue':>13} {'transfer':>8} {'prefill util':>12}")
    for r in rows:
        print(f"{r['reading']:26} {r['kv']:4} {r['rate']:6.1f} | {r['ttft_mean_ms']:9.0f} {r['ttft_p99_ms']:8.0f} | "
              f"{r['tpot_mean_ms']:9.2f} {r['tpot_p99_ms']:6.2f} | {r['decode_batch_mean']:12.1f} | "
              f"{r['prefill_queue_mean_ms']:13.0f} {r['transfer_mean_ms']:8.1f} {r['prefill_util']:12.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", choices=["pr6170", "aiconfigurator"])
    ap.add_argument("--requests", type=int, default=2000, help="AIConfigurator point: requests simulated")
    args = ap.parse_args()
    t0 = time.process_time()
    if args.only in (None, "pr6170"):
        print_pr6170(pr6170())
        print()
    if args.only in (None, "aiconfigurator"):
        print_aiconfigurator([r for kv in (None, "fp8") for r in aiconfigurator(kv, args.requests)])
    print(f"\n{time.process_time() - t0:.1f} s CPU")


if __name__ == "__main__":
    main()
