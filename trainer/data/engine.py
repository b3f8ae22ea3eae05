"""Out-of-core preparation of file sources with DuckDB, under a memory limit.

The in-memory path (:func:`trainer.data.prepare.prepare_interactions`) holds
every event as numpy arrays (about 110 bytes per event at its peak). This
one gives byte-identical folders (same dense ids, order, splits, manifest)
while holding only per-user and per-item arrays and one batch of events:

1. **Read** (pyarrow, one record batch at a time): each file of the
   :class:`~trainer.data.files.FileScan` goes through the same per-column
   rules as the in-memory reader (filter, id columns, times;
   :mod:`trainer.data.files`), and each batch is appended to a DuckDB table
   with a running row number ``seq`` (file order). Parquet files are read
   in batches of :data:`BATCH_ROWS` rows; text formats (CSV, TSV, JSON
   lines, whose id and time types are decided per file) and parquet files
   with a text time column are read one whole file at a time, as before.
   Local files or any fsspec URL (``gs://...``).
2. **Filter and remap** (DuckDB SQL): items with fewer than
   ``min_item_count`` events dropped, then users with fewer than
   ``min_user_count`` of the rest; dense ids in increasing raw-id order
   (numbers numerically, strings by code point: DuckDB compares text by
   bytes, and UTF-8 byte order is code point order). The per-user counts
   give the offsets before any event is sorted.
3. **Sort and write** (DuckDB ``ORDER BY user, time, seq``, an external
   sort that spills to ``temp_dir`` past the memory limit): streamed out in
   batches into the ``.npy`` event arrays (one file, or one per user shard),
   while the per-user counts the temporal split needs are summed.
4. The split, the manifest and the small arrays come from the same code as
   the in-memory path (:func:`trainer.data.splits.split_from_counts`,
   :func:`trainer.data.storage.build_manifest`,
   :func:`trainer.data.storage.write_prepared`).

DuckDB's memory limit bounds its own buffers (hash tables, sort runs, the
table of raw events); past it they spill to ``temp_dir`` (a local folder:
default the system's temporary folder), which is removed at the end. It runs
on every core unless ``threads`` says otherwise. Memory outside DuckDB: one
read batch, one output batch, and arrays of U users and V items (per-user
counts come back as arrays, never as Python objects). Parquet is read
without pyarrow's pre-buffering, which keeps every column chunk it has read
until the file is closed (the whole compressed file: +1.3 GiB at 100M
events). Measured, the process's peak RSS is the limit plus a part that
does not grow with the events (the interpreter and libraries, allocator
slack, the batches): about 0.5 to 0.8 GiB (docs/data.md).

Why DuckDB: it did the same work as Polars' streaming engine within the
memory limit, and it is the one of the two that honours a hard memory limit
and spills its sort to disk (see ``benchmarks/prepare_bench.py`` and
docs/data.md).
"""

from __future__ import annotations

import logging
import os
import queue
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Mapping

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from trainer.workdir import paths
from trainer.data import files as files_lib
from trainer.data import splits, storage
from trainer.data.sources import DataError

_LOG = logging.getLogger(__name__)
# Rows per parquet read batch, and per batch of sorted output.
BATCH_ROWS = 1 << 21
OUTPUT_ROWS = 1 << 21
# The default memory limit: this fraction of the machine's RAM.
DEFAULT_MEMORY_FRACTION = 0.5
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_MEMORY = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b|b)?\s*$", re.IGNORECASE)


def parse_memory_limit(text: str | int) -> int:
  """``"4GB"``, ``"512MiB"``, ``"1.5 GiB"`` or a byte count -> bytes.

  Raises:
    ValueError: not a size, or below 64 MiB.

  Example:
    >>> parse_memory_limit("4GB"), parse_memory_limit("1GiB")
    (4000000000, 1073741824)
  """
  match = _MEMORY.match(str(text))
  if not match:
    raise ValueError(f"memory limit {text!r} is not a size; expected e.g. '4GB', "
                     "'512MiB' or a number of bytes")
  size = int(float(match.group(1)) * _UNITS[(match.group(2) or "").lower()])
  if size < 64 * 2**20:
    raise ValueError(f"memory limit {text!r} is below 64 MiB; expected e.g. '4GB'")
  return size


def default_memory_limit() -> int:
  """Bytes: :data:`DEFAULT_MEMORY_FRACTION` of this machine's physical memory."""
  total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  return int(total * DEFAULT_MEMORY_FRACTION)


# --------------------------------------------------------------------------- #
# 1. Read                                                                      #
# --------------------------------------------------------------------------- #


