"""`sharded_cut_softmax_ce` against the unsharded op, on every 8-device mesh shape.

V = 1003 divides no vocab axis size, so every vocab-sharded case pads and
masks rows; `num_items=1000` leaves rows past it in the last shard. Loss to
1e-6 relative, gradients to 1e-5 of their largest entry (float32 sums in
another order), stats to 1e-6.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cutbce
from cutbce.sharding import collective_report, sharded_cut_softmax_ce
from tests.cutbce import meshes

B, N, D, V, L, E = 8, 6, 16, 1003, 3, 5

# (mesh shape, token_axes, vocab_axis) for mesh axes ("data", "model").
LAYOUTS = [
    ((8, 1), ("data",), None),
    ((4, 2), ("data",), "model"),
    ((2, 4), ("data", "model"), "model"),
    ((1, 8), ("model",), "model"),
    ((1, 8), (), "model"),
]


def _mesh(shape):
  return meshes.mesh(shape)


@functools.lru_cache(maxsize=None)
def _inputs():
  rng = np.random.default_rng(1)
  hidden = jnp.asarray(0.7 * rng.normal(size=(B, N, D)), jnp.float32)
  table = jnp.asarray(0.7 * rng.normal(size=(V, D)), jnp.float32)
  bias = jnp.asarray(0.2 * rng.normal(size=V), jnp.float32)
  targets = rng.integers(-1, V, size=(B, N, L)).astype(np.int32)
  targets[:, :, 1] = targets[:, :, 0]  # repeats count once
  exclude = rng.integers(-1, V, size=(B, N, E)).astype(np.int32)
  exclude[:, :, 0] = targets[:, :, 0]  # excluded targets stay targets
  weights = rng.uniform(size=(B, N)).astype(np.float32)
  weights[0] = 0.0
  return hidden, table, bias, jnp.asarray(targets), jnp.asarray(exclude), jnp.asarray(weights)


OPTIONS = dict(num_items=1000, label_smoothing=0.1, return_stats=True)


def _outputs(loss_fn, **options):
  hidden, table, bias, targets, exclude, weights = _inputs()

  def loss(hidden, table, bias):
    return loss_fn(hidden, table, targets, weights, bias=bias, exclude=exclude,
                   **{**OPTIONS, **options})

  return jax.jit(jax.value_and_grad(loss, (0, 1, 2), has_aux=True))(hidden, table, bias)


@functools.lru_cache(maxsize=None)
def _reference(target_reduction="sum"):
  return _outputs(functools.partial(cutbce.cut_softmax_ce, backend="xla"),
                  target_reduction=target_reduction)


def _assert_close(got, want):
  (value, stats), grads = got
  (want_value, want_stats), want_grads = want
  np.testing.assert_allclose(float(value), float(want_value), rtol=1e-6)
  np.testing.assert_allclose(np.array(stats), np.array(want_stats), rtol=1e-6)
  for name, a, b in zip(("dh", "dE", "db"), grads, want_grads):
    b = np.asarray(b)
    np.testing.assert_allclose(np.asarray(a), b, rtol=1e-5, atol=1e-5 * np.abs(b).max(),
                               err_msg=name)


@pytest.mark.parametrize("shape,token_axes,vocab_axis", LAYOUTS)
def test_equals_the_unsharded_op(shape, token_axes, vocab_axis):
  got = _outputs(functools.partial(sharded_cut_softmax_ce, mesh=_mesh(shape),
                                   token_axes=token_axes, vocab_axis=vocab_axis, backend="xla"))
  _assert_close(got, _reference())


def test_pallas_tpu_kernels_in_shard_map_equal_the_unsharded_op():
  got = _outputs(functools.partial(sharded_cut_softmax_ce, mesh=_mesh((2, 4)),
                                   token_axes=("data", "model"), vocab_axis="model",
                                   backend="pallas_tpu"))
  _assert_close(got, _reference())


@pytest.mark.parametrize("shape,token_axes", [((2, 4), ("data", "model")), ((1, 8), ())])
def test_pallas_triton_kernels_in_shard_map_equal_the_unsharded_op(shape, token_axes):
  """The last vocabulary shard holds padding rows (1003 rows over 4 or 8 shards):
  the GPU kernels mask them through their per-token row limit."""
  got = _outputs(functools.partial(sharded_cut_softmax_ce, mesh=_mesh(shape),
                                   token_axes=token_axes, vocab_axis="model",
                                   backend="pallas_triton"))
  _assert_close(got, _reference())


def test_averaging_over_targets_and_the_dense_backend_on_a_mesh():
  mesh = _mesh((2, 4))
  kw = dict(mesh=mesh, token_axes=("data", "model"), vocab_axis="model",
            target_reduction="mean")
  _assert_close(_outputs(functools.partial(sharded_cut_softmax_ce, backend="xla"), **kw),
                _reference("mean"))
  _assert_close(_outputs(functools.partial(sharded_cut_softmax_ce, backend="dense"), **kw),
                _reference("mean"))


def _report(vocab):
  hidden, _, _, targets, exclude, weights = _inputs()
  table = jnp.ones((vocab, D), jnp.float32)
  kw = dict(mesh=_mesh((2, 4)), token_axes=("data", "model"), vocab_axis="model",
            backend="xla", plan=cutbce.TilePlan(block_v=128), label_smoothing=0.1)

  def loss(hidden, table):
    return sharded_cut_softmax_ce(hidden, table, targets, weights, exclude=exclude, **kw)

  step = jax.jit(jax.value_and_grad(loss, (0, 1)))
  return collective_report(step.lower(hidden, table).compile().as_text())


def test_collectives_outside_the_tile_loop_and_constant_in_v():
  small, large = _report(V), _report(8 * V + 1)
  assert small.in_loop == () and large.in_loop == (), (small, large)
  assert 0 < small.count <= 14, small
  assert sorted(small.ops) == sorted(large.ops), (small, large)
