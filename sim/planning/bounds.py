"""Capacity bounds for `kvsim plan`: the fewest replicas of one configuration that could meet the SLO,
from the load sample and the configuration's cost model, before anything is simulated.

Each bound is **optimistic** (it never exceeds the fewest replicas a simulation would find meeting the
SLO), so a configuration ruled out by its bound is never the answer. The argument, for a replica
of `plan` (one GPU type at one TP degree) serving the sample under a percentile SLO:

- **Who must meet it.** `ttft_pQ <= T` over the k finished requests holds only if at least
  floor(Q/100 x (k - 1)) + 1 of them have TTFT <= T (numpy's linear percentile is at least the
  value at that rank). Requests that might be rejected (longer than `max_model_len` or the KV pool)
  count as not finished, so k is at least the others; TPOT counts requests of 2+ output tokens.
- **Prefill work.** A request meeting its TTFT had its uncached prompt (less the leading blocks an
  earlier request of the sample carried: an ideal prefix cache) computed between the first arrival and
  the last arrival + T. Any engine step holding p prefill tokens takes at least `predict(1 sequence,
  p tokens)` (attention, decodes and other sequences left out), so a replica computes at most
  R_p = max over p <= max_num_batched_tokens of p / predict(p) prompt tokens per second. The fewest
  requests' prompts that must be done, over R_p x the span, is a replica count the fleet needs.
  The same rate rules out a TTFT limit below the time its own prompt takes: if fewer requests than
  needed have uncached prompt / R_p <= T, no replica count meets it.
- **Decode work.** A request meeting both its TTFT and TPOT limits finished its output - 1 decode
  tokens by arrival + T + (output - 1) x TPOT limit. A step holding b decoding sequences takes at
  least `predict_decode(b, b x the shortest context)`, so a replica produces at most
  R_d = max over b <= min(max_num_seqs, KV blocks) of b / that time. Every decode token of a request
  is its own step, so its TPOT is at least the one-sequence step: above the limit, no count meets it.
- **KV memory.** While a request decodes it holds its uncached prompt's KV (blocks no other request
  of the sample computed: distinct across requests), for at least (output - 1) one-sequence steps; a
  replica holds `num_blocks` x `block_size` tokens. Token-seconds needed over token-seconds held.

The fleet of N replicas behind any router has N x each replica's rate, so N >= the largest of the
three. Assumptions, each checked where it can be: step times never fall when a batch grows (more
tokens, sequences or context), which holds for the roofline cost model's max() of sums; deterministic
steps (with `step_variance` the bound is not computed); the full KV cache (`kv.policy: none`); arrivals
fixed by the trace (no sessions, client concurrency limit or timeouts). Where an assumption fails the
bound is 1 replica (nothing pruned), with the reason.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .capacity import Constraint
from ..config import SimConfig


@dataclass(frozen=True)
class Demand:
    """The load sample's requests as the bounds see them (model-independent)."""
    arrivals: np.ndarray            # seconds, as simulated (rate scale and window applied)
    prompts: np.ndarray
    outputs: np.ndarray
    uncached: np.ndarray            # prompt tokens an ideal prefix cache could not serve (at least 1)
    why_not: str = ""               # non-empty: no bound applies to this load (the reason)

    @property
    def requests(self) -> int:
        return len(self.arrivals)


@dataclass(frozen=True)
class ReplicaBound:
    """The fewest replicas one configuration may need; None: no count can meet the SLO."""
    min_replicas: int | None
    why: str
    prefill_tok_s: float = math.nan     # R_p: best prompt tokens/s of one replica
    decode_tok_s: float = math.nan      # R_d: best output tokens/s of one replica


def _not_bounded(cfg: SimConfig) -> str:
    """Why the bounds' assumptions do not hold for `cfg` ('' when they do)."""
    opts = cfg.trace_options
    if cfg.step_variance not in (0, 0.0):
        return "step-time variance: a step may be faster than its cost model"
    if cfg.kv.policy != "none":
        return f"KV policy {cfg.kv.policy}: the bounds assume the full cache"
    if opts.sessions is not None or cfg.trace == "synthetic-sessions":
        return "sessions: arrivals depend on the answers"
    if opts.max_concurrency is not None:
        return "a client concurrency limit: arrivals depend on the answers"
    if opts.arrival_unit != "time":
        return "arrivals by engine step"
    if opts.request_timeout is not None:
        return "request timeouts"
    if cfg.fleet is not None:
        return "a disaggregated fleet (its pools have their own bounds)"
    if cfg.speculative_config is not None:
        return "speculative decoding: a step may give a request several tokens"
    if cfg.kv_offload is not None:
        return "a KV offload tier: prefixes beyond the GPU's cache are not recomputed"
    if cfg.pp > 1 or cfg.dp > 1:
        return "pipeline or data parallelism: the bounds price one stage per replica"
    return ""


