"""Property test: over random small shapes, arguments and loss variants, the XLA path equals dense_bce."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, given, settings, strategies as st

import cutbce


@st.composite
def problems(draw):
  tokens = draw(st.integers(1, 12))
  vocab = draw(st.integers(1, 300))
  dim = draw(st.integers(1, 9))
  num_targets = draw(st.integers(1, 5))
  num_exclude = draw(st.integers(1, 4))
  block_v = draw(st.integers(1, 160))
  seed = draw(st.integers(0, 2**31 - 1))
  rng = np.random.default_rng(seed)
  ids = lambda shape: rng.integers(-2, vocab + 2, size=shape).astype(np.int32)
  maybe = lambda value: draw(st.sampled_from([None, value]))  # noqa: E731
  options = dict(
      pos_weight=maybe(draw(st.floats(0.1, 5.0))),
      label_smoothing=draw(st.sampled_from([0.0, draw(st.floats(0.0, 1.0))])),
      logit_soft_cap=maybe(draw(st.floats(0.5, 10.0))),
      focal_gamma=maybe(draw(st.floats(0.0, 3.0))),
      focal_alpha=maybe(draw(st.floats(0.0, 1.0))),
  )
  return dict(
      **options,
      num_items=draw(st.sampled_from([None, draw(st.integers(1, vocab))])),
      hidden=rng.normal(size=(tokens, dim)).astype(np.float32),
      table=rng.normal(size=(vocab, dim)).astype(np.float32),
      bias=rng.normal(size=(vocab,)).astype(np.float32) if draw(st.booleans()) else None,
      targets=ids((tokens, num_targets)),
      weights=(rng.random(tokens) * (rng.random(tokens) > 0.2)).astype(np.float32),
      exclude=ids((tokens, num_exclude)) if draw(st.booleans()) else None,
      reduction=draw(st.sampled_from(["mean", "sum", "none"])),
      vocab_reduction=draw(st.sampled_from(["mean", "sum"])),
      plan=cutbce.TilePlan(block_v=block_v),
  )


@settings(max_examples=14, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems())
def test_xla_path_equals_dense(problem):
  plan = problem.pop("plan")
  hidden, table, bias = problem.pop("hidden"), problem.pop("table"), problem.pop("bias")

  def run(backend, **extra):
    fn = lambda h, e, b: jnp.sum(cutbce.cut_bce(h, e, bias=b, backend=backend, **problem, **extra))
    return jax.jit(jax.value_and_grad(fn, argnums=(0, 1, 2)))(hidden, table, bias)

  (value, grads), (want, want_grads) = run("xla", plan=plan), run("dense")
  np.testing.assert_allclose(float(value), float(want), rtol=2e-5, atol=1e-6)
  for got, ref in zip(grads, want_grads):
    if ref is None:
      assert got is None
      continue
    scale = max(float(jnp.max(jnp.abs(ref))), 1e-6)
    np.testing.assert_allclose(np.asarray(got) / scale, np.asarray(ref) / scale, atol=1e-5)
  def ranks_of(backend, **extra):
    fn = lambda h, e, b: cutbce.target_ranks(  # noqa: E731
        h, e, problem["targets"], bias=b, exclude=problem["exclude"],
        num_items=problem["num_items"], backend=backend, **extra)
    return jax.jit(fn)(hidden, table, bias)

  ranks, want_ranks = ranks_of("xla", plan=plan), ranks_of("dense")
  np.testing.assert_array_equal(np.asarray(ranks), np.asarray(want_ranks))
