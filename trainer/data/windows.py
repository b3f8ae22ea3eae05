"""Training windows and evaluation examples as numpy arrays.

Id convention (what the model and the loss see):

* item ids are dense in ``[0, V)``, V = ``num_items`` of the dataset;
* ``inputs`` are padded on the left with ``V`` (:func:`input_pad_id`), so a
  model owning an input embedding of ``V + 1`` rows reads padding as row V,
  while its output table is rows ``[0, V)``; ``inputs == V`` is the padding
  mask (equivalently ``weights > 0`` for training windows);
* ``targets`` and ``exclude`` are padded with -1 (:data:`PAD`): any id outside
  ``[0, V)`` is padding for ``cutbce.cut_bce`` and ``cutbce.target_ranks``.

Training window: for a user's training sequence ``s`` of length n (n >= 2),
input positions ``j`` in ``[0, n - 1)`` (those with a next item) are cut from
the end into windows of N: the last window is positions ``n-1-N .. n-2``, the
one before ends N earlier, and the oldest one is left-padded. Position j has
targets ``s[j+1 : j+1+L]`` padded with -1 past the end, and weight 1 (0 on
padding). Which windows an epoch holds is the window policy
(:data:`TRAIN_WINDOWS`):

* ``"all"``: every non-overlapping window, cut from the end as above; a user
  has ``ceil((n - 1) / N)`` windows. Long histories are used in full, and
  heavy users dominate the epoch.
* ``"last"``: one window per user (n >= 2), the most recent one: positions
  ``n-1-N .. n-2``, whose targets end at the user's last training item. This
  is how the published SASRec recipes train (SASRec, SASRec+, gSASRec): an
  epoch is one sequence per user.
"""

from __future__ import annotations

import numpy as np

PAD = -1
TRAIN_WINDOWS = ("all", "last")


def input_pad_id(num_items: int) -> int:
  """The id that pads ``inputs``: V, one past the last item."""
  return int(num_items)


def check_positive(**values: int) -> None:
  """Raises ValueError unless every value is an integer >= 1."""
  for name, value in values.items():
    if isinstance(value, bool) or int(value) != value or value < 1:
      raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


def check_policy(train_windows: str) -> None:
  """Raises ValueError unless ``train_windows`` is one of :data:`TRAIN_WINDOWS`."""
  if train_windows not in TRAIN_WINDOWS:
    raise ValueError(f"train_windows must be one of {TRAIN_WINDOWS}, got {train_windows!r}")


