"""Precision against float64 at every confidence: no backend is less accurate than dense.

The rule (DESIGN.md section 2; Apple CCE's test rule): on the same input
values (rounded to the input dtype first), each cut op's gradient error
against a float64 oracle is at most the dense reference's error in the same
dtype, times 1 + `RTOL`, plus one unit of the dtype's rounding (`ATOL`).

The inputs put one target per position at a chosen logit (from -30 to +30,
several at +7: sigmoid 0.9991, softmax probability ~1 - 1e-5) and every other
item far below (~-10), the regime of a trained model where `sigmoid(x) - 1`
and `p - 1` are tiny differences of numbers near 1. Shapes divide no tile;
targets include padding, out-of-range ids, repeats, a second target and an
excluded target; some weights are 0.

Errors are per row (a position's dh row, an item's dE row), relative to the
largest entry of that row in the oracle: a confident position's small
gradient is not hidden behind a larger one elsewhere. A row that is 0 in the
oracle (weight 0, padding items) must be 0.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cutbce
from cutbce.kernels.tiling import TilePlan
from cutbce.sharding import sharded_cut_bce, sharded_cut_softmax_ce
from tests.cutbce import meshes, np_reference

B, N, D, L, E = 2, 9, 24, 3, 2
V, NUM_ITEMS = 261, 258  # 3 padding rows; no tile below divides either
# One target logit per position: the sweep, with several confident ones.
TARGET_LOGITS = (-30.0, -12.0, -4.0, 0.0, 2.0, 4.0, 7.0, 7.0, 7.0,
                 7.0, 7.0, 9.0, 12.0, 16.0, 20.0, 30.0, 7.0, 5.0)
BACKGROUND = -10.0

PLANS = {
    "xla": TilePlan(block_v=64),
    "pallas_tpu": TilePlan(block_v=128, block_t=16, token_chunk=16,
                           vmem_limit_bytes=64 * 1024 * 1024),
    "pallas_triton": TilePlan(block_v=64, block_t=16),
    "pallas_gpu": TilePlan(block_v=64, block_t=64),
}
# The cut ops round each logit-gradient tile to the input dtype for its two
# GEMMs (as an MXU takes it), a rounding the dense reference (float32
# cotangents) does not make: in bfloat16 up to 2^-9 relative per entry, so
# ATOL allows two units of 2^-8 beyond the dense reference's own error.
RTOL = 0.25
ATOL = {jnp.float32: 2e-6, jnp.bfloat16: 2.0 ** -7}
# Softmax targets over the same sweep: p up to 1 - 1e-15 (x = 30 over ~258
# items at -10), 1 - 1.1e-5 at x = 7, 1 - 1e-6 near x = 9.4. The targets'
# 1 - p is computed from their own logits against the rest's log-sum-exp
# (`cutbce.softmax.partition`), never read off lse_t - x_tp.

@functools.lru_cache(maxsize=None)
def _raw_inputs():
  """float64 NumPy inputs: hidden, table, bias, targets, exclude, weights."""
  rng = np.random.default_rng(30)
  tokens = B * N
  # Dimension 0: a constant feature, so table[:, 0] is each item's offset;
  # 1..T: one private dimension per position, on which only its own target
  # item stands out (every other position sees that item at the background);
  # the rest: noise.
  hidden = np.zeros((tokens, D))
  hidden[:, 0] = 1.0
  hidden[:, 1:1 + tokens] = np.eye(tokens)
  hidden[:, 1 + tokens:] = rng.normal(size=(tokens, D - 1 - tokens))
  table = rng.normal(size=(V, D)) * 0.5
  table[:, 0] = BACKGROUND
  table[:, 1:1 + tokens] = rng.normal(size=(V, tokens)) * 0.5
  bias = rng.normal(size=(V,)) * 0.1
  targets = np.full((tokens, L), -1, np.int64)
  targets[:, 0] = np.arange(tokens) * 7 % NUM_ITEMS  # one target item per position
  for t, item in enumerate(targets[:, 0]):
    # x_tp = TARGET_LOGITS[t] in float64 (before rounding to the dtype).
    rest = hidden[t] @ table[item] - table[item, 1 + t] + bias[item]
    table[item, 1 + t] = TARGET_LOGITS[t] - rest
  targets[1, 1] = targets[1, 0]  # a repeat counts once
  targets[2, 2] = NUM_ITEMS + 1  # a padding row's id: not a target
  targets[3, 1] = 200  # a second (background-level) target
  targets[4, 1] = -7
  exclude = rng.integers(tokens * 7, NUM_ITEMS, size=(tokens, E))
  exclude[5, 0] = targets[5, 0]  # an excluded target stays a target
  exclude[6, 1] = -1
  weights = rng.random(tokens) + 0.5
  weights[[0, 9]] = 0.0
  shape = lambda a: a.reshape((B, N) + a.shape[1:])  # noqa: E731
  return (shape(hidden), table, bias, shape(targets).astype(np.int32),
          shape(exclude).astype(np.int32), shape(weights))


def _inputs(dtype):
  hidden, table, bias, targets, exclude, weights = _raw_inputs()
  return (jnp.asarray(hidden, dtype), jnp.asarray(table, dtype), jnp.asarray(bias, dtype),
          jnp.asarray(targets), jnp.asarray(exclude), jnp.asarray(weights, jnp.float32))


def _grads(loss_fn, dtype, reduction="mean", **kwargs):
  """float32 NumPy (dh, dE, db) of the weighted-mean loss of `loss_fn`."""
  hidden, table, bias, targets, exclude, weights = _inputs(dtype)

  def loss(h, t, b):
    value = loss_fn(h, t, targets, weights, bias=b, exclude=exclude, num_items=NUM_ITEMS,
                    reduction=reduction, **kwargs)
    if reduction == "none":
      value = jnp.sum(value) / jnp.sum(weights)
    return value

  grads = jax.jit(jax.grad(loss, (0, 1, 2)))(hidden, table, bias)
  for g, x in zip(grads, (hidden, table, bias)):
    assert g.dtype == x.dtype, (g.dtype, x.dtype)
  return tuple(np.asarray(g.astype(jnp.float32)) for g in grads)


@functools.lru_cache(maxsize=None)
def _dense_grads(kind, dtype, options=()):
  """`_grads` of the dense reference (computed once per kind, dtype and options)."""
  if kind == "bce":
    return _grads(cutbce.dense_bce, dtype, vocab_reduction="sum", **dict(options))
  return _grads(cutbce.dense_softmax_ce, dtype)


@functools.lru_cache(maxsize=None)
def _oracle(kind, dtype, options=()):
  """float64 (dh, dE, db) on the inputs rounded to `dtype`."""
  hidden, table, bias, targets, exclude, weights = (
      np.asarray(x.astype(jnp.float32) if x.dtype == jnp.bfloat16 else x)
      for x in _inputs(dtype))
  if kind == "bce":
    _, grads, _ = np_reference.bce(hidden, table, targets, weights, bias=bias, exclude=exclude,
                                   num_items=NUM_ITEMS, vocab_reduction="sum",
                                   **dict(options))
    return grads["hidden"], grads["table"], grads["bias"]
  _, grads, _ = np_reference.softmax_ce(hidden, table, targets, weights, bias=bias,
                                        exclude=exclude, num_items=NUM_ITEMS)
  return grads


def softmax_db_scale(inputs, **options):
  """`[V]` float64 sum_t |G_tv|: the size of the terms whose sum is db_v.

  db_v = sum_t G_tv adds terms of both signs (k p_tv - q_tv: with label
  smoothing, p_tv against its uniform share); where they cancel, |db_v| is
  far below them and its relative error is float32's rounding of the terms,
  whatever the order of the sum (dense's too: up to 1e-4 of |db_v| on items
  where the cut's is 1e-6, and the reverse on others). The rule measures db
  against this scale instead, as a sum's accuracy is measured.
  """
  hidden, table, bias, targets, exclude, weights = (np.asarray(x) for x in inputs)
  _, d_logits, _ = np_reference.softmax_logit_grads(
      hidden, table, targets, weights, bias=bias, exclude=exclude, num_items=NUM_ITEMS,
      **options)
  return np.sum(np.abs(d_logits), axis=0)


@functools.lru_cache(maxsize=None)
def _softmax_db_scale(dtype):
  return softmax_db_scale(
      np.asarray(x.astype(jnp.float32) if x.dtype == jnp.bfloat16 else x) for x in _inputs(dtype))


def _row_errors(got, want, scale=None):
  """Per-row max |got - want| / max |want| (or / `scale`, one per row); a row
  whose scale is 0 must be exact."""
  got = np.asarray(got, np.float64).reshape(want.shape[0], -1)
  want = np.asarray(want, np.float64).reshape(want.shape[0], -1)
  if scale is None:
    scale = np.max(np.abs(want), axis=1)
  error = np.max(np.abs(got - want), axis=1)
  return np.where(scale > 0, error / np.where(scale > 0, scale, 1.0), np.where(error > 0, np.inf, 0.0))


def _check_no_worse_than_dense(got, dense, oracle, dtype, what, db_scale=None):
  """Per row, the cut's error at most 1 + RTOL times dense's plus ATOL[dtype].

  Rows: dh per token, dE per item, db per item, each against its largest
  entry, or db against `db_scale` (`softmax_db_scale`) when given.
  """
  for name, g, d, o in zip(("dh", "dE", "db"), got, dense, oracle):
    o = np.asarray(o, np.float64)
    scale = None
    if name == "db":
      g, d, o = g[:, None], d[:, None], o[:, None]
      scale = db_scale
    if name == "dh":
      g, d, o = (x.reshape(B * N, D) for x in (g, d, o))
    assert np.all(np.isfinite(g)), (what, name)
    cut_error, dense_error = _row_errors(g, o, scale), _row_errors(d, o, scale)
    bound = dense_error * (1 + RTOL) + ATOL[dtype]
    worst = int(np.argmax(cut_error - bound))
    assert np.all(cut_error <= bound), (
        f"{what} {name}: row {worst} error {cut_error[worst]:.3g} vs dense "
        f"{dense_error[worst]:.3g} (max over rows: cut {cut_error.max():.3g}, "
        f"dense {dense_error.max():.3g})")


def _mesh():
  return meshes.mesh((2, 2))


DTYPES = [jnp.float32, jnp.bfloat16]
DTYPE_IDS = ["f32", "bf16"]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("route", ["xla", "xla-two-pass", "pallas_tpu", "pallas_triton",
                                   "pallas_gpu", "pallas_gpu-two-pass", "sharded"])
def test_bce_confident_targets_as_accurate_as_dense(route, dtype):
  if route == "sharded":
    fn = functools.partial(sharded_cut_bce, mesh=_mesh(), token_axes=("data",),
                           vocab_axis="model", backend="xla", plan=PLANS["xla"])
  else:
    backend = route.split("-")[0]
    fn = functools.partial(cutbce.cut_bce, backend=backend, plan=PLANS[backend],
                           one_pass=not route.endswith("two-pass"))
  got = _grads(fn, dtype, vocab_reduction="sum")
  _check_no_worse_than_dense(got, _dense_grads("bce", dtype), _oracle("bce", dtype), dtype,
                             f"cut_bce {route}")


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("route", ["xla", "xla-none", "pallas_tpu", "pallas_triton",
                                   "pallas_gpu", "pallas_gpu-none", "sharded"])
def test_softmax_confident_targets_as_accurate_as_dense(route, dtype):
  reduction = "mean"
  if route == "sharded":
    fn = functools.partial(sharded_cut_softmax_ce, mesh=_mesh(), token_axes=("data",),
                           vocab_axis="model", backend="xla", plan=PLANS["xla"])
  else:
    backend = route.split("-")[0]
    reduction = "none" if route.endswith("none") else "mean"
    fn = functools.partial(cutbce.cut_softmax_ce, backend=backend, plan=PLANS[backend])
  got = _grads(fn, dtype, reduction=reduction)
  _check_no_worse_than_dense(got, _dense_grads("softmax", dtype), _oracle("softmax", dtype),
                             dtype, f"cut_softmax_ce {route}", _softmax_db_scale(dtype))


VARIANTS = {
    "pos_weight": (("pos_weight", 3.0),),
    "label_smoothing": (("label_smoothing", 0.1),),
    "soft_cap": (("logit_soft_cap", 20.0),),
    "focal": (("focal_gamma", 2.0), ("focal_alpha", 0.25)),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_bce_variants_confident_targets_bf16(variant):
  options = VARIANTS[variant]
  fn = functools.partial(cutbce.cut_bce, backend="xla", plan=PLANS["xla"])
  got = _grads(fn, jnp.bfloat16, vocab_reduction="sum", **dict(options))
  dense = _dense_grads("bce", jnp.bfloat16, options)
  _check_no_worse_than_dense(got, dense, _oracle("bce", jnp.bfloat16, options), jnp.bfloat16,
                             f"cut_bce {variant}")
