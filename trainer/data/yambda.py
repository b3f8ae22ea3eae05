"""Yambda (Yandex music) interactions from a local folder of parquet files.

Users download Yambda themselves (e.g. the ``flat/50m`` folder) and pass the
folder. Files and columns read:

* ``likes.parquet``: ``uid``, ``item_id``, ``timestamp``.
* ``listens.parquet``: the same plus ``played_ratio_pct``; listens below
  ``min_played_ratio`` percent (50 in the benchmark protocol) are dropped.
* ``multi_event.parquet``: the same columns; ``played_ratio_pct`` is null for
  events other than listens, and those events are kept.

Id and timestamp columns must have an integer dtype (Yambda uses uint32).
"""

from __future__ import annotations

import os
import pathlib

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from trainer.data import sources

EVENTS = ("likes", "listens", "multi_event")
ID_COLUMNS = ("uid", "item_id", "timestamp")
RATIO_COLUMN = "played_ratio_pct"


def _check_schema(schema: pa.Schema, path: pathlib.Path,
                  required: tuple[str, ...]) -> None:
  """Raises if a required column is missing or not an integer column."""
  missing = [name for name in required if name not in schema.names]
  if missing:
    raise ValueError(
        f"{path} lacks columns {missing}; found {schema.names}, expected "
        f"{list(required)}")
  for name in required:
    kind = schema.field(name).type
    if not pa.types.is_integer(kind):
      raise TypeError(
          f"column {name!r} of {path} has type {kind}; expected an integer "
          "type (uint32, int64, ...)")


def load_yambda(path: str | os.PathLike, event: str = "listens",
                min_played_ratio: int = 50) -> sources.Interactions:
  """Loads one Yambda event file.

  Args:
    path: folder holding ``<event>.parquet``.
    event: one of ``likes``, ``listens``, ``multi_event``.
    min_played_ratio: keep listens with ``played_ratio_pct >=`` this (0 keeps
      every listen). Ignored for likes.

  Returns:
    Interactions in file order, ``uid`` as user, ``item_id`` as item.

  Raises:
    ValueError: unknown event, missing folder, file or column, or no rows left.
    TypeError: an id, timestamp or ratio column that is not integer.
  """
  if event not in EVENTS:
    raise ValueError(f"unknown Yambda event {event!r}; expected one of {EVENTS}")
  folder = pathlib.Path(path).expanduser()
  if not folder.is_dir():
    raise FileNotFoundError(
        f"Yambda folder {folder} does not exist; expected a folder holding "
        f"{event}.parquet")
  file = folder / f"{event}.parquet"
  if not file.is_file():
    found = sorted(p.name for p in folder.glob("*.parquet"))
    raise FileNotFoundError(
        f"{file} not found; the folder holds {found or 'no parquet files'}, "
        f"expected {[e + '.parquet' for e in EVENTS]}")
  schema = pq.read_schema(file)
  with_ratio = event == "listens" or (event == "multi_event"
                                      and RATIO_COLUMN in schema.names)
  columns = ID_COLUMNS + ((RATIO_COLUMN,) if with_ratio else ())
  _check_schema(schema, file, columns)
  table = pq.read_table(file, columns=list(columns))
  if with_ratio and min_played_ratio > 0:
    ratio = table[RATIO_COLUMN]
    keep = pc.greater_equal(ratio, min_played_ratio)
    if event == "multi_event":  # non-listen events have no ratio: keep them.
      keep = pc.or_kleene(keep, pc.is_null(ratio))
    table = table.filter(pc.fill_null(keep, False))
  if table.num_rows == 0:
    raise ValueError(
        f"{file} has no interactions left after filtering with "
        f"min_played_ratio={min_played_ratio}; expected at least one row")
  for name in ID_COLUMNS:
    if table[name].null_count:
      raise ValueError(f"column {name!r} of {file} has "
                       f"{table[name].null_count} nulls; expected none")

  def as_int64(name: str) -> np.ndarray:
    return table[name].to_numpy().astype(np.int64, copy=False)

  return sources.Interactions(
      user=as_int64("uid"), item=as_int64("item_id"),
      timestamp=as_int64("timestamp"), name=f"yambda/{event}")
