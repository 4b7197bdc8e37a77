"""The real backend's executor: runs each engine step on tensors, with the engine core's KV plan.

The engine core (`sim.engine.loop.EngineReplica`) schedules a step, calls `execute(out)` (the `Executor`
protocol of sim/core/protocols.py), runs the KV manager's policies (`kv.finish_step`), calls
`complete(result, kv_plan)`, then updates the requests. Here a step is:

1. take the KV plan the manager built while the scheduler allocated (`KVStepPlan`: slot mapping of
   the new tokens, and — when a slot strategy copies at allocation or memory pressure made the
   policy evict — evictions and copies that must happen BEFORE the new tokens are written), apply
   its evictions and copies to the cache;
2. build `AttentionMetadata` (query_start_loc, seq_lens, slot_mapping, block tables packed from the
   manager's tables) and run `model.forward` (which writes the new K/V and marks them live);
3. sample greedily; hand the real attention scores to the manager (`supply_scores`) for the
   requests whose policy runs this step, and record attention statistics at the end of prefills;
4. (`complete`) apply the plan of the policies the engine ran (evictions, compaction moves, freed
   pages) to the cache.

The whole of it is timed (CUDA synchronized before and after) and returned as the step's duration;
the cost model's prediction for the same step shape is returned alongside.

With the base `KVCacheManager` (policy `none`, shared layout) there is no plan: block tables come
from `kv.blocks_of(req)` and a token's slot is table[pos // bs] * bs + pos % bs.

Slot ids: the manager numbers a slot block * stride + offset (stride = its largest page capacity);
the cache numbers it block * block_slots + offset (block_size for full-precision pages, whose
offsets stay below block_size; the stride itself for LeanKV's mixed-precision `TieredKVCache`).

Mixed precision (policy `leankv`): the cache's page tiers follow the manager's page tables after
every plan; tier moves (demotions) are re-quantized, same-tier moves copied byte for byte. Policies
with `gqa_reduce="max"` get the kernels' max over each GQA group.

Selection (policies with `select_layer`: quest, tokenselect): each layer's decode attention reads
only the slots the policy selects from the backend's Quest bound (page key min/max against the
layer's query); the cache keeps everything.
"""
from __future__ import annotations

from dataclasses import dataclass
import time
from typing import Callable, NamedTuple

import numpy as np
import torch

from kvsim.gpu.attention import AttentionMetadata, quest_bound
from kvsim.gpu.cache import TieredKVCache
from kvsim.sim.core.request import Request
from kvsim.sim.core.scheduler import ScheduledRequest, SchedulerOutput
from kvsim.sim.core.step import StepResult, batch_shape
from kvsim.sim.kv.importance import NUM_SINK, ImportanceSource, keys_for_mass
from kvsim.sim.kv.manager import EvictingKVManager
from kvsim.sim.kv.slots import KVStepPlan
from kvsim.sim.kv.policy import EvictionPolicy

RECENT_WINDOW = 64          # attention statistics: share of the mass on the last 64 tokens


STEP_CLOCKS = ("wall", "cpu")


def step_clock(name: str, device) -> Callable[[], float]:
    """The timer of a step: `wall` (time.perf_counter) or `cpu` (this thread's CPU time,
    time.thread_time: time other processes take of the CPU does not count). `cpu` needs device cpu and
    1 torch thread, where all of a step's work runs in the calling thread."""
    if name == "wall":
        return time.perf_counter
    if name != "cpu":
        raise ValueError(f"clock must be one of {STEP_CLOCKS}, got {name!r}")
    if torch.device(device).type != "cpu" or torch.get_num_threads() != 1:
        raise ValueError(f"clock 'cpu' times the calling thread only: it needs device cpu and 1 torch thread "
                         f"(got {device}, {torch.get_num_threads()} threads)")
    return time.thread_time


class _BegunStep(NamedTuple):
    """What `execute` leaves for `complete`: the step's requests, shape, pre-write plan and clock marks."""
    scheduled: list
    shape: object
    pre: KVStepPlan | None
    marks: tuple


