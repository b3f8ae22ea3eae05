"""Training windows, evaluation examples and the grain pipelines."""

import itertools
import json

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from trainer.data import pipeline, prepare, storage, windows


@pytest.fixture
def hand_prepared(tmp_path, make_interactions):
  """User 0: items 0..6 at t=0..6; user 1: items 7, 8, 9, 7, 8 (repeats)."""
  rows = [(0, i, i) for i in range(7)]
  rows += [(1, i, 10 + t) for t, i in enumerate([7, 8, 9, 7, 8])]
  prepare.prepare_interactions(make_interactions(rows), tmp_path,
                               dataset="hand")
  return storage.load_prepared(tmp_path)


def _rows(batch):
  """Batch dict -> list of per-row tuples (hashable, for set comparisons)."""
  size = next(iter(batch.values())).shape[0]
  return [tuple(batch[k][r].tobytes() for k in sorted(batch))
          for r in range(size)]


def test_windows_and_targets_on_a_hand_made_sequence(hand_prepared):
  data, v = hand_prepared, hand_prepared.num_items
  assert v == 10
  # Leave-one-out: user 0 trains on items 0..4, user 1 on 7, 8, 9.
  users, ends = windows.train_window_index(data.train_lengths, seq_len=3)
  np.testing.assert_array_equal(users, [0, 0, 1])
  np.testing.assert_array_equal(ends, [1, 4, 2])
  batch = windows.build_train_batch(
      data.items, data.offsets, data.train_lengths, users, ends, seq_len=3,
      num_targets=2, num_items=v)
  np.testing.assert_array_equal(batch["inputs"],
                                [[v, v, 0], [1, 2, 3], [v, 7, 8]])
  np.testing.assert_array_equal(batch["targets"], [
      [[-1, -1], [-1, -1], [1, 2]],
      [[2, 3], [3, 4], [4, -1]],
      [[-1, -1], [8, 9], [9, -1]],
  ])
  np.testing.assert_array_equal(batch["weights"],
                                [[0, 0, 1], [1, 1, 1], [0, 1, 1]])
  assert batch["inputs"].dtype == batch["targets"].dtype == np.int32
  assert batch["weights"].dtype == np.float32


def test_last_policy_is_each_users_most_recent_window(hand_prepared):
  data, v = hand_prepared, hand_prepared.num_items
  # Leave-one-out: user 0 trains on items 0..4 (5 validation, 6 test), user 1
  # on 7, 8, 9 (7 validation, 8 test).
  users, ends = windows.train_window_index(data.train_lengths, seq_len=3,
                                           train_windows="last")
  np.testing.assert_array_equal(users, [0, 1])
  np.testing.assert_array_equal(ends, [4, 2])
  assert windows.num_train_windows(data.train_lengths, 3, "last") == 2
  assert windows.num_train_windows(data.train_lengths, 3, "all") == 3
  batch = windows.build_train_batch(
      data.items, data.offsets, data.train_lengths, users, ends, seq_len=3,
      num_targets=2, num_items=v)
  np.testing.assert_array_equal(batch["inputs"], [[1, 2, 3], [v, 7, 8]])
  np.testing.assert_array_equal(batch["targets"], [
      [[2, 3], [3, 4], [4, -1]],
      [[-1, -1], [8, 9], [9, -1]],
  ])
  # A window longer than the history: left-padded, the same last targets.
  users, ends = windows.train_window_index(data.train_lengths, seq_len=6,
                                           train_windows="last")
  batch = windows.build_train_batch(
      data.items, data.offsets, data.train_lengths, users, ends, seq_len=6,
      num_targets=1, num_items=v)
  np.testing.assert_array_equal(batch["inputs"][0], [v, v, 0, 1, 2, 3])
  np.testing.assert_array_equal(batch["targets"][0, :, 0], [-1, -1, 1, 2, 3, 4])
  np.testing.assert_array_equal(batch["weights"][0], [0, 0, 1, 1, 1, 1])
  with pytest.raises(ValueError, match="train_windows must be one of"):
    windows.train_window_index(data.train_lengths, 3, "first")


