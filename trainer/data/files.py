"""Your own interactions: parquet, CSV, TSV or JSON lines files, any column names.

``load_files(path, user_col, item_col, time_col, filter=None, time_unit="s")``
reads one table and takes three of its columns: who (``user_col``), what
(``item_col``) and when (``time_col``). Yambda is this reader with its own
column names and filter (:mod:`trainer.data.yambda`).

What is read:

* ``path``: a file, a folder (every data file below it, recursively; names
  starting with ``.`` or ``_`` are skipped) or a glob (``data/*.parquet``,
  ``logs/**/*.csv``), local or a URL of any fsspec file system
  (``gs://bucket/logs/*.parquet``, read through ``gcsfs``). Several files are one table, concatenated in sorted path
  order, so events with equal times keep that order.
* Formats, by file name: ``.parquet`` / ``.pq``; ``.csv``; ``.tsv`` / ``.tab``
  (tab-separated); ``.jsonl`` / ``.ndjson`` / ``.json`` (JSON lines: one
  object per line). Text formats may be compressed (``.csv.gz``, ``.bz2``,
  ``.zst``). CSV and TSV files have a header line.
* Ids may be integers (>= 0) or strings. Parquet and JSON keep their types; a
  CSV / TSV id column is read as text and becomes integers when every value is
  a plain decimal integer without leading zeros (``"17"``; ``"017"`` keeps the
  column as strings). When files disagree (integers in one, strings in
  another), the integers are read as their decimal text. Preprocessing keeps
  the raw ids: the prepared folder's ``user_ids`` / ``item_ids`` are int64 for
  integer ids, and an unpadded UTF-8 blob with offsets for string ids
  (``trainer.data.storage``).
* Times become int64 counts of ``time_unit`` (``"s"``, ``"ms"``, ``"us"``,
  ``"ns"``; default ``"s"``): an integer is taken as such a count already; a
  float too, rounded down (events that then tie keep their file order); a
  date-time value, a date (midnight) or an ISO-8601 string
  (``2024-05-01T12:30:00Z``, ``2024-05-01 12:30:00.250``, ``2024-05-01``) is
  converted to the count since 1970-01-01 UTC, rounded down (strings without a
  zone offset are taken as UTC). Only the order of events and the windows of
  the temporal split (given in the same unit) depend on times.
* ``filter``: one condition ``<column> <op> <literal>`` with ``op`` one of
  ``>= <= > < == !=`` and a number, a quoted string (``'listen'``), a bare
  word, or ``true`` / ``false`` for a boolean column
  (``played_ratio_pct>=50``, ``event_type==listen``), or such conditions
  joined by ``AND`` / ``OR`` with parentheses (:mod:`trainer.data.filters`:
  the whole text is parsed, or refused in one line). Rows where the column
  is null are dropped. A numeric literal compares numerically (text columns
  are read as numbers); a string literal compares text.

Every problem with the data (a missing column, an empty table, a null id, an
unreadable time) raises :class:`~trainer.data.sources.DataError` (a
``ValueError``; :class:`~trainer.data.sources.DataTypeError` for a column of
the wrong type, also a ``TypeError``) naming the file and the column; a path
that matches nothing raises ``FileNotFoundError``; a malformed ``filter`` or
``time_unit`` a ``ValueError``.
"""

from __future__ import annotations

import glob
import os
import pathlib
from collections.abc import Sequence
from typing import NamedTuple

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pa_csv
import pyarrow.json as pa_json
import pyarrow.parquet as pq

from trainer.workdir import paths
from trainer.data import filters, sources
from trainer.data.filters import (  # noqa: F401  (the filter, re-exported)
    OPERATORS, Filter, apply_filter, parse_filter)
from trainer.data.sources import DataError, DataTypeError

# File name suffix -> format.
FORMATS = {".parquet": "parquet", ".pq": "parquet", ".csv": "csv", ".tsv": "tsv",
           ".tab": "tsv", ".jsonl": "json", ".ndjson": "json", ".json": "json"}
