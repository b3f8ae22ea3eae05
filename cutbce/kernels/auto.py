"""Kernel set of `backend="auto"`: Pallas on TPU, XLA elsewhere, chosen at lowering time.

Honours the backend contract written in `cutbce/kernels/xla.py`. Every entry
point is a `lax.platform_dependent` over the two kernel sets: both are
traced, only the lowering platform's is lowered. So one function runs the XLA
path on CPU and GPU and lowers (or exports, from a CPU host) to the Mosaic
kernels for TPU. `backends.resolve_backend` picks this set only where the Pallas
kernels take the inputs (and the plan), so the TPU branch never fails where
the XLA path would not; on a TPU host it picks `pallas_tpu` directly.
"""

from __future__ import annotations

import functools

from jax import lax

from cutbce.kernels import tpu, xla

unsupported_reason = tpu.unsupported_reason
# The TPU branch's limit (the XLA branch takes any number).
MAX_FIXED_COLUMNS = tpu.MAX_FIXED_COLUMNS
SOFTMAX_MASS = tpu.SOFTMAX_MASS and xla.SOFTMAX_MASS


def _choose(name: str, *operands, **static):
  """`lax.platform_dependent` of kernel `name` over the TPU and XLA kernel sets."""
  present = [x for x in operands if x is not None]

  def branch(kernels):
    def call(*arrays):
      arrays = iter(arrays)
      full = (None if x is None else next(arrays) for x in operands)
      return getattr(kernels, name)(*full, **static)
    return call

  return lax.platform_dependent(*present, tpu=branch(tpu), default=branch(xla))


forward = functools.partial(_choose, "forward")
backward = functools.partial(_choose, "backward")
rank_counts = functools.partial(_choose, "rank_counts")
rank_logits = functools.partial(_choose, "rank_logits")
forward_backward = functools.partial(_choose, "forward_backward")
softmax_forward = functools.partial(_choose, "softmax_forward")
softmax_backward = functools.partial(_choose, "softmax_backward")


def default_plan(kernel: str, num_tokens: int, vocab: int, dim: int, dtype, num_targets: int = 1):
  """The TPU kernels' plan (the XLA branch, given None, plans for itself)."""
  return tpu.default_plan(kernel, num_tokens, vocab, dim, dtype, num_targets=num_targets)
