"""How far the attached platform's float32 functions and products are from float64.

    python benchmarks/float32_functions.py

Each function runs jitted on 2,000,001 evenly spaced float32 points of its
range; the error of each point is |got - float64(f)(x)| / |float64(f)(x)| in
float32 ulps (2^-23), reported as the max and the mean signed value (a bias).
Products: a [256, 512] x [512, 256] normal matrix product at each
`jax.lax.Precision`, max error over the largest entry. Sums: 10^7 values,
relative error. On this repository's CPU every function is within 3 ulp; on
a TPU v5e (docs/results/tpu_v5e/float32_functions.log) exp is off by up to 68
ulp, log1p 2,900, tanh 682 (docs/loss.md, "On a TPU").
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

ULP = 2.0 ** -23
POINTS = 2_000_001


def _tanh_from_expm1(x):
  """tanh(x) = -expm1(-2|x|) / (2 + expm1(-2|x|)), signed: a candidate replacement."""
  m = jnp.expm1(-2 * jnp.abs(x))
  return jnp.sign(x) * (-m / (2 + m))


# name, the platform's function, float64's, the range of x.
FUNCTIONS = (
    ("tanh", jnp.tanh, np.tanh, (-20, 20)),
    ("tanh_from_expm1", _tanh_from_expm1, np.tanh, (-20, 20)),
    ("exp", jnp.exp, np.exp, (-80, 80)),
    ("expm1", jnp.expm1, np.expm1, (-20, 20)),
    ("log", jnp.log, np.log, (1e-6, 1e4)),
    ("log1p", jnp.log1p, np.log1p, (-0.9, 1e3)),
    ("softplus", lambda x: jnp.logaddexp(0.0, x), lambda x: np.logaddexp(0.0, x), (-20, 20)),
    ("sigmoid", jax.nn.sigmoid, lambda x: 1 / (1 + np.exp(-x)), (-20, 20)),
    ("reciprocal", lambda x: 1.0 / x, lambda x: 1.0 / x, (0.5, 1e3)),
)


def main() -> None:
  print(jax.devices())
  for name, fn, reference, (low, high) in FUNCTIONS:
    x = np.linspace(low, high, POINTS).astype(np.float32)
    want = reference(x.astype(np.float64))
    got = np.asarray(jax.jit(fn)(x), np.float64)
    error = (got - want) / np.maximum(np.abs(want), 1e-30) / ULP
    print(f"{name:16s} max |error| {np.max(np.abs(error)):8.1f} ulp, mean {np.mean(error):6.2f} ulp")
  rng = np.random.default_rng(0)
  a = rng.normal(size=(256, 512)).astype(np.float32)
  b = rng.normal(size=(512, 256)).astype(np.float32)
  want = a.astype(np.float64) @ b
  for precision in ("default", "high", "highest"):
    got = jax.jit(lambda u, v, p=precision: jnp.dot(u, v, precision=p))(a, b)
    error = np.max(np.abs(np.asarray(got, np.float64) - want)) / np.max(np.abs(want))
    print(f"product at {precision:8s} max error / max |entry| {error:.3g}")
  values = rng.normal(size=10_000_000).astype(np.float32) * 3
  for name, fn, reference in (("softplus", lambda v: jnp.logaddexp(0.0, v),
                               lambda v: np.logaddexp(0.0, v)),
                              ("|x|", jnp.abs, np.abs)):
    got = float(jax.jit(lambda v, f=fn: jnp.sum(f(v)))(values))
    want = float(np.sum(reference(values.astype(np.float64))))
    print(f"sum of 10^7 {name:8s} relative error {abs(got - want) / want:.3g}")


if __name__ == "__main__":
  main()
