"""Shape catalog and input makers shared by the tests and the benchmarks.

Every case has a V that no power-of-two `block_v` divides, padding ids of all
kinds (-1, V, 10**9), repeated targets, rows with no valid target and
positions of weight 0.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


class Case(NamedTuple):
  leading: tuple[int, ...]  # [B, N] or [T]
  vocab: int
  dim: int
  num_targets: int
  num_exclude: int
  block_v: int


CASES = {
    "ragged_v1003": Case((3, 7), 1003, 16, 5, 6, 128),
    "flat_tokens": Case((29,), 517, 8, 3, 40, 100),
    "one_tile": Case((2, 5), 97, 12, 4, 3, 128),
    "tiny_tiles": Case((4, 3), 301, 4, 2, 2, 7),
}


def make_case(case: Case, seed: int = 0, *, logit_scale: float = 1.0):
  """NumPy float64 inputs for `case`: hidden, table, bias, targets, weights, exclude."""
  rng = np.random.default_rng(seed)
  t = int(np.prod(case.leading))
  hidden = rng.normal(size=case.leading + (case.dim,)) * logit_scale / np.sqrt(case.dim)
  table = rng.normal(size=(case.vocab, case.dim))
  bias = rng.normal(size=(case.vocab,)) * 0.5 - 1.0
  targets = rng.integers(0, case.vocab, size=(t, case.num_targets))
  # Padding of every kind, repeats, and one row with no valid target.
  pad_ids = np.array([-1, case.vocab, 10**9, -7])
  pad = rng.random(targets.shape) < 0.25
  targets[pad] = rng.choice(pad_ids, size=pad.sum())
  if case.num_targets > 1:
    targets[1, 1] = targets[1, 0] = rng.integers(0, case.vocab)
  targets[0] = -1
  weights = rng.random(t) + 0.5
  weights[rng.random(t) < 0.2] = 0.0
  exclude = rng.integers(-1, case.vocab, size=(t, case.num_exclude))
  if case.num_exclude > 1 and case.num_targets > 0:
    exclude[2, 0] = targets[2, -1]  # overlaps a target (which stays a target)
    exclude[2, 1] = exclude[2, 0] if exclude[2, 0] >= 0 else 3  # repeated
  shape = lambda a: a.reshape(case.leading + a.shape[1:])
  return dict(
      hidden=hidden, table=table, bias=bias, targets=shape(targets).astype(np.int32),
      weights=weights.reshape(case.leading), exclude=shape(exclude).astype(np.int32),
  )
