"""The scheduler's bulk decode paths give the schedule of its request-by-request loop, to the bit.

`Scheduler._schedule_decodes` (every running request decodes and the pool supplies all their slots),
`Scheduler._bulk_decodes` (the requests before the first one that must preempt) and
`KVCacheManager.allocate_decodes` (one call for the batch, also with resumed requests and prefix
caching) must leave the pool, the requests and the step log as `allocate_slots(req, 1)` one request
after another does. The reference run turns every bulk path off (`_all_decode` answers False: each
step goes through `_schedule_running`'s per-request loop); both runs step one at a time (no decode
fast-forward) and check the KV invariants after every step.
"""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from kvsim.sim.config import load_config
from kvsim.sim.core.scheduler import Scheduler
from kvsim.sim.simulator.simulate import run_simulation
from kvsim.traces import Trace
from test_fast_forward_property import assert_bit_identical, engine_configs, traces


def simulate(config: dict, trace: Trace, monkeypatch, bulk: bool):
    with monkeypatch.context() as m:
        if not bulk:
            m.setattr(Scheduler, "_all_decode", lambda self: False)
        return run_simulation(load_config(None, {**config, "fast_forward": False}), trace=trace)


@settings(max_examples=40, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                 HealthCheck.function_scoped_fixture])
@given(config=engine_configs(), trace=traces())
def test_bulk_decodes_equal_the_per_request_loop_for_every_feature_mix(config, trace, monkeypatch):
    assert_bit_identical(simulate(config, trace, monkeypatch, True), simulate(config, trace, monkeypatch, False))


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_bulk_prefix_then_preemption_under_a_full_pool(monkeypatch, async_scheduling):
    # 40 requests decoding long outputs in a pool far too small for them: steps where the pool runs out
    # part way through the batch (bulk prefix, then preemptions from the tail), resumed requests that
    # re-hit their own cached blocks, and async finishes beside them
    n = 40
    rng = np.random.default_rng(3)
    trace = Trace.from_columns(arrival_time_s=np.sort(rng.uniform(0, 0.5, n)),
                               prompt_tokens=rng.integers(20, 120, n), output_tokens=rng.integers(40, 200, n))
    config = {"model": "llama-3.1-8b", "gpu": "l4", "engine.block_size": 16, "engine.num_gpu_blocks": 120,
              "engine.max_num_seqs": 64, "engine.enable_prefix_caching": True,
              "engine.async_scheduling": async_scheduling, "kv.policy": "none", "check_invariants": True}
    stops = []
    original = Scheduler._bulk_decodes

    def spy(self, i, budget, scheduled):
        j, left = original(self, i, budget, scheduled)
        stops.append(j < len(self.running) and left > 0)       # stopped at a request that must preempt
        return j, left

    monkeypatch.setattr(Scheduler, "_bulk_decodes", spy)
    bulk = simulate(config, trace, monkeypatch, True)
    assert any(stops), "no step ran out of blocks part way through the batch"
    assert bulk.summary["preemptions"] > 0
    assert_bit_identical(bulk, simulate(config, trace, monkeypatch, False))


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_decode_step_fast_paths_equal_the_general_ones(monkeypatch, async_scheduling):
    # a step that `_schedule_decodes` made alone (`out.decode_contexts` set): `batch_shape` and `update`
    # take their short paths; here every such step is also priced and updated by the general paths on a
    # copy of its requests, and both must agree field by field
    import copy
    import dataclasses

    from kvsim.sim.core import step as step_mod

    n = 30
    rng = np.random.default_rng(5)
    trace = Trace.from_columns(arrival_time_s=np.sort(rng.uniform(0, 0.3, n)),
                               prompt_tokens=rng.integers(20, 120, n), output_tokens=rng.integers(5, 60, n))
    config = {"model": "llama-3.1-8b", "gpu": "l4", "engine.block_size": 16, "engine.num_gpu_blocks": 200,
              "engine.max_num_seqs": 64, "engine.enable_prefix_caching": True,
              "engine.async_scheduling": async_scheduling, "kv.policy": "none", "check_invariants": True}
    seen = {"shape": 0, "update": 0}
    shape_of, update = step_mod.batch_shape, Scheduler.update

    def checked_shape(out, kv, kv_bytes_per_token=0.0):
        got = shape_of(out, kv, kv_bytes_per_token)
        if out.decode_contexts is not None:
            seen["shape"] += 1
            general = shape_of(dataclasses.replace(out, decode_contexts=None), kv, kv_bytes_per_token)
            assert got == general
            assert [type(getattr(got, f.name)) for f in dataclasses.fields(got)] == \
                   [type(getattr(general, f.name)) for f in dataclasses.fields(general)]
        return got

    def checked_update(self, out, now):
        if out.decode_contexts is None:
            return update(self, out, now)
        seen["update"] += 1
        reqs = [s.request for s in out.scheduled]
        state = [(r.num_computed_tokens, r.num_output_tokens, list(r.token_times)) for r in reqs]
        # the general loop's answer for each request, on copies (no finish: only the counts and times)
        expect = []
        for s, r in zip(out.scheduled, reqs, strict=True):
            c = copy.copy(r)
            c.token_times = list(r.token_times)
            computed = c.num_computed_tokens + s.num_new_tokens
            sampled = computed >= c.prompt_tokens + c.num_output_tokens
            expect.append((computed, c.num_output_tokens + sampled,
                           c.token_times + [now] * sampled, c.num_output_tokens + sampled >= c.max_output_tokens))
        done = update(self, out, now)
        assert [(r.num_computed_tokens, r.num_output_tokens, list(r.token_times), r in done) for r in reqs] == expect
        assert all(s[0] + 1 == r.num_computed_tokens for s, r in zip(state, reqs, strict=True))
        return done

    monkeypatch.setattr(step_mod, "batch_shape", checked_shape)
    monkeypatch.setattr("kvsim.sim.engine.loop.batch_shape", checked_shape)
    monkeypatch.setattr("kvsim.sim.simulator.executor.batch_shape", checked_shape)
    monkeypatch.setattr(Scheduler, "update", checked_update)
    fast = simulate(config, trace, monkeypatch, True)
    assert seen["shape"] > 20 and seen["update"] > 20
    assert_bit_identical(fast, simulate(config, trace, monkeypatch, False))
