"""Mixture of experts, multi-head latent attention and sliding-window layers: memory and step costs
against figures computed here by hand from each model's config.json, HF configs parsing into the
catalog's specs, the hybrid KV allocator's bounded blocks, and every new catalog model end to end."""
import json

import numpy as np
import pytest

from kvsim.sim.model.catalog import get_model
from kvsim.sim.config import ConfigError, load_config
from kvsim.sim.core.request import Request
from kvsim.sim.core.sliding_window import HybridKVManager
from kvsim.sim.core.step import BatchShape
from kvsim.sim.model.cost_model import CostModel, expected_distinct_experts
from kvsim.sim.model.memory import PoolSizing, num_gpu_blocks
from kvsim.sim.simulator.simulate import run_simulation
from kvsim.traces import Trace

# config.json of mistralai/Mixtral-8x7B-v0.1 and deepseek-ai/DeepSeek-V3 as published (keys kvsim does not read
# included)
MIXTRAL_CONFIG = {
    "architectures": ["MixtralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2,
    "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
    "max_position_embeddings": 32768, "model_type": "mixtral", "num_attention_heads": 32,
    "num_experts_per_tok": 2, "num_hidden_layers": 32, "num_key_value_heads": 8, "num_local_experts": 8,
    "output_router_logits": False, "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.02,
    "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.36.0.dev0", "use_cache": True, "vocab_size": 32000}
DEEPSEEK_V3_CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "aux_loss_alpha": 0.001, "bos_token_id": 0, "eos_token_id": 1, "ep_size": 1, "first_k_dense_replace": 3,
    "hidden_act": "silu", "hidden_size": 7168, "initializer_range": 0.02, "intermediate_size": 18432,
    "kv_lora_rank": 512, "max_position_embeddings": 163840, "model_type": "deepseek_v3",
    "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256,
    "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 128, "num_experts_per_tok": 8,
    "num_hidden_layers": 61, "num_key_value_heads": 128, "num_nextn_predict_layers": 1, "q_lora_rank": 1536,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [128, 128]},
    "rms_norm_eps": 1e-06, "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                                           "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                                           "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid",
    "tie_word_embeddings": False, "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
    "transformers_version": "4.33.1", "use_cache": True, "v_head_dim": 128, "vocab_size": 129280}
GPT_OSS_20B_CONFIG = {
    "architectures": ["GptOssForCausalLM"], "attention_bias": True, "attention_dropout": 0.0, "eos_token_id": 200002,
    "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880, "initial_context_length": 4096,
    "initializer_range": 0.02, "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 12, "max_position_embeddings": 131072,
    "model_type": "gpt_oss", "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": 24,
    "num_key_value_heads": 8, "num_local_experts": 32, "output_router_logits": False, "pad_token_id": 199999,
    "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                       "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"},
    "rms_norm_eps": 1e-05, "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                                           "original_max_position_embeddings": 4096, "rope_type": "yarn",
                                           "truncate": False},
    "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128,
    "swiglu_limit": 7.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
    "vocab_size": 201088}
QWEN3_30B_A3B_CONFIG = {
    "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 6144, "max_position_embeddings": 40960,
    "max_window_layers": 48, "mlp_only_layers": [], "model_type": "qwen3_moe", "moe_intermediate_size": 768,
    "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": 128, "num_experts_per_tok": 8,
    "num_hidden_layers": 48, "num_key_value_heads": 4, "output_router_logits": False, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.51.0", "use_cache": True,
    "use_sliding_window": False, "vocab_size": 151936}
SPEC_ONLY = {"name", "hf_id", "aliases"}


def from_hf(tmp_path, config):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return get_model(path)


@pytest.mark.parametrize("config, name", [(MIXTRAL_CONFIG, "mixtral-8x7b"), (DEEPSEEK_V3_CONFIG, "deepseek-v3"),
                                          (GPT_OSS_20B_CONFIG, "gpt-oss-20b"), (QWEN3_30B_A3B_CONFIG, "qwen3-30b-a3b")])
def test_hf_config_parses_into_the_catalog_spec(tmp_path, config, name):
    parsed = from_hf(tmp_path, config).model_dump(exclude=SPEC_ONLY)
    assert parsed == get_model(name).model_dump(exclude=SPEC_ONLY)


def test_interleaved_moe_layers_are_refused_in_one_line(tmp_path):
    from kvsim.sim.model.catalog import CatalogError
    with pytest.raises(CatalogError, match="decoder_sparse_step") as err:
        from_hf(tmp_path, {**QWEN3_30B_A3B_CONFIG, "decoder_sparse_step": 2})
    assert "config.json" in str(err.value) and "\n" not in str(err.value)


