"""Pipeline parallelism and data-parallel attention with expert parallelism (sim/model/parallel.py,
docs/parallelism.md): vLLM's stage split, the KV pool per stage, the pipeline round against the TP1 step,
the fast-forward on a PP replica, DP ranks against independent engines with and without the all-to-all,
vLLM's DP load balancer, and the refusals."""
from types import SimpleNamespace

import pandas as pd
import pytest

from kvsim.sim.config import ConfigError, SimConfig, load_config
from kvsim.sim.core.step import BatchShape
from kvsim.sim.engine.resolved_run import resolve_run
from kvsim.sim.engine.routers import build_router
from kvsim.sim.model.cost_model import CostModel
from kvsim.sim.model.memory import PoolSizing, num_gpu_blocks
from kvsim.sim.model.parallel import DPAttentionPricing, PipelineCostModel, pp_layer_split, stage_weight_bytes
from kvsim.sim.model.catalog import get_model
from kvsim.sim.simulator.simulate import run_simulation


def test_layers_split_as_vllm_get_pp_indices():
    # vllm.distributed.utils.get_pp_indices: the remainder goes to the stages before the last, from the back
    assert pp_layer_split(32, 2) == [16, 16]
    assert pp_layer_split(80, 3) == [27, 27, 26]
    assert pp_layer_split(61, 4) == [15, 15, 16, 15]
    assert pp_layer_split(7, 7) == [1] * 7
    with pytest.raises(ValueError, match=r"pp \(--pipeline-parallel-size\) 33 exceeds the model's 32"):
        pp_layer_split(32, 33)


def test_stage_weights_add_up_to_the_model_plus_a_last_stage_lm_head():
    m = get_model("llama-3.1-8b")                 # untied: the stages hold exactly the model's weights
    parts = pp_layer_split(m.num_layers, 4)
    total = sum(stage_weight_bytes(m, n, i == 0, i == 3) for i, n in enumerate(parts))
    assert abs(total - m.weight_bytes) <= 4
    tied = get_model("llama-3.2-1b") if get_model("llama-3.2-1b").tied_embeddings else None
    if tied is not None:                          # the last stage holds its own copy of a tied LM head
        two = sum(stage_weight_bytes(tied, n, i == 0, i == 1) for i, n in enumerate(pp_layer_split(tied.num_layers, 2)))
        assert two > tied.weight_bytes


def test_pp2_doubles_the_kv_pool_of_tp1():
    one = resolve_run(load_config(None, {})).num_blocks
    two = resolve_run(load_config(None, {"pp": 2})).num_blocks
    # each GPU holds half the layers' KV per block and half the weights: more than twice the blocks
    assert 2.0 * one <= two <= 2.6 * one
    # 70B does not fit one H100 but fits two stages of one
    with pytest.raises(ValueError, match="does not fit"):
        num_gpu_blocks("llama-3.1-70b", "h100", PoolSizing(tp=1))
    assert num_gpu_blocks("llama-3.1-70b", "h100", PoolSizing(tp=1, pp=2)).num_blocks > 0
    assert num_gpu_blocks("llama-3.1-8b", "h100", PoolSizing(pp=2)).num_blocks > 2 * num_gpu_blocks(
        "llama-3.1-8b", "h100", PoolSizing()).num_blocks


