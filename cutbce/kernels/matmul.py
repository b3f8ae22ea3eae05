"""The precision of the op's matrix products: float32 at float32's on every platform.

A TPU multiplies float32 matrices in one bfloat16 pass at jax's default
precision (about three significant digits), where a CPU multiplies them in
float32; on the TPU v5e the op's float32 results then missed the float64
oracle on every backend, the dense one included (docs/results.md, "TPU").
The op promises float32 results as accurate as float32 allows, so every
product with a float32 operand asks for `Precision.HIGHEST` (float32 on the
MXU: several bfloat16 passes; full float32 on a CPU, where nothing changes).
A caller who chose a precision with `jax.default_matmul_precision(...)`
(or the `jax_default_matmul_precision` flag) gets that one instead: the
op honours the choice rather than overriding it. A bfloat16 x bfloat16
product accumulated in float32 is exact at any precision, so it keeps the
default (one pass).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def precision(*dtypes) -> lax.Precision | None:
  """`Precision.HIGHEST` where an operand is float32 and the caller set none, else None.

  Args:
    *dtypes: the dtypes (or arrays) of the product's operands.
  """
  if jax.config.jax_default_matmul_precision is not None:
    return None
  wide = any(jnp.dtype(getattr(d, "dtype", d)) == jnp.float32 for d in dtypes)
  return lax.Precision.HIGHEST if wide else None