class _Progress:
  """Progress lines of a long preparation: logger ``trainer.data.engine``, level INFO.

  ``python -m trainer.data`` shows them on stderr. Each line gives the
  seconds since the preparation started; counts are logged at most every
  ``every`` rows, and nothing in the first ``quiet_s`` seconds (a small
  preparation prints nothing).
  """

  def __init__(self, every: int = 100_000_000, quiet_s: float = 10.0):
    self.start = time.perf_counter()
    self.every = every
    self.next = every
    self.quiet_s = quiet_s

  def __call__(self, message: str) -> None:
    elapsed = time.perf_counter() - self.start
    if elapsed >= self.quiet_s:
      _LOG.info("prepare: %s (%.0f s)", message, elapsed)

  def rows(self, done: int, message: str) -> None:
    """Logs ``message`` once ``done`` has passed the next multiple of ``every``."""
    if done >= self.next:
      self(message)
      self.next = (done // self.every + 1) * self.every

  def restart_rows(self) -> None:
    """A new count from 0 (the next phase over the same rows)."""
    self.next = self.every


def _is_text_type(kind: pa.DataType) -> bool:
  if pa.types.is_dictionary(kind):
    kind = kind.value_type
  return pa.types.is_string(kind) or pa.types.is_large_string(kind)


def _tables(file, columns: list[str]):
  """The tables of ``file`` to normalize, one batch at a time where the rules allow."""
  if files_lib.file_format(file) == "parquet":
    try:
      # No pre-buffering: with it, the reader keeps every column chunk it
      # has read until the file is closed (the whole file, compressed).
      parquet = pq.ParquetFile(files_lib.open_source(file), pre_buffer=False)
    except (pa.ArrowInvalid, OSError) as error:
      raise DataError(f"cannot read {file} as parquet: {error}") from None
    schema = parquet.schema_arrow
    files_lib._check_columns(schema.names, file, columns)  # pylint: disable=protected-access
    # A text time column's type (integers, floats or ISO strings) is decided
    # over the whole file, as the in-memory reader does.
    if not _is_text_type(schema.field(columns[2]).type) and parquet.metadata.num_rows:
      for batch in parquet.iter_batches(batch_size=BATCH_ROWS, columns=columns):
        yield pa.Table.from_batches([batch])
      return
  yield files_lib.read_file(file, columns)


class _IdStats:
  """What the id columns held: types seen, longest text, largest integer."""

  def __init__(self):
    self.integers = False
    self.strings = False
    self.longest = 0
    self.largest = -1

  def add(self, column: pa.ChunkedArray) -> None:
    if not len(column):
      return
    if pa.types.is_integer(column.type):
      self.integers = True
      self.largest = max(self.largest, pc.max(column).as_py())
    else:
      self.strings = True
      self.longest = max(self.longest, pc.max(pc.utf8_length(column)).as_py())

  def width(self) -> int:
    """Code points of the longest raw id once every id is text."""
    return max(self.longest, len(str(self.largest)) if self.integers else 0)

  def sql(self, name: str) -> str:
    """The raw id as one column: integers, text, or (mixed) integers as decimal text."""
    if self.strings and self.integers:
      return f"coalesce({name}_str, CAST({name}_int AS VARCHAR))"
    return f"{name}_str" if self.strings else f"{name}_int"


def _split_ids(column: pa.ChunkedArray) -> tuple[pa.Array, pa.Array]:
  """An id column as (int64, text) columns, the other one null."""
  column = column.combine_chunks()
  nulls_int = pa.nulls(len(column), pa.int64())
  nulls_str = pa.nulls(len(column), pa.large_string())
  if pa.types.is_integer(column.type):
    return column, nulls_str
  return nulls_int, column


def _batches(scan: files_lib.FileScan, users: _IdStats, items: _IdStats):
  """Yields ``(rows read, table of raw's columns but seq)`` for each batch of every file."""
  condition = files_lib.check_scan(scan)
  columns = files_lib.scan_columns(scan, condition)
  for file in scan.files:
    from_text = files_lib.file_format(file) in ("csv", "tsv")
    for table in _tables(file, columns):
      table = files_lib._decoded(table)  # pylint: disable=protected-access
      rows = table.num_rows
      if condition is not None:
        table = files_lib.apply_filter(table, condition, file,
                                       keep_null=scan.filter_keeps_null)
      user = files_lib.id_column(table[scan.user_col], file, scan.user_col, "user",
                                 from_text=from_text)
      item = files_lib.id_column(table[scan.item_col], file, scan.item_col, "item",
                                 from_text=from_text)
      time = files_lib.time_column(table[scan.time_col], file, scan.time_col,
                                   scan.time_unit).astype(np.int64, copy=False)
      users.add(user)
      items.add(item)
      yield rows, pa.table(dict(zip(("u_int", "u_str"), _split_ids(user)))
                           | dict(zip(("i_int", "i_str"), _split_ids(item))) | {"t": time})


def _prefetched(iterator, depth: int = 1):
  """``iterator``'s items in order, the next ``depth`` made by a thread meanwhile.

  Reading and decoding a batch (pyarrow) and inserting the previous one
  (DuckDB) both release the GIL, so the two overlap. An exception of the
  thread is raised here, at the item it stopped at.
  """
  items = queue.Queue(maxsize=depth)
  stop = threading.Event()
  done = object()

  def produce():
    try:
      for item in iterator:
        while not stop.is_set():
          try:
            items.put((item, None), timeout=0.1)
            break
          except queue.Full:
            continue
        if stop.is_set():
          return
      items.put((done, None))
    except BaseException as error:  # pylint: disable=broad-except  (raised in the consumer)
      items.put((done, error))

  thread = threading.Thread(target=produce, name="prepare-read", daemon=True)
  thread.start()
  try:
    while True:
      item, error = items.get()
      if error is not None:
        raise error
      if item is done:
        return
      yield item
  finally:
    stop.set()
    thread.join()


def duckdb_settings(work: str, limit: int, threads: int | None) -> dict[str, str]:
  """DuckDB's settings for one preparation, passed to ``duckdb.connect(config=...)``.

  Values, never SQL: the spill folder (under ``work``, which comes from
  ``--temp-dir`` or TMPDIR) may hold any character, quotes and semicolons
  included, and no path or value is ever pasted into a statement.
  """
  return {
      "memory_limit": f"{int(limit) // 2**20}MiB",
      "temp_directory": os.path.join(work, "spill"),
      "threads": str(int(threads or os.cpu_count() or 1)),
      "preserve_insertion_order": "false",
  }


def _load(connection, scan: files_lib.FileScan,
          progress: _Progress) -> tuple[int, _IdStats, _IdStats]:
  """Reads every file into table ``raw``; returns (rows after the filter, user and item id stats).

  Raises:
    DataError, DataTypeError: as :func:`trainer.data.files.read_interactions`.
  """
  connection.execute(
      "CREATE TABLE raw (u_int BIGINT, u_str VARCHAR, i_int BIGINT, i_str VARCHAR, "
      "t BIGINT, seq BIGINT)")
  users, items = _IdStats(), _IdStats()
  rows = kept = 0
  for read, table in _prefetched(_batches(scan, users, items)):
    rows += read
    count = table.num_rows
    batch = table.append_column("seq", pa.array(np.arange(kept, kept + count, dtype=np.int64)))
    connection.register("batch", batch)
    connection.execute("INSERT INTO raw SELECT * FROM batch")
    connection.unregister("batch")
    kept += count
    progress.rows(rows, f"read {rows:,} rows")
  where = files_lib.describe_files(scan.files)
  if rows == 0:
    raise DataError(f"{where} has no rows; expected at least one interaction")
  if kept == 0:
    raise DataError(f"{where} has no interactions left after filter {scan.filter!r} "
                    f"({rows} rows read); expected at least one row to pass")
  progress(f"read {rows:,} rows of {where}, {kept:,} kept")
  return kept, users, items


def _arrow_reader(result, rows: int) -> pa.RecordBatchReader:
  """A query's result as record batches of ``rows`` (DuckDB 2 and 1 spell it differently)."""
  if hasattr(result, "to_arrow_reader"):
    return result.to_arrow_reader(rows)
  return result.fetch_arrow_reader(rows)


def _arrow_table(result) -> pa.Table:
  if hasattr(result, "to_arrow_table"):
    return result.to_arrow_table()
  return result.arrow()


# --------------------------------------------------------------------------- #
# 2. Filter and remap                                                          #
# --------------------------------------------------------------------------- #


def _raw_ids(connection, table: str, column: str, stats: _IdStats) -> np.ndarray:
  """``[K]`` raw ids of ``table`` in dense order: int64, or variable-width strings
  (numpy ``StringDType``: a long id costs its own bytes, not the catalog's)."""
  values = _arrow_table(connection.sql(
      f"SELECT {column} FROM {table} ORDER BY dense")).column(0)
  if not stats.strings:
    return values.to_numpy().astype(np.int64, copy=False)
  return np.asarray(values.to_numpy(zero_copy_only=False), dtype=np.dtypes.StringDType())


def _remap(connection, *, min_item_count: int, min_user_count: int,
           users: _IdStats, items: _IdStats, name: str, rows: int) -> None:
  """Tables ``events(u, i, t, seq)``, ``kept_users(u, dense, n, t_max)``, ``kept_items(i, dense)``."""
  connection.execute(f"CREATE VIEW events AS SELECT {users.sql('u')} AS u, "
                     f"{items.sql('i')} AS i, t, seq FROM raw")
  connection.execute(
      "CREATE TABLE counted_items AS SELECT i FROM events GROUP BY i "
      f"HAVING count(*) >= {max(1, int(min_item_count))}")
  counted = ("events" if int(min_item_count) <= 1  # every item counted: no join
             else "events SEMI JOIN counted_items USING (i)")
  connection.execute(
      "CREATE TABLE counted_users AS SELECT u, count(*) AS n, max(t) AS t_max "
      f"FROM {counted} GROUP BY u HAVING count(*) >= {int(min_user_count)}")
  connection.execute("CREATE TABLE kept_users AS SELECT u, n, t_max, "
                     "row_number() OVER (ORDER BY u) - 1 AS dense FROM counted_users")
  if connection.execute("SELECT count(*) FROM kept_users").fetchone()[0] == 0:
    raise ValueError(
        f"{name or 'dataset'} is empty after filtering: 0 of {rows} "
        f"interactions kept with min_item_count={min_item_count}, "
        f"min_user_count={min_user_count}; expected at least one")
  if int(min_user_count) <= 1:  # no user dropped: every counted item stays
    present = "SELECT i FROM counted_items"
  else:  # items whose only users were dropped go too
    present = ("SELECT DISTINCT i FROM events SEMI JOIN counted_items USING (i) "
               "SEMI JOIN kept_users USING (u)")
  connection.execute(f"CREATE TABLE kept_items AS SELECT i, row_number() OVER (ORDER BY i) - 1 "
                     f"AS dense FROM ({present})")


# --------------------------------------------------------------------------- #
# 3. Sort and write                                                            #
# --------------------------------------------------------------------------- #


def _write_events(connection, out, *, offsets: np.ndarray, num_shards: int,
                  thresholds: list[int], progress: _Progress) -> list[np.ndarray]:
  """Streams the sorted events into the event files; returns per-user counts below each threshold."""
  folder = paths.as_path(out)
  folder.mkdir(parents=True, exist_ok=True)
  num_users = offsets.shape[0] - 1
  rows = offsets[storage.shard_bounds(offsets, num_shards)]
  streams = {name: [storage.NpyStream(folder / file, dtype, stop - start)
                    for file, start, stop in zip(storage.event_files(name, num_shards),
                                                 rows[:-1], rows[1:])]
             for name, dtype in (("items", np.int32), ("timestamps", np.int64))}
  counts = [np.zeros(num_users, np.int64) for _ in thresholds]
  try:
    result = connection.sql(
        "SELECT CAST(kept_users.dense AS INTEGER) AS user, CAST(kept_items.dense AS INTEGER) "
        "AS item, t FROM events JOIN kept_users USING (u) JOIN kept_items USING (i) "
        "ORDER BY user, t, seq")  # user: 4 bytes of sort key, not 8
    progress(f"sorting {int(offsets[-1]):,} events by user, time and file order")
    reader = _arrow_reader(result, OUTPUT_ROWS)
    position = 0
    progress.restart_rows()
    for batch in reader:
      if position == 0:
        progress("sorted; writing the event files")
      user = batch.column(0).to_numpy()
      item = batch.column(1).to_numpy()
      time = batch.column(2).to_numpy()
      if user.shape[0]:  # sorted by user: the batch's users are one range
        first, stop = int(user[0]), int(user[-1]) + 1
        for index, threshold in enumerate(thresholds):
          counts[index][first:stop] += np.bincount(user[time < threshold] - first,
                                                   minlength=stop - first)
      start = position
      position += user.shape[0]
      progress.rows(position, f"written {position:,} of {int(offsets[-1]):,} sorted events")
      for shard in range(num_shards):  # the parts of this batch in each shard
        low, high = max(start, rows[shard]), min(position, rows[shard + 1])
        if low < high:
          streams["items"][shard].write(item[low - start:high - start])
          streams["timestamps"][shard].write(time[low - start:high - start])
    for shard_streams in streams.values():
      for stream in shard_streams:
        stream.close()
  except BaseException:
    for shard_streams in streams.values():
      for stream in shard_streams:
        if not stream._file.closed:  # pylint: disable=protected-access
          stream.abort()
    raise
  return counts


# --------------------------------------------------------------------------- #
# The whole preparation                                                        #
# --------------------------------------------------------------------------- #


def prepare_scan(scan: files_lib.FileScan, out: str | os.PathLike, *, dataset: str,
                 min_item_count: int = 1, min_user_count: int = 1, split: str = "loo",
                 split_options: Mapping | None = None,
                 source_options: Mapping | None = None,
                 seq_lens: tuple[int, ...] = (200,), num_shards: int = 1,
                 memory_limit: str | int | None = None,
                 temp_dir: str | os.PathLike | None = None,
                 threads: int | None = None) -> dict:
  """Prepares the files of ``scan`` into ``out`` out of core; the same folder as in memory.

  Args:
    scan: the files and how to read them (:func:`trainer.data.files.scan_files`).
    out: output folder, local or a URL (``gs://...``); any manifest in it is
      removed first.
    dataset, min_item_count, min_user_count, split, split_options,
      source_options, seq_lens, num_shards: see
      :func:`trainer.data.prepare.prepare_dataset`.
    memory_limit: DuckDB's memory limit (``"4GB"``, bytes); None:
      :func:`default_memory_limit`.
    temp_dir: a local folder for DuckDB's database and spill files (a fresh
      folder is made inside it and removed at the end); None: the system's
      temporary folder.
    threads: DuckDB threads; None: every core.

  Returns:
    The manifest written to ``out/manifest.json``.

  Raises:
    FileNotFoundError, DataError, DataTypeError, ValueError: as the
      in-memory path, with the same messages (a message about a batch of a
      large parquet file counts that batch's rows).
  """
  import duckdb  # pylint: disable=import-outside-toplevel

  progress = _Progress()
  storage.remove_manifest(out)
  limit = default_memory_limit() if memory_limit is None else parse_memory_limit(memory_limit)
  split_options = dict(split_options or {})
  if split == "gts":  # checked before anything is read
    splits.gts_boundaries(0, **split_options)
  if temp_dir is not None:
    os.makedirs(temp_dir, exist_ok=True)
  work = tempfile.mkdtemp(prefix="cutbce-prepare-", dir=temp_dir)
  try:
    connection = duckdb.connect(os.path.join(work, "prepare.duckdb"),
                                config=duckdb_settings(work, limit, threads))
    try:
      rows, users, items = _load(connection, scan, progress)
      _remap(connection, min_item_count=min_item_count, min_user_count=min_user_count,
             users=users, items=items, name=scan.name, rows=rows)
      per_user = _arrow_table(connection.sql("SELECT n, t_max FROM kept_users ORDER BY dense"))
      lengths = per_user.column(0).to_numpy().astype(np.int64)
      t_max = per_user.column(1).to_numpy()
      del per_user
      offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
      storage.shard_bounds(offsets, num_shards)  # a bad count fails before the sort
      bounds = (splits.gts_boundaries(int(t_max.max()) + 1, **split_options)
                if split == "gts" else None)
      names = ("train_end", "test_start_minus_gap", "test_start", "validation_start")
      thresholds = [bounds[name] for name in names] if bounds else []
      progress(f"{lengths.shape[0]:,} users and their {int(offsets[-1]):,} events kept, "
               "dense ids given")
      counts = _write_events(connection, out, offsets=offsets, num_shards=num_shards,
                             thresholds=thresholds, progress=progress)
      user_ids = _raw_ids(connection, "kept_users", "u", users)
      item_ids = _raw_ids(connection, "kept_items", "i", items)
    finally:
      connection.close()
  finally:
    shutil.rmtree(work, ignore_errors=True)
  parts = splits.split_from_counts(split, lengths, dict(zip(names, counts)), bounds)
  manifest = storage.build_manifest(
      dataset=dataset, source_options=source_options, raw_interactions=rows,
      min_item_count=min_item_count, min_user_count=min_user_count, parts=parts,
      num_users=lengths.shape[0], num_items=item_ids.shape[0],
      num_interactions=int(offsets[-1]), seq_lens=seq_lens)
  n = int(offsets[-1])
  arrays = {"items": storage.Written("int32", n), "timestamps": storage.Written("int64", n),
            "offsets": offsets, "train_lengths": parts.train_lengths,
            "validation": parts.validation, "test": parts.test,
            "user_ids": user_ids, "item_ids": item_ids}
  storage.write_prepared(out, arrays, manifest, num_shards=num_shards)
  progress(f"wrote {out}")
  return storage.load_prepared(out).manifest
