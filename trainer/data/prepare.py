"""End-to-end preparation: source -> filters and remap -> split -> disk.

Preparation is deterministic: the same source and options give
byte-identical files (the arrays and the manifest, which records no time,
host or process), whatever the process or its hash seed. So a folder
prepared once and read by every host, and a copy prepared by each host on its
own disk (``data.prepare_per_host``, under :func:`host_lock`), hold the same
data (``tests/trainer/test_data_storage.py`` hashes two preparations).
"""

from __future__ import annotations

import contextlib
import fcntl
import inspect
import json
import os
import pathlib
import shutil
from collections.abc import Mapping

from trainer.workdir import outputs, paths
from trainer.data import preprocess, sources, splits, storage

# Minimum interactions per item when the caller does not say: the SASRec
# preparation for MovieLens (>= 5), everything for Yambda, Ciao (its 10^5
# items are the point) and your own files, and the whole declared catalog for synthetic data. Other sources: 1.
class _OneUnlessListed(dict):
  """A dict whose missing keys read as 1."""

  def __missing__(self, key) -> int:
    return 1


DEFAULT_MIN_ITEM_COUNT: Mapping[str, int] = _OneUnlessListed({
    "ml-1m": 5, "ml-100k": 5, "yambda": 1, "ciao": 1, "synthetic": 0, "files": 1,
    "synthetic_topics": 0})
# Source options that say where raw data is cached, not what it is: recorded
# in the manifest, never a reason to prepare again.
CACHE_OPTIONS = frozenset({"cache_dir"})
# How a dataset is prepared: "memory" (numpy, everything in RAM), "duckdb"
# (out of core, trainer.data.engine; file sources only), "auto" (duckdb for
# the file sources, memory for the others). Every engine writes the same folder.
ENGINES = ("auto", "memory", "duckdb")


def _scan(dataset: str, source_options: Mapping):
  """The FileScan of a file source, or None for a source read in memory."""
  from trainer.data import files, yambda  # pylint: disable=import-outside-toplevel
  scans = {"files": files.scan_files, "yambda": yambda.scan_yambda}
  if dataset not in scans:
    return None
  return scans[dataset](**source_options)


def default_min_item_count(dataset: str) -> int:
  """``min_item_count`` of ``dataset`` when none is given (1 if not listed)."""
  return DEFAULT_MIN_ITEM_COUNT[dataset]


def _json_value(value):
  """``value`` as the manifest stores it (paths as text, tuples as lists)."""
  return json.loads(json.dumps(value, default=str))


def full_source_options(dataset: str, source_options: Mapping | None) -> dict:
  """``source_options`` completed with the loader's defaults, as JSON values.

  What the manifest records, so that leaving an option out and giving its
  default are the same preparation.

  Raises:
    ValueError: unknown dataset.
  """
  options = {}
  for name, parameter in inspect.signature(sources.get_source(dataset)).parameters.items():
    if parameter.default is not inspect.Parameter.empty:
      options[name] = parameter.default
  options.update(dict(source_options or {}))
  return {k: _json_value(v) for k, v in options.items()}


def _check_options(split: str, seq_lens: tuple[int, ...]) -> None:
  """Raises ValueError for an unknown split or a window length below 1."""
  if split not in splits.SPLITS:
    raise ValueError(f"unknown split {split!r}; expected one of {splits.SPLITS}")
  for n in seq_lens:
    if isinstance(n, bool) or int(n) != n or n < 1:
      raise ValueError(f"sequence length N must be an integer >= 1, got {n!r}")


def summarize(manifest: Mapping, seq_len: int) -> dict:
  """The CLI's summary: counts, and the training windows of N = ``seq_len``."""
  keys = ("dataset", "split", "num_users", "num_items", "num_interactions",
          "train_interactions", "validation_examples", "test_examples")
  summary = {key: manifest[key] for key in keys}
  summary["split"] = manifest["split"]["kind"]
  summary["seq_len"] = seq_len
  summary["train_examples"] = manifest["train_windows"][str(seq_len)]
  return summary


def _read_manifest(folder: str | os.PathLike) -> dict | None:
  path = paths.as_path(folder) / storage.MANIFEST
  return storage.read_manifest(path) if path.is_file() else None


def has_manifest(folder: str | os.PathLike) -> bool:
  """Whether ``folder`` (local or ``gs://...``) holds a prepared dataset (of any options)."""
  return (paths.as_path(folder) / storage.MANIFEST).is_file()


