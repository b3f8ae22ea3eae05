"""Weighted confusion counts at the threshold logit > 0."""

from __future__ import annotations

from typing import NamedTuple

import jax


class Stats(NamedTuple):
  """Weighted confusion counts over all (position, item) pairs, float32 scalars.

  Each position contributes its counts times its weight; excluded ids count in
  none of the four. A pair is predicted positive when its logit is > 0 and is a
  true positive when its id is one of the position's (deduplicated) targets.

  Attributes:
    tp: predicted positive, is a target.
    fp: predicted positive, not a target.
    fn: predicted negative, is a target.
    tn: predicted negative, not a target.
  """

  tp: jax.Array
  fp: jax.Array
  fn: jax.Array
  tn: jax.Array

  @property
  def precision(self) -> jax.Array:
    return self.tp / jax.numpy.maximum(self.tp + self.fp, 1e-30)

  @property
  def recall(self) -> jax.Array:
    return self.tp / jax.numpy.maximum(self.tp + self.fn, 1e-30)
