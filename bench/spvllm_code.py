"""SpvLLM's fragmentation figures as its code computes them (github.com/Charlie-XIAO/sparse-vllm).

kvsim's slot strategies keep the block table, the attention kernel's range and the recorded scores
consistent. SpvLLM's code does not, in two places that decide its published p99 fragmentation, and
this module replays its per-sequence bookkeeping with them (scores from kvsim's importance model,
shared layout, so only the code path differs from `kvsim simulate`):

- `seq_len`: the kernel, the slot mapping and the recorded scores cover the first `get_len()` slots
  of the block table, and `get_len()` is prompt + outputs - `num_evicted_tokens`. The no-op and
  free-block strategies subtract only freed blocks' slots, so that is the table's length. The
  spvllm strategy (slot reuse) subtracts every evicted token, while its table still holds the
  holes: after a cut the kernel sees a prefix of the table, the live tokens beyond it are neither
  attended, counted as active, nor evictable; `append_slots` re-activates the first hole (its stale
  KV), the new token's KV is written at position `get_len() - 1`. Active slots are counted in the
  prefix, the total over the whole table, so the reported fragmentation is higher than the table's
  (`seq_len_prefix`).
- paged_attention_v2: vLLM uses it when the longest sequence of a decode batch spans more than one
  512-token partition and batch x heads <= 512 (42 sequences for OPT-125m's 12 heads). SpvLLM's
  kernel reads the block mask and writes the recorded score at `token_idx - start_token_idx`, the
  index inside the partition: partition p's softmax (normalized over the partition) lands on slots
  0..511, masked by those slots' flags, and slots from 512 on get no score. Evictions then fall on
  the unscored slots past 512 just behind the protected recent tokens, a contiguous run, and
  free_block gives their blocks back (`v2_relative_index`). Which partition's write lands last is a
  race; the replay takes their mean.

The sparse-copy strategy (`sparse_copy` here, the code's `sparse-copy`) is replayed for its copy
volume: its H2O `step` deletes the evicted slots' scores and asks for `ceil((num_slots - evicted + 1) /
16)` fresh blocks, and at the sequence's next schedule (`append_migrate_slots`, worker.py,
`migrate_blocks_kernel`) every slot of `range(num_slots)` not evicted, i.e. every kept token, is copied
densely into them (one kernel launch per step for all sequences, grid layers x sequences x slots, K and
V of every head); the old blocks are then freed. A sequence that finishes right after an eviction is
freed, not copied. `copy_lines` gives the slots copied per step; bytes = slots x 2 x layers x hidden
x 2 (fp16).

The rest follows the code: vLLM v0's schedule (prefills first, 2,048 batched tokens, at most
`max_num_seqs` sequences; OPT-125m on a T4 holds ~370K tokens, more than this workload's peak, so
nothing is preempted), H2O `step` per decoding sequence after the step's forward (scores summed over
decode steps only, keep `budget` = half the last active slots by position + the top accumulated
rest, SpvLLM's score array resized to `seq_len`, and for removed blocks `np.delete` at the original
block index one block at a time, as the code does), one fragmentation line per decode step
(1 - sum of active slots before the eviction / sum of table slots after it), the first 200 lines
dropped, then p99 (cs243/analyze.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

BLOCK = 16
PARTITION = 512
V2_MAX_SEQ_HEADS = 512          # vLLM: v1 when batch x heads > 512 or one partition
OPT_125M_HEADS = 12
WARMUP_LINES = 200


@dataclass(frozen=True)
class CodePath:
    """Which of SpvLLM's code facts the replay applies (both: as its code runs)."""
    seq_len_prefix: bool = True
    v2_relative_index: bool = True


