"""CLI hygiene: documented options exist, --version, ineffective or impossible options refused in one line."""
import re
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from kvsim.sim.cli import app
from kvsim.sim.planning.sweep import SchedulerUnreachable, connect

DOC = (Path(__file__).resolve().parents[1] / "docs" / "commands.md").read_text()


def run(*args):
    return CliRunner().invoke(app, list(args))


def test_version():
    r = run("--version")
    assert r.exit_code == 0 and re.fullmatch(r"kvsim \S+\n", r.output)


def command_paths(command=None, path=()):
    """Every command of the CLI, as its argument path (('simulate',), ('trace', 'synth'), ...)."""
    import typer
    command = typer.main.get_command(app) if command is None else command
    subcommands = getattr(command, "commands", None)
    if not subcommands:
        return [path]
    return [p for name, sub in subcommands.items() for p in command_paths(sub, (*path, name))]


def usage(*args):
    return CliRunner().invoke(app, list(args), prog_name="kvsim")


def one_error_line(r) -> str:
    assert r.exit_code == 2, r.output
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Usage:" not in r.output, r.output
    return lines[0]


@pytest.mark.parametrize("path", command_paths(), ids=" ".join)
def test_every_command_reports_an_unknown_option_in_one_line_and_keeps_its_help(path):
    line = one_error_line(usage(*path, "--no-such-option"))
    assert line.startswith("error: No such option: --no-such-option") and f"'kvsim {' '.join(path)} --help'" in line
    r = usage(*path, "--help")
    assert r.exit_code == 0 and "Usage: kvsim " + " ".join(path) in " ".join(r.output.split())


@pytest.mark.parametrize("args, expected", [
    (["simulate", "--polcy", "h2o"], "error: No such option: --polcy (Possible options: --policy, --pool-choice, --profile); see "
                                     "'kvsim simulate --help'"),
    (["simulate", "--num-gpu-block", "9"], "error: No such option: --num-gpu-block (Possible options: "
                                           "--num-gpu-blocks); see 'kvsim simulate --help'"),
    (["simulate", "--seed", "abc"], "error: Invalid value for '--seed': Input should be a valid integer, unable to "
                                    "parse string as an integer; see 'kvsim simulate --help'"),
    (["simulate", "--max-requests"], "error: Option '--max-requests' requires an argument"),
    (["sweep"], "error: Missing argument 'spec'; see 'kvsim sweep --help'"),
    (["simulte"], "error: No such command 'simulte'. Did you mean 'simulate'?; see 'kvsim --help'"),
    (["trace", "synth", "-n", "1e3", "t.jsonl"], "error: Invalid value for '--requests' / '-n'"),
])
def test_usage_errors_are_one_line_naming_the_option(args, expected):
    assert one_error_line(usage(*args)).startswith(expected)


def test_the_console_script_reports_a_usage_error_in_one_line():
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-m", "kvsim.sim.cli", "capacity", "--overwrit"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr == ("error: No such option: --overwrit (Possible options: --overwrite); see 'python -m "
                        "kvsim.sim.cli capacity --help'\n")
    r = subprocess.run([sys.executable, "-m", "kvsim.sim.cli"], capture_output=True, text=True, timeout=120)
    assert "Usage: python -m kvsim.sim.cli [OPTIONS] COMMAND" in r.stdout and r.stderr == ""     # bare: the help


def test_every_option_of_the_shared_table_exists_on_simulate():
    shared = DOC.split("## Options shared by the simulation commands")[1].split("\n## ")[0]
    options = re.findall(r"(?m)^\| `(--[a-z-]+)` \| `", shared)
    assert "--max-model-len" in options and "--chunked-prefill" in options
    import typer
    simulate = typer.main.get_command(app).commands["simulate"]
    names = {n for p in simulate.params for n in (*p.opts, *p.secondary_opts)}
    assert [o for o in options if o not in names] == []


