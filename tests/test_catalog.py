import pytest

from kvsim.sim.model.catalog import CatalogError, get_gpu, get_model, gpu_for_device_name, list_gpus, list_models

# Parameter totals as published on each model's Hugging Face page (safetensors metadata).
PUBLISHED_PARAMS = {
    "Llama-2-7B": 6_738_415_616,
    "Llama-3.1-8B": 8_030_261_248,
    "Llama-3.1-70B": 70_553_706_496,
    "Llama-3-8B": 8_030_261_248,         # meta-llama/Meta-Llama-3-8B
    "Llama-3-70B": 70_553_706_496,       # meta-llama/Meta-Llama-3-70B
    "Mistral-7B-v0.2": 7_241_732_096,
    "Qwen2.5-7B": 7_615_616_512,
    "Qwen2.5-32B": 32_763_876_352,
    "SmolLM2-135M": 134_515_008,
    "Llama-3.2-1B": 1_235_814_400,
    "Llama-3.2-3B": 3_212_749_824,
    "OPT-125M": 125_239_296,
    "OPT-1.3B": 1_315_758_080,
    "Llama-2-70B": 68_976_648_192,       # meta-llama/Llama-2-70b-hf
}


def test_llama31_8b_matches_config_json():
    m = get_model("Llama-3.1-8B")
    assert (m.num_layers, m.hidden_size, m.num_heads, m.num_kv_heads, m.head_dim) == (32, 4096, 32, 8, 128)
    assert (m.intermediate_size, m.vocab_size, m.tied_embeddings, m.max_position) == (14336, 128256, False, 131072)
    assert m.kv_bytes_per_token() == 2 * 32 * 8 * 128 * 2 == 131072


@pytest.mark.parametrize("size", ["8b", "70b"])
def test_llama3_is_not_llama31(size):
    """Meta-Llama-3 has Llama 3.1's shapes but 8,192 positions (rope_scaling null), 3.1 has 131,072
    (rope_type llama3): vLLM's max_model_len differs, so the names must not share an entry."""
    three = {get_model(n) for n in (f"llama-3-{size}", f"llama3-{size}", f"meta-llama/Meta-Llama-3-{size.upper()}",
                                    f"meta-llama/Meta-Llama-3-{size.upper()}-Instruct", f"Meta-Llama-3-{size}")}
    three_one = {get_model(n) for n in (f"llama-3.1-{size}", f"llama3.1-{size}", f"meta-llama/Llama-3.1-{size.upper()}",
                                        f"meta-llama/Meta-Llama-3.1-{size.upper()}-Instruct")}
    assert [m.name for m in three] == [f"Llama-3-{size.upper()}"] and three.pop().max_model_len == 8192
    assert [m.name for m in three_one] == [f"Llama-3.1-{size.upper()}"] and three_one.pop().max_model_len == 131072
    shape = ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size", "vocab_size")
    a, b = get_model(f"llama-3-{size}"), get_model(f"llama-3.1-{size}")
    assert [getattr(a, f) for f in shape] == [getattr(b, f) for f in shape] and a.weight_bytes == b.weight_bytes


def test_llama3_8b_refuses_what_vllm_serving_it_refuses(tmp_path, monkeypatch):
    """A 9,000-token prompt fits Llama-3.1-8B's 131,072 positions, not Meta-Llama-3-8B's 8,192."""
    monkeypatch.delenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", raising=False)
    from kvsim.sim.config import ConfigError, load_config
    from kvsim.sim.simulator.simulate import run_simulation
    trace = tmp_path / "t.csv"
    trace.write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n0.0,100,10\n0.5,9000,10\n")
    runs = {m: run_simulation(load_config(None, {"model": m, "gpu": "a100-80gb", "trace": str(trace)})).summary
            for m in ("llama-3-8b", "llama-3.1-8b")}
    assert (runs["llama-3-8b"]["num_rejected"], runs["llama-3-8b"]["max_model_len"]) == (1, 8192)
    assert (runs["llama-3.1-8b"]["num_rejected"], runs["llama-3.1-8b"]["max_model_len"]) == (0, 131072)
    with pytest.raises(ConfigError, match=r"16384 is above Llama-3-8B's max_position_embeddings \(8192\)"):
        run_simulation(load_config(None, {"model": "llama-3-8b", "trace": str(trace), "engine.max_model_len": 16384}))


def test_smollm2_matches_the_backend_gguf():
    m = get_model("SmolLM2-135M")
    assert (m.num_layers, m.hidden_size, m.num_heads, m.num_kv_heads, m.head_dim) == (30, 576, 9, 3, 64)
    assert (m.intermediate_size, m.vocab_size, m.tied_embeddings) == (1536, 49152, True)


