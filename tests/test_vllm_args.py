"""Pasted `vllm serve` / `vllm bench serve` command lines (kvsim simulate --vllm/--bench) and vLLM's flags as
kvsim options: the same configuration as kvsim's own options, one note per flag not modelled, unknown flags
refused; vllm bench serve's random dataset drawn as vLLM draws it."""
import math

import numpy as np
import pytest
from typer.testing import CliRunner

from kvsim.sim.cli import app
from kvsim.sim.cli.vllm_args import VllmArgsError, parse_bench, parse_serve, translate
from kvsim.traces.synthetic import vllm_random_dataset

runner = CliRunner()

SERVE = ("vllm serve meta-llama/Llama-3.1-8B-Instruct --tensor-parallel-size 2 --kv-cache-dtype fp8 "
         "--enable-prefix-caching --gpu-memory-utilization 0.85 --max-num-seqs 64 --port 8000 --disable-log-requests")
BENCH = ("vllm bench serve --model meta-llama/Llama-3.1-8B-Instruct --dataset-name random --random-input-len 512 "
         "--random-output-len 64 --random-range-ratio 0.5 --num-prompts 30 --request-rate 20 --burstiness 0.5 "
         "--seed 3 --goodput ttft:800 tpot:40 --ignore-eos --save-result")
KVSIM = ["--model", "meta-llama/Llama-3.1-8B-Instruct", "--tp", "2", "--kv-dtype", "fp8", "--prefix-caching",
         "--gpu-memory-utilization", "0.85", "--max-num-seqs", "64", "--trace", "random", "--random-input-len", "512",
         "--random-output-len", "64", "--random-range-ratio", "0.5", "--max-requests", "30", "--request-rate", "20",
         "--burstiness", "0.5", "--seed", "3", "--slo-ttft", "800ms", "--slo-tpot", "40ms"]


def _simulate(tmp_path, name, args):
    out = tmp_path / name
    result = runner.invoke(app, ["simulate", "--gpu", "h100", "--out", str(out), "-q", *args])
    assert result.exit_code == 0, result.output
    return out, result.output


def test_pasted_serve_and_bench_lines_give_the_config_of_kvsim_options(tmp_path):
    pasted, output = _simulate(tmp_path, "pasted", ["--vllm", SERVE, "--bench", BENCH])
    native, _ = _simulate(tmp_path, "native", KVSIM)
    assert (pasted / "config.yaml").read_bytes() == (native / "config.yaml").read_bytes()
    assert (pasted / "requests.parquet").read_bytes() == (native / "requests.parquet").read_bytes()
    # one note per flag read but not modelled, none for the modelled ones
    assert "vllm serve --port 8000: not modelled" in output
    assert "vllm serve --disable-log-requests: not modelled" in output
    assert "--bench: vllm bench serve --save-result: not modelled" in output
    assert "--tensor-parallel-size" not in output and "--kv-cache-dtype" not in output


def test_vllm_flag_aliases_on_simulate(tmp_path):
    aliased, _ = _simulate(tmp_path, "aliased", [
        "--model", "llama-3.1-8b", "-tp", "2", "--kv-cache-dtype", "fp8", "--no-enable-prefix-caching",
        "--no-enable-chunked-prefill", "--quantization", "fp8", "--dataset-name", "random", "--num-prompts", "10",
        "--goodput", "ttft:800", "--goodput", "tpot:40"])
    native, _ = _simulate(tmp_path, "native", [
        "--model", "llama-3.1-8b", "--tp", "2", "--kv-dtype", "fp8", "--no-prefix-caching", "--no-chunked-prefill",
        "--weight-dtype", "fp8", "--trace", "random", "--max-requests", "10", "--slo-ttft", "800ms",
        "--slo-tpot", "40ms"])
    assert (aliased / "config.yaml").read_bytes() == (native / "config.yaml").read_bytes()


def test_flag_spellings_vllm_accepts():
    t = parse_serve("CUDA_VISIBLE_DEVICES=0,1 vllm serve llama-3.1-8b --max_num_seqs=8 --max-model-len 32k "
                    "--max-num-batched-tokens 2K --no-enable-prefix-caching -O3 --block-size=32 \\\n --enforce-eager")
    assert t.overrides == {"model": "llama-3.1-8b", "engine.max_num_seqs": 8, "engine.max_model_len": 32000,
                           "engine.max_num_batched_tokens": 2048, "engine.enable_prefix_caching": False,
                           "engine.block_size": 32}
    assert any("-O 3: not modelled" in n for n in t.notes)
    assert any("--enforce-eager: not modelled" in w for w in t.warnings)
    assert parse_serve("vllm serve m --speculative-config.method ngram").warnings   # dotted JSON keys: the flag
    assert parse_serve("python -m vllm.entrypoints.openai.api_server --model m -tp 4").overrides == {
        "model": "m", "tp": 4}


