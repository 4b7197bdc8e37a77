"""Synthetic generators (statistics match their parameters, seeds reproduce) and trace transforms."""
import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings, strategies as st

from kvsim.traces import Trace, TraceError, load_trace, trace_stats
from kvsim.traces.arrivals import gamma_arrivals, poisson_arrivals
from kvsim.traces.synthetic import Fixed, LogNormal, Uniform, closed_batch, parse_length_spec, synthesize

N = 200_000


def gap_cv(times):
    gaps = np.diff(times)
    return gaps.std() / gaps.mean()


# ---- arrival processes -----------------------------------------------------------------------------
def test_poisson_arrivals_have_the_rate_and_unit_cv():
    times = poisson_arrivals(N, rate=5.0, seed=0)
    assert times[0] == 0.0 and np.all(np.diff(times) >= 0)
    assert (N - 1) / times[-1] == pytest.approx(5.0, rel=0.01)
    assert gap_cv(times) == pytest.approx(1.0, rel=0.01)


@pytest.mark.parametrize("cv", [0.5, 2.0, 4.0])
def test_gamma_arrivals_have_the_rate_and_cv(cv):
    times = gamma_arrivals(N, rate=3.0, cv=cv, seed=1)
    assert (N - 1) / times[-1] == pytest.approx(3.0, rel=0.03)
    assert gap_cv(times) == pytest.approx(cv, rel=0.05)


def test_arrivals_are_reproducible_per_seed():
    assert np.array_equal(gamma_arrivals(1000, 2.0, 3.0, seed=7), gamma_arrivals(1000, 2.0, 3.0, seed=7))
    assert not np.array_equal(poisson_arrivals(1000, 2.0, seed=7), poisson_arrivals(1000, 2.0, seed=8))


@pytest.mark.parametrize("call, fragment", [
    (lambda: poisson_arrivals(10, rate=0.0), "rate must be a finite number > 0"),
    (lambda: gamma_arrivals(10, rate=1.0, cv=-1.0), "cv must be a finite number > 0"),
    (lambda: poisson_arrivals(0, rate=1.0), "number of requests must be an integer >= 1"),
    (lambda: synthesize(10, cv=2.0), "cv needs a rate"),
])
def test_bad_generator_parameters_are_explained(call, fragment):
    with pytest.raises(TraceError, match=fragment):
        call()


# ---- length distributions ----------------------------------------------------------------------------
def test_lognormal_lengths_have_the_mean_and_cv():
    values = LogNormal(1000, 0.8).draw(N, np.random.default_rng(0))
    assert values.dtype == np.int64 and values.min() >= 1
    assert values.mean() == pytest.approx(1000, rel=0.01)
    assert values.std() / values.mean() == pytest.approx(0.8, rel=0.03)
    assert LogNormal(1000, 2.0, max_tokens=4096).draw(N, np.random.default_rng(0)).max() == 4096


def test_uniform_and_fixed_lengths():
    values = Uniform(64, 512).draw(N, np.random.default_rng(0))
    assert values.min() == 64 and values.max() == 512
    assert values.mean() == pytest.approx(288, rel=0.01)
    assert set(Fixed(128).draw(100, np.random.default_rng(0))) == {128}


@pytest.mark.parametrize("spec, expected", [
    ("fixed:128", Fixed(128)), ("256", Fixed(256)), (64, Fixed(64)), ("uniform:1,10", Uniform(1, 10)),
    ("lognormal:1000,0.5", LogNormal(1000.0, 0.5)), ("lognormal:1000,0.5,8192", LogNormal(1000.0, 0.5, 8192)),
])
def test_length_specs_parse(spec, expected):
    assert parse_length_spec(spec) == expected


@pytest.mark.parametrize("spec", ["normal:5,1", "uniform:10", "uniform:10,1", "fixed:0", "lognormal:a,b", "fixed:-3"])
def test_bad_length_specs_are_explained(spec):
    with pytest.raises(TraceError, match="length|uniform|fixed"):
        parse_length_spec(spec)