# Compression suffixes of text formats (pyarrow decompresses by file name).
COMPRESSIONS = (".gz", ".bz2", ".zst")
TIME_UNITS = ("s", "ms", "us", "ns")
# Nanoseconds per unit ("D": days, for date columns).
_NS = {"D": 86_400 * 10**9, "s": 10**9, "ms": 10**6, "us": 10**3, "ns": 1}
# Plain decimal integers that fit int64: text ids read as integers.
_DECIMAL_ID = r"^(0|[1-9][0-9]{0,17})$"
# An ISO-8601 time of day followed by a zone (Z, +01:00, -0500).
_ZONED = r"\d\d:\d\d(:\d\d(\.\d*)?)?([Zz]|[+-]\d\d(:?\d\d)?)$"
_KINDS = "parquet, CSV, TSV or JSON lines"


def file_format(path: str | os.PathLike) -> str | None:
  """The format of a data file by its name (compression suffix allowed), or None."""
  name = pathlib.Path(path).name.lower()
  for compression in COMPRESSIONS:
    if name.endswith(compression):
      name = name[:-len(compression)]
      if pathlib.PurePath(name).suffix in (".parquet", ".pq"):
        return None  # parquet compresses inside the file
  return FORMATS.get(pathlib.PurePath(name).suffix)


def _data_files(folder: pathlib.Path) -> list[pathlib.Path]:
  """Data files below ``folder``, sorted, skipping hidden and ``_`` names."""
  found = []
  for root, dirs, names in os.walk(folder):
    dirs[:] = sorted(d for d in dirs if not d.startswith((".", "_")))
    found += [pathlib.Path(root, n) for n in names
              if not n.startswith((".", "_")) and file_format(n)]
  return sorted(found)


def resolve_files(path: str | os.PathLike) -> list[pathlib.Path]:
  """The data files ``path`` names: a file, a folder or a glob.

  Returns:
    Sorted paths, at least one.

  Raises:
    FileNotFoundError: nothing matches, or a folder holds no data file.
    ValueError: a named file of an unknown format.
  """
  if paths.is_remote(path):
    paths.check_remote(path)  # gs:// without gcsfs: one line
    return _resolve_remote(os.fspath(path))
  text = os.path.expanduser(os.fspath(path))
  if os.path.isfile(text):
    matches = [text]
  elif os.path.isdir(text):
    files = _data_files(pathlib.Path(text))
    if not files:
      raise FileNotFoundError(
          f"folder {text} holds no data files; expected {_KINDS} files "
          f"({', '.join(FORMATS)})")
    return files
  elif glob.has_magic(text):
    matches = sorted(glob.glob(text, recursive=True))
    if not matches:
      raise FileNotFoundError(
          f"path {text!r} matches no files; expected a file, a folder or a "
          f"glob matching {_KINDS} files")
  else:
    raise FileNotFoundError(
        f"{text} does not exist; expected a file, a folder or a glob of "
        f"{_KINDS} files")
  files = []
  for match in matches:
    if os.path.basename(match).startswith((".", "_")):
      continue  # hidden files and markers such as _SUCCESS
    if os.path.isdir(match):
      files += _data_files(pathlib.Path(match))
    elif file_format(match) is None:
      raise DataError(
          f"{match}: unknown file format; expected a name ending in "
          f"{', '.join(FORMATS)} (text formats optionally + "
          f"{', '.join(COMPRESSIONS)})")
    else:
      files.append(pathlib.Path(match))
  if not files:
    raise FileNotFoundError(f"path {text!r} matches no data files ({_KINDS})")
  return sorted(set(files))


def _hidden(relative: str) -> bool:
  return any(part.startswith((".", "_")) for part in relative.split("/") if part)