class RealScoresOnly(ImportanceSource):
    """Importance source of a replay: scores come only from the model (`supply_scores`); a policy
    asking for scores the executor did not supply is a bug, not a reason to fall back to a model."""

    def prefill_scores(self, req_id, state, window):
        raise RuntimeError(f"request {req_id}: the policy asked for prefill scores the real executor did not supply")

    def decode_scores(self, req_id, state):
        raise RuntimeError(f"request {req_id}: the policy asked for decode scores the real executor did not supply")


class ReplayRecorder:
    """Eviction decisions and attention statistics in the recorded format of `sim.kv.importance`."""

    DECISION_COLUMNS = ("request_id", "step", "layer", "head", "position", "action", "engine_step", "reason",
                        "num_tokens", "event")
    STATS_COLUMNS = ("request_id", "layer", "head", "num_keys", "keys_95", "sink_share", "recent_share")

    def __init__(self):
        self._decisions: list[dict[str, np.ndarray]] = []
        self._stats: list[dict[str, np.ndarray]] = []
        self.num_events = 0

    def decision(self, request_id: int, step: int, layer: np.ndarray, head: np.ndarray, position: np.ndarray,
                 engine_step: int, reason: str, num_tokens: int) -> None:
        """One applied policy decision (one `compress` or `reclaim` result) of one request; `event` numbers
        them in order, so two pressure decisions of a request in one engine step stay apart."""
        n = position.size
        self._decisions.append({
            "request_id": np.full(n, request_id, np.int64), "step": np.full(n, step, np.int32),
            "layer": layer.astype(np.int16), "head": head.astype(np.int16), "position": position.astype(np.int64),
            "action": np.full(n, "evict", object), "engine_step": np.full(n, engine_step, np.int64),
            "reason": np.full(n, reason, object), "num_tokens": np.full(n, num_tokens, np.int64),
            "event": np.full(n, self.num_events, np.int64)})
        self.num_events += 1

    def stats(self, request_id: int, layer, head, num_keys: int, keys_95, sink, recent) -> None:
        n = len(layer)
        self._stats.append({
            "request_id": np.full(n, request_id, np.int64), "layer": np.asarray(layer, np.int16),
            "head": np.asarray(head, np.int16), "num_keys": np.full(n, num_keys, np.int64),
            "keys_95": np.asarray(keys_95, np.int64), "sink_share": np.asarray(sink, np.float64),
            "recent_share": np.asarray(recent, np.float64)})

    @staticmethod
    def _table(parts: list[dict], columns) -> "pd.DataFrame":  # noqa: F821 - pandas imported on use
        import pandas as pd
        if not parts:
            return pd.DataFrame({c: pd.Series(dtype=object if c in ("action", "reason") else "int64")
                                 for c in columns})
        return pd.DataFrame({c: np.concatenate([p[c] for p in parts]) for c in columns})

    def decisions_table(self):
        return self._table(self._decisions, self.DECISION_COLUMNS)

    def stats_table(self):
        return self._table(self._stats, self.STATS_COLUMNS)


@dataclass(frozen=True)
class ExecutorOptions:
    """How a RealExecutor runs: `stats_window` queries observed for the attention statistics recorded
    at the end of each prefill (0: none); `check_cache` asserts every step that the cache's live mask
    (and page tiers) equal the KV manager's; `clock` times steps by wall | cpu time."""
    stats_window: int = 0
    check_cache: bool = False
    clock: str = "wall"