def test_engine_and_window_options_reach_the_config(tmp_path):
    out = tmp_path / "run"
    r = run("simulate", "--max-model-len", "1024", "--no-chunked-prefill", "--long-prefill-token-threshold", "256",
            "--start-s", "10", "--end-s", "60", "-q", "-o", str(out))
    assert r.exit_code == 0, r.output
    cfg = yaml.safe_load((out / "config.yaml").read_text())
    assert cfg["engine"]["max_model_len"] == 1024 and cfg["engine"]["enable_chunked_prefill"] is False
    assert cfg["engine"]["long_prefill_token_threshold"] == 256
    assert (cfg["trace_options"]["start_s"], cfg["trace_options"]["end_s"]) == (10.0, 60.0)


@pytest.mark.parametrize("args, message", [
    (["--budget", "128"], "--budget (kv.budget): policy none keeps every token"),
    (["--compression-rate", "2"], "policy none compresses nothing"),
    (["--kv-mode", "fast"], "--kv-mode fast (kv.mode): with policy none"),
    (["--slot-strategy", "compact"], "--slot-strategy compact (kv.slot_strategy): policy none evicts nothing"),
    (["--layout", "per_head", "--slot-strategy", "slot_reuse"], "policy none evicts nothing"),
    (["--num-gpu-blocks", "200000"], "390.6 GiB of KV cache per GPU, but H100-SXM has 79.11 GiB"),
    (["--burstiness", "0.5"], "burstiness 0.5 has no effect without request_rate"),
    (["--gpu", "t4", "--model", "llama-3.2-1b", "--weight-dtype", "fp8"], "T4 predates Ampere"),
])
def test_ineffective_or_impossible_options_are_one_line(tmp_path, args, message):
    r = run("simulate", "--max-requests", "5", *args, "-q", "-o", str(tmp_path / "x"))
    assert r.exit_code == 2 and message in r.output
    assert r.output.count("\n") == 1 and r.output.startswith("error: ")


@pytest.mark.parametrize("args, message", [
    (["--budget", "64"], "--budget (kv.budget): policy none keeps every token"),
    (["--slot-strategy", "sparse_copy"], "--slot-strategy sparse_copy (kv.slot_strategy): policy none evicts nothing"),
])
def test_replay_refuses_kv_options_policy_none_would_ignore(tmp_path, args, message):
    r = run("replay", "--trace", "azure-conv-2023", "--max-requests", "2", "--num-gpu-blocks", "40", *args, "-q",
            "-o", str(tmp_path / "x"))
    assert r.exit_code == 2 and message in r.output
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("command", ["simulate", "replay"])
def test_max_model_len_above_the_models_positions_is_refused_as_vllm_does(tmp_path, command, monkeypatch):
    monkeypatch.delenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", raising=False)
    model = "llama-3.2-1b" if command == "simulate" else "smollm2-135m"      # 131,072 / 8,192 positions
    limit = 131072 if command == "simulate" else 8192
    length = ["--max-model-len", str(limit + 1)] if command == "simulate" else [
        "--set", f"engine.max_model_len={limit + 1}", "--num-gpu-blocks", "40"]
    r = run(command, "--model", model, *length, "--max-requests", "2", "-q", "-o", str(tmp_path / "x"))
    assert r.exit_code == 2 and r.output.count("\n") == 1, r.output
    assert r.output.startswith(f"error: engine.max_model_len (--max-model-len) {limit + 1} is above ")
    assert f"max_position_embeddings ({limit}); vLLM refuses it" in r.output
    assert "VLLM_ALLOW_LONG_MAX_MODEL_LEN=1" in r.output and not (tmp_path / "x").exists()


