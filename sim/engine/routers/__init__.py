"""Routers: which replica an arriving request goes to. Each is a small plug-in registered by name
(`@register_router("name")`, one module each, like KV policies in sim/kv/policy.py); `build_router`
makes the run's router from `cfg.router` and `cfg.router_options` (docs/kv-tiers.md#routers).

Built in: round_robin, least_outstanding (today's two), queue_depth, kv_usage, prefix_affinity
(approximate: where the prompt's leading blocks were sent before), precise_prefix (the replicas' own
prefix caches), session_affinity (a session's turns to one replica), and weighted (llm-d's inference scheduler: a weighted sum of scorers, highest wins), dp_balance (vLLM's
data-parallel load balancer).
"""
from .base import RouterBase, RouterError, build_router, register_router, router_names, routes_ahead
from . import (dp_balance, kv_usage, least_outstanding, prefix_affinity, precise_prefix, queue_depth, round_robin,  # noqa: F401
               session_affinity, weighted)  # (registration)

__all__ = ["RouterBase", "RouterError", "build_router", "register_router", "router_names", "routes_ahead"]
