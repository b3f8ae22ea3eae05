"""`backend="pallas_tpu"` inside `jax.shard_map` on all 8 simulated CPU devices.

Issue 16: these calls used to hang forever. In TPU interpret mode every
kernel runs as host callbacks, and on the XLA CPU client the callbacks of 8
devices (blocked at the interpreter's per-call barrier, or waiting for an
argument copy of 100 KiB or more) hold every thread of the pool that would
run those copies. Off a TPU the kernels now run in Pallas' generic
interpreter (no host callbacks); see docs/kernels.md, "Pallas kernels
inside shard_map on simulated CPU devices".

Every mesh below uses all 8 devices (the case that hung), with V = 1003,
which no vocab axis size divides: each vocab-sharded case pads rows and
walks a ragged last tile. Compared, from one jitted value_and_grad:

  loss, stats, dh, dE, db   pallas_tpu == sharded xla == unsharded dense
                            to float32 rounding (`_assert_close`)
  ranks, top-k              exactly, on small-integer inputs (exact logits,
                            full of ties, so the tie rules are checked too)
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cutbce
from cutbce.kernels import tpu
from cutbce.sharding import sharded_cut_bce, sharded_target_ranks, sharded_top_k
from tests.cutbce import meshes

B, N, D, V, L, E = 8, 8, 32, 1003, 3, 4
MIB = 1024 * 1024
# Small tiles keep the interpreted grid short: 128-row vocab tiles (ragged
# last tile on every shard), 8-row token tiles in chunks of 16 tokens.
PLAN = cutbce.TilePlan(block_v=128, block_t=8, token_chunk=16, vmem_limit_bytes=64 * MIB)

# Float32 rounding (summation order differs per backend and per shard): loss
# to RTOL; dh, dE, db to RTOL plus RTOL times the largest reference entry
# (measured: at most 6e-7 of it); stats, weighted counts of logit > 0 up to
# ~3e4, to summation order (equal to XLA's to the bit, 1e-3 from dense).
RTOL = 1e-5
STATS_RTOL, STATS_ATOL = 1e-6, 1e-4

# (mesh shape, token_axes, vocab_axis) for mesh axes ("data", "model").
LAYOUTS = [
    ((8, 1), ("data", "model"), "model"),
    ((4, 2), ("data", "model"), "model"),
    ((2, 4), ("data", "model"), "model"),
    ((1, 8), ("data", "model"), "model"),
    ((4, 2), ("data",), None),  # table replicated, tokens repeated over "model"
]
LAYOUT_IDS = ["8x1", "4x2", "2x4", "1x8", "4x2-replicated-table"]
VARIANTS = (("label_smoothing", 0.1), ("logit_soft_cap", 4.0), ("focal_gamma", 2.0))


def _mesh(shape):
  return meshes.mesh(shape)


@functools.lru_cache(maxsize=None)
def _inputs():
  """Random float32 inputs with padding ids, repeats and zero weights."""
  keys = jax.random.split(jax.random.key(16), 6)
  hidden = 0.5 * jax.random.normal(keys[0], (B, N, D))
  table = 0.5 * jax.random.normal(keys[1], (V, D))
  bias = 0.1 * jax.random.normal(keys[2], (V,))
  targets = jax.random.randint(keys[3], (B, N, L), -1, V)
  targets = targets.at[:, :, 1].set(targets[:, :, 0])  # a repeat counts once
  exclude = jax.random.randint(keys[4], (B, N, E), -1, V)
  exclude = exclude.at[:, :, 0].set(targets[:, :, 0])  # an excluded target stays a target
  weights = jax.random.uniform(keys[5], (B, N)).at[0].set(0.0)
  return hidden, table, bias, targets, exclude, weights


@functools.lru_cache(maxsize=None)
def _integer_inputs():
  """Small-integer inputs: every logit is an exact small integer in float32."""
  rng = np.random.default_rng(16)
  hidden = rng.integers(-2, 3, (B, N, D)).astype(np.float32)
  table = rng.integers(-2, 3, (V, D)).astype(np.float32)
  bias = rng.integers(-2, 3, (V,)).astype(np.float32)
  targets = rng.integers(-1, V, (B, N, L)).astype(np.int32)
  exclude = rng.integers(-1, V, (B, N, E)).astype(np.int32)
  exclude[..., 0] = targets[..., 0]  # an excluded target stays a target
  return hidden, table, bias, targets, exclude


def _step(loss_fn, num_items=None, options=(), reduction="mean"):
  """jit(value_and_grad) of `loss_fn` in (hidden, table, bias): ((loss, stats), grads).

  reduction="none" (per-position w_t l_t) is reduced here to the weighted
  mean, so every reduction gives the same numbers.
  """
  _, _, _, targets, exclude, weights = _inputs()

  def loss(hidden, table, bias):
    value, stats = loss_fn(hidden, table, targets, weights, bias=bias, exclude=exclude,
                           return_stats=True, num_items=num_items, reduction=reduction,
                           **dict(options))
    if reduction == "none":
      value = jnp.sum(value) / jnp.sum(weights)
    return value, stats

  return jax.jit(jax.value_and_grad(loss, (0, 1, 2), has_aux=True))


def _loss_and_grads(loss_fn, num_items=None, options=(), reduction="mean"):
  """(loss, stats, (dh, dE, db)) of `loss_fn` from one jitted value_and_grad."""
  hidden, table, bias = _inputs()[:3]
  (value, stats), grads = _step(loss_fn, num_items, options, reduction)(hidden, table, bias)
  return value, stats, grads


@functools.lru_cache(maxsize=None)
def _dense(num_items=None, options=()):
  return _loss_and_grads(cutbce.dense_bce, num_items, options)


def _sharded(layout, backend, num_items=None, options=(), reduction="mean"):
  shape, token_axes, vocab_axis = layout
  fn = functools.partial(sharded_cut_bce, mesh=_mesh(shape), token_axes=token_axes,
                         vocab_axis=vocab_axis, backend=backend, plan=PLAN)
  return _loss_and_grads(fn, num_items, options, reduction)


def _assert_close(got, want, what):
  value, stats, grads = got
  value_ref, stats_ref, grads_ref = want
  np.testing.assert_allclose(value, value_ref, rtol=RTOL, err_msg=f"{what}: loss")
  for name, a, b in zip(stats._fields, stats, stats_ref):
    np.testing.assert_allclose(a, b, rtol=STATS_RTOL, atol=STATS_ATOL,
                               err_msg=f"{what}: stats.{name}")
  for name, a, b in zip(("dh", "dE", "db"), grads, grads_ref):
    assert a.dtype == b.dtype == jnp.float32, (what, name, a.dtype, b.dtype)
    a, b = np.asarray(a), np.asarray(b)
    assert np.all(np.isfinite(a)), (what, name)
    np.testing.assert_allclose(a, b, rtol=RTOL, atol=RTOL * np.abs(b).max(),
                               err_msg=f"{what}: {name}")


@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
def test_loss_stats_and_grads_match_xla_and_dense(layout):
  got = _sharded(layout, "pallas_tpu")
  _assert_close(got, _sharded(layout, "xla"), "pallas_tpu vs xla")
  _assert_close(got, _dense(), "pallas_tpu vs dense")


# reduction="none" leaves the cotangent of each position unknown until the
# backward, so forward and backward are separate sweeps (separate kernels)
# whatever the default for "mean" is.
@pytest.mark.parametrize("layout", [LAYOUTS[0], LAYOUTS[2]], ids=["8x1", "2x4"])
def test_per_position_losses_match_xla_and_dense(layout):
  got = _sharded(layout, "pallas_tpu", reduction="none")
  _assert_close(got, _sharded(layout, "xla", reduction="none"), "pallas_tpu vs xla")
  _assert_close(got, _dense(), "pallas_tpu vs dense")


@pytest.mark.parametrize("layout", [LAYOUTS[2], LAYOUTS[3]], ids=["2x4", "1x8"])
@pytest.mark.parametrize("num_items,options", [(900, ()), (None, VARIANTS), (900, VARIANTS)],
                         ids=["num_items", "variants", "num_items+variants"])
def test_num_items_and_variants_match_xla_and_dense(layout, num_items, options):
  got = _sharded(layout, "pallas_tpu", num_items, options)
  _assert_close(got, _sharded(layout, "xla", num_items, options), "pallas_tpu vs xla")
  _assert_close(got, _dense(num_items, options), "pallas_tpu vs dense")
  if num_items is not None:  # rows past num_items are padding: zero gradient
    _, table_grad, bias_grad = got[2]
    assert not np.any(np.asarray(table_grad)[num_items:])
    assert not np.any(np.asarray(bias_grad)[num_items:])


@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
@pytest.mark.parametrize("num_items", [None, 900])
def test_target_ranks_exact(layout, num_items):
  shape, token_axes, vocab_axis = layout
  hidden, table, bias, targets, exclude = _integer_inputs()
  kw = dict(bias=bias, exclude=exclude, num_items=num_items)

  def ranks(backend):
    fn = lambda h, t: sharded_target_ranks(  # noqa: E731
        h, t, targets, mesh=_mesh(shape), token_axes=token_axes, vocab_axis=vocab_axis,
        backend=backend, plan=PLAN, **kw)
    return np.asarray(jax.jit(fn)(hidden, table))

  got = ranks("pallas_tpu")
  np.testing.assert_array_equal(got, ranks("xla"))
  dense = cutbce.target_ranks(hidden, table, targets, backend="dense", **kw)
  np.testing.assert_array_equal(got, dense)
  assert got.shape == (B, N, L) and got.max() > 1 and np.all((got > 0) == (
      (targets >= 0) & (targets < (num_items or V))))


@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
def test_top_k_matches_xla(layout):
  shape, token_axes, vocab_axis = layout
  hidden, table, bias, _, exclude = _integer_inputs()

  def top_k(backend):
    fn = lambda h, t: sharded_top_k(  # noqa: E731
        h, t, 10, mesh=_mesh(shape), token_axes=token_axes, vocab_axis=vocab_axis,
        bias=bias, exclude=exclude, num_items=950, backend=backend, plan=PLAN)
    return jax.jit(fn)(hidden, table)

  scores, ids = top_k("pallas_tpu")
  want_scores, want_ids = top_k("xla")
  np.testing.assert_array_equal(scores, want_scores)
  np.testing.assert_array_equal(ids, want_ids)
  dense_scores, dense_ids = cutbce.top_k(hidden, table, 10, bias=bias, exclude=exclude,
                                         num_items=950, backend="dense")
  np.testing.assert_array_equal(scores, dense_scores)
  np.testing.assert_array_equal(ids, dense_ids)


def _interpret_params(fn, *args):
  """How the `pallas_call`s of `fn`'s jaxpr interpret: {"tpu", "generic", "compiled"}."""
  text = str(jax.make_jaxpr(fn)(*args))
  assert "pallas_call" in text
  found = set()
  if "interpret=InterpretParams" in text:
    found.add("tpu")
  if "interpret=True" in text:
    found.add("generic")
  if "interpret=False" in text:
    found.add("compiled")
  return found