@pytest.mark.parametrize("name,params", PUBLISHED_PARAMS.items())
def test_parameter_count_matches_published_total(name, params):
    assert get_model(name).param_count == params


def test_qwen_has_qkv_bias_and_it_counts():
    qwen = get_model("qwen2.5-7b")
    assert qwen.qkv_bias
    no_bias = qwen.model_copy(update={"qkv_bias": False})
    assert qwen.param_count - no_bias.param_count == qwen.num_layers * (qwen.q_size + 2 * qwen.kv_size)


def test_fp8_weights_halve_linear_weight_bytes_but_keep_bf16_embeddings():
    bf16, fp8 = get_model("llama-3.1-70b"), get_model("llama-3.1-70b-fp8")
    assert fp8.param_count == bf16.param_count
    emb = 2 * fp8.embedding_params * 2                       # embedding + untied LM head, bf16
    small = (fp8.num_layers * fp8.small_params_per_layer + fp8.hidden_size) * 2
    assert fp8.weight_bytes == fp8.linear_params * 1 + emb + small
    assert bf16.weight_bytes == bf16.linear_params * 2 + emb + small
    assert bf16.weight_bytes - fp8.weight_bytes == bf16.linear_params   # exactly half of the linears
    assert 0.5 < fp8.weight_bytes / bf16.weight_bytes < 0.52


def test_kv_dtype_override_halves_kv_bytes():
    m = get_model("llama-3.1-8b")
    assert m.kv_bytes_per_token("fp8") == m.kv_bytes_per_token() / 2
    assert m.with_dtypes(kv_dtype="fp8_e4m3").kv_bytes_per_token() == 65536


def test_flops_per_token():
    m = get_model("llama-3.1-8b")
    assert m.linear_flops_per_token == 2 * 32 * (4096 * (4096 + 2 * 1024) + 4096 * 4096 + 3 * 4096 * 14336)
    assert m.lm_head_flops_per_seq == 2 * 4096 * 128256


@pytest.mark.parametrize("alias,name", [
    ("h100", "H100-SXM"), ("H100", "H100-SXM"), ("a100", "A100-80GB"), ("A100_40GB", "A100-40GB"),
    ("nvidia-l4", "L4"), ("cpu", "cpu-2core"),
])
def test_gpu_aliases(alias, name):
    assert get_gpu(alias).name == name


@pytest.mark.parametrize("alias,name", [
    ("llama-3.1-8b", "Llama-3.1-8B"), ("LLAMA_3.1_8B", "Llama-3.1-8B"),
    ("meta-llama/Llama-3.1-8B-Instruct", "Llama-3.1-8B"), ("mistral-7b", "Mistral-7B-v0.2"),
    ("llama-3.1-70b-fp8", "Llama-3.1-70B-FP8"), ("smollm2", "SmolLM2-135M"), ("Qwen/Qwen2.5-32B", "Qwen2.5-32B"),
])
def test_model_aliases(alias, name):
    assert get_model(alias).name == name


def test_every_alias_resolves_to_its_own_entry():
    for spec in list_models():
        for alias in (spec.name, *spec.aliases):
            assert get_model(alias) is spec
    for spec in list_gpus():
        for alias in (spec.name, *spec.aliases):
            assert get_gpu(alias) is spec


def test_unknown_names_list_the_known_ones():
    with pytest.raises(CatalogError, match="known gpus: T4, L4, L40, .*H200, .*B200, .*cpu-2core"):
        get_gpu("b300")
    with pytest.raises(CatalogError, match="unknown model 'gpt-5'.*Llama-3.1-8B"):
        get_model("gpt-5")


def test_a_model_path_that_does_not_exist_is_said_so(tmp_path):
    """`kvsim models ~/models/Qwen2.5-14B-Instruct` (a typo in a Hugging Face directory) answered
    "unknown model ...; known models: <the catalog> ... or a path to a YAML file": neither that the path
    does not exist nor that a config.json directory is accepted."""
    missing = tmp_path / "Qwen2.5-14B-Instruct"
    with pytest.raises(CatalogError, match=r"no such file or directory \(expected a catalog name or a YAML file, "
                                           r"a Hugging Face config.json or its directory\)"):
        get_model(str(missing))
    with pytest.raises(CatalogError, match="or a path to a YAML file, a Hugging Face config.json"):
        get_model("gpt-5")


