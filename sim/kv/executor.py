"""Cost-model executor for eviction-aware managers: runs the step's policies, charges their effects.

Per step: the manager applies the policies (after the step's attention), then the cost model is
charged the bytes copied/moved by the slot strategy, the per-head block-table entries, and the
KV reads the policies leave (evicted tokens are not read, quantized tiers read fewer bytes —
`kv_tokens_read` is in fp16 token-equivalents — and selection policies read only what they select).
"""
from __future__ import annotations

from ..core.scheduler import SchedulerOutput
from ..core.step import batch_shape
from ..engine import StepResult


class KVPolicyExecutor:
    supports_fast_forward = False

    def __init__(self, cost_model, kv):
        self.cost = cost_model
        self.kv = kv
        self.last_plan = None

    def execute(self, out: SchedulerOutput) -> StepResult:
        shape = batch_shape(out, self.kv, self.cost.kv_bytes_per_token)
        plan = self.kv.finish_step(out.scheduled)
        shape.bytes_moved = plan.bytes_moved
        shape.op_bytes = plan.op_bytes
        shape.op_flops = plan.op_flops
        seconds = float(self.cost.predict(shape))
        self.last_plan = plan
        return StepResult(duration_s=seconds, predicted_s=seconds, evicted_tokens=plan.evicted_tokens,
                          blocks_freed_by_eviction=plan.blocks_freed_by_eviction, bytes_moved=plan.bytes_moved,
                          shape=shape)

    def predict_run(self, shape):
        return self.cost.predict(shape)
