"""cutbce.kernels.numerics: exp and log within float32's ulps, no exp or log primitive.

And `softmax.partition`, whose log-sum-exp uses them, for any number of
separated targets (none included).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from cutbce.kernels import numerics


def _ulps(got, want):
  """|got - want| in units of float32's spacing at want (float64 arrays)."""
  return np.abs(got - want) / np.spacing(np.abs(want).astype(np.float32)).astype(np.float64)


def test_exp_is_within_one_ulp_over_its_range():
  rng = np.random.default_rng(0)
  x = np.concatenate([-rng.uniform(0, 87, 100_000), -rng.uniform(0, 1e-3, 10_000),
                      -np.arange(0, 87, 0.5)]).astype(np.float32)
  got = np.asarray(jax.jit(numerics.exp)(x), np.float64)
  assert np.max(_ulps(got, np.exp(x.astype(np.float64)))) < 1.0


def test_exp_ends():
  x = np.array([0.0, -0.0, -87.0, -88.0, -104.0, -1e30, -np.inf, np.finfo(np.float32).min],
               np.float32)
  got = np.asarray(jax.jit(numerics.exp)(x))
  assert got[0] == got[1] == 1.0
  assert abs(got[2] / np.exp(-87.0) - 1) < 1e-6
  np.testing.assert_array_equal(got[3:], 0.0)  # under 2^-126: below any running sum's ulp


def test_log_is_within_two_ulps_over_its_range():
  rng = np.random.default_rng(1)
  x = np.concatenate([rng.uniform(1, 2, 50_000), np.exp(rng.uniform(0, 88, 50_000)),
                      rng.uniform(0.5, 1.5, 10_000)]).astype(np.float32)
  got = np.asarray(jax.jit(numerics.log)(x), np.float64)
  want = np.log(x.astype(np.float64))
  away = np.abs(want) > 1e-3  # near log 1 = 0 the spacing vanishes: absolute there
  assert np.max(_ulps(got[away], want[away])) < 2.0
  assert np.max(np.abs(got - want)[~away]) < 1e-9


def test_log_ends():
  got = np.asarray(jax.jit(numerics.log)(np.array([1.0, 2.0, 0.0, 3e38], np.float32)))
  assert got[0] == 0.0 and got[1] == np.float32(np.log(2.0)) and got[2] == -np.inf
  assert abs(got[3] / np.log(3e38) - 1) < 1e-7


_EXP, _LOG = jax.jit(numerics.exp), jax.jit(numerics.log)


# Jitted, as the op traces them. Op by op, each intermediate rounded,
# exp(-39.85439) came out 1.05 ulp off (0.05 compiled on this CPU): the
# example kept below; over 4e7 random arguments compiled, 0.90 at most.
@settings(max_examples=200, deadline=None)
@given(st.floats(-87.0, 0.0, width=32), st.floats(1.0, float(np.float32(1e30)), width=32))
@example(-39.85438919067383, 1.0)
def test_property_exp_and_log(x, y):
  assert _ulps(float(_EXP(jnp.float32(x))), np.exp(np.float64(x))) < 1.0
  want = np.log(np.float64(y))
  got = float(_LOG(jnp.float32(y)))
  assert abs(got - want) <= 2 * np.spacing(np.float32(max(abs(want), 1e-3)))


def test_expm1_is_within_two_ulps_for_a_targets_arguments():
  rng = np.random.default_rng(2)
  x = np.concatenate([-rng.uniform(0, 87, 50_000), -np.exp(rng.uniform(-40, 0, 50_000)),
                      rng.uniform(0, 0.34, 5_000), [-0.34657359, -0.3466, 0.0, -1e-30]]
                     ).astype(np.float32)
  got = np.asarray(jax.jit(numerics.expm1)(x), np.float64)
  want = np.expm1(x.astype(np.float64))
  assert np.max(_ulps(got[x != 0], want[x != 0])) < 2.0
  assert got[x == 0].tolist() == [0.0]


def test_sigmoid_is_within_three_ulps_and_keeps_nan():
  rng = np.random.default_rng(3)
  z = np.concatenate([rng.uniform(-87, 87, 100_000), rng.normal(size=10_000) * 1e-3,
                      [0.0, 87.0, 200.0, np.inf, -np.inf]]).astype(np.float32)
  got = np.asarray(jax.jit(numerics.sigmoid)(z), np.float64)
  want = 1 / (1 + np.exp(-z.astype(np.float64)))
  assert np.max(_ulps(got, want)) < 3.0
  assert got[-3:].tolist() == [1.0, 1.0, 0.0]
  assert np.isnan(numerics.sigmoid(jnp.float32(np.nan)))
  assert float(numerics.sigmoid(jnp.float32(-100.0))) == 0.0  # under 2^-126


@pytest.mark.parametrize("fn", [numerics.exp, numerics.log, numerics.expm1, numerics.sigmoid])
def test_no_exp_or_log_primitive(fn):
  """The point of them: the platform's exp and log (a TPU's err by tens of ulps) are not called."""
  primitives = {eqn.primitive.name for eqn in jax.make_jaxpr(fn)(jnp.ones(4)).jaxpr.eqns}
  assert not primitives & {"exp", "exp2", "log", "log1p", "expm1", "logistic"}, primitives


@pytest.mark.parametrize("count", [0, 1, 3])
def test_partition_matches_float64_for_any_number_of_separated_targets(count):
  """lse and 1 - p from the rest's (max, sum) and the targets' logits, K = 0 included."""
  from cutbce import softmax  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(count)
  tokens, num_targets = 5, 3
  logits = rng.normal(size=(tokens, 40)) * 3  # every column an item; targets: columns 0..2
  logits[:, :num_targets] += np.array([9.0, 0.0, -4.0])
  rest = logits[:, count:]  # the sweep leaves the first `count` targets out of its sums
  row_max = rest.max(axis=1)
  row_sum = np.exp(rest - row_max[:, None]).sum(axis=1)
  mask = np.ones((tokens, num_targets), bool)
  mask[1, -1] = False  # a padding target's column comes back 0
  lse, complement = softmax.partition(
      jnp.asarray(row_max, jnp.float32), jnp.asarray(row_sum, jnp.float32),
      jnp.asarray(logits[:, :num_targets], jnp.float32), jnp.asarray(mask), count)
  want_lse = np.log(np.exp(logits).sum(axis=1))
  np.testing.assert_allclose(np.asarray(lse), want_lse, rtol=1e-6)
  want = np.where(mask, 1 - np.exp(logits[:, :num_targets] - want_lse[:, None]), 0.0)
  # Separated targets: 1 - p at float32's relative precision; the rest read
  # 1 - p off lse - x (-expm1), within float32's spacing at lse.
  got = np.asarray(complement)
  np.testing.assert_allclose(got[:, :count], want[:, :count], rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(got[:, count:], want[:, count:], rtol=1e-5, atol=2e-6)
