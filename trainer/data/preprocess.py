"""Preprocessing: count filters, dense id remap and a stable time sort.

``prepare_sequences`` turns raw :class:`~trainer.data.sources.Interactions`
into :class:`Sequences`, every user's items in time order, stored as one flat
array cut by offsets (CSR):

1. items with fewer than ``min_item_count`` interactions are dropped, then
   users with fewer than ``min_user_count`` of the remaining ones (one pass
   each, in that order, as in the SASRec ML-1M preparation; not an iterated
   k-core);
2. kept ids are remapped densely in increasing raw-id order: users to
   ``[0, U)``, items to ``[0, V)`` (string ids arrive as codes of a sorted
   vocabulary, so code order is raw-id order);
3. interactions are sorted by (user, timestamp) with a stable sort, so events
   of a user with equal timestamps keep their file order.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from trainer.data import sources

# Remap through a lookup table when the largest raw id is below this many
# entries per interaction (or below 2**24), else through np.unique.
_TABLE_FACTOR = 4


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Sequences:
  """Per-user item sequences in time order (CSR layout).

  User u's events are rows ``offsets[u]:offsets[u + 1]`` of ``items`` and
  ``timestamps``.

  Attributes:
    items: int32 ``[n]`` dense item ids in ``[0, V)``.
    timestamps: int64 ``[n]``, non-decreasing within each user.
    offsets: int64 ``[U + 1]``; ``offsets[0] == 0``, ``offsets[U] == n``.
    user_ids: ``[U]`` raw id of each dense user: int64, or numpy unicode
      (``<U``) for string ids.
    item_ids: ``[V]`` raw id of each dense item, the same way.
  """

  items: np.ndarray
  timestamps: np.ndarray
  offsets: np.ndarray
  user_ids: np.ndarray
  item_ids: np.ndarray

  @property
  def num_users(self) -> int:
    return int(self.offsets.shape[0] - 1)

  @property
  def num_items(self) -> int:
    return int(self.item_ids.shape[0])

  @property
  def lengths(self) -> np.ndarray:
    """int64 ``[U]`` number of events per user."""
    return np.diff(self.offsets)

  def user(self, u: int) -> np.ndarray:
    """int32 ``[n_u]`` items of dense user ``u`` in time order."""
    return self.items[self.offsets[u]:self.offsets[u + 1]]


def dense_remap(ids: np.ndarray, min_count: int = 1
                ) -> tuple[np.ndarray, np.ndarray]:
  """Remaps ids with at least ``min_count`` occurrences to ``[0, K)``.

  New ids follow increasing raw id. Linear time through a lookup table when ids
  are small enough, else ``np.unique``.

  Args:
    ids: int ``[n]`` raw ids, >= 0.
    min_count: occurrences needed to keep an id (>= 1).

  Returns:
    ``(new, kept)``: int32 ``[n]`` new id per row (-1 where dropped) and int64
    ``[K]`` raw id of each new id.
  """
  n = ids.shape[0]
  if n == 0:
    return np.empty(0, np.int32), np.empty(0, np.int64)
  top = int(ids.max())
  if top < max(_TABLE_FACTOR * n, 1 << 24):
    counts = np.bincount(ids, minlength=top + 1)
    keep = counts >= min_count
    table = np.where(keep, np.cumsum(keep) - 1, -1).astype(np.int32)
    return table[ids], np.flatnonzero(keep).astype(np.int64)
  unique, inverse, counts = np.unique(ids, return_inverse=True,
                                      return_counts=True)
  keep = counts >= min_count
  table = np.where(keep, np.cumsum(keep) - 1, -1).astype(np.int32)
  return table[inverse.reshape(-1)], unique[keep].astype(np.int64)


def _is_sorted(user: np.ndarray, timestamp: np.ndarray) -> bool:
  """True when rows are already ordered by (user, timestamp)."""
  if user.shape[0] < 2:
    return True
  user_step = np.diff(user)
  if (user_step < 0).any():
    return False
  same_user = user_step == 0
  return not (same_user & (np.diff(timestamp) < 0)).any()


def stable_user_time_order(user: np.ndarray, timestamp: np.ndarray
                           ) -> np.ndarray | None:
  """Permutation sorting rows by (user, timestamp), ties in input order.

  Returns:
    int64 ``[n]`` permutation, or None when the rows are already sorted.
  """
  if _is_sorted(user, timestamp):
    return None
  # Two stable sorts: by the minor key, then by the major key.
  order = np.argsort(timestamp, kind="stable")
  return order[np.argsort(user[order], kind="stable")]


def prepare_sequences(interactions: sources.Interactions, *,
                      min_item_count: int = 1, min_user_count: int = 1
                      ) -> Sequences:
  """Filters, remaps and sorts raw interactions.

  Args:
    interactions: raw interactions in file order.
    min_item_count: keep items with at least this many interactions. 0 keeps
      the whole declared catalog ``[0, interactions.num_items)``, even items
      that never occur (the synthetic source declares it); without a declared
      catalog 0 acts as 1.
    min_user_count: then keep users with at least this many of the remaining
      interactions (>= 1).

  Returns:
    :class:`Sequences`.

  Raises:
    ValueError: negative counts, or nothing left after filtering.

  Example:
    >>> raw = sources.Interactions(user=np.array([7, 3, 7]),
    ...     item=np.array([5, 5, 9]), timestamp=np.array([2, 1, 1]))
    >>> seqs = prepare_sequences(raw)
    >>> seqs.items.tolist(), seqs.offsets.tolist()
    ([0, 1, 0], [0, 1, 3])
  """
  if min_item_count < 0 or min_user_count < 1:
    raise ValueError(
        f"min_item_count must be >= 0 and min_user_count >= 1, got "
        f"{min_item_count} and {min_user_count}")
  n = len(interactions)
  if n == 0:
    raise ValueError(f"{interactions.name or 'dataset'} has no interactions; "
                     "expected at least one")
  if min_item_count == 0 and interactions.num_items is not None:
    item = interactions.item.astype(np.int32, copy=False)
    item_ids = np.arange(interactions.num_items, dtype=np.int64)
  else:
    item, item_ids = dense_remap(interactions.item, max(1, min_item_count))
  keep = item >= 0
  user_raw, timestamp = interactions.user, interactions.timestamp
  if not keep.all():
    item, user_raw, timestamp = item[keep], user_raw[keep], timestamp[keep]
  user, user_ids = dense_remap(user_raw, min_user_count)
  del user_raw
  keep = user >= 0
  if not keep.all():
    item, user, timestamp = item[keep], user[keep], timestamp[keep]
  if item.shape[0] == 0:
    raise ValueError(
        f"{interactions.name or 'dataset'} is empty after filtering: 0 of {n} "
        f"interactions kept with min_item_count={min_item_count}, "
        f"min_user_count={min_user_count}; expected at least one")
  if min_item_count != 0 or interactions.num_items is None:
    # Items whose only users were dropped by the user filter: remap again.
    present = np.bincount(item, minlength=item_ids.shape[0]) > 0
    if not present.all():
      table = (np.cumsum(present) - 1).astype(np.int32)
      item, item_ids = table[item], item_ids[present]
  order = stable_user_time_order(user, timestamp)
  if order is not None:
    item, user, timestamp = item[order], user[order], timestamp[order]
  counts = np.bincount(user, minlength=user_ids.shape[0])
  offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
  # Codes of a vocabulary -> the raw ids they stand for.
  if interactions.user_vocab is not None:
    user_ids = interactions.user_vocab[user_ids]
  if interactions.item_vocab is not None:
    item_ids = interactions.item_vocab[item_ids]
  return Sequences(items=np.ascontiguousarray(item, np.int32),
                   timestamps=np.ascontiguousarray(timestamp, np.int64),
                   offsets=offsets, user_ids=user_ids, item_ids=item_ids)