def ideal_cache_hits(trace, prompts: np.ndarray) -> np.ndarray:
    """Tokens of each prompt an ideal prefix cache holds: the leading blocks whose prefix hash an earlier
    request of the trace carried (never the whole prompt: its last token is computed)."""
    df = trace.df
    cached = np.zeros(len(df))
    block = trace.prefix_block_tokens or 0
    if not block or "prefix_hash_ids" not in df:
        return cached
    seen: set = set()
    for i, ids in enumerate(df["prefix_hash_ids"]):
        if ids is None or (isinstance(ids, float) and math.isnan(ids)):
            continue
        hits = 0
        for h in ids:
            if h not in seen:
                break
            hits += 1
        seen.update(ids)
        cached[i] = min(hits * block, prompts[i] - 1)
    return cached


def demand_of(cfg: SimConfig) -> Demand:
    """The sample `cfg` simulates, with the ideal prefix cache's hits taken off each prompt."""
    from ..engine.assembly import load_workload

    why = _not_bounded(cfg)
    empty = np.zeros(0)
    if why:
        return Demand(empty, empty, empty, empty, why)
    trace = load_workload(cfg)
    df = trace.df
    prompts = df["prompt_tokens"].to_numpy(dtype=float)
    cached = ideal_cache_hits(trace, prompts) if cfg.engine.enable_prefix_caching else np.zeros(len(df))
    return Demand(df["arrival_time_s"].to_numpy(dtype=float), prompts, df["output_tokens"].to_numpy(dtype=float),
                  np.maximum(prompts - cached, 1.0))


def at_least(q: float, n: int) -> int:
    """The fewest of n values at or below a limit when their numpy (linear) q-th percentile is: the
    value at rank floor(q/100 x (n - 1)) is at most the percentile (rounded down: never more)."""
    if n <= 0:
        return 0
    return int(np.floor(np.float64(q) / 100 * (n - 1))) + 1       # numpy's virtual index, as it computes it


def _percentile_limits(constraints: list[Constraint], kind: str) -> list[tuple[float, float]]:
    """(q, limit) of every `kind`_pQ <= limit constraint (kind: ttft, tpot)."""
    out = []
    for c in constraints:
        parts = c.metric.split("_")
        if len(parts) == 3 and parts[0] == kind and c.op in ("<=", "<") and parts[1][:1] == "p":
            try:
                out.append((float(parts[1][1:]), c.limit))
            except ValueError:
                continue
    return out


def _smallest_sum(values: np.ndarray, k: int) -> float:
    if k <= 0:
        return 0.0
    return float(np.partition(values, k - 1)[:k].sum()) if k < len(values) else float(values.sum())


@dataclass(frozen=True)
class _Rates:
    """One replica's ceilings (the cost model's best rates) and which requests may not finish on it."""
    r_p: float                      # best prompt tokens/s
    r_d: float                      # best output tokens/s
    t_one: float                    # the fastest decode step (one sequence, the shortest context)
    kv_tokens: int                  # the KV pool, tokens
    finished: int                   # requests surely counted in the percentiles (the rest might be rejected)
    finished_multi: int             # of those, with 2+ output tokens (TPOT's)
    outputs: np.ndarray             # output tokens as run (capped at max_model_len)
    rejected: np.ndarray | None = None  # the requests that might be rejected (longer than the model or KV)


def _rates(plan, demand: Demand) -> _Rates:
    from ..core.step import BatchShape

    cost, sched = plan.cost, plan.scheduler
    block = plan.cfg.engine.block_size
    top = int(sched.max_num_batched_tokens)
    steps = np.array([float(cost.predict(BatchShape(num_seqs=1, num_prefill_tokens=t))) for t in range(1, top + 1)])
    r_p = float((np.arange(1, top + 1) / steps).max())
    ctx = float(demand.prompts.min()) + 1
    b = np.arange(1, int(max(1, min(sched.max_num_seqs, plan.num_blocks))) + 1, dtype=float)
    t_dec = np.asarray(cost.predict_decode(b, b * ctx, b * math.ceil(ctx / block)), dtype=float)
    peak = demand.prompts + demand.outputs - 1
    maybe_rejected = (demand.prompts + 1 > sched.max_model_len) | (peak > (plan.num_blocks - 1) * block)
    if not sched.enable_chunked_prefill:
        maybe_rejected |= peak > top
    outputs = np.minimum(demand.outputs, np.maximum(sched.max_model_len - demand.prompts, 1.0))
    return _Rates(r_p, float((b / t_dec).max()), float(t_dec[0]), plan.num_blocks * block,
                  demand.requests - int(maybe_rejected.sum()), int(((outputs >= 2) & ~maybe_rejected).sum()), outputs,
                  maybe_rejected)


