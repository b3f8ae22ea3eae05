"""End-to-end preparation: source -> filters and remap -> split -> disk."""

from __future__ import annotations

import json
import os
import pathlib
from collections.abc import Mapping

import numpy as np

from trainer.data import preprocess, sources, splits, storage
from trainer.data.windows import num_train_windows

# Minimum interactions per item when the caller does not say: the SASRec
# preparation for MovieLens (>= 5), everything for Yambda, and the whole
# declared catalog for synthetic data.
DEFAULT_MIN_ITEM_COUNT: Mapping[str, int] = {
    "ml-1m": 5, "ml-100k": 5, "yambda": 1, "synthetic": 0}


def _max_or_zero(values: np.ndarray) -> int:
  return int(values.max()) if values.size else 0


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


def is_prepared(folder: str | os.PathLike, *, dataset: str, seq_len: int) -> bool:
  """Whether ``folder`` holds ``dataset`` prepared with the windows of N = ``seq_len``.

  The trainer reuses such a folder as it is (and then needs no raw data).
  """
  manifest = pathlib.Path(folder) / storage.MANIFEST
  if not manifest.is_file():
    return False
  current = json.loads(manifest.read_text())
  return current.get("dataset") == dataset and str(seq_len) in current.get("train_windows", {})


def prepare_dataset(dataset: str, out: str | os.PathLike, *,
                    min_item_count: int | None = None,
                    min_user_count: int = 1, split: str = "loo",
                    split_options: Mapping | None = None,
                    source_options: Mapping | None = None,
                    seq_lens: tuple[int, ...] = (200,)) -> dict:
  """Prepares a dataset into ``out`` and returns its manifest.

  Any manifest already in ``out`` is removed first, so a failure at any step
  leaves no manifest behind.

  Args:
    dataset: a name of :data:`trainer.data.sources.SOURCE_NAMES`.
    out: output folder.
    min_item_count: see :func:`trainer.data.preprocess.prepare_sequences`;
      None picks :data:`DEFAULT_MIN_ITEM_COUNT` of the dataset.
    min_user_count: see :func:`trainer.data.preprocess.prepare_sequences`.
    split: ``"loo"`` or ``"gts"``.
    split_options: for ``"gts"``: ``test_window``, ``validation_window``,
      ``gap`` (timestamp units).
    source_options: passed to the source loader.
    seq_lens: training window lengths N whose window counts go in the
      manifest (``train_windows``).

  Returns:
    The manifest written to ``out/manifest.json``.

  Raises:
    ValueError, TypeError, FileNotFoundError: bad names, options or data.
  """
  storage.remove_manifest(out)
  loader = sources.get_source(dataset)
  _check_options(split, seq_lens)
  if min_item_count is None:
    min_item_count = DEFAULT_MIN_ITEM_COUNT[dataset]
  raw = loader(**dict(source_options or {}))
  return prepare_interactions(
      raw, out, dataset=dataset, min_item_count=min_item_count,
      min_user_count=min_user_count, split=split, split_options=split_options,
      source_options=source_options, seq_lens=seq_lens)


def prepare_interactions(raw: sources.Interactions, out: str | os.PathLike, *,
                         dataset: str, min_item_count: int = 1,
                         min_user_count: int = 1, split: str = "loo",
                         split_options: Mapping | None = None,
                         source_options: Mapping | None = None,
                         seq_lens: tuple[int, ...] = (200,)) -> dict:
  """Prepares already loaded interactions into ``out``.

  Args:
    raw: interactions in file order.
    out: output folder; any manifest in it is removed first.
    dataset: name recorded in the manifest.
    min_item_count, min_user_count, split, split_options, source_options,
      seq_lens: see :func:`prepare_dataset`.

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
  validation, test = parts.validation, parts.test
  history = np.concatenate([validation[:, 1], test[:, 1]])
  manifest = {
      "dataset": dataset,
      "source_options": {k: (str(v) if isinstance(v, pathlib.PurePath) else v)
                         for k, v in dict(source_options or {}).items()},
      "raw_interactions": raw_size,
      "min_item_count": int(min_item_count),
      "min_user_count": int(min_user_count),
      "split": {"kind": parts.kind, **parts.params},
      "num_users": sequences.num_users,
      "num_items": sequences.num_items,
      "num_interactions": int(sequences.items.shape[0]),
      "train_interactions": int(parts.train_lengths.sum()),
      "validation_examples": int(validation.shape[0]),
      "test_examples": int(test.shape[0]),
      "max_train_length": _max_or_zero(parts.train_lengths),
      "max_history": _max_or_zero(history),
      "max_validation_targets": _max_or_zero(validation[:, 3] - validation[:, 2]),
      "max_test_targets": _max_or_zero(test[:, 3] - test[:, 2]),
      "train_windows": {str(int(n)): num_train_windows(parts.train_lengths, n)
                        for n in seq_lens},
  }
  arrays = {
      "items": sequences.items, "timestamps": sequences.timestamps,
      "offsets": sequences.offsets, "train_lengths": parts.train_lengths,
      "validation": validation, "test": test,
      "user_ids": sequences.user_ids, "item_ids": sequences.item_ids,
  }
  storage.write_prepared(out, arrays, manifest)
  return storage.load_prepared(out).manifest
