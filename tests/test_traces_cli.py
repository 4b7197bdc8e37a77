"""`kvsim trace stats|synth|convert` through the root CLI app."""
import json

import pandas as pd
import pytest
from typer.testing import CliRunner

from kvsim.sim.cli import app
from kvsim.traces import load_trace, trace_stats
from kvsim.traces.synthetic import synthesize

runner = CliRunner()


def kvsim(*args):
    return runner.invoke(app, ["trace", *map(str, args)])


def test_stats_prints_the_published_azure_conv_figures():
    result = kvsim("stats", "azure-conv-2023")
    assert result.exit_code == 0, result.output
    rows = {line.split("│")[1].strip(): line.split("│")[2].strip()
            for line in result.stdout.splitlines() if line.count("│") == 3}
    assert rows["requests"] == "19,366"
    assert rows["span (s)"] == "3,501.72" and rows["mean rate (req/s)"] == "5.53"
    assert (rows["prompt mean"], rows["prompt p50"], rows["prompt p90"], rows["prompt max"]) == ("1,155", "1,020", "2,734", "14,050")
    assert (rows["output mean"], rows["output p50"], rows["output p90"], rows["output max"]) == ("211", "129", "424", "1,000")
    assert "prefix blocks seen before" not in rows  # no prefix ids in Azure traces


def test_stats_of_several_traces_as_json():
    result = kvsim("stats", "mooncake-conversation", "sharegpt-8k-filtered", "--rate", "2", "--json")
    assert result.exit_code == 0, result.output
    conversation, sharegpt = json.loads(result.stdout)
    assert conversation["prefix_repeat_share"] == pytest.approx(0.366, abs=0.0005)
    assert conversation["mean_rate_rps"] == pytest.approx(3.40, abs=0.005)
    assert sharegpt["mean_rate_rps"] == pytest.approx(trace_stats(load_trace("sharegpt-8k-filtered", rate=2.0))["mean_rate_rps"])


def test_stats_table_shows_prefix_reuse_and_length_only_notice():
    result = kvsim("stats", "mooncake-synthetic", "arxiv")
    assert result.exit_code == 0, result.output
    assert "64.0%" in result.stdout
    assert "note (arxiv): arrivals synthesized: closed batch" in result.stdout


def test_synth_writes_the_same_trace_as_the_library(tmp_path):
    out = tmp_path / "bursty.parquet"
    result = kvsim("synth", out, "-n", "500", "--rate", "4", "--cv", "3", "--prompt", "uniform:10,100",
                   "--output", "fixed:16", "--seed", "9")
    assert result.exit_code == 0, result.output
    assert "wrote 500 requests" in result.stdout
    expected = synthesize(500, rate=4.0, cv=3.0, prompt="uniform:10,100", output="fixed:16", seed=9)
    pd.testing.assert_frame_equal(load_trace(out).df, expected.df)
    assert load_trace(out).name == "bursty"


def test_convert_applies_transforms_and_writes_native(tmp_path):
    out = tmp_path / "mc.jsonl"
    result = kvsim("convert", "mooncake-conversation", out, "--start", "60", "--end", "660",
                   "--scale-rate", "2", "--max-model-len", "32768")
    assert result.exit_code == 0, result.output
    expected = load_trace("mooncake-conversation").window(60, 660).scale_rate(2).clip(32768)
    back = load_trace(out)
    pd.testing.assert_frame_equal(back.df, expected.df)
    assert back.num_clipped == expected.num_clipped > 0 and back.prefix_block_tokens == 512


def test_convert_length_only_with_rate_then_sample(tmp_path):
    out = tmp_path / "sg.parquet"
    result = kvsim("convert", "sharegpt-8k-filtered", out, "--rate", "3", "--seed", "4", "--sample", "100")
    assert result.exit_code == 0, result.output
    expected = load_trace("sharegpt-8k-filtered", rate=3.0, seed=4).sample(100, seed=4)
    pd.testing.assert_frame_equal(load_trace(out).df, expected.df)


def test_stats_and_convert_read_a_gateway_log_through_its_column_mapping(tmp_path):
    log = tmp_path / "gateway.jsonl"
    log.write_text('{"t": 1764064800000, "u": {"p": 10, "o": 5}}\n{"t": 1764064800500, "u": {"p": 20, "o": 6}}\n')
    reader = ["--trace-format", "jsonl", "--trace-columns", "arrival=t,prompt_tokens=u.p,output_tokens=u.o",
              "--time-unit", "ms"]
    result = kvsim("stats", log, "--json", *reader)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)[0]["span_s"] == 0.5
    result = kvsim("convert", log, tmp_path / "native.parquet", *reader)
    assert result.exit_code == 0, result.output
    t = load_trace(tmp_path / "native.parquet")
    assert t.df["arrival_time_s"].tolist() == [0.0, 0.5] and t.df["prompt_tokens"].tolist() == [10, 20]


@pytest.mark.parametrize("args, fragment", [
    (["stats", "{bad}"], "{bad}:3: ContextTokens: expected an integer >= 1, got '-2'"),
    (["stats", "nothing-here.csv"], "no such file, and not a shipped trace name"),
    (["convert", "{bad}", "{out}"], "{bad}:3: ContextTokens"),
    (["convert", "azure-code-2023", "{tmp}/x.txt"], "expected .parquet or .jsonl"),
    (["convert", "azure-code-2023", "{out}", "--start", "9000"], "no requests left"),
    (["convert", "azure-code-2023", "{out}", "--rate", "2"], "rate/cv apply only to length-only traces"),
    (["synth", "{out}", "--prompt", "gauss:5"], "length spec 'gauss:5'"),
    (["synth", "{out}", "--rate", "-1"], "rate must be a finite number > 0"),
    (["convert", "{bad}", "{bad}"], "{bad}: is the source trace"),        # was: the source overwritten
    (["stats", "{bad}", "--trace-columns", "arrival=t"], "--trace-columns reads a csv, jsonl or parquet log"),
    (["convert", "{bad}", "{out}", "--time-unit", "ms"], "--time-unit reads a csv, jsonl or parquet log"),
])
def test_bad_input_exits_2_with_a_clear_message(tmp_path, args, fragment):
    bad = tmp_path / "bad.csv"
    bad.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.68,5,5\n2023-11-16 18:15:47.1,-2,5\n")
    names = {"bad": bad, "out": tmp_path / "out.parquet", "tmp": tmp_path}
    result = kvsim(*[a.format(**names) for a in args])
    assert result.exit_code == 2
    assert result.stderr.startswith("error: ") and fragment.format(**names) in result.stderr, result.stderr
    assert "Traceback" not in result.output
