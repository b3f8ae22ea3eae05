"""Whether prepared data can train and be evaluated, checked before a run starts.

A split can leave nothing to learn from or nothing to measure: leave-one-out
holds out the last two events of every user with 3 or more, so users with 2
events train on both and are never evaluated, and users with 3 keep 1
training event (a training window needs 2: an input and its next item); a
global temporal split trains only on events before its validation window.
Without a training window the trainer would stop inside its data pipeline;
without an evaluation user it would train, then print a table of NaN and
exit 0. `check_trainable` says which is missing and why, in one line, before
any state is built.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from trainer.data import windows
from trainer.data.sources import DataError
from trainer.data.storage import PreparedDataset

# Events a user needs: 2 in training for one window; leave-one-out evaluates users with 3+.
TRAIN_EVENTS = 2
LOO_EVALUATED = 3


def _events_per_user(data: PreparedDataset) -> np.ndarray:
  return np.diff(np.asarray(data.offsets, np.int64))


def _why_no_window(data: PreparedDataset) -> str:
  split = data.manifest.get("split", {})
  longest = int(np.max(data.train_lengths)) if data.num_users else 0
  if split.get("kind") == "loo":
    most = int(np.max(_events_per_user(data))) if data.num_users else 0
    return (f"every user has fewer than {LOO_EVALUATED + 1} interactions (the most is {most}): "
            f"leave-one-out holds out the last 2 of a user with {LOO_EVALUATED} or more for "
            f"validation and test, and a training window needs {TRAIN_EVENTS} training events")
  return (f"no user has {TRAIN_EVENTS} or more events before the split's training end "
          f"{split.get('train_end')} (the most is {longest}): the validation and test "
          "windows (data.split_options) hold the rest")


def _why_no_examples(data: PreparedDataset, name: str) -> str:
  split = data.manifest.get("split", {})
  if split.get("kind") == "loo":
    most = int(np.max(_events_per_user(data))) if data.num_users else 0
    return (f"every user has fewer than {LOO_EVALUATED} interactions (the most is {most}): "
            f"leave-one-out evaluates users with {LOO_EVALUATED} or more (the last for test, "
            "the one before for validation)")
  params = split  # the manifest's split: its kind and the gts boundaries
  if name == "validation":
    start, end = params.get("validation_start"), params.get("test_start", 0) - params.get("gap", 0)
  else:
    start, end = params.get("test_start"), params.get("end")
  return (f"no user with training events has an event in the {name} window [{start}, {end}) "
          f"(data.split_options: validation_window={params.get('validation_window')}, "
          f"test_window={params.get('test_window')}, gap={params.get('gap')})")


def check_trainable(data: PreparedDataset, *, seq_len: int, train_windows: str = "all",
                    eval_splits: Iterable[str] = ("validation", "test")) -> None:
  """Refuses data with no training window or no user to evaluate on a split.

  Args:
    data: the prepared dataset.
    seq_len: N, inputs per training window.
    train_windows: the window policy (`trainer.data.windows`).
    eval_splits: the splits the run evaluates ("validation", "test").

  Raises:
    DataError: one line naming the folder, what is missing and why.
  """
  if windows.num_train_windows(data.train_lengths, seq_len, train_windows) == 0:
    raise DataError(f"{data.path} has no training window ({data.num_users:,} users): "
                    f"{_why_no_window(data)}; nothing to train on")
  for name in dict.fromkeys(eval_splits):
    if data.examples(name).shape[0] == 0:
      raise DataError(f"{data.path} has no {name} user ({data.num_users:,} users): "
                      f"{_why_no_examples(data, name)}; nothing to evaluate")