@pytest.mark.parametrize("train_windows", windows.TRAIN_WINDOWS)
def test_labels_never_hold_held_out_items(synthetic_prepared, train_windows):
  data = synthetic_prepared
  users, ends = windows.train_window_index(data.train_lengths, 8, train_windows)
  batch = windows.build_train_batch(
      data.items, data.offsets, data.train_lengths, users, ends, seq_len=8,
      num_targets=3, num_items=data.num_items)
  # Every label is an item at a training position of its user, and the
  # newest window of each user ends at its last training item.
  base = data.offsets[users][:, None, None]
  pos = ends[:, None, None] - 8 + np.arange(8)[None, :, None] + 1 + np.arange(3)
  valid = batch["targets"] >= 0
  assert (pos < data.train_lengths[users][:, None, None])[valid].all()
  np.testing.assert_array_equal(batch["targets"][valid],
                                np.asarray(data.items)[(base + pos)[valid]])
  last = data.offsets[users] + data.train_lengths[users] - 1
  newest = np.r_[users[1:] != users[:-1], True]
  np.testing.assert_array_equal(batch["targets"][newest, -1, 0],
                                np.asarray(data.items)[last[newest]])
  if train_windows == "last":
    np.testing.assert_array_equal(users, np.flatnonzero(data.train_lengths >= 2))


@pytest.mark.parametrize("train_windows", windows.TRAIN_WINDOWS)
def test_one_epoch_of_a_policy_yields_its_windows_once(synthetic_prepared, train_windows):
  data = synthetic_prepared
  ds = pipeline.train_dataset(data, seq_len=8, num_targets=2, batch_size=1, seed=0,
                              num_epochs=1, process_index=0, process_count=1,
                              train_windows=train_windows)
  seen = sorted(r for batch in ds for r in _rows(batch))
  users, ends = windows.train_window_index(data.train_lengths, 8, train_windows)
  expected = windows.build_train_batch(
      data.items, data.offsets, data.train_lengths, users, ends, seq_len=8,
      num_targets=2, num_items=data.num_items)
  assert seen == sorted(_rows(expected))


def test_one_epoch_yields_every_window_once(synthetic_prepared):
  data = synthetic_prepared
  n, l = 8, 3
  ds = pipeline.train_dataset(data, seq_len=n, num_targets=l, batch_size=1,
                              seed=0, num_epochs=1, process_index=0,
                              process_count=1)
  seen = sorted(r for batch in ds for r in _rows(batch))
  users, ends = windows.train_window_index(data.train_lengths, n)
  expected = windows.build_train_batch(
      data.items, data.offsets, data.train_lengths, users, ends, seq_len=n,
      num_targets=l, num_items=data.num_items)
  assert len(seen) == len(users) == data.manifest["train_windows"]["8"]
  assert seen == sorted(_rows(expected))


def _take(iterator, count):
  return [next(iterator) for _ in range(count)]


def _assert_same(batches_a, batches_b):
  assert len(batches_a) == len(batches_b)
  for a, b in zip(batches_a, batches_b):
    for key in a:
      np.testing.assert_array_equal(a[key], b[key], err_msg=key)


def test_seeded_pipeline_is_deterministic(synthetic_prepared):
  kwargs = dict(seq_len=8, num_targets=2, batch_size=16, process_index=0,
                process_count=1)
  first = _take(pipeline.train_iterator(synthetic_prepared, seed=7, **kwargs),
                6)
  again = _take(pipeline.train_iterator(synthetic_prepared, seed=7, **kwargs),
                6)
  other = _take(pipeline.train_iterator(synthetic_prepared, seed=8, **kwargs),
                6)
  _assert_same(first, again)
  assert not all(np.array_equal(a["inputs"], b["inputs"])
                 for a, b in zip(first, other))


