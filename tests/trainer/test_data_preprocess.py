"""Preprocessing (filters, remap, stable sort) and the two splits."""

import numpy as np
import pytest

from trainer.data import preprocess, sources, splits


def _as_lists(seqs):
  return [seqs.user(u).tolist() for u in range(seqs.num_users)]


def test_remap_filter_and_stable_sort(make_interactions):
  # (user, item, timestamp) in file order. Item 40 occurs once and is dropped
  # with min_item_count=2; user 8 then has no events and disappears.
  rows = [(9, 30, 5), (3, 20, 7), (9, 10, 5), (8, 40, 1), (3, 30, 2),
          (9, 20, 4), (3, 10, 7), (9, 10, 1)]
  seqs = preprocess.prepare_sequences(make_interactions(rows),
                                      min_item_count=2)
  np.testing.assert_array_equal(seqs.user_ids, [3, 9])
  np.testing.assert_array_equal(seqs.item_ids, [10, 20, 30])  # raw id order
  # User 3: t=2 item 30, then t=7 items 20 and 10 in file order.
  # User 9: t=1 item 10, t=4 item 20, then t=5 items 30 and 10 in file order.
  assert _as_lists(seqs) == [[2, 1, 0], [0, 1, 2, 0]]
  np.testing.assert_array_equal(seqs.timestamps, [2, 7, 7, 1, 4, 5, 5])
  np.testing.assert_array_equal(seqs.offsets, [0, 3, 7])
  assert seqs.items.dtype == np.int32


def test_min_user_count_and_items_left_without_users(make_interactions):
  rows = [(1, 5, 1), (1, 6, 2), (2, 7, 1)]
  seqs = preprocess.prepare_sequences(make_interactions(rows),
                                      min_user_count=2)
  np.testing.assert_array_equal(seqs.user_ids, [1])
  np.testing.assert_array_equal(seqs.item_ids, [5, 6])  # 7 went with user 2
  assert _as_lists(seqs) == [[0, 1]]


def test_remap_of_huge_ids_uses_the_same_order():
  ids = np.array([2**40, 5, 2**40, 2**35, 5, 5], np.int64)
  new, kept = preprocess.dense_remap(ids, min_count=2)
  np.testing.assert_array_equal(kept, [5, 2**40])
  np.testing.assert_array_equal(new, [1, 0, 1, -1, 0, 0])
  small = np.array([9, 5, 9, 7, 5, 5])
  new, kept = preprocess.dense_remap(small, min_count=2)
  np.testing.assert_array_equal(kept, [5, 9])
  np.testing.assert_array_equal(new, [1, 0, 1, -1, 0, 0])


def test_min_item_count_zero_keeps_declared_catalog(make_interactions):
  raw = make_interactions([(0, 3, 1), (0, 1, 2)], num_items=6)
  seqs = preprocess.prepare_sequences(raw, min_item_count=0)
  assert seqs.num_items == 6
  assert _as_lists(seqs) == [[3, 1]]
  undeclared = make_interactions([(0, 3, 1), (0, 1, 2)])
  assert preprocess.prepare_sequences(undeclared, min_item_count=0).num_items == 2


def test_bad_input_errors(make_interactions):
  with pytest.raises(ValueError, match="empty after filtering: 0 of 2"):
    preprocess.prepare_sequences(make_interactions([(0, 1, 1), (0, 2, 2)]),
                                 min_item_count=2)
  with pytest.raises(ValueError, match="item ids must be >= 0, found -2"):
    make_interactions([(0, -2, 1)])
  with pytest.raises(TypeError, match="user must have an integer dtype, got "
                     "float64"):
    sources.Interactions(user=np.array([1.5]), item=np.array([1]),
                         timestamp=np.array([1]))
  with pytest.raises(ValueError, match="item has 2 entries, expected 1"):
    sources.Interactions(user=np.array([1]), item=np.array([1, 2]),
                         timestamp=np.array([1]))
  with pytest.raises(ValueError, match="timestamp must hold integral values"):
    sources.float_to_int_ids(np.array([1.0, 2.5]), "timestamp")
  with pytest.raises(ValueError, match="has no interactions"):
    preprocess.prepare_sequences(sources.Interactions(
        user=np.zeros(0, np.int64), item=np.zeros(0, np.int64),
        timestamp=np.zeros(0, np.int64)))


def _sequences(make_interactions, timelines):
  """Sequences from ``{user: [(item, t), ...]}`` (already time-sorted)."""
  rows = [(u, i, t) for u, events in timelines.items() for i, t in events]
  return preprocess.prepare_sequences(make_interactions(rows))


def test_leave_one_out(make_interactions):
  seqs = _sequences(make_interactions, {0: [(1, 1), (2, 2), (3, 3), (4, 4)], 1: [(1, 5), (2, 6)],
                     2: [(4, 1), (3, 2), (2, 3)]})
  split = splits.leave_one_out(seqs)
  np.testing.assert_array_equal(split.train_lengths, [2, 2, 1])
  assert split.validation.tolist() == [[0, 2, 2, 3], [2, 1, 1, 2]]
  assert split.test.tolist() == [[0, 3, 3, 4], [2, 2, 2, 3]]
  # The held-out items are the last two of each evaluated user.
  base = seqs.offsets[split.test[:, 0]] + split.test[:, 2]
  np.testing.assert_array_equal(seqs.items[base], [3, 1])


def test_global_temporal_split_with_gap(make_interactions):
  # Last timestamp 99 -> end 100. test_window 10: test [90, 100);
  # gap 5: validation window 20 is [65, 85); training before 60.
  seqs = _sequences(make_interactions, {
      0: [(1, 10), (2, 59), (3, 62), (4, 70), (5, 87), (6, 90), (7, 99)],
      1: [(1, 61), (2, 95)],           # no training event: never evaluated
      2: [(1, 20), (2, 30), (3, 80)],  # validation only
      3: [(1, 5), (2, 86), (3, 91)],   # test only; 86 is in the gap
  })
  split = splits.global_temporal_split(seqs, test_window=10,
                                       validation_window=20, gap=5)
  p = split.params
  assert (p["test_start"], p["validation_start"], p["train_end"]) == (90, 65,
                                                                       60)
  np.testing.assert_array_equal(split.train_lengths, [2, 0, 2, 1])
  # Validation: history = training events, targets = events in [65, 85).
  assert split.validation.tolist() == [[0, 2, 3, 4], [2, 2, 2, 3]]
  # Test: history = events before 85 (test_start - gap), targets >= 90.
  assert split.test.tolist() == [[0, 4, 5, 7], [3, 1, 2, 3]]


def test_global_temporal_split_errors(make_interactions):
  seqs = _sequences(make_interactions, {0: [(1, 1), (2, 2)]})
  with pytest.raises(ValueError, match="test_window > 0"):
    splits.global_temporal_split(seqs, test_window=0, validation_window=1)
  with pytest.raises(ValueError, match="no test example"):
    # The window covers everything: no user has training events.
    splits.global_temporal_split(seqs, test_window=10, validation_window=0)
  with pytest.raises(ValueError, match="unknown split 'random'"):
    splits.make_split(seqs, "random")
