"""Speculative decoding (issue 48): vLLM v1's scheduling of 1 + k tokens, lookahead slots, rejected-token
rollback, seeded acceptance, the config's refusals and the drafter's costs."""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvsim.sim.config import ConfigError, SimConfig
from kvsim.sim.core.kv_manager import KVCacheManager
from kvsim.sim.core.request import Request
from kvsim.sim.core.scheduler import Scheduler, SchedulerConfig
from kvsim.sim.core.spec_decode import SpecDecoder, SpecDecodeSettings
from kvsim.sim.engine.resolved_run import resolve_run
from kvsim.sim.model.spec_decode import conditional_from_rates


def _run_core(prompts, outputs, k, cond, lookahead, num_blocks, block_size, budget, caching, propose, seed,
              own=None):
    """Drive the scheduler and the plain KV manager step by step; check the invariants after each step.
    `own`: per request, its own conditional acceptance (a workload class's) or None. Returns the requests,
    the decoder and the steps taken."""
    kv = KVCacheManager(num_blocks, block_size, enable_caching=caching)
    spec = SpecDecoder(SpecDecodeSettings(k, lookahead, tuple(cond), propose), seed=seed)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget, max_model_len=10_000), kv,
                      spec=spec)
    reqs = [Request(i, 0.0, p, o) for i, (p, o) in enumerate(zip(prompts, outputs, strict=True))]
    for r, mine in zip(reqs, own or [None] * len(reqs), strict=False):
        r.spec_conditional = None if mine is None else tuple(mine[:k])
        sched.add_request(r)
    high_water: dict[Request, int] = {}      # the most tokens each request's blocks were reserved for
    now, steps = 0.0, 0
    while sched.has_work:
        out = sched.schedule()
        assert not out.is_empty, "nothing schedulable"
        for victim in out.preempted:
            high_water.pop(victim, None)
        for s in out.scheduled:
            req = s.request
            verified = s.num_spec_tokens
            # vLLM: a running request's allocation covers its tokens, this step's and the lookahead slots; a
            # request admitted from WAITING (new, or preempted before) gets no lookahead
            running = req in high_water
            reserved = int(s.context_before) + s.num_new_tokens + (lookahead if running else 0)
            high_water[req] = max(high_water.get(req, 0), reserved)
            assert verified <= k
            if not s.is_prefill:
                assert s.num_new_tokens == 1 + verified
        now += 1.0
        done = sched.update(out, now)
        steps += 1
        kv.check_invariants(set(sched.running) | set(sched.waiting))
        for req, blocks in kv.req_blocks.items():
            # held blocks: exactly those of the request's reservations (vLLM keeps a rejected draft's slots
            # for the next step's tokens; nothing beyond the lookahead of its next 1 + k tokens)
            assert len(blocks) == math.ceil(high_water[req] / block_size), (req.request_id, len(blocks))
            assert len(blocks) * block_size >= req.num_computed_tokens
            assert high_water[req] <= req.num_computed_tokens + req.spec_rejected + lookahead + 1 + k
            assert req.num_computed_tokens <= req.num_tokens
        for req in done:
            high_water.pop(req, None)
            assert req not in kv.req_blocks
        assert steps < 100_000
    return reqs, spec, kv, steps


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lengths=st.lists(st.tuples(st.integers(1, 90), st.integers(1, 60)), min_size=1, max_size=8),
    k=st.integers(1, 5),
    cond=st.lists(st.floats(0.0, 1.0), min_size=5, max_size=5),
    eagle=st.booleans(),
    spare=st.integers(0, 40),
    block_size=st.sampled_from([4, 16]),
    budget=st.sampled_from([8, 16, 64, 512]),
    caching=st.booleans(),
    propose=st.sampled_from([1.0, 0.5]),
    seed=st.integers(0, 2**32),
    own=st.lists(st.none() | st.lists(st.floats(0.0, 1.0), min_size=5, max_size=5), min_size=8, max_size=8),
)
def test_random_workloads_keep_the_pool_exact_and_finish_every_output(lengths, k, cond, eagle, spare, block_size,
                                                                      budget, caching, propose, seed, own):
    prompts = [p for p, _ in lengths]
    outputs = [o for _, o in lengths]
    lookahead = k if eagle else 0
    # the pool holds the longest request at its peak (prompt + outputs + one step's drafts and lookahead) and
    # `spare` blocks more: small spares make requests preempt each other
    peak = max(p + o + k + lookahead for p, o in lengths)
    num_blocks = math.ceil(peak / block_size) + 1 + spare
    reqs, spec, kv, _ = _run_core(prompts, outputs, k, cond[:k], lookahead, num_blocks, block_size, budget,
                                  caching, propose, seed, own)      # some requests with their own acceptance
    for r in reqs:
        assert r.num_output_tokens == r.max_output_tokens, r.request_id
        assert len(r.token_times) == r.max_output_tokens
    assert not kv.req_blocks, "blocks still held at the end"
    assert kv.pool.num_used_blocks == 0
    assert kv.pool.num_free_blocks == num_blocks - 1
    assert spec.num_accepted_tokens <= spec.num_draft_tokens <= k * spec.num_drafts
    assert sum(spec.accepted_per_pos) == spec.num_accepted_tokens


