"""Pipeline parallelism and data-parallel attention with expert parallelism: kvsim against an exact pipeline
timing and against published vLLM figures. Prints errors; nothing is fitted to them (docs/parallelism.md).

    python bench/bench_parallelism.py [--quick]

1. The steady-state pipeline round (sim/model/parallel.py PipelineCostModel) against an exact timing of
   vLLM's batch queue for decode batches that cycle through the stages (each stage a FIFO of micro-batches,
   stage time = its share of the layers x the whole model's step time on the micro-batch, a hand-off between
   stages, a batch re-entering the first stage when its tokens are back): (a) requests spread evenly over
   the P in-flight batches (the steady state with arrivals), (b) a burst that fits one batch (vLLM schedules
   it whole into the first batch and the other P - 1 stay empty: the case the approximation leaves out).
2. Substratus, "Benchmarking 70B model on 8 x L4 GPUs vLLM: Pipeline vs Tensor Parallelism"
   (substratus.ai/blog/benchmarking-llama-3.1-70b-on-l4): Llama-3.1-70B-Instruct FP8 on 8 x L4, ShareGPT
   1,000 prompts at request rate inf, --max-num-seqs 512 --max-num-batched-tokens 32768 --kv-cache-dtype fp8
   --enable-chunked-prefill=false --enforce-eager: PP4 x TP2 307.61 output tok/s (1.76 req/s), PP2 x TP4
   261.16 output tok/s (1.50 req/s). kvsim runs the shipped sharegpt-8k-filtered lengths (not vLLM's own
   sampling of ShareGPT), on the derived L4 profile, without eager mode's slower decode.
3. vLLM's blog "Large Scale Serving: DeepSeek @ 2.2k tok/s/H200 with Wide-EP" (2025-12-17) and llm-d's
   wide-EP guide: DeepSeek-R1 decode on DP16 x EP (16 x H200, two nodes, InfiniBand CX-7), ~2.2k output
   tokens/s per GPU with dual-batch overlap and EPLB (~1.5k before them), prefill on other instances (P/D).
   kvsim runs a decode-heavy load (short prompts, long outputs) on dp 16 of DeepSeek-V3 (the same
   architecture) on H200 without DBO, EPLB or P/D: the batch per rank and the lengths of the published run
   are not given, so this compares orders of magnitude only.
"""
from __future__ import annotations

import argparse
import time
import warnings

from kvsim.sim.config import load_config
from kvsim.sim.core.step import BatchShape
from kvsim.sim.model.cost_model import CostModel
from kvsim.sim.model.parallel import PipelineCostModel
from kvsim.sim.simulator.simulate import run_simulation


def decode_shape(seqs: float, context: int) -> BatchShape:
    return BatchShape(num_seqs=seqs, num_prefill_tokens=0, num_decode_tokens=seqs, kv_tokens_read=seqs * context,
                      attn_pairs_prefill=0, block_table_entries=seqs * context / 16)


def exact_itl(pipe: PipelineCostModel, plain: CostModel, batches: list[int], context: int, rounds: int = 50) -> float:
    """Steady-state time between two tokens of the first batch when `batches` (sizes) cycle through the
    pipeline's stages, each stage serving micro-batches in order (vLLM's batch queue)."""
    shares = [n / pipe.model.num_layers for n in pipe.stage_layers]
    stage_free = [0.0] * pipe.pp
    ready = [0.0] * len(batches)
    done = []
    for _ in range(rounds):
        for j, b in enumerate(batches):
            t = plain.predict(decode_shape(b, context))
            send = pipe.send_seconds(float(b))
            clock = ready[j]
            for s, w in enumerate(shares):
                start = max(clock, stage_free[s])
                clock = stage_free[s] = start + w * t
                if s < pipe.pp - 1:
                    clock += send
            ready[j] = clock
            if j == 0:
                done.append(clock)
    return done[-1] - done[-2]


