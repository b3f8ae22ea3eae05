"""On-disk format of a prepared dataset: ``.npy`` arrays plus a JSON manifest.

A prepared dataset is a folder::

  manifest.json          counts, options, split parameters, array list
  items.npy              int32 [n]      dense item ids, user-major, time order
  timestamps.npy         int64 [n]
  offsets.npy            int64 [U + 1]  user u = rows offsets[u]:offsets[u+1]
  train_lengths.npy      int64 [U]      training prefix length per user
  validation.npy         int64 [K, 4]   (user, history_length, target_start,
  test.npy               int64 [K, 4]    target_end), relative to offsets[user]
  user_ids.npy           int64 [U]        raw id of each dense user (integer ids)
  item_ids.npy           int64 [V]        raw id of each dense item (integer ids)
  item_ids.utf8.npy      uint8 [bytes]    string ids: every id's UTF-8, concatenated
  item_ids.offsets.npy   int64 [V + 1]    id v = utf8[offsets[v]:offsets[v + 1]]
                                          (user_ids.utf8.npy, .offsets.npy alike)

Raw ids: ``PreparedDataset.item_ids[v]`` is the raw id of dense item ``v``
(``user_ids[u]`` of dense user ``u``), as the source had it: int64 for integer
ids, a variable-width numpy string array (``StringDType``) for string ids
(``.tolist()`` gives Python ``int`` / ``str``; an element of a string array
is already a Python ``str``). String ids are
stored unpadded, as one UTF-8 blob and int64 offsets (manifest dtype
``"utf8"``), so one long id costs its own bytes, not its length times the
catalog (a fixed-width ``<U`` array pads every id to the longest: one 1 MB id
made a 61-item map 244 MB). Folders of version 1, whose string ids are ``<U``
``.npy`` files, still load (as ``<U`` arrays). Every file loads with
``np.load(path, allow_pickle=False)``, so tools outside the trainer can read
the id maps.

The folder is an ``etils.epath`` path: local, or on object storage
(``gs://bucket/prepared``, through fsspec and ``gcsfs``). From a local folder
the arrays are read memory-mapped (``np.load(mmap_mode="r")``): only the
pages used are read, and the processes of one machine share them. Memory
mapping needs a local file, so from a remote folder every array is read
whole into memory (each process holds its own copy; on a TPU VM the host
memory is ample: 50M events take 0.6 GB, int32 items and int64 times).

Shards. Prepared with ``num_shards`` S > 1, the two event arrays are cut
by user into S files each, ``items-00000-of-00004.npy`` (and
``timestamps-...``): shard s holds users ``shards.users[s]:users[s + 1]``,
rows ``shards.rows[s]:rows[s + 1]`` (contiguous ranges of dense users,
cut so that every shard holds about n / S events). The manifest's
``shards`` entry is the index, and its ``arrays`` entries of ``items`` and
``timestamps`` list the shard files instead of one file. The loader gives
:class:`ShardedRows` for them: global row indexing like an array, each shard
file opened on first use, so a process that reads only its users' rows
opens only their shards. With S = 1 (the default) the folder is exactly the
single-file layout above.

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
import pathlib
from collections.abc import Mapping

import numpy as np
from etils import epath

from trainer.workdir import outputs, paths
from trainer.data import splits, windows
from trainer.data.sources import DataError

MANIFEST = "manifest.json"
FORMAT = "cutbce-prepared"
VERSION = 2
READABLE_VERSIONS = (1, 2)  # 1: string ids as fixed-width <U .npy
STRING_IDS = "utf8"  # manifest dtype of string ids stored as UTF-8 blob + offsets
ARRAYS = {  # name -> (dtype, rank)
    "items": ("int32", 1), "timestamps": ("int64", 1),
    "offsets": ("int64", 1), "train_lengths": ("int64", 1),
    "validation": ("int64", 2), "test": ("int64", 2),
    "user_ids": ("int64", 1), "item_ids": ("int64", 1),
}
# Raw-id arrays: int64 as in ARRAYS, or strings (numpy StringDType or <U in
# memory; UTF-8 blob + offsets on disk). Object arrays are refused (they may
# hold anything).
RAW_ID_ARRAYS = ("user_ids", "item_ids")


def is_string_ids(dtype: np.dtype) -> bool:
  """Whether raw ids of ``dtype`` are strings (``<U`` or ``StringDType``)."""
  return np.dtype(dtype).kind in "UT"


def encode_strings(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """``(utf8, offsets)`` of ``[K]`` string ids: uint8 ``[bytes]``, int64 ``[K + 1]``.

  Example:
    >>> utf8, offsets = encode_strings(np.array(["a", "bé"]))
    >>> offsets.tolist(), bytes(utf8).decode()
    ([0, 1, 4], 'abé')
  """
  encoded = [str(value).encode("utf-8") for value in np.asarray(ids).tolist()]
  offsets = np.zeros(len(encoded) + 1, np.int64)
  np.cumsum([len(raw) for raw in encoded], out=offsets[1:])
  return np.frombuffer(b"".join(encoded), np.uint8), offsets


def decode_strings(utf8: np.ndarray, offsets: np.ndarray, where: str = "") -> np.ndarray:
  """The ``[K]`` string ids (numpy ``StringDType``) of :func:`encode_strings`' output.

  Raises:
    ValueError: offsets that are not ``[K + 1]`` non-decreasing from 0 to the
      blob's length, or bytes that are not UTF-8 (``where`` names the files).
  """
  utf8, offsets = np.asarray(utf8), np.asarray(offsets)
  if (utf8.ndim != 1 or utf8.dtype != np.uint8 or offsets.ndim != 1
      or not np.issubdtype(offsets.dtype, np.integer) or offsets.shape[0] < 1
      or offsets[0] != 0 or offsets[-1] != utf8.shape[0] or np.any(np.diff(offsets) < 0)):
    raise ValueError(f"string ids {where}: expected a uint8 blob and int64 offsets from 0 "
                     f"to its {utf8.shape[0]} bytes, non-decreasing")
  blob = bytes(utf8)
  try:
    values = [blob[start:stop].decode("utf-8")
              for start, stop in zip(offsets[:-1].tolist(), offsets[1:].tolist())]
  except UnicodeDecodeError as error:
    raise ValueError(f"string ids {where}: not UTF-8 ({error})") from None
  return np.array(values, dtype=np.dtypes.StringDType())


# Event arrays: [n], cut into shards by user when num_shards > 1.
EVENT_ARRAYS = ("items", "timestamps")


def shard_file(name: str, shard: int, num_shards: int) -> str:
  """File name of shard ``shard`` of ``name``: ``items-00001-of-00004.npy``."""
  return f"{name}-{shard:05d}-of-{num_shards:05d}.npy"


def shard_bounds(offsets: np.ndarray, num_shards: int) -> np.ndarray:
  """int64 ``[S + 1]`` user bounds cutting the users into S shards of about n / S events.

  Shard s holds users ``bounds[s]:bounds[s + 1]`` (contiguous dense ids);
  its rows are ``offsets[bounds[s]]:offsets[bounds[s + 1]]``.

  Raises:
    ValueError: ``num_shards`` below 1 or above the number of users.

  Example:
    >>> shard_bounds(np.array([0, 5, 6, 10, 12]), 2).tolist()
    [0, 2, 4]
  """
  offsets = np.asarray(offsets, np.int64)
  users = offsets.shape[0] - 1
  if num_shards == 1 and not isinstance(num_shards, bool):
    return np.array([0, users], np.int64)
  if isinstance(num_shards, bool) or int(num_shards) != num_shards or not 1 <= num_shards <= users:
    raise ValueError(f"num_shards={num_shards!r}: expected an integer in [1, {users}] "
                     f"(at most the number of users, {users})")
  targets = offsets[-1] * np.arange(1, num_shards) // num_shards
  inner = np.searchsorted(offsets, targets, side="left")
  bounds = np.concatenate([[0], inner, [users]]).astype(np.int64)
  # At least one user per shard, in increasing order.
  for s in range(1, num_shards):
    bounds[s] = max(bounds[s], bounds[s - 1] + 1)
  for s in range(num_shards - 1, 0, -1):
    bounds[s] = min(bounds[s], bounds[s + 1] - 1)
  return bounds


def npy_header(dtype: np.dtype, shape: tuple[int, ...]) -> bytes:
  """The ``.npy`` header ``np.save`` writes for an array of ``dtype`` and ``shape``."""
  import io  # pylint: disable=import-outside-toplevel
  buffer = io.BytesIO()
  header = np.lib.format.header_data_from_array_1_0(np.empty(0, dtype))
  header["shape"] = tuple(int(d) for d in shape)
  np.lib.format.write_array_header_1_0(buffer, header)
  return buffer.getvalue()


class NpyStream:
  """Writes a 1-D ``.npy`` file in pieces, under a temporary name renamed at ``close``.

  The file is byte-identical to ``np.save`` of the concatenated pieces.

  Raises (at ``close``):
    ValueError: the pieces do not add up to the declared length.
  """

  def __init__(self, target: epath.Path, dtype, length: int):
    self.target = target
    self.dtype = np.dtype(dtype)
    self.length = int(length)
    self.written = 0
    self._temporary = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    self._file = self._temporary.open("wb")
    self._file.write(npy_header(self.dtype, (self.length,)))

  def write(self, values: np.ndarray) -> None:
    values = np.ascontiguousarray(values, self.dtype)
    self._file.write(values.tobytes())
    self.written += values.shape[0]

  def close(self) -> None:
    """Completes the file (renamed to its name)."""
    if self.written != self.length:
      self.abort()
      raise ValueError(f"{self.target}: {self.written} values written, {self.length} declared")
    self._file.flush()
    if not paths.is_remote(self.target):
      os.fsync(self._file.fileno())
    self._file.close()
    self._temporary.replace(self.target)

  def abort(self) -> None:
    """Drops the temporary file."""
    self._file.close()
    if self._temporary.exists():
      self._temporary.unlink()


def _dtype_ok(name: str, dtype: np.dtype) -> bool:
  if name in RAW_ID_ARRAYS and is_string_ids(dtype):
    return True
  return dtype == np.dtype(ARRAYS[name][0])


@dataclasses.dataclass(frozen=True, slots=True)
class PreparedDataset:
  """A prepared dataset opened for reading (arrays memory-mapped from a local folder).

  Attributes:
    path: the folder.
    manifest: the parsed manifest.
    items, timestamps, offsets, train_lengths, validation, test: the arrays
      listed in the module docstring (``items`` and ``timestamps`` are
      :class:`ShardedRows` when the folder holds shards).
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
  def num_shards(self) -> int:
    """S, the number of user shards of the event arrays (1: one file each)."""
    return int(self.manifest.get("shards", {}).get("count", 1))

  @property
  def shard_users(self) -> np.ndarray:
    """int64 ``[S + 1]``: shard s holds dense users ``shard_users[s]:shard_users[s + 1]``."""
    if "shards" in self.manifest:
      return np.asarray(self.manifest["shards"]["users"], np.int64)
    return np.array([0, self.num_users], np.int64)

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


