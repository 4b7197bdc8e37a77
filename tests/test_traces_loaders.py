"""Loaders: the shipped public traces (figures from traces/data/README.md), each format on small
hand-written files, bad input with file:line messages, and the native format round trip."""
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from kvsim.traces import DATA_DIR, DATA_TRACES, Trace, TraceError, TraceWarning, detect_format, load_trace, trace_stats

SHIPPED = {  # name: (requests, rate, prompt mean/p50/p90/max, output mean/p50/p90/max, prefix repeat share)
    "azure-conv-2023": (19366, 5.53, (1155, 1020, 2734, 14050), (211, 129, 424, 1000), None),
    "azure-code-2023": (8819, 2.57, (2048, 1469, 5188, 7437), (28, 13, 55, 1899), None),
    "mooncake-conversation": (12031, 3.40, (12035, 6909, 27367, 126195), (343, 350, 597, 2000), 0.366),
    "mooncake-synthetic": (3993, None, (15325, 11587, 38611, 191378), (149, 69, 389, 893), 0.640),
    "sharegpt-8k-filtered": (30731, None, (2340, 1730, 5696, 8141), (439, 415, 834, 1024), None),
    "arxiv": (28257, None, (2588, 2730, 3702, 4054), (291, 167, 372, 4056), None),
}


@pytest.fixture(scope="module")
def shipped():
    return {name: load_trace(name) for name in DATA_TRACES}


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def assert_trace_error(path, line, fragment, **kwargs):
    with pytest.raises(TraceError) as info:
        load_trace(path, **kwargs)
    message = str(info.value)
    prefix = f"{path}:{line}: " if line is not None else f"{path}: "
    assert message.startswith(prefix), message
    assert fragment in message, message
    return message


# ---- shipped traces ----------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(SHIPPED))
def test_shipped_trace_matches_published_figures(shipped, name):
    requests, rate, prompt, output, repeat = SHIPPED[name]
    stats = trace_stats(shipped[name])
    assert stats["requests"] == requests
    if rate is not None:
        assert stats["mean_rate_rps"] == pytest.approx(rate, abs=0.005)
    for label, (mean, p50, p90, maximum) in (("prompt", prompt), ("output", output)):
        assert stats[f"{label}_mean"] == pytest.approx(mean, abs=0.5)
        assert stats[f"{label}_p50"] == pytest.approx(p50, abs=0.5)
        assert stats[f"{label}_p90"] == pytest.approx(p90, abs=0.5)
        assert stats[f"{label}_max"] == maximum
    if repeat is None:
        assert stats["prefix_repeat_share"] is None
    else:
        assert stats["prefix_repeat_share"] == pytest.approx(repeat, abs=0.0005)


def test_azure_conv_span_and_code_burstiness(shipped):
    conv, code = trace_stats(shipped["azure-conv-2023"]), trace_stats(shipped["azure-code-2023"])
    assert conv["span_s"] == pytest.approx(3501.72, abs=0.01)
    assert code["interarrival_cv"] == pytest.approx(13.15, abs=0.01)
    # 7 fractional digits: two conv requests arrive 2 microseconds apart and stay distinct
    assert np.diff(shipped["azure-conv-2023"].df["arrival_time_s"].to_numpy()).min() == pytest.approx(2e-6, abs=1e-9)


@pytest.mark.parametrize("name", list(SHIPPED))
def test_shipped_trace_is_canonical(shipped, name):
    trace = shipped[name]
    df = trace.df
    assert list(df.columns) == ["request_id", "arrival_time_s", "prompt_tokens", "output_tokens",
                                "session_id", "prefix_hash_ids", "priority"]
    assert df["request_id"].dtype == np.int64 and df["request_id"].is_unique
    assert df["arrival_time_s"].dtype == np.float64 and df["arrival_time_s"].iloc[0] == 0.0
    assert df["arrival_time_s"].is_monotonic_increasing
    assert (df["prompt_tokens"] >= 1).all() and (df["output_tokens"] >= 1).all()
    assert (df["priority"] == 0).all()
    assert trace.name == name and Path(trace.source).is_file()
    assert trace.num_output_clamped == 0 and trace.num_reordered == 0  # no zero outputs in shipped files


