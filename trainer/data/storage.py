"""On-disk format of a prepared dataset: ``.npy`` arrays plus a JSON manifest.

A prepared dataset is a folder::

  manifest.json          counts, options, split parameters, array list
  items.npy              int32 [n]      dense item ids, user-major, time order
  timestamps.npy         int64 [n]
  offsets.npy            int64 [U + 1]  user u = rows offsets[u]:offsets[u+1]
  train_lengths.npy      int64 [U]      training prefix length per user
  validation.npy         int64 [K, 4]   (user, history_length, target_start,
  test.npy               int64 [K, 4]    target_end), relative to offsets[user]
  user_ids.npy           int64 or <U [U]  raw id of each dense user
  item_ids.npy           int64 or <U [V]  raw id of each dense item

Raw ids: ``PreparedDataset.item_ids[v]`` is the raw id of dense item ``v``
(``user_ids[u]`` of dense user ``u``), as the source had it: int64 for integer
ids, numpy unicode (``<U``, fixed width) for string ids (``.item()`` /
``.tolist()`` give Python ``int`` / ``str``). Both files load with
``np.load(path, allow_pickle=False)``, so tools outside the trainer can read
the id maps.

The folder is an ``etils.epath`` path: local, or on object storage
(``gs://bucket/prepared``, through fsspec and ``gcsfs``). From a local folder
the arrays are read memory-mapped (``np.load(mmap_mode="r")``): only the
pages used are read, and the processes of one machine share them. Memory
mapping needs a local file, so from a remote folder every array is read
whole into memory (each process holds its own copy; on a TPU VM the host
memory is ample: 50M events take 0.6 GB, int32 items and int64 times).

Writes are atomic: each file is written under a temporary name and renamed,
the manifest last, and any previous manifest is removed first, so a folder
with a manifest always holds a complete dataset and a failed preparation
leaves no manifest behind (on object storage a rename is a copy, and each
upload is all or nothing: the manifest still comes last).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping

import numpy as np
from etils import epath

from trainer import paths

MANIFEST = "manifest.json"
FORMAT = "cutbce-prepared"
VERSION = 1
ARRAYS = {  # name -> (dtype, rank)
    "items": ("int32", 1), "timestamps": ("int64", 1),
    "offsets": ("int64", 1), "train_lengths": ("int64", 1),
    "validation": ("int64", 2), "test": ("int64", 2),
    "user_ids": ("int64", 1), "item_ids": ("int64", 1),
}
# Raw-id arrays: int64 as in ARRAYS, or numpy unicode ("<U...") for string ids.
RAW_ID_ARRAYS = ("user_ids", "item_ids")


def _dtype_ok(name: str, dtype: np.dtype) -> bool:
  if name in RAW_ID_ARRAYS and dtype.kind == "U":
    return True
  return dtype == np.dtype(ARRAYS[name][0])


@dataclasses.dataclass(frozen=True, slots=True)
class PreparedDataset:
  """A prepared dataset opened for reading (arrays memory-mapped from a local folder).

  Attributes:
    path: the folder.
    manifest: the parsed manifest.
    items, timestamps, offsets, train_lengths, validation, test: the arrays
      listed in the module docstring.
    user_ids: ``[U]`` raw id of each dense user (int64, or ``<U`` for string
      ids): ``user_ids[u]`` is dense user ``u``'s id in the source.
    item_ids: ``[V]`` raw id of each dense item: ``item_ids[v]`` is dense item
      ``v``'s id in the source (what recommendations and exports report).
  """

  path: epath.Path
  manifest: dict
  items: np.ndarray
  timestamps: np.ndarray
  offsets: np.ndarray
  train_lengths: np.ndarray
  validation: np.ndarray
  test: np.ndarray
  user_ids: np.ndarray
  item_ids: np.ndarray

  @property
  def num_users(self) -> int:
    return int(self.offsets.shape[0] - 1)

  @property
  def num_items(self) -> int:
    """V: item ids are in ``[0, V)``; V is also the input padding id."""
    return int(self.item_ids.shape[0])

  def examples(self, split: str) -> np.ndarray:
    """int64 ``[K, 4]`` evaluation examples of ``"validation"`` or ``"test"``."""
    if split not in ("validation", "test"):
      raise ValueError(
          f"unknown evaluation split {split!r}; expected 'validation' or 'test'")
    return getattr(self, split)


def remove_manifest(path: str | os.PathLike) -> None:
  """Deletes the manifest of ``path`` if any, marking the folder incomplete."""
  (paths.as_path(path) / MANIFEST).unlink(missing_ok=True)


def _write_atomic(target: epath.Path, write) -> None:
  """Writes through ``write(file)`` to a temporary name, then renames."""
  temporary = target.with_name(f".{target.name}.tmp-{os.getpid()}")
  try:
    with temporary.open("wb") as file:
      write(file)
      file.flush()
      if not paths.is_remote(target):
        os.fsync(file.fileno())
    temporary.replace(target)
  finally:
    if temporary.exists():
      temporary.unlink()


def write_prepared(path: str | os.PathLike, arrays: Mapping[str, np.ndarray],
                   manifest: Mapping) -> epath.Path:
  """Writes a prepared dataset atomically (manifest last).

  Args:
    path: output folder (created if needed), local or ``gs://...``.
    arrays: every name of :data:`ARRAYS` to its array (the raw-id arrays
      may also be numpy unicode ``<U``).
    manifest: JSON-serializable metadata; the array table and format version
      are added.

  Returns:
    The folder.

  Raises:
    ValueError: a missing array or one of the wrong dtype or rank.
  """
  folder = paths.as_path(path)
  missing = sorted(set(ARRAYS) - set(arrays))
  if missing:
    raise ValueError(f"arrays {missing} missing; expected {sorted(ARRAYS)}")
  table = {}
  for name, (dtype, rank) in ARRAYS.items():
    array = arrays[name]
    if not _dtype_ok(name, array.dtype) or array.ndim != rank:
      expected = f"{dtype} (or <U)" if name in RAW_ID_ARRAYS else dtype
      raise ValueError(f"array {name!r} is {array.dtype} rank {array.ndim}; "
                       f"expected {expected} rank {rank}")
    table[name] = {"file": f"{name}.npy",
                   "dtype": str(array.dtype) if array.dtype.kind == "U" else dtype,
                   "shape": list(array.shape)}
  folder.mkdir(parents=True, exist_ok=True)
  remove_manifest(folder)
  for name in ARRAYS:
    _write_atomic(folder / table[name]["file"],
                  lambda file, a=arrays[name]: np.save(file, a))
  full = {"format": FORMAT, "version": VERSION, **manifest, "arrays": table}
  text = json.dumps(full, indent=2, sort_keys=True).encode()
  _write_atomic(folder / MANIFEST, lambda file: file.write(text))
  return folder


def load_prepared(path: str | os.PathLike) -> PreparedDataset:
  """Opens a prepared dataset: memory-mapped from a local folder, read from a remote one.

  Memory mapping (``np.load(mmap_mode="r")``) works only on a local file, so
  the arrays of a local folder are mapped, not read, and those of a remote
  one (``gs://...``) are read whole into this process's memory.

  Args:
    path: folder written by :func:`write_prepared`, local or ``gs://...``.

  Returns:
    :class:`PreparedDataset`.

  Raises:
    FileNotFoundError: no manifest (never prepared, or preparation failed).
    ValueError: a manifest of another format or version, or an array whose
      dtype or shape differs from the manifest.
  """
  folder = paths.as_path(path)
  manifest_path = folder / MANIFEST
  if not manifest_path.is_file():
    raise FileNotFoundError(
        f"no {MANIFEST} in {folder}: the dataset was not prepared there or its "
        "preparation failed; run `python -m trainer.data --out "
        f"{folder} ...` first")
  manifest = json.loads(manifest_path.read_text())
  if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
    raise ValueError(
        f"{manifest_path} has format {manifest.get('format')!r} version "
        f"{manifest.get('version')!r}; expected {FORMAT!r} version {VERSION}")
  arrays = {}
  for name, entry in manifest["arrays"].items():
    array = _load_array(folder / entry["file"])
    if str(array.dtype) != entry["dtype"] or list(array.shape) != entry["shape"]:
      raise ValueError(
          f"{entry['file']} in {folder} is {array.dtype} {list(array.shape)}; "
          f"the manifest expects {entry['dtype']} {entry['shape']}")
    arrays[name] = array
  return PreparedDataset(path=folder, manifest=manifest, **arrays)


def _load_array(file: epath.Path) -> np.ndarray:
  """A ``.npy`` file: memory-mapped when local, read into memory when remote."""
  if not paths.is_remote(file):
    return np.load(os.fspath(file), mmap_mode="r", allow_pickle=False)
  with file.open("rb") as handle:
    return np.load(handle, allow_pickle=False)