@contextlib.contextmanager
def host_lock(folder: str | os.PathLike):
  """Holds an exclusive lock on the local ``folder`` among the processes of this machine.

  With ``data.prepare_per_host`` every process prepares its own copy; the
  processes of one machine (``launch/local.sh``) may name the same folder,
  so the first one prepares it while the others wait, then finds it ready.
  The lock is ``fcntl.flock`` on ``folder/.lock`` (the folder is created),
  released when the block ends or the process dies.

  Raises:
    ValueError: ``folder`` is not local (``gs://...``): copies per host go on
      each host's own disk.
  """
  if paths.is_remote(folder):
    raise ValueError(f"{folder}: a local folder (a copy per host goes on its own disk)")
  path = paths.as_path(folder)
  path.mkdir(parents=True, exist_ok=True)
  with open(os.fspath(path / ".lock"), "w", encoding="utf-8") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    try:
      yield
    finally:
      fcntl.flock(lock, fcntl.LOCK_UN)


def _split_record(split: str, split_options: Mapping | None) -> dict:
  """The manifest's ``split`` entries that the options decide."""
  if split != "gts":
    return {"kind": split}
  options = {"gap": 0, **dict(split_options or {})}  # gap's default
  return {"kind": split, **{k: _json_value(options.get(k)) for k in
                            ("test_window", "validation_window", "gap")}}


def prepared_mismatch(folder: str | os.PathLike, *, dataset: str,
                      source_options: Mapping | None = None,
                      min_item_count: int | None = None, min_user_count: int = 1,
                      split: str = "loo", split_options: Mapping | None = None,
                      num_shards: int = 1) -> list[str]:
  """How the dataset prepared in ``folder`` differs from these options.

  Arguments are those of :func:`prepare_dataset` (None: the same defaults).
  Compared: the dataset, every source option (completed with the loader's
  defaults; cache folders are not compared), ``min_item_count``,
  ``min_user_count``, the split and its options. Entries a manifest does not
  record are not compared. The window length N is not compared: the prepared
  arrays do not depend on it.

  Returns:
    One line per difference, ``"min_item_count: prepared 5, asked 1"``;
    ``["nothing prepared in FOLDER"]`` when it holds no manifest; empty when
    the folder can be used as it is.

  Example:
    >>> prepared_mismatch("/no/such/folder", dataset="synthetic")
    ['nothing prepared in /no/such/folder']
  """
  manifest = _read_manifest(folder)
  if manifest is None:
    return [f"nothing prepared in {folder}"]
  differences = []

  def compare(label, prepared, asked):
    if prepared != asked:
      differences.append(f"{label}: prepared {prepared!r}, asked {asked!r}")

  compare("dataset", manifest.get("dataset"), dataset)
  if manifest.get("dataset") != dataset:
    return differences
  if "source_options" in manifest:
    try:
      prepared = full_source_options(dataset, manifest["source_options"])
      asked = full_source_options(dataset, source_options)
    except ValueError:  # a dataset this version does not know
      prepared, asked = manifest["source_options"], _json_value(dict(source_options or {}))
    for name in sorted((set(prepared) | set(asked)) - CACHE_OPTIONS):
      compare(f"source_options.{name}", prepared.get(name), asked.get(name))
  if "min_item_count" in manifest:
    compare("min_item_count", manifest["min_item_count"],
            default_min_item_count(dataset) if min_item_count is None else int(min_item_count))
  if "min_user_count" in manifest:
    compare("min_user_count", manifest["min_user_count"], int(min_user_count))
  compare("num_shards", int(manifest.get("shards", {}).get("count", 1)), int(num_shards))
  if "split" in manifest:
    asked_split = _split_record(split, split_options)
    prepared_split = {k: manifest["split"].get(k) for k in asked_split}
    for name in asked_split:
      label = "split" if name == "kind" else f"split_options.{name}"
      compare(label, prepared_split[name], asked_split[name])
      if name == "kind" and prepared_split[name] != asked_split[name]:
        break
  return differences


def needs_preparation(folder: str | os.PathLike, *, explicit: bool, dataset: str,
                      source_options: Mapping | None = None,
                      min_item_count: int | None = None, min_user_count: int = 1,
                      split: str = "loo", split_options: Mapping | None = None,
                      num_shards: int = 1) -> bool:
  """Whether the trainer must prepare into ``folder`` before reading it.

  Args:
    folder: the prepared-data folder of the run.
    explicit: the folder was chosen by the user (``data.prepared_dir``), not
      the run's own ``WORKDIR/data``: a dataset prepared there with other
      options is then an error, never overwritten.
    dataset, source_options, min_item_count, min_user_count, split,
      split_options, num_shards: as for :func:`prepare_dataset`.

  Returns:
    False when ``folder`` holds this dataset prepared with these options; True
    when it holds nothing, or (not ``explicit``) another preparation.

  Raises:
    ValueError: ``explicit`` and ``folder`` holds a dataset prepared with
      other options; the message lists them.
  """
  if not has_manifest(folder):
    return True
  differences = prepared_mismatch(
      folder, dataset=dataset, source_options=source_options,
      min_item_count=min_item_count, min_user_count=min_user_count, split=split,
      split_options=split_options, num_shards=num_shards)
  if differences and explicit:
    raise ValueError(
        f"{folder} holds data prepared with other options ({'; '.join(differences)}); "
        "prepare into another folder, delete this one, or leave data.prepared_dir "
        "unset to prepare into WORKDIR/data")
  return bool(differences)