def test_vllms_switch_allows_a_longer_max_model_len_with_a_warning(tmp_path, monkeypatch):
    for value, code in (("0", 2), ("1", 0), ("true", 0)):
        monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", value)
        r = run("simulate", "--model", "llama-3.2-1b", "--max-model-len", "200000", "--max-requests", "2", "-q",
                "-o", str(tmp_path / value))
        assert r.exit_code == code, r.output
    assert "warning: engine.max_model_len (--max-model-len) 200000 is above Llama-3.2-1B's max_position_embeddings " \
           "(131072), allowed by VLLM_ALLOW_LONG_MAX_MODEL_LEN=1" in r.stderr
    assert yaml.safe_load((tmp_path / "1" / "config.yaml").read_text())["engine"]["max_model_len"] == 200000
    monkeypatch.delenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN")
    assert run("simulate", "--model", "llama-3.2-1b", "--max-model-len", "131072", "--max-requests", "2", "-q",
               "-o", str(tmp_path / "at")).exit_code == 0


H2O = ["--policy", "h2o", "--budget", "64"]
IGNORED_KV_OPTIONS = [
    (H2O + ["--set", "kv.trigger_interval=4"], "kv.trigger_interval=4: only kv.trigger=every_n reads it, and this "
                                               "run's trigger is every_step (policy h2o's default)"),
    (["--set", "kv.trigger_threshold=100"], "kv.trigger_threshold=100: only kv.trigger=threshold reads it, and this "
                                            "run's trigger is never (policy none's default)"),
    (H2O + ["--set", "kv.trigger=every_step", "--set", "kv.trigger_threshold=9"], "run's trigger is every_step;"),
    (H2O + ["--set", "kv.high_tier=K8V8"], "kv.high_tier=K8V8: policy 'h2o' keeps every token at full precision"),
    (["--policy", "snapkv", "--budget", "64", "--set", "kv.low_tier=K8V4"], "kv.low_tier=K8V4: policy 'snapkv' keeps"),
    (H2O + ["--set", "kv.fast_rows=4"], "kv.fast_rows=4: only kv.mode=fast samples rows, and this run is "
                                        "kv.mode=token"),
    (["--policy", "quest", "--slot-strategy", "compact"], "--slot-strategy compact (kv.slot_strategy): policy "
                                                          "'quest' evicts nothing"),
    (["--policy", "tokenselect", "--slot-strategy", "slot_reuse"], "policy 'tokenselect' evicts nothing"),
]


@pytest.mark.parametrize("command", ["simulate", "replay"])
@pytest.mark.parametrize("args, message", IGNORED_KV_OPTIONS)
def test_kv_options_the_runs_policy_never_reads_are_refused(tmp_path, command, args, message):
    extra = ["--num-gpu-blocks", "40"] if command == "replay" else []
    r = run(command, "--max-requests", "2", *extra, *args, "-q", "-o", str(tmp_path / "x"))
    assert r.exit_code == 2 and message in r.output, r.output
    assert r.output.count("\n") == 1 and r.output.startswith("error: ")
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("args", [
    H2O + ["--set", "kv.trigger=every_n", "--set", "kv.trigger_interval=4"],
    H2O + ["--set", "kv.trigger=threshold", "--set", "kv.trigger_threshold=32"],
    ["--policy", "leankv", "--layout", "per_head", "--set", "kv.high_tier=K8V8", "--set", "kv.low_tier=K8V4"],
    H2O + ["--kv-mode", "fast", "--set", "kv.fast_rows=4"],
    ["--policy", "quest"],
])
def test_kv_options_are_accepted_where_the_run_reads_them(tmp_path, args):
    r = run("simulate", "--max-requests", "3", *args, "-q", "-o", str(tmp_path / "x"))
    assert r.exit_code == 0, r.output


def test_the_pool_check_passes_what_fits(tmp_path):
    r = run("simulate", "--max-requests", "5", "--num-gpu-blocks", "32846", "-q", "-o", str(tmp_path / "x"))
    assert r.exit_code == 0, r.output