def test_accepted_tokens_cut_the_steps_and_the_same_seed_gives_the_same_bits():
    args = ([40] * 6, [200] * 6, 3, [0.8, 0.8, 0.8], 3, 400, 16, 512, True, 1.0)
    a_reqs, a_spec, _, a_steps = _run_core(*args, seed=7)
    b_reqs, b_spec, _, b_steps = _run_core(*args, seed=7)
    assert a_steps == b_steps and a_spec.summary() == b_spec.summary()
    assert [list(r.token_times) for r in a_reqs] == [list(r.token_times) for r in b_reqs]
    _, c_spec, _, c_steps = _run_core(*args, seed=8)
    assert c_spec.summary() != a_spec.summary()
    # 200 outputs each: without drafts 1 prefill step + 199 decode steps; with ~2.95 tokens a step far fewer
    assert a_steps < 110
    never = ([40] * 6, [200] * 6, 3, [0.0, 0.0, 0.0], 3, 400, 16, 512, True, 1.0)
    _, n_spec, _, n_steps = _run_core(*never, seed=7)
    assert n_spec.num_accepted_tokens == 0 and n_steps == 200


def test_acceptance_draws_follow_the_per_position_rates():
    settings_ = SpecDecodeSettings(3, 0, (0.8, 0.75, 0.5))
    spec = SpecDecoder(settings_, seed=1)
    for _ in range(20):
        spec.accept([3] * 2000)
    rates = spec.summary()["acceptance_rate_per_pos"]
    assert rates == pytest.approx([0.8, 0.6, 0.3], abs=0.01)
    assert spec.summary()["mean_acceptance_length"] == pytest.approx(settings_.mean_acceptance_length, abs=0.02)
    # fewer drafts scheduled (the token budget trimmed them): no more accepted than verified
    assert max(spec.accept([1] * 500)) == 1


def test_published_rates_become_conditional_probabilities():
    assert conditional_from_rates([0.8, 0.6, 0.3], 3, 1.0) == pytest.approx((0.8, 0.75, 0.5))
    assert conditional_from_rates([0.8, 0.6], 4, 0.5) == pytest.approx((0.8, 0.75, 0.375, 0.1875))


def _spec(**kw):
    return resolve_run(SimConfig(speculative_config=kw))


@pytest.mark.parametrize("kw, fragment", [
    ({"method": "eagle3", "num_speculative_tokens": 0}, "greater than 0"),
    ({"method": "medusa", "num_speculative_tokens": 2}, "unknown method 'medusa'"),
    ({"model": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 6, "prompt_lookup_max": 3},
     "prompt_lookup_min=6"),
    ({"method": "eagle3", "num_speculative_tokens": 2, "synthetic_acceptance_rates": [0.5, 0.7]}, "non-increasing"),
])
def test_bad_configs_are_refused_by_the_schema(kw, fragment):
    with pytest.raises(ValueError, match=fragment):
        SimConfig(speculative_config=kw)