def build_manifest(*, dataset: str, source_options: Mapping | None, raw_interactions: int,
                   min_item_count: int, min_user_count: int, parts: splits.Split,
                   num_users: int, num_items: int, num_interactions: int,
                   seq_lens: tuple[int, ...]) -> dict:
  """The manifest of a preparation (before :func:`write_prepared` adds the array table).

  Every preparation path (in memory, :mod:`trainer.data.prepare`, or out of
  core, :mod:`trainer.data.engine`) builds it here, so the same data gives the
  same manifest.
  """
  validation, test = parts.validation, parts.test
  history = np.concatenate([validation[:, 1], test[:, 1]])
  return {
      "dataset": dataset,
      "source_options": {k: (str(v) if isinstance(v, pathlib.PurePath) else v)
                         for k, v in dict(source_options or {}).items()},
      "raw_interactions": int(raw_interactions),
      "min_item_count": int(min_item_count),
      "min_user_count": int(min_user_count),
      "split": {"kind": parts.kind, **parts.params},
      "num_users": int(num_users),
      "num_items": int(num_items),
      "num_interactions": int(num_interactions),
      "train_interactions": int(parts.train_lengths.sum()),
      "validation_examples": int(validation.shape[0]),
      "test_examples": int(test.shape[0]),
      "max_train_length": _max_or_zero(parts.train_lengths),
      "max_history": _max_or_zero(history),
      "max_validation_targets": _max_or_zero(validation[:, 3] - validation[:, 2]),
      "max_test_targets": _max_or_zero(test[:, 3] - test[:, 2]),
      "train_windows": {str(int(n)): windows.num_train_windows(parts.train_lengths, n)
                        for n in seq_lens},
  }