@pytest.mark.parametrize("line, message", [
    ("vllm serve m --max-num-seq 8", "--max-num-seq: not a flag kvsim knows"),
    ("vllm serve m -pp 0", "expected an integer >= 1"),
    ("vllm serve m --quantization hqq", "--quantization hqq: kvsim reads"),
    ("vllm serve m --max-num-seqs", "--max-num-seqs: expected a value"),
    ("vllm serve m --max-num-seqs eight", "--max-num-seqs 'eight': expected an integer"),
    ("vllm serve a b", "one model expected"),
    ("vllm bench m", "expected a line starting with 'vllm serve'"),
])
def test_bad_serve_lines_name_the_flag(line, message):
    with pytest.raises(VllmArgsError, match=message):
        parse_serve(line)


def test_serve_specials():
    assert parse_serve("vllm serve m --quantization awq").overrides["weight_dtype"] == "int4"
    assert parse_serve("vllm serve m --dtype half").overrides["weight_dtype"] == "fp16"
    assert "kv_dtype" not in parse_serve("vllm serve m --kv-cache-dtype auto").overrides
    dp = parse_serve("vllm serve llama-3.1-8b -dp 4")
    assert dp.overrides["replicas"] == 4 and dp.overrides["router"] == "least_outstanding"
    # pipeline parallelism and a MoE model's data parallelism are modelled (docs/parallelism.md), not refused
    assert parse_serve("vllm serve m -pp 2").overrides["pp"] == 2
    from kvsim.sim.cli.vllm_args import VllmOptions, translate_options
    moe = translate_options(VllmOptions(serve="vllm serve mixtral-8x7b --data-parallel-size 2"))
    assert moe.overrides["dp"] == 2 and moe.overrides["router"] == "dp_balance" and "replicas" not in moe.overrides
    assert any("data-parallel attention" in n for n in moe.notes)


def test_bench_lines():
    t = parse_bench("vllm bench serve --model m --dataset-name sharegpt --dataset-path sg.json --random-input-len 9")
    assert t.overrides["trace"] == "sg.json"
    assert t.overrides["trace_options.max_requests"] == 1000         # vLLM's default --num-prompts
    assert "trace_options.random.input_len" not in t.overrides
    assert any("--random-input-len: applies to --dataset-name random only" in n for n in t.notes)
    default = parse_bench("vllm bench serve --model m --request-rate inf")
    assert default.overrides["trace"] == "random" and default.overrides["trace_options.request_rate"] == math.inf
    assert any("--ignore-eos" in n for n in default.notes)
    with pytest.raises(VllmArgsError, match="--goodput 'ttft=5'"):
        parse_bench("vllm bench serve --goodput ttft=5")
    assert parse_bench("vllm bench serve --goodput e2el:900 --ignore-eos").warnings
    with pytest.raises(VllmArgsError, match="--dataset-name sonnet"):
        parse_bench("vllm bench serve --dataset-name sonnet")
    with pytest.raises(VllmArgsError, match="differs from the served model"):
        translate("vllm serve a", "vllm bench serve --model b")


def test_a_kvsim_option_and_a_pasted_flag_that_disagree_are_refused(tmp_path):
    result = runner.invoke(app, ["simulate", "--tp", "4", "--vllm", "vllm serve llama-3.1-8b -tp 2",
                                 "--out", str(tmp_path / "x")])
    assert result.exit_code == 2
    assert "tp: 4 from kvsim's option but 2 from the vLLM flags" in result.output


def test_random_dataset_draws_as_vllm():
    t = vllm_random_dataset(2000, input_len=100, output_len=10, range_ratio=0.5, seed=7)
    prompt, output = t.df["prompt_tokens"].to_numpy(), t.df["output_tokens"].to_numpy()
    assert prompt.min() == 50 and prompt.max() == 150 and output.min() == 5 and output.max() == 15
    rng = np.random.default_rng(7)            # vLLM: inputs, then outputs, from default_rng(seed)
    assert (prompt == rng.integers(50, 151, size=2000)).all() and (output == rng.integers(5, 16, size=2000)).all()
    fixed = vllm_random_dataset(3, input_len=64, output_len=8, prefix_len=32)
    assert fixed.df["prompt_tokens"].tolist() == [96] * 3 and fixed.prefix_block_tokens == 32
    assert fixed.df["prefix_hash_ids"].tolist() == [[0]] * 3