@pytest.mark.parametrize("kw, fragment", [
    ({"method": "draft_model", "model": "llama-3.1-70b", "num_speculative_tokens": 3, "draft_tensor_parallel_size": 1},
     "131.4 GiB of weights"),
    ({"method": "draft_model", "model": "qwen2.5-0.5b", "num_speculative_tokens": 3}, "vocabulary"),
    ({"method": "mtp", "num_speculative_tokens": 1}, "multi-token-prediction"),
    ({"method": "eagle3"}, "num_speculative_tokens"),
    ({"num_speculative_tokens": 2}, "without speculative model"),
    ({"method": "eagle3", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 2}, "expected 1 or"),
])
def test_bad_configs_are_refused_when_resolved(kw, fragment):
    with pytest.raises(ConfigError, match=fragment):
        _spec(**kw)


def test_the_drafter_takes_hbm_from_the_kv_pool_and_off_leaves_the_config_as_it_was():
    off = resolve_run(SimConfig())
    assert "speculative_config" not in SimConfig().model_dump()
    eagle3 = _spec(method="eagle3", num_speculative_tokens=3)
    draft = _spec(method="draft_model", model="llama-3.2-1b", num_speculative_tokens=3)
    ngram = _spec(model="ngram", num_speculative_tokens=3)
    assert ngram.num_blocks == off.num_blocks          # a host-side lookup: no weights, no KV
    assert draft.num_blocks < eagle3.num_blocks < off.num_blocks
    assert eagle3.spec.settings.num_lookahead_tokens == 3 and ngram.spec.settings.num_lookahead_tokens == 0
    mtp = resolve_run(SimConfig(model="deepseek-v3", gpu="h200", tp=8,
                                speculative_config={"method": "deepseek_mtp"}))
    assert mtp.spec.method == "mtp" and mtp.spec.settings.num_speculative_tokens == 1


def test_verification_prices_more_compute_but_not_more_weight_reads():
    from kvsim.sim.core.step import BatchShape
    plan = _spec(method="eagle3", num_speculative_tokens=3)
    cost = plan.cost
    decode = cost.predict(BatchShape(num_seqs=1, num_decode_tokens=1, kv_tokens_read=1001))
    verify = cost.predict(BatchShape(num_seqs=1, num_decode_tokens=4, kv_tokens_read=1004,
                                     attn_pairs_prefill=4 * (1000 + 2.5) - 1004))
    assert decode < verify < 1.2 * decode          # batch 1: weight reads dominate, read once
    big_decode = cost.predict(BatchShape(num_seqs=256, num_decode_tokens=256, kv_tokens_read=256 * 1001))
    big_verify = cost.predict(BatchShape(num_seqs=256, num_decode_tokens=1024, kv_tokens_read=256 * 1004,
                                         attn_pairs_prefill=256 * (4 * 1002.5 - 1004)))
    assert big_verify / big_decode > verify / decode          # compute grows with the batch
    draft = plan.spec.draft.seconds(BatchShape(num_seqs=1, num_decode_tokens=4, kv_tokens_read=1004), [1004.0])
    assert 0 < draft < 0.3 * decode


def test_the_drafting_loop_sampler_and_projections_are_priced_from_shapes():
    """vLLM's spec-decode work beyond the forwards (sim/data/spec_decode.yaml vllm_loop): each drafting pass
    pays its small kernels at the profile's kernel time, a logits row per sequence and the head's extra
    projections; the rejection sampler reads a target logits row per draft; an n-gram drafter pays only
    the sampler."""
    from dataclasses import replace

    from kvsim.sim.core.step import BatchShape
    from kvsim.sim.model.spec_decode import LoopCosts
    shape = BatchShape(num_seqs=2, num_decode_tokens=8, kv_tokens_read=2008)
    contexts = [1004.0, 1004.0]
    for method, extra_kernels in (("eagle", 0), ("eagle3", 4)):
        plan = _spec(method=method, num_speculative_tokens=3)
        draft, profile, model = plan.spec.draft, plan.cost.profile, plan.model
        loop = draft.loop
        assert loop.kernel_s == profile.gemm_latency_s > 0
        assert (loop.pass_kernels, loop.first_pass_kernels) == (16 + extra_kernels, 9 + extra_kernels)
        h = model.hidden_size
        if method == "eagle":       # [embedding, hidden] -> h in every forward
            assert (loop.pass_params, loop.first_pass_params) == (2 * h * h, 0)
        else:                       # 3 auxiliary states -> h once; QKV over 2h inputs in every forward
            assert (loop.pass_params, loop.first_pass_params) == (h * (model.q_size + 2 * model.kv_size), 3 * h * h)
        forwards = replace(draft, loop=LoopCosts()).seconds(shape, contexts)
        bw = plan.gpu.mem_bw * profile.mem_bw_eff
        read = 2.0 / bw                         # bf16 weights: batch 2 reads them, it does not compute-bind
        expected = (loop.first_pass_kernels * loop.kernel_s + 2 * loop.row_s
                    + (loop.pass_params + loop.first_pass_params) * read
                    + 2 * (loop.pass_kernels * loop.kernel_s + 2 * loop.row_s + loop.pass_params * read))
        assert draft.seconds(shape, contexts) - forwards == pytest.approx(expected, rel=1e-9)
        assert expected > 0.15 * forwards       # not a rounding error at batch 2
    ngram = _spec(model="ngram", num_speculative_tokens=3).spec.draft
    assert ngram.loop.pass_kernels == 0 and ngram.seconds(shape, contexts) == pytest.approx(5e-5 + 2 * 2e-6)
    sampler = ngram.loop
    assert sampler.sampler_seconds(0) == 0.0
    row = 4.0 * 128256 / bw                     # Llama-3.1's fp32 logits row, read by the argmax
    assert sampler.sampler_seconds(6) == pytest.approx(3 * profile.gemm_latency_s + 6 * row)
    assert sampler.sampler_seconds(600) - sampler.sampler_seconds(6) == pytest.approx(594 * row)