def _shape(seqs, prefill=0, kv=0):
    return BatchShape(num_seqs=seqs, num_prefill_tokens=prefill, num_decode_tokens=seqs - (1 if prefill else 0),
                      kv_tokens_read=kv, attn_pairs_prefill=prefill * prefill / 2, block_table_entries=kv // 16)


def test_pipeline_step_latency_is_at_least_the_tp1_step():
    tp1 = CostModel("llama-3.1-8b", "h100", tp=1, async_scheduling=True)
    pp2 = PipelineCostModel("llama-3.1-8b", "h100", tp=1, async_scheduling=True, pp=2)
    one = _shape(1, kv=2000)
    # one sequence rides one micro-batch through both stages and the stage boundary
    assert pp2.predict(one) == pytest.approx(tp1.predict(one) + pp2.send_seconds(1.0), rel=1e-12)
    assert pp2.predict(one) > tp1.predict(one)
    for shape in (_shape(64, kv=64 * 1500), _shape(8, prefill=2048, kv=8 * 900)):
        # a round is never shorter than one micro-batch's pass through every stage
        micro = tp1.predict(BatchShape(**{k: (v / 2 if isinstance(v, (int, float)) and v is not None else v)
                                          for k, v in vars(shape).items()}))
        assert pp2.predict(shape) >= micro
    # the decode fast-forward's run pricing agrees with stepping
    import numpy as np
    seqs, kv = np.array([1, 2, 5, 64]), np.array([900, 1800, 4500, 64 * 900])
    runs = pp2.predict_decode(seqs, kv, kv // 16)
    steps = [pp2.predict(BatchShape(num_seqs=int(s), num_prefill_tokens=0, num_decode_tokens=int(s),
                                    kv_tokens_read=int(k), attn_pairs_prefill=0, block_table_entries=int(k) // 16))
             for s, k in zip(seqs, kv, strict=True)]
    assert np.allclose(runs, steps, rtol=1e-12, atol=0)


def _small(**over) -> SimConfig:
    base = {"trace": "random", "trace_options.max_requests": 120, "trace_options.request_rate": 30.0,
            "trace_options.random.input_len": 600, "trace_options.random.output_len": 60}
    base.update(over)
    return load_config(None, base)


def test_a_pp_replica_fast_forwards_exactly_has_its_pool_and_is_never_faster_for_a_lone_request():
    on = run_simulation(_small(pp=2), keep_steps=True)
    off = run_simulation(_small(pp=2, fast_forward=False), keep_steps=True)
    # the decode fast-forward prices each in-flight batch of a run apart: what stepping gives, bit for bit
    cols = ["request_id", "ttft_s", "e2e_s", "finish_s"]
    pd.testing.assert_frame_equal(on.requests[cols], off.requests[cols], check_exact=True)
    pd.testing.assert_frame_equal(on.steps[["time_s", "duration_s", "batch_size"]].reset_index(drop=True),
                                  off.steps[["time_s", "duration_s", "batch_size"]].reset_index(drop=True),
                                  check_exact=True)
    assert on.num_gpu_blocks == resolve_run(_small(pp=2)).num_blocks
    plain = run_simulation(_small(), keep_steps=False)
    # more than twice the pool; the first request's prefill (alone) takes the TP1's plus a stage hand-off
    assert on.num_gpu_blocks > 2 * plain.num_gpu_blocks
    first = on.requests["arrival_s"].idxmin()
    assert on.requests["ttft_s"][first] > plain.requests["ttft_s"][first]


def _first_step_batches(prompt: int, n: int) -> tuple[list[int], float, PipelineCostModel]:
    from kvsim.sim.core.request import Request
    from kvsim.sim.core.scheduler import Scheduler
    from kvsim.sim.simulator.executor import PipelineExecutor, replica_parts
    plan = resolve_run(_small(pp=2))
    kv, executor = replica_parts(plan, 0)
    assert isinstance(executor, PipelineExecutor)
    sched = Scheduler(plan.scheduler, kv)
    for i in range(n):
        assert sched.add_request(Request(request_id=i, arrival_time=0.0, prompt_tokens=prompt, max_output_tokens=4))
    out = sched.schedule()
    seconds = executor.execute(out).duration_s
    return sorted(executor.batch_of.values()), seconds, plan.cost


def test_in_flight_batches_fill_as_vllm_schedules_them():
    # a burst that fits one batch's max_num_batched_tokens rides one batch (vLLM leaves the other empty)
    batches, seconds, cost = _first_step_batches(100, 8)
    assert batches == [0] * 8
    one = cost.round_seconds([BatchShape(num_seqs=8, num_prefill_tokens=800, attn_pairs_prefill=8 * 100 * 101 / 2,
                                         kv_tokens_read=800, block_table_entries=8 * 7)])
    assert seconds == pytest.approx(one, rel=1e-12)
    assert seconds > cost.predict(BatchShape(num_seqs=8, num_prefill_tokens=800, attn_pairs_prefill=8 * 100 * 101 / 2,
                                             kv_tokens_read=800, block_table_entries=8 * 7))   # the even split
    # prompts beyond one batch's budget go to the next batch (each in-flight batch has its own budget)
    budget = cost.batch_tokens
    batches, _, _ = _first_step_batches(budget // 2, 4)
    assert batches == [0, 0, 1, 1]


def test_pp_refusals_are_one_line():
    with pytest.raises(ConfigError, match=r"^pp \(--pipeline-parallel-size\) 40 exceeds the model's 32 decoder layers"):
        resolve_run(load_config(None, {"pp": 40}))
    with pytest.raises(ConfigError, match="sliding-window"):
        resolve_run(load_config(None, {"pp": 2, "model": "gpt-oss-20b"}))
    with pytest.raises(ConfigError, match="pp > 1 with dp > 1"):
        resolve_run(load_config(None, {"pp": 2, "dp": 2, "model": "qwen3-30b-a3b"}))


def test_configs_without_parallelism_keep_their_keys():
    data = SimConfig().model_dump()
    assert "pp" not in data and "dp" not in data
    assert SimConfig(pp=2).model_dump()["pp"] == 2


def test_a_stage_that_does_not_fit_names_the_layout():
    with pytest.raises(ValueError, match=r"does not fit on L4 \(tp=1, pp=2\).*raise tp, pp"):
        num_gpu_blocks("llama-3.1-70b", "l4", PoolSizing(pp=2))


def test_dp_refusals_are_one_line():
    with pytest.raises(ConfigError, match=r"dp \(data-parallel attention\) needs a mixture-of-experts model, got dp 2"):
        load_config(None, {"dp": 2})
    with pytest.raises(ConfigError, match=r"^dp \(--data-parallel-size\) 64: 128 experts of Qwen3-30B-A3B over dp 64 x tp 4"):
        resolve_run(load_config(None, {"dp": 64, "tp": 4, "model": "qwen3-30b-a3b"}))
    with pytest.raises(ConfigError, match="kv_offload with dp 2"):
        load_config(None, {"dp": 2, "model": "qwen3-30b-a3b", "kv_offload.cpu_gib": 8})


def test_dp_pricing_is_the_slowest_rank_with_the_moe_of_every_rank():
    cost = CostModel("qwen3-30b-a3b", "h100", tp=1, async_scheduling=True)
    pricing = DPAttentionPricing(cost, 4)
    big, small = cost.predict(_shape(64, kv=64 * 1000)), cost.predict(_shape(16, kv=16 * 1000))
    own = [big, None, small, None]              # two idle ranks run dummy batches
    tokens = [64.0, 0.0, 16.0, 0.0]
    step = pricing.step_seconds(own, tokens)
    moe = pricing.moe_seconds(80.0, 4)
    a2a = pricing.all_to_all_seconds(64.0)
    assert big - pricing.moe_seconds(64.0, 1) > 0
    assert step == pytest.approx(big - pricing.moe_seconds(64.0, 1) + moe + a2a, rel=1e-12)
    # the experts split 4 ways: one step of the group is shorter than the big rank's step alone
    assert step < big
    assert a2a > 0 and pricing.link.name.endswith("interconnect")       # 4 GPUs: one node
    # across nodes (more than 8 GPUs) the all-to-all crosses the network
    wide = DPAttentionPricing(cost, 16)
    assert wide.link.name == "ib-ndr" and wide.all_to_all_seconds(64.0) > a2a
    assert DPAttentionPricing(cost, 4, free_all_to_all=True).all_to_all_seconds(64.0) == 0.0


def _burst(input_len: int, output_len: int, **over) -> SimConfig:
    base = {"trace": "random", "model": "qwen3-30b-a3b", "trace_options.max_requests": 160,
            "trace_options.random.input_len": input_len, "trace_options.random.output_len": output_len,
            "router": "dp_balance", "seed": 3}
    base.update(over)
    return load_config(None, base)


@pytest.mark.filterwarnings("ignore:all 160 requests arrive at t=0")
def test_dp_ranks_match_independent_engines_when_the_all_to_all_is_free(monkeypatch):
    def throughput(cfg):
        return run_simulation(cfg, keep_steps=False).summary["total_token_throughput"]
    # long prompts (compute-bound steps) and decode-heavy requests, each as 4 engines and as 4 DP ranks
    prefill_ind, decode_ind = throughput(_burst(4000, 2, replicas=4)), throughput(_burst(400, 48, replicas=4))
    prefill_sync, decode_sync = throughput(_burst(4000, 2, dp=4)), throughput(_burst(400, 48, dp=4))
    monkeypatch.setattr(DPAttentionPricing, "all_to_all_seconds", lambda self, tokens: 0.0)
    prefill_free, decode_free = throughput(_burst(4000, 2, dp=4)), throughput(_burst(400, 48, dp=4))
    # all-to-all free, compute-bound: the shared MoE layers do the 4 engines' expert work in grouped GEMMs of
    # 4x the rows per expert (sim/model/moe_kernels.py), which run at a higher efficiency: faster, not slower
    assert prefill_ind < prefill_free < 1.3 * prefill_ind
    # with the experts in the linear roofline (efficiency by the step's tokens) no more, no less
    priced = CostModel.__init__

    def on_the_roofline(self, *args, **kwargs):       # every cost model of the run, as with_experts_on_the_roofline
        priced(self, *args, **kwargs)
        self.moe_kernels = False
        self._set_operator_terms()
    monkeypatch.setattr(CostModel, "__init__", on_the_roofline)
    assert throughput(_burst(4000, 2, dp=4)) == pytest.approx(throughput(_burst(4000, 2, replicas=4)), rel=0.03)
    # decode reads the experts its tokens touch: split over 4 GPUs instead of read by each engine (faster)
    assert decode_free > decode_ind
    # the all-to-all costs every step: slower than with it free
    assert prefill_sync < 0.9 * prefill_free and decode_sync < decode_free


def test_dp_balance_routes_as_vllm():
    def rank(i, running=0, waiting=0, used=0):
        pool = SimpleNamespace(num_used_blocks=used, num_blocks=101)
        return SimpleNamespace(index=i, outstanding=running + waiting, now=0.0, inbox=(),
                               scheduler=SimpleNamespace(waiting=[None] * waiting), kv=SimpleNamespace(pool=pool))
    idle = [rank(0), rank(1), rank(2)]
    router = build_router("dp_balance", idle)
    assert [router.route(None).index for _ in range(4)] == [0, 1, 2, 0]       # ties: round robin
    # equal counts, but the waiting requests of a KV-full engine are penalised
    busy = [rank(0, running=2, waiting=2, used=95), rank(1, running=3, waiting=1, used=20)]
    assert build_router("dp_balance", busy).route(None).index == 1
    assert build_router("dp_balance", [rank(0, running=1), rank(1, running=4)]).route(None).index == 0


@pytest.mark.parametrize("pasted, native", [
    ("vllm serve meta-llama/Llama-3.1-70B-Instruct -tp 2 --pipeline-parallel-size 2",
     ["--model", "meta-llama/Llama-3.1-70B-Instruct", "--tp", "2", "-pp", "2"]),
    ("vllm serve Qwen/Qwen3-30B-A3B --data-parallel-size 2 --enable-expert-parallel",
     ["--model", "Qwen/Qwen3-30B-A3B", "--dp", "2", "--router", "dp_balance", "--enable-expert-parallel"]),
])
def test_pasted_pp_and_dp_flags_give_the_config_of_kvsim_options(tmp_path, pasted, native):
    from typer.testing import CliRunner

    from kvsim.sim.cli import app
    runner = CliRunner()
    common = ["simulate", "--gpu", "h100", "-q", "--trace", "random", "--max-requests", "16", "--random-input-len", "256",
              "--random-output-len", "16", "--request-rate", "8"]
    a = runner.invoke(app, [*common, "--out", str(tmp_path / "a"), "--vllm", pasted])
    b = runner.invoke(app, [*common, "--out", str(tmp_path / "b"), *native])
    assert a.exit_code == 0 and b.exit_code == 0, a.output + b.output
    assert (tmp_path / "a" / "config.yaml").read_bytes() == (tmp_path / "b" / "config.yaml").read_bytes()
    assert (tmp_path / "a" / "requests.parquet").read_bytes() == (tmp_path / "b" / "requests.parquet").read_bytes()


def test_dp_ranks_step_in_lockstep_and_share_the_load():
    res = run_simulation(_small(dp=2, model="qwen3-30b-a3b", router="dp_balance"), keep_steps=True)
    steps = res.steps
    assert set(steps["replica"]) == {0, 1}
    # every step of the group starts at one time and takes one duration on every rank that ran in it
    by_start = steps.groupby("time_s")["duration_s"].nunique()
    assert (by_start == 1).all()
    both = steps.groupby("time_s")["replica"].nunique()
    assert (both == 2).any()
    counts = res.requests.groupby("replica").size()
    assert abs(int(counts[0]) - int(counts[1])) <= 0.2 * len(res.requests)
