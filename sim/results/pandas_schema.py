"""The `pandas` key of an Arrow schema's metadata, built without importing pandas (issue 49's start-up).

requests.parquet has always been written from a pandas DataFrame (`pa.Table.from_pandas(df,
preserve_index=False)`), which stores a JSON description of the frame under the schema metadata's `pandas` key:
each column's name, its logical type (from its Arrow type) and its pandas dtype, the pyarrow and pandas
versions. A run path that builds the table from numpy/pyarrow columns directly must write the same bytes for
the file to stay byte-identical. This module builds that JSON the way pyarrow's `pandas_compat.construct_metadata`
does for `preserve_index=False` and empty `DataFrame.attrs` (same keys, same order, `json.dumps` defaults);
tests/test_pandas_schema.py checks it against pandas' own, column type by column type, and on a run's
requests.parquet.

The pandas version comes from the installed distribution's metadata (importlib.metadata: no pandas import),
the value `pandas.__version__` reports.
"""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from functools import cache
from typing import Any
from importlib.metadata import PackageNotFoundError, version

import pyarrow as pa

# pyarrow's pandas_compat.get_logical_type_map: the logical type written for an Arrow type id; any other
# (large_string, large_binary, struct...) is 'object', lists are 'list[<value type>]'
_LOGICAL = {pa.null(): "empty", pa.bool_(): "bool", pa.int8(): "int8", pa.int16(): "int16", pa.int32(): "int32",
            pa.int64(): "int64", pa.uint8(): "uint8", pa.uint16(): "uint16", pa.uint32(): "uint32",
            pa.uint64(): "uint64", pa.float16(): "float16", pa.float32(): "float32", pa.float64(): "float64",
            pa.date32(): "date", pa.date64(): "date", pa.binary(): "bytes", pa.string(): "unicode"}


class PandasSchemaError(ValueError):
    """A column type this module does not reproduce (categorical, timezone-aware, decimal columns)."""


@dataclass(frozen=True)
class PandasColumn:
    """One column as pandas would have held it: its name, the Arrow type `from_pandas` gives it and the
    pandas dtype's name (`str(series.dtype)`: 'int64', 'float64', 'object', 'str' for pandas 3's strings)."""
    name: str
    arrow_type: pa.DataType
    dtype: str


def logical_type(arrow_type: pa.DataType) -> str:
    """pyarrow's `pandas_compat.get_logical_type` for the types kvsim's tables hold."""
    if arrow_type in _LOGICAL:
        return _LOGICAL[arrow_type]
    if pa.types.is_time(arrow_type):
        return "time"
    if pa.types.is_fixed_size_binary(arrow_type):
        return "bytes"
    if pa.types.is_list(arrow_type):
        return f"list[{logical_type(arrow_type.value_type)}]"
    if pa.types.is_timestamp(arrow_type):
        if arrow_type.tz is not None:
            raise PandasSchemaError(f"column type {arrow_type}: timezone metadata is not reproduced")
        return "datetime"
    if pa.types.is_dictionary(arrow_type) or pa.types.is_decimal(arrow_type):
        raise PandasSchemaError(f"column type {arrow_type}: categorical/decimal metadata is not reproduced")
    return "object"


@cache
def pandas_version() -> str:
    """The installed pandas' version: `pandas.__version__` once pandas is imported, else the distribution's
    metadata, read without importing it (~5-20 ms: the metadata lookup scans the path's distributions)."""
    imported = sys.modules.get("pandas")
    if imported is not None:
        return str(imported.__version__)
    try:
        return version("pandas")
    except PackageNotFoundError as e:       # pragma: no cover - pandas is a dependency
        raise PandasSchemaError("pandas is not installed: its schema metadata names its version") from e


@cache
def string_column() -> tuple[pa.DataType, str]:
    """(Arrow type, pandas dtype name) of a column of Python strings in the installed pandas: pandas 3 infers
    its `str` dtype (written as large_string), pandas 2 an object column (written as string)."""
    major = int(pandas_version().split(".", 1)[0])
    return (pa.large_string(), "str") if major >= 3 else (pa.string(), "object")