def test_a_drafter_of_another_target_takes_its_own_published_acceptance():
    oss = resolve_run(SimConfig(model="gpt-oss-120b", gpu="h200",
                                speculative_config={"method": "eagle3", "num_speculative_tokens": 7}))
    d = oss.spec.describe()
    assert d["expected_mean_acceptance_length"] == pytest.approx(2.76, abs=0.005)     # the card's figure
    assert "nebius/EAGLE3-gpt-oss-120b" in d["acceptance_source"]
    assert d["conditional_acceptance"] == pytest.approx([0.649] * 7, abs=0.005)     # rates rounded to 3 places
    llama = _spec(method="eagle3", num_speculative_tokens=7).spec.describe()
    assert llama["expected_mean_acceptance_length"] == pytest.approx(3.54, abs=0.005)
    assert "issue 20780" in llama["acceptance_source"]
    mine = resolve_run(SimConfig(model="gpt-oss-120b", gpu="h200", speculative_config={
        "method": "eagle3", "num_speculative_tokens": 2, "synthetic_acceptance_rates": [0.9, 0.8]}))
    assert mine.spec.describe()["expected_acceptance_rate_per_pos"] == pytest.approx([0.9, 0.8])


def test_a_request_with_its_own_acceptance_draws_from_it_and_the_others_keep_their_bits():
    settings_ = SpecDecodeSettings(num_speculative_tokens=3, num_lookahead_tokens=3, conditional=(0.8, 0.6, 0.5))
    plain, mixed = SpecDecoder(settings_, seed=4), SpecDecoder(settings_, seed=4)
    drafts = [3, 3, 3, 2] * 50
    own = [None, (1.0, 1.0, 1.0), (0.0, 0.0, 0.0), None] * 50
    a, b = plain.accept(drafts), mixed.accept(drafts, own)
    assert [x for x, c in zip(a, own, strict=True) if c is None] == [x for x, c in zip(b, own, strict=True) if c is None]
    assert all(x == 3 for x, c in zip(b, own, strict=True) if c == (1.0, 1.0, 1.0))
    assert all(x == 0 for x, c in zip(b, own, strict=True) if c == (0.0, 0.0, 0.0))
    assert any(x not in (0, 3) for x in a)                  # the run's own rates draw in between
    assert mixed.accept(drafts, [None] * len(drafts)) == plain.accept(drafts)


