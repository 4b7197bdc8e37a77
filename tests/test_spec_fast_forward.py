"""Property: with speculative decoding the decode fast-forward (sim/engine/bulk/spec_runs.py) gives results
bit-identical to stepping (`--no-fast-forward`): requests, every step column (predicted_s included) and the
summary, for every method's drafter, k, acceptance (the method's, the user's, a workload class's), prefix
caching, async scheduling, budgets that trim drafts, small pools that preempt, and max_model_len caps.
Both runs check the engine's invariants after every step (or run)."""
import os
from unittest import mock

import numpy as np
import yaml
from hypothesis import HealthCheck, given, settings, strategies as st

from kvsim.sim.config import load_config
from kvsim.sim.engine.bulk import spec_runs
from kvsim.sim.model.cost_model import StepCounts
from kvsim.sim.simulator.simulate import run_simulation
from test_fast_forward_property import assert_bit_identical, make_trace, traces

EXAMPLES = int(os.environ.get("KVSIM_PROPERTY_EXAMPLES", 24))


def simulate(config: dict, trace, fast_forward: bool):
    """One run; with the fast-forward, also the steps its spec runs took."""
    bulk: list[int] = []
    apply = spec_runs.apply_spec_run

    def counted(sched, kv, run):
        bulk.append(run.num_steps)
        return apply(sched, kv, run)

    with mock.patch.object(spec_runs, "apply_spec_run", side_effect=counted):
        result = run_simulation(load_config(None, {**config, "fast_forward": fast_forward}), trace=trace)
    return result, sum(bulk)


def assert_identical_with_prices(fast, slow) -> None:
    assert_bit_identical(fast, slow)
    a = fast.steps.sort_values(["replica", "step"])["predicted_s"].to_numpy()
    b = slow.steps.sort_values(["replica", "step"])["predicted_s"].to_numpy()
    assert np.array_equal(a, b)


@st.composite
def spec_configs(draw) -> dict:
    k = draw(st.integers(1, 5))
    spec: dict = {"method": draw(st.sampled_from(["eagle3", "eagle", "ngram", "draft_model"])),
                  "num_speculative_tokens": k}
    if spec["method"] == "draft_model":
        spec["model"] = "llama-3.2-1b"
    if draw(st.booleans()):             # the user's measured rates (non-increasing)
        rates = sorted(draw(st.lists(st.sampled_from([0.0, 0.2, 0.5, 0.8, 0.95, 1.0]), min_size=1, max_size=k)),
                       reverse=True)
        spec["synthetic_acceptance_rates"] = rates
    block_size = draw(st.sampled_from([4, 16]))
    seqs = draw(st.sampled_from([2, 8, 64]))
    return {
        "model": "llama-3.1-8b", "gpu": "h100", "seed": draw(st.integers(0, 3)),
        "replicas": draw(st.integers(1, 2)),
        "engine.block_size": block_size,
        "engine.num_gpu_blocks": draw(st.integers(12, 200)) * 16 // block_size,
        "engine.max_num_seqs": seqs,
        "engine.max_num_batched_tokens": draw(st.sampled_from([b for b in (16, 64, 2048) if b >= seqs])),
        "engine.long_prefill_token_threshold": draw(st.sampled_from([0, 3, 100])),
        "engine.max_model_len": draw(st.sampled_from([4096, 392])),
        "engine.enable_prefix_caching": draw(st.booleans()),
        "engine.async_scheduling": draw(st.booleans()),
        "check_invariants": True,
        "speculative_config": spec,
    }


