"""One pass (gradients made in the forward sweep) against two passes and the float64 oracle.

Tolerances as in test_api.py: loss rtol 1e-5, gradients atol 1e-4 x max
|reference| against the oracle; the two modes against each other to float32
rounding (rtol 1e-5, atol 1e-6 x max).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cutbce
from cutbce.sharding import sharded_cut_bce
from tests.cutbce import meshes, np_reference
from tests.cutbce.cases import CASES, make_case

ALL_VARIANTS = dict(pos_weight=2.0, label_smoothing=0.1, logit_soft_cap=4.0, focal_gamma=2.0,
                    focal_alpha=0.3)
PALLAS_PLAN = cutbce.TilePlan(block_v=128, block_t=8, token_chunk=16,
                              vmem_limit_bytes=64 * 1024 * 1024)


def _data(case_name="ragged_v1003", seed=0):
  data = make_case(CASES[case_name], seed)
  f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
  return data, (f32(data["hidden"]), f32(data["table"]), f32(data["bias"]))


def _loss(data, backend, one_pass, reduction, options, num_items=None):
  plan = PALLAS_PLAN if backend == "pallas_tpu" else cutbce.TilePlan(block_v=128)

  def fn(hidden, table, bias):
    return cutbce.cut_bce(
        hidden, table, data["targets"], jnp.asarray(data["weights"], jnp.float32), bias=bias,
        exclude=data["exclude"], reduction=reduction, backend=backend, plan=plan,
        one_pass=one_pass, num_items=num_items, **options)

  return fn


def _assert_grads_close(got, want, rtol=1e-5):
  for a, b, name in zip(got, want, ("dh", "dE", "db")):
    a, b = np.asarray(a), np.asarray(b)
    np.testing.assert_allclose(a, b, rtol=rtol, atol=1e-6 * np.abs(b).max(), err_msg=name)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("options", [{}, ALL_VARIANTS, dict(label_smoothing=0.2)],
                         ids=["plain", "all_variants", "smoothing"])
def test_one_pass_equals_two_passes_and_the_oracle(reduction, options):
  data, args = _data()
  results = {}
  for one_pass in (True, False):
    fn = _loss(data, "xla", one_pass, reduction, options, num_items=950)
    results[one_pass] = jax.jit(jax.value_and_grad(fn, argnums=(0, 1, 2)))(*args)
  (value, grads), (value2, grads2) = results[True], results[False]
  assert float(value) == float(value2)  # the forward value is computed the same way
  _assert_grads_close(grads, grads2)
  ref_loss, ref_grads, _ = np_reference.bce(
      *(np.asarray(a, np.float64) for a in args[:2]), data["targets"], data["weights"],
      bias=np.asarray(args[2], np.float64), exclude=data["exclude"], reduction=reduction,
      num_items=950, **options)
  np.testing.assert_allclose(float(value), ref_loss, rtol=1e-5)
  for got, name in zip(grads, ("hidden", "table", "bias")):
    want = ref_grads[name]
    assert np.max(np.abs(np.asarray(got) - want)) < 1e-4 * np.abs(want).max(), name


@pytest.mark.parametrize("outer", ["scaled", "used_twice", "function_of_it"])
def test_callers_that_transform_the_loss(outer):
  data, args = _data("flat_tokens", seed=3)
  wrap = {
      "scaled": lambda loss: -3.5 * loss,
      "used_twice": lambda loss: loss * loss + loss,
      "function_of_it": lambda loss: jnp.sin(loss) * jnp.exp(-loss),
  }[outer]
  grads = {}
  for one_pass in (True, False):
    fn = _loss(data, "xla", one_pass, "mean", ALL_VARIANTS)
    grads[one_pass] = jax.grad(lambda *a: wrap(fn(*a)), argnums=(0, 1, 2))(*args)
  _assert_grads_close(grads[True], grads[False])
  assert np.abs(np.asarray(grads[True][1])).max() > 0


def test_one_pass_on_pallas_tpu():
  data, args = _data("one_tile", seed=1)
  results = {}
  for backend, one_pass in (("pallas_tpu", True), ("xla", False)):
    fn = _loss(data, backend, one_pass, "mean", ALL_VARIANTS)
    results[backend] = jax.value_and_grad(fn, argnums=(0, 1, 2))(*args)
  np.testing.assert_allclose(float(results["pallas_tpu"][0]), float(results["xla"][0]), rtol=1e-6)
  _assert_grads_close(results["pallas_tpu"][1], results["xla"][1])


def _count(jaxpr, primitive):
  total = 0
  for eqn in jaxpr.eqns:
    total += eqn.primitive.name == primitive
    for param in eqn.params.values():
      for sub in (param if isinstance(param, (list, tuple)) else [param]):
        inner = getattr(sub, "jaxpr", None)
        if inner is not None:
          total += _count(getattr(inner, "jaxpr", inner), primitive)
  return total


def test_one_pass_sweeps_the_vocabulary_once():
  data, args = _data()
  counts = {}
  for one_pass in (True, False):
    fn = _loss(data, "xla", one_pass, "mean", {})
    counts[one_pass] = _count(jax.make_jaxpr(jax.value_and_grad(fn, argnums=(0, 1)))(
        *args).jaxpr, "scan")
  assert counts == {True: 1, False: 2}, counts
  # The primal alone (no gradient) is one forward sweep in either mode.
  primal = _count(jax.make_jaxpr(_loss(data, "xla", True, "mean", {}))(*args).jaxpr, "scan")
  assert primal == 1


def test_one_pass_arguments():
  data, args = _data("one_tile")
  with pytest.raises(ValueError, match="one_pass=True needs reduction 'mean' or 'sum'"):
    _loss(data, "xla", True, "none", {})(*args)
  with pytest.raises(TypeError, match="one_pass must be None, True or False"):
    _loss(data, "xla", "yes", "mean", {})(*args)
  # Default: one pass for mean/sum, two for none (and none still differentiates).
  grad = jax.grad(lambda h: jnp.sum(_loss(data, "xla", None, "none", {})(h, *args[1:])))(args[0])
  assert np.all(np.isfinite(np.asarray(grad)))


@pytest.mark.parametrize("shape,token_axes,vocab_axis", [
    ((2, 4), ("data", "model"), "model"), ((8, 1), ("data",), None), ((1, 8), (), "model")])
def test_sharded_one_pass_equals_two_passes(shape, token_axes, vocab_axis):
  data, args = _data("one_tile", seed=2)
  mesh = meshes.mesh(shape)
  hidden = jnp.tile(args[0], (4, 1, 1))  # B = 8 for the token axes
  targets, exclude = (jnp.tile(jnp.asarray(data[k]), (4, 1, 1)) for k in ("targets", "exclude"))
  weights = jnp.tile(jnp.asarray(data["weights"], jnp.float32), (4, 1))

  def run(one_pass):
    fn = functools.partial(
        sharded_cut_bce, mesh=mesh, token_axes=token_axes, vocab_axis=vocab_axis, backend="xla",
        one_pass=one_pass, return_stats=True, num_items=90, **ALL_VARIANTS)
    loss = lambda h, e, b: fn(h, e, targets, weights, bias=b, exclude=exclude)  # noqa: E731
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(
        hidden, args[1], args[2])

  ((value, stats), grads), ((value2, stats2), grads2) = run(True), run(False)
  np.testing.assert_allclose(float(value), float(value2), rtol=1e-6)
  np.testing.assert_allclose([float(s) for s in stats], [float(s) for s in stats2])
  _assert_grads_close(grads, grads2)
  assert not np.any(np.asarray(grads[1])[90:])