def _resolve_remote(url: str) -> list[str]:
  """:func:`resolve_files` for a URL (``gs://...``): the same rules through fsspec."""
  fs, root = fsspec.core.url_to_fs(url)
  protocol = url.split("://", 1)[0]

  def as_url(found: str) -> str:
    return f"{protocol}://{found.split('://', 1)[-1]}"

  if fs.isfile(root):
    matches = [root]
  elif fs.isdir(root):
    base = root.rstrip("/")
    found = [p for p in fs.find(base) if file_format(p) and not _hidden(p[len(base):])]
    if not found:
      raise FileNotFoundError(
          f"folder {url} holds no data files; expected {_KINDS} files ({', '.join(FORMATS)})")
    return sorted(as_url(p) for p in found)
  elif glob.has_magic(root):
    matches = sorted(fs.glob(root))
    if not matches:
      raise FileNotFoundError(
          f"path {url!r} matches no files; expected a file, a folder or a glob matching "
          f"{_KINDS} files")
  else:
    raise FileNotFoundError(
        f"{url} does not exist; expected a file, a folder or a glob of {_KINDS} files")
  files = []
  for match in matches:
    if os.path.basename(match.rstrip("/")).startswith((".", "_")):
      continue
    if fs.isdir(match):
      files += [p for p in fs.find(match) if file_format(p) and not _hidden(p[len(match):])]
    elif file_format(match) is None:
      raise DataError(
          f"{as_url(match)}: unknown file format; expected a name ending in "
          f"{', '.join(FORMATS)} (text formats optionally + {', '.join(COMPRESSIONS)})")
    else:
      files.append(match)
  if not files:
    raise FileNotFoundError(f"path {url!r} matches no data files ({_KINDS})")
  return sorted({as_url(p) for p in files})


def open_source(file: str | os.PathLike):
  """What pyarrow reads ``file`` from: the local path, or an open fsspec file for a URL
  (text formats decompressed by their suffix, as pyarrow does for a path)."""
  if not paths.is_remote(file):
    return os.fspath(file)
  compression = "infer" if file_format(file) != "parquet" else None
  return fsspec.open(os.fspath(file), "rb", compression=compression).open()


# --------------------------------------------------------------------------- #
# Reading one file                                                             #
# --------------------------------------------------------------------------- #


def _check_columns(names: Sequence[str], file, columns: Sequence[str]) -> None:
  """Each of ``columns`` is in ``names`` exactly once (a CSV header may repeat a name).

  Raises:
    DataError: a column missing, or one used (id, time or filter column) that
      appears twice: readers would take the first silently.
  """
  names = list(names)
  repeated = list(dict.fromkeys(c for c in columns if names.count(c) > 1))
  if repeated:
    counts = ", ".join(f"{c!r} {names.count(c)} times" for c in repeated)
    raise DataError(
        f"{file} has duplicate column names ({counts}; found {names}): which column holds "
        "the data is ambiguous; rename or drop the duplicates")
  missing = [c for c in columns if c not in names]
  if missing:
    raise DataError(
        f"{file} lacks columns {missing}; found {list(names)}, expected "
        f"{list(columns)}")


def read_file(file: str | os.PathLike, columns: Sequence[str]) -> pa.Table:
  """Reads ``columns`` of one data file (CSV / TSV columns as text).

  Raises:
    DataError: a missing column, or a file its format cannot read.
  """
  kind = file_format(file)
  try:
    if kind == "parquet":
      parquet = pq.ParquetFile(open_source(file))
      _check_columns(parquet.schema_arrow.names, file, columns)
      return parquet.read(columns=list(columns))
    if kind in ("csv", "tsv"):
      parse = pa_csv.ParseOptions(delimiter="," if kind == "csv" else "\t")
      with pa_csv.open_csv(open_source(file), parse_options=parse) as reader:
        _check_columns(reader.schema.names, file, columns)
      return pa_csv.read_csv(open_source(file), parse_options=parse,
                             convert_options=pa_csv.ConvertOptions(
          include_columns=list(columns), column_types={c: pa.string() for c in columns},
          strings_can_be_null=True, null_values=[""]))
    if kind == "json":
      table = pa_json.read_json(open_source(file))
      _check_columns(table.column_names, file, columns)
      return table.select(list(columns))
  except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError) as error:
    raise DataError(f"cannot read {file} as {kind}: {error}") from None
  raise DataError(f"{file}: unknown file format; expected {', '.join(FORMATS)}")


def _decoded(table: pa.Table) -> pa.Table:
  """``table`` with dictionary-encoded columns (pandas categoricals) decoded."""
  for index, field in enumerate(table.schema):
    if pa.types.is_dictionary(field.type):
      table = table.set_column(index, field.name,
                               pc.cast(table[index], field.type.value_type))
  return table


def _is_text(kind: pa.DataType) -> bool:
  return pa.types.is_string(kind) or pa.types.is_large_string(kind)


