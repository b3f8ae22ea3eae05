"""Yambda (Yandex music) interactions from a local folder of parquet files.

Users download Yambda themselves (e.g. the ``flat/50m`` folder) and pass the
folder. Yambda is a preset of the ``files`` source (:mod:`trainer.data.files`):
one file of the folder, its column names and its filter. Files and columns
read:

* ``likes.parquet``: ``uid``, ``item_id``, ``timestamp``.
* ``listens.parquet``: the same plus ``played_ratio_pct``; listens below
  ``min_played_ratio`` percent (50 in the benchmark protocol) are dropped
  (the filter ``played_ratio_pct>=<min_played_ratio>``).
* ``multi_event.parquet``: the same columns; ``played_ratio_pct`` is null for
  events other than listens, and those events are kept.

Yambda's ids and timestamps are integers (uint32); timestamps are read as
they are (``time_unit="s"``).
"""

from __future__ import annotations

import os
import pathlib

import pyarrow.parquet as pq

from trainer.data import files, sources

EVENTS = ("likes", "listens", "multi_event")
USER_COLUMN, ITEM_COLUMN, TIME_COLUMN = "uid", "item_id", "timestamp"
ID_COLUMNS = (USER_COLUMN, ITEM_COLUMN, TIME_COLUMN)
RATIO_COLUMN = "played_ratio_pct"


def load_yambda(path: str | os.PathLike, event: str = "listens",
                min_played_ratio: int = 50) -> sources.Interactions:
  """Loads one Yambda event file (see :func:`scan_yambda` for the arguments).

  Returns:
    Interactions in file order, ``uid`` as user, ``item_id`` as item.
  """
  return files.read_interactions(**scan_yambda(path, event, min_played_ratio)._asdict())


def scan_yambda(path: str | os.PathLike, event: str = "listens",
                min_played_ratio: int = 50) -> files.FileScan:
  """Loads one Yambda event file.

  Args:
    path: folder holding ``<event>.parquet``.
    event: one of ``likes``, ``listens``, ``multi_event``.
    min_played_ratio: keep listens with ``played_ratio_pct >=`` this (0 keeps
      every listen). Ignored for likes.

  Returns:
    The :class:`~trainer.data.files.FileScan` of the file: its columns, the
    played-ratio filter.

  Raises:
    FileNotFoundError: missing folder or file.
    ValueError: unknown event, missing column, or no rows left.
    TypeError: an id column that holds neither integers nor strings.
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
  with_ratio = event == "listens" or (
      event == "multi_event" and RATIO_COLUMN in pq.read_schema(file).names)
  condition = (f"{RATIO_COLUMN}>={int(min_played_ratio)}"
               if with_ratio and min_played_ratio > 0 else None)
  return files.FileScan(
      [file], user_col=USER_COLUMN, item_col=ITEM_COLUMN, time_col=TIME_COLUMN,
      filter=condition, time_unit="s",
      # Non-listen events have no ratio: keep them.
      filter_keeps_null=event == "multi_event", name=f"yambda/{event}")