def is_prepared(folder: str | os.PathLike, *, dataset: str, seq_len: int,
                **options) -> bool:
  """Whether ``folder`` holds ``dataset`` prepared with the windows of N = ``seq_len``.

  With ``options`` (``source_options``, ``min_item_count``, ...), also that
  it was prepared with them (see :func:`prepared_mismatch`).
  """
  manifest = _read_manifest(folder)
  if manifest is None or manifest.get("dataset") != dataset:
    return False
  if str(seq_len) not in manifest.get("train_windows", {}):
    return False
  return not options or not prepared_mismatch(folder, dataset=dataset, **options)


STAGING = ".{name}.preparing-{pid}"  # beside the output folder, while it is prepared


def _pid_alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:  # another user's live process
    return True
  return True


def _remove_stale_staging(target: pathlib.Path) -> None:
  """Deletes the staging folders of `target` left by preparations that died."""
  prefix = STAGING.format(name=target.name, pid="")
  for entry in target.parent.glob(prefix + "*"):
    pid = entry.name[len(prefix):]
    if pid.isdigit() and not _pid_alive(int(pid)):
      shutil.rmtree(entry, ignore_errors=True)


@contextlib.contextmanager
def staged(out: str | os.PathLike):
  """Yields the folder to prepare into; on success its files become ``out``'s.

  A local ``out`` is prepared in a hidden folder beside it
  (``.<name>.preparing-<pid>``, same file system), so nothing is written
  into ``out`` while the data is computed: a preparation that fails or is
  killed leaves ``out`` as it was (less its manifest, removed first) and no
  half-written array in it. On success a new or empty ``out`` is the staging
  folder renamed (one atomic step); an ``out`` that holds other files (an
  older preparation, a lock) gets the new files by rename, the manifest
  last, so a folder with a manifest is always complete. Staging folders of
  dead processes are deleted. On object storage (no rename) the files go
  straight to ``out``, each whole, the manifest last.
  """
  if paths.is_remote(out):
    yield out
    return
  # A symlink to a folder (the data on another disk) is followed: the files go
  # where it points, and the staging folder beside them (same file system).
  target = pathlib.Path(os.path.realpath(os.fspath(out)))
  target.parent.mkdir(parents=True, exist_ok=True)
  _remove_stale_staging(target)
  staging = target.parent / STAGING.format(name=target.name, pid=os.getpid())
  shutil.rmtree(staging, ignore_errors=True)
  staging.mkdir()
  try:
    yield staging
    if not target.exists() or (target.is_dir() and not any(target.iterdir())):
      os.replace(staging, target)  # the whole folder at once (onto an empty one too)
      return
    for entry in sorted(staging.iterdir()):
      if entry.name != storage.MANIFEST:
        os.replace(entry, target / entry.name)
    os.replace(staging / storage.MANIFEST, target / storage.MANIFEST)  # last: complete
    outputs.drop_retired(target)
  finally:
    shutil.rmtree(staging, ignore_errors=True)


def check_output_folder(out: str | os.PathLike, name: str = "--out") -> None:
  """Refuses ``out`` unless it is new, empty or a preparation's (its manifest tagged).

  A folder holding a user's own files (an ``items.npy`` of theirs, notes, a
  manifest of another tool or one that is not JSON) is never written into:
  nothing of it is overwritten or deleted (``trainer.workdir.outputs``).

  Raises:
    ConfigError: one line naming ``name``, the folder and a few of its files.
  """
  paths.check_remote(out)
  outputs.check_folder(out, name, format_tag=storage.FORMAT, ignore=(".lock",))