def id_column(column: pa.ChunkedArray, file, name: str, what: str, *,
              from_text: bool = False) -> pa.ChunkedArray:
  """An id column as int64 (integer ids, >= 0) or large_string.

  Args:
    column: the column as read.
    file: for messages.
    name: the column's name.
    what: ``"user"`` or ``"item"``.
    from_text: a CSV / TSV column read as text: integers when every value is
      a plain decimal integer.

  Raises:
    DataError: nulls, or negative integer ids.
    DataTypeError: neither integers nor strings.
  """
  if column.null_count:
    raise DataError(
        f"column {name!r} of {file} has {column.null_count} empty values "
        f"(nulls); expected a {what} id in every row")
  kind = column.type
  if from_text and _is_text(kind) and pc.all(
      pc.match_substring_regex(column, _DECIMAL_ID)).as_py() is not False:
    return pc.cast(column, pa.int64())
  if pa.types.is_integer(kind):
    try:
      column = pc.cast(column, pa.int64())
    except pa.ArrowInvalid as error:
      raise DataError(f"column {name!r} of {file}: {error}; expected {what} "
                      "ids that fit int64") from None
    low = pc.min(column).as_py()
    if low is not None and low < 0:
      raise DataError(
          f"{what} ids must be >= 0, found {low} in column {name!r} of {file}; "
          "store negative ids as strings")
    return column
  if _is_text(kind):
    return pc.cast(column, pa.large_string())
  raise DataTypeError(
      f"column {name!r} of {file} has type {kind}; expected integer or "
      f"string {what} ids (int64, uint32, string, ...)")


