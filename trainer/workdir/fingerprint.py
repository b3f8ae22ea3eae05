"""The run's record of its item-id map: WORKDIR/data_fingerprint.json.

A checkpoint's table row v is the item of dense id v. Re-preparing changed raw
data (an item renamed, added or dropped) can give row v another item with the
same shapes, and a resume would train on, silently, with rows that now name
other items. So the first start records a SHA-256 of the item-id map (every
raw id in dense order) and the item count; a resume, evaluate, recommend or
export compares, and refuses data that differs, naming what changed.
"""

from __future__ import annotations

import hashlib
import json
import os

import numpy as np

from trainer.workdir import paths
from trainer.config.schema import ConfigError

FILE = "data_fingerprint.json"


def of(item_ids: np.ndarray) -> dict:
  """`{"num_items", "item_ids_sha256"}` of a `[V]` raw item-id array (ints or strings)."""
  ids = np.asarray(item_ids)
  digest = hashlib.sha256()
  # Strings (fixed-width <U of older folders, variable-width StringDType, or
  # object) hash alike: each id as UTF-8 with its length, no padding.
  if ids.dtype.kind in "USTO":
    for value in ids.tolist():
      raw = str(value).encode("utf-8")
      digest.update(len(raw).to_bytes(8, "little") + raw)
  else:
    digest.update(np.ascontiguousarray(ids, dtype="<i8").tobytes())
  return {"num_items": int(ids.shape[0]), "item_ids_sha256": digest.hexdigest()}


def _advice(prepared: str | os.PathLike | None) -> str:
  """What to do: the raw data back, and the preparation of the changed data gone."""
  if prepared is None:
    return ("Restore the raw data the run was prepared from and prepare it again, or start "
            "a new workdir")
  return (f"Restore the raw data the run was prepared from and delete {prepared} (it holds "
          "the preparation of the changed data; the next start prepares it again from the "
          "restored raw data), or start a new workdir")


def check(workdir: str | os.PathLike, item_ids: np.ndarray,
          prepared: str | os.PathLike | None = None) -> dict:
  """Compares the data's fingerprint with the run's record; returns the data's.

  Args:
    workdir: the run's directory.
    item_ids: `[V]` raw item ids of the prepared data, in dense order.
    prepared: the prepared-data folder, named in the advice.

  Raises:
    ConfigError: the run recorded another item-id map (one line).
    WorkdirError: the record is a folder or not JSON (one line).
  """
  current = of(item_ids)
  target = paths.as_path(workdir) / FILE
  if not target.exists():
    return current
  recorded = paths.read_json(target, "record of its item ids")
  if recorded != current:
    digests = (f"sha256 {current['item_ids_sha256'][:12]}, was "
               f"{str(recorded.get('item_ids_sha256'))[:12]}")
    was = recorded.get("num_items")
    if isinstance(was, int) and was != current["num_items"]:
      raise ConfigError(
          f"the prepared data has {current['num_items']:,} items and this run was trained on "
          f"{was:,} (the item count changed from {was:,} to {current['num_items']:,}; "
          f"{digests}): the raw data "
          f"changed since the run was prepared. {_advice(prepared)}")
    what = f"the same {current['num_items']} items, other raw ids or another order"
    raise ConfigError(
        f"the prepared data's item-id map differs from the one this run trained on ({what}; "
        f"{digests}): the checkpoint's table rows would name "
        f"other items. {_advice(prepared)}")
  return current


def record(workdir: str | os.PathLike, fingerprint: dict) -> None:
  """Writes WORKDIR/data_fingerprint.json atomically (once the state is built or restored)."""
  target = paths.as_path(workdir) / FILE
  temporary = target.parent / f".{FILE}.tmp-{os.getpid()}"
  temporary.write_text(json.dumps(fingerprint, sort_keys=True) + "\n")
  temporary.replace(target)
