"""Which pool of a role the disaggregated proxy sends a request to, when the role has several pools (xPyD
over pools of different GPU types or TP: docs/disaggregation.md#several-pools-of-a-role).

A plug-in registry as the routers' (`register_pool_choice`); each choice returns the replica. With one pool
of a role the proxy asks that pool's router directly and no choice runs (the outputs of one-pool fleets
are unchanged).

- `least_work` (the default): the pool whose outstanding work, this request's included, over the pool's
  speed is least (ties: the first pool), then that pool's router picks the replica. Prefill pools: the
  prompt tokens still to compute on the pool (queued, running, just submitted) plus this prompt, over the
  pool's prompt tokens a second (its replicas x one replica's rate at a full token budget, from its cost
  model): an estimate of when the pool would finish this prefill. Decode pools: the requests on the pool
  (running, waiting, pulling their KV, just submitted) plus this one, over the pool's output tokens a second
  (its replicas x one replica's rate at a reference batch): an estimate of the pool's time per output token
  with this request added.
- `round_robin`: every instance of the role in turn, pool after pool (vLLM's toy proxy for xPyD,
  examples/online_serving/disaggregated_serving/disagg_proxy_demo.py, cycles over its --prefill and its
  --decode instance lists with itertools.cycle and knows nothing of their GPUs or load).
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Protocol

_REGISTRY: dict[str, type] = {}


def register_pool_choice(name: str) -> Callable[[type], type]:
    def add(cls: type) -> type:
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ValueError(f"pool choice {name!r} is already registered by {_REGISTRY[name].__module__}")
        _REGISTRY[name] = cls
        return cls
    return add


def pool_choice_names() -> list[str]:
    return sorted(_REGISTRY)


class PoolChoice(Protocol):
    def choose(self, pools: list, req, role: str):
        """The replica (of one of `pools`, all of `role`) that `req` goes to."""


def make_pool_choice(name: str, speeds: Mapping[str, float] | None = None) -> PoolChoice:
    """The registered choice `name`; `speeds`: each pool's tokens a second by pool name (missing: 1.0)."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown pool choice {name!r}; known: {', '.join(pool_choice_names())}")
    return _REGISTRY[name](dict(speeds or {}))


def pending_prompt_tokens(replica) -> int:
    """Prompt tokens still to compute on a replica: its waiting and running requests' and those submitted
    while a step was in flight."""
    sched = replica.scheduler
    reqs = [*sched.waiting, *sched.running, *replica.inbox]
    return sum(max(0, r.prompt_tokens - r.num_computed_tokens) for r in reqs)


def requests_on(replica) -> int:
    """Requests a decode replica holds or will: running, waiting, pulling their KV, just submitted."""
    sched = replica.scheduler
    return len(sched.running) + len(sched.waiting) + len(sched.loading) + len(replica.inbox)


@register_pool_choice("least_work")
class LeastWork:
    def __init__(self, speeds: dict[str, float]):
        self.speeds = speeds

    def score(self, pool, req, role: str) -> float:
        if role == "prefill":
            work = sum(pending_prompt_tokens(r) for r in pool.replicas) + req.prompt_tokens
        else:
            work = sum(requests_on(r) for r in pool.replicas) + 1
        return work / (len(pool.replicas) * self.speeds.get(pool.name, 1.0))

    def choose(self, pools: list, req, role: str):
        best = min(range(len(pools)), key=lambda i: (self.score(pools[i], req, role), i))
        return pools[best].router.route(req)


@register_pool_choice("round_robin")
class RoundRobinInstances:
    def __init__(self, speeds: dict[str, float]):
        self._next: dict[str, int] = {}

    def choose(self, pools: list, req, role: str):
        replicas = [r for p in pools for r in p.replicas]
        i = self._next.get(role, 0)
        self._next[role] = i + 1
        return replicas[i % len(replicas)]
