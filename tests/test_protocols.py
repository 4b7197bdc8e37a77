"""Every KV manager and every executor implements its protocol (sim/core/protocols.py): names and call
signatures, checked structurally; the classes are found in the source, so a new one is checked too."""
from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path
from typing import Protocol

import numpy as np
import pytest

from kvsim.sim.config import KVConfig, load_config
from kvsim.sim.core.protocols import Executor, FastForwardExecutor, FastForwardKV, FastForwardPool, KVManager, KVPool
from kvsim.sim.simulator.executor import CostModelExecutor, KVPolicyExecutor, replica_parts
from kvsim.sim.engine.run_plan import build_run_plan

ROOT = Path(__file__).resolve().parent.parent


def protocol_methods(protocol) -> dict:
    """Public methods the protocol (and the protocols it extends) declare, by name."""
    out = {}
    for klass in reversed(protocol.__mro__):
        if klass is Protocol or not getattr(klass, "_is_protocol", False):
            continue
        out.update({n: f for n, f in vars(klass).items() if inspect.isfunction(f) and not n.startswith("_")})
    return out


def protocol_data(protocol) -> set[str]:
    """Attributes and properties the protocol declares."""
    names = set()
    for klass in protocol.__mro__:
        if getattr(klass, "_is_protocol", False) and klass is not Protocol:
            names |= set(getattr(klass, "__annotations__", {}))
            names |= {n for n, v in vars(klass).items() if isinstance(v, property)}
    return names


def signature_problems(impl, proto) -> list[str]:
    """How a method's signature fails the protocol's: callers pass the protocol's positional
    parameters by position and those with defaults by keyword (same name); extra ones need defaults."""
    p_params = list(inspect.signature(proto).parameters.values())[1:]
    i_params = list(inspect.signature(impl).parameters.values())
    if i_params and i_params[0].name == "self":
        i_params = i_params[1:]
    if any(q.kind == q.VAR_POSITIONAL for q in i_params):
        return []
    problems = []
    if len(i_params) < len(p_params):
        return [f"takes {len(i_params)} parameters, the protocol passes {len(p_params)}"]
    for p, q in zip(p_params, i_params):
        if q.kind not in (q.POSITIONAL_ONLY, q.POSITIONAL_OR_KEYWORD):
            problems.append(f"parameter {q.name} is not positional")
        if p.default is not p.empty and (q.name != p.name or q.default is q.empty):
            problems.append(f"parameter {p.name} (optional, passed by keyword) is {q.name}"
                            f"{'' if q.default is not q.empty else ' without a default'}")
    problems += [f"extra parameter {q.name} has no default" for q in i_params[len(p_params):]
                 if q.default is q.empty and q.kind not in (q.VAR_KEYWORD,)]
    return problems


def conformance_problems(obj, protocol) -> list[str]:
    """What `obj` (an instance, or a class whose instances set attributes in __init__) lacks of `protocol`."""
    cls = obj if isinstance(obj, type) else type(obj)
    init = inspect.getsource(cls.__init__) if "__init__" in vars(cls) else ""
    problems = [f"no attribute {n}" for n in sorted(protocol_data(protocol))
                if not hasattr(obj, n) and f"self.{n} =" not in init]
    for name, proto in sorted(protocol_methods(protocol).items()):
        impl = getattr(cls, name, None)
        if not callable(impl):
            problems.append(f"no method {name}")
            continue
        problems += [f"{name}: {p}" for p in signature_problems(impl, proto)]
    return problems