def _max_or_zero(values: np.ndarray) -> int:
  return int(values.max()) if values.size else 0


def read_manifest(path: str | os.PathLike) -> dict:
  """The parsed manifest at ``path``.

  Raises:
    DataError: it is not a JSON object (a truncated or foreign file), one line.
  """
  text = paths.as_path(path).read_text()
  try:
    manifest = json.loads(text)
  except ValueError as error:
    raise DataError(f"{path} is not JSON ({error}): not a manifest this project wrote; "
                    "move it away and prepare again, or name another folder") from None
  if not isinstance(manifest, dict):
    raise DataError(f"{path} holds JSON {type(manifest).__name__}, not a manifest object; "
                    "move it away and prepare again, or name another folder")
  return manifest


def remove_manifest(path: str | os.PathLike) -> None:
  """Sets the manifest of ``path`` aside if any, marking the folder incomplete.

  It is renamed, not deleted (``trainer.workdir.outputs.retire_manifest``):
  the folder stays known as a preparation's, so a preparation killed before
  its new manifest is written can be run again into the same folder.
  """
  outputs.retire_manifest(path)


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


@dataclasses.dataclass(frozen=True, slots=True)
class Written:
  """Stands for an event array the caller already wrote (with :class:`NpyStream`).

  Attributes:
    dtype: its dtype name (``"int32"``, ``"int64"``).
    length: n, its number of rows.
  """

  dtype: str
  length: int

  @property
  def shape(self) -> tuple[int]:
    return (self.length,)

  @property
  def ndim(self) -> int:
    return 1


