"""Host-side check of a batch's id arrays before they become jax arrays.

With `jax_enable_x64` off (the default) jax converts an int64 NumPy argument
of a jitted function to int32 by wrapping, before the function sees it: an id
of 2^32 + 5 reaches `cutbce` as item 5, where called eagerly it would be
padding (the op checks the range in the caller's integer type, but under
`jit` the caller's type is already int32). The trainer builds its batches as
int32 from int32 prepared items, so this cannot happen today; `check_int32`
keeps it that way where batches enter jax (the training loop, `evaluate`,
`recommend`), at the cost of a min/max over any array of a wider integer
type (int32 arrays are in range by their type and are not read).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

INT32 = np.iinfo(np.int32)


def check_int32(batch: Mapping[str, np.ndarray]) -> None:
  """Raises unless every integer array of `batch` fits int32.

  Raises:
    ValueError: one line naming the array and its out-of-range value.
  """
  for name, value in batch.items():
    array = np.asarray(value)
    if array.dtype.kind not in "iu" or array.size == 0:
      continue
    if np.can_cast(array.dtype, np.int32, casting="safe"):
      continue
    low, high = int(array.min()), int(array.max())
    if low < INT32.min or high > INT32.max:
      bad = high if high > INT32.max else low
      raise ValueError(
          f"batch[{name!r}] holds {bad} ({array.dtype}), outside int32: jax would wrap it "
          f"to {np.asarray(bad).astype(np.int64).astype(np.int32)} under jit with x64 off "
          "(ids must be dense, below 2^31)")