def _prefill_need(rates: _Rates, demand: Demand, ttfts: list[tuple[float, float]], local: int = 0,
                  ) -> tuple[int | None, str]:
    """Replicas the prompts due by the TTFT deadlines need; `local`: prompts whose uncached part is at most
    this are prefilled elsewhere (a disaggregated fleet's decode pool), so only the others count."""
    a0, a1 = float(demand.arrivals.min()), float(demand.arrivals.max())
    # at most the requests whose ideal uncached prompt is <= local stay local (a real cache hits less); one
    # that does not computes more than `local` tokens here, so its work is at least local + 1
    n_local = int((demand.uncached <= local).sum())
    remote = np.where(demand.uncached > local, demand.uncached, local + 1.0)
    need, why = 1, "1 replica"
    for q, limit in ttfts:
        k = at_least(q, rates.finished) - n_local          # requests meeting the limit that prefill here
        if k <= 0:
            continue
        if np.partition(remote / rates.r_p, k - 1)[k - 1] > limit:
            return None, (f"ttft_p{q:g}<={limit:g}s: {k} prompts need more than {limit:g} s each at "
                          f"{rates.r_p:,.0f} prompt tok/s")
        work = _smallest_sum(remote, k)
        n = max(1, math.ceil(work / (rates.r_p * (a1 + limit - a0)) * (1 - 1e-9)))
        if n > need:
            need, why = n, (f"prefill: {work:,.0f} prompt tokens of {k} requests by the last arrival + {limit:g} s "
                            f"at {rates.r_p:,.0f} tok/s per replica")
    return need, why


def _decode_need(rates: _Rates, demand: Demand, ttfts: list[tuple[float, float]],
                 tpots: list[tuple[float, float]]) -> tuple[int | None, str]:
    """Replicas the output tokens (and the KV they hold) due by the TTFT + TPOT deadlines need."""
    n, outputs = demand.requests, rates.outputs
    multi = outputs >= 2
    a0 = float(demand.arrivals.min())
    need, why = 1, "1 replica"
    for q_d, tpot in tpots:
        k_d = at_least(q_d, rates.finished_multi)
        if k_d and rates.t_one > tpot:
            return None, f"tpot_p{q_d:g}<={tpot * 1e3:g}ms: one sequence's decode step takes {rates.t_one * 1e3:.2f} ms"
        for q, limit in ttfts:
            both = k_d - (n - at_least(q, n))       # at most n - at_least(q, n) miss the TTFT limit
            if both <= 0:
                continue
            span = float((demand.arrivals + limit + (outputs - 1) * tpot)[multi].max()) - a0
            tokens = _smallest_sum(outputs[multi] - 1, both)
            n_d = max(1, math.ceil(tokens / (rates.r_d * span) * (1 - 1e-9)))
            if n_d > need:
                need, why = n_d, (f"decode: {tokens:,.0f} output tokens of {both} requests by their deadlines "
                                  f"at {rates.r_d:,.0f} tok/s per replica")
            # while decoding its j-th token a request holds its uncached prompt + j tokens, for a step each
            steps = outputs - 1
            held_each = rates.t_one * (demand.uncached * steps + steps * (steps + 1) / 2)
            held = _smallest_sum(held_each[multi], both)
            n_kv = max(1, math.ceil(held / (rates.kv_tokens * span) * (1 - 1e-9)))
            if n_kv > need:
                need, why = n_kv, (f"KV: {held:,.0f} token-seconds of {both} requests in {rates.kv_tokens:,} tokens "
                                   f"per replica")
    return need, why


def replica_bound(plan, demand: Demand, constraints: list[Constraint], role: str = "both",
                  local: int = 0) -> ReplicaBound:
    """The bound of one replica's resolved run `plan` (sim.engine.resolved_run) on `demand`: an aggregated
    replica (`role` both), or a disaggregated fleet's prefill or decode pool (`local`: the fleet's
    conditional-disaggregation threshold)."""
    if demand.why_not:
        return ReplicaBound(1, f"no bound: {demand.why_not}")
    ttfts, tpots = _percentile_limits(constraints, "ttft"), _percentile_limits(constraints, "tpot")
    if demand.requests == 0 or not ttfts:
        return ReplicaBound(1, "no bound: the SLO sets no TTFT percentile")
    rates = _rates(plan, demand)
    found = []
    if role in ("both", "prefill"):
        found.append(_prefill_need(rates, demand, ttfts, local if role == "prefill" else 0))
    if role in ("both", "decode"):
        found.append(_decode_need(rates, demand, ttfts, tpots))
    for need, why in found:
        if need is None:
            return ReplicaBound(None, why, rates.r_p, rates.r_d)
    need, why = max(found, key=lambda f: f[0] or 0)
    return ReplicaBound(need, why, rates.r_p, rates.r_d)