@pytest.mark.parametrize("train_windows", windows.TRAIN_WINDOWS)
def test_resume_from_saved_state_yields_the_next_batches(synthetic_prepared, train_windows):
  kwargs = dict(seq_len=8, num_targets=2, batch_size=16, seed=3,
                process_index=0, process_count=1, train_windows=train_windows)
  # More batches than one epoch holds, to cross an epoch boundary.
  epoch = windows.num_train_windows(synthetic_prepared.train_lengths, 8, train_windows) // 16
  iterator = pipeline.train_iterator(synthetic_prepared, **kwargs)
  _take(iterator, epoch - 1)
  state = json.loads(json.dumps(iterator.get_state()))  # as a checkpoint does
  expected = _take(iterator, 4)
  resumed = pipeline.train_iterator(synthetic_prepared, **kwargs)
  resumed.set_state(state)
  _assert_same(_take(resumed, 4), expected)


@pytest.mark.parametrize("train_windows", windows.TRAIN_WINDOWS)
@pytest.mark.parametrize("process_count", [2, 3])
def test_process_shards_partition_the_global_batch(synthetic_prepared,
                                                   process_count, train_windows):
  kwargs = dict(seq_len=8, num_targets=2, seed=11, train_windows=train_windows)
  per_process = 4
  single = _take(pipeline.train_iterator(
      synthetic_prepared, batch_size=per_process * process_count,
      process_index=0, process_count=1, **kwargs), 5)
  shards = [_take(pipeline.train_iterator(
      synthetic_prepared, batch_size=per_process, process_index=p,
      process_count=process_count, **kwargs), 5) for p in range(process_count)]
  for step, global_batch in enumerate(single):
    for p in range(process_count):
      for key, value in global_batch.items():
        np.testing.assert_array_equal(value[p::process_count],
                                      shards[p][step][key])


def test_eval_examples_on_a_hand_made_sequence(hand_prepared):
  v = hand_prepared.num_items
  ds = pipeline.eval_dataset(hand_prepared, "test", seq_len=4, batch_size=2,
                             max_exclude=8, process_index=0, process_count=1)
  assert len(ds) == 1
  batch = ds[0]
  np.testing.assert_array_equal(batch["users"], [0, 1])
  # User 0: history 0..5, target 6. User 1: history 7 8 9 7, target 8.
  np.testing.assert_array_equal(batch["inputs"], [[2, 3, 4, 5], [7, 8, 9, 7]])
  np.testing.assert_array_equal(batch["targets"], [[6], [8]])
  np.testing.assert_array_equal(batch["exclude"], [
      [0, 1, 2, 3, 4, 5, -1, -1], [7, 8, 9, -1, -1, -1, -1, -1]])
  np.testing.assert_array_equal(batch["weights"], [1, 1])
  val = pipeline.eval_dataset(hand_prepared, "validation", seq_len=6,
                              batch_size=3, process_index=0, process_count=1)
  batch = val[0]
  # Padding row at the end; default E = longest history (6 events of user 0).
  np.testing.assert_array_equal(batch["users"], [0, 1, -1])
  np.testing.assert_array_equal(batch["weights"], [1, 1, 0])
  np.testing.assert_array_equal(batch["inputs"], [
      [v, 0, 1, 2, 3, 4], [v, v, v, 7, 8, 9], [v] * 6])
  np.testing.assert_array_equal(batch["targets"], [[5], [7], [-1]])
  assert batch["exclude"].shape == (3, 6)
  np.testing.assert_array_equal(batch["exclude"][2], [-1] * 6)


