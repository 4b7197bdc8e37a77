"""StepLog: rows appended one step at a time or as decode-run columns, in typed buffers, read back
as numpy converts them; a value a typed buffer refuses falls back to lists with the same table."""
import math

import numpy as np
import pyarrow.parquet as pq

from kvsim.sim.results.metrics import STEP_COLUMNS, STEP_DEFAULTS, StepLog


def row(i: int, **over) -> dict:
    r = {name: (float(i) + 0.25 if name in ("time_s", "duration_s", "fragmentation") else i)
         for name in STEP_COLUMNS if name not in STEP_DEFAULTS}
    r.update(over)
    return r


def fill(log: StepLog, odd: dict | None = None) -> None:
    for i in range(5):
        log.append(row(i))
    cols = {name: [v] * 3 for name, v in row(5).items()}
    cols["step"] = range(5, 8)
    cols["time_s"] = np.array([5.5, 6.5, 7.5])
    cols["kv_tokens_read"] = np.array([50, 60, 70])       # int64: copied as the buffer's own bytes
    cols["predicted_s"] = 1.5                     # a scalar repeated over the run
    cols["batch_size"] = cols["num_decode_seqs"] = cols["duration_s"] = [5, 6, 7]   # one list, both types
    log.append_columns(cols, 3)
    log.append(row(8, **(odd or {})))
    for i in range(9, 300):
        log.append(row(i))


def test_rows_and_runs_come_back_in_order_with_defaults(tmp_path):
    log = StepLog(tmp_path / "steps.parquet", flush_rows=64)
    fill(log)
    log.close()
    t = pq.read_table(tmp_path / "steps.parquet")
    assert t.schema.field("num_running").type.bit_width == 32
    assert t.column("step").to_pylist() == list(range(300))
    assert t.column("time_s").to_pylist()[4:9] == [4.25, 5.5, 6.5, 7.5, 8.25]
    assert t.column("predicted_s").to_pylist()[4:9][1:4] == [1.5] * 3
    assert math.isnan(t.column("predicted_s").to_pylist()[0])          # default
    assert t.column("bytes_moved").to_pylist()[:3] == [0, 0, 0]
    assert t.column("num_decode_seqs").to_pylist()[4:9] == [4, 5, 6, 7, 8] == t.column("batch_size").to_pylist()[4:9]
    assert t.column("duration_s").to_pylist()[4:9] == [4.25, 5.0, 6.0, 7.0, 8.25]
    assert t.column("kv_tokens_read").to_pylist()[4:9] == [4, 50, 60, 70, 8]
    assert [g.num_rows for g in (pq.ParquetFile(tmp_path / "steps.parquet").metadata.row_group(i)
                                 for i in range(5))] == [64, 64, 64, 64, 44]


def test_a_float_in_an_integer_column_gives_numpy_conversion(tmp_path):
    """A float where an integer column is typed (a backend's count as float) is truncated as
    np.asarray(..., int64) truncates, before and after the switch to lists."""
    typed, odd = StepLog(None, flush_rows=64), StepLog(None, flush_rows=64)
    fill(typed)
    fill(odd, {"kv_tokens_read": 8.75, "batch_size": np.float64(8.0)})
    a, b = typed.to_pandas(), odd.to_pandas()
    assert typed._typed and not odd._typed          # the second one took the fallback
    assert b["kv_tokens_read"].tolist()[8] == 8 and b["batch_size"].tolist()[8] == 8
    assert a.equals(b)


def test_kept_columns_equal_the_file_read_back(tmp_path):
    """The run summary reads its step columns from the log's copies instead of the file: the same
    frame, rows in the file's order (by replica, then step, within each row group)."""
    import pandas as pd
    keep = ("duration_s", "blocks_used", "batch_size", "preemptions")
    log = StepLog(tmp_path / "steps.parquet", flush_rows=64, keep=keep, keep_rows=1000)
    for i in range(150):                                  # two replicas interleaved
        log.append(row(i // 2, replica=i % 2, duration_s=0.5 * i, preemptions=i % 3))
    log.close()
    kept = log.kept()
    assert kept["duration_s"].tolist()[:3] == [0.0, 1.0, 2.0]            # replica 0 first in a group
    pd.testing.assert_frame_equal(kept, pd.read_parquet(tmp_path / "steps.parquet", columns=list(keep)))
    small = StepLog(tmp_path / "small.parquet", flush_rows=64, keep=keep, keep_rows=100)
    fill(small)
    small.close()
    assert small.kept() is None                            # over keep_rows: read the file instead