def pandas_metadata(columns: list[PandasColumn]) -> bytes:
    """The `pandas` schema metadata `pa.Table.from_pandas(df, preserve_index=False)` writes for a frame with
    these columns (in order) and no attrs."""
    described = [{"name": c.name, "field_name": c.name, "pandas_type": logical_type(c.arrow_type),
                  "numpy_type": c.dtype, "metadata": None} for c in columns]
    return json.dumps({"index_columns": [], "column_indexes": [], "columns": described, "attributes": {},
                       "creator": {"library": "pyarrow", "version": pa.__version__},
                       "pandas_version": pandas_version()}).encode("utf8")


def with_pandas_metadata(table: pa.Table, dtypes: dict[str, str], arrow_types: dict[str, pa.DataType] | None = None,
                         described: list[str] | None = None) -> pa.Table:
    """`table` with the schema metadata pandas would have written. `dtypes`: each described column's pandas
    dtype name; `arrow_types`: the Arrow type from_pandas gave a column where the table's differs (a column
    cast after the conversion, e.g. an all-None column made a string one); `described`: the columns the
    frame had, in order (default: all of the table's; columns appended after the conversion are left out)."""
    names = described if described is not None else table.column_names
    types = arrow_types or {}
    columns = [PandasColumn(n, types.get(n, table.schema.field(n).type), dtypes[n]) for n in names]
    return table.replace_schema_metadata({b"pandas": pandas_metadata(columns)})


_NUMPY_NAMES = {pa.bool_(): "bool", pa.int8(): "int8", pa.int16(): "int16", pa.int32(): "int32", pa.int64(): "int64",
                pa.uint8(): "uint8", pa.uint16(): "uint16", pa.uint32(): "uint32", pa.uint64(): "uint64",
                pa.float32(): "float32", pa.float64(): "float64"}


def numpy_column(arrow_type: pa.DataType, *, all_null: bool = False) -> tuple[pa.DataType, str]:
    """(Arrow type from_pandas gives, pandas dtype name) of a column pandas would have held as a numpy column
    of `arrow_type`'s values, or, for a string column, as the installed pandas' strings; `all_null`: a column of
    None only (an object column; from_pandas gives it Arrow's null type)."""
    if all_null:
        return pa.null(), "object"
    if arrow_type in _NUMPY_NAMES:
        return arrow_type, _NUMPY_NAMES[arrow_type]
    if pa.types.is_string(arrow_type) or pa.types.is_large_string(arrow_type):
        return string_column()
    raise PandasSchemaError(f"column type {arrow_type}: expected a numeric or string column")


def arrow_table(columns: dict[str, Any], dtypes: dict[str, str]) -> pa.Table:
    """The Arrow table `pa.Table.from_pandas(df, preserve_index=False)` makes of a frame with these columns
    (name -> a numpy array, or a sequence of str/None for a string column) and pandas dtypes (name -> dtype
    name): numpy numeric columns (NaN becomes null, as from_pandas does), the installed pandas' string columns
    ('str': large_string, NaN/None null) and object columns of None only (Arrow's null type), with the
    `pandas` schema metadata. Any other kind of column raises PandasSchemaError (the caller converts with
    pandas)."""
    string_type, string_dtype = string_column()
    arrays, described = [], []
    for name, values in columns.items():
        dtype = dtypes[name]
        if dtype in _NUMPY_NAMES.values():
            array = pa.array(values, from_pandas=True)
            if _NUMPY_NAMES.get(array.type) != dtype:
                raise PandasSchemaError(f"column {name}: dtype {dtype} became {array.type}")
        elif dtype == string_dtype == "str":
            array = pa.array(values, type=string_type, from_pandas=True)
        elif dtype == "object" and all(v is None for v in values):
            array = pa.nulls(len(values))
        else:
            raise PandasSchemaError(f"column {name}: dtype {dtype} is converted by pandas")
        arrays.append(array)
        described.append(PandasColumn(name, array.type, dtype))
    return pa.Table.from_arrays(arrays, names=list(columns)).replace_schema_metadata(
        {b"pandas": pandas_metadata(described)})
