"""The XLA kernels' excluded-column masks: a scatter (CPU, GPU) and compares (TPU) agree."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings, strategies as st

from cutbce.kernels import xla


def _numpy_mask(exclude_ids, start, size):
  mask = np.zeros((exclude_ids.shape[0], size), bool)
  for row, ids in enumerate(exclude_ids):
    for item in ids:
      if start <= item < start + size:
        mask[row, item - start] = True
  return mask


@settings(max_examples=40, deadline=None)
@given(tokens=st.integers(1, 9), width=st.integers(1, 7), size=st.integers(1, 40),
       start=st.integers(0, 50), seed=st.integers(0, 2**31 - 1))
def test_scatter_and_compares_mark_the_same_columns(tokens, width, size, start, seed):
  # Ids before, inside and past the tile, -1 for none, repeats in a row.
  rng = np.random.default_rng(seed)
  exclude_ids = rng.integers(-1, start + size + 5, size=(tokens, width)).astype(np.int32)
  exclude_ids[:, -1] = exclude_ids[:, 0]
  want = _numpy_mask(exclude_ids, start, size)
  for mark in (xla.excluded_by_scatter, xla.excluded_by_compare, xla.excluded_columns):
    got = jax.jit(mark, static_argnums=2)(jnp.asarray(exclude_ids), jnp.int32(start), size)
    np.testing.assert_array_equal(got, want, err_msg=mark.__name__)


def _lowered_text(platform):
  exclude_ids = jax.ShapeDtypeStruct((16, 5), jnp.int32)
  exported = jax.export.export(jax.jit(lambda ids: xla.excluded_columns(ids, 8, 32)),
                               platforms=(platform,))(exclude_ids)
  return exported.mlir_module()


def test_a_tpu_program_marks_columns_without_a_scatter():
  # The TPU's scatter applies its T x E updates one after another (about 20x
  # the compares' time at T = 25,600, E = 201: benchmarks/exclude_bench.py).
  assert "stablehlo.scatter" in _lowered_text("cpu")
  assert "stablehlo.scatter" not in _lowered_text("tpu")


def _bce_grad_text(exclude_shape):
  """The TPU program of cut_bce's XLA gradient with `exclude` of `exclude_shape`."""
  import cutbce  # pylint: disable=import-outside-toplevel
  spec = jax.ShapeDtypeStruct
  args = (spec((2, 9, 8), jnp.float32), spec((50, 8), jnp.float32),
          spec((2, 9, 2), jnp.int32), spec(exclude_shape, jnp.int32))

  def loss(hidden, table, targets, exclude):
    return cutbce.cut_bce(hidden, table, targets, exclude=exclude, backend="xla",
                          label_smoothing=0.1)

  grad = jax.jit(jax.grad(loss, (0, 1)))
  return jax.export.export(grad, platforms=("tpu",))(*args).mlir_module()


def test_bce_sets_shared_excluded_rows_per_row_not_per_token():
  # Per token, the T x (L + E) = 18 x 13 fixed ids are scattered into every
  # tile; one row per window is marked by compares and only the T x L targets
  # are set per token.
  assert "18x13xi32" in _bce_grad_text((2, 9, 11))
  assert "18x13xi32" not in _bce_grad_text((2, 1, 11))
