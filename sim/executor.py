"""The simulator's executor: a step takes as long as the cost model predicts."""
from __future__ import annotations

from .core.scheduler import SchedulerOutput
from .core.step import BatchShape, batch_shape
from .engine import StepResult


class CostModelExecutor:
    supports_fast_forward = True

    def __init__(self, cost_model, kv):
        self.cost = cost_model
        self.kv = kv
        # A profile that prices padded decode attention needs each step's widest block table, which
        # the decode fast-forward does not compute: such runs step one at a time (same results).
        self.supports_fast_forward = not cost_model.profile.padded_attn_cost

    def execute(self, out: SchedulerOutput) -> StepResult:
        shape = batch_shape(out, self.kv, self.cost.kv_bytes_per_token)
        seconds = float(self.cost.predict(shape))
        return StepResult(duration_s=seconds, predicted_s=seconds, shape=shape)

    def predict_run(self, shape: BatchShape):
        return self.cost.predict(shape)

    def predict_decode_run(self, num_seqs, kv_tokens_read, block_table_entries):
        """Durations of a run of pure-decode steps (float64 arrays), as `execute` would price them."""
        return self.cost.predict_decode(num_seqs, kv_tokens_read, block_table_entries)
