"""The recorded vLLM reference scenarios: small request sets that each exercise one scheduler rule.

Each scenario is a kvsim trace (arrivals by engine step) plus engine settings. `write_scenario`
stores it as `trace.jsonl` + `scenario.yaml` (a kvsim config); `kvsim reference vllm` records real
vLLM's schedule of it next to them (`vllm_steps.parquet`). The test suite replays every recorded
scenario in kvsim and requires the same schedule step for step.
"""
from __future__ import annotations

from dataclasses import dataclass, field

BLOCK = 32          # vLLM's CPU attention backend needs a block size that is a multiple of 32
# vLLM refuses to start unless the KV pool holds one request of max_model_len: small pools get a
# small max_model_len.


@dataclass(frozen=True)
class Scenario:
    name: str
    description: str
    prompts: list[int]
    outputs: list[int]
    arrival_steps: list[int] | None = None
    priorities: list[int] | None = None
    prefix_ids: list[list[int] | None] | None = None
    prefix_block_tokens: int | None = None
    engine: dict = field(default_factory=dict)

    def engine_settings(self) -> dict:
        settings = {"block_size": BLOCK, "num_gpu_blocks": 400, "max_num_batched_tokens": 512,
                    "max_num_seqs": 8, "max_model_len": 1024, "enable_prefix_caching": True,
                    "enable_chunked_prefill": True, "long_prefill_token_threshold": 0,
                    "scheduling_policy": "fcfs", "async_scheduling": False}
        settings.update(self.engine)
        return settings

    def trace_records(self) -> list[dict]:
        n = len(self.prompts)
        steps = self.arrival_steps or [0] * n
        records = []
        for i in range(n):
            rec = {"request_id": i, "arrival_time_s": steps[i], "prompt_tokens": self.prompts[i],
                   "output_tokens": self.outputs[i]}
            if self.priorities:
                rec["priority"] = self.priorities[i]
            if self.prefix_ids:
                rec["prefix_hash_ids"] = self.prefix_ids[i]
            records.append(rec)
        return records


SCENARIOS = [
    Scenario("closed_batch", "8 prompts at step 0, ample KV pool: admission order and decode batching",
             prompts=[5, 40, 120, 300, 700, 20, 60, 250], outputs=[32] * 8),
    Scenario("chunked_prefill_budget", "long prompts that exhaust a 256-token budget: chunk sizes per step",
             prompts=[900, 700, 450, 300, 120], outputs=[12] * 5,
             engine={"max_num_batched_tokens": 256, "num_gpu_blocks": 300, "max_model_len": 2048,
                     "enable_prefix_caching": False}),
    Scenario("staggered_arrivals", "requests arriving at different steps join the running batch",
             prompts=[64, 200, 33, 500, 97, 150, 31, 400, 250, 80],
             outputs=[20, 10, 30, 8, 16, 12, 24, 6, 10, 14],
             arrival_steps=[0, 0, 1, 3, 4, 6, 9, 12, 15, 20],
             engine={"max_num_batched_tokens": 384, "max_num_seqs": 6, "num_gpu_blocks": 200}),
    Scenario("memory_pressure_preemption",
             "8 prompts in 40 blocks: full-prompt admission, recompute preemption and resumption",
             prompts=[5, 40, 120, 300, 700, 20, 60, 250], outputs=[32] * 8,
             engine={"num_gpu_blocks": 40}),
    Scenario("max_num_seqs_cap", "12 short requests with at most 3 running",
             prompts=[30, 64, 45, 100, 33, 70, 90, 31, 64, 50, 80, 40],
             outputs=[6, 9, 12, 7, 10, 8, 6, 11, 9, 7, 6, 8],
             arrival_steps=[0] * 8 + [5, 6, 7, 8],
             engine={"max_num_seqs": 3, "num_gpu_blocks": 200}),
    Scenario("prefix_caching_eviction",
             "shared prefixes (64-token ids) in a 24-block pool: hits, revival of free cached blocks, "
             "LRU eviction of cached blocks",
             prompts=[230, 250, 300, 140, 330, 230, 100, 270],
             outputs=[8, 8, 8, 8, 8, 8, 8, 8],
             arrival_steps=[0, 0, 10, 12, 20, 30, 32, 40],
             prefix_ids=[[1, 2, 3], [1, 2, 3], [1, 2, 3, 4], [10, 11], [20, 21, 22, 23], [1, 2, 3],
                         [10], [20, 21, 22]],
             prefix_block_tokens=64,
             engine={"num_gpu_blocks": 24, "max_num_batched_tokens": 256, "max_model_len": 512}),
    Scenario("long_prefill_threshold",
             "96-token cap per prefill chunk, lifted for a request that is alone in the engine",
             prompts=[600, 350, 40, 500, 800], outputs=[10, 10, 10, 10, 6],
             arrival_steps=[0, 0, 0, 0, 60],
             engine={"long_prefill_token_threshold": 96, "num_gpu_blocks": 300}),
    Scenario("max_model_len_limits",
             "max_model_len 256: outputs capped at the model length, prompts that cannot fit refused",
             prompts=[100, 230, 255, 256, 300, 50], outputs=[20, 40, 10, 5, 5, 20],
             engine={"max_model_len": 256, "max_num_batched_tokens": 128, "num_gpu_blocks": 100}),
    Scenario("priority_preemption",
             "priority scheduling in a tight pool: admission by priority, lowest-priority victim",
             prompts=[150, 200, 180, 160, 210, 120], outputs=[40] * 6,
             arrival_steps=[0, 0, 0, 3, 3, 5], priorities=[2, 1, 0, 2, 1, 0],
             engine={"scheduling_policy": "priority", "num_gpu_blocks": 30, "max_model_len": 512}),
    Scenario("no_chunked_prefill", "chunked prefill off: a prompt that does not fit the budget waits",
             prompts=[300, 400, 200, 100, 250], outputs=[10, 10, 10, 10, 10],
             engine={"enable_chunked_prefill": False, "max_model_len": 512, "max_num_batched_tokens": 512,
                     "num_gpu_blocks": 100}),
]


def get_scenario(name: str) -> Scenario:
    for s in SCENARIOS:
        if s.name == name:
            return s
    raise KeyError(f"unknown scenario {name!r}; known: {', '.join(s.name for s in SCENARIOS)}")