def _windows_per_user(train_lengths: np.ndarray, seq_len: int,
                      train_windows: str = "all") -> np.ndarray:
  check_positive(seq_len=seq_len)
  check_policy(train_windows)
  positions = np.maximum(np.asarray(train_lengths, np.int64) - 1, 0)
  if train_windows == "last":
    return np.minimum(positions, 1)  # 1 window, 0 when n < 2.
  return -(-positions // seq_len)  # ceil((n - 1) / N), 0 when n < 2.


def num_windows_per_user(train_lengths: np.ndarray, seq_len: int,
                         train_windows: str = "all") -> np.ndarray:
  """int64 ``[U]`` training windows of N = ``seq_len`` inputs per user."""
  return _windows_per_user(train_lengths, seq_len, train_windows)


def num_train_windows(train_lengths: np.ndarray, seq_len: int,
                      train_windows: str = "all") -> int:
  """Number of training windows of N = ``seq_len`` inputs over all users (one epoch)."""
  return int(_windows_per_user(train_lengths, seq_len, train_windows).sum())


def train_window_index(train_lengths: np.ndarray, seq_len: int,
                       train_windows: str = "all") -> tuple[np.ndarray, np.ndarray]:
  """Enumerates training windows, user-major, oldest window first.

  Args:
    train_lengths: int ``[U]`` training prefix length per user.
    seq_len: N.
    train_windows: the window policy, ``"all"`` or ``"last"`` (module doc).

  Returns:
    ``(users, ends)``, int64 ``[W]`` each: window w covers input positions
    ``ends[w] - N .. ends[w] - 1`` of user ``users[w]`` (negative = padding).
  """
  counts = _windows_per_user(train_lengths, seq_len, train_windows)
  users = np.repeat(np.arange(counts.shape[0], dtype=np.int64), counts)
  first = np.concatenate([[0], np.cumsum(counts)[:-1]])
  k = np.arange(users.shape[0], dtype=np.int64) - first[users]
  last_end = np.asarray(train_lengths, np.int64)[users] - 1
  ends = last_end - (counts[users] - 1 - k) * seq_len
  return users, ends


def build_train_batch(items: np.ndarray, offsets: np.ndarray,
                      train_lengths: np.ndarray, users: np.ndarray,
                      ends: np.ndarray, *, seq_len: int, num_targets: int,
                      num_items: int) -> dict[str, np.ndarray]:
  """Builds a batch of training windows (vectorized).

  Args:
    items: int32 ``[n]`` all items (may be memory-mapped, or
      :class:`~trainer.data.storage.ShardedRows`).
    offsets: int64 ``[U + 1]``.
    train_lengths: int64 ``[U]``.
    users: int ``[B]`` window users; ends: int ``[B]`` window ends (see
      :func:`train_window_index`).
    seq_len: N.
    num_targets: L.
    num_items: V (the input padding id).

  Returns:
    ``inputs`` int32 ``[B, N]`` (padding V), ``targets`` int32 ``[B, N, L]``
    (padding -1), ``weights`` float32 ``[B, N]`` (0 on padding).
  """
  users = np.asarray(users, np.int64)
  pos = ends[:, None] - seq_len + np.arange(seq_len)  # [B, N]
  valid = pos >= 0
  base = np.asarray(offsets[users], np.int64)[:, None]  # [B, 1]
  # Padding positions read the user's first row (never used), so a batch
  # touches only its users' rows (and, for sharded data, their shards).
  inputs = np.where(valid, items[np.where(valid, base + pos, base)],
                    input_pad_id(num_items))
  target_pos = pos[:, :, None] + 1 + np.arange(num_targets)  # [B, N, L]
  length = np.asarray(train_lengths[users], np.int64)[:, None, None]
  has_target = valid[:, :, None] & (target_pos < length)
  targets = np.where(
      has_target, items[np.where(has_target, base[:, :, None] + target_pos,
                                 base[:, :, None])],
      PAD)
  return {"inputs": inputs.astype(np.int32),
          "targets": targets.astype(np.int32),
          "weights": valid.astype(np.float32)}


def _pad_to(values: np.ndarray, size: int, fill: int) -> np.ndarray:
  out = np.full(size, fill, np.int32)
  out[:values.shape[0]] = values
  return out


def unique_in_order(values: np.ndarray) -> np.ndarray:
  """Distinct values in order of first occurrence."""
  _, first = np.unique(values, return_index=True)
  return values[np.sort(first)]


def recent_distinct(history: np.ndarray, limit: int) -> np.ndarray:
  """Up to ``limit`` distinct ids of ``history``, most recent kept, sorted."""
  distinct, last_seen = np.unique(history[::-1], return_index=True)
  if distinct.shape[0] > limit:
    distinct = distinct[np.sort(np.argsort(last_seen, kind="stable")[:limit])]
  return distinct


def build_eval_example(items: np.ndarray, offsets: np.ndarray,
                       row: np.ndarray | None, *, seq_len: int,
                       num_targets: int, max_exclude: int,
                       num_items: int) -> dict[str, np.ndarray]:
  """Builds one evaluation example, or a padding example when ``row`` is None.

  Args:
    items: int32 ``[n]``; offsets: int64 ``[U + 1]``.
    row: ``(user, history_length, target_start, target_end)`` or None.
    seq_len: N, inputs are the last N history items, left-padded with V.
    num_targets: L, targets are the distinct held-out items in order, the
      first L kept, padded with -1.
    max_exclude: E, the user's distinct history items (the most recent E
      when there are more), sorted, padded with -1.
    num_items: V.

  Returns:
    ``inputs`` int32 ``[N]``, ``targets`` int32 ``[L]``, ``exclude`` int32
    ``[E]``, ``weights`` float32 ``[]`` (1, or 0 for padding) and ``users``
    int32 ``[]`` (dense user id, -1 for padding).
  """
  pad_id = input_pad_id(num_items)
  if row is None:
    return {"inputs": np.full(seq_len, pad_id, np.int32),
            "targets": np.full(num_targets, PAD, np.int32),
            "exclude": np.full(max_exclude, PAD, np.int32),
            "weights": np.float32(0.0), "users": np.int32(-1)}
  user, history_length, target_start, target_end = (int(v) for v in row)
  base = int(offsets[user])
  history = np.asarray(items[base:base + history_length])
  inputs = np.full(seq_len, pad_id, np.int32)
  recent = history[-seq_len:]
  inputs[seq_len - recent.shape[0]:] = recent
  held_out = unique_in_order(
      np.asarray(items[base + target_start:base + target_end]))
  return {"inputs": inputs,
          "targets": _pad_to(held_out[:num_targets], num_targets, PAD),
          "exclude": _pad_to(recent_distinct(history, max_exclude),
                             max_exclude, PAD),
          "weights": np.float32(1.0), "users": np.int32(user)}