def test_mooncake_keeps_hash_ids_as_512_token_blocks(shipped):
    trace = shipped["mooncake-conversation"]
    assert trace.prefix_block_tokens == 512
    first = trace.df.iloc[0]
    assert first["prompt_tokens"] == 6758 and first["prefix_hash_ids"] == list(range(14))
    blocks = trace.df["prefix_hash_ids"].map(len)
    assert (blocks == -(-trace.df["prompt_tokens"] // 512)).all()


def test_shipped_data_carries_licenses_and_attribution():
    for folder, licenses in (("azure2023", ["LICENSE"]), ("mooncake", ["LICENSE-APACHE"]),
                             ("lengths", ["LICENSE-arxiv-stats", "LICENSE-sharegpt-stats"])):
        for name in licenses:
            assert (DATA_DIR / folder / name).stat().st_size > 1000
    readme = (DATA_DIR / "README.md").read_text()
    assert "CC-BY 4.0" in readme and "kvcache-ai/Mooncake" in readme and "microsoft/vidur" in readme
    for name in DATA_TRACES:
        assert f"`{name}`" in readme


def test_short_names_load_from_any_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert len(load_trace("azure-code-2023")) == 8819


def test_unknown_short_name_lists_the_shipped_ones():
    with pytest.raises(TraceError, match="azure-conv-2023"):
        load_trace("azure-conv-2042")


# ---- length-only traces need an arrival process ---------------------------------------------------
def test_length_only_without_rate_is_a_closed_batch(shipped):
    trace = shipped["sharegpt-8k-filtered"]
    assert (trace.df["arrival_time_s"] == 0).all()
    assert "closed batch" in trace.notices[-1]


def test_length_only_with_rate_is_seeded_poisson(shipped):
    a = load_trace("sharegpt-8k-filtered", rate=2.0, seed=0)
    assert a.df.equals(load_trace("sharegpt-8k-filtered", rate=2.0, seed=0).df)
    assert not a.df.equals(load_trace("sharegpt-8k-filtered", rate=2.0, seed=1).df)
    stats = trace_stats(a)
    assert stats["mean_rate_rps"] == pytest.approx(2.0, rel=0.02)
    assert stats["interarrival_cv"] == pytest.approx(1.0, abs=0.03)
    # lengths stay in file order
    assert a.df["prompt_tokens"].equals(shipped["sharegpt-8k-filtered"].df["prompt_tokens"])


def test_length_only_with_cv_is_bursty():
    stats = trace_stats(load_trace("arxiv", rate=4.0, cv=3.0, seed=0))
    assert stats["interarrival_cv"] == pytest.approx(3.0, rel=0.1)


def test_rate_is_refused_for_traces_with_their_own_arrivals():
    with pytest.raises(TraceError, match="scale_rate"):
        load_trace("azure-conv-2023", rate=2.0)


# ---- each format on small hand-written files -------------------------------------------------------
def test_azure_2024_style_timestamps_with_utc_offset(tmp_path):
    path = write(tmp_path, "a.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n"
                 "2024-05-10 00:00:00.009930+00:00,100,10\n2024-05-10 00:00:01.5+00:00,200,0\n")
    with pytest.warns(TraceWarning, match="0 output tokens"):
        trace = load_trace(path)
    assert trace.df["arrival_time_s"].tolist() == pytest.approx([0.0, 1.49007])
    assert trace.df["output_tokens"].tolist() == [10, 1]
    assert trace.num_output_clamped == 1


def test_vidur_processed_csv(tmp_path):
    path = write(tmp_path, "v.csv", "arrived_at,num_prefill_tokens,num_decode_tokens,extra\n"
                 "10.5,100,20,x\n11.0,300,40,y\n")
    assert detect_format(path) == "vidur"
    trace = load_trace(path)
    assert trace.df["arrival_time_s"].tolist() == [0.0, 0.5]
    assert trace.df["prompt_tokens"].tolist() == [100, 300]


BURSTGPT = ("Timestamp,Session ID,Elapsed time,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
            "5,1001,1.2,ChatGPT,472,18,490,Conversation log\n"
            "7,1001,3.0,GPT-4,1200,0,1200,Conversation log\n"
            "6,,0.8,ChatGPT,35,250,285,API log\n"
            "9,1002,2.0,ChatGPT,800,120,920,Conversation log\n")


def test_burstgpt_csv(tmp_path):
    path = write(tmp_path, "burst.csv", BURSTGPT)
    with pytest.warns(TraceWarning) as record:
        trace = load_trace(path)
    messages = " ".join(str(w.message) for w in record)
    assert "0 output tokens (first at line 3)" in messages and "not sorted" in messages
    df = trace.df
    assert df["arrival_time_s"].tolist() == [0.0, 1.0, 2.0, 4.0]
    assert df["request_id"].tolist() == [0, 2, 1, 3]  # ids follow file rows
    assert df["prompt_tokens"].tolist() == [472, 35, 1200, 800]
    assert df["output_tokens"].tolist() == [18, 250, 1, 120]
    assert df["session_id"].dtype == "Int64" and df["session_id"].isna().tolist() == [False, True, False, False]
    assert trace.num_output_clamped == 1 and trace.num_reordered == 1


def test_burstgpt_model_and_log_type_filters(tmp_path):
    path = write(tmp_path, "burst.csv", BURSTGPT)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TraceWarning)
        assert load_trace(path, model="GPT-4").df["prompt_tokens"].tolist() == [1200]
    assert load_trace(path, model="ChatGPT", log_type="Conversation log").df["prompt_tokens"].tolist() == [472, 800]
    with pytest.raises(TraceError, match="no rows with Model == 'Claude'"):
        load_trace(path, model="Claude")


def test_unsorted_arrivals_are_sorted_stably_and_reported(tmp_path):
    path = write(tmp_path, "m.jsonl", "\n".join([
        '{"timestamp": 2000, "input_length": 10, "output_length": 1}',
        '{"timestamp": 1000, "input_length": 20, "output_length": 2}',
        '{"timestamp": 1000, "input_length": 30, "output_length": 3}',
        '{"timestamp": 3000, "input_length": 40, "output_length": 4}']) + "\n")
    with pytest.warns(TraceWarning, match=r"2 requests arrive before an earlier row \(first at line 2\)"):
        trace = load_trace(path)
    assert trace.df["prompt_tokens"].tolist() == [20, 30, 10, 40]
    assert trace.df["arrival_time_s"].tolist() == [0.0, 0.0, 1.0, 2.0]
    assert trace.num_reordered == 2 and "sorted by arrival time" in trace.notices[0]
    assert trace.prefix_block_tokens is None and trace.df["prefix_hash_ids"].isna().all()


# ---- bad input: file, line, what was expected ---------------------------------------------------------
AZURE_HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"
ROW = "2023-11-16 18:15:46.6805900,374,44\n"


@pytest.mark.parametrize("body, line, fragment", [
    (AZURE_HEADER + ROW + ROW + "2023-11-16 18:15:47.0,1,2,3\n", 4, "malformed row: 4 fields, expected 3"),
    (AZURE_HEADER + ROW + "2023-11-16 18:15:47.0,-5,2\n", 3, "ContextTokens: expected an integer >= 1, got '-5'"),
    (AZURE_HEADER + ROW + "2023-11-16 18:15:47.0,5,12.5\n", 3, "GeneratedTokens: expected an integer >= 0, got '12.5'"),
    (AZURE_HEADER + ROW + "2023-11-16 18:15:47.0,5\n", 3, "GeneratedTokens: expected an integer >= 0, got nothing"),
    (AZURE_HEADER + ROW + "\n" + "16/11/2023 6pm,5,2\n", 4, "TIMESTAMP: expected a timestamp like 2023-11-16"),
    ("TIMESTAMP,ContextTokens\n" + "2023-11-16 18:15:47.0,5\n", 1, "missing column(s) GeneratedTokens"),
    (AZURE_HEADER, 2, "no requests"),
    ("", 1, "empty file"),
    ("\n\n  \n", 1, "empty file"),
    ("time,prompt,output\n1,2,3\n", 1, "is not a known trace format"),
    ("arrived_at,num_prefill_tokens,num_decode_tokens\nsoon,5,5\n", 2, "arrived_at: expected a time in seconds"),
    ("num_prefill_tokens,num_decode_tokens\n5,5\n5,x\n", 3, "num_decode_tokens: expected an integer >= 0, got 'x'"),
    # a first row longer than the header would become an index, shifting every column
    ("arrived_at,num_prefill_tokens,num_decode_tokens\n0,100,20,7\n0.5,5,30,8\n", 2, "malformed row: 4 fields"),
])
def test_bad_csv_files_name_file_line_and_expectation(tmp_path, body, line, fragment):
    assert_trace_error(write(tmp_path, "bad.csv", body), line, fragment)


@pytest.mark.parametrize("body, line, fragment", [
    ('{"timestamp": 0, "input_length": 5, "output_length": 1}\n{"timestamp": 1, "input_length": 5,\n', 2, "invalid JSON"),
    ('{"timestamp": 0, "input_length": 5, "output_length": 1}\n\n{"timestamp": 1, "output_length": 1}\n', 3,
     "missing key 'input_length'"),
    ('{"timestamp": 0, "input_length": 5, "output_length": -1}\n', 1, "output_length: expected an integer >= 0, got -1"),
    ('{"timestamp": 0, "input_length": 5.5, "output_length": 1}\n', 1, "input_length: expected an integer >= 1, got 5.5"),
    ('{"timestamp": "noon", "input_length": 5, "output_length": 1}\n', 1, "timestamp: expected milliseconds"),
    ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [0, "a"]}\n', 1,
     "hash_ids: expected a list of integer block ids"),
    ('{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [0, 1, 2]}\n', 1,
     "3 block ids for a 600-token prompt; expected at most 2"),
    ('{"timestamp": 0, "input_length": 5, "output_length": 1}\n[1, 2]\n', 2, "expected a JSON object, got list"),
    ('{"prompt": "hi"}\n', 1, "none of the keys of a known trace"),
    ('{"kvsim_trace": {"version": 1}}\n{"arrival_time_s": 0.0, "prompt_tokens": 5, "output_tokens": 1, '
     '"prefix_hash_ids": [1]}\n', 1, "prefix_block_tokens is nothing"),
    ('{"request_id": 3, "arrival_time_s": 0.0, "prompt_tokens": 5, "output_tokens": 1}\n'
     '{"request_id": 3, "arrival_time_s": 1.0, "prompt_tokens": 5, "output_tokens": 1}\n', 2, "request_id: 3 is used twice"),
])
def test_bad_jsonl_files_name_file_line_and_expectation(tmp_path, body, line, fragment):
    assert_trace_error(write(tmp_path, "bad.jsonl", body), line, fragment)


