"""Runs `test_precision`'s confident-target check with a TPU-like float32 exp on CPU.

    python -m tests.cutbce.emulated_exp ROUTE AMPLITUDE BIAS [GRADIENTS [SMOOTHING [OTHERS]]]

A TPU v5e's float32 exp is off by up to 68 ulp (8.1e-6 relative), with a mean
of -6.9 ulp (docs/results/tpu_v5e/float32_functions.log); this machine's is
within 1 ulp, so the softmax gradient's sensitivity to it cannot show here.
This script re-registers the CPU lowering of `exp` (in this process only:
jit caches would otherwise carry it into other tests) as an accurate exp
built from other primitives, times 1 + AMPLITUDE sin(12345.678 x) + BIAS, a
deterministic stand-in for the chip's error, then checks ROUTE's softmax
gradients ("xla", "pallas_tpu" or "sharded": XLA on a 2 x 2 mesh) against
the dense reference's under the same exp (ROUTE "bce/xla", "bce/xla-two-pass"
or "bce/pallas_tpu": `cut_bce`'s; the rule of
`tests/cutbce/test_precision.py`), all of them or those named in GRADIENTS
("dh,dE,db"), with label smoothing SMOOTHING (default 0); OTHERS > 0 makes
float32 sigmoid and expm1 err too, by 1 + OTHERS sin(7654.321 x), and
treats this CPU as a TPU (`variants.EXP_SIGMOID_PLATFORMS`). Exit status
0: the rule holds; 1: it fails (the message says where).
"""

from __future__ import annotations

import functools
import sys

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.interpreters import mlir

from tests.cutbce import np_reference

LN2_HIGH, LN2_LOW = np.float32(0.693145751953125), np.float32(1.4286068203094172e-06)


def accurate_exp(x):
  """float32 exp(x) without the exp primitive: 2^n e^r, |r| <= ln2 / 2, Taylor to r^9."""
  n = jnp.round(x * np.float32(1.4426950408889634))
  r = (x - n * LN2_HIGH) - n * LN2_LOW
  poly = jnp.ones_like(r)
  for k in range(9, 0, -1):
    poly = 1 + poly * r / np.float32(k)
  n = jnp.clip(n, -126, 127).astype(jnp.int32)
  scale = lax.bitcast_convert_type((n + 127) << 23, jnp.float32)
  y = poly * scale
  y = jnp.where(x < -87.3, 0.0, y)
  y = jnp.where(x > 88.7, jnp.inf, y)
  return jnp.where(jnp.isnan(x), x, y)


def emulate_exp(amplitude: float, bias: float) -> None:
  """Makes every float32 exp this process lowers for CPU TPU-like (others exact)."""

  def exp(x, **_):
    if x.dtype != jnp.float32:
      return accurate_exp(x.astype(jnp.float32)).astype(x.dtype)
    finite = jnp.clip(jnp.where(jnp.isfinite(x), x, 0.0), -1e3, 1e3)
    return accurate_exp(x) * (1 + amplitude * jnp.sin(finite * np.float32(12345.678)) + bias)

  mlir.register_lowering(lax.exp_p, mlir.lower_fun(exp, multiple_results=False), platform="cpu")


def emulate_sigmoid_and_expm1(amplitude: float) -> None:
  """Makes sigmoid (logistic) and expm1 err like `emulate_exp`'s sine.

  The chip's err by up to 48 ulp (sigmoid) and 990 ulp (expm1); relative to
  their results here, without a bias. (JAX lowers sigmoid as 1 / (1 +
  exp(-x)), so the chip's sigmoid errs through its exp, which this leaves
  exact unless `emulate_exp` says otherwise.)
  """

  def wobble(x, value):
    finite = jnp.clip(jnp.where(jnp.isfinite(x), x, 0.0), -1e3, 1e3)
    return value * (1 + amplitude * jnp.sin(finite * np.float32(7654.321)))

  def logistic(given, **_):
    z = given.astype(jnp.float32)
    e = accurate_exp(-jnp.abs(z))
    return wobble(z, jnp.where(z >= 0, 1.0, e) / (1.0 + e)).astype(given.dtype)

  def expm1(given, **_):
    x = given.astype(jnp.float32)
    near = jnp.abs(x) < 0.25
    small = jnp.where(near, x, 0.0)
    series = jnp.ones_like(small)
    for k in range(11, 1, -1):
      series = 1 + series * small / np.float32(k)
    return wobble(x, jnp.where(near, small * series, accurate_exp(x) - 1)).astype(given.dtype)

  for primitive, fn in ((lax.logistic_p, logistic), (lax.expm1_p, expm1)):
    mlir.register_lowering(primitive, mlir.lower_fun(fn, multiple_results=False), platform="cpu")


