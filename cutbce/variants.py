"""Loss variants: the per-logit BCE of every option, as the tiles and corrections see it.

For a logit x with label y in {0, 1}, all options at once (each one off by
default; the defaults give plain BCE(x, y) = softplus(x) - y x):

    x~   = c tanh(x / c)                          logit_soft_cap=c, before everything
    y'   = y (1 - e) + e / 2                      label_smoothing=e
    bce  = w y' softplus(-x~) + (1 - y') softplus(x~)        pos_weight=w
    p    = sigmoid(x~);  p_t = y' p + (1 - y')(1 - p)
    f    = a_t (1 - p_t)^g bce,  a_t = y' a + (1 - y')(1 - a)  focal_gamma=g, focal_alpha=a

The focal form is Keras' `binary_focal_crossentropy` (smoothed label in p_t
and a_t, `apply_class_balancing` when `focal_alpha` is given), with
`pos_weight` added as PyTorch's `BCEWithLogitsLoss` defines it. Position t's
loss is then exactly

    l_t = sum_{v not in X_t} f(x_tv, 0) + sum_{p in P_t} [f(x_tp, 1) - f(x_tp, 0)]

a dense background of negatives plus a correction at the targets.

Without a cap or focal terms, f(x, 0) = A softplus(x) - B x with
A = 1 - e/2 + w e/2 and B = w e/2 ("affine" options): the tiles then compute
the plain softplus (and sigmoid in the backward), the sum is scaled by A
outside, and sum_v B x_tv = B (h_t . sum_v e_v + sum_v b_v) costs O(D) per
position instead of any tile work. With a cap or focal terms f(x, 0) is
evaluated in every tile and its derivative by forward-mode autodiff of the
same stable expression.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax import lax

from cutbce.kernels import numerics

# The public keyword arguments of the variants, in signature order.
OPTION_NAMES = ("pos_weight", "label_smoothing", "logit_soft_cap", "focal_gamma", "focal_alpha")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class LossOptions:
  """The loss variants of one call; hashable, so it travels as a static argument.

  Attributes:
    pos_weight: w > 0, the weight of positive labels, or None (1).
    label_smoothing: e in [0, 1]: labels become y (1 - e) + e / 2.
    logit_soft_cap: c > 0: logits become c tanh(x / c); or None.
    focal_gamma: g >= 0, the focal exponent; or None (no focal factor).
    focal_alpha: a in [0, 1], the class balance of the focal loss; or None.
  """

  pos_weight: float | None = None
  label_smoothing: float = 0.0
  logit_soft_cap: float | None = None
  focal_gamma: float | None = None
  focal_alpha: float | None = None

  def __post_init__(self):
    for name in OPTION_NAMES:
      value = getattr(self, name)
      if value is None:
        if name == "label_smoothing":
          raise TypeError("label_smoothing must be a float in [0, 1], got None")
        continue
      if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a Python float, got {type(value).__name__} ({value!r})")
      if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")
    if self.pos_weight is not None and self.pos_weight <= 0:
      raise ValueError(f"pos_weight must be > 0, got {self.pos_weight!r}")
    if not 0.0 <= self.label_smoothing <= 1.0:
      raise ValueError(f"label_smoothing must be in [0, 1], got {self.label_smoothing!r}")
    if self.logit_soft_cap is not None and self.logit_soft_cap <= 0:
      raise ValueError(f"logit_soft_cap must be > 0, got {self.logit_soft_cap!r}")
    if self.focal_gamma is not None and self.focal_gamma < 0:
      raise ValueError(f"focal_gamma must be >= 0, got {self.focal_gamma!r}")
    if self.focal_alpha is not None and not 0.0 <= self.focal_alpha <= 1.0:
      raise ValueError(f"focal_alpha must be in [0, 1], got {self.focal_alpha!r}")

  @property
  def is_plain(self) -> bool:
    """No option set: plain BCE."""
    return self == PLAIN

  @property
  def is_affine(self) -> bool:
    """f(x, 0) = A softplus(x) - B x: no cap and no focal factor."""
    return self.logit_soft_cap is None and not self.focal_gamma and self.focal_alpha is None

  def affine_coefficients(self) -> tuple[float, float]:
    """(A, B) of the dense part outside the tiles: l = A sum_v tile_value - B sum_v x.

    (1, 0) for options that are not affine: their tiles compute all of f(x, 0).
    """
    if not self.is_affine:
      return 1.0, 0.0
    weight = 1.0 if self.pos_weight is None else float(self.pos_weight)
    half = self.label_smoothing / 2
    return 1.0 - half + weight * half, weight * half


PLAIN = LossOptions()


def softplus(x):
  """log(1 + e^x) = max(x, 0) + log1p(e^-|x|): stable for every x, and vectorizes.

  The same identity `jax.nn.softplus` uses, without its inf/nan special cases,
  which on CPU cost about 3x the whole tile's elementwise time.
  """
  return jnp.maximum(x, 0.0) + jnp.log1p(jnp.exp(-jnp.abs(x)))


def cap(options: LossOptions, x):
  """The logit every option sees: c tanh(x / c), or x without a cap."""
  if options.logit_soft_cap is None:
    return x
  c = options.logit_soft_cap
  return c * jnp.tanh(x / c)


def elementwise_loss(options: LossOptions, x, label: int):
  """f(x, y) of the module docstring for a static label y in {0, 1}; float32 in, out.

  Written so that it is stable for every finite x and its derivative by
  autodiff is too, with few transcendentals per logit: one exp(-|x|) gives
  softplus(x), softplus(-x) (sharing log1p(e^-|x|)) and sigmoid(x) (one
  division); the focal base 1 - p_t = y' + (1 - 2y') p is linear in p, and an
  integer exponent g is a product (`integer_pow`), never exp(g log .).
  Without smoothing a non-integer g uses exp(-g softplus(-+x)) (never 0^g).
  """
  x = cap(options, x)
  smoothed = label * (1.0 - options.label_smoothing) + options.label_smoothing / 2
  weight = 1.0 if options.pos_weight is None else options.pos_weight
  decay = jnp.exp(-jnp.abs(x))  # e^-|x| in (0, 1]
  tail = jnp.log1p(decay)
  softplus_pos = jnp.maximum(x, 0.0) + tail  # -log(1 - p)
  softplus_neg = jnp.maximum(-x, 0.0) + tail  # -log(p)
  loss = 0.0
  if smoothed:
    loss = loss + weight * smoothed * softplus_neg
  if smoothed != 1.0:
    loss = loss + (1.0 - smoothed) * softplus_pos
  gamma = options.focal_gamma
  if gamma:
    if float(gamma).is_integer() or options.label_smoothing:
      p = sigmoid_from_exp(x, decay)
      # 1 - p_t = y'(1 - p) + (1 - y') p, in [min(y', 1-y'), max(y', 1-y')].
      base = smoothed + (1.0 - 2.0 * smoothed) * p
      if float(gamma).is_integer():
        factor = lax.integer_pow(base, int(gamma))
      else:
        factor = jnp.exp(gamma * jnp.log(base))  # smoothed: base > 0
    else:
      # 1 - p_t is p for a negative and 1 - p for a positive.
      factor = jnp.exp(-gamma * (softplus_neg if label == 0 else softplus_pos))
    loss = factor * loss
  if options.focal_alpha is not None:
    alpha = options.focal_alpha
    loss = (smoothed * alpha + (1.0 - smoothed) * (1.0 - alpha)) * loss
  return loss


def _value_and_derivative(fn, x):
  """fn(x) and fn'(x) of an elementwise fn, by one forward-mode pass."""
  return jax.jvp(fn, (x,), (jnp.ones_like(x),))