def _rescale(counts: np.ndarray, unit: str, time_unit: str, file, name: str) -> np.ndarray:
  """int64 counts of ``unit`` -> counts of ``time_unit``, rounded down."""
  source, target = _NS[unit], _NS[time_unit]
  if source >= target:
    factor = source // target
    if counts.size and factor > 1 and int(np.abs(counts).max()) > (2**63 - 1) // factor:
      raise DataError(f"column {name!r} of {file}: times overflow int64 in "
                      f"time_unit={time_unit!r}; expected a coarser time_unit")
    return counts * factor
  return np.floor_divide(counts, target // source)


def _parse_date_times(column: pa.ChunkedArray) -> np.ndarray:
  """ISO-8601 strings -> int64 ns since the epoch (UTC; no zone: taken as UTC)."""
  zoned = pc.match_substring_regex(column, _ZONED)
  naive = pc.cast(pc.if_else(zoned, "1970-01-01", column), pa.timestamp("ns"))
  aware = pc.cast(pc.if_else(zoned, column, "1970-01-01T00:00:00Z"),
                  pa.timestamp("ns", "UTC"))
  return np.where(zoned.to_numpy(zero_copy_only=False),
                  aware.cast(pa.int64()).to_numpy(), naive.cast(pa.int64()).to_numpy())


def _numbers(values: np.ndarray, file, name: str) -> np.ndarray:
  """Floats -> int64 rounded down; NaN, infinities and huge values rejected."""
  bad = ~np.isfinite(values) | (np.abs(values) >= 2.0**63)
  if bad.any():
    index = int(np.argmax(bad))
    raise DataError(f"column {name!r} of {file} holds {values[index]!r} at row "
                    f"{index}; expected finite times")
  return np.floor(values).astype(np.int64)


def time_column(column: pa.ChunkedArray, file, name: str, time_unit: str) -> np.ndarray:
  """A time column as int64 counts of ``time_unit`` (see the module docstring).

  Raises:
    DataError: nulls, a value that is no time, or an overflow.
    DataTypeError: a column type that holds no times.
  """
  if column.null_count:
    raise DataError(f"column {name!r} of {file} has {column.null_count} empty "
                    "values (nulls); expected a time in every row")
  kind = column.type
  if pa.types.is_integer(kind):
    try:
      return pc.cast(column, pa.int64()).to_numpy()
    except pa.ArrowInvalid as error:
      raise DataError(f"column {name!r} of {file}: {error}") from None
  if pa.types.is_floating(kind):
    return _numbers(column.to_numpy().astype(np.float64), file, name)
  if pa.types.is_timestamp(kind):  # stored as UTC counts of its unit
    return _rescale(column.cast(pa.int64()).to_numpy(), kind.unit, time_unit, file, name)
  if pa.types.is_date32(kind):
    return _rescale(column.cast(pa.int32()).to_numpy().astype(np.int64), "D",
                    time_unit, file, name)
  if pa.types.is_date64(kind):
    return _rescale(column.cast(pa.int64()).to_numpy(), "ms", time_unit, file, name)
  if not _is_text(kind):
    raise DataTypeError(f"column {name!r} of {file} has type {kind}; expected "
                        "integer, float, date-time or ISO-8601 string times")
  for number in (pa.int64(), pa.float64()):
    try:
      values = pc.cast(column, number).to_numpy()
    except pa.ArrowInvalid:
      continue
    return values if number == pa.int64() else _numbers(values, file, name)
  try:
    ns = _parse_date_times(column)
  except pa.ArrowInvalid as error:
    raise DataError(
        f"column {name!r} of {file} holds a value that is not a time ({error}); "
        "expected integers or floats (counts of time_unit), or ISO-8601 "
        "date-times such as '2024-05-01T12:30:00Z' or '2024-05-01'") from None
  return _rescale(ns, "ns", time_unit, file, name)


# --------------------------------------------------------------------------- #
# Many files -> Interactions                                                   #
# --------------------------------------------------------------------------- #


def _unify_ids(parts: list[pa.ChunkedArray]) -> pa.ChunkedArray:
  """One column of the per-file id columns; integers become text when mixed."""
  if len({part.type for part in parts}) > 1:
    parts = [pc.cast(part, pa.large_string()) for part in parts]
  return pa.chunked_array([c for part in parts for c in part.chunks], parts[0].type)


def _ids_and_vocab(column: pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray | None]:
  """int64 ids and no vocabulary, or codes of the sorted distinct strings."""
  if pa.types.is_integer(column.type):
    return column.to_numpy(), None
  distinct = pc.unique(column)
  vocab = distinct.take(pc.sort_indices(distinct))  # UTF-8 byte = code point order
  codes = pc.index_in(column, value_set=vocab).to_numpy().astype(np.int64)
  return codes, np.asarray(vocab.to_numpy(zero_copy_only=False), dtype=str)


class FileScan(NamedTuple):
  """What to read: the files and how (the arguments of :func:`read_interactions`).

  Both preparation paths take it: :func:`read_interactions` (in memory) and
  :mod:`trainer.data.engine` (out of core).
  """

  files: list
  user_col: str
  item_col: str
  time_col: str
  filter: str | None = None
  time_unit: str = "s"
  filter_keeps_null: bool = False
  name: str = ""


def check_scan(scan: FileScan) -> filters.Node | None:
  """Checks the options of ``scan`` and returns its parsed filter (or None).

  Raises:
    ValueError: an unknown ``time_unit``, a column that is not a name, a
      malformed ``filter``.
    DataError: one column named for two fields (``item_col`` = ``user_col``).
  """
  if scan.time_unit not in TIME_UNITS:
    raise ValueError(f"time_unit {scan.time_unit!r} is unknown; expected one of {TIME_UNITS}")
  for label, column in (("user_col", scan.user_col), ("item_col", scan.item_col),
                        ("time_col", scan.time_col)):
    if not isinstance(column, str) or not column:
      raise ValueError(f"{label}={column!r}: expected a column name")
  names = {"user_col": scan.user_col, "item_col": scan.item_col, "time_col": scan.time_col}
  for label, column in names.items():
    first = next(other for other in names if names[other] == column)
    if first != label:
      raise DataError(f"{label}={column!r} is also {first}: users, items and times are "
                      "three columns")
  return parse_filter(scan.filter) if scan.filter is not None else None


def scan_columns(scan: FileScan, condition: filters.Node | None) -> list[str]:
  """The columns read: user, item, time and the filter's."""
  return list(dict.fromkeys([scan.user_col, scan.item_col, scan.time_col]
                            + filters.columns(condition)))


def describe_files(files: Sequence) -> str:
  """``a.csv`` or ``3 files (a.csv, ...)``, for messages."""
  return str(files[0]) if len(files) == 1 else f"{len(files)} files ({files[0]}, ...)"


def read_interactions(  # pylint: disable=redefined-builtin
    files: Sequence[str | os.PathLike], *, user_col: str, item_col: str, time_col: str,
    filter: str | None = None, time_unit: str = "s", filter_keeps_null: bool = False,
    name: str = "") -> sources.Interactions:
  """Reads ``files`` as one table of interactions (the reader of :func:`load_files`).

  Args:
    files: data files, read in this order.
    user_col, item_col, time_col, filter, time_unit: see :func:`load_files`.
    filter_keeps_null: keep rows whose filter column is null (Yambda's
      multi-event file, where only listens have a played ratio).
    name: recorded as :attr:`Interactions.name`.

  Returns:
    :class:`~trainer.data.sources.Interactions` in file order; string ids as
    codes with ``user_vocab`` / ``item_vocab``.

  Raises:
    DataError, DataTypeError, ValueError: see :func:`load_files`.
  """
  scan = FileScan(list(files), user_col, item_col, time_col, filter, time_unit,
                  filter_keeps_null, name)
  condition = check_scan(scan)
  columns = scan_columns(scan, condition)
  users, items, times = [], [], []
  rows = 0
  for file in files:
    table = _decoded(read_file(file, columns))
    rows += table.num_rows
    if condition is not None:
      table = apply_filter(table, condition, file, keep_null=filter_keeps_null)
    from_text = file_format(file) in ("csv", "tsv")
    users.append(id_column(table[user_col], file, user_col, "user", from_text=from_text))
    items.append(id_column(table[item_col], file, item_col, "item", from_text=from_text))
    times.append(time_column(table[time_col], file, time_col, time_unit))
  where = describe_files(files)
  if rows == 0:
    raise DataError(f"{where} has no rows; expected at least one interaction")
  timestamp = np.concatenate(times).astype(np.int64, copy=False)
  if timestamp.shape[0] == 0:
    raise DataError(f"{where} has no interactions left after filter {filter!r} "
                    f"({rows} rows read); expected at least one row to pass")
  user, user_vocab = _ids_and_vocab(_unify_ids(users))
  del users
  item, item_vocab = _ids_and_vocab(_unify_ids(items))
  return sources.Interactions(user=user, item=item, timestamp=timestamp, name=name,
                              user_vocab=user_vocab, item_vocab=item_vocab)


def scan_files(path: str | os.PathLike, user_col: str, item_col: str, time_col: str,
               filter: str | None = None,  # pylint: disable=redefined-builtin
               time_unit: str = "s") -> FileScan:
  """The :class:`FileScan` of the ``files`` source (arguments of :func:`load_files`).

  Raises:
    FileNotFoundError: ``path`` matches no data file.
    ValueError: a malformed ``filter`` or unknown ``time_unit``.
  """
  scan = FileScan(resolve_files(path), user_col, item_col, time_col, filter, time_unit,
                  name=f"files:{os.fspath(path)}")
  check_scan(scan)
  return scan


def load_files(path: str | os.PathLike, user_col: str, item_col: str, time_col: str,
               filter: str | None = None,  # pylint: disable=redefined-builtin
               time_unit: str = "s") -> sources.Interactions:
  """Loads interactions from your own files (the ``files`` source).

  Args:
    path: a file, a folder or a glob of parquet, CSV, TSV or JSON lines files.
    user_col: the column of user ids (integers >= 0 or strings).
    item_col: the column of item ids (integers >= 0 or strings).
    time_col: the column of event times (numbers, date-times, ISO-8601).
    filter: None, or one condition such as ``"played_ratio_pct>=50"``; rows
      where it does not hold (or its column is null) are dropped.
    time_unit: ``"s"``, ``"ms"``, ``"us"`` or ``"ns"``: what one unit of a
      numeric time is, and the unit of the int64 timestamps (and of the
      temporal split's windows).

  Returns:
    :class:`~trainer.data.sources.Interactions` in file order.

  Raises:
    FileNotFoundError: ``path`` matches no data file.
    DataError: a missing column, an empty table, a null or bad id, an
      unreadable time; the message names the file and the column.
    DataTypeError: a column whose type holds no ids or times.
    ValueError: a malformed ``filter`` or unknown ``time_unit``.
  """
  files = resolve_files(path)
  return read_interactions(files, user_col=user_col, item_col=item_col,
                           time_col=time_col, filter=filter, time_unit=time_unit,
                           name=f"files:{os.fspath(path)}")