@settings(max_examples=EXAMPLES, deadline=None, derandomize=not os.environ.get("KVSIM_PROPERTY_RANDOM"),
          database=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(config=spec_configs(), trace=traces())
def test_spec_fast_forward_equals_stepping(config, trace):
    (fast, bulk), (slow, none) = simulate(config, trace, True), simulate(config, trace, False)
    assert none == 0 and bulk <= len(fast.steps)
    assert_identical_with_prices(fast, slow)
    assert len(fast.steps) == len(slow.steps)


def test_spec_runs_take_most_steps_and_stop_at_finishes_arrivals_and_a_full_pool():
    """A workload where the fast-forward matters: most verification steps are taken in bulk, and runs
    stop at each finish, arrival and (small pool) preemption, with identical results."""
    rng = np.random.default_rng(7)
    n = 24
    trace = make_trace(rng.choice([0.0, 0.05, 0.4], n), rng.integers(20, 300, n), rng.integers(40, 250, n),
                       [0] * n, [0] * n, prefix_ids=False)
    for method, blocks in (("eagle3", 2000), ("eagle", 60), ("ngram", 2000)):
        config = {"model": "llama-3.1-8b", "gpu": "h100", "engine.block_size": 16, "engine.num_gpu_blocks": blocks,
                  "check_invariants": True,
                  "speculative_config": {"method": method, "num_speculative_tokens": 3}}
        (fast, bulk), (slow, _) = simulate(config, trace, True), simulate(config, trace, False)
        assert_identical_with_prices(fast, slow)
        # a small pool keeps requests waiting (preempted): runs start only once WAITING is empty
        assert bulk > (0.1 if blocks == 60 else 0.5) * len(slow.steps), (method, bulk, len(slow.steps))
        if blocks == 60:
            assert fast.summary["preemptions"] > 0
        assert (fast.requests.status == "finished").all()


def test_workload_classes_with_their_own_acceptance_fast_forward_to_the_same_bits(tmp_path):
    """Requests drawing from their workload class's measured acceptance (Request.spec_conditional) and
    others from the method's, in the same runs."""
    classes = [{"name": name, "requests": 8, "arrival": {"process": "poisson", "rate": 4},
                "prompt_tokens": "uniform:50,300", "output_tokens": "uniform:20,200", **extra}
               for name, extra in (("code", {"spec_acceptance_rates": [0.95, 0.9, 0.8]}), ("chat", {}),
                                   ("noise", {"spec_acceptance_rates": [0.3]}))]
    path = tmp_path / "w.yaml"
    path.write_text(yaml.safe_dump({"workload": {"seed": 5, "classes": classes}}, sort_keys=False))
    config = {"trace": str(path), "model": "llama-3.1-8b", "gpu": "h100", "check_invariants": True,
              "speculative_config": {"method": "eagle3", "num_speculative_tokens": 4}}
    (fast, bulk), (slow, _) = simulate(config, None, True), simulate(config, None, False)
    assert_identical_with_prices(fast, slow)
    assert bulk > 0.5 * len(slow.steps)
    assert fast.summary["spec_decode"]["workload_class_acceptance_rate_per_pos"]


def test_a_long_run_priced_as_arrays_equals_each_step_priced_as_stepping_prices_it():
    """`SpecDecodeExecutor.price_spec_run` prices runs longer than FLAT_STEPS as arrays (shorter ones from the
    steps' numbers): the same bits as the stepping code on each step's shape (target, drafter passes,
    rejection sampler), for every drafter."""
    from kvsim.sim.core.step import BatchShape
    from kvsim.sim.engine.resolved_run import resolve_run
    from kvsim.sim.simulator.executor import FLAT_STEPS, SpecDecodeExecutor, _scalar_prices
    rng = np.random.default_rng(11)
    for spec, gpu, tp in (({"method": "eagle3", "num_speculative_tokens": 3}, "h100", 1),
                          ({"method": "eagle", "num_speculative_tokens": 5}, "l4", 2),
                          ({"method": "ngram", "num_speculative_tokens": 2}, "h100", 1),
                          ({"method": "draft_model", "model": "llama-3.2-1b", "num_speculative_tokens": 4}, "h100", 2)):
        plan = resolve_run(load_config(None, {"model": "llama-3.1-8b", "gpu": gpu, "tp": tp, "speculative_config": spec}))
        executor = SpecDecodeExecutor(plan.cost, None, plan.spec.draft)
        for m in (20, FLAT_STEPS + 40):      # a short run priced from the steps' numbers, a long one as arrays
            b = rng.integers(1, 96, m)
            drafts = rng.integers(0, spec["num_speculative_tokens"] + 1, m) * b * (rng.random(m) < 0.9)
            entries = b * rng.integers(1, 300, m)
            shape = BatchShape(num_seqs=b, num_prefill_tokens=0, num_decode_tokens=b + drafts,
                               attn_pairs_prefill=np.where(drafts > 0, rng.random(m) * 1e6, 0.0),
                               kv_tokens_read=rng.integers(1, 16 * 300, m) * b, swap_bytes=0.0,
                               block_table_entries=entries, kv_tokens_padded=b * (rng.integers(1, 300, m) * 16 / 1),
                               attn_pairs_prefill_padded=0.0, num_logit_rows=np.where(drafts > 0, b + drafts, b))
            contexts = shape.kv_tokens_read
            arrays = executor.price_spec_run(shape, b, contexts, drafts)
            steps = _scalar_prices(executor, shape, b, contexts, drafts)
            for a, s in zip(arrays, steps, strict=True):
                assert np.array_equal(a, s), spec
            assert (arrays[2][drafts == 0] == 0.0).all() and (arrays[2][drafts > 0] > 0).all()


def test_pricing_verification_steps_from_their_numbers_equals_the_shapes_pricing_bit_for_bit():
    """`SpecDecodeExecutor.price_spec_flat` (the target's `CostModel.flat_step_total` and the drafter's
    `DraftCost.seconds_flat`, tables of the terms that depend on the counts alone) gives the same bits as
    `price_spec_shape` (a BatchShape through `predict` for the target and each drafter pass) on random
    steps: verification, mixed (prefill tokens) and plain decode steps; every drafter; dense, MoE (the
    experts' kernels) and MLA targets; TP 1, 2 and 8, async scheduling and a step-time factor."""
    from kvsim.sim.core.step import BatchShape
    from kvsim.sim.engine.resolved_run import resolve_run
    from kvsim.sim.simulator.executor import SpecDecodeExecutor
    rng = np.random.default_rng(5)
    cases = [("llama-3.1-8b", "h100", 1, {"method": "eagle3", "num_speculative_tokens": 3}, {}),
             ("llama-3.1-8b", "l4", 2, {"method": "eagle", "num_speculative_tokens": 5},
              {"engine.async_scheduling": True}),
             ("llama-3.1-8b", "h100", 1, {"method": "ngram", "num_speculative_tokens": 2}, {}),
             ("llama-3.1-8b", "h100", 2, {"method": "draft_model", "model": "llama-3.2-1b",
                                          "num_speculative_tokens": 4}, {"profile": "h100-sxm*1.07"}),
             ("qwen3-30b-a3b", "h100", 2, {"method": "eagle3", "num_speculative_tokens": 2}, {}),
             ("deepseek-v3", "h200", 8, {"method": "mtp", "num_speculative_tokens": 1}, {}),
             ("deepseek-v3", "h200", 8, {"method": "eagle", "num_speculative_tokens": 3},
              {"engine.async_scheduling": True, "profile": "h200*0.93"})]
    flat_steps = 0
    for model, gpu, tp, spec, extra in cases:
        plan = resolve_run(load_config(None, {"model": model, "gpu": gpu, "tp": tp, "speculative_config": spec,
                                              **extra}))
        executor = SpecDecodeExecutor(plan.cost, None, plan.spec.draft)
        assert executor.flat, model
        k = spec["num_speculative_tokens"]
        for _ in range(200):
            b = int(rng.integers(1, 200))
            drafts = int(rng.integers(0, k + 1)) * b if rng.random() < 0.8 else 0
            prefill = int(rng.integers(1, 4000)) if rng.random() < 0.3 else 0
            pairs = float(rng.random() * 1e7) if drafts or prefill else 0.0
            kv_read, entries = int(rng.integers(1, 5000)) * b, b * int(rng.integers(1, 300))
            m = int(rng.integers(0, b + 1))
            ctx = int(rng.integers(0, 5000)) * m
            shape = BatchShape(num_seqs=b, num_prefill_tokens=prefill, num_decode_tokens=b + drafts,
                               attn_pairs_prefill=pairs, kv_tokens_read=kv_read, block_table_entries=entries,
                               kv_tokens_padded=float(kv_read), num_logit_rows=b + drafts if drafts else None)
            want = executor.price_spec_shape(shape, m, ctx, drafts)
            got = executor.price_spec_flat(StepCounts(b, b + drafts, prefill + b + drafts, pairs, kv_read, entries),
                                           m, ctx, drafts)
            assert got == want, (model, spec, b, drafts, prefill, m)
            assert executor.cost.flat_step_total(b, b + drafts, prefill + b + drafts, pairs, kv_read, entries) \
                == executor.cost.predict(shape)
            flat_steps += 1
    assert flat_steps == 200 * len(cases)
