"""exp and log to within an ulp or two of float32, built from multiplies and adds.

For the softmax's per-token numbers only (the rescale of a running sum when
its max moves, the log of the sum, the log-sum-exp of a few terms), never per
logit. A TPU v5e's float32 exp errs by up to 68 ulp with a mean of -6.9 ulp
and its log by a mean of 1.4 ulp (docs/results/tpu_v5e/float32_functions.log).
Per logit that bias cancels: the backward's p_tv = exp(x_tv - top_t) / total_t
carry it as the forward's sums behind total_t do. The per-token exps and logs do not
cancel: a token whose running max moved k times had its sum, hence lse_t,
shifted by k times the bias, and its p then summed to 1 - k b rather than 1
(dE and db, sums over tokens, kept that error; tests/cutbce/test_emulated_exp.py).
A few dozen multiply-adds per token cost nothing beside the sweep.

`expm1` and `sigmoid` serve the targets (a few per token): the softmax's 1 - p_tp
is a sigmoid of the other items' log-sum-exp less x_tp, or -expm1(x_tp - lse_t);
BCE's target column is -sigmoid(-x_tp).
The chip's own err by up to 990 ulp (expm1) and 48 ulp (sigmoid), so a
confident target's 1 - p, and dE's row for it, kept a relative error of
3e-6 where dense's p - 1 (p read off a sum that holds p's own exp) kept
float32's (tests/cutbce/test_precision.py on the chip, 2026-12-07).

Inputs are float32; the functions are elementwise and lower in XLA and in
Mosaic (Pallas TPU) alike.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

# ln 2 split so that n * LN2_HIGH is exact for |n| < 2^11 (Cody and Waite).
LN2_HIGH = np.float32(0.693145751953125)
LN2_LOW = np.float32(1.4286068203094172e-06)
LOG2_E = np.float32(1.4426950408889634)


def _power_of_two(n):
  """2^n as float32 for int32 n in [-126, 127] (the exponent field set directly)."""
  return lax.bitcast_convert_type((n + 127) << 23, jnp.float32)


def exp(x):
  """float32 exp(x) for x <= 0 (the rescale factors and log-sum-exp terms), -inf to 0.

  2^n e^r with n = round(x / ln 2), |r| <= ln 2 / 2, e^r by Taylor to r^8
  (the first term left out is under 2^-30). Results under 2^-126 (x < -87.3)
  are 0: beside the term exp(0) = 1 that every running sum holds, they are
  below float32's resolution.
  """
  x = jnp.maximum(x.astype(jnp.float32), -104.0)  # finite: no inf - inf below
  n = jnp.floor(x * LOG2_E + 0.5)
  r = (x - n * LN2_HIGH) - n * LN2_LOW
  poly = jnp.ones_like(r)
  for k in range(8, 0, -1):
    poly = 1.0 + poly * r * np.float32(1.0 / k)
  n = n.astype(jnp.int32)
  return jnp.where(n < -126, 0.0, poly * _power_of_two(jnp.maximum(n, -126)))


def log(x):
  """float32 log(x) for x > 0 (the sums of exp, >= 1); -inf at 0.

  x = 2^e m with m in [sqrt(1/2), sqrt(2)) (the exponent field read
  directly), log m = 2 atanh(s), s = (m - 1) / (m + 1), |s| < 0.172, the
  series to s^13 (the first term left out is under 2^-33).
  """
  x = x.astype(jnp.float32)
  bits = lax.bitcast_convert_type(jnp.maximum(x, np.float32(np.finfo(np.float32).tiny)),
                                  jnp.int32)
  exponent = (bits >> 23) - 127
  mantissa = lax.bitcast_convert_type((bits & 0x007FFFFF) | 0x3F800000, jnp.float32)  # [1, 2)
  high = mantissa > np.float32(np.sqrt(2.0))
  mantissa = jnp.where(high, mantissa * 0.5, mantissa)
  exponent = (exponent + high.astype(jnp.int32)).astype(jnp.float32)
  s = (mantissa - 1.0) / (mantissa + 1.0)
  s2 = s * s
  series = jnp.zeros_like(s)
  for k in range(13, 1, -2):
    series = (series + np.float32(1.0 / k)) * s2
  log_m = 2.0 * s + 2.0 * s * series
  value = (exponent * LN2_HIGH + (log_m + exponent * LN2_LOW))
  return jnp.where(x > 0, value, -jnp.inf)


def expm1(x):
  """float32 exp(x) - 1 for x <= ln 2 / 2 (1 - p of a target: x = x_tp - lse_t <= 0).

  Near 0 (|x| < ln 2 / 2) by Taylor to x^10 (the first term left out is under
  2^-30 of the result), so no digit is lost to the subtraction; below,
  `exp(x) - 1` (exp(x) <= 0.71: the subtraction keeps every digit).
  """
  x = x.astype(jnp.float32)
  near = jnp.abs(x) < np.float32(0.34657359)
  small = jnp.where(near, x, 0.0)
  series = jnp.ones_like(small)
  for k in range(10, 1, -1):
    series = 1.0 + series * small * np.float32(1.0 / k)
  return jnp.where(near, small * series, exp(jnp.minimum(x, 0.0)) - 1.0)


def sigmoid(z):
  """float32 1 / (1 + exp(-z)) for any z, within a few ulp; NaN stays NaN.

  With e = exp(-|z|) <= 1 (`exp`): 1 / (1 + e) for z >= 0, e / (1 + e)
  below; one rounding in 1 + e and one in the division. Results under 2^-126
  (z < -87.3) are 0.
  """
  z = z.astype(jnp.float32)
  e = exp(-jnp.abs(jnp.where(jnp.isnan(z), 0.0, z)))
  value = jnp.where(z >= 0, 1.0, e) / (1.0 + e)
  return jnp.where(jnp.isnan(z), z, value)
