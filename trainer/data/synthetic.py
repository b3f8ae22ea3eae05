"""Synthetic interactions: Zipf popularity with planted item-to-item transitions.

Each user draws a sequence. The first item is drawn from a Zipf popularity law;
every next item is, with probability ``transition_prob``, the planted successor
of the previous item, ``succ(v) = (a * v + c) mod V`` (a bijection, so no table
is stored), and otherwise a fresh Zipf draw. A sequential model can learn the
successors and beat a popularity baseline, whose best hit rate is the Zipf head.

Zipf draws use the inverse CDF of the continuous law ``p(x) ~ x^-s`` on
``[1, V + 1)``: ``rank = floor(x) - 1`` in ``[0, V)``, then a second affine
bijection scatters ranks over ids so that popular items are not simply the
small ids. Nothing of size ``V`` is allocated.

Generation runs over chunks of users, each with its own generator seeded by
``(seed, chunk index)``, straight into preallocated output arrays: memory is the
output (12 bytes per interaction: int32 user and item, int64 timestamp) plus
one chunk of about 4M interactions. Results depend only on the arguments.
"""

from __future__ import annotations

import math

import numpy as np

from trainer.config import budget
from trainer.config.schema import ConfigError
from trainer.data import sources

_CHUNK_INTERACTIONS = 1 << 22