class RealExecutor:
    """Executes engine steps on a `LlamaModel` over a `PagedKVCache`, driven by the shared KV manager."""

    supports_fast_forward = False

    def __init__(self, model, cache, kv, cost=None, *, prompt_ids: Callable[[Request], list[int]],
                 recorder: ReplayRecorder | None = None, options: ExecutorOptions = ExecutorOptions()):
        self.model, self.cache, self.kv, self.cost = model, cache, kv, cost
        self.prompt_ids = prompt_ids
        self.recorder = recorder
        self.check_cache = options.check_cache
        stats_window = options.stats_window
        self.clock = step_clock(options.clock, cache.device)
        self.device = cache.device
        self.bs = cache.block_slots
        self.tiered = isinstance(cache, TieredKVCache)
        self.selector = None
        self.last_selection: dict[int, dict[int, np.ndarray]] = {}
        self.evicting = isinstance(kv, EvictingKVManager)
        cfg = model.config
        self.group = cfg.heads // cfg.kv_heads
        self.num_layers, self.num_kv_heads = cfg.layers, cfg.kv_heads
        if self.evicting:
            self._check_supported(kv, cache, cfg)
            self.stride = kv.stride
            self.policy = kv.policy
            self.needs_scores = kv.policy.needs_scores
            self.score_window = kv.policy.obs_window if self.needs_scores else stats_window
            self.score_max = kv.policy.needs_scores and kv.policy.gqa_reduce == "max"
            self.selector = kv.policy if kv.policy.select_layer is not None else None
        else:
            self.score_max = False
            if kv.enable_caching:
                raise ValueError("prefix caching is not supported by the real backend: replay prompts are "
                                 "generated per request, so shared prefixes hold no shared tokens")
            self.needs_scores = False
            self.score_window = stats_window
        self.stats_window = stats_window
        self.slot_pos = np.full(cache.num_slots, -1, dtype=np.int64)   # token position held by each cache slot
        self.num_steps = 0
        # host-side breakdown of the measured time: metadata/inputs, model forward + sampling, the
        # manager's policies (finish_step), KV-plan application to the cache (+ batch shape, checks)
        self.times = {"prepare_s": 0.0, "forward_s": 0.0, "kv_ops_s": 0.0, "policy_s": 0.0}
        self.step_times: list[dict[str, float]] = []
        self.last_logits: torch.Tensor | None = None
        self.last_request_ids: list[int] = []
        self._begun: _BegunStep | None = None

    def _check_supported(self, kv: EvictingKVManager, cache, cfg) -> None:
        tiers = kv.new_token_tier != 0
        if tiers != self.tiered:
            raise ValueError(f"policy {kv.policy.name} " + ("assigns precision tiers: it needs a TieredKVCache"
                                                             if tiers else "stores full precision: it needs a "
                                                             "PagedKVCache"))
        if self.tiered and tuple(kv.tier_capacity[1:]) != cache.capacity:
            raise ValueError(f"KV manager pages hold {tuple(kv.tier_capacity[1:].tolist())} tokens (high, low tier) "
                             f"but the cache's pages hold {cache.capacity}")
        if self.tiered and kv.stride != cache.block_slots:
            raise ValueError(f"KV manager slot stride {kv.stride} differs from the cache's {cache.block_slots}")
        selective = type(kv.policy).read_tokens is not EvictionPolicy.read_tokens
        if selective and (kv.policy.select_layer is None or self.tiered):
            raise ValueError(f"policy {kv.policy.name}: selection needs a select_layer(state, ctx, layer, bound) "
                             "method and a full-precision cache")
        if kv.policy.needs_scores and kv.policy.gqa_reduce not in ("sum", "mean", "max"):
            raise ValueError(f"policy {kv.policy.name}: gqa_reduce={kv.policy.gqa_reduce!r} is not one the "
                             "attention kernels report (sum, mean, max over each GQA group)")
        rows = cfg.layers * cfg.kv_heads if cache.layout == "per_head" else 1
        if kv.rows != rows or kv.ctx.layout != cache.layout:
            raise ValueError(f"KV manager has {kv.rows} rows ({kv.ctx.layout}) but the model/cache needs {rows} "
                             f"({cache.layout})")
        if kv.pool.num_blocks != cache.num_blocks or kv.block_size != cache.block_size:
            raise ValueError(f"KV manager pool ({kv.pool.num_blocks} x {kv.block_size}) differs from the cache "
                             f"({cache.num_blocks} x {cache.block_size})")
        if kv.importance.__class__ is not RealScoresOnly:
            kv.importance = RealScoresOnly()
        kv.track_mass = False     # the quality proxy needs full-cache attention; a replay has only the live part

    # ----- engine interface -------------------------------------------------------------------------
    def execute(self, out: SchedulerOutput) -> StepResult:
        for s in out.scheduled:          # prompt ids are the workload, not the step: made before timing
            self.tokens(s.request)
        self._sync()
        t0 = self.clock()
        shape = batch_shape(out, self.kv, self.cost.kv_bytes_per_token) if self.cost is not None else None
        sched = out.scheduled
        pre = None
        if self.evicting:
            pre = self.kv.plan
            self.kv.begin_step()
            self._apply_plan(pre, sched, after_write=False, reason="pressure")
        t1 = self.clock()
        ids, positions, meta, tables = self._prepare(sched, pre)
        t2 = self.clock()
        logits = self.model.forward(ids, positions, meta, self.cache)
        next_tokens = logits.argmax(-1).tolist()
        t3 = self.clock()
        self.last_logits, self.last_request_ids = logits, [s.request.request_id for s in sched]
        for s, token in zip(sched, next_tokens):
            req = s.request
            if req.num_computed_tokens + s.num_new_tokens >= req.num_tokens:
                req.gpu_tokens.append(int(token))
        if meta.scores is not None:
            self._use_scores(sched, meta, tables)
        self._begun = _BegunStep(sched, shape, pre, (t0, t1, t2, t3))
        return StepResult(duration_s=float("nan"), predicted_s=float("nan"), shape=shape)

    def complete(self, result: StepResult, kv_plan: KVStepPlan | None) -> StepResult:
        """Apply what the manager's policies did (`kv_plan`, from the engine's `finish_step` call) to the
        cache and time the whole step."""
        sched, shape, pre, (t0, t1, t2, t3) = self._begun
        self._begun = None
        post = kv_plan if self.evicting else None
        t4 = self.clock()
        if post is not None:
            self._apply_plan(post, sched, after_write=True, reason="policy")
        self._sync()
        t5 = self.clock()
        if self.check_cache:      # a check, not engine work: outside the step's time (and the replay's clock)
            self.verify_cache(sched)
        parts = {"prepare_s": t2 - t1, "forward_s": t3 - t2, "policy_s": t4 - t3, "kv_ops_s": (t1 - t0) + (t5 - t4)}
        for k, v in parts.items():
            self.times[k] += v
        self.step_times.append(parts)
        self.num_steps += 1
        evicted = freed = moved = 0
        for plan in (pre, post):
            if plan is not None:
                evicted += plan.evicted_tokens
                freed += plan.blocks_freed_by_eviction
                moved += plan.bytes_moved
        predicted = float("nan")
        if shape is not None:
            shape.bytes_moved = moved
            predicted = float(self.cost.predict(shape))
        return StepResult(duration_s=t5 - t0, predicted_s=predicted, evicted_tokens=evicted,
                          blocks_freed_by_eviction=freed, bytes_moved=moved, shape=shape)

    def warm_up(self, prefill_tokens: int = 2) -> None:
        """One throwaway prefill of `prefill_tokens` and a decode (nothing cached) so lazy
        initialisation — torch's thread pool, Triton compilation on CUDA, the allocator growing its heap
        to the largest step's temporaries — is not charged to the first measured steps."""
        dev = self.device
        L, H = self.num_layers, self.num_kv_heads
        for n, window in ((max(prefill_tokens, 2), self.score_window), (1, self.score_window)):
            if self.cache.layout == "shared":
                slots, table = torch.full((n,), -1), torch.full((1, 1), -1)
            else:
                slots, table = torch.full((n, L, H), -1), torch.full((1, L, H, 1), -1)
            meta = AttentionMetadata(query_start_loc=torch.tensor([0, n], device=dev),
                                     seq_lens=torch.tensor([n], device=dev), slot_mapping=slots.to(dev),
                                     block_tables=table.to(dev), score_window=window)
            self.model.forward(torch.zeros(n, dtype=torch.long, device=dev), torch.arange(n, device=dev), meta,
                               self.cache)
        self._sync()

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # ----- tokens -----------------------------------------------------------------------------------
    def tokens(self, req: Request) -> list[int]:
        """Prompt ids plus every greedy output so far (EOS ignored: outputs run to the trace's length)."""
        toks = req.gpu_tokens
        if toks is None:
            toks = req.gpu_tokens = list(self.prompt_ids(req))
            if len(toks) != req.prompt_tokens:
                raise ValueError(f"request {req.request_id}: {len(toks)} prompt ids for {req.prompt_tokens} tokens")
        return toks

    # ----- step inputs ------------------------------------------------------------------------------
    def _prepare(self, sched: list[ScheduledRequest], pre: KVStepPlan | None):
        """Flat input ids, positions and AttentionMetadata; also each request's packed table info."""
        ids, pos, slots, tables, seq_lens, starts = [], [], [], [], [], [0]
        fresh = []
        relocated = pre is not None and (bool(pre.evicted) or bool(pre.copy_src))
        for s in sched:
            req = s.request
            c, n = req.num_computed_tokens, s.num_new_tokens
            toks = self.tokens(req)
            if c + n > len(toks):
                raise AssertionError(f"request {req.request_id}: scheduled up to token {c + n} of {len(toks)}")
            ids.append(toks[c:c + n])
            p = np.arange(c, c + n, dtype=np.int64)
            pos.append(p)
            if self.evicting:
                rk = self.kv.req_kv[req]
                table, order, count = _pack(rk.table)
                tables.append((table, order, count))
                sm = self._slots_from_state(rk, c, n) if relocated else self._slots_from_plan(pre, req)
            else:
                blocks = np.asarray(self.kv.blocks_of(req), dtype=np.int64)
                tables.append((blocks[None, :], None, None))
                fresh.append(blocks[-(-c // self.bs):])
                sm = (blocks[p // self.bs] * self.bs + p % self.bs)[None, :]
            slots.append(sm)                                  # [rows, n]
            keep = sm >= 0
            self.slot_pos[sm[keep]] = np.broadcast_to(p, sm.shape)[keep]
            seq_lens.append(c + n)
            starts.append(starts[-1] + n)
        if fresh:                                             # blocks first written now start empty
            blocks = np.concatenate(fresh)
            if blocks.size:
                self.cache.set_live(torch.from_numpy(blocks), False)
        dev = self.device
        flat_ids = torch.tensor([t for chunk in ids for t in chunk], dtype=torch.long, device=dev)
        flat_pos = torch.from_numpy(np.concatenate(pos)).to(dev)
        if self.cache.layout == "shared":
            slot_mapping = np.concatenate([sm[0] for sm in slots])
            width = max(t[0].shape[1] for t in tables)
            bt = np.full((len(sched), width), -1, dtype=np.int64)
            for b, (table, _, _) in enumerate(tables):
                bt[b, :table.shape[1]] = table[0]
        else:
            L, H = self.num_layers, self.num_kv_heads
            slot_mapping = np.concatenate([sm.T for sm in slots]).reshape(-1, L, H)
            width = max(t[0].shape[1] for t in tables)
            bt = np.full((len(sched), L * H, width), -1, dtype=np.int64)
            for b, (table, _, _) in enumerate(tables):
                bt[b, :, :table.shape[1]] = table
            bt = bt.reshape(len(sched), L, H, width)
        meta = AttentionMetadata(
            query_start_loc=torch.tensor(starts, dtype=torch.long, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.long, device=dev),
            slot_mapping=torch.from_numpy(slot_mapping).to(dev),
            block_tables=torch.from_numpy(bt).to(dev),
            score_window=self._score_window(sched), score_max=self.score_max)
        if self.selector is not None:
            decodes = [(s.request, info) for s, info in zip(sched, tables) if s.num_new_tokens == 1]
            if decodes:
                self.last_selection = {}
                meta.decode_select = lambda layer, q, tbl, cache: self._select(layer, q, tbl, cache, decodes)
        return flat_ids, flat_pos, meta, tables

    # ----- selection (quest / tokenselect) ----------------------------------------------------------
    def _select(self, layer: int, q: torch.Tensor, tables: torch.Tensor, cache, decodes) -> torch.Tensor:
        """Slots each decode reads in `layer` [Bd, H, M * bs], table order: the backend computes Quest's
        bound from the layer's query and the cached keys; the policy picks the pages."""
        keys, _, live = cache.gather(layer, tables)
        Bd, H, S = live.shape
        host_tables = tables.cpu().numpy()
        slots = np.maximum(host_tables, 0)[..., None] * self.bs + np.arange(self.bs)
        pos = torch.from_numpy(np.where(host_tables[..., None] >= 0, self.slot_pos[slots], -1).reshape(Bd, H, S))
        pos = pos.to(tables.device)
        valid = live & (pos >= 0)
        bound = quest_bound(q, keys, valid, pos // self.selector.page_size).cpu().numpy()
        out = np.zeros((Bd, H, S), dtype=bool)
        ctx = self.kv.ctx
        for b, (req, (table, order, count)) in enumerate(decodes):
            st = self.kv.req_kv[req].state
            rows = layer * H + np.arange(H) if ctx.layout == "per_head" else np.zeros(H, dtype=np.int64)
            width = table.shape[1]                                    # this request's packed table
            cols = order[rows, :width, None] * self.stride + np.arange(self.bs)          # [H, width, bs]
            ok = np.broadcast_to((np.arange(width)[None, :] < count[rows, None])[:, :, None], cols.shape)
            h = np.broadcast_to(np.arange(H)[:, None, None], cols.shape)
            state_bound = np.full((H, st.num_slots), -np.inf)
            state_bound[h[ok], cols[ok]] = bound[b, :, :width * self.bs].reshape(H, width, self.bs)[ok]
            chosen = self.selector.select_layer(st, ctx, layer, state_bound)              # [H, S_state]
            picked = np.zeros((H, width, self.bs), dtype=bool)
            picked[ok] = chosen[h[ok], cols[ok]]
            out[b, :, :width * self.bs] = picked.reshape(H, -1)
            keep = np.zeros((H, st.num_tokens), dtype=bool)
            hh, ss = np.nonzero(chosen)
            keep[hh, st.pos[rows[hh], ss]] = True
            self.last_selection.setdefault(req.request_id, {})[layer] = keep
        return torch.from_numpy(out).to(tables.device)

    def _score_window(self, sched) -> int:
        if not self.score_window:
            return 0
        for s in sched:
            req = s.request
            done = req.num_computed_tokens + s.num_new_tokens >= req.num_tokens
            if done and (self.needs_scores or (s.is_prefill and self.stats_window)):
                return self.score_window
        return 0

    def _cache_slots(self, global_slots: np.ndarray) -> np.ndarray:
        """Manager slot ids (block * stride + offset) -> cache slot ids (block * block_size + offset)."""
        g = np.asarray(global_slots, dtype=np.int64)
        return g // self.stride * self.bs + g % self.stride

    def _slots_from_plan(self, pre: KVStepPlan, req: Request) -> np.ndarray:
        return self._cache_slots(pre.slot_mapping[req.request_id])

    def _slots_from_state(self, rk, c: int, n: int) -> np.ndarray:
        """Slots of positions c..c+n-1 per row from the token state (after pre-step moves/evictions;
        -1 where pressure evicted a token before it was written)."""
        st = rk.state
        r, s = np.nonzero(st.live & (st.pos >= c) & (st.pos < c + n))
        out = np.full((st.rows, n), -1, dtype=np.int64)
        out[r, st.pos[r, s] - c] = rk.table[r, s // self.stride] * self.bs + s % self.stride
        return out

    # ----- attention scores -------------------------------------------------------------------------
    def _use_scores(self, sched, meta: AttentionMetadata, tables) -> None:
        sums = meta.scores.sum.float().cpu().numpy()          # [B, L, H, M*bs], block-table order
        nq = meta.scores.num_queries.cpu().numpy()
        # what the policy gets: per slot, the GQA group's sum (or max, for gqa_reduce="max")
        policy_scores = meta.scores.max.float().cpu().numpy() if self.score_max else sums
        for b, s in enumerate(sched):
            req = s.request
            if req.num_computed_tokens + s.num_new_tokens < req.num_tokens:
                continue
            if self.needs_scores:
                self._supply(req, s, policy_scores[b], int(nq[b]), tables[b])
            if s.is_prefill and self.recorder is not None and self.stats_window:
                self._record_stats(req, s, sums[b], int(nq[b]), tables[b])

    def _supply(self, req: Request, s: ScheduledRequest, summed: np.ndarray, nq: int, table_info) -> None:
        table, order, count = table_info
        L, H = self.num_layers, self.num_kv_heads
        per_head = summed.reshape(L * H, -1)
        if self.policy.gqa_reduce == "mean":
            per_head = per_head / self.group
        rows = self.kv.rows
        width = table.shape[1]
        if rows == 1:
            per_row = per_head[:, :width * self.bs].mean(axis=0, keepdims=True)
        else:
            per_row = per_head[:, :width * self.bs]
        rk = self.kv.req_kv[req]
        scores = np.zeros((rows, rk.state.num_slots), dtype=np.float32)
        cols = order[:, :width, None] * self.stride + np.arange(self.bs)          # [rows, width, bs]
        valid = np.broadcast_to((np.arange(width)[None, :] < count[:, None])[:, :, None], cols.shape)
        r = np.broadcast_to(np.arange(rows)[:, None, None], cols.shape)
        scores[r[valid], cols[valid]] = per_row.reshape(rows, width, self.bs)[valid]
        if s.is_prefill:       # the kernels sum the window's queries: hand each query the mean
            scores = np.broadcast_to(scores / max(nq, 1), (max(nq, 1),) + scores.shape)
        self.kv.supply_scores(req, scores)

    def _record_stats(self, req: Request, s: ScheduledRequest, summed: np.ndarray, nq: int, table_info) -> None:
        table = table_info[0]
        L, H = self.num_layers, self.num_kv_heads
        width = table.shape[1]
        mass = summed.reshape(L * H, -1)[:, :width * self.bs] / (max(nq, 1) * self.group)
        slot = np.where(table[:, :, None] >= 0, table[:, :, None] * self.bs + np.arange(self.bs), -1).reshape(
            table.shape[0], -1)
        pos = np.where(slot >= 0, self.slot_pos[np.maximum(slot, 0)], -1)
        pos = np.broadcast_to(pos, mass.shape)
        mass = np.where(pos >= 0, mass, 0.0)
        n = req.num_computed_tokens + s.num_new_tokens
        rows = np.arange(L * H)
        self.recorder.stats(req.request_id, rows // H, rows % H, n, keys_for_mass(mass),
                            np.where(pos < NUM_SINK, mass, 0).sum(axis=1),
                            np.where(pos >= n - RECENT_WINDOW, mass, 0).sum(axis=1))

    # ----- KV plans ---------------------------------------------------------------------------------
    def _apply_plan(self, plan: KVStepPlan, sched, *, after_write: bool, reason: str) -> None:
        """Evictions, then copies/moves in the order recorded, then the live bits of every block the
        plan touched are set from the manager's token state (the single source of truth, whatever
        the interleaving of allocations, evictions and moves inside the plan was)."""
        if not (plan.evicted or plan.copy_src or plan.freed_blocks or plan.allocated_blocks):
            return
        if self.recorder is not None and plan.evicted:
            self._record_decisions(plan, reason)
        touched = [np.concatenate(plan.allocated_blocks)] if plan.allocated_blocks else []
        touched += list(plan.freed_blocks)
        for _, slots in plan.evicted.values():
            cslots = self._cache_slots(slots)
            self.cache.evict(torch.from_numpy(cslots))
            touched.append(cslots // self.bs)
        if sum(slots.size for _, slots in plan.evicted.values()) != plan.evicted_tokens:
            # a request evicted twice in one plan keeps only its last entry: resync all its blocks
            by_id = {r.request_id: rk for r, rk in self.kv.req_kv.items()}
            touched += [by_id[rid].table[by_id[rid].table >= 0] for rid in plan.evicted if rid in by_id]
        for src, dst, src_tier, dst_tier in zip(plan.copy_src, plan.copy_dst, plan.copy_tiers, plan.copy_dst_tiers):
            s, d = self._cache_slots(src), self._cache_slots(dst)
            self.cache.move_slots(torch.from_numpy(s), torch.from_numpy(d), src_tier, dst_tier)
            moved = self.slot_pos[s]
            self.slot_pos[s] = -1
            self.slot_pos[d] = moved
            touched += [s // self.bs, d // self.bs]
        written = {s.request: s.request.num_computed_tokens + (s.num_new_tokens if after_write else 0) for s in sched}
        self._sync_live(np.unique(np.concatenate(touched)), written)

    def _record_decisions(self, plan: KVStepPlan, reason: str) -> None:
        """Every eviction the manager applied, in order, with the positions the token state held then
        (exact even when pressure evicted a request twice in one step or compaction moved tokens between)."""
        ctx = self.kv.ctx
        for rid, rows, positions, decode_steps, num_tokens in plan.decisions:
            if ctx.layout == "per_head":
                layer, head = ctx.row_layer[rows], ctx.row_head[rows]
            else:
                layer = head = np.full(rows.size, -1)
            step = decode_steps if decode_steps > 0 else -1
            self.recorder.decision(rid, step, layer, head, positions, self.num_steps, reason, num_tokens)

    def _truth(self, blocks: np.ndarray | None, written: dict, with_tiers: bool = False):
        """(block ids, live [k, bs]) the manager's state says the cache should hold, for the owned blocks
        among `blocks` (all owned blocks when None). Tokens not yet written are not live. With
        `with_tiers`, also each block's page tier."""
        ids, lives, tiers = [], [], []
        ar = np.arange(self.bs)
        for req, rk in self.kv.req_kv.items():
            table = rk.table
            m = table >= 0 if blocks is None else np.isin(table, blocks)
            if not m.any():
                continue
            r, e = np.nonzero(m)
            cols = e[:, None] * self.stride + ar
            st = rk.state
            limit = written.get(req, req.num_computed_tokens)
            lives.append(st.live[r[:, None], cols] & (st.pos[r[:, None], cols] < limit))
            ids.append(table[r, e])
            tiers.append(rk.page_tier[r, e])
        if not ids:
            out = np.zeros(0, dtype=np.int64), np.zeros((0, self.bs), dtype=bool)
            return out + (np.zeros(0, dtype=np.int8),) if with_tiers else out
        out = np.concatenate(ids), np.concatenate(lives)
        return out + (np.concatenate(tiers),) if with_tiers else out

    def _sync_live(self, blocks: np.ndarray, written: dict) -> None:
        ids, live, tiers = self._truth(blocks, written, with_tiers=True)
        self.cache.set_live(torch.from_numpy(blocks), False)
        if self.tiered:
            self.cache.set_page_tiers(torch.from_numpy(blocks), np.full(blocks.size, -1, dtype=np.int8))
            self.cache.set_page_tiers(torch.from_numpy(ids), tiers)
        if ids.size:
            self.cache.set_live(torch.from_numpy(ids), torch.from_numpy(live))

    # ----- checks -----------------------------------------------------------------------------------
    def expected_live(self, sched=()) -> tuple[np.ndarray, np.ndarray]:
        """(owned block ids, live [k, bs]) the engine core says the cache holds after the step."""
        written = {s.request: s.request.num_computed_tokens + s.num_new_tokens for s in sched}
        if self.evicting:
            return self._truth(None, written)
        ids, lives = [], []
        for req, blocks in self.kv.req_blocks.items():
            n = written.get(req, req.num_computed_tokens)
            b = np.asarray(blocks, dtype=np.int64)
            ids.append(b)
            lives.append((np.arange(b.size)[:, None] * self.bs + np.arange(self.bs)) < n)
        if not ids:
            return np.zeros(0, dtype=np.int64), np.zeros((0, self.bs), dtype=bool)
        return np.concatenate(ids), np.concatenate(lives)

    def verify_cache(self, sched=()) -> None:
        """Assert the cache's live mask equals the manager's token state on every owned block."""
        ids, live = self.expected_live(sched)
        actual = self.cache.block_live(torch.from_numpy(ids)).cpu().numpy()      # [copies, k, bs]
        if not (actual == live[None]).all():
            bad = np.flatnonzero((actual != live[None]).any(axis=(0, 2)))
            raise AssertionError(f"step {self.num_steps}: cache live mask differs from the KV manager's state "
                                 f"in blocks {ids[bad][:10].tolist()}")
        if self.tiered:
            _, _, tiers = self._truth(None, {}, with_tiers=True)
            actual = self.cache.pages.page_tier.view(self.cache.copies, -1)[:, torch.from_numpy(ids)].cpu().numpy()
            if not (actual == tiers[None] - 1).all():
                bad = np.flatnonzero((actual != tiers[None] - 1).any(axis=0))
                raise AssertionError(f"step {self.num_steps}: cache page tiers differ from the KV manager's in "
                                     f"blocks {ids[bad][:10].tolist()}")


def _pack(table: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Left-pack each row's allocated entries (the kernels scan entries up to the row's block count).

    Returns (packed table [rows, width], order [rows, E]: packed column j holds entry order[r, j],
    count [rows])."""
    empty = table < 0
    order = np.argsort(empty, axis=1, kind="stable")
    count = (~empty).sum(axis=1)
    width = max(int(count.max()) if count.size else 0, 1)
    packed = np.take_along_axis(table, order[:, :width], axis=1)
    packed[np.arange(width)[None, :] >= count[:, None]] = -1
    return packed, order, count
