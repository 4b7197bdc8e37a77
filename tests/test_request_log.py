"""Requests streamed to requests.parquet as they finish (sim/results/request_log.py): the same table and summary
as a run kept whole, exact quantiles of the compacted inter-token gaps, partial results on Ctrl-C."""
from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from kvsim.sim.results import metrics, request_log
from kvsim.sim.simulator import simulate
from kvsim.sim.config import load_config
from kvsim.sim.results.metrics import inter_token_latencies, summarize
from kvsim.sim.results.request_log import ValueCounts, step_figures_from_file, token_stats


@pytest.mark.parametrize("seed", range(6))
def test_compacted_quantiles_equal_numpys(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 3000))
    values = rng.choice(rng.random(int(rng.integers(1, 50))) * 0.05, size=n)
    dist = ValueCounts(raw_limit=int(rng.integers(0, 200)))
    for part in np.array_split(values, 7):
        dist.add(part)
    assert dist.compacted and dist.size == n
    qs = (0, 1, 10, 33.3, 50, 90, 99, 99.9, 100)
    assert dist.percentile(qs).tolist() == np.percentile(values, qs).tolist()       # bit for bit
    for q in qs:
        assert float(dist.percentile(q)) == float(np.percentile(values, q))
    assert dist.median() == float(np.median(values))
    assert dist.mean() == pytest.approx(float(np.mean(values)), rel=1e-14)
    assert dist.std() == pytest.approx(float(np.std(values)), rel=1e-12, abs=1e-18)


def test_raw_distribution_is_numpys():
    values = np.random.default_rng(1).random(1000)
    dist = ValueCounts()
    dist.add(values[:400])
    dist.add(values[400:])
    assert not dist.compacted
    assert (dist.mean(), dist.std(), dist.median()) == (np.mean(values), np.std(values), np.median(values))


def test_token_figures_computed_once_are_numpys_in_any_order():
    """The summary computes the token times' figures once (`token_stats`) for both of its summaries:
    the same bits as numpy on the pooled gaps, whichever statistic is asked first."""
    rng = np.random.default_rng(3)
    lists = [np.cumsum(rng.random(int(k)) * 0.05) + s for k, s in zip(rng.integers(0, 40, 300), rng.random(300) * 9)]
    gaps = inter_token_latencies(lists)
    stats = token_stats(lists, 0.0)
    qs = (50, 90, 99)
    assert stats.itl.percentile(qs).tolist() == np.percentile(gaps, qs).tolist()        # reorders in place
    assert (stats.itl.size, stats.itl.mean(), stats.itl.std()) == (gaps.size, np.mean(gaps), np.std(gaps))
    assert stats.itl.median() == np.median(gaps) and float(stats.itl.percentile(99.9)) == np.percentile(gaps, 99.9)
    assert stats.peak_tokens_per_s == np.bincount(np.concatenate(lists).astype(np.int64)).max()


def _cfg(n=1500):
    return load_config(None, {"trace": "azure-conv-2023", "model": "llama-3.1-8b", "gpu": "h100",
                              "trace_options": {"max_requests": n}})


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(request_log, "CHUNK_ROWS", 100)
    monkeypatch.setattr(simulate, "WHOLE_STEP_LOG_ROWS", 500)


def test_streamed_run_writes_the_same_table_and_summary(tmp_path, monkeypatch):
    whole = simulate.run_simulation(_cfg(), tmp_path / "whole", keep_steps=False)
    monkeypatch.setattr(request_log, "CHUNK_ROWS", 100)
    streamed = simulate.run_simulation(_cfg(), tmp_path / "streamed", keep_steps=False)
    meta = pq.ParquetFile(tmp_path / "streamed" / "requests.parquet").metadata
    assert meta.num_row_groups > 3 and meta.num_rows == 1500       # written as the run went
    a = pq.read_table(tmp_path / "whole" / "requests.parquet")
    b = pq.read_table(tmp_path / "streamed" / "requests.parquet")
    assert a.schema.equals(b.schema, check_metadata=False)         # one schema (reject_reason a string column)
    assert a.schema.field("reject_reason").type == pa.large_string()
    for name in a.column_names:
        assert a.column(name).equals(b.column(name)), name
    assert "token_times_s" not in streamed.requests                # the table in memory has no token lists
    sa, sb = dict(whole.summary), dict(streamed.summary)
    sa.pop("wall_s"), sb.pop("wall_s")
    assert sa == sb
    assert json.loads((tmp_path / "streamed" / "summary.json").read_text())["num_finished"] == 1500