def prepare_dataset(dataset: str, out: str | os.PathLike, *,
                    min_item_count: int | None = None,
                    min_user_count: int = 1, split: str = "loo",
                    split_options: Mapping | None = None,
                    source_options: Mapping | None = None,
                    seq_lens: tuple[int, ...] = (200,), num_shards: int = 1,
                    engine: str = "auto", memory_limit: str | int | None = None,
                    temp_dir: str | os.PathLike | None = None, name: str = "--out") -> dict:
  """Prepares a dataset into ``out`` and returns its manifest.

  ``out`` must be new, empty or hold an earlier preparation
  (:func:`check_output_folder`). Any manifest already in ``out`` is set aside
  first, so a failure at any step leaves no manifest behind; the new files are written beside ``out`` and
  moved in once complete (:func:`staged`), so a stopped preparation leaves
  no partial array in ``out``.

  Args:
    dataset: a name of :data:`trainer.data.sources.SOURCE_NAMES`.
    out: output folder, local or ``gs://...``.
    min_item_count: see :func:`trainer.data.preprocess.prepare_sequences`;
      None picks :func:`default_min_item_count` of the dataset.
    min_user_count: see :func:`trainer.data.preprocess.prepare_sequences`.
    split: ``"loo"`` or ``"gts"``.
    split_options: for ``"gts"``: ``test_window``, ``validation_window``,
      ``gap`` (timestamp units).
    source_options: passed to the source loader; the manifest records them
      completed with the loader's defaults.
    seq_lens: training window lengths N whose window counts go in the
      manifest (``train_windows``).
    num_shards: S, the event arrays cut by user into S shard files (see
      :mod:`trainer.data.storage`); 1 (default) writes one file each.
    engine: one of :data:`ENGINES`. ``"duckdb"`` (what ``"auto"`` picks for
      the ``files`` and ``yambda`` sources) prepares out of core under
      ``memory_limit`` (:mod:`trainer.data.engine`); ``"memory"`` holds
      every event in RAM. Both write the same bytes.
    memory_limit: the out-of-core engine's limit (``"4GB"``; None: half of
      the machine's RAM). Ignored in memory.
    temp_dir: local folder for the engine's spill files (None: the system's
      temporary folder).
    name: how ``out`` is named in a refusal (the flag or config key).

  Returns:
    The manifest written to ``out/manifest.json``: counts, and every option
    that shaped the data (dataset, source options, min counts, split and its
    options), which :func:`prepared_mismatch` compares.

  Raises:
    ValueError, TypeError, FileNotFoundError: bad names, options or data.
    ConfigError: ``out`` holds files no preparation wrote (nothing is changed).
  """
  check_output_folder(out, name)
  storage.remove_manifest(out)
  loader = sources.get_source(dataset)
  _check_options(split, seq_lens)
  if engine not in ENGINES:
    raise ValueError(f"unknown engine {engine!r}; expected one of {ENGINES}")
  if min_item_count is None:
    min_item_count = default_min_item_count(dataset)
  options = dict(min_item_count=min_item_count, min_user_count=min_user_count, split=split,
                 split_options=split_options,
                 source_options=full_source_options(dataset, source_options),
                 seq_lens=seq_lens, num_shards=num_shards)
  scan = _scan(dataset, dict(source_options or {})) if engine != "memory" else None
  if engine == "duckdb" and scan is None:
    raise ValueError(f"engine 'duckdb' prepares the files and yambda sources, not "
                     f"{dataset!r}; expected engine 'memory' or 'auto'")
  with staged(out) as folder:
    if scan is not None:
      from trainer.data import engine as engine_lib  # pylint: disable=import-outside-toplevel
      return engine_lib.prepare_scan(scan, folder, dataset=dataset, memory_limit=memory_limit,
                                     temp_dir=temp_dir, **options)
    raw = loader(**dict(source_options or {}))
    return prepare_interactions(raw, folder, dataset=dataset, **options)


def prepare_interactions(raw: sources.Interactions, out: str | os.PathLike, *,
                         dataset: str, min_item_count: int = 1,
                         min_user_count: int = 1, split: str = "loo",
                         split_options: Mapping | None = None,
                         source_options: Mapping | None = None,
                         seq_lens: tuple[int, ...] = (200,), num_shards: int = 1) -> dict:
  """Prepares already loaded interactions into ``out`` (in memory).

  Args:
    raw: interactions in file order.
    out: output folder; any manifest in it is removed first.
    dataset: name recorded in the manifest.
    min_item_count, min_user_count, split, split_options, source_options,
      seq_lens, num_shards: see :func:`prepare_dataset`.

  Returns:
    The manifest written to ``out/manifest.json``.
  """
  storage.remove_manifest(out)
  _check_options(split, seq_lens)
  raw_size = len(raw)
  sequences = preprocess.prepare_sequences(
      raw, min_item_count=min_item_count, min_user_count=min_user_count)
  del raw
  parts = splits.make_split(sequences, split, **dict(split_options or {}))
  manifest = storage.build_manifest(
      dataset=dataset, source_options=source_options, raw_interactions=raw_size,
      min_item_count=min_item_count, min_user_count=min_user_count, parts=parts,
      num_users=sequences.num_users, num_items=sequences.num_items,
      num_interactions=int(sequences.items.shape[0]), seq_lens=seq_lens)
  arrays = {
      "items": sequences.items, "timestamps": sequences.timestamps,
      "offsets": sequences.offsets, "train_lengths": parts.train_lengths,
      "validation": parts.validation, "test": parts.test,
      "user_ids": sequences.user_ids, "item_ids": sequences.item_ids,
  }
  storage.write_prepared(out, arrays, manifest, num_shards=num_shards)
  return storage.load_prepared(out).manifest