def tile_value(options: LossOptions, x):
  """What a tile sums per logit: softplus(x) for affine options, f(x, 0) otherwise."""
  if options.is_affine:
    return softplus(x)
  return elementwise_loss(options, x, 0)


# Platforms where the tiles make sigmoid from exp(-|x|), as
# `tile_value_and_grad` does. JAX lowers sigmoid as 1 / (1 + exp(-x)), exp
# at positive arguments for x < 0; a TPU v5e's float32 exp errs by up to 68
# ulp (docs/results/tpu_v5e/float32_functions.log), and there the two-pass
# BCE dE that took JAX's sigmoid broke the precision rule where the one-pass,
# from exp(-|x|), kept it. Elsewhere JAX's is 3-10x faster (this CPU).
EXP_SIGMOID_PLATFORMS = ("tpu",)


def sigmoid_from_exp(x, decay=None):
  """sigmoid(x) = [x >= 0 ? 1 : e] / (1 + e) with e = exp(-|x|): exp the only transcendental.

  `decay`: e when the caller has it already (it shares it with softplus).
  """
  if decay is None:
    decay = jnp.exp(-jnp.abs(x))
  return jnp.where(x >= 0, 1.0, decay) / (1.0 + decay)


def tile_sigmoid(x):
  """sigmoid(x) per logit in an XLA program: `sigmoid_from_exp` on EXP_SIGMOID_PLATFORMS."""
  return lax.platform_dependent(
      x, default=jax.nn.sigmoid, **{name: sigmoid_from_exp for name in EXP_SIGMOID_PLATFORMS})