def main(route: str, amplitude: float, bias: float, gradients: str = "dh,dE,db",
         smoothing: str = "0", others: str = "0") -> int:
  emulate_exp(amplitude, bias)
  if float(others):
    emulate_sigmoid_and_expm1(float(others))
    from cutbce import variants  # pylint: disable=import-outside-toplevel
    variants.EXP_SIGMOID_PLATFORMS += ("cpu",)  # this CPU stands in for the TPU
  from tests.cutbce import test_precision as rule  # pylint: disable=import-outside-toplevel
  if route.startswith("bce/"):
    got, dense, oracle, db_scale = _bce_grads(rule, route.removeprefix("bce/"))
    what = f"cut_bce {route.removeprefix('bce/')}"
  else:
    got, dense, oracle, db_scale = _softmax_grads(rule, route, float(smoothing))
    what = f"cut_softmax_ce {route}"
  picked = [name in gradients.split(",") for name in ("dh", "dE", "db")]
  pick = lambda grads: tuple(g if keep else 0 * g for g, keep in zip(grads, picked))  # noqa: E731
  try:
    rule._check_no_worse_than_dense(pick(got), pick(dense), pick(oracle), jnp.float32,  # pylint: disable=protected-access
                                    f"{what} under exp x (1 + {amplitude} sin + {bias})",
                                    db_scale)
  except AssertionError as error:
    print(str(error).split("\n")[0])
    return 1
  print("holds")
  return 0


def _softmax_grads(rule, route: str, smoothing: float):
  """(cut, dense, float64) gradients and db's scale of `test_precision`'s softmax check."""
  import cutbce  # pylint: disable=import-outside-toplevel
  from cutbce.sharding import sharded_cut_softmax_ce  # pylint: disable=import-outside-toplevel
  if route == "sharded":
    fn = functools.partial(sharded_cut_softmax_ce, mesh=rule._mesh(), token_axes=("data",),  # pylint: disable=protected-access
                           vocab_axis="model", backend="xla", plan=rule.PLANS["xla"])
  else:
    fn = functools.partial(cutbce.cut_softmax_ce, backend=route, plan=rule.PLANS[route])
  options = {"label_smoothing": smoothing}
  return (rule._grads(fn, jnp.float32, **options),  # pylint: disable=protected-access
          rule._grads(cutbce.dense_softmax_ce, jnp.float32, **options),  # pylint: disable=protected-access
          _oracle(rule, options),
          rule.softmax_db_scale(rule._inputs(jnp.float32), **options))  # pylint: disable=protected-access


def _bce_grads(rule, route: str):
  """The same for `test_precision`'s BCE check, ROUTE "xla", "xla-two-pass" or "pallas_tpu"."""
  import cutbce  # pylint: disable=import-outside-toplevel
  backend = route.split("-")[0]
  fn = functools.partial(cutbce.cut_bce, backend=backend, plan=rule.PLANS[backend],
                         one_pass=not route.endswith("two-pass"))
  return (rule._grads(fn, jnp.float32, vocab_reduction="sum"),  # pylint: disable=protected-access
          rule._dense_grads("bce", jnp.float32),  # pylint: disable=protected-access
          rule._oracle("bce", jnp.float32),  # pylint: disable=protected-access
          None)


def _oracle(rule, options):
  """float64 (dh, dE, db) of `test_precision`'s float32 inputs."""
  hidden, table, bias, targets, exclude, weights = (np.asarray(x) for x in rule._inputs(jnp.float32))  # pylint: disable=protected-access
  _, grads, _ = np_reference.softmax_ce(hidden, table, targets, weights, bias=bias,
                                        exclude=exclude, num_items=rule.NUM_ITEMS, **options)
  return grads


if __name__ == "__main__":
  sys.exit(main(sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), *sys.argv[4:]))
