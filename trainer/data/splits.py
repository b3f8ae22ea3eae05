"""Train / validation / test splits over time-sorted user sequences.

A split never copies items. It says, per user, how long the training prefix
is, and lists evaluation examples as positions inside a user's sequence:

* ``train_lengths[u]``: user u's training sequence is the first
  ``train_lengths[u]`` events.
* an evaluation example is one row ``(user, history_length, target_start,
  target_end)``: the model reads the first ``history_length`` events of the user
  (the last N of them as inputs, all of them as the exclude list), and the
  targets are events ``target_start:target_end``.

Two protocols:

* leave-one-out (``loo``): users with at least 3 events; validation target =
  second-to-last event, history = the events before it; test target = last
  event, history = every event before it. Users with fewer than 3 events only
  train.
* global temporal split (``gts``): with ``T`` the last timestamp plus one,
  the test window is ``[T - test_window, T)`` and the validation window
  ``[test_start - gap - validation_window, test_start - gap)``. Training uses
  events before ``validation_start - gap``. The history of a window is every
  event before ``window_start - gap`` (events inside a gap are never inputs and
  never targets). Only users with training events get evaluation examples
  (test users must occur in train), and only when the window holds events.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from trainer.data.preprocess import Sequences

SPLITS = ("loo", "gts")
EXAMPLE_COLUMNS = ("user", "history_length", "target_start", "target_end")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Split:
  """Where each part of every user's sequence goes.

  Attributes:
    kind: ``"loo"`` or ``"gts"``.
    train_lengths: int64 ``[U]`` training prefix length per user.
    validation: int64 ``[K_val, 4]`` rows of :data:`EXAMPLE_COLUMNS`.
    test: int64 ``[K_test, 4]`` rows of :data:`EXAMPLE_COLUMNS`.
    params: the split's parameters (for the manifest).
  """

  kind: str
  train_lengths: np.ndarray
  validation: np.ndarray
  test: np.ndarray
  params: dict


def _examples(user, history, start, end) -> np.ndarray:
  """Stacks example columns into int64 ``[K, 4]``."""
  return np.stack([user, history, start, end], axis=1).astype(np.int64)


def leave_one_out(sequences: Sequences) -> Split:
  """Leave-one-out split: validation = second-to-last event, test = last.

  Args:
    sequences: time-sorted sequences.

  Returns:
    :class:`Split` of kind ``"loo"``.

  Example:
    >>> from trainer.data.preprocess import Sequences
    >>> seqs = Sequences(items=np.arange(4, dtype=np.int32),
    ...     timestamps=np.arange(4), offsets=np.array([0, 4]),
    ...     user_ids=np.array([0]), item_ids=np.arange(4))
    >>> leave_one_out(seqs).test.tolist()
    [[0, 3, 3, 4]]
  """
  return split_from_counts("loo", sequences.lengths)


def _count_before(sequences: Sequences, row_user: np.ndarray,
                  threshold: int) -> np.ndarray:
  """int64 ``[U]``: per user, events with timestamp < threshold.

  Events are time-sorted within a user, so these are a prefix.
  """
  before = sequences.timestamps < threshold
  return np.bincount(row_user[before],
                     minlength=sequences.num_users).astype(np.int64)


def gts_boundaries(end: int, *, test_window: int, validation_window: int,
                   gap: int = 0) -> dict:
  """The windows of the global temporal split whose data ends at ``end`` (last time + 1).

  Returns:
    The split's ``params`` (``test_window``, ``validation_window``, ``gap``,
    ``train_end``, ``validation_start``, ``test_start``, ``end``) and
    ``test_start_minus_gap``, where the history of a test example ends.

  Raises:
    ValueError: bad window sizes.
  """
  if test_window <= 0 or validation_window < 0 or gap < 0:
    raise ValueError(
        f"expected test_window > 0, validation_window >= 0 and gap >= 0, got "
        f"{test_window}, {validation_window} and {gap}")
  test_start = int(end) - int(test_window)
  validation_start = test_start - int(gap) - int(validation_window)
  train_end = validation_start - int(gap)
  return {"test_window": int(test_window), "validation_window": int(validation_window),
          "gap": int(gap), "train_end": train_end, "validation_start": validation_start,
          "test_start": test_start, "end": int(end),
          "test_start_minus_gap": test_start - int(gap)}


def split_from_counts(kind: str, lengths: np.ndarray, counts: dict | None = None,
                      bounds: dict | None = None) -> Split:
  """A split from per-user counts alone (no event array): what both preparation paths share.

  Args:
    kind: ``"loo"`` or ``"gts"``.
    lengths: int64 ``[U]`` events per user.
    counts: for ``"gts"``: int64 ``[U]`` per user, events with a timestamp
      below ``bounds[name]``, for the names ``train_end``,
      ``test_start_minus_gap``, ``test_start``, ``validation_start``.
    bounds: for ``"gts"``: :func:`gts_boundaries`.

  Raises:
    ValueError: unknown kind, or (``gts``) no test example.
  """
  lengths = np.asarray(lengths, np.int64)
  if kind == "loo":
    evaluated = lengths >= 3
    train_lengths = np.where(evaluated, lengths - 2, lengths).astype(np.int64)
    users = np.flatnonzero(evaluated)
    n = lengths[users]
    return Split(kind="loo", train_lengths=train_lengths,
                 validation=_examples(users, n - 2, n - 2, n - 1),
                 test=_examples(users, n - 1, n - 1, n), params={})
  if kind != "gts":
    raise ValueError(f"unknown split {kind!r}; expected one of {SPLITS}")
  train_lengths = counts["train_end"]
  before_test_gap = counts["test_start_minus_gap"]
  before_test = counts["test_start"]
  before_validation = counts["validation_start"]
  in_train = train_lengths > 0

  val_users = np.flatnonzero(in_train & (before_test_gap > before_validation))
  validation = _examples(val_users, train_lengths[val_users],
                         before_validation[val_users],
                         before_test_gap[val_users])
  test_users = np.flatnonzero(in_train & (lengths > before_test))
  test = _examples(test_users, before_test_gap[test_users],
                   before_test[test_users], lengths[test_users])
  if test.shape[0] == 0:
    raise ValueError(
        f"global temporal split has no test example: no user with events "
        f"before {bounds['train_end']} has an event in the test window "
        f"[{bounds['test_start']}, {bounds['end']}); expected a test_window "
        f"({bounds['test_window']}) that holds events of training users")
  params = {k: v for k, v in bounds.items() if k != "test_start_minus_gap"}
  return Split(kind="gts", train_lengths=train_lengths,
               validation=validation, test=test, params=params)


def global_temporal_split(sequences: Sequences, *, test_window: int,
                          validation_window: int, gap: int = 0) -> Split:
  """Global temporal split with a gap before each evaluation window.

  Args:
    sequences: time-sorted sequences.
    test_window: length of the test window in timestamp units (> 0).
    validation_window: length of the validation window (>= 0; 0 gives no
      validation examples).
    gap: time between the end of the inputs and the start of each window
      (>= 0).

  Returns:
    :class:`Split` of kind ``"gts"``; ``params`` records the boundaries.

  Raises:
    ValueError: bad window sizes, or no test example (no event in the test
      window from a user with training events).
  """
  gts_boundaries(0, test_window=test_window, validation_window=validation_window, gap=gap)
  bounds = gts_boundaries(int(sequences.timestamps.max()) + 1, test_window=test_window,
                          validation_window=validation_window, gap=gap)
  row_user = np.repeat(np.arange(sequences.num_users, dtype=np.int32), sequences.lengths)
  counts = {name: _count_before(sequences, row_user, bounds[name]) for name in
            ("train_end", "test_start_minus_gap", "test_start", "validation_start")}
  return split_from_counts("gts", sequences.lengths, counts, bounds)


def make_split(sequences: Sequences, kind: str, **params) -> Split:
  """Dispatches to :func:`leave_one_out` (``"loo"``) or
  :func:`global_temporal_split` (``"gts"``).

  Raises:
    ValueError: unknown kind.
  """
  if kind == "loo":
    return leave_one_out(sequences)
  if kind == "gts":
    return global_temporal_split(sequences, **params)
  raise ValueError(f"unknown split {kind!r}; expected one of {SPLITS}")