def test_workload_classes_with_measured_acceptance_drive_their_requests(tmp_path):
    """A workload spec's class gives its measured per-position acceptance (spec_acceptance_rates): its
    requests accept as measured, the other classes keep the method's default."""
    import warnings

    import yaml

    from kvsim.sim.config import load_config
    from kvsim.sim.simulator.simulate import run_simulation
    from kvsim.traces import load_trace
    classes = [{"name": name, "requests": 12, "arrival": {"process": "constant", "rate": 2},
                "prompt_tokens": "fixed:200", "output_tokens": "fixed:60", **extra}
               for name, extra in (("code", {"spec_acceptance_rates": [1.0]}), ("chat", {}),
                                   ("noise", {"spec_acceptance_rates": [0.0]}))]
    path = tmp_path / "w.yaml"
    path.write_text(yaml.safe_dump({"workload": {"seed": 3, "classes": classes}}, sort_keys=False))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = run_simulation(load_config(None, {"trace": str(path), "model": "llama-3.1-8b", "gpu": "h100",
                                                "speculative_config": {"method": "eagle3", "num_speculative_tokens": 3}}),
                             None, progress=False)
    s = res.summary["spec_decode"]
    assert s["workload_class_acceptance_rate_per_pos"] == {"code": [1.0], "noise": [0.0]}
    of = load_trace(path).workload_classes.of_request
    req = res.requests.assign(cls=res.requests["request_id"].map(of))
    tpot = req.groupby("cls")["tpot_s"].mean()
    assert tpot["code"] < tpot["chat"] < tpot["noise"]      # 4 tokens a step, ~2.8, 1
    assert 0 < s["num_accepted_tokens"] < s["num_draft_tokens"]
    # a verification accepts all 3 drafts in the code class, none in the noise class: 4 tokens a step against 1
    assert tpot["noise"] / tpot["code"] > 3.0


def test_a_workload_class_refuses_rising_acceptance_rates(tmp_path):
    import yaml

    from kvsim.traces import load_trace
    from kvsim.traces.errors import TraceError
    path = tmp_path / "w.yaml"
    path.write_text(yaml.safe_dump({"workload": {"classes": [{
        "name": "c", "requests": 2, "arrival": {"process": "constant", "rate": 1}, "prompt_tokens": "fixed:10",
        "output_tokens": "fixed:5", "spec_acceptance_rates": [0.5, 0.7]}]}}, sort_keys=False))
    with pytest.raises(TraceError) as e:
        load_trace(path)
    msg = str(e.value)
    assert "\n" not in msg and "spec_acceptance_rates" in msg and "non-increasing" in msg and "w.yaml" in msg


def test_simulate_with_eagle3_lowers_tpot_at_low_load():
    from kvsim.sim.simulator.simulate import run_simulation
    base = {"trace": "random", "trace_options": {"max_requests": 40, "request_rate": 2.0,
                                                 "random": {"input_len": 500, "output_len": 150}},
            "engine": {"num_gpu_blocks": 600}}       # a small pool: the per-step invariant checks stay cheap
    off = run_simulation(SimConfig(**base), None, progress=False, keep_steps=True)
    on = run_simulation(SimConfig(**base, speculative_config={"method": "eagle3", "num_speculative_tokens": 3},
                                  check_invariants=True), None, progress=False, keep_steps=True)
    s = on.summary["spec_decode"]
    assert s["num_drafts"] > 0 and 2.5 < s["mean_acceptance_length"] < 3.3
    assert on.summary["tpot_mean_s"] < 0.75 * off.summary["tpot_mean_s"]
    steps = on.steps
    assert int(steps["num_accepted_tokens"].sum()) == s["num_accepted_tokens"]
    assert float(steps["draft_s"].sum()) == pytest.approx(s["draft_s"])
    assert (on.requests["output_tokens"] == off.requests["output_tokens"]).all()
    assert np.array_equal(on.requests.sort_values("request_id")["output_tokens"].to_numpy(),
                          off.requests.sort_values("request_id")["output_tokens"].to_numpy())


def test_a_pasted_vllm_serve_line_sets_the_speculative_config():
    from kvsim.sim.cli.vllm_args import parse_serve
    line = ("vllm serve meta-llama/Llama-3.1-8B-Instruct --speculative-config "
            "'{\"method\": \"eagle3\", \"model\": \"yuhuili/EAGLE3-LLaMA3.1-Instruct-8B\", \"num_speculative_tokens\": 3}'")
    t = parse_serve(line)
    assert t.overrides["speculative_config"]["num_speculative_tokens"] == 3 and not t.warnings
    assert parse_serve("vllm serve m --speculative-config.method ngram").warnings      # dotted keys: not assembled


