"""grain input pipelines over a prepared dataset, sharded by process.

Training (:func:`train_dataset`, :func:`train_iterator`)::

  MapDataset.range(W)            window ids, W = number of training windows
    .shuffle(seed=seed)          a new permutation each epoch
    .repeat(num_epochs)          None = forever
    [process_index::process_count]
    .batch(batch_size, drop_remainder=True)   per-process batch of window ids
    .map(build the batch)        vectorized gather, see trainer.data.windows

With the event arrays cut into S > 1 user shards
(:attr:`~trainer.data.storage.PreparedDataset.num_shards`), the stream is a
round robin over the shards instead: element k is the next window of shard
``k % S``, each shard's windows shuffled (its own seed) and repeated. The
stream depends on S and the seed, never on P; when P divides S, process p
reads only shards ``p, p + P, ...`` (and opens only their files).

Element k of the repeated, shuffled stream goes to process ``k % P``, so the
per-process batch b of process p holds global elements ``p, p + P, ...`` of
global batch b: the P processes' batches are exactly the single-process batch
of ``P * batch_size`` rows, split by row ``i % P``.

Evaluation (:func:`eval_dataset`): every example once, no shuffle. The
example list is padded with weight-0 rows up to a multiple of
``batch_size * process_count`` and dealt round-robin, so every process runs the
same number of batches and no user is dropped or seen twice. With S > 1
shards and P dividing S, process p instead takes the examples of its own
shards ``p, p + P, ...`` (in user order), each process's list padded to the
longest one's batches, so evaluation too opens only its shards' files.

Batches are dicts of numpy arrays; ids follow the convention of
:mod:`trainer.data.windows` (items in ``[0, V)``, inputs padded with V,
targets and exclude padded with -1). :func:`to_global_arrays` makes them global
``jax.Array`` s.
"""

from __future__ import annotations

from collections.abc import Mapping

import sys

import grain
import jax
import numpy as np

from trainer.data import windows
from trainer.data.storage import PreparedDataset


def _process(process_index: int | None, process_count: int | None
             ) -> tuple[int, int]:
  """Fills in jax's process index and count and checks them."""
  index = jax.process_index() if process_index is None else int(process_index)
  count = jax.process_count() if process_count is None else int(process_count)
  if count < 1 or not 0 <= index < count:
    raise ValueError(f"process_index must be in [0, process_count) with "
                     f"process_count >= 1, got {index} and {count}")
  return index, count


class _TrainBatch:
  """Picklable map function: window ids ``[b]`` -> training batch."""

  def __init__(self, data: PreparedDataset, seq_len: int, num_targets: int,
               train_windows: str):
    self._data = data
    self._seq_len = seq_len
    self._num_targets = num_targets
    self._users, self._ends = windows.train_window_index(
        data.train_lengths, seq_len, train_windows)

  def __len__(self) -> int:
    return int(self._users.shape[0])

  def __call__(self, window_ids: np.ndarray) -> dict[str, np.ndarray]:
    window_ids = np.asarray(window_ids, np.int64)
    return windows.build_train_batch(
        self._data.items, self._data.offsets, self._data.train_lengths,
        self._users[window_ids], self._ends[window_ids],
        seq_len=self._seq_len, num_targets=self._num_targets,
        num_items=self._data.num_items)


