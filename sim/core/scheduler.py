"""Continuous-batching scheduler with vLLM v1 semantics (checked step for step against real vLLM).

Per step: RUNNING requests first (in admission order), then WAITING ones (FCFS, or by
(priority, arrival) in priority mode), under a token budget and `max_num_seqs`. A running request
that cannot get its blocks preempts the most recently admitted running request (priority mode:
the least urgent, latest arrival) (recompute: freed, reset to 0 computed tokens, put back at the
head of WAITING; swap, a vLLM v0 extension: its KV goes to CPU memory) until the allocation fits
or it preempts itself (which ends the running loop; a step left empty by that is rescheduled at
once, as vLLM runs an empty step). Nothing is admitted in a step that preempted. A waiting request is admitted
only when the free pool holds its whole known sequence after prefix hits (vLLM's
`scheduler_reserve_full_isl`). `long_prefill_token_threshold` caps chunks only while more than one
request is running or waiting.

Async scheduling (vLLM's default on GPUs) schedules step k+1 while step k runs: requests that
finish in step k keep their sequence slot and blocks until step k+1 has been scheduled (they are
not scheduled again), and the engine shows step k+1's scheduler only the arrivals from before
step k started.
"""
from __future__ import annotations

import heapq
from collections import deque
from itertools import repeat
from dataclasses import dataclass, field
from operator import attrgetter
from typing import NamedTuple, cast

from .connector import KVConnector, KVTransferStep
from .kv_manager import KVCacheManager
from .sliding_window import HybridKVManager
from .protocols import KVManager
from .request import Request, RequestStatus
from .spec_decode import SpecDecoder


_REQUEST = attrgetter("request")


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
    async_scheduling: bool = False             # finishes release their slot one schedule later


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int
    context_before: float        # KV token-equivalents resident before this step's tokens
    is_prefill: bool
    swap_in_tokens: int = 0
    num_spec_tokens: int = 0     # draft tokens verified in this step (speculative decoding)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    swap_out_tokens: float = 0        # KV token-equivalents swapped out (kv_tokens of the victims)
    swap_in_tokens: int = 0
    kv_transfer: KVTransferStep | None = None     # the connector's synchronous loads/saves this step
    # set when the step is `scheduled`'s requests each decoding one token and nothing else (the common
    # step, `Scheduler._schedule_decodes`): their contexts, in order, so `update` and `batch_shape` skip
    # the per-request tests (the same results); None: not known, the general paths run
    decode_contexts: list | None = None

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Admission(NamedTuple):
    """An admissible request's prefix-cache hits and the tokens it gets this step; with a KV
    connector, the tokens computed before the step (hits, swapped or loaded KV, external tokens),
    the external ones among them and whether they load asynchronously (no tokens this step)."""
    hits: list
    num_new_tokens: int
    computed: int = 0
    external: int = 0
    load_async: bool = False