def test_a_sweep_over_methods_and_k_runs_each_point(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from kvsim.sim.cli import app
    (tmp_path / "spec.yaml").write_text(
        "fixed:\n  trace: random\n  trace_options: {max_requests: 16, max_concurrency: 4, "
        "random: {input_len: 64, output_len: 64}}\n"
        "runs:\n  - {speculative_config: {method: eagle3}}\n  - {speculative_config: {model: ngram}}\n"
        "grid:\n  speculative_config.num_speculative_tokens: [2, 4]\n")

    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["sweep", "spec.yaml", "--out", "st", "--jobs", "1"])
    assert result.exit_code == 0, result.output
    import pandas as pd
    rows = pd.concat([pd.read_parquet(p) for p in (tmp_path / "st" / "runs").glob("*.parquet")])
    assert (rows["status"] == "ok").all() and len(rows) == 4
    assert sorted(rows["speculative_config.num_speculative_tokens"].tolist()) == [2, 2, 4, 4]
    assert all(d["mean_acceptance_length"] > 1 for d in rows["spec_decode"])


@pytest.mark.parametrize("spec, engine", [
    ({"method": "eagle3", "num_speculative_tokens": 4}, {"async_scheduling": True}),
    ({"model": "ngram", "num_speculative_tokens": 3}, {"async_scheduling": False, "max_num_batched_tokens": 64,
                                                        "max_num_seqs": 16, "long_prefill_token_threshold": 32}),
    ({"method": "draft_model", "model": "llama-3.2-1b", "num_speculative_tokens": 2},
     {"async_scheduling": True, "enable_prefix_caching": True}),
    ({"method": "eagle3", "num_speculative_tokens": 3, "model_name": "gpt-oss-20b"}, {"async_scheduling": True}),
])
@pytest.mark.filterwarnings("ignore:.*sliding-window layers")
def test_the_engine_keeps_its_invariants_under_preemption_chunking_and_async(spec, engine):
    """Through the whole engine (the loop, async finishes, chunked prefill, a pool short enough to preempt),
    with the engine's invariant checks after every step: every request finishes with its output length."""
    from kvsim.sim.simulator.simulate import run_simulation
    spec = dict(spec)
    model = spec.pop("model_name", "llama-3.1-8b")        # gpt-oss: vLLM's hybrid allocator (sliding-window layers)
    cfg = SimConfig(trace="random", seed=3, check_invariants=True, model=model,
                    trace_options={"max_requests": 48, "request_rate": 40.0,
                                   "random": {"input_len": 300, "output_len": 120, "range_ratio": 0.5}},
                    engine={"num_gpu_blocks": 160, **engine}, speculative_config=spec)
    result = run_simulation(cfg, None, progress=False, keep_steps=True)
    req = result.requests
    assert (req["status"] == "finished").all()
    assert result.summary["preemptions"] > 0
    assert result.summary["spec_decode"]["num_drafts"] > 0
    steps = result.steps
    assert (steps["num_accepted_tokens"] <= steps["num_draft_tokens"]).all()


def test_an_eagle_drafter_drops_the_last_block_of_a_prefix_hit():
    """vLLM (KVCacheManager(use_eagle=True)): the drafter needs the last hit block's hidden states, so that
    block is recomputed."""
    def hits(use_eagle: bool) -> int:
        kv = KVCacheManager(64, 16, enable_caching=True)
        kv.use_eagle = use_eagle
        first = Request(0, 0.0, 100, 10, prefix_hash_ids=(1, 2, 3, 4), prefix_block_tokens=25)
        assert kv.allocate_slots(first, 100)
        kv.free(first)
        second = Request(1, 0.0, 100, 10, prefix_hash_ids=(1, 2, 3, 4), prefix_block_tokens=25)
        return len(kv.get_computed_blocks(second))
    assert hits(False) == 6 and hits(True) == 5
    plan = _spec(method="eagle3", num_speculative_tokens=2)
    from kvsim.sim.simulator.executor import replica_parts
    assert replica_parts(plan, 0)[0].use_eagle
    assert not replica_parts(_spec(model="ngram", num_speculative_tokens=2), 0)[0].use_eagle


