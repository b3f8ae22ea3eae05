"""The softmax gradients under a TPU-like float32 exp, on CPU (`emulated_exp`).

On a TPU v5e the softmax dh of `xla` and `pallas_tpu` broke the precision
rule (3.7e-5 of a row where dense was 2.7e-7 off; docs/results.md, "float32
on a TPU"). The chip's float32 exp is off by up to 68 ulp; with an exp
that errs like it (here, in a subprocess), this CPU shows the same failure,
and with an exact one the rule holds. Why: the backward's p_tv = exp(x_tv -
lse_t) come from other exp calls than the forward's sums that made lse_t, so
they do not sum to 1 (a bias of b per exp leaves the tiles' rescaled sums
off by b per rescale), and dh_t = sum_v p_tv e_v - ... then carries
(sum_v p_tv - 1) times the part of the items' embeddings they share (here a
constant -10 in one dimension); the dense reference divides by the sum of
its own exponentials, so its p sum to 1 whatever exp returns.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

# The chip's measured error: up to 68 ulp (8.1e-6), mean -6.9 ulp (-8.2e-7).
TPU_LIKE = (8.1e-6, -8.2e-7)


class RuleBroken(AssertionError):
  """A backend's gradients were less accurate than the dense reference's."""


KNOWN = pytest.mark.xfail(
    strict=True, raises=RuleBroken,
    reason="the backward's p do not sum to 1 under an inexact exp: not fixed yet")


def _check_rule(backend, amplitude, bias):
  run = subprocess.run(
      [sys.executable, "-m", "tests.cutbce.emulated_exp", backend, str(amplitude), str(bias)],
      capture_output=True, text=True, timeout=600, check=False)
  if run.returncode not in (0, 1):
    raise RuntimeError(run.stderr[-3000:])
  if run.returncode == 1:
    raise RuleBroken(run.stdout)


@pytest.mark.parametrize("backend", ["xla", "pallas_tpu"])
def test_an_exact_exp_built_from_other_primitives_keeps_the_rule(backend):
  _check_rule(backend, 0.0, 0.0)


@pytest.mark.parametrize("backend", [pytest.param("xla", marks=KNOWN),
                                     pytest.param("pallas_tpu", marks=KNOWN)])
def test_a_tpu_like_exp_keeps_the_rule(backend):
  _check_rule(backend, *TPU_LIKE)