def test_mixtral_memory_by_hand():
    m = get_model("mixtral-8x7b")
    h, layers, kv, inter, vocab = 4096, 32, 8 * 128, 14336, 32000
    attn = h * h + 2 * h * kv + h * h                          # q, k, v, o
    expert = 3 * h * inter                                     # gate, up, down
    small = layers * (2 * h + h * 8) + h                       # two norms and the router per layer, final norm
    params = layers * (attn + 8 * expert) + small + 2 * vocab * h
    assert m.param_count == params == 46_702_792_704           # the model card's 46.7 B
    assert m.weight_bytes == 2 * params                        # bf16, every expert resident
    assert m.kv_bytes_per_token() == 2 * layers * 8 * 128 * 2
    assert m.linear_flops_per_token == 2 * layers * (attn + 2 * expert)     # top-2: 12.9 B active


def test_mixtral_step_costs_by_hand():
    cost = CostModel("mixtral-8x7b", "h100", "default")
    h, layers, bw = 4096, 32, cost.gpu.mem_bw
    attn, expert = 2 * h * h + 2 * h * 1024, 3 * h * 14336
    dense_bytes = 2 * (layers * attn + layers * (2 * h + 8 * h) + h + 32000 * h)   # no experts; LM head
    assert cost._c["weights_s"] * bw == pytest.approx(dense_bytes, rel=1e-12)
    one_expert_all_layers = layers * expert * 2
    # one token picks 2 of 8 experts: 2 distinct; 256 tokens: 8 * (1 - 0.75**256), i.e. all 8
    assert cost.expert_read_time(1) * bw == pytest.approx(2 * one_expert_all_layers, rel=1e-12)
    assert cost.expert_read_time(256) * bw == pytest.approx(8 * (1 - 0.75 ** 256) * one_expert_all_layers)
    assert expected_distinct_experts(8, 2, np.array([0.0, 1.0, 2.0])).tolist() == pytest.approx(
        [0.0, 2.0, 8 * (1 - 0.75 ** 2)])
    # the decode step's linear memory term: weights + expert reads + activations + logits
    one = cost.features(BatchShape(num_seqs=1, num_decode_tokens=1, kv_tokens_read=100))
    big = cost.features(BatchShape(num_seqs=256, num_decode_tokens=256, kv_tokens_read=25600))
    read = lambda f, n: f["linear_memory"] - n * (cost._c["act_token_s"] + cost._c["logits_seq_s"])  # noqa: E731
    assert read(one, 1) * bw == pytest.approx(dense_bytes + 2 * one_expert_all_layers, rel=1e-9)
    assert read(big, 256) * bw == pytest.approx(dense_bytes + 8 * one_expert_all_layers, rel=1e-9)
    assert read(one, 1) < read(big, 256)                       # fewer expert bytes at batch 1
    assert one["linear_compute_decode"] * cost.gpu.peak_flops("bf16") == pytest.approx(
        2 * layers * (attn + 2 * expert) + 2 * h * 32000, rel=1e-12)


def test_moe_decode_reads_fewer_expert_bytes_at_batch_1_than_256_in_both_forms():
    for profile in ("default", "auto"):            # plain roofline, operator-fitted form
        cost = CostModel("qwen3-30b-a3b", "h100", profile)
        dense = CostModel(get_model("qwen3-30b-a3b").model_copy(update={"num_experts": 0, "experts_per_token": 0}),
                          "h100", profile)
        t1 = cost.predict(BatchShape(num_seqs=1, num_decode_tokens=1, kv_tokens_read=1000))
        t256 = cost.predict(BatchShape(num_seqs=256, num_decode_tokens=256, kv_tokens_read=256_000))
        assert cost.expert_read_time(1) < cost.expert_read_time(256) / 10     # 8 of 128 vs ~all 128
        assert t1 < t256
        assert dense.expert_read_time(256) == 0.0
        # predict_decode (the fast-forward's path) prices the same
        run = cost.predict_decode(np.array([1.0, 256.0]), np.array([1000.0, 256_000.0]), np.array([63.0, 16000.0]))
        one = cost.predict(BatchShape(num_seqs=1, num_decode_tokens=1, kv_tokens_read=1000, block_table_entries=63))
        assert run[0] == pytest.approx(one, rel=1e-12)


