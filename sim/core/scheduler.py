"""Continuous-batching scheduler with vLLM v1 semantics (see DESIGN.md, Scheduler).

Per step: RUNNING requests first (in admission order), then WAITING ones (FCFS, or by
(priority, arrival) in priority mode), under a token budget and `max_num_seqs`. A running request
that cannot get its blocks preempts the most recently admitted running request (the least urgent in
priority mode; recompute: freed, reset to 0 computed tokens, put back at the head of WAITING; swap:
its KV goes to CPU memory) until the allocation fits or it preempts itself (the running requests
after it are still scheduled). Nothing is admitted in a step that preempted.
"""
from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field

from .kv_manager import KVCacheManager
from .request import Request, RequestStatus


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    long_prefill_token_threshold: int = 0      # 0 = no per-request chunk cap
    max_model_len: int = 131072
    enable_chunked_prefill: bool = True
    policy: str = "fcfs"                       # fcfs | priority
    preemption_mode: str = "recompute"         # recompute | swap
    swap_space_tokens: int = 0                 # CPU swap capacity in tokens (swap mode)


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int
    context_before: int          # KV token-equivalents resident before this step's tokens
    is_prefill: bool
    swap_in_tokens: int = 0


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    swap_out_tokens: int = 0
    swap_in_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class WaitingQueue:
    """FCFS deque, or a (priority, arrival, seq) heap; preempted requests return to the front."""

    def __init__(self, policy: str):
        self.policy = policy
        self._fifo: deque[Request] = deque()
        self._heap: list[tuple] = []
        self._seq = 0

    def __len__(self) -> int:
        return len(self._fifo) if self.policy == "fcfs" else len(self._heap)

    def add(self, req: Request) -> None:
        if self.policy == "fcfs":
            self._fifo.append(req)
        else:
            self._push(req)

    def add_front(self, req: Request) -> None:
        if self.policy == "fcfs":
            self._fifo.appendleft(req)
        else:
            self._push(req)

    def _push(self, req: Request) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (req.priority, req.arrival_time, self._seq, req))

    def peek(self) -> Request:
        return self._fifo[0] if self.policy == "fcfs" else self._heap[0][3]

    def pop(self) -> Request:
        return self._fifo.popleft() if self.policy == "fcfs" else heapq.heappop(self._heap)[3]

    def __iter__(self):
        return iter(self._fifo) if self.policy == "fcfs" else (e[3] for e in sorted(self._heap))


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager):
        self.config = config
        self.kv = kv
        self.waiting = WaitingQueue(config.policy)
        self.running: list[Request] = []
        self.finished: list[Request] = []
        self.rejected: list[Request] = []
        self.swap_used_tokens = 0
        self.num_preemptions = 0

    # ----- admission control -----------------------------------------------------------------
    def add_request(self, req: Request) -> bool:
        """Queue a request, or reject it with a reason when it can never fit. Output that would run
        past max_model_len is capped there (as vLLM stops at the model length)."""
        limit = self.config.max_model_len
        if req.prompt_tokens + 1 <= limit < req.prompt_tokens + req.max_output_tokens:
            req.max_output_tokens = limit - req.prompt_tokens
            req.extra["output_capped"] = True
        reason = self._never_fits(req)
        if reason:
            req.status = RequestStatus.REJECTED
            req.reject_reason = reason
            self.rejected.append(req)
            return False
        self.waiting.add(req)
        return True

    def _never_fits(self, req: Request) -> str | None:
        if req.prompt_tokens + 1 > self.config.max_model_len:
            return (f"prompt of {req.prompt_tokens} tokens leaves no room for output within "
                    f"max_model_len={self.config.max_model_len}")
        peak = req.prompt_tokens + req.max_output_tokens - 1
        capacity = self.kv.max_tokens_per_request()
        if peak > capacity:
            return (f"needs {peak} KV slots at its last token but the whole KV pool holds "
                    f"{capacity} tokens")
        budget = self.config.max_num_batched_tokens
        if not self.config.enable_chunked_prefill and peak > budget:
            # unchunked, its prompt (or its recompute after a preemption) must fit one step's budget
            return (f"needs up to {peak} tokens in one step (prompt, or prompt and outputs recomputed "
                    f"after a preemption) but max_num_batched_tokens={budget} and chunked prefill is off")
        return None

    @property
    def has_work(self) -> bool:
        return bool(self.running) or len(self.waiting) > 0

    # ----- one step ---------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        scheduled = self._schedule_decodes(budget)
        if scheduled is not None:
            budget -= len(scheduled)
        else:
            scheduled = self._schedule_running(budget, out)
            budget -= sum(s.num_new_tokens for s in scheduled.values())
        if not out.preempted:
            budget = self._admit(budget, scheduled, out)
        out.scheduled = list(scheduled.values())
        return out

    def _schedule_decodes(self, budget: int) -> dict | None:
        """The common step, when every running request decodes one token and the KV manager can
        reserve all their slots at once (`allocate_decodes`): the same result as the loop in
        `_schedule_running`, without its per-request calls. None when that does not hold (nothing
        was allocated then)."""
        allocate = getattr(self.kv, "allocate_decodes", None)
        running = self.running
        if allocate is None or not running or len(running) > budget:
            return None
        max_len = self.config.max_model_len
        for req in running:
            computed = req.num_computed_tokens
            if req.num_tokens - computed != 1 or not req.num_output_tokens or computed >= max_len:
                return None
        contexts = allocate(running)
        if contexts is None:
            return None
        return {req: ScheduledRequest(req, 1, ctx, False) for req, ctx in zip(running, contexts)}

    def _schedule_running(self, budget: int, out: SchedulerOutput) -> dict:
        scheduled: dict[Request, ScheduledRequest] = {}
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = self._chunk(req.num_tokens - req.num_computed_tokens, budget, req.num_computed_tokens)
            if n <= 0:
                i += 1
                continue
            context = self.kv.kv_tokens(req)
            while not self.kv.allocate_slots(req, n):
                if self.kv.reclaim(self.kv.blocks_needed(req, n), self.running):
                    continue
                victim, index = self._pick_victim()
                if index < i:                # priority mode may pick one already passed
                    i -= 1
                    if victim in scheduled:
                        budget += scheduled.pop(victim).num_new_tokens
                self._preempt(victim, out)
                if victim is req:
                    break
            else:
                scheduled[req] = ScheduledRequest(req, n, context, _is_prefill(req, n))
                budget -= n
                i += 1
        # A request that preempted itself was the last one (FCFS) or the least urgent one (priority):
        # the more urgent requests after it are still scheduled, into the blocks it gave back.
        return scheduled

    def _chunk(self, remaining: int, budget: int, computed: int) -> int:
        """New tokens a request gets: min(remaining, budget left, long_prefill_token_threshold)."""
        n = remaining
        if self.config.long_prefill_token_threshold > 0:
            n = min(n, self.config.long_prefill_token_threshold)
        return min(n, budget, self.config.max_model_len - computed)

    def _pick_victim(self) -> tuple[Request, int]:
        index = len(self.running) - 1
        if self.config.policy == "priority":
            index = max(range(len(self.running)),
                        key=lambda k: (self.running[k].priority, self.running[k].arrival_time, k))
        return self.running.pop(index), index

    def _preempt(self, victim: Request, out: SchedulerOutput) -> None:
        freed_tokens = self.kv.kv_tokens(victim)
        self.kv.free(victim)
        victim.status = RequestStatus.WAITING
        victim.num_preemptions += 1
        self.num_preemptions += 1
        swap = (self.config.preemption_mode == "swap"
                and self.swap_used_tokens + freed_tokens <= self.config.swap_space_tokens)
        if swap:
            victim.swapped_tokens = victim.num_computed_tokens
            self.swap_used_tokens += victim.swapped_tokens
            out.swap_out_tokens += freed_tokens
        else:
            victim.num_computed_tokens = 0
        self.waiting.add_front(victim)
        out.preempted.append(victim)

    def _admit(self, budget: int, scheduled: dict, out: SchedulerOutput) -> int:
        while len(self.waiting) and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting.peek()
            swapped = req.swapped_tokens
            hits = [] if swapped else self.kv.get_computed_blocks(req)
            num_cached = len(hits) * self.kv.block_size
            computed = swapped or num_cached
            remaining = req.num_tokens - computed
            if not self.config.enable_chunked_prefill and remaining > budget:
                break
            n = self._chunk(remaining, budget, computed)
            if swapped and self._swap_in_blocked(req, swapped + n):
                break                         # a failed swap-in must not touch the pool (see below)
            context = self._allocate_admission(req, swapped, num_cached, n, hits)
            if context is None:
                break
            self.waiting.pop()
            self.kv.record_prefix_lookup(req.num_tokens if not swapped else 0, num_cached)
            if req.first_scheduled_time is None:
                req.num_cached_tokens = num_cached
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            if swapped:
                self.swap_used_tokens -= swapped
                req.swapped_tokens = 0
                out.swap_in_tokens += swapped
            scheduled[req] = ScheduledRequest(req, n, context, _is_prefill(req, n), swap_in_tokens=swapped)
            budget -= n
        return budget

    def _swap_in_blocked(self, req: Request, tokens: int) -> bool:
        """Whether the blocks for a swapped request's KV plus this step's tokens are missing. Checked
        before allocating: allocating the swapped part and then failing on the rest would pull blocks
        off the free queue (evicting cached prefixes) and return them hashed, changing the pool."""
        req.num_computed_tokens = 0
        need = self.kv.blocks_needed(req, tokens)
        req.num_computed_tokens = req.swapped_tokens
        return need > self.kv.num_free_blocks

    def _allocate_admission(self, req: Request, swapped: int, num_cached: int, n: int, hits: list) -> float | None:
        """Slots for an admitted request (its swapped KV first); the context before this step's
        tokens, or None (the request unchanged) when the pool cannot supply them."""
        if swapped:                           # its KV comes back from CPU: restore the slots first
            req.num_computed_tokens = 0
            if not self.kv.allocate_slots(req, swapped):
                req.num_computed_tokens = swapped
                return None
        req.num_computed_tokens = swapped or num_cached
        context = self.kv.kv_tokens(req)
        if not self.kv.allocate_slots(req, n, computed_blocks=hits):
            self._undo_admission(req, swapped)
            return None
        return context

    def waiting_head_blocked(self, budget: int, free_blocks: int) -> bool:
        """Whether `_admit` would stop at the head of WAITING for lack of KV blocks (or, without
        chunked prefill, of budget) with `budget` tokens left and `free_blocks` free. Changes nothing.

        While free blocks only shrink (a decode run), a blocked head stays blocked.
        """
        req = self.waiting.peek()
        bs = self.kv.block_size
        if req.swapped_tokens:
            hits, computed = [], req.swapped_tokens
            if -(-computed // bs) > free_blocks:
                return True
        else:
            hits = self.kv.get_computed_blocks(req)
            computed = len(hits) * bs
        remaining = req.num_tokens - computed
        if not self.config.enable_chunked_prefill and remaining > budget:
            return True
        n = self._chunk(remaining, budget, computed)
        need = -(-(computed + n) // bs) - len(hits)
        revivable = sum(1 for b in hits if self.kv.pool.ref_cnt[b] == 0)
        return need > free_blocks - revivable

    def _undo_admission(self, req: Request, swapped: int) -> None:
        if swapped:
            self.kv.free(req)
            req.num_computed_tokens = swapped
        else:
            req.num_computed_tokens = 0

    # ----- after the step ran -----------------------------------------------------------------
    def update(self, out: SchedulerOutput, now: float) -> list[Request]:
        """Advance computed counts, sample tokens, finish requests; returns those that finished."""
        done = []
        for s in out.scheduled:
            req = s.request
            req.num_computed_tokens += s.num_new_tokens
            if req.num_computed_tokens >= req.num_tokens:
                req.num_output_tokens += 1
                req.token_times.append(now)
                if req.num_output_tokens >= req.max_output_tokens:
                    done.append(req)
        self.finish(done, now)
        return done

    def finish(self, reqs: list[Request], now: float) -> None:
        """Requests that produced their last token leave the batch and free their KV."""
        for req in reqs:
            self.running.remove(req)
            self.kv.free(req)
            self.kv.forget(req)
            req.prefix_hash_ids = None          # read only to hash its prompt blocks
            req.status = RequestStatus.FINISHED
            req.finish_time = now
            self.finished.append(req)


def _is_prefill(req: Request, num_new_tokens: int) -> bool:
    """A decode computes exactly the one token sampled last step; anything else is (re)prefill."""
    return not (num_new_tokens == 1 and req.num_output_tokens > 0
                and req.num_computed_tokens == req.num_tokens - 1)