def test_binary_file_is_an_unknown_format(tmp_path):
    path = tmp_path / "blob.bin"
    path.write_bytes(bytes(range(256)) * 4)
    assert_trace_error(path, 1, "not a text or Parquet file")


def test_forced_unknown_format_is_refused(tmp_path):
    assert_trace_error(write(tmp_path, "x.csv", AZURE_HEADER + ROW), None, "unknown format 'openai'", format="openai")
    # a known format forced on the wrong file: that format's reader says what it expected
    assert_trace_error(write(tmp_path, "y.csv", AZURE_HEADER + ROW), 1, "expected a ShareGPT JSON list", format="sharegpt")


def test_bad_parquet_rows_name_the_row(tmp_path):
    path = tmp_path / "bad.parquet"
    pd.DataFrame({"arrival_time_s": [0.0, 1.0], "prompt_tokens": [5, 0], "output_tokens": [1, 1]}).to_parquet(path)
    assert_trace_error(path, None, "row 1: prompt_tokens: expected an integer >= 1, got 0")
    pd.DataFrame({"arrival_time_s": [0.0], "output_tokens": [1]}).to_parquet(path)
    assert_trace_error(path, None, "missing column(s) prompt_tokens")


# ---- native format ---------------------------------------------------------------------------
@pytest.mark.parametrize("suffix", [".parquet", ".jsonl"])
def test_native_round_trip_is_identical(shipped, tmp_path, suffix):
    original = shipped["mooncake-conversation"].window(100.0, 400.0).clip(16384)
    original.df.loc[[0, 3], "priority"] = [2, -1]
    path = original.save(tmp_path / f"trace{suffix}")
    assert detect_format(path) == f"native-{suffix[1:]}"
    back = load_trace(path)
    pd.testing.assert_frame_equal(back.df, original.df)
    assert back.df["prefix_hash_ids"].iloc[0] == original.df["prefix_hash_ids"].iloc[0]
    assert isinstance(back.df["prefix_hash_ids"].iloc[0], list)
    assert (back.name, back.prefix_block_tokens, back.num_clipped) == ("mooncake-conversation", 512, original.num_clipped)
    assert back.source == str(path)