def test_deepseek_v3_memory_by_hand():
    m = get_model("deepseek-v3")
    h, heads, layers, vocab = 7168, 128, 61, 129280
    q = h * 1536 + 1536 * heads * (128 + 64)                   # through q_lora_rank
    kv = h * (512 + 64) + 512 * heads * (128 + 128)            # latent + RoPE key down, K/V up
    attn = q + kv + heads * 128 * h
    dense_mlp, expert = 3 * h * 18432, 3 * h * 2048
    linear = layers * attn + 3 * dense_mlp + 58 * (256 + 1) * expert
    small = layers * (2 * h + 1536 + 512) + 58 * h * 256 + h   # norms, latent norms, routers, final norm
    params = linear + small + 2 * vocab * h
    assert m.param_count == params == 671_026_404_352          # 671 B without the MTP layer
    assert m.weight_bytes == linear * 1 + 2 * vocab * h * 2 + small * 2     # fp8 linears, bf16 rest
    assert m.kv_bytes_per_token() == layers * (512 + 64) * 2 == 70_272
    active = layers * attn + 3 * dense_mlp + 58 * (8 + 1) * expert
    assert m.linear_flops_per_token == 2 * active              # ~37 B active
    assert m.attention_flops_per_pair() == 2 * layers * heads * (128 + 64 + 128)
    assert m.attention_flops_per_kv_read() == 2 * layers * heads * (2 * 512 + 64)


def test_deepseek_v3_latent_kv_is_whole_on_every_gpu():
    for tp in (1, 8):
        cost = CostModel("deepseek-v3", "h200", "default", tp=tp)
        assert cost.kv_bytes_per_token_per_gpu == 70_272
        pool = num_gpu_blocks("deepseek-v3", "h200", PoolSizing(tp=8, block_size=16))
        assert pool.bytes_per_block == 16 * 70_272
    cost = CostModel("deepseek-v3", "h200", "default", tp=8)
    f = cost.features(BatchShape(num_seqs=4, num_prefill_tokens=100, num_decode_tokens=3, kv_tokens_read=5000,
                                 attn_pairs_prefill=5050))
    peak = cost.gpu.peak_flops("bf16")
    expected = (5050 * 2 * 61 * 128 * 320 + 5000 * 2 * 61 * 128 * 1088) / 8 / peak
    assert f["attn_compute"] == pytest.approx(expected, rel=1e-12)
    assert f["attn_memory"] * cost.gpu.mem_bw == pytest.approx(5000 * 70_272, rel=1e-12)


def test_gpt_oss_mxfp4_experts_and_groups():
    m = get_model("gpt-oss-20b")
    expert = 3 * 2880 * 2880
    routed = 24 * 32 * expert
    assert m.weight_bytes - get_model("gpt-oss-20b").model_copy(update={"expert_dtype": None}).weight_bytes \
        == pytest.approx(routed * (4.25 / 8 - 2), abs=1)
    assert 20.8e9 < m.param_count < 21.0e9                     # 20.9 B on the model card
    assert m.kv_cache_groups() == (12, 1, 1)                   # 12 full + 12 sliding layers
    assert m.kv_bytes_per_token() == 2 * 24 * 8 * 64 * 2
    pool = num_gpu_blocks(m, "h100", PoolSizing(block_size=16))
    assert pool.bytes_per_block == 16 * 2 * 12 * 8 * 64 * 2    # one group's 12 layers


def test_expert_parallel_all_to_all_and_refusals():
    tp = CostModel("mixtral-8x7b", "h100", "default", tp=4)
    ep = CostModel("mixtral-8x7b", "h100", "default", tp=4, expert_parallel=True)
    h, act = 4096, 2
    assert tp._c["allreduce_token_s"] * tp.gpu.link_bw == pytest.approx(2 * 32 * 2 * 3 / 4 * h * act)
    # attention's all-reduce per layer + all-to-all dispatch/combine of 2 experts' inputs, 1/4 of the tokens
    assert ep._c["allreduce_token_s"] * ep.gpu.link_bw == pytest.approx((32 * 2 * 3 / 4 + 32 * 2 * 2 * 3 / 4 / 4) * h * act)
    assert ep._c["allreduce_count"] == 32 + 2 * 32
    with pytest.raises(ValueError, match="no experts"):
        CostModel("llama-3.1-8b", "h100", tp=2, expert_parallel=True)
    with pytest.raises(ValueError, match="do not split evenly"):
        CostModel(get_model("mixtral-8x7b").model_copy(update={"num_experts": 6}), "h100", tp=4, expert_parallel=True)


def _prefill_then_decode(kv, req, chunk, decode_steps):
    peak = 0
    while req.num_computed_tokens < req.prompt_tokens + decode_steps:
        n = min(chunk, req.prompt_tokens - req.num_computed_tokens) if req.num_computed_tokens < req.prompt_tokens else 1
        assert kv.allocate_slots(req, n)
        req.num_computed_tokens += n
        peak = max(peak, kv.blocks_held(req))
        kv.check_invariants([req])
    return peak