def pipeline_errors() -> None:
    print("1. steady-state pipeline round vs an exact batch-queue timing (decode, 1,000-token contexts)")
    print(f"   {'model / layout':34s} {'seqs':>5s} {'exact spread':>13s} {'err':>7s} {'exact burst':>12s} {'err':>7s}")
    for model, gpu, tp, pp in (("llama-3.1-8b", "h100", 1, 2), ("llama-3.1-70b", "h100", 4, 2),
                               ("llama-3.1-70b", "h100", 2, 4), ("llama-3.1-70b", "h100", 8, 3)):
        pipe = PipelineCostModel(model, gpu, tp=tp, async_scheduling=True, pp=pp)
        plain = CostModel(model, gpu, tp=tp, async_scheduling=True)
        for seqs in (1, 8, 64, 256):
            model_round = pipe.predict(decode_shape(seqs, 1000))
            m = int(min(seqs, pp))
            spread = exact_itl(pipe, plain, [seqs / m] * m, 1000)
            burst = exact_itl(pipe, plain, [seqs], 1000)
            print(f"   {model + f' {gpu} tp{tp} pp{pp}':34s} {seqs:5d} {spread * 1e3:10.2f} ms {(model_round / spread - 1):+7.1%}"
                  f" {burst * 1e3:9.2f} ms {(model_round / burst - 1):+7.1%}")


def simulate(overrides: dict) -> dict:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t0 = time.process_time()
        summary = run_simulation(load_config(None, overrides), keep_steps=False).summary
        summary["cpu_s"] = time.process_time() - t0
    return summary


def substratus_l4(requests: int) -> None:
    print(f"\n2. Llama-3.1-70B FP8 on 8 x L4, ShareGPT lengths, {requests} prompts at rate inf (Substratus)")
    published = {(4, 2): (307.61, 1.76), (2, 4): (261.16, 1.50)}
    got = {}
    for (pp, tp), (tok_s, req_s) in published.items():
        s = simulate({"trace": "sharegpt-8k-filtered", "model": "llama-3.1-70b-fp8", "gpu": "l4", "tp": tp, "pp": pp,
                      "kv_dtype": "fp8", "engine.max_num_seqs": 512, "engine.max_num_batched_tokens": 32768,
                      "engine.max_model_len": 32768, "engine.enable_chunked_prefill": False,
                      "trace_options.max_requests": requests, "trace_options.request_rate": float("inf")})
        got[(pp, tp)] = s["output_throughput"]
        print(f"   PP{pp} x TP{tp}: kvsim {s['output_throughput']:8.1f} output tok/s, {s['request_throughput']:.2f} req/s "
              f"(pool {s['num_gpu_blocks']} blocks, {s['cpu_s']:.1f} s CPU); published {tok_s} tok/s, {req_s} req/s: "
              f"error {s['output_throughput'] / tok_s - 1:+.1%}")
    ratio = got[(4, 2)] / got[(2, 4)]
    print(f"   PP4xTP2 / PP2xTP4: kvsim {ratio:.2f}, published {307.61 / 261.16:.2f}")


def deepseek_wide_ep(requests_per_rank: int) -> None:
    dp = 16
    print(f"\n3. DeepSeek-V3 decode on dp {dp} x EP, 16 x H200 over InfiniBand (vLLM wide-EP blog: ~2.2k tok/s/GPU "
          "with DBO + EPLB, ~1.5k before)")
    for output in (256,):
        s = simulate({"trace": "random", "model": "deepseek-v3", "gpu": "h200", "dp": dp, "router": "dp_balance",
                      "trace_options.max_requests": requests_per_rank * dp, "trace_options.random.input_len": 128,
                      "trace_options.random.output_len": output, "trace_options.request_rate": float("inf")})
        per_gpu = s["output_throughput"] / dp
        print(f"   {requests_per_rank} requests per rank at once, 128 in / {output} out: kvsim {per_gpu:,.0f} output tok/s "
              f"per GPU ({s['cpu_s']:.1f} s CPU); vs 2.2k: {per_gpu / 2200 - 1:+.0%}, vs 1.5k: {per_gpu / 1500 - 1:+.0%}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer requests (a smoke run)")
    args = parser.parse_args()
    pipeline_errors()
    substratus_l4(200 if args.quick else 1000)
    deepseek_wide_ep(32 if args.quick else 128)


if __name__ == "__main__":
    main()