# `admission`'s answer when the KV connector cannot yet say what it holds of the request: the
# request is skipped this schedule (vLLM), the ones behind it may be admitted
CONNECTOR_PENDING = Admission([], 0, -1)


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
        heapq.heappush(self._heap, (req.priority, req.arrival_time, req.arrival_order, req))

    def peek(self) -> Request:
        return self._fifo[0] if self.policy == "fcfs" else self._heap[0][3]

    def pop(self) -> Request:
        return self._fifo.popleft() if self.policy == "fcfs" else heapq.heappop(self._heap)[3]

    def __iter__(self):
        return iter(self._fifo) if self.policy == "fcfs" else (e[3] for e in sorted(self._heap))

    def remove(self, req: Request) -> bool:
        """Take `req` out of the queue wherever it is (an abort); False if it is not queued."""
        if self.policy == "fcfs":
            try:
                self._fifo.remove(req)
            except ValueError:
                return False
            return True
        for i, entry in enumerate(self._heap):
            if entry[3] is req:
                self._heap[i] = self._heap[-1]
                self._heap.pop()
                heapq.heapify(self._heap)
                return True
        return False

    def promote(self, first) -> bool:
        """FCFS: move the requests for which `first(req)` holds to the front, in their order; whether
        the head changed (a priority heap keeps its order: False)."""
        if self.policy != "fcfs":
            return False
        ahead = [r for r in self._fifo if first(r)]
        if not ahead or ahead[0] is self._fifo[0]:
            return False
        rest = [r for r in self._fifo if not first(r)]
        self._fifo = deque(ahead + rest)
        return True


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVManager, connector: KVConnector | None = None,
                 spec: SpecDecoder | None = None):
        self.config = config
        self.kv = kv
        self.connector = connector
        self.spec = spec                       # speculative decoding (sim/core/spec_decode.py), or None
        self.loading: list[Request] = []       # WAITING_FOR_REMOTE_KVS: the connector loads their KV
        self.sending: list[Request] = []       # finished; blocks kept until the connector saved/sent them
        self.waiting = WaitingQueue(config.policy)
        self.running: list[Request] = []
        self.finished: list[Request] = []
        self.rejected: list[Request] = []
        self.aborted: list[Request] = []       # aborted by their client (`abort`)
        self.swap_used_tokens = 0
        self.num_preemptions = 0
        self.num_submitted = 0
        self.finishing: list[Request] = []     # async scheduling: finished, slot released next schedule
        self._threshold = config.long_prefill_token_threshold
        self._decode_contexts: list | None = None   # `_schedule_decodes`'s contexts (its step's)

    # ----- admission control -----------------------------------------------------------------
    def add_request(self, req: Request) -> bool:
        """Queue a request, or reject it with a reason when it can never fit. Output that would run
        past max_model_len is capped there (as vLLM stops at the model length)."""
        req.arrival_order = self.num_submitted
        self.num_submitted += 1
        capped = self.capped_output(req)
        if capped != req.max_output_tokens:
            req.max_output_tokens = capped
            req.output_capped = True
        reason = self._never_fits(req, capped)
        if reason:
            req.status = RequestStatus.REJECTED
            req.reject_reason = reason
            self.rejected.append(req)
            return False
        self.waiting.add(req)
        return True

    def capped_output(self, req: Request) -> int:
        """The output length `req` gets: its own, capped at max_model_len (vLLM stops there)."""
        limit = self.config.max_model_len
        if req.prompt_tokens + 1 <= limit < req.prompt_tokens + req.max_output_tokens:
            return limit - req.prompt_tokens
        return req.max_output_tokens

    def never_fits(self, req: Request) -> bool:
        """Whether `add_request` would reject `req`. Changes nothing."""
        return self.reject_reason(req) is not None

    def reject_reason(self, req: Request) -> str | None:
        """Why `add_request` would reject `req` (it can never fit), or None. Changes nothing."""
        return self._never_fits(req, self.capped_output(req))

    def _never_fits(self, req: Request, max_output: int) -> str | None:
        if req.prompt_tokens + 1 > self.config.max_model_len:
            return (f"prompt of {req.prompt_tokens} tokens leaves no room for output within "
                    f"max_model_len={self.config.max_model_len}")
        peak = req.prompt_tokens + max_output - 1
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
        return len(self.running) > len(self.finishing) or len(self.waiting) > 0

    @property
    def awaiting_transfers(self) -> bool:
        """Requests wait for a connector's load, or hold blocks for its save/send."""
        return bool(self.loading or self.sending)

    # ----- one step ---------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = self._schedule_step()
        if self.connector is not None:
            out.kv_transfer = self.connector.build_connector_meta(out)
        return out

    def _schedule_step(self) -> SchedulerOutput:
        out = SchedulerOutput()
        had_finishing = bool(self.finishing)
        budget = self.config.max_num_batched_tokens
        # the cap exists so a long prefill does not starve others: alone, a request gets the budget
        alone = len(self.running) - len(self.finishing) + len(self.waiting) <= 1
        self._threshold = 0 if alone else self.config.long_prefill_token_threshold
        decodes = self.spec is None and self._all_decode()
        scheduled = self._schedule_decodes(budget) if decodes else None
        contexts = self._decode_contexts
        if scheduled is not None:
            budget -= len(scheduled)
        else:
            contexts = None
            scheduled = self._schedule_running(budget, out, decodes and type(self.kv) is KVCacheManager)
            budget -= sum(s.num_new_tokens for s in scheduled.values())
        if not out.preempted:
            budget = self._admit(budget, scheduled, out)
        out.scheduled = list(scheduled.values())
        if contexts is not None and len(out.scheduled) == len(contexts):    # nothing admitted
            out.decode_contexts = contexts
        self.release_finishing()
        if out.is_empty and out.preempted:
            # vLLM runs an empty step after a request preempted itself first thing; the next
            # schedule may admit again. Both come out as one step here.
            again = self._schedule_step()
            again.preempted[:0] = out.preempted
            again.swap_out_tokens += out.swap_out_tokens
            return again
        if out.is_empty and had_finishing:
            return self._schedule_step()    # async: an empty step; the freed blocks serve the next
        return out

    def release_finishing(self) -> None:
        """Async scheduling: requests that finished in the step in flight leave now."""
        if self.finishing:
            done, self.finishing = self.finishing, []
            for req in done:
                self.running.remove(req)
                self._free_finished(req)

    def _all_decode(self) -> bool:
        """Whether every running request (those done in the step in flight aside) decodes one token:
        it computed all its known tokens but the last sampled one, below max_model_len."""
        max_len = self.config.max_model_len
        finished = RequestStatus.FINISHED
        for req in self.running:
            computed = req.num_computed_tokens
            if (req.prompt_tokens + req.num_output_tokens - computed != 1 or not req.num_output_tokens
                    or computed >= max_len) and req.status != finished:
                return False
        return True

    def _schedule_decodes(self, budget: int) -> dict | None:
        """The common step, when every running request decodes one token (`_all_decode`) and the KV
        manager can reserve all their slots at once (`allocate_decodes`): the same result as the
        loop in `_schedule_running`, without its per-request calls. None when that does not hold
        (nothing was allocated then)."""
        running = self.running
        if self.finishing:       # async: requests done in the step in flight are skipped, as the loop skips them
            running = [r for r in running if r.status != RequestStatus.FINISHED]
        if not running or len(running) > budget:
            return None
        contexts = self.kv.allocate_decodes(running)
        if contexts is None:
            return None
        self._decode_contexts = contexts
        return dict(zip(running, map(ScheduledRequest, running, repeat(1), contexts, repeat(False)), strict=True))

    def _schedule_running(self, budget: int, out: SchedulerOutput, bulk: bool = False) -> dict:
        """The running requests' tokens, request by request, preempting from the tail when one cannot get
        its blocks. `bulk` (every running request decodes, the plain KV manager): the requests that get
        their slot without a preemption are allocated together (`_bulk_decodes`), the same result."""
        scheduled: dict[Request, ScheduledRequest] = {}
        i = 0
        while i < len(self.running) and budget > 0:
            if bulk:
                i, budget = self._bulk_decodes(i, budget, scheduled)
                if i >= len(self.running) or budget <= 0:
                    break
            req = self.running[i]
            if req.status == RequestStatus.FINISHED:     # async: done in the step in flight
                i += 1
                continue
            n = self.new_tokens(req.num_tokens + req.spec_tokens - req.num_computed_tokens, budget,
                                req.num_computed_tokens)
            if n <= 0:
                i += 1
                continue
            context = self.kv.kv_tokens(req)
            while not self._allocate_running(req, n):
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
                drafts = n + req.num_computed_tokens - req.num_tokens if req.spec_tokens else 0
                if drafts > 0:       # vLLM: the drafts trimmed to those scheduled
                    scheduled[req] = ScheduledRequest(req, n, context, _is_prefill(req, n - drafts),
                                                      num_spec_tokens=drafts)
                else:
                    scheduled[req] = ScheduledRequest(req, n, context, _is_prefill(req, n))
                req.spec_tokens = 0   # new drafts are proposed after this step (vLLM)
                budget -= n
                i += 1
                continue
            break           # vLLM (0.32, recorded): a request that preempted itself ends the loop
        return scheduled

    def _bulk_decodes(self, i: int, budget: int, scheduled: dict) -> tuple[int, int]:
        """From running request `i` on (all decoding, the plain KV manager), the requests whose decode slot
        the free pool supplies in order, allocated at once (`allocate_decodes`: the pool as one
        `allocate_slots(req, 1)` after another leaves it) and scheduled, as the loop of
        `_schedule_running` would; the index of the first request left for that loop and the budget left."""
        kv = cast(KVCacheManager, self.kv)
        running, req_blocks, bs = self.running, kv.req_blocks, kv.block_size
        free = kv.pool.num_free_blocks
        finished = RequestStatus.FINISHED
        reqs = []
        n = len(running)
        start = i, budget
        while i < n and budget > 0:
            req = running[i]
            if req.status != finished:
                if len(req_blocks[req]) * bs <= req.num_computed_tokens:     # a new block
                    if not free:
                        break
                    free -= 1
                reqs.append(req)
                budget -= 1
            i += 1
        if reqs:
            contexts = kv.allocate_decodes(reqs)
            if contexts is None:         # the manager declined (nothing allocated): the loop goes request by request
                return start
            scheduled.update(zip(reqs, map(ScheduledRequest, reqs, repeat(1), contexts, repeat(False)), strict=True))
        return i, budget

    def _allocate_running(self, req: Request, n: int) -> bool:
        """Slots for a running request's `n` tokens; with speculative decoding, vLLM's
        `allocate_slots(req, n, num_lookahead_tokens)` (only verified tokens' blocks are hashed)."""
        if self.spec is None:
            return self.kv.allocate_slots(req, n)
        # the plain manager or the sliding-window one: those speculative decoding runs with (sim/config.py)
        kv = cast(KVCacheManager | HybridKVManager, self.kv)
        return kv.allocate_spec_slots(req, n, self.spec.lookahead)

    def new_tokens(self, remaining: int, budget: int, computed: int, threshold: int | None = None) -> int:
        """New tokens a request gets: min(remaining, budget left, long_prefill_token_threshold)."""
        n = self.capped(remaining, threshold)
        return min(n, budget, self.config.max_model_len - computed)

    def capped(self, n: int, threshold: int | None = None) -> int:
        """`n` under the chunk cap (this step's, unless `threshold` is given)."""
        threshold = self._threshold if threshold is None else threshold
        return min(n, threshold) if threshold > 0 else n

    def _pick_victim(self) -> tuple[Request, int]:
        candidates = [k for k, r in enumerate(self.running) if r.status != RequestStatus.FINISHED]
        index = candidates[-1]
        if self.config.policy == "priority":
            index = max(candidates, key=lambda k: _priority_key(self.running[k]))
        return self.running.pop(index), index

    def _preempt(self, victim: Request, out: SchedulerOutput) -> None:
        freed_tokens = self.kv.kv_tokens(victim)
        self.kv.free(victim)
        victim.status = RequestStatus.WAITING
        victim.num_preemptions += 1
        victim.spec_tokens = 0               # vLLM clears a preempted request's drafts
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
        if self.connector is not None:
            return self._admit_with_connector(budget, scheduled, out)
        while len(self.waiting) and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting.peek()
            swapped = req.swapped_tokens
            admission = self.admission(req, budget)
            if admission is None:
                break
            hits, n = admission[:2]
            num_cached = len(hits) * self.kv.block_size
            if swapped and self._swap_in_blocked(req, swapped + n):
                break                         # a failed swap-in must not touch the pool (see below)
            context = self._allocate_admission(req, swapped, num_cached, n, hits)
            if context is None:
                break
            self.waiting.pop()
            if not swapped:
                self.kv.record_prefix_lookup(req.num_tokens, num_cached, preempted=req.num_preemptions > 0)
            if req.first_scheduled_time is None:
                req.num_cached_tokens = num_cached
            self._start_running(req, n, context, scheduled, out)
            budget -= n
        return budget

    def _start_running(self, req: Request, n: int, context: float, scheduled: dict, out: SchedulerOutput) -> None:
        """An admitted request joins RUNNING with `n` tokens this step (its swapped KV back from CPU)."""
        swapped = req.swapped_tokens
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        if swapped:
            self.swap_used_tokens -= swapped
            req.swapped_tokens = 0
            out.swap_in_tokens += swapped
        scheduled[req] = ScheduledRequest(req, n, context, _is_prefill(req, n), swap_in_tokens=swapped)

    def _admit_with_connector(self, budget: int, scheduled: dict, out: SchedulerOutput) -> int:
        """`_admit` with a KV connector: as vLLM's scheduler calls it (sim/core/connector.py). A request
        whose external KV loads asynchronously gets its blocks, leaves WAITING for `loading` and takes
        no budget; one the connector cannot place yet is skipped this schedule (back at the front after)."""
        connector = self.connector
        assert connector is not None
        skipped: list[Request] = []
        while len(self.waiting) and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting.peek()
            swapped = req.swapped_tokens
            admission = self.admission(req, budget)
            if admission is CONNECTOR_PENDING:
                skipped.append(self.waiting.pop())
                continue
            if admission is None:
                if self._loaded_first():
                    continue
                break
            hits, n, computed, external, load_async = admission
            if swapped and self._swap_in_blocked(req, swapped + n):
                break
            resumed = bool(req.num_computed_tokens) and not swapped      # its KV was loaded
            if load_async:
                req.status = RequestStatus.WAITING_FOR_REMOTE_KVS      # its blocks are not hashed until loaded
            context = self._allocate_admission(req, swapped, computed, n, hits)
            if context is None:
                req.status = RequestStatus.WAITING
                if resumed:
                    req.num_computed_tokens = computed         # it keeps its loaded KV
                break
            self.waiting.pop()
            if not swapped and not resumed:
                num_local = len(hits) * self.kv.block_size
                self.kv.record_prefix_lookup(req.num_tokens, num_local, preempted=req.num_preemptions > 0)
                req.num_external_computed_tokens = external
                connector.update_state_after_alloc(req, external)
            if load_async:
                self.loading.append(req)
                continue
            if req.first_scheduled_time is None:
                req.num_cached_tokens = computed
            self._start_running(req, n, context, scheduled, out)
            budget -= n
        for req in reversed(skipped):
            self.waiting.add_front(req)
        return budget

    def _loaded_first(self) -> bool:
        """A waiting request whose KV the connector loaded holds its blocks: when the head cannot be
        admitted (a request preempted after the load returned ahead of it), the loaded ones go first,
        else the blocks they hold could keep the head out for ever. Whether the head changed."""
        head = self.waiting.peek()
        if head.num_computed_tokens and not head.swapped_tokens:
            return False
        return self.waiting.promote(lambda r: bool(r.num_computed_tokens) and not r.swapped_tokens
                                    and r in self.kv.req_blocks)

    def update_from_connector(self, now: float) -> None:
        """The connector's asynchronous transfers done by `now` (vLLM: each step's KV connector
        output): loaded requests return to the front of WAITING with their KV computed (the last
        prompt token recomputed, for its logits); sent ones free their blocks."""
        assert self.connector is not None
        received, sent = self.connector.get_finished(now)
        for req in sent:
            self.sending.remove(req)
            if req not in self.finishing:       # else it leaves at the next schedule (async)
                self.kv.free(req)
        for req in reversed(received):
            self.loading.remove(req)
            req.num_computed_tokens = min(req.num_computed_tokens, req.num_tokens - 1)
            req.status = RequestStatus.WAITING
            self.kv.allocate_slots(req, 0)       # hashes its loaded full blocks (prefix caching)
            self.waiting.add_front(req)

    def next_transfer_completion(self) -> float:
        """When the connector's next asynchronous transfer completes (inf: none, or no connector)."""
        return self.connector.next_completion() if self.connector is not None else float("inf")

    def admit_waiting(self, budget: int) -> list[ScheduledRequest]:
        """Admit from WAITING as a step's schedule does with `budget` tokens left beside running
        requests (the chunk cap applies); what it admitted, in order."""
        self._threshold = self.config.long_prefill_token_threshold
        scheduled: dict = {}
        self._admit(budget, scheduled, SchedulerOutput())
        return list(scheduled.values())

    def _swap_in_blocked(self, req: Request, tokens: int) -> bool:
        """Whether the blocks for a swapped request's KV plus this step's tokens are missing. Checked
        before allocating: allocating the swapped part and then failing on the rest would pull blocks
        off the free queue (evicting cached prefixes) and return them hashed, changing the pool."""
        req.num_computed_tokens = 0
        need = self.kv.blocks_needed(req, tokens)
        req.num_computed_tokens = req.swapped_tokens
        return need > self.kv.pool.num_free_blocks

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

    def admission(self, req: Request, budget: int, threshold: int | None = None,
                   free_blocks: int | None = None) -> Admission | None:
        """The admission rule, before any allocation: None when `req` cannot be admitted with `budget`
        tokens left (its whole sequence does not fit the KV pool — with `free_blocks` free, if
        given — or, without chunked prefill, its prompt does not fit the budget); else its prefix-cache
        hits and this step's tokens. Changes nothing."""
        swapped = req.swapped_tokens
        if self.connector is not None and not swapped:
            return self._admission_with_connector(req, budget, threshold, free_blocks)
        hits = [] if swapped else self.kv.get_computed_blocks(req)
        computed = swapped or len(hits) * self.kv.block_size
        if not swapped and not self.kv.fits_full_sequence(
                req, min(req.num_tokens, self.config.max_model_len), hits, free_blocks):
            return None
        remaining = req.num_tokens - computed
        if not self.config.enable_chunked_prefill and self.capped(remaining, threshold) > budget:
            return None
        return Admission(hits, self.new_tokens(remaining, budget, computed, threshold), computed)

    def _admission_with_connector(self, req: Request, budget: int, threshold: int | None,
                                  free_blocks: int | None) -> Admission | None:
        """`admission` with a KV connector (vLLM's order): local prefix hits first, then the tokens
        the connector can supply beyond them. A request whose KV was loaded (WAITING_FOR_REMOTE_KVS
        done) holds its blocks and computed tokens already: no lookup. An asynchronous load gets no
        tokens this step. CONNECTOR_PENDING when the connector cannot tell yet."""
        external, load_async = 0, False
        if req.num_computed_tokens:
            hits, computed = [], req.num_computed_tokens
        else:
            hits = self.kv.get_computed_blocks(req)
            computed = len(hits) * self.kv.block_size
            assert self.connector is not None
            matched, load_async = self.connector.get_num_new_matched_tokens(req, computed)
            if matched is None:
                return CONNECTOR_PENDING
            external = matched
            computed += external
        if not self.kv.fits_full_sequence(req, min(req.num_tokens, self.config.max_model_len), hits, free_blocks):
            return None
        if load_async:
            return Admission(hits, 0, computed, external, True)
        remaining = req.num_tokens - computed
        if not self.config.enable_chunked_prefill and self.capped(remaining, threshold) > budget:
            return None
        return Admission(hits, self.new_tokens(remaining, budget, computed, threshold), computed, external)

    def _undo_admission(self, req: Request, swapped: int) -> None:
        if swapped:
            self.kv.free(req)
            req.num_computed_tokens = swapped
        else:
            req.num_computed_tokens = 0

    # ----- after the step ran -----------------------------------------------------------------
    def update(self, out: SchedulerOutput, now: float) -> list[Request]:
        """Advance computed counts, sample tokens, finish requests; returns those that finished."""
        if self.spec is not None:
            return self._update_spec(out, now, self.spec)
        done = []
        if out.decode_contexts is not None:
            # every request decodes one token (`_all_decode`: its computed tokens reach its known ones),
            # so each samples one, as the loop below finds
            for req in map(_REQUEST, out.scheduled):
                req.num_computed_tokens += 1
                n_out = req.num_output_tokens = req.num_output_tokens + 1
                req.token_times.append(now)
                if n_out >= req.max_output_tokens:
                    done.append(req)
            self.finish(done, now)
            return done
        for s in out.scheduled:
            req = s.request
            computed = req.num_computed_tokens = req.num_computed_tokens + s.num_new_tokens
            if computed >= req.prompt_tokens + req.num_output_tokens:      # req.num_tokens: a token sampled
                n_out = req.num_output_tokens = req.num_output_tokens + 1
                req.token_times.append(now)
                if n_out >= req.max_output_tokens:
                    done.append(req)
        self.finish(done, now)
        return done

    def _update_spec(self, out: SchedulerOutput, now: float, spec: SpecDecoder) -> list[Request]:
        """`update` with speculative decoding (vLLM's `update_from_output`): a verified request gains 1 +
        accepted tokens, at most up to its output length (the stop check truncates), and its computed
        count goes back by the rejected drafts; every request that sampled and goes on gets new drafts."""
        verified = [s for s in out.scheduled if s.num_spec_tokens]
        accepted = iter(spec.accept([s.num_spec_tokens for s in verified],
                                    [s.request.spec_conditional for s in verified]))
        done, drafting = [], []
        for s in out.scheduled:
            req = s.request
            req.num_computed_tokens += s.num_new_tokens
            if req.num_computed_tokens < req.num_tokens:
                continue                       # a prompt chunk: nothing sampled
            tokens = 1
            if s.num_spec_tokens:
                a = next(accepted)
                rejected = s.num_spec_tokens - a
                req.num_computed_tokens -= rejected
                req.spec_rejected = rejected
                tokens += a
            else:
                req.spec_rejected = 0
            tokens = min(tokens, req.max_output_tokens - req.num_output_tokens)
            req.num_output_tokens += tokens
            times = req.token_times
            for _ in range(tokens):
                times.append(now)
            if req.num_output_tokens >= req.max_output_tokens:
                # the stop check cut accepted tokens: those past the last output are not the request's
                req.num_computed_tokens = min(req.num_computed_tokens, req.num_tokens)
                done.append(req)
            else:
                drafting.append(req)
        for req, d in zip(drafting, spec.proposals(len(drafting)), strict=True):
            req.spec_tokens = d
        self.finish(done, now)
        return done

    def finish(self, reqs: list[Request], now: float) -> None:
        """Requests that produced their last token leave the batch and free their KV (with async
        scheduling: after the next schedule, see `release_finishing`)."""
        for req in reqs:
            self.kv.forget(req)
            if self.connector is None:          # read only to hash its prompt blocks (a connector's too)
                req.prefix_hash_ids = None
            elif self.connector.request_finished(req):
                self.sending.append(req)        # its blocks stay until the connector saved/sent them
            req.status = RequestStatus.FINISHED
            req.finish_time = now
            self.finished.append(req)
            if self.config.async_scheduling:
                self.finishing.append(req)
            else:
                self.running.remove(req)
                self._free_finished(req)

    def _free_finished(self, req: Request) -> None:
        """A finished request's blocks return to the pool, unless the connector still saves or sends
        them (vLLM's `request_finished` -> delay_free_blocks): it frees them when done."""
        if not self.sending or req not in self.sending:
            self.kv.free(req)

    def abort(self, req: Request, now: float) -> bool:
        """Abort `req` between steps, as vLLM's engine aborts a request whose client went away (a client
        timeout): out of WAITING or RUNNING, its blocks freed as a finish frees them (full prompt blocks
        stay in the prefix cache), its swap space returned, the tokens it produced kept. False (nothing
        done) for a request that already finished or is not in this scheduler."""
        if req.status == RequestStatus.WAITING:
            if not self.waiting.remove(req):
                return False
            self.swap_used_tokens -= req.swapped_tokens
            req.swapped_tokens = 0
        elif req.status == RequestStatus.RUNNING and req in self.running:
            self.running.remove(req)
        else:
            return False
        self.kv.forget(req)
        self.kv.free(req)
        req.prefix_hash_ids = None
        req.status = RequestStatus.ABORTED
        req.finish_time = now
        self.aborted.append(req)
        return True


def _priority_key(req: Request) -> tuple:
    """Priority mode order: (priority, arrival time, submission order); larger = preempted first."""
    return req.priority, req.arrival_time, req.arrival_order


def _is_prefill(req: Request, num_new_tokens: int) -> bool:
    """A decode computes exactly the one token sampled last step; anything else is (re)prefill."""
    return not (num_new_tokens == 1 and req.num_output_tokens > 0
                and req.num_computed_tokens == req.num_tokens - 1)
