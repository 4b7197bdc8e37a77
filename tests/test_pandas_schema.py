"""The pandas schema metadata built without pandas (sim/results/pandas_schema.py, issue 49's start-up) equals the
metadata pandas/pyarrow write: column type by column type, and on a run's requests.parquet, whose bytes a
table rebuilt from plain Arrow columns with it reproduces."""
import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from kvsim.sim.cli import app
from kvsim.sim.results.pandas_schema import (PandasColumn, PandasSchemaError, arrow_table, numpy_column,
                                             pandas_metadata, pandas_version, with_pandas_metadata)


def pandas_own(df: pd.DataFrame) -> bytes:
    return pa.Table.from_pandas(df, preserve_index=False).schema.metadata[b"pandas"]


def test_version_is_pandas_own():
    assert pandas_version() == pd.__version__


@pytest.mark.parametrize("values", [
    np.arange(3, dtype=np.int64), np.arange(3, dtype=np.int32), np.arange(3, dtype=np.uint8),
    np.array([0.5, np.nan, 2.0]), np.array([1.0, 2.0, 3.0], dtype=np.float32), np.array([True, False, True]),
    ["finished", "rejected", "finished"], [None, None, None]])
def test_one_column_matches_pandas(values):
    df = pd.DataFrame({"col": values})
    table = pa.Table.from_pandas(df, preserve_index=False)
    all_null = all(v is None for v in values) if isinstance(values, list) else False
    arrow_type, dtype = numpy_column(table.schema.field("col").type, all_null=all_null)
    assert dtype == str(df["col"].dtype)
    assert pandas_metadata([PandasColumn("col", arrow_type, dtype)]) == pandas_own(df)


def test_several_columns_keep_their_order():
    df = pd.DataFrame({"b": [1, 2], "a": ["x", "y"], "c": [0.1, 0.2]})
    table = pa.Table.from_pandas(df, preserve_index=False).replace_schema_metadata(None)
    rebuilt = with_pandas_metadata(table, {n: numpy_column(table.schema.field(n).type)[1] for n in "bac"})
    assert rebuilt.schema.metadata[b"pandas"] == pandas_own(df)


def test_list_column_and_unreproduced_types():
    df = pd.DataFrame({"v": [np.array([1.0]), np.array([2.0, 3.0])]})
    assert pandas_metadata([PandasColumn("v", pa.list_(pa.float64()), "object")]) == pandas_own(df)
    with pytest.raises(PandasSchemaError, match="dictionary"):
        pandas_metadata([PandasColumn("c", pa.dictionary(pa.int8(), pa.string()), "category")])
    with pytest.raises(PandasSchemaError, match="expected a numeric or string column"):
        numpy_column(pa.list_(pa.float64()))


def test_requests_parquet_rebuilt_without_pandas_is_byte_identical(tmp_path):
    out = tmp_path / "run"
    result = CliRunner().invoke(app, ["simulate", "--trace", "azure-conv-2023", "--max-requests", "60", "--model",
                                      "llama-3.1-8b", "--gpu", "h100", "-q", "--out", str(out)])
    assert result.exit_code == 0, result.output
    written = pq.read_table(out / "requests.parquet")
    # the columns as plain Arrow arrays, the token times rebuilt as requests_arrow builds them
    tokens = written.column("token_times_s").combine_chunks()
    columns = {n: written.column(n).combine_chunks() for n in written.column_names if n != "token_times_s"}
    columns["token_times_s"] = pa.ListArray.from_arrays(tokens.offsets, tokens.values)
    table = pa.table(columns)
    assert table.schema.metadata is None
    dtypes, types = {}, {}
    for name in written.column_names[:-1]:
        # a string column of None only was an object column (Arrow's null type; a float column of NaN stays float)
        kind = table.schema.field(name).type
        empty = pa.types.is_large_string(kind) and table.column(name).null_count == len(table)
        types[name], dtypes[name] = numpy_column(kind, all_null=empty)
    rebuilt = with_pandas_metadata(table, dtypes, types, described=written.column_names[:-1])
    pq.write_table(rebuilt, tmp_path / "rebuilt.parquet", use_dictionary=False)
    assert (tmp_path / "rebuilt.parquet").read_bytes() == (out / "requests.parquet").read_bytes()


def test_arrow_table_equals_from_pandas():
    df = pd.DataFrame({"request_id": np.arange(4, dtype=np.int64), "replica": np.zeros(4, dtype=np.int32),
                       "status": ["finished", "rejected", None, "finished"], "reject_reason": [None] * 4,
                       "ttft_s": [0.1, np.nan, 0.3, 0.4], "flag": [True, False, True, True]})
    expected = pa.Table.from_pandas(df, preserve_index=False)
    table = arrow_table({n: df[n].to_numpy() for n in df.columns}, {n: str(df[n].dtype) for n in df.columns})
    assert table.equals(expected, check_metadata=True)
    assert table.column("ttft_s").null_count == 1 and table.column("status").null_count == 1


def test_arrow_table_leaves_other_columns_to_pandas():
    labels = pd.Series(["a", "b"]).astype(object)             # the source's request labels: an object column
    with pytest.raises(PandasSchemaError, match="column request_label: dtype object"):
        arrow_table({"request_label": labels.to_numpy()}, {"request_label": str(labels.dtype)})
    with pytest.raises(PandasSchemaError, match="dtype Int64"):
        arrow_table({"session": pd.array([1, None], dtype="Int64")}, {"session": "Int64"})


def test_version_without_pandas_imported():
    import subprocess
    import sys
    code = ("import sys\nfrom kvsim.sim.results.pandas_schema import pandas_version\nv = pandas_version()\n"
            "print(v, 'pandas' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == [pd.__version__, "False"]