@dataclass(frozen=True)
class MixedBound:
    """The bound of a role made of several pool types (a mixed role of a disaggregated fleet): which replica
    counts per type could meet the SLO. `needs`: each (tokens or token-seconds due, that per replica of
    each type over its span, why); counts n pass a need when sum(n_i x per_replica_i) reaches it (a role's
    capacity is the sum of its pools'). `impossible`: why no counts can ('' when some may)."""
    types: int
    needs: tuple[tuple[float, tuple[float, ...], str], ...] = ()
    impossible: str = ""
    why_not: str = ""               # non-empty: no bound applies (every count passes)

    def admits(self, counts: tuple[int, ...]) -> bool:
        if self.why_not:
            return True
        if self.impossible:
            return False
        return all(sum(n * c for n, c in zip(counts, caps, strict=True)) >= need * (1 - 1e-9)
                   for need, caps, _ in self.needs)

    def min_single(self, i: int) -> int | None:
        """The fewest replicas of type i alone (the others at 0); None: none can."""
        if self.why_not:
            return 1
        if self.impossible:
            return None
        need = 1
        for amount, caps, _ in self.needs:
            if amount > 0:
                if caps[i] <= 0:
                    return None
                need = max(need, math.ceil(amount / caps[i] * (1 - 1e-9)))
        return need


def mixed_role_bound(plans: list, demand: Demand, constraints: list[Constraint], role: str,
                     local: int = 0) -> MixedBound:
    """The bound of a disaggregated fleet's `role` (prefill or decode) made of pools of several types, one
    resolved run per type in `plans`: the arguments of `replica_bound`, with the fleet's rate the sum of its
    replicas' rates. A request is surely finished when no type might reject it; a limit is out of reach when
    it is for the fastest type (the best prompt rate, the shortest one-sequence decode step), since the
    proxy may send the requests that need it there; the KV held is priced at the fastest type's step."""
    if demand.why_not:
        return MixedBound(len(plans), why_not=demand.why_not)
    ttfts, tpots = _percentile_limits(constraints, "ttft"), _percentile_limits(constraints, "tpot")
    if demand.requests == 0 or not ttfts:
        return MixedBound(len(plans), why_not="the SLO sets no TTFT percentile")
    rates = [_rates(plan, demand) for plan in plans]
    rejected = np.zeros(demand.requests, dtype=bool)
    for r in rates:
        rejected |= r.rejected if r.rejected is not None else False
    finished = demand.requests - int(rejected.sum())
    outputs = rates[0].outputs
    a0, a1 = float(demand.arrivals.min()), float(demand.arrivals.max())
    needs: list[tuple[float, tuple[float, ...], str]] = []
    if role == "prefill":
        r_best = max(r.r_p for r in rates)
        n_local = int((demand.uncached <= local).sum())
        remote = np.where(demand.uncached > local, demand.uncached, local + 1.0)
        for q, limit in ttfts:
            k = at_least(q, finished) - n_local
            if k <= 0:
                continue
            if np.partition(remote / r_best, k - 1)[k - 1] > limit:
                return MixedBound(len(plans), impossible=f"ttft_p{q:g}<={limit:g}s: {k} prompts need more than "
                                                         f"{limit:g} s each at the fastest pool's {r_best:,.0f} tok/s")
            span = a1 + limit - a0
            needs.append((_smallest_sum(remote, k), tuple(r.r_p * span for r in rates),
                          f"prefill: prompt tokens of {k} requests by the last arrival + {limit:g} s"))
        return MixedBound(len(plans), tuple(needs))
    n, multi = demand.requests, outputs >= 2
    t_one = min(r.t_one for r in rates)
    finished_multi = int((multi & ~rejected).sum())
    for q_d, tpot in tpots:
        k_d = at_least(q_d, finished_multi)
        if k_d and t_one > tpot:
            return MixedBound(len(plans), impossible=f"tpot_p{q_d:g}<={tpot * 1e3:g}ms: the fastest pool's one-"
                                                     f"sequence decode step takes {t_one * 1e3:.2f} ms")
        for q, limit in ttfts:
            both = k_d - (n - at_least(q, n))
            if both <= 0:
                continue
            span = float((demand.arrivals + limit + (outputs - 1) * tpot)[multi].max()) - a0
            needs.append((_smallest_sum(outputs[multi] - 1, both), tuple(r.r_d * span for r in rates),
                          f"decode: output tokens of {both} requests by their deadlines"))
            steps = outputs - 1
            held_each = t_one * (demand.uncached * steps + steps * (steps + 1) / 2)
            needs.append((_smallest_sum(held_each[multi], both), tuple(float(r.kv_tokens) * span for r in rates),
                          f"KV: token-seconds of {both} requests"))
    return MixedBound(len(plans), tuple(needs))