class _Sequence:
    """One sequence's block table (slots = table positions), masks, SpvLLM's score array, and a
    TokenState holding what each slot's KV is (pos) for the importance model."""

    def __init__(self, req_id: int, prompt: int, output: int, model):
        from kvsim.sim.kv.state import TokenState

        self.req_id, self.prompt, self.output, self.model = req_id, prompt, output, model
        n = -(-prompt // BLOCK) * BLOCK
        self.state = TokenState(1, n)
        self.mask = np.ones(n, bool)                 # fresh blocks are all-active, as BlockTable's
        self.cum: np.ndarray | None = None
        self.evicted = 0                             # Sequence._num_evicted_tokens
        self.steps = 0
        self.pending_copy = 0                        # sparse_copy: slots the next schedule migrates
        self._write(np.arange(prompt), np.arange(prompt))

    def _write(self, slots: np.ndarray, positions: np.ndarray) -> None:
        self.state.pos[0, slots] = positions
        self.state.num_tokens = int(positions[-1]) + 1
        self.model.on_write(self.req_id, self.state, np.array([0]), slots[None, :], positions)

    def get_len(self) -> int:
        return self.prompt + self.steps - self.evicted

    def append(self, strategy: str, path: CodePath) -> tuple[int, int]:
        """BlockSpaceManagerV1.append_slots (+ append_migrate_slots) and the slot mapping; returns the
        kernel's seq_len and the slots migrated before this step (sparse_copy)."""
        self.steps += 1
        copied, self.pending_copy = self.pending_copy, 0
        seq_len = self.get_len()
        if len(self.mask) < -(-seq_len // BLOCK) * BLOCK:
            self.state.resize(len(self.mask) + BLOCK)
            self.mask = np.concatenate([self.mask, np.ones(BLOCK, bool)])
            write = seq_len - 1
        elif strategy == "slot_reuse" and not self.mask.all():
            hole = int(np.argmin(self.mask))
            self.mask[hole] = True
            write = seq_len - 1 if path.seq_len_prefix else hole
        else:
            write = seq_len - 1
        self._write(np.array([write]), np.array([self.prompt + self.steps - 1]))
        if strategy == "slot_reuse" and not path.seq_len_prefix:
            seq_len = int(np.flatnonzero(self.state.pos[0] >= 0)[-1]) + 1
        return seq_len, copied

    def scores(self, seq_len: int, v2: bool) -> np.ndarray:
        """The recorded score row over slots 0..seq_len-1, averaged over layers and heads."""
        live = self.state.live
        live[:] = False
        if not v2 or seq_len <= PARTITION:
            live[0, :seq_len] = self.mask[:seq_len]
            return self.model.decode_scores(self.req_id, self.state)[0][0, :seq_len].astype(np.float64)
        parts = range(0, seq_len, PARTITION)
        for p in parts:                               # partition p reads mask[i] for slot p + i
            n = min(PARTITION, seq_len - p)
            live[0, p:p + n] = self.mask[:n]
        a = self.model.decode_scores(self.req_id, self.state)[0][0].astype(np.float64)
        out = np.zeros(seq_len)
        count = np.zeros(seq_len)
        for p in parts:                               # ... and writes its own softmax at slot i
            n = min(PARTITION, seq_len - p)
            part = a[p:p + n]
            if part.sum() > 0:
                out[:n] += part / part.sum()
                count[:n] += 1
        return np.divide(out, count, out=np.zeros(seq_len), where=count > 0)

    def step(self, seq_len: int, scores: np.ndarray, budget: int, strategy: str) -> tuple[int, int]:
        """H2OKVCacheSparsifier.step: (active slots before the eviction, table slots after it)."""
        if self.cum is None:
            self.cum = scores.copy()
        else:
            self.cum = _resized(self.cum, seq_len)
            self.cum += scores
        in_range = self.mask[:seq_len]
        active = np.flatnonzero(in_range)
        if len(active) <= budget:
            return len(active), len(self.mask)
        k, k_last = budget // 2, (budget + 1) // 2
        cand = active[:-k_last]
        top = cand[np.argpartition(self.cum[cand], -k)[-k:]]
        evict = in_range.copy()
        evict[top] = False
        evict[active[-k_last:]] = False
        slots = np.flatnonzero(evict)
        if strategy == "sparse_copy":
            return self._sparse_copy(seq_len, slots, len(active))
        self.mask[slots] = False
        if strategy == "noop":
            return len(active), len(self.mask)
        blocks = self.mask.reshape(-1, BLOCK).any(axis=1)
        removed = np.flatnonzero(~blocks)
        if len(removed):
            for i in removed:                        # SpvLLM deletes at the original index, one by one
                self.cum = np.delete(self.cum, np.s_[i * BLOCK:(i + 1) * BLOCK])
            kept = np.flatnonzero(np.repeat(blocks, BLOCK))
            self.state.move(np.zeros(len(kept), int), kept, np.arange(len(kept)))
            self.state.resize(len(kept))
            self.mask = self.mask[kept]
        self.evicted += len(removed) * BLOCK if strategy == "free_block" else len(slots)
        return len(active), len(self.mask)


    def _sparse_copy(self, seq_len: int, slots: np.ndarray, active: int) -> tuple[int, int]:
        """The sparse-copy branch: no slot is deactivated; the kept slots of range(seq_len) move densely
        into ceil((kept + 1) / 16) fresh blocks at the next schedule (done here: the replay's state is
        the same, and the step's line still counts the old table)."""
        total = len(self.mask)
        self.cum = np.delete(self.cum, slots)
        kept = np.setdiff1d(np.arange(seq_len), slots)
        self.pending_copy = len(kept)
        self.evicted += len(slots)
        self.state.move(np.zeros(len(kept), int), kept, np.arange(len(kept)))
        n = -(-(len(kept) + 1) // BLOCK) * BLOCK
        self.state.resize(n)
        self.mask = np.ones(n, bool)
        return active, total


def _resized(a: np.ndarray, n: int) -> np.ndarray:
    out = np.zeros(n)
    m = min(n, len(a))
    out[:m] = a[:m]
    return out


def fragmentation_lines(prompts, outputs, budget: int, strategy: str, *, path: CodePath = CodePath(),
                        importance: str = "smollm2-135m-aged", max_num_seqs: int = 256,
                        max_batched_tokens: int = 2048, num_heads: int = OPT_125M_HEADS, seed: int = 0
                        ) -> np.ndarray:
    """Per decode step (active, total) slot sums, as SpvLLM prints its #CS243F# lines."""
    return _replay(prompts, outputs, budget, strategy, path, importance, max_num_seqs, max_batched_tokens,
                   num_heads, seed)[:, :2]


def copy_lines(prompts, outputs, budget: int, *, importance: str = "smollm2-135m-aged", max_num_seqs: int = 256,
               max_batched_tokens: int = 2048, seed: int = 0) -> np.ndarray:
    """sparse_copy: slots migrated per decode step (one kernel launch on each step with any)."""
    return _replay(prompts, outputs, budget, "sparse_copy", CodePath(), importance, max_num_seqs, max_batched_tokens,
                   OPT_125M_HEADS, seed)[:, 2]


def _replay(prompts, outputs, budget, strategy, path, importance, max_num_seqs, max_batched_tokens, num_heads,
            seed) -> np.ndarray:
    """Per decode step (active, total, slots migrated before the step)."""
    from kvsim.sim.kv.importance import SyntheticImportance
    from kvsim.sim.kv.policy import PolicyContext

    if strategy not in ("noop", "free_block", "slot_reuse", "sparse_copy"):
        raise ValueError(f"strategy {strategy!r}: expected noop, free_block, slot_reuse or sparse_copy")
    model = SyntheticImportance(PolicyContext("shared", 12, 12, 12, BLOCK, 1), importance, seed)
    waiting, running, lines = list(range(len(prompts))), [], []
    while waiting or running:
        if waiting and len(running) < max_num_seqs:          # a prefill step: no attention recorded
            tokens = 0
            while waiting and len(running) < max_num_seqs and tokens + prompts[waiting[0]] <= max_batched_tokens:
                r = waiting.pop(0)
                tokens += int(prompts[r])
                running.append(_Sequence(r, int(prompts[r]), int(outputs[r]), model))
            continue
        appended = [s.append(strategy, path) for s in running]
        lens = [n for n, _ in appended]
        v2 = path.v2_relative_index and max(lens) > PARTITION and len(running) * num_heads <= V2_MAX_SEQ_HEADS
        active = total = 0
        for s, n in zip(running, lens, strict=True):
            a, t = s.step(n, s.scores(n, v2), budget, strategy)
            active += a
            total += t
        lines.append((active, total, sum(c for _, c in appended)))
        for s in [s for s in running if s.steps >= s.output - 1]:
            running.remove(s)
            model.release(s.req_id)
    return np.array(lines, dtype=np.int64).reshape(-1, 3)


def fragmentation_p99(lines: np.ndarray, warmup: int = WARMUP_LINES) -> float:
    """cs243/analyze.py: 1 - active / total per line, the first `warmup` lines dropped, p99."""
    a, t = lines[warmup:, 0], lines[warmup:, 1]
    return float(np.percentile(1 - a / t, 99))