class _ShardRoundRobin(grain.MapDataset):
  """Window ids: element k is element ``k // S`` of shard ``k % S``'s stream.

  Each shard's stream is its window ids ``[start_s, stop_s)`` shuffled with
  the shard's seed and repeated forever; with ``num_epochs`` the stream ends
  after ``num_epochs * W`` elements (every shard has taken about
  ``num_epochs`` passes).
  """

  def __init__(self, bounds: list[tuple[int, int]], *, seed: int, num_epochs: int | None):
    super().__init__()
    self._streams = [
        grain.MapDataset.range(start, stop).shuffle(
            seed=int(np.random.SeedSequence((seed, shard)).generate_state(1)[0])).repeat(None)
        for shard, (start, stop) in enumerate(bounds)]
    total = sum(stop - start for start, stop in bounds)
    self._length = sys.maxsize if num_epochs is None else total * int(num_epochs)

  def __len__(self) -> int:
    return self._length

  def __getitem__(self, index):
    if isinstance(index, slice):
      return self.slice(index)
    count = len(self._streams)
    return self._streams[index % count][index // count]

  def __str__(self) -> str:
    return f"ShardRoundRobin(shards={len(self._streams)})"


def _shard_window_bounds(data: PreparedDataset, seq_len: int,
                        train_windows: str) -> list[tuple[int, int]]:
  """Per user shard with training windows: its range of (user-major) window ids."""
  per_user = windows.num_windows_per_user(data.train_lengths, seq_len, train_windows)
  first = np.concatenate([[0], np.cumsum(per_user)])
  users = data.shard_users
  bounds = [(int(first[a]), int(first[b])) for a, b in zip(users[:-1], users[1:])]
  return [(start, stop) for start, stop in bounds if stop > start]


def train_dataset(data: PreparedDataset, *, seq_len: int, num_targets: int,
                  batch_size: int, seed: int, num_epochs: int | None = None,
                  process_index: int | None = None,
                  process_count: int | None = None,
                  train_windows: str = "all") -> grain.MapDataset:
  """The training pipeline as a (random-access) ``grain.MapDataset``.

  Args:
    data: a prepared dataset (:func:`trainer.data.load_prepared`).
    seq_len: N, inputs per window.
    num_targets: L, next items per position.
    batch_size: per-process batch size b (global batch = b * process_count).
    seed: shuffle seed; the order is a function of the seed alone.
    num_epochs: passes over the windows; None repeats forever. A last partial
      batch is dropped.
    process_index: this process; defaults to ``jax.process_index()``.
    process_count: number of processes; defaults to ``jax.process_count()``.
    train_windows: the windows of an epoch: ``"all"`` non-overlapping
      windows of every history, or ``"last"``, each user's most recent
      window (:mod:`trainer.data.windows`).

  Returns:
    MapDataset of dicts: ``inputs`` int32 ``[b, N]`` (padding V), ``targets``
    int32 ``[b, N, L]`` (padding -1), ``weights`` float32 ``[b, N]``.

  Raises:
    ValueError: N, L or b below 1, bad process arguments, or no training
      window (no user with two training events).
  """
  windows.check_positive(seq_len=seq_len, num_targets=num_targets,
                         batch_size=batch_size)
  index, count = _process(process_index, process_count)
  make_batch = _TrainBatch(data, seq_len, num_targets, train_windows)
  if len(make_batch) == 0:
    raise ValueError(f"{data.path} has no training window: no user has 2 or "
                     "more training events; expected at least one")
  if data.num_shards > 1:
    dataset = _ShardRoundRobin(_shard_window_bounds(data, seq_len, train_windows), seed=seed,
                               num_epochs=num_epochs)[index::count]
  else:
    dataset = grain.MapDataset.range(len(make_batch)).shuffle(seed=seed)
    dataset = dataset.repeat(num_epochs)[index::count]
  return dataset.batch(batch_size, drop_remainder=True).map(make_batch)


def train_iterator(data: PreparedDataset, *, seq_len: int, num_targets: int,
                   batch_size: int, seed: int, num_epochs: int | None = None,
                   process_index: int | None = None,
                   process_count: int | None = None, num_threads: int = 2,
                   prefetch_buffer_size: int = 8,
                   train_windows: str = "all") -> grain.DatasetIterator:
  """A checkpointable iterator over :func:`train_dataset` batches.

  The iterator's ``get_state()`` / ``set_state(state)`` (and
  ``grain.checkpoint.CheckpointSave`` / ``CheckpointRestore``) save and
  restore the position: a restored iterator yields exactly the batches the
  saved one would have yielded next.

  Args:
    data, seq_len, num_targets, batch_size, seed, num_epochs, process_index,
      process_count, train_windows: see :func:`train_dataset`.
    num_threads: grain read threads.
    prefetch_buffer_size: batches read ahead.

  Returns:
    ``grain.DatasetIterator`` of training batches.

  Example:
    >>> it = train_iterator(data, seq_len=50, num_targets=4, batch_size=32,
    ...                     seed=0)  # doctest: +SKIP
    >>> state = it.get_state()  # doctest: +SKIP
  """
  dataset = train_dataset(data, seq_len=seq_len, num_targets=num_targets,
                          batch_size=batch_size, seed=seed,
                          num_epochs=num_epochs, process_index=process_index,
                          process_count=process_count, train_windows=train_windows)
  options = grain.ReadOptions(num_threads=num_threads,
                              prefetch_buffer_size=prefetch_buffer_size)
  return iter(dataset.to_iter_dataset(options))


class _EvalExample:
  """Picklable map function: padded example index -> evaluation example."""

  def __init__(self, data: PreparedDataset, examples: np.ndarray, *,
               seq_len: int, num_targets: int, max_exclude: int):
    self._data = data
    self._examples = examples
    self._options = dict(seq_len=seq_len, num_targets=num_targets,
                         max_exclude=max_exclude, num_items=data.num_items)

  def __call__(self, index: int) -> dict[str, np.ndarray]:
    row = self._examples[index] if index < self._examples.shape[0] else None
    return windows.build_eval_example(self._data.items, self._data.offsets,
                                      row, **self._options)


def eval_dataset(data: PreparedDataset, split: str, *, seq_len: int,
                 batch_size: int, num_targets: int | None = None,
                 max_exclude: int | None = None,
                 process_index: int | None = None,
                 process_count: int | None = None) -> grain.MapDataset:
  """The evaluation pipeline of ``"validation"`` or ``"test"``.

  Args:
    data: a prepared dataset.
    split: ``"validation"`` or ``"test"``.
    seq_len: N, the last N history items are the inputs.
    batch_size: per-process batch size b.
    num_targets: L; default the longest held-out part of the split (so no
      target is cut). Leave-one-out has one target.
    max_exclude: E; default the longest history of the dataset (so the whole
      history is excluded). With a smaller E the E most recent distinct items
      are kept.
    process_index, process_count: see :func:`train_dataset`.

  Returns:
    Finite MapDataset, the same number of batches on every process, of dicts:
    ``inputs`` int32 ``[b, N]``, ``targets`` int32 ``[b, L]``, ``exclude``
    int32 ``[b, E]``, ``weights`` float32 ``[b]`` (0 for padding rows added
    to fill the last global batch), ``users`` int32 ``[b]`` (-1 for padding).

  Raises:
    ValueError: unknown split, sizes below 1, bad process arguments.
  """
  examples = data.examples(split)
  manifest = data.manifest
  if num_targets is None:
    num_targets = max(1, manifest[f"max_{split}_targets"])
  if max_exclude is None:
    max_exclude = max(1, manifest["max_history"])
  windows.check_positive(seq_len=seq_len, batch_size=batch_size,
                         num_targets=num_targets, max_exclude=max_exclude)
  index, count = _process(process_index, process_count)
  make_example = _EvalExample(data, examples, seq_len=seq_len,
                              num_targets=num_targets, max_exclude=max_exclude)
  if count > 1 and data.num_shards % count == 0:
    return grain.MapDataset.source(
        _own_shard_examples(data, examples, index, count, batch_size)).map(
            make_example).batch(batch_size)
  global_batch = batch_size * count
  padded = -(-examples.shape[0] // global_batch) * global_batch
  dataset = grain.MapDataset.range(padded)[index::count].map(make_example)
  return dataset.batch(batch_size)


def _own_shard_examples(data: PreparedDataset, examples: np.ndarray, index: int,
                        count: int, batch_size: int) -> np.ndarray:
  """Indices of the examples of shards ``index, index + count, ...``.

  Padded with ``len(examples)`` (a weight-0 row) to the batches of the
  process with the most examples, so every process runs as many batches.
  """
  shard = np.searchsorted(data.shard_users, examples[:, 0], side="right") - 1
  owner = shard % count
  longest = int(np.bincount(owner, minlength=count).max()) if owner.size else 0
  length = -(-longest // batch_size) * batch_size
  mine = np.flatnonzero(owner == index)
  return np.concatenate([mine, np.full(length - mine.size, examples.shape[0], np.int64)])


def to_global_arrays(batch: Mapping[str, np.ndarray],
                     sharding: jax.sharding.Sharding
                     | Mapping[str, jax.sharding.Sharding]
                     ) -> dict[str, jax.Array]:
  """Turns this process's batch into global arrays.

  Each process passes its own rows; the global batch concatenates the
  processes' rows along the leading axis (``jax.make_array_from_process_local_data``).

  Args:
    batch: per-process numpy arrays, leading axis = per-process batch.
    sharding: one sharding for every array (e.g.
      ``NamedSharding(mesh, P("data"))``, which leaves trailing axes
      replicated) or one per key.

  Returns:
    Dict of ``jax.Array`` with leading axis ``process_count`` times larger.
  """
  def pick(key):
    return sharding[key] if isinstance(sharding, Mapping) else sharding

  return {key: jax.make_array_from_process_local_data(pick(key), value)
          for key, value in batch.items()}
