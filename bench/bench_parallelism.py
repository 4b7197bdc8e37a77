"""Pipeline parallelism and data-parallel attention with expert parallelism: kvsim against an exact pipeline
timing and against published vLLM figures. Prints errors; nothing is fitted to them (docs/parallelism.md).

    python bench/bench_parallelism.py [--quick]

1. The pipeline round (sim/model/parallel.py PipelineCostModel.round_seconds) against an exact timing of the
   same decode batches cycling through the stages (each stage a FIFO of batches, stage time = its share of the
   layers x the whole model's step time on the batch, a hand-off between stages, a batch re-entering the first
   stage when its tokens are back): (a) requests spread evenly over the P in-flight batches, (b) a burst in
   one batch (vLLM schedules it whole into the first batch and the other P - 1 stay empty); and the error an
   even split of every step would make there.
1b. The whole engine (kvsim simulate with pp, its PipelineExecutor) against an exact event timing of vLLM's
   batch queue and scheduler on small workloads (Poisson arrivals, bursts; `VllmPipelineReference`).
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
    print("1. a round of in-flight batches (PipelineCostModel.round_seconds) vs an exact timing of the same batches "
          "cycling\n   through the stages (decode, 1,000-token contexts); 'even split' prices the step as min(P, seqs) "
          "equal batches whatever the batches are")
    print(f"   {'model / layout':30s} {'seqs':>5s} {'spread exact':>13s} {'err':>6s} {'burst exact':>12s} {'err':>6s} "
          f"{'even split':>10s}")
    for model, gpu, tp, pp in (("llama-3.1-8b", "h100", 1, 2), ("llama-3.1-70b", "h100", 4, 2),
                               ("llama-3.1-70b", "h100", 2, 4), ("llama-3.1-70b", "h100", 8, 3)):
        pipe = PipelineCostModel(model, gpu, tp=tp, async_scheduling=True, pp=pp)
        plain = CostModel(model, gpu, tp=tp, async_scheduling=True)
        for seqs in (1, 8, 64, 256):
            m = int(min(seqs, pp))
            spread = exact_itl(pipe, plain, [seqs / m] * m, 1000)
            burst = exact_itl(pipe, plain, [seqs], 1000)
            spread_round = pipe.round_seconds([decode_shape(seqs / m, 1000)] * m)
            burst_round = pipe.round_seconds([decode_shape(seqs, 1000)])
            even = pipe.predict(decode_shape(seqs, 1000))
            print(f"   {model + f' tp{tp} pp{pp}':30s} {seqs:5d} {spread * 1e3:10.2f} ms {spread_round / spread - 1:+6.1%}"
                  f" {burst * 1e3:9.2f} ms {burst_round / burst - 1:+6.1%} {even / burst - 1:+10.1%}")


# ---- 1b. the whole engine against an exact event timing of vLLM's batch queue --------------------------------
class VllmPipelineReference:
    """vLLM's engine with pipeline stages (EngineCore.step_with_batch_queue; the v1 scheduler without async
    scheduling), timed exactly on small workloads: while fewer than P batches are in flight and something can
    be scheduled, a batch is scheduled at once (running requests first: a decode only when its last token is
    back, a prompt's next chunk at once; then arrived waiting requests FCFS while fewer than max_seqs run), each
    up to `budget` tokens; else the engine waits for the oldest batch, whose tokens come back at its end. A batch
    enters a stage when the stage is free; stage s takes its layer share of the cost model's step time on the
    batch, then the hand-off to the next stage. KV is unlimited and nothing is preempted or cached."""

    def __init__(self, pipe: PipelineCostModel, arrivals, prompts, outputs, budget: int, max_seqs: int):
        from collections import deque
        self.pipe, self.plain = pipe, plain_cost(pipe)
        self.arrivals, self.prompts, self.outputs = arrivals, prompts, outputs
        self.budget, self.max_seqs = budget, max_seqs
        n = len(arrivals)
        self.shares = [k / pipe.model.num_layers for k in pipe.stage_layers]
        self.computed, self.produced = [0] * n, [0] * n        # prompt tokens scheduled, output tokens back
        self.in_flight = [False] * n                           # a decode waiting for its token
        self.first_token: list = [None] * n
        self.finish: list = [None] * n
        self.waiting, self.running = deque(range(n)), []
        self.queue: deque = deque()
        self.stage_free = [0.0] * pipe.pp
        self.now = 0.0

    def run(self):
        """(TTFT of each request, mean time per output token after the first of each, the last finish)."""
        while self.waiting or self.running or self.queue:
            batch = self._schedule() if len(self.queue) < self.pipe.pp else []
            if batch:
                self._start(batch)
            elif self.queue:
                self._return()
            else:
                self.now = self.arrivals[self.waiting[0]]
        a, o = self.arrivals, self.outputs
        ttft = [t - a[i] for i, t in enumerate(self.first_token)]
        tpot = [(self.finish[i] - self.first_token[i]) / (o[i] - 1) for i in range(len(a)) if o[i] > 1]
        return ttft, tpot, max(self.finish)

    def _schedule(self) -> list:
        batch, tokens = [], 0
        for r in self.running:
            if tokens >= self.budget:
                break
            if self.computed[r] < self.prompts[r]:
                k = min(self.prompts[r] - self.computed[r], self.budget - tokens)
            elif not self.in_flight[r]:
                k = 1
            else:
                continue
            batch.append((r, k, self.computed[r] + self.produced[r]))
            tokens += k
        waiting = self.waiting
        while waiting and self.arrivals[waiting[0]] <= self.now and len(self.running) < self.max_seqs \
                and tokens < self.budget:
            r = waiting.popleft()
            self.running.append(r)
            k = min(self.prompts[r], self.budget - tokens)
            batch.append((r, k, 0))
            tokens += k
        return batch

    def _start(self, batch: list) -> None:
        prefill = [(k, ctx) for r, k, ctx in batch if self.computed[r] < self.prompts[r]]
        shape = BatchShape(num_seqs=len(batch), num_prefill_tokens=sum(k for k, _ in prefill),
                           num_decode_tokens=len(batch) - len(prefill),
                           attn_pairs_prefill=sum(k * (c + (k + 1) / 2) for k, c in prefill),
                           kv_tokens_read=sum(c + k for _, k, c in batch),
                           block_table_entries=sum(-(-(c + k) // 16) for _, k, c in batch))
        t = self.plain.predict(shape)
        send = self.pipe.send_seconds(float(sum(k for _, k, _ in batch)))
        clock = self.now
        for s, w in enumerate(self.shares):
            clock = self.stage_free[s] = max(clock, self.stage_free[s]) + w * t
            if s < self.pipe.pp - 1:
                clock += send
        done = []
        for r, k, _ in batch:
            if self.computed[r] < self.prompts[r]:
                self.computed[r] += k
                if self.computed[r] < self.prompts[r]:
                    continue                  # not the prompt's last chunk: no token sampled
            self.in_flight[r] = True
            done.append(r)
        self.queue.append((clock, done))

    def _return(self) -> None:
        end, done = self.queue.popleft()
        self.now = max(self.now, end)
        for r in done:
            self.in_flight[r] = False
            self.produced[r] += 1
            if self.produced[r] == 1:
                self.first_token[r] = self.now
            if self.produced[r] == self.outputs[r]:
                self.finish[r] = self.now
                self.running.remove(r)


_PLAIN: dict = {}     # pipeline cost model -> the plain one of its model, GPU and TP (kept alive with it)


def plain_cost(pipe: PipelineCostModel) -> CostModel:
    if pipe not in _PLAIN:
        _PLAIN[pipe] = CostModel(pipe.model, pipe.gpu, pipe.profile, tp=pipe.tp, async_scheduling=pipe.async_scheduling)
    return _PLAIN[pipe]


def engine_vs_reference() -> None:
    import numpy as np

    from kvsim.traces.trace import Trace
    print("\n1b. kvsim's PP engine vs the exact batch-queue reference (sync scheduling, no prefix caching, "
          "H100; kvsim / reference - 1)")
    print(f"   {'case':52s} {'mean TTFT':>10s} {'mean TPOT':>10s} {'makespan':>9s}")
    rng = np.random.default_rng(7)
    cases = []
    n = 200
    cases.append(("Poisson 20/s, 1000 in / 200 out", np.cumsum(rng.exponential(1 / 20, n)), [1000] * n, [200] * n))
    cases.append(("burst of 64, 100 in / 100 out", np.zeros(64), [100] * 64, [100] * 64))
    cases.append(("burst of 64, 3000 in / 100 out", np.zeros(64), [3000] * 64, [100] * 64))
    lens = rng.integers(200, 4000, n)
    cases.append(("Poisson 8/s, 200-4000 in / 300 out", np.cumsum(rng.exponential(1 / 8, n)), lens.tolist(), [300] * n))
    for model, tp, pp in (("llama-3.1-8b", 1, 2), ("llama-3.1-70b", 2, 4)):
        for name, arrivals, prompts, outputs in cases:
            cfg = load_config(None, {"model": model, "gpu": "h100", "tp": tp, "pp": pp, "engine.async_scheduling": False,
                                     "engine.enable_prefix_caching": False})
            from kvsim.sim.engine.resolved_run import resolve_run
            plan = resolve_run(cfg)
            pipe = plan.cost
            eng = plan.cfg.engine
            ttft, tpot, end = VllmPipelineReference(pipe, list(map(float, arrivals)), prompts, outputs,
                                                    eng.max_num_batched_tokens, eng.max_num_seqs).run()
            trace = Trace.from_columns(arrival_time_s=arrivals, prompt_tokens=prompts, output_tokens=outputs)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                res = run_simulation(cfg, trace=trace, keep_steps=False)
            df = res.requests
            k_ttft, k_tpot = float(df["ttft_s"].mean()), float(df["tpot_s"].mean())
            k_end = float(df["finish_s"].max())
            r_ttft, r_tpot = float(np.mean(ttft)), float(np.mean(tpot))
            print(f"   {model + f' tp{tp} pp{pp}, ' + name:52s} {k_ttft / r_ttft - 1:+10.1%} {k_tpot / r_tpot - 1:+10.1%} "
                  f"{k_end / end - 1:+9.1%}   (reference {r_ttft * 1e3:.1f} ms, {r_tpot * 1e3:.2f} ms, {end:.2f} s)")


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
    engine_vs_reference()
    substratus_l4(200 if args.quick else 1000)
    deepseek_wide_ep(32 if args.quick else 128)


if __name__ == "__main__":
    main()
