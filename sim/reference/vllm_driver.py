"""Drive a real vLLM engine in-process, step by step, and record every step's schedule.

Runs in the vLLM virtualenv, never imports kvsim: `python vllm_driver.py SPEC.json OUT.jsonl`.
SPEC holds the engine settings and the requests (prompt token ids, output length, arrival step,
priority). A request with arrival step k is added before the engine's k-th step (steps counted
from 0); when the engine runs out of work first, the next arrivals are added at once. Each line
of OUT is one engine step: what `Scheduler.schedule` returned (tokens per request, new / resumed /
preempted requests) and, after the step, finished requests, running / waiting counts and free
KV blocks. Requests vLLM refuses at `add_request` are reported as `rejected` lines.
"""
from __future__ import annotations

import json
import os
import sys
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")   # engine core in this process
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def build_engine(spec: dict):
    from vllm import EngineArgs, LLMEngine

    eng = spec["engine"]
    args = EngineArgs(
        model=spec["model"], dtype="bfloat16", seed=0, enforce_eager=True,
        skip_tokenizer_init=True, block_size=eng["block_size"],
        num_gpu_blocks_override=eng["num_gpu_blocks"],
        max_num_batched_tokens=eng["max_num_batched_tokens"], max_num_seqs=eng["max_num_seqs"],
        max_model_len=eng["max_model_len"], enable_prefix_caching=eng["enable_prefix_caching"],
        enable_chunked_prefill=eng["enable_chunked_prefill"],
        long_prefill_token_threshold=eng["long_prefill_token_threshold"],
        scheduling_policy=eng["scheduling_policy"], async_scheduling=False,
        # on the CPU backend this is the fraction of host RAM vLLM may reserve; the KV cache is
        # sized exactly by num_gpu_blocks_override, so keep it small on a shared machine
        gpu_memory_utilization=spec.get("host_memory_fraction", 0.2),
    )
    return LLMEngine.from_engine_args(args)


def core_scheduler(engine):
    return engine.engine_core.engine_core.scheduler


class StepRecorder:
    """Wraps `Scheduler.schedule` to keep the output of the step being run."""

    def __init__(self, scheduler):
        self.scheduler = scheduler
        self.last = None
        original = scheduler.schedule

        def schedule(*args, **kwargs):
            self.last = original(*args, **kwargs)
            self.kinds = token_kinds(self.last, scheduler)
            return self.last

        scheduler.schedule = schedule


def kvsim_id(vllm_id: str) -> int:
    return int(vllm_id.split("-")[0])


def token_kinds(out, scheduler) -> tuple[int, int]:
    """(prefill tokens, decode tokens) of a step, as kvsim counts them: a decode computes exactly
    the one token sampled last step; anything else is (re)prefill. Runs right after `schedule`,
    which has already advanced `num_computed_tokens`."""
    prefill = decode = 0
    for req_id, n in out.num_scheduled_tokens.items():
        req = scheduler.requests[req_id]
        before = req.num_computed_tokens - n
        if n == 1 and req.num_output_tokens > 0 and before == req.num_tokens - 1:
            decode += 1
        else:
            prefill += n
    return prefill, decode


def step_row(step: int, out, kinds: tuple[int, int], scheduler, finished: list[int]) -> dict:
    tokens = {kvsim_id(k): v for k, v in out.num_scheduled_tokens.items()}
    new = [kvsim_id(r.req_id) for r in out.scheduled_new_reqs]
    cached = out.scheduled_cached_reqs
    resumed = [kvsim_id(rid) for rid, res in zip(cached.req_ids, _resumed_flags(cached), strict=True) if res]
    preempted = sorted(kvsim_id(r) for r in (out.preempted_req_ids or ()))
    return {
        "step": step,
        "scheduled_ids": sorted(tokens), "scheduled_tokens": [tokens[i] for i in sorted(tokens)],
        "new_ids": sorted(new), "resumed_ids": sorted(resumed), "preempted_ids": preempted,
        "finished_ids": sorted(finished),
        "prefill_tokens": kinds[0], "decode_tokens": kinds[1],
        "num_running": len(scheduler.running),
        "num_waiting": len(scheduler.waiting) + len(getattr(scheduler, "kv_holding_waiting", ())),
        "blocks_free": scheduler.kv_cache_manager.block_pool.get_num_free_blocks(),
    }


def _resumed_flags(cached) -> list[bool]:
    flags = getattr(cached, "resumed_from_preemption", None)
    if flags is None:
        resumed = getattr(cached, "resumed_req_ids", set())
        return [rid in resumed for rid in cached.req_ids]
    return list(flags)


def run(spec: dict, out_path: str) -> None:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    engine = build_engine(spec)
    scheduler = core_scheduler(engine)
    recorder = StepRecorder(scheduler)
    pending = sorted(spec["requests"], key=lambda r: (r["arrival_step"], r["id"]))
    step = 0
    carried: list[int] = []        # preemptions of an empty step (reported with the next step, as kvsim does)
    t0 = time.perf_counter()
    with open(out_path, "w") as out:
        out.write(json.dumps({"meta": {"vllm_version": _vllm_version(),
                                       "num_free_blocks_at_start": scheduler.kv_cache_manager
                                       .block_pool.get_num_free_blocks()}}) + "\n")
        while pending or engine.has_unfinished_requests():
            due = [r for r in pending if r["arrival_step"] <= step]
            if not due and not engine.has_unfinished_requests():
                due = [r for r in pending if r["arrival_step"] == pending[0]["arrival_step"]]
            for r in due:
                pending.remove(r)
                try:
                    engine.add_request(
                        str(r["id"]), TokensPrompt(prompt_token_ids=r["prompt_token_ids"]),
                        SamplingParams(max_tokens=r["output_tokens"], ignore_eos=True, temperature=0.0,
                                       detokenize=False),
                        priority=r.get("priority", 0))
                except Exception as exc:       # vLLM refuses the request (e.g. too long): record why
                    out.write(json.dumps({"rejected": r["id"], "step": step, "reason": str(exc)}) + "\n")
            if not engine.has_unfinished_requests():
                continue
            recorder.last = None
            outputs = engine.step()
            if recorder.last is None or not recorder.last.num_scheduled_tokens:
                if recorder.last is not None:
                    carried += [kvsim_id(r) for r in (recorder.last.preempted_req_ids or ())]
                continue
            finished = [kvsim_id(o.request_id) for o in outputs if o.finished]
            row = step_row(step, recorder.last, recorder.kinds, scheduler, finished)
            row["preempted_ids"] = sorted(carried + row["preempted_ids"])
            carried = []
            out.write(json.dumps(row) + "\n")
            step += 1
        out.write(json.dumps({"done": {"steps": step, "wall_s": time.perf_counter() - t0}}) + "\n")


def _vllm_version() -> str:
    import vllm
    return vllm.__version__


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: vllm_driver.py SPEC.json OUT.jsonl")
    with open(sys.argv[1]) as f:
        run(json.load(f), sys.argv[2])