def classes_defining(method: str) -> list[type]:
    """Classes of sim/ and gpu/ that define `method` (found with ast, then imported), protocols aside."""
    found = []
    for folder in ("sim", "gpu"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            tree = ast.parse(path.read_text())
            names = [c.name for c in tree.body if isinstance(c, ast.ClassDef)
                     and any(isinstance(f, ast.FunctionDef) and f.name == method for f in c.body)]
            if names:
                parts = path.relative_to(ROOT).with_suffix("").parts
                module = importlib.import_module(".".join(("kvsim",) + tuple(p for p in parts if p != "__init__")))
                found += [getattr(module, n) for n in names]
    return [c for c in found if not getattr(c, "_is_protocol", False)]


KV_CONFIGS = {
    "plain": {},
    "prefix caching": {"engine.enable_prefix_caching": True},
    "token-level h2o": {"kv.policy": "h2o", "kv.budget": 64},
    "per_head leankv": {"kv.policy": "leankv", "kv.layout": "per_head"},
    "fast h2o": {"kv.policy": "h2o", "kv.budget": 64, "kv.mode": "fast"},
    "fast leankv (sampled rows)": {"kv.policy": "leankv", "kv.layout": "per_head", "kv.mode": "fast"},
    "sliding-window layers (hybrid)": {"model": "gpt-oss-20b"},
}


def built(name: str):
    cfg = load_config(None, {"model": "smollm2-135m", "gpu": "l4", "engine.num_gpu_blocks": 64,
                             **KV_CONFIGS[name]})
    return replica_parts(build_run_plan(cfg), 0)


@pytest.mark.parametrize("name", list(KV_CONFIGS))
def test_every_built_kv_manager_and_simulator_executor_satisfies_its_protocol(name):
    kv, executor = built(name)
    assert isinstance(kv, KVManager) and isinstance(executor, Executor) and isinstance(kv.pool, KVPool)
    assert conformance_problems(kv, KVManager) == [] and conformance_problems(kv.pool, KVPool) == []
    assert conformance_problems(executor, Executor) == []
    if kv.supports_fast_forward:
        assert isinstance(kv, FastForwardKV) and conformance_problems(kv, FastForwardKV) == []
        assert isinstance(kv.pool, FastForwardPool)
    if executor.supports_fast_forward:
        assert conformance_problems(executor, FastForwardExecutor) == []


def test_the_kv_managers_checked_are_all_there_are():
    # every class that allocates slots is one of the managers built above, or a base/mixin of one
    built_types = {type(built(name)[0]) for name in KV_CONFIGS}
    found = classes_defining("allocate_slots")
    assert built_types <= set(found)
    assert all(any(issubclass(b, c) for b in built_types) for c in found), found


@pytest.mark.parametrize("cls", classes_defining("execute"), ids=lambda c: f"{c.__module__}.{c.__name__}")
def test_every_executor_class_satisfies_the_executor_protocol(cls):
    assert conformance_problems(cls, Executor) == []
    if getattr(cls, "supports_fast_forward", False) is True:      # set per instance elsewhere (False there)
        assert conformance_problems(cls, FastForwardExecutor) == []


def test_the_simulator_executors_are_among_those_found():
    found = set(classes_defining("execute"))
    assert {CostModelExecutor, KVPolicyExecutor} <= found
    assert any(c.__module__ == "kvsim.gpu.executor" for c in found)


def test_the_fast_forward_manager_pool_supports_planning():
    kv, executor = built("prefix caching")
    pool = kv.pool
    assert isinstance(kv, FastForwardKV) and isinstance(executor, FastForwardExecutor)
    assert pool.next_free_blocks(2) == pool.free_block_ids()[:2] and len(pool.ref_cnt) == pool.num_blocks
    durations = executor.predict_decode_run(np.array([2.0]), np.array([100.0]), np.array([8.0]))
    assert durations.shape == (1,) and durations[0] > 0


def test_the_checker_reports_missing_members_and_mismatched_signatures():
    class Partial:
        supports_fast_forward = False

    class WrongKeyword:
        block_size = 16

        def record_prefix_lookup(self, num_queried, num_hit, was_preempted=False):
            pass

        def blocks_needed(self, req, n, extra):
            return 0

    assert "no method execute" in conformance_problems(Partial(), Executor)
    problems = conformance_problems(WrongKeyword(), KVManager)
    assert "no attribute enable_caching" in problems and "no method allocate_slots" in problems
    assert any(p.startswith("record_prefix_lookup: parameter preempted") for p in problems)
    assert any(p.startswith("blocks_needed: parameter num_computed_blocks") for p in problems)


def test_kv_config_defaults_build_the_plain_manager():
    kv, executor = built("plain")
    assert type(kv).__name__ == "KVCacheManager" and isinstance(executor, CostModelExecutor)
    assert KVConfig().is_default


@pytest.mark.parametrize("over, pressure", [
    ({"engine.num_gpu_blocks": 500}, True),                           # preemptions
    ({"engine.num_gpu_blocks": 500, "engine.enable_prefix_caching": False}, True),
    ({"engine.num_gpu_blocks": 600, "engine.async_scheduling": False, "engine.preemption_mode": "swap",
      "engine.swap_space_gib": 0.05}, True),
    ({"trace": "mooncake-conversation", "engine.num_gpu_blocks": 3000, "gpu": "l4"}, False),   # prefix hits
])
def test_plain_manager_batch_decode_path_schedules_as_the_per_request_loop(monkeypatch, over, pressure):
    from kvsim.sim.core.kv_manager import KVCacheManager
    from kvsim.sim.simulator.simulate import run_simulation

    cfg = load_config(None, {"trace_options.max_requests": 150, "fast_forward": False, **over})
    calls = []
    batch = KVCacheManager.allocate_decodes

    def counted(self, reqs):
        out = batch(self, reqs)
        calls.append(out is not None)
        return out
    monkeypatch.setattr(KVCacheManager, "allocate_decodes", counted)
    batched = run_simulation(cfg)
    monkeypatch.setattr(KVCacheManager, "allocate_decodes", lambda self, reqs: None)   # no batch path
    looped = run_simulation(cfg)
    assert any(calls)
    if pressure:                                   # it fell back when the pool was short
        assert not all(calls) and batched.steps["preemptions"].sum() > 0
    else:
        assert batched.summary["prefix_hit_rate"] > 0
    assert batched.requests.equals(looped.requests)
    assert batched.steps.equals(looped.steps)