# ---- workloads -----------------------------------------------------------------------------------------
def test_synthesize_matches_parameters_and_reproduces():
    trace = synthesize(50_000, rate=10.0, cv=2.0, prompt="lognormal:2000,1.0", output="uniform:1,100", seed=3)
    stats = trace_stats(trace)
    assert stats["requests"] == 50_000
    assert stats["mean_rate_rps"] == pytest.approx(10.0, rel=0.05)
    assert stats["interarrival_cv"] == pytest.approx(2.0, rel=0.05)
    assert stats["prompt_mean"] == pytest.approx(2000, rel=0.03)
    assert stats["output_mean"] == pytest.approx(50.5, rel=0.02) and stats["output_max"] == 100
    again = synthesize(50_000, rate=10.0, cv=2.0, prompt="lognormal:2000,1.0", output="uniform:1,100", seed=3)
    pd.testing.assert_frame_equal(trace.df, again.df)


def test_synthesize_streams_are_independent():
    a = synthesize(1000, rate=1.0, prompt="lognormal:500,1.0", output="fixed:10", seed=0).df
    b = synthesize(1000, rate=1.0, prompt="lognormal:500,1.0", output="lognormal:100,2.0", seed=0).df
    assert a["arrival_time_s"].equals(b["arrival_time_s"]) and a["prompt_tokens"].equals(b["prompt_tokens"])
    assert not a["output_tokens"].equals(b["output_tokens"])


def test_synthesize_resamples_joint_lengths_from_a_trace():
    pool = load_trace("sharegpt-8k-filtered").df
    pairs = set(zip(pool["prompt_tokens"], pool["output_tokens"], strict=True))
    trace = synthesize(2000, rate=4.0, lengths="sharegpt-8k-filtered", seed=5)
    assert all(pair in pairs for pair in zip(trace.df["prompt_tokens"], trace.df["output_tokens"], strict=True))
    assert trace_stats(trace)["prompt_mean"] == pytest.approx(2340, rel=0.05)


def test_closed_batch_all_arrive_at_zero():
    trace = closed_batch(64, prompt_tokens=512, output_tokens=128)
    df = trace.df
    assert len(trace) == 64 and (df["arrival_time_s"] == 0).all()
    assert (df["prompt_tokens"] == 512).all() and (df["output_tokens"] == 128).all()
    assert df["request_id"].tolist() == list(range(64)) and trace.name == "batch-64x512+128"
    assert trace_stats(trace)["mean_rate_rps"] is None


def test_synthesize_without_rate_is_a_closed_batch():
    assert (synthesize(100, prompt=32, output=8).df["arrival_time_s"] == 0).all()


# ---- transforms ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def mooncake():
    return load_trace("mooncake-conversation")


def test_window_keeps_half_open_interval_and_shifts(mooncake):
    arrivals = mooncake.df["arrival_time_s"]
    part = mooncake.window(600.0, 1200.0)
    expected = mooncake.df[(arrivals >= 600) & (arrivals < 1200)]
    assert len(part) == len(expected) > 0
    assert part.df["request_id"].tolist() == expected["request_id"].tolist()
    assert part.df["arrival_time_s"].min() >= 0 and part.df["arrival_time_s"].max() < 600
    assert mooncake.window(600.0, 1200.0, shift=False).df["arrival_time_s"].min() >= 600
    with pytest.raises(TraceError, match="end_s"):
        mooncake.window(5.0, 5.0)


@pytest.mark.parametrize("factor", [0.5, 2.0, 4.0])
def test_scale_rate_multiplies_the_rate(mooncake, factor):
    scaled = mooncake.scale_rate(factor)
    assert trace_stats(scaled)["mean_rate_rps"] == pytest.approx(trace_stats(mooncake)["mean_rate_rps"] * factor)
    assert scaled.df["prompt_tokens"].equals(mooncake.df["prompt_tokens"])
    with pytest.raises(TraceError, match="factor"):
        mooncake.scale_rate(0)


def test_head_and_sample(mooncake):
    assert mooncake.head(10).df["request_id"].tolist() == mooncake.df["request_id"].tolist()[:10]
    a, b = mooncake.sample(500, seed=1), mooncake.sample(500, seed=1)
    pd.testing.assert_frame_equal(a.df, b.df)
    assert not a.df["request_id"].equals(mooncake.sample(500, seed=2).df["request_id"])
    assert a.df["request_id"].is_unique and a.df["arrival_time_s"].is_monotonic_increasing
    assert set(a.df["request_id"]) <= set(mooncake.df["request_id"])
    with pytest.raises(TraceError, match="between 0 and"):
        mooncake.sample(len(mooncake) + 1)