def event_files(name: str, num_shards: int) -> list[str]:
  """The files of event array ``name``: one, or one per shard."""
  if num_shards == 1:
    return [f"{name}.npy"]
  return [shard_file(name, s, num_shards) for s in range(num_shards)]


def write_prepared(path: str | os.PathLike, arrays: Mapping[str, np.ndarray],
                   manifest: Mapping, *, num_shards: int = 1) -> epath.Path:
  """Writes a prepared dataset atomically (manifest last).

  Args:
    path: output folder (created if needed), local or ``gs://...``.
    arrays: every name of :data:`ARRAYS` to its array (the raw-id arrays
      may also be numpy unicode ``<U``); an event array (``items``,
      ``timestamps``) may be :class:`Written`: already in the folder under
      the names of :func:`event_files`.
    manifest: JSON-serializable metadata; the array table and format version
      are added (and with ``num_shards`` > 1 the ``shards`` index).
    num_shards: S, the event arrays cut by user into S files (see the module
      docstring); 1 writes one file each.

  Returns:
    The folder.

  Raises:
    ValueError: a missing array or one of the wrong dtype or rank, or a bad
      ``num_shards``.
  """
  folder = paths.as_path(path)
  missing = sorted(set(ARRAYS) - set(arrays))
  if missing:
    raise ValueError(f"arrays {missing} missing; expected {sorted(ARRAYS)}")
  bounds = shard_bounds(arrays["offsets"], num_shards)
  rows = np.asarray(arrays["offsets"], np.int64)[bounds]
  table = {}
  for name, (dtype, rank) in ARRAYS.items():
    array = arrays[name]
    kind = np.dtype(array.dtype)
    if not _dtype_ok(name, kind) or array.ndim != rank:
      expected = f"{dtype} (or strings)" if name in RAW_ID_ARRAYS else dtype
      raise ValueError(f"array {name!r} is {kind} rank {array.ndim}; "
                       f"expected {expected} rank {rank}")
    entry = {"dtype": dtype, "shape": list(array.shape)}
    if name in RAW_ID_ARRAYS and is_string_ids(kind):
      entry.update(dtype=STRING_IDS, file=f"{name}.utf8.npy", offsets_file=f"{name}.offsets.npy")
    elif name in EVENT_ARRAYS and num_shards > 1:
      entry["files"] = event_files(name, num_shards)
    else:
      entry["file"] = f"{name}.npy"
    table[name] = entry
  folder.mkdir(parents=True, exist_ok=True)
  remove_manifest(folder)
  for name in ARRAYS:
    array = arrays[name]
    if isinstance(array, Written):
      continue
    if table[name]["dtype"] == STRING_IDS:
      utf8, offsets = encode_strings(array)
      _write_atomic(folder / table[name]["file"], lambda file, a=utf8: np.save(file, a))
      _write_atomic(folder / table[name]["offsets_file"],
                    lambda file, a=offsets: np.save(file, a))
    elif name in EVENT_ARRAYS and num_shards > 1:
      for file, start, stop in zip(table[name]["files"], rows[:-1], rows[1:]):
        _write_atomic(folder / file, lambda f, a=array[start:stop]: np.save(f, a))
    else:
      _write_atomic(folder / table[name]["file"], lambda file, a=array: np.save(file, a))
  full = {"format": FORMAT, "version": VERSION, **manifest, "arrays": table}
  if num_shards > 1:
    full["shards"] = {"count": int(num_shards), "users": bounds.tolist(),
                      "rows": rows.tolist()}
  text = json.dumps(full, indent=2, sort_keys=True).encode()
  _write_atomic(folder / MANIFEST, lambda file: file.write(text))
  outputs.drop_retired(folder)
  return folder


