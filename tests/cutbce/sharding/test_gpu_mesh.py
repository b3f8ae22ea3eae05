"""`backend="pallas_triton"` inside `jax.shard_map` on all 8 simulated CPU devices.

Off a GPU the Triton kernels run in Pallas' generic interpreter (no host
callbacks), so every device of the mesh runs them. Inputs, layouts and
tolerances are those of test_pallas_mesh.py (V = 1003, which no vocab axis
divides: padded rows and a ragged last tile on every shard); compared from
one jitted value_and_grad, pallas_triton == sharded xla == unsharded dense to
float32 rounding, and ranks exactly on small-integer inputs.
"""

import functools

import jax
import numpy as np
import pytest

import cutbce
from cutbce.sharding import sharded_cut_bce, sharded_target_ranks
from tests.cutbce.sharding.test_pallas_mesh import (
    LAYOUTS, VARIANTS, B, N, L, V, _assert_close, _dense, _integer_inputs, _loss_and_grads, _mesh)

# 64-row vocab tiles, 16-row token tiles (Triton's smallest dot side).
PLAN = cutbce.TilePlan(block_v=64, block_t=16)
GPU_LAYOUTS = {"8x1": LAYOUTS[0], "2x4": LAYOUTS[2], "1x8": LAYOUTS[3],
               "4x2-replicated-table": LAYOUTS[4]}


def _sharded(layout, backend, num_items=None, options=(), reduction="mean"):
  shape, token_axes, vocab_axis = layout
  fn = functools.partial(sharded_cut_bce, mesh=_mesh(shape), token_axes=token_axes,
                         vocab_axis=vocab_axis, backend=backend,
                         plan=PLAN if backend == "pallas_triton" else None)
  return _loss_and_grads(fn, num_items, options, reduction)


@pytest.mark.parametrize("name", ["2x4", "4x2-replicated-table"])
def test_loss_stats_and_grads_match_xla_and_dense(name):
  layout = GPU_LAYOUTS[name]
  got = _sharded(layout, "pallas_triton")
  _assert_close(got, _sharded(layout, "xla"), "pallas_triton vs xla")
  _assert_close(got, _dense(), "pallas_triton vs dense")


@pytest.mark.slow  # two passes are checked unsharded in test_gpu.py
def test_per_position_losses_match_xla_and_dense():
  layout = GPU_LAYOUTS["8x1"]
  got = _sharded(layout, "pallas_triton", reduction="none")
  _assert_close(got, _sharded(layout, "xla", reduction="none"), "pallas_triton vs xla")
  _assert_close(got, _dense(), "pallas_triton vs dense")


@pytest.mark.slow  # num_items and variants are checked unsharded in test_gpu.py
def test_num_items_and_variants_match_xla_and_dense():
  layout = GPU_LAYOUTS["1x8"]
  got = _sharded(layout, "pallas_triton", 900, VARIANTS)
  _assert_close(got, _sharded(layout, "xla", 900, VARIANTS), "pallas_triton vs xla")
  _assert_close(got, _dense(900, VARIANTS), "pallas_triton vs dense")
  _, table_grad, bias_grad = got[2]
  assert not np.any(np.asarray(table_grad)[900:]) and not np.any(np.asarray(bias_grad)[900:])


def test_target_ranks_exact():
  shape, token_axes, vocab_axis = GPU_LAYOUTS["2x4"]
  hidden, table, bias, targets, exclude = _integer_inputs()
  kw = dict(bias=bias, exclude=exclude, num_items=900)

  def ranks(backend):
    fn = lambda h, t: sharded_target_ranks(  # noqa: E731
        h, t, targets, mesh=_mesh(shape), token_axes=token_axes, vocab_axis=vocab_axis,
        backend=backend, plan=PLAN if backend == "pallas_triton" else None, **kw)
    return np.asarray(jax.jit(fn)(hidden, table))

  got = ranks("pallas_triton")
  np.testing.assert_array_equal(got, ranks("xla"))
  np.testing.assert_array_equal(got, cutbce.target_ranks(hidden, table, targets,
                                                         backend="dense", **kw))
  assert got.shape == (B, N, L) and got.max() > 1
  assert np.all((got > 0) == ((targets >= 0) & (targets < 900))) and V > 900