def test_eval_targets_of_a_window_are_distinct_and_padded(tmp_path,
                                                          make_interactions):
  # Test window [20, 30): user 0 holds 5 4 5 3 there, user 1 holds 6.
  # Raw items 1..6 become dense ids 0..5.
  rows = [(0, 1, 1), (0, 2, 2), (0, 5, 21), (0, 4, 22), (0, 5, 23), (0, 3, 29),
          (1, 2, 3), (1, 1, 4), (1, 6, 25)]
  prepare.prepare_interactions(make_interactions(rows), tmp_path,
                               dataset="hand", split="gts",
                               split_options=dict(test_window=10,
                                                  validation_window=0, gap=0))
  data = storage.load_prepared(tmp_path)
  batch = pipeline.eval_dataset(data, "test", seq_len=2, batch_size=2,
                                process_index=0, process_count=1)[0]
  np.testing.assert_array_equal(batch["targets"],
                                [[4, 3, 2, -1], [5, -1, -1, -1]])
  cut = pipeline.eval_dataset(data, "test", seq_len=2, batch_size=2,
                              num_targets=2, max_exclude=1, process_index=0,
                              process_count=1)[0]
  np.testing.assert_array_equal(cut["targets"], [[4, 3], [5, -1]])
  # The most recent history item of user 0 is raw 2, of user 1 raw 1.
  np.testing.assert_array_equal(cut["exclude"], [[1], [0]])


@pytest.mark.parametrize("process_count,batch_size", [(1, 7), (3, 7), (4, 5)])
def test_eval_shards_cover_every_user_once(synthetic_prepared, process_count,
                                           batch_size):
  data = synthetic_prepared
  per_process = [list(pipeline.eval_dataset(
      data, "test", seq_len=8, batch_size=batch_size, process_index=p,
      process_count=process_count)) for p in range(process_count)]
  assert len({len(batches) for batches in per_process}) == 1
  users, padding = [], 0
  for batch in itertools.chain.from_iterable(per_process):
    assert batch["inputs"].shape == (batch_size, 8)
    real = batch["weights"] > 0
    users += batch["users"][real].tolist()
    padding += int((~real).sum())
    assert (batch["users"][~real] == -1).all()
    assert (batch["targets"][~real] == -1).all()
  assert sorted(users) == sorted(data.test[:, 0].tolist())
  assert padding < batch_size * process_count


def test_bad_sizes_and_processes(hand_prepared):
  for kwargs, message in [
      (dict(seq_len=0, num_targets=1), "seq_len must be an integer >= 1, got 0"),
      (dict(seq_len=2, num_targets=0), "num_targets must be an integer >= 1"),
      (dict(seq_len=2, num_targets=1, batch_size=0), "batch_size"),
      (dict(seq_len=2, num_targets=1, process_index=2, process_count=2),
       r"process_index must be in \[0, process_count\)"),
  ]:
    with pytest.raises(ValueError, match=message):
      pipeline.train_dataset(hand_prepared, **{"batch_size": 2, "seed": 0,
                                               **kwargs})
  with pytest.raises(ValueError, match="unknown evaluation split 'train'"):
    pipeline.eval_dataset(hand_prepared, "train", seq_len=2, batch_size=2)
  with pytest.raises(ValueError, match="max_exclude must be"):
    pipeline.eval_dataset(hand_prepared, "test", seq_len=2, batch_size=2,
                          max_exclude=0)


def test_no_training_window_is_an_error(tmp_path, make_interactions):
  # Three events each: leave-one-out leaves one training event per user.
  rows = [(u, i, i) for u in range(2) for i in range(3)]
  prepare.prepare_interactions(make_interactions(rows), tmp_path,
                               dataset="hand")
  with pytest.raises(ValueError, match="no training window"):
    pipeline.train_dataset(storage.load_prepared(tmp_path), seq_len=2,
                           num_targets=1, batch_size=1, seed=0)


def test_to_global_arrays(synthetic_prepared):
  devices = np.array(jax.devices())
  mesh = jax.sharding.Mesh(devices, ("data",))
  batch = next(pipeline.train_iterator(
      synthetic_prepared, seq_len=8, num_targets=2, batch_size=len(devices),
      seed=0))
  arrays = pipeline.to_global_arrays(batch, NamedSharding(mesh, P("data")))
  assert set(arrays) == set(batch)
  for key, value in batch.items():
    assert arrays[key].shape == value.shape and arrays[key].dtype == value.dtype
    np.testing.assert_array_equal(np.asarray(arrays[key]), value)
    assert len(arrays[key].addressable_shards) == len(devices)