@pytest.mark.parametrize("suffix", [".parquet", ".jsonl"])
def test_native_round_trip_keeps_session_ids(tmp_path, suffix):
    for sessions in (pd.array([7, pd.NA, 7], dtype="Int64"), pd.Series(["alice", None, "bob"], dtype=object)):
        trace = Trace.from_columns(arrival_time_s=[0.0, 0.5, 0.5], prompt_tokens=[3, 4, 5], output_tokens=[1, 1, 2],
                                   session_id=sessions, name="s")
        back = load_trace(trace.save(tmp_path / f"s{suffix}"))
        pd.testing.assert_frame_equal(back.df, trace.df)


def test_native_jsonl_written_by_hand_needs_no_metadata(tmp_path):
    path = write(tmp_path, "mine.jsonl", '{"arrival_time_s": 1.5, "prompt_tokens": 10, "output_tokens": 3, "priority": 1}\n'
                                         '{"arrival_time_s": 2.0, "prompt_tokens": 20, "output_tokens": 4}\n')
    trace = load_trace(path)
    assert trace.df["arrival_time_s"].tolist() == [1.5, 2.0]  # native times are kept as written
    assert trace.df["priority"].tolist() == [1, 0] and trace.df["request_id"].tolist() == [0, 1]
    assert trace.name == "mine"


def test_native_csv_without_prefix_ids(tmp_path):
    path = write(tmp_path, "mine.csv", "request_id,arrival_time_s,prompt_tokens,output_tokens,session_id\n"
                                       "10,0.0,10,3,a\n11,0.25,20,4,\n")
    df = load_trace(path).df
    assert df["request_id"].tolist() == [10, 11] and df["session_id"].tolist() == ["a", None]


def test_save_refuses_unknown_extension(shipped, tmp_path):
    with pytest.raises(TraceError, match="expected .parquet or .jsonl"):
        shipped["arxiv"].save(tmp_path / "x.csv")


def test_loaders_are_fast(shipped):
    import time

    start = time.perf_counter()
    load_trace("azure-conv-2023")
    assert time.perf_counter() - start < 1.0