def test_unreachable_dask_scheduler_is_one_line():
    with pytest.raises(SchedulerUnreachable) as err:
        connect("tcp://127.0.0.1:1", timeout_s=1)
    assert "--scheduler tcp://127.0.0.1:1: no dask scheduler answered" in str(err.value)
    assert "\n" not in str(err.value)


def test_models_and_gpus_list_the_catalog_figures(tmp_path):
    import json
    r = run("models", "--json")
    assert r.exit_code == 0, r.output
    rows = {m["name"]: m for m in json.loads(r.output)}
    assert rows["Qwen3-0.6B"]["kv_bytes_per_token"] == 114688 and rows["Llama-3.1-8B"]["layers"] == 32
    assert rows["Qwen2.5-0.5B"]["weight_gib"] == pytest.approx(988065536 / 2**30)
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 512, "intermediate_size": 1024,
        "num_attention_heads": 8, "num_hidden_layers": 4, "vocab_size": 1000, "torch_dtype": "float16"}))
    one = json.loads(run("models", str(tmp_path / "m"), "--json").output)
    assert one[0]["name"] == "m" and one[0]["kv_bytes_per_token"] == 2 * 4 * 8 * 64 * 2
    assert run("models", "no-such-model").exit_code == 2
    gpus = {g["name"]: g for g in json.loads(run("gpus", "--json").output)}
    assert gpus["H100-SXM"]["memory_bw_gbps"] == 3350 and "fp8" not in gpus["T4"]["tflops"]
    assert run("gpus").exit_code == 0 and "H200" in run("gpus").output


def test_tables_printed_to_a_pipe_are_not_cut_to_80_columns():
    """Piped or captured, `kvsim models` cut names and lengths to 'Llama-3.1-70B-…', '13…' (and
    plan's Pareto table 'llama-3.…'): rich's default of 80 columns off a terminal."""
    r = run("models", "llama-3.1-70b-fp8", "llama-3-8b")
    assert r.exit_code == 0, r.output
    assert "Llama-3.1-70B-FP8" in r.output and "131,072" in r.output and "8,192" in r.output
    assert "\u2026" not in r.output


def test_a_runs_config_yaml_reruns_from_another_directory(tmp_path, monkeypatch):
    """config.yaml kept --trace and --model as typed (relative), so `kvsim simulate -c OUT/config.yaml`
    failed from any other directory, or read another directory's file of the same name."""
    work = tmp_path / "work"
    (work / "hf").mkdir(parents=True)
    (work / "t.csv").write_text("arrival_time_s,prompt_tokens,output_tokens\n0,50,4\n0.1,60,5\n")
    (work / "hf" / "config.json").write_text(
        '{"model_type": "llama", "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4, '
        '"num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 1000, "max_position_embeddings": 2048}')
    import shutil
    from kvsim.sim.model.cost_model import PROFILES_DIR
    shutil.copy(PROFILES_DIR / "l4.yaml", work / "mine.yaml")
    monkeypatch.chdir(work)
    r = run("simulate", "--trace", "t.csv", "--model", "hf/config.json", "--gpu", "l4", "-q", "-o", "run",
            "--profile", "mine.yaml*1.25")
    assert r.exit_code == 0, r.output
    cfg = yaml.safe_load((work / "run" / "config.yaml").read_text())
    assert cfg["trace"] == str(work / "t.csv") and cfg["model"] == str(work / "hf" / "config.json")
    assert cfg["profile"] == f"{work / 'mine.yaml'}*1.25"         # a scaled profile file: the file made absolute
    assert cfg["gpu"] == "l4"                                      # a catalog name stays a name
    monkeypatch.chdir(tmp_path)
    r = run("simulate", "-c", str(work / "run" / "config.yaml"), "-q", "-o", "again")
    assert r.exit_code == 0, r.output
    assert (tmp_path / "again" / "requests.parquet").read_bytes() == (work / "run" / "requests.parquet").read_bytes()