def test_a_verification_computes_logits_for_every_verified_position():
    from kvsim.sim.core.scheduler import ScheduledRequest, SchedulerOutput
    from kvsim.sim.core.step import BatchShape, batch_shape
    kv = KVCacheManager(64, 16)
    reqs = [Request(i, 0.0, 100, 50) for i in range(2)]
    for r in reqs:
        r.num_output_tokens, r.num_computed_tokens = 1, 100
        kv.allocate_slots(r, 4)
    out = SchedulerOutput([ScheduledRequest(reqs[0], 4, 100, False, num_spec_tokens=3),
                           ScheduledRequest(reqs[1], 1, 100, False)])
    shape = batch_shape(out, kv)
    assert shape.num_logit_rows == 2 + 3 and shape.num_decode_tokens == 5
    assert batch_shape(SchedulerOutput([ScheduledRequest(reqs[1], 1, 100, False)]), kv).num_logit_rows is None
    cost = _spec(method="eagle3", num_speculative_tokens=3).cost
    plain = BatchShape(num_seqs=256, num_decode_tokens=1024, kv_tokens_read=256 * 1004)
    rows = BatchShape(num_seqs=256, num_decode_tokens=1024, kv_tokens_read=256 * 1004, num_logit_rows=1024)
    assert cost.predict(rows) > cost.predict(plain)
    assert cost.breakdown(rows)["total"] == pytest.approx(cost.predict(rows))


def test_plan_searches_speculative_variants_as_configurations_of_their_own():
    from kvsim.sim.planning.plan import PlanSpace, candidates, spec_label
    base = SimConfig(trace="random")
    space = PlanSpace(["llama-3.1-8b"], ["h100"], [1], speculative=[
        None, {"method": "eagle3", "num_speculative_tokens": 3}, {"model": "ngram", "num_speculative_tokens": 2}])
    keep, unfit = candidates(base, space)
    assert [c.spec for c in keep] == ["no-spec", "eagle3 k=3", "ngram k=2"] and not unfit
    assert keep[0].cfg.speculative_config is None and keep[1].cfg.speculative_config.num_speculative_tokens == 3
    assert keep[1].label == "llama-3.1-8b h100 TP1 eagle3 k=3"
    assert [c.spec for c in candidates(base, PlanSpace(["llama-3.1-8b"], ["h100"], [1]))[0]] == [None]
    assert spec_label(None) == "no-spec"


def test_the_token_budget_trims_the_drafts_and_a_preemption_clears_them():
    """vLLM: num_new_tokens = min(1 + drafts, budget left); the scheduled drafts are those that fit; a preempted
    request loses its drafts."""
    kv = KVCacheManager(200, 16)
    spec = SpecDecoder(SpecDecodeSettings(4, 4, (1.0, 1.0, 1.0, 1.0)), seed=0)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=7, max_model_len=10_000), kv, spec=spec)
    a, b = Request(0, 0.0, 3, 50), Request(1, 0.0, 3, 50)
    for r in (a, b):
        sched.add_request(r)
    out = sched.schedule()                                  # both prompts (3 + 3 tokens)
    sched.update(out, 1.0)
    assert a.spec_tokens == b.spec_tokens == 4             # drafts proposed after the prompts sampled
    out = sched.schedule()
    got = {s.request.request_id: (s.num_new_tokens, s.num_spec_tokens, s.is_prefill) for s in out.scheduled}
    assert got == {0: (5, 4, False), 1: (2, 1, False)}     # 7 tokens: 1 + 4 drafts, then 1 + 1
    assert a.spec_tokens == b.spec_tokens == 0             # moved into the step
    # lookahead: a holds blocks for 3 computed + 5 new + 4 lookahead = 12 tokens
    assert len(kv.blocks_of(a)) == 1 and len(kv.blocks_of(b)) == 1
    sched.update(out, 2.0)
    assert a.num_output_tokens == 1 + 1 + 4 and b.num_output_tokens == 1 + 1 + 1   # all drafts accepted
    assert a.num_computed_tokens == a.num_tokens - 1 and b.num_computed_tokens == b.num_tokens - 1
    sched._preempt(b, out)
    assert b.spec_tokens == 0 and b.num_computed_tokens == 0 and not kv.blocks_of(b)


def test_serve_refuses_a_speculative_config():
    from kvsim.sim.serve.cli import check_serve_config
    with pytest.raises(ConfigError, match="speculative_config: kvsim serve does not run"):
        check_serve_config(SimConfig(speculative_config={"method": "eagle3", "num_speculative_tokens": 2}))