def tile_grad(options: LossOptions, x, sigmoid=tile_sigmoid):
  """d tile_value / dx: sigmoid(x) for affine options, f'(x, 0) otherwise.

  `sigmoid` for affine options: `tile_sigmoid` in XLA programs (a TPU's
  two-pass backward then takes its p as the one-pass does, from exp: with
  the chip's own sigmoid its dE broke the rule where the one-pass kept it);
  a kernel for one platform passes its own.
  """
  if options.is_affine:
    return sigmoid(x)
  return _value_and_derivative(lambda z: elementwise_loss(options, z, 0), x)[1]


def tile_value_and_grad(options: LossOptions, x):
  """(tile_value, tile_grad) in one pass, sharing the transcendentals.

  For affine options softplus(x) and sigmoid(x) share one exp(-|x|):
  sigmoid(x) = [x >= 0 ? 1 : e] / (1 + e) with e = exp(-|x|).
  """
  if options.is_affine:
    decay = jnp.exp(-jnp.abs(x))
    value = jnp.maximum(x, 0.0) + jnp.log1p(decay)
    return value, sigmoid_from_exp(x, decay)
  return _value_and_derivative(lambda z: elementwise_loss(options, z, 0), x)


def negative_value_and_grad(options: LossOptions, x):
  """f(x, 0) and f'(x, 0), the full negative term (affine part included)."""
  return _value_and_derivative(lambda z: elementwise_loss(options, z, 0), x)


def target_value_and_grad(options: LossOptions, x):
  """f(x, 1) - f(x, 0) and its derivative: the correction at a target."""
  return _value_and_derivative(
      lambda z: elementwise_loss(options, z, 1) - elementwise_loss(options, z, 0), x
  )


def target_column_grad(options: LossOptions, x):
  """f'(x, 1) + B: the whole logit gradient at a target, less the linear -B added outside.

  What a backward sweep sets in a target's column (in float32, before the
  tile is cast to the input dtype), where the tile alone holds A f'_tile(x)
  = A sigmoid(x) (affine options) or f'(x, 0). Computed directly from the
  target's own logit, never as the background's sigmoid(x) plus a correction
  of -1 that cancel: for plain BCE it is -sigmoid(-x), accurate at every x
  (sigmoid(7) = 0.99909 is 1.0 in bfloat16, and 1.0 - 1 = 0).
  """
  if options.is_plain:
    return -numerics.sigmoid(-x)  # within 3 ulp, a few per token (a TPU's sigmoid: 48)
  _, slope = options.affine_coefficients()
  return _value_and_derivative(lambda z: elementwise_loss(options, z, 1) + slope * z, x)[1]


def make_options(*, pos_weight=None, label_smoothing=0.0, logit_soft_cap=None,
                 focal_gamma=None, focal_alpha=None) -> LossOptions:
  """`LossOptions` from the public keyword arguments (validated; floats normalized)."""
  as_float = lambda v: float(v) if isinstance(v, int) and not isinstance(v, bool) else v  # noqa: E731
  return LossOptions(
      pos_weight=as_float(pos_weight), label_smoothing=as_float(label_smoothing),
      logit_soft_cap=as_float(logit_soft_cap), focal_gamma=as_float(focal_gamma),
      focal_alpha=as_float(focal_alpha),
  )