def _coprime_multiplier(num_items: int, rng: np.random.Generator) -> int:
  """An odd-ish multiplier a with gcd(a, V) == 1, so v -> a v + c is a bijection."""
  a = int(rng.integers(num_items // 3 + 1, num_items + 2)) | 1
  while math.gcd(a, num_items) != 1:
    a += 1
  return a % num_items if num_items > 1 else 1


def zipf_ranks(rng: np.random.Generator, shape: tuple[int, ...],
               num_items: int, exponent: float) -> np.ndarray:
  """Draws popularity ranks in ``[0, V)`` from a continuous Zipf law.

  Args:
    rng: generator.
    shape: output shape.
    num_items: V.
    exponent: s > 0; larger is more skewed.

  Returns:
    int64 array of ``shape``.
  """
  u = rng.random(shape)
  top = float(num_items + 1)
  if abs(exponent - 1.0) < 1e-9:
    x = np.exp(u * math.log(top))
  else:
    one_minus = 1.0 - exponent
    x = ((top ** one_minus - 1.0) * u + 1.0) ** (1.0 / one_minus)
  return np.clip(np.floor(x).astype(np.int64) - 1, 0, num_items - 1)


# Bytes per item of the catalog that preparation holds at once: the int64 raw id
# of every item (the item-id map) and its copy on the way to disk.
CATALOG_BYTES_PER_ITEM = 16


def check_catalog_fits(num_items: int) -> None:
  """Refuses, in one line, a declared catalog whose item-id map cannot fit this host.

  Every item, even one never drawn, gets a raw id in the prepared data
  (`item_ids`, int64 [V]): `num_items=2e9` asked numpy for 32 GB and failed
  with a MemoryError traceback (issue 41).

  Raises:
    ConfigError: naming `num_items`, the bytes and the host's memory.
  """
  memory = budget.host_memory_bytes()
  if memory is None or num_items * CATALOG_BYTES_PER_ITEM <= memory:
    return
  raise ConfigError(
      f"num_items={num_items}: at most {memory // CATALOG_BYTES_PER_ITEM:,} on this host "
      f"(preparing keeps {CATALOG_BYTES_PER_ITEM} bytes per item, the raw id of every item "
      f"and its copy: {budget.gib(num_items * CATALOG_BYTES_PER_ITEM)}, and this host's memory "
      f"is {budget.gib(memory)})")


def generate_synthetic(num_users: int = 1_000, num_items: int = 10_000,
                       interactions_per_user: int = 50,
                       zipf_exponent: float = 1.0,
                       transition_prob: float = 0.5, seed: int = 0,
                       mean_gap_seconds: int = 600,
                       horizon_seconds: int = 100_000_000
                       ) -> sources.Interactions:
  """Generates a deterministic synthetic dataset.

  Sequence lengths are uniform in ``[ceil(m / 2), m + m // 2]`` for
  ``m = interactions_per_user`` (so the mean is about m). User u starts at a
  uniform time in ``[0, horizon_seconds)`` and events follow with gaps uniform
  in ``[1, 2 * mean_gap_seconds]``.

  Args:
    num_users: U >= 1.
    num_items: V >= 1, the catalog size (ids in ``[0, V)``).
    interactions_per_user: mean sequence length m >= 1.
    zipf_exponent: Zipf exponent s > 0.
    transition_prob: probability in [0, 1] that the next item is the planted
      successor of the previous one.
    seed: everything is a function of the arguments and this seed.
    mean_gap_seconds: mean time between two events of a user.
    horizon_seconds: range of user start times.

  Returns:
    Interactions in user-major, time-ascending order with
    ``num_items=V`` declared; int32 ``[n]`` user and item, int64 timestamps.

  Raises:
    ValueError: a size below 1, an exponent <= 0 or a probability outside
      [0, 1].

  Example:
    >>> data = generate_synthetic(num_users=3, num_items=20,
    ...                           interactions_per_user=4, seed=1)
    >>> bool((data.item < 20).all())
    True
  """
  for name, value in (("num_users", num_users), ("num_items", num_items),
                      ("interactions_per_user", interactions_per_user),
                      ("mean_gap_seconds", mean_gap_seconds),
                      ("horizon_seconds", horizon_seconds)):
    if int(value) != value or value < 1:
      raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
  if num_items >= 2**31 or num_users >= 2**31:
    raise ValueError(f"num_users {num_users} and num_items {num_items} must "
                     "be < 2**31 (int32 ids)")
  check_catalog_fits(num_items)
  if not zipf_exponent > 0:
    raise ValueError(f"zipf_exponent must be > 0, got {zipf_exponent!r}")
  if not 0.0 <= transition_prob <= 1.0:
    raise ValueError(
        f"transition_prob must be in [0, 1], got {transition_prob!r}")

  setup = np.random.default_rng([seed, 0])
  succ_a = _coprime_multiplier(num_items, setup)
  succ_c = int(setup.integers(0, num_items))
  scatter_a = _coprime_multiplier(num_items, setup)
  scatter_c = int(setup.integers(0, num_items))
  m = int(interactions_per_user)
  lengths = setup.integers((m + 1) // 2, m + m // 2 + 1, size=num_users)
  starts = setup.integers(0, horizon_seconds, size=num_users)
  offsets = np.concatenate([[0], np.cumsum(lengths)])
  total = int(offsets[-1])

  user = np.empty(total, np.int32)
  item = np.empty(total, np.int32)
  timestamp = np.empty(total, np.int64)
  users_per_chunk = max(1, _CHUNK_INTERACTIONS // int(lengths.max()))
  for chunk, first in enumerate(range(0, num_users, users_per_chunk)):
    last = min(num_users, first + users_per_chunk)
    rng = np.random.default_rng([seed, 1, chunk])
    chunk_lengths = lengths[first:last]
    width = int(chunk_lengths.max())
    ranks = zipf_ranks(rng, (last - first, width), num_items, zipf_exponent)
    fresh = (scatter_a * ranks + scatter_c) % num_items  # [users, width]
    jump = rng.random((last - first, width)) < transition_prob
    sequence = np.empty_like(fresh)
    sequence[:, 0] = fresh[:, 0]
    for t in range(1, width):
      successor = (succ_a * sequence[:, t - 1] + succ_c) % num_items
      sequence[:, t] = np.where(jump[:, t], successor, fresh[:, t])
    gaps = rng.integers(1, 2 * mean_gap_seconds + 1, size=(last - first, width))
    times = starts[first:last, None] + np.cumsum(gaps, axis=1)
    valid = np.arange(width)[None, :] < chunk_lengths[:, None]
    lo, hi = int(offsets[first]), int(offsets[last])
    item[lo:hi] = sequence[valid]
    timestamp[lo:hi] = times[valid]
    user[lo:hi] = np.repeat(np.arange(first, last, dtype=np.int32),
                            chunk_lengths)
  return sources.Interactions(user=user, item=item, timestamp=timestamp,
                              num_items=num_items, name="synthetic")


def planted_successor(num_items: int, seed: int):
  """Returns the planted successor function ``v -> succ(v)`` of a seed.

  Useful to check that a model learned the transitions.
  """
  setup = np.random.default_rng([seed, 0])
  a = _coprime_multiplier(num_items, setup)
  c = int(setup.integers(0, num_items))
  return lambda v: (a * np.asarray(v, np.int64) + c) % num_items
