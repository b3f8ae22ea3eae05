"""int64 ids >= 2^31 with x64 off: padding eagerly, wrapped under jit (documented).

Issue 32, bad #9. The op checks the id range in the type it receives; an
int64 NumPy argument of `jax.jit` is converted to int32 by jax first, so the
op cannot tell. This pins both behaviours so the documentation (cut_bce and
target_ranks docstrings, docs/loss.md) stays true; the trainer's host check
is tested in tests/trainer/test_data_ids.py.
"""

import jax
import numpy as np
import pytest

import cutbce


def _inputs():
  rng = np.random.default_rng(0)
  hidden = rng.normal(size=(2, 8)).astype(np.float32)
  table = rng.normal(size=(16, 8)).astype(np.float32)
  return hidden, table


def test_wide_ids_are_padding_eagerly_and_wrapped_under_jit():
  if jax.config.jax_enable_x64:
    pytest.skip("x64 on: int64 ids reach the op unwrapped")
  hidden, table = _inputs()
  wide = np.array([[2**32 + 5], [3]], np.int64)
  eager = np.asarray(cutbce.target_ranks(hidden, table, wide, backend="xla"))
  assert eager[0, 0] == 0  # padding
  jitted = np.asarray(jax.jit(
      lambda h, e, t: cutbce.target_ranks(h, e, t, backend="xla"))(hidden, table, wide))
  item_5 = np.asarray(cutbce.target_ranks(hidden, table, np.array([[5], [3]]), backend="xla"))
  np.testing.assert_array_equal(jitted, item_5)  # wrapped: item 5, as documented
  assert jitted[0, 0] >= 1


def test_the_docs_say_so():
  for function in (cutbce.cut_bce, cutbce.target_ranks):
    assert "wrapped" in function.__doc__ or "wrapping" in function.__doc__