def test_clip_fits_max_model_len_and_counts(mooncake):
    clipped = mooncake.clip(8192)
    df, original = clipped.df, mooncake.df
    assert ((df["prompt_tokens"] + df["output_tokens"]) <= 8192).all()
    too_long = (original["prompt_tokens"] + original["output_tokens"]) > 8192
    assert clipped.num_clipped == int(too_long.sum()) > 0
    assert df[~too_long.to_numpy()]["prompt_tokens"].equals(original[~too_long]["prompt_tokens"])
    assert (df["prefix_hash_ids"].map(len) <= -(-df["prompt_tokens"] // 512)).all()
    assert clipped.clip(4096).num_clipped > clipped.num_clipped  # counts accumulate
    assert mooncake.num_clipped == 0  # transforms return new traces


@settings(max_examples=40, deadline=None)
@given(lengths=st.lists(st.tuples(st.integers(1, 5000), st.integers(1, 5000)), min_size=1, max_size=30),
       max_model_len=st.integers(2, 6000))
def test_clip_invariants(lengths, max_model_len):
    prompt, output = map(np.array, zip(*lengths, strict=True))
    trace = Trace.from_columns(arrival_time_s=np.zeros(len(prompt)), prompt_tokens=prompt, output_tokens=output)
    df = trace.clip(max_model_len).df
    fits = prompt + output <= max_model_len
    assert ((df["prompt_tokens"] + df["output_tokens"]) <= max_model_len).all()
    assert (df["output_tokens"] >= 1).all()
    assert (df["prompt_tokens"].to_numpy()[fits] == prompt[fits]).all()
    assert (df["output_tokens"].to_numpy()[fits] == output[fits]).all()
    assert (df["prompt_tokens"].to_numpy() == np.minimum(prompt, max_model_len - 1)).all()


def test_concat_sequential_and_overlay(mooncake):
    a, b = mooncake.head(100), mooncake.window(1000, 2000).head(50)
    joined = Trace.concat([a, b])
    df = joined.df
    assert len(joined) == 150 and df["request_id"].tolist() == list(range(150))
    assert df["arrival_time_s"].is_monotonic_increasing
    assert df["arrival_time_s"].iloc[100] == pytest.approx(a.df["arrival_time_s"].iloc[-1])
    assert joined.prefix_block_tokens == 512
    ids_a = {h for ids in df["prefix_hash_ids"].iloc[:100] for h in ids}
    ids_b = {h for ids in df["prefix_hash_ids"].iloc[100:] for h in ids}
    assert not ids_a & ids_b  # block ids of different traces never alias
    overlay = Trace.concat([a, b], how="overlay")
    assert sorted(overlay.df["arrival_time_s"]) == sorted(list(a.df["arrival_time_s"]) + list(b.df["arrival_time_s"]))


def test_concat_refuses_different_block_sizes(mooncake):
    other = Trace(mooncake.head(5).df, prefix_block_tokens=16)
    with pytest.raises(TraceError, match="different prefix block sizes"):
        Trace.concat([mooncake.head(5), other])


def test_trace_refuses_non_canonical_frames():
    with pytest.raises(TraceError, match="non-decreasing"):
        Trace.from_columns(arrival_time_s=[1.0, 0.5], prompt_tokens=[1, 1], output_tokens=[1, 1])
    with pytest.raises(TraceError, match="output_tokens must be >= 1"):
        Trace.from_columns(arrival_time_s=[0.0], prompt_tokens=[1], output_tokens=[0])
    with pytest.raises(TraceError, match="without prefix_block_tokens"):
        Trace.from_columns(arrival_time_s=[0.0], prompt_tokens=[1], output_tokens=[1], prefix_hash_ids=[[3]])
    with pytest.raises(TraceError, match="request_id must be unique"):
        Trace.from_columns(arrival_time_s=[0.0, 1.0], prompt_tokens=[1, 1], output_tokens=[1, 1], request_id=[4, 4])


def test_prefix_repeat_share_counts_blocks_seen_before():
    trace = Trace.from_columns(arrival_time_s=[0.0, 1.0, 2.0], prompt_tokens=[32, 32, 16], output_tokens=[1, 1, 1],
                               prefix_hash_ids=[[1, 2], [1, 3], [1]], prefix_block_tokens=16)
    assert trace_stats(trace)["prefix_repeat_share"] == pytest.approx(2 / 5)
