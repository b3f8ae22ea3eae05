"""An `exclude` row shared by a window's positions (`[B, 1, E]`) is the per-position one.

The shared form takes the excluded logits per row (`sparse.shared_row_logits`)
and, on the softmax's XLA path, masks each tile per row (`xla.SharedExclude`);
everything it returns must equal the op given the same ids repeated for every
position, `[B, N, E]`, which the other tests hold to the float64 oracle.
Rows here hold the window's targets (which stay targets), repeats, -1, ids
past V and past num_items.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cutbce
from cutbce.sharding import sharded_cut_bce, sharded_cut_softmax_ce

from tests.cutbce import meshes

B, N, D, V, L = 4, 6, 8, 103, 2


def _inputs(dtype, seed=0, num_exclude=9, batch=B):
  rng = np.random.default_rng(seed)
  items = rng.integers(0, V, size=(batch, N + L))
  targets = np.stack([items[:, i + 1:i + 1 + L] for i in range(N)], axis=1)  # [B, N, L]
  targets[0, 0] = -1  # a position without a target
  targets[1, 2, 1] = targets[1, 2, 0]  # a repeated target
  rows = rng.integers(-1, V + 3, size=(batch, 1, num_exclude))
  rows[:, 0, :3] = items[:, 1:4]  # the window's own items: targets of some positions
  rows[2, 0, 4] = rows[2, 0, 5]  # a repeat
  weights = rng.random((batch, N)) + 0.5
  weights[3, 1] = 0.0
  as_dtype = lambda a: jnp.asarray(a, dtype)  # noqa: E731
  return dict(hidden=as_dtype(rng.normal(size=(batch, N, D)) * 0.5),
              table=as_dtype(rng.normal(size=(V, D))),
              bias=jnp.asarray(rng.normal(size=V) * 0.5, jnp.float32),
              targets=jnp.asarray(targets, jnp.int32), weights=jnp.asarray(weights, jnp.float32),
              rows=jnp.asarray(rows, jnp.int32))


def _value_and_grads(loss, x, exclude, **kwargs):
  def f(hidden, table, bias):
    value, stats = loss(hidden, table, x["targets"], x["weights"], bias=bias, exclude=exclude,
                        return_stats=True, **kwargs)
    return value, stats
  (value, stats), grads = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))(
      x["hidden"], x["table"], x["bias"])
  return value, stats, grads


def _assert_same(shared, per_position, dtype):
  (value_a, stats_a, grads_a), (value_b, stats_b, grads_b) = shared, per_position
  tight = dict(rtol=2e-6, atol=2e-6) if dtype == jnp.float32 else dict(rtol=1e-2, atol=1e-2)
  np.testing.assert_allclose(value_a, value_b, **tight)
  for name in ("tp", "fp", "fn", "tn"):  # weighted counts: float32 sums in either order
    np.testing.assert_allclose(getattr(stats_a, name), getattr(stats_b, name), rtol=1e-6,
                               err_msg=name)
  for name, a, b in zip(("dh", "dE", "db"), grads_a, grads_b):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                               err_msg=name, **tight)


def _expanded(rows):
  return jnp.broadcast_to(rows, (rows.shape[0], N, rows.shape[-1]))


SMOOTHED = {"label_smoothing": 0.1, "num_items": 97}
VARIANT = {"num_items": 97, "pos_weight": 2.0}
SHARED_CASES = [  # (backend, dtype, kind, options): every backend, both dtypes, both losses
    ("xla", jnp.float32, "softmax", {}), ("xla", jnp.float32, "softmax", SMOOTHED),
    ("xla", jnp.bfloat16, "softmax", SMOOTHED), ("xla", jnp.float32, "bce", VARIANT),
    ("xla", jnp.bfloat16, "bce", {}),
    ("xla", jnp.float32, "bce", SMOOTHED),  # affine: excluded columns hold g_t B, not 0
    ("dense", jnp.float32, "softmax", SMOOTHED),
    ("dense", jnp.float32, "bce", VARIANT), ("pallas_tpu", jnp.float32, "softmax", SMOOTHED),
    ("pallas_tpu", jnp.bfloat16, "softmax", {}), ("pallas_tpu", jnp.float32, "bce", VARIANT),
]


@pytest.mark.parametrize("backend,dtype,kind,options", SHARED_CASES)
def test_a_shared_row_equals_the_row_repeated_for_every_position(backend, dtype, kind, options):
  x = _inputs(dtype)
  loss = cutbce.cut_softmax_ce if kind == "softmax" else cutbce.cut_bce
  kwargs = dict(backend=backend, **options)
  shared = _value_and_grads(loss, x, x["rows"], **kwargs)
  per_position = _value_and_grads(loss, x, _expanded(x["rows"]), **kwargs)
  _assert_same(shared, per_position, dtype)
  # The exclusion reaches the loss: without it the value moves.
  without = _value_and_grads(loss, x, None, **kwargs)
  assert abs(float(without[0]) - float(shared[0])) > 1e-3


def test_wide_rows_take_the_xla_path_with_shared_masks():
  # E past the Pallas kernels' limit (128): "auto" runs the XLA kernels,
  # which mask per row; rows are sorted and deduplicated once per row.
  x = _inputs(jnp.float32, seed=3, num_exclude=150)
  shared = _value_and_grads(cutbce.cut_softmax_ce, x, x["rows"], backend="auto")
  per_position = _value_and_grads(cutbce.cut_softmax_ce, x, _expanded(x["rows"]),
                                  backend="auto")
  _assert_same(shared, per_position, jnp.float32)


@pytest.mark.parametrize("kind", ["softmax", "bce"])
def test_sharded_shared_rows_equal_the_single_device_op(kind):
  # Tokens split over data x model, the table over model: rows travel with
  # their tokens (placed, gathered over the vocab axis, rebased per shard).
  mesh = meshes.mesh((2, 4))
  x = _inputs(jnp.float32, seed=5, num_exclude=12, batch=8)
  loss, sharded = ((cutbce.cut_softmax_ce, sharded_cut_softmax_ce) if kind == "softmax"
                   else (cutbce.cut_bce, sharded_cut_bce))
  want = _value_and_grads(loss, x, _expanded(x["rows"]), backend="xla")
  got = _value_and_grads(
      lambda *a, **k: sharded(*a, mesh=mesh, token_axes=("data", "model"), vocab_axis="model",
                              **k), x, x["rows"], backend="xla")
  _assert_same(got, want, jnp.float32)


def test_other_broadcasts_and_bad_shapes():
  x = _inputs(jnp.float32)
  every = x["rows"][:1]  # [1, 1, E]: one row for all B x N positions
  by_position = jnp.broadcast_to(x["rows"][:1, :, :], (1, N, 9)) % 50  # [1, N, E]: expanded
  for exclude in (every, by_position):
    got = _value_and_grads(cutbce.cut_softmax_ce, x, exclude, backend="xla")
    want = _value_and_grads(cutbce.cut_softmax_ce, x, jnp.broadcast_to(exclude, (B, N, 9)),
                            backend="xla")
    _assert_same(got, want, jnp.float32)
  # Ranks and top-k take the same broadcast (expanded per position).
  shared, expanded = x["rows"], _expanded(x["rows"])
  np.testing.assert_array_equal(
      cutbce.target_ranks(x["hidden"], x["table"], x["targets"], exclude=shared),
      cutbce.target_ranks(x["hidden"], x["table"], x["targets"], exclude=expanded))
  np.testing.assert_array_equal(cutbce.top_k(x["hidden"], x["table"], 5, exclude=shared)[1],
                                cutbce.top_k(x["hidden"], x["table"], 5, exclude=expanded)[1])
  with pytest.raises(ValueError, match="does not broadcast"):
    cutbce.top_k(x["hidden"], x["table"], 5, exclude=x["rows"][:2])
  with pytest.raises(ValueError, match="does not broadcast"):
    cutbce.cut_softmax_ce(x["hidden"], x["table"], x["targets"], exclude=x["rows"][:, :, None])
  with pytest.raises(ValueError, match="does not broadcast"):
    cutbce.cut_bce(x["hidden"], x["table"], x["targets"], exclude=x["rows"][:2])