def test_sliding_window_keeps_a_long_requests_blocks_bounded():
    m = get_model("mistral-7b-v0.1")
    assert m.kv_cache_groups() == (32, 0, 1)
    kv = HybridKVManager(4000, 16, window=m.sliding_window, full_groups=0, sliding_groups=1, sliding_layer_fraction=1)
    req = Request(0, 0.0, 20_000, 500)
    peak = _prefill_then_decode(kv, req, 2048, 300)
    window_blocks = 4096 // 16
    assert peak <= window_blocks + 2048 // 16 + 1               # the window plus the chunk in flight
    assert kv.blocks_held(req) <= window_blocks + 1             # decoding: the window only
    assert kv.kv_tokens(req) == 4096                            # attention reads the window
    # a hybrid model (gpt-oss): the full group keeps every block, the sliding one 128 tokens
    g = HybridKVManager(4000, 16, window=128, full_groups=1, sliding_groups=1, sliding_layer_fraction=0.5)
    r = Request(1, 0.0, 3000, 100)
    _prefill_then_decode(g, r, 1024, 50)
    assert g.blocks_held(r) == -(-3050 // 16) + (128 // 16 + 1)
    assert g.kv_tokens(r) == 3050 - 0.5 * (3050 - 128)
    held = g.blocks_held(r)
    assert g.free(r) == held and g.pool.num_free_blocks == 3999    # all back (one block is the null block)


def _batch_trace(n, prompt, output):
    return Trace.from_columns(arrival_time_s=np.zeros(n), prompt_tokens=np.full(n, prompt),
                              output_tokens=np.full(n, output))


def test_more_requests_fit_with_a_sliding_window():
    windowed = get_model("mistral-7b-v0.1")
    full = windowed.model_copy(update={"sliding_window": 0})
    peak = {}
    for name, spec in (("window", windowed), ("full", full)):
        cfg = load_config(None, {"model": "mistral-7b-v0.1", "gpu": "h100", "engine.num_gpu_blocks": 4000,
                                 "engine.enable_prefix_caching": False, "check_invariants": True})
        res = run_simulation(cfg, trace=_batch_trace(12, 16_000, 20), model=spec)
        assert res.summary["completed"] == 12
        peak[name] = res.steps["num_running"].max()
    # 3999 blocks of 16 tokens: 3 whole 16,020-token requests; windowed ones hold 257 blocks once prefilled
    assert peak["full"] == 3
    assert peak["window"] >= 3 * peak["full"]


def test_sliding_window_refuses_eviction_policies_and_swap():
    trace = _batch_trace(2, 100, 5)
    with pytest.raises(ConfigError, match="sliding-window"):
        run_simulation(load_config(None, {"model": "mistral-7b-v0.1", "kv.policy": "streaming", "kv.budget": 64}),
                       trace=trace)
    with pytest.raises(ConfigError, match="preemption_mode"):
        run_simulation(load_config(None, {"model": "gpt-oss-20b", "engine.preemption_mode": "swap"}), trace=trace)


@pytest.mark.parametrize("model, gpu, tp", [
    ("mixtral-8x7b", "h100", 2), ("qwen3-30b-a3b", "h100", 1), ("deepseek-v3", "h200", 8),
    ("gpt-oss-20b", "h100", 1), ("gpt-oss-120b", "h100", 1), ("qwen2.5-7b", "h100", 1),
    ("qwen2.5-32b", "h100", 1), ("mistral-7b-v0.1", "h100", 1)])
def test_each_new_catalog_model_simulates(model, gpu, tp):
    cfg = load_config(None, {"model": model, "gpu": gpu, "tp": tp, "trace": "azure-conv-2023",
                             "trace_options.max_requests": 40})
    res = run_simulation(cfg)
    assert res.summary["completed"] == 40
    assert res.summary["output_throughput"] > 0


def test_kvsim_models_lists_experts_active_params_and_attention():
    from typer.testing import CliRunner

    from kvsim.sim.cli import app
    r = CliRunner().invoke(app, ["models", "--json"])
    assert r.exit_code == 0, r.output
    rows = {m["name"]: m for m in json.loads(r.output)}
    ds = rows["DeepSeek-V3"]
    assert (ds["experts"], ds["experts_per_token"], ds["shared_experts"], ds["attention"]) == (256, 8, 1, "MLA")
    assert ds["kv_bytes_per_token"] == 70_272 and 37.0 < ds["active_params_b"] < 38.0
    assert rows["gpt-oss-20b"]["attention"] == "GQA, window 128 on 12/24 layers"
    assert rows["gpt-oss-20b"]["expert_dtype"] == "mxfp4"
    assert rows["Llama-3.1-8B"]["experts"] == 0 and rows["Llama-3.1-8B"]["attention"] == "GQA"