def test_tpu_interpret_mode_is_single_device_only():
  """Inside `tpu_interpret_mode()`: a multi-device shard_map falls back to the
  generic interpreter (TPU interpret mode would deadlock there) and still
  matches; a single-device call, and a shard_map over one device, use TPU
  interpret mode. The jaxprs are checked before anything runs, so a
  regression fails here instead of hanging."""
  args = _inputs()[:3]
  kw = dict(mesh=_mesh((2, 4)), token_axes=("data", "model"), vocab_axis="model",
            backend="pallas_tpu", plan=PLAN)
  on_8 = _step(functools.partial(sharded_cut_bce, **kw))
  on_1 = _step(functools.partial(sharded_cut_bce, **dict(kw, mesh=_mesh((1, 1)))))
  single = _step(functools.partial(cutbce.cut_bce, backend="pallas_tpu", plan=PLAN))
  with tpu.tpu_interpret_mode():
    # Off a TPU: a platform_dependent of Mosaic (lowered only for TPU) and
    # the generic interpreter.
    assert _interpret_params(on_8, *args) == {"generic", "compiled"}
    assert _interpret_params(on_1, *args) == {"tpu"}
    assert _interpret_params(single, *args) == {"tpu"}
    results = {name: fn(*args) for name, fn in
               (("8 devices", on_8), ("1 device", on_1), ("unsharded", single))}
  for name, ((value, stats), grads) in results.items():
    _assert_close((value, stats, grads), _dense(), f"{name} in tpu_interpret_mode vs dense")
  # Outside the context the default, the generic interpreter, is back.
  fresh = _step(functools.partial(cutbce.cut_bce, backend="pallas_tpu", plan=PLAN))
  assert _interpret_params(fresh, *args) == {"generic", "compiled"}