def test_step_figures_from_file_match_the_whole_columns(tmp_path):
    run = simulate.run_simulation(_cfg(400), tmp_path / "r")
    whole = summarize(run.requests, run.steps, num_blocks_total=run.num_gpu_blocks)
    figures = step_figures_from_file(tmp_path / "r" / "steps.parquet", run.num_gpu_blocks)
    for key in ("num_steps", "kv_util_max", "fragmentation_p99", "preemptions"):
        assert figures[key] == whole[key]
    for key in ("kv_util_mean", "fragmentation_mean", "batch_size_mean"):
        assert figures[key] == pytest.approx(whole[key], rel=1e-12)


def test_interrupted_streamed_run_keeps_consistent_partial_results(tmp_path, small_chunks):
    def stop(p):
        if p.requests_done >= 700 and not p.finished:
            raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        simulate.run_simulation(_cfg(), tmp_path / "r", keep_steps=False, progress=stop)
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    table = pq.read_table(tmp_path / "r" / "requests.parquet").to_pandas()
    assert summary["partial"] and pq.ParquetFile(tmp_path / "r" / "requests.parquet").metadata.num_row_groups >= 2
    ids = table["request_id"].to_numpy()
    assert (np.diff(ids) > 0).all() and len(table) == summary["num_requests"] < 1500
    assert summary["num_finished"] == (table["status"] == "finished").sum() >= 700
    unfinished = table[table["status"] != "finished"]
    assert len(unfinished) == summary["num_unfinished"]
    done = table[table["status"] == "finished"]
    assert (done["token_times_s"].map(len) == done["output_tokens"]).all()


def test_peak_tokens_per_s_in_slices_counts_as_the_whole_buffer(monkeypatch):
    """Counted slice by slice (bounded temporaries), the busiest second is the whole buffer's: buckets
    truncated toward zero from the start (times less than a second before it count in second 0), times
    earlier left out, a second's tokens split across slices added up."""
    rng = np.random.default_rng(7)
    times = np.sort(rng.uniform(-3.0, 40.0, 5000)) + 100.0
    buckets = (times - 100.25).astype(np.int64)
    whole = float(np.bincount(buckets[buckets >= 0]).max())
    for size in (1, 7, 64, 4999, 1 << 16):
        monkeypatch.setattr(request_log, "PEAK_SLICE", size)
        assert request_log.peak_tokens_per_s(times, 100.25) == whole
    assert request_log.peak_tokens_per_s(times[:10], 1e6) == 0.0          # all before the start
    assert request_log.peak_tokens_per_s(np.array([]), 0.0) == 0.0


def test_gaps_computed_in_the_buffer_itself_are_np_diffs(monkeypatch):
    """The token figures take the gaps in the flat token buffer's own memory, slice by slice: the same
    gaps as np.diff without each list's first (lists of 0, 1 or many values, slices cut anywhere), and
    the input left untouched when it may not be overwritten."""
    rng = np.random.default_rng(11)
    lists = [np.cumsum(rng.random(int(k))) for k in rng.integers(0, 6, 400)] + [np.array([]), np.array([2.0])]
    offsets, times = metrics.flat_token_times(lists)
    expected = np.concatenate([np.diff(t) for t in lists])
    kept = times.copy()
    assert metrics.list_gaps(offsets, times).tobytes() == expected.tobytes() and (times == kept).all()
    for size in (1, 2, 5, 64, 1 << 16):
        monkeypatch.setattr(metrics, "GAPS_SLICE", size)
        assert metrics.list_gaps(offsets, kept.copy(), overwrite=True).tobytes() == expected.tobytes()