def test_gpu_specs_and_dtype_fallbacks():
    h100, a100, t4 = get_gpu("h100"), get_gpu("a100"), get_gpu("t4")
    assert h100.peak_flops("bf16") == pytest.approx(989.4e12)
    assert h100.peak_flops("fp8") == pytest.approx(2 * 989.4e12, rel=1e-3)
    assert h100.mem_bw == 3.35e12 and h100.link_bw == 450e9
    assert a100.compute_dtype("fp8") == "bf16"        # Ampere runs FP8 checkpoints weight-only
    assert t4.compute_dtype("bf16") == "fp16"         # Turing has no bf16
    assert t4.link_bw == t4.pcie_bw                    # no NVLink: collectives go over PCIe
    assert get_gpu("h200").memory_gib > h100.memory_gib


def test_user_model_file(tmp_path):
    path = tmp_path / "tiny.yaml"
    path.write_text("name: Tiny\nnum_layers: 2\nhidden_size: 64\nnum_heads: 4\nnum_kv_heads: 2\nhead_dim: 16\n"
                    "intermediate_size: 128\nvocab_size: 1000\ntied_embeddings: true\nmax_position: 512\n"
                    "weight_dtype: bfloat16\nkv_dtype: bf16\n")
    tiny = get_model(str(path))
    assert tiny.name == "Tiny" and tiny.weight_dtype == "bf16"
    assert tiny.kv_bytes_per_token() == 2 * 2 * 2 * 16 * 2


def test_user_file_errors_name_file_line_and_field(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("gpus:\n  - name: X1\n    memory_gib: -3\n    memory_bw_gbps: 100\n    tflops: {bf16: 10}\n"
                    "    pcie_gbps: 16\n    usd_per_hour: 1\n    colour: red\n")
    with pytest.raises(CatalogError) as err:
        get_gpu(path)
    text = str(err.value)
    assert f"{path}:3: field 'memory_gib': Input should be greater than 0" in text
    assert f"{path}:8: field 'colour': unknown field" in text


def test_multi_entry_file_needs_a_name(tmp_path):
    path = tmp_path / "two.yaml"
    entry = "  - name: {n}\n    memory_gib: 8\n    memory_bw_gbps: 100\n    tflops: {{fp16: 10}}\n" \
            "    pcie_gbps: 16\n    usd_per_hour: 1\n"
    path.write_text("gpus:\n" + entry.format(n="A") + entry.format(n="B"))
    with pytest.raises(CatalogError, match="holds 2 gpus .*#NAME"):
        get_gpu(str(path))
    assert get_gpu(f"{path}#b").name == "B"


def test_bad_dtype_and_head_counts_rejected(tmp_path):
    path = tmp_path / "m.yaml"
    path.write_text("name: M\nnum_layers: 2\nhidden_size: 64\nnum_heads: 6\nnum_kv_heads: 4\nhead_dim: 16\n"
                    "intermediate_size: 128\nvocab_size: 1000\ntied_embeddings: true\nmax_position: 512\n"
                    "weight_dtype: fp7\nkv_dtype: bf16\n")
    with pytest.raises(CatalogError) as err:
        get_model(path)
    assert "field 'weight_dtype'" in str(err.value) and ":11:" in str(err.value)


def test_models_doc_lists_every_catalog_name_alias_and_length():
    """docs/models.md's catalog table is what `--model` answers to: every entry, alias and max_position."""
    from pathlib import Path
    text = (Path(__file__).parents[1] / "docs" / "models.md").read_text()
    section = text.split("## Catalog names, aliases and lengths", 1)[1].split("\n## ", 1)[0]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in section.splitlines()
            if line.startswith("| ") and not line.startswith("| model ")]
    documented = {r[0]: (r[1], tuple(a for a in r[2].split(", ") if a), int(r[3].replace(",", ""))) for r in rows}
    assert documented == {m.name: (m.hf_id, m.aliases, m.max_position) for m in list_models()}


@pytest.mark.parametrize("device_name, gib, gpu", [
    ("NVIDIA H100 80GB HBM3", 79.1, "h100"), ("NVIDIA H200", 139.8, "h200"),
    ("NVIDIA A100-SXM4-80GB", 79.2, "a100-80gb"), ("NVIDIA A100-SXM4-40GB", 39.4, "a100-40gb"),
    ("NVIDIA L40S", 44.4, "l40"), ("NVIDIA L4", 22.0, "l4"), ("NVIDIA A40", 44.3, "a40"), ("Tesla T4", 14.6, "t4"),
    ("NVIDIA GeForce RTX 4090", 23.6, None),
])
def test_cuda_device_names_map_to_catalog_gpus(device_name, gib, gpu):
    # the one map replay's defaults and the GPU validation both use (torch.cuda.get_device_name strings)
    assert gpu_for_device_name(device_name, gib) == gpu
    if gpu is not None:
        assert get_gpu(gpu).name.lower().startswith(gpu.split("-")[0])