class ShardedRows:
  """A 1-D event array stored in shard files, read like one array by global row.

  ``rows[i]``, ``rows[a:b]`` and ``rows[index_array]`` take global rows;
  each shard file is opened (memory-mapped when local, read when remote) the
  first time a row of it is asked for. ``opened`` lists the shards opened.

  Attributes:
    files: the shard files, in shard order.
    starts: int64 ``[S + 1]`` first global row of each shard, then n.
  """

  def __init__(self, files: list[epath.Path], starts: np.ndarray, dtype: str):
    self.files = list(files)
    self.starts = np.asarray(starts, np.int64)
    self.dtype = np.dtype(dtype)
    self.shape = (int(self.starts[-1]),)
    self.ndim = 1
    self._shards: dict[int, np.ndarray] = {}

  def __len__(self) -> int:
    return self.shape[0]

  @property
  def opened(self) -> list[int]:
    """Shards opened so far, in increasing order."""
    return sorted(self._shards)

  def shard(self, index: int) -> np.ndarray:
    """Shard ``index`` as an array (opened on first use)."""
    if index not in self._shards:
      array = _load_array(self.files[index])
      expected = int(self.starts[index + 1] - self.starts[index])
      if array.dtype != self.dtype or array.shape != (expected,):
        raise ValueError(f"{self.files[index]} is {array.dtype} {list(array.shape)}; the "
                         f"manifest expects {self.dtype} [{expected}]")
      self._shards[index] = array
    return self._shards[index]

  def _take(self, index: np.ndarray) -> np.ndarray:
    index = np.asarray(index, np.int64)
    flat = index.reshape(-1)
    if flat.size and (flat.min() < 0 or flat.max() >= self.shape[0]):
      raise IndexError(f"row index out of range [0, {self.shape[0]})")
    which = np.searchsorted(self.starts, flat, side="right") - 1
    out = np.empty(flat.shape, self.dtype)
    for s in np.unique(which):
      mask = which == s
      out[mask] = self.shard(int(s))[flat[mask] - self.starts[s]]
    return out.reshape(index.shape)

  def __getitem__(self, key):
    if isinstance(key, slice):
      start, stop, step = key.indices(self.shape[0])
      if step != 1:
        return self._take(np.arange(start, stop, step))
      stop = max(start, stop)
      first = int(np.searchsorted(self.starts, start, side="right") - 1)
      last = int(np.searchsorted(self.starts, max(stop - 1, start), side="right") - 1)
      if start == stop:
        return np.empty(0, self.dtype)
      parts = [self.shard(s)[max(start, self.starts[s]) - self.starts[s]:
                             min(stop, self.starts[s + 1]) - self.starts[s]]
               for s in range(first, last + 1)]
      return parts[0] if len(parts) == 1 else np.concatenate(parts)
    if isinstance(key, (int, np.integer)):
      key = int(key) + (self.shape[0] if key < 0 else 0)
      return self._take(np.array([key]))[0]
    return self._take(key)

  def __array__(self, dtype=None, copy=None):
    del copy
    whole = self[0:self.shape[0]]
    return whole if dtype is None else whole.astype(dtype)


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
  manifest = read_manifest(manifest_path)
  if manifest.get("format") != FORMAT or manifest.get("version") not in READABLE_VERSIONS:
    raise ValueError(
        f"{manifest_path} has format {manifest.get('format')!r} version "
        f"{manifest.get('version')!r}; expected {FORMAT!r} version "
        f"{' or '.join(map(str, READABLE_VERSIONS))}")
  arrays = {}
  for name, entry in manifest["arrays"].items():
    if "files" in entry:  # an event array cut into shards: opened on first use
      arrays[name] = ShardedRows([folder / file for file in entry["files"]],
                                 manifest["shards"]["rows"], entry["dtype"])
      continue
    if entry["dtype"] == STRING_IDS:
      array = decode_strings(_load_array(folder / entry["file"]),
                             _load_array(folder / entry["offsets_file"]),
                             f"{entry['file']} and {entry['offsets_file']} in {folder}")
      if list(array.shape) != entry["shape"]:
        raise ValueError(f"{entry['file']} in {folder} holds {array.shape[0]} ids; the "
                         f"manifest expects {entry['shape'][0]}")
      arrays[name] = array
      continue
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
