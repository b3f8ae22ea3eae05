"""Every matrix product the op traces asks for float32 precision where an operand is float32.

A TPU multiplies float32 matrices in one bfloat16 pass at jax's default
precision; on a v5e chip that made every float32 comparison with the float64
oracle fail, on every backend (docs/results.md, "TPU"). A CPU computes float32
products in full whatever they ask, so the numerics tests here cannot see it:
these tests read the products out of the traced programs instead (the Pallas
kernels' bodies included) and check what each one asks of the compiler.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.extend import core as jex_core

import cutbce
from cutbce.kernels import matmul
from cutbce.kernels import tpu

BACKENDS = ["dense", "xla", "pallas_tpu"]
HIGHEST = lax.Precision.HIGHEST


def dot_products(jaxpr):
  """(operand dtypes, precision) of every dot_general in `jaxpr` and the jaxprs inside it."""
  found = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "dot_general":
      precision = eqn.params["precision"]
      if isinstance(precision, tuple):
        assert precision[0] == precision[1], precision
        precision = precision[0]
      found.append((tuple(jnp.dtype(v.aval.dtype) for v in eqn.invars), precision))
    for sub in jex_core.jaxprs_in_params(eqn.params):
      found += dot_products(sub)
  return found


def _inputs(dtype):
  rng = np.random.default_rng(0)
  hidden = jnp.asarray(rng.normal(size=(2, 5, 16)), dtype)
  table = jnp.asarray(rng.normal(size=(301, 16)), dtype)
  bias = jnp.asarray(rng.normal(size=(301,)), dtype)
  targets = jnp.asarray(rng.integers(-1, 301, size=(2, 5, 3)), jnp.int32)
  exclude = jnp.asarray(rng.integers(-1, 301, size=(2, 5, 2)), jnp.int32)
  return hidden, table, bias, targets, exclude


def _programs(backend, dtype):
  """The jaxprs of the op's entry points: both losses' value and gradients, ranks, top-k."""
  hidden, table, bias, targets, exclude = _inputs(dtype)

  def bce(h, e, b):
    return cutbce.cut_bce(h, e, targets, bias=b, exclude=exclude, label_smoothing=0.1,
                          backend=backend)

  def softmax_ce(h, e, b):
    return cutbce.cut_softmax_ce(h, e, targets, bias=b, exclude=exclude, label_smoothing=0.1,
                                 backend=backend)

  grad = lambda f: jax.value_and_grad(f, argnums=(0, 1, 2))  # noqa: E731
  programs = {
      "cut_bce": jax.make_jaxpr(grad(bce))(hidden, table, bias),
      "cut_softmax_ce": jax.make_jaxpr(grad(softmax_ce))(hidden, table, bias),
  }
  if backend != "dense":
    programs["target_ranks"] = jax.make_jaxpr(
        lambda h, e: cutbce.target_ranks(h, e, targets, bias=bias, exclude=exclude,
                                         backend=backend))(hidden, table)
    programs["top_k"] = jax.make_jaxpr(
        lambda h, e: cutbce.top_k(h, e, 5, bias=bias, exclude=exclude, backend=backend))(
            hidden, table)
  return {name: dot_products(program.jaxpr) for name, program in programs.items()}


@pytest.mark.parametrize("backend", BACKENDS)
def test_float32_products_ask_for_float32_precision(backend):
  with tpu.tpu_interpret_mode():
    programs = _programs(backend, jnp.float32)
  for name, dots in programs.items():
    assert dots, f"{name}: no matrix product traced"
    for dtypes, precision in dots:
      if jnp.dtype(jnp.float32) in dtypes:
        assert precision == HIGHEST, (name, dtypes, precision)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bfloat16_tiles_keep_one_pass_and_float32_parts_ask_for_float32(backend):
  with tpu.tpu_interpret_mode():
    programs = _programs(backend, jnp.bfloat16)
  for name, dots in programs.items():
    narrow = [p for dtypes, p in dots if set(dtypes) == {jnp.dtype(jnp.bfloat16)}]
    assert narrow and all(p is None for p in narrow), (name, dots)
    if backend == "dense":
      # Its backward products are autodiff's transposes of its one forward
      # product, at that product's precision: jax's own dense loss.
      continue
    for dtypes, precision in dots:
      if jnp.dtype(jnp.float32) in dtypes:
        assert precision == HIGHEST, (name, dtypes, precision)


@pytest.mark.parametrize("backend", ["xla", "pallas_tpu"])
def test_a_precision_the_caller_chose_is_honoured(backend):
  with tpu.tpu_interpret_mode(), jax.default_matmul_precision("bfloat16"):
    programs = _programs(backend, jnp.float32)
  for name, dots in programs.items():
    assert dots and all(p != HIGHEST for _, p in dots), (name, dots)


def test_precision_rule():
  assert matmul.precision(jnp.float32) == HIGHEST
  assert matmul.precision(jnp.bfloat16, jnp.float32) == HIGHEST
  assert matmul.precision(jnp.zeros(2, jnp.bfloat16), jnp.zeros(2, jnp.bfloat16)) is None
  with jax.default_matmul_precision("float32"):
    assert matmul.precision(jnp.float32) is None
