"""cut_bce against the float64 oracle, on every tiled backend in the registry.

Tolerances: float32 loss rtol 1e-5; gradients atol 1e-4 x max |reference|
(relative to the largest entry). bfloat16: the error against float64 may be at
most the dense bfloat16 implementation's error plus 2e-3 (loss, relative) /
2e-2 x max |reference| (gradients).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cutbce
from cutbce import api
from tests.cutbce import np_reference
from tests.cutbce.cases import CASES, make_case

# Interpret-mode Pallas is tested in tests/cutbce/kernels; here the fast paths.
TILED_BACKENDS = ["xla"]
REDUCTIONS = ["mean", "sum", "none"]


def _run(case_name, backend, *, reduction, vocab_reduction, use_bias, use_exclude,
         dtype=jnp.float32, seed=0):
  case = CASES[case_name]
  data = make_case(case, seed)
  cast = lambda a: jnp.asarray(a, dtype)
  bias = cast(data["bias"]) if use_bias else None
  exclude = data["exclude"] if use_exclude else None
  plan = cutbce.TilePlan(block_v=case.block_v) if backend != "dense" else None
  rng = np.random.default_rng(seed + 1)
  upstream = rng.normal(size=case.leading) if reduction == "none" else None

  def loss_fn(hidden, table, bias):
    loss = cutbce.cut_bce(
        hidden, table, data["targets"], jnp.asarray(data["weights"], jnp.float32),
        bias=bias, exclude=exclude, reduction=reduction, vocab_reduction=vocab_reduction,
        backend=backend, plan=plan,
    )
    return jnp.sum(loss * upstream) if upstream is not None else loss

  value, grads = jax.value_and_grad(loss_fn, argnums=(0, 1, 2))(
      cast(data["hidden"]), cast(data["table"]), bias
  )
  ref_inputs = {k: np.asarray(jnp.asarray(v, dtype).astype(jnp.float32), np.float64)
                if k in ("hidden", "table", "bias") else v for k, v in data.items()}
  ref_loss, ref_grads, _ = np_reference.bce(
      ref_inputs["hidden"], ref_inputs["table"], data["targets"], data["weights"],
      bias=ref_inputs["bias"] if use_bias else None, exclude=exclude,
      reduction=reduction, vocab_reduction=vocab_reduction, upstream=upstream,
  )
  if upstream is not None:
    ref_loss = np.sum(ref_loss * upstream)
  return value, grads, ref_loss, ref_grads


def _grad_error(got, want):
  got = np.asarray(jnp.asarray(got, jnp.float32), np.float64)
  return np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30)


@pytest.mark.parametrize("backend", TILED_BACKENDS + ["dense"])
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("vocab_reduction", ["mean", "sum"])
def test_float32_matches_float64_reference(backend, reduction, vocab_reduction):
  value, grads, ref_loss, ref_grads = _run(
      "ragged_v1003", backend, reduction=reduction, vocab_reduction=vocab_reduction,
      use_bias=True, use_exclude=True,
  )
  assert value.dtype == jnp.float32
  np.testing.assert_allclose(float(value), ref_loss, rtol=1e-5)
  for got, name in zip(grads, ("hidden", "table", "bias")):
    assert got.dtype == jnp.float32
    assert _grad_error(got, ref_grads[name]) < 1e-4, name


@pytest.mark.parametrize("backend", TILED_BACKENDS)
@pytest.mark.parametrize("case_name", sorted(CASES))
@pytest.mark.parametrize("use_bias,use_exclude", [(False, False), (True, False), (False, True)])
def test_cases_match_float64_reference(backend, case_name, use_bias, use_exclude):
  value, grads, ref_loss, ref_grads = _run(
      case_name, backend, reduction="mean", vocab_reduction="sum",
      use_bias=use_bias, use_exclude=use_exclude,
  )
  np.testing.assert_allclose(float(value), ref_loss, rtol=1e-5)
  assert _grad_error(grads[0], ref_grads["hidden"]) < 1e-4
  assert _grad_error(grads[1], ref_grads["table"]) < 1e-4
  if use_bias:
    assert _grad_error(grads[2], ref_grads["bias"]) < 1e-4
  else:
    assert grads[2] is None


@pytest.mark.parametrize("backend", TILED_BACKENDS)
def test_bfloat16_error_within_dense_bfloat16_error(backend):
  kwargs = dict(reduction="mean", vocab_reduction="sum", use_bias=True, use_exclude=True,
                dtype=jnp.bfloat16)
  value, grads, ref_loss, ref_grads = _run("ragged_v1003", backend, **kwargs)
  dense_value, dense_grads, _, _ = _run("ragged_v1003", "dense", **kwargs)
  assert value.dtype == jnp.float32
  assert all(g.dtype == jnp.bfloat16 for g in grads)
  loss_error = abs(float(value) - ref_loss) / abs(ref_loss)
  dense_loss_error = abs(float(dense_value) - ref_loss) / abs(ref_loss)
  assert loss_error <= dense_loss_error + 2e-3
  for got, dense, name in zip(grads, dense_grads, ("hidden", "table", "bias")):
    assert _grad_error(got, ref_grads[name]) <= _grad_error(dense, ref_grads[name]) + 2e-2, name


@pytest.mark.parametrize("backend", TILED_BACKENDS + ["dense"])
def test_all_zero_weights_give_zero_loss_and_gradient(backend):
  case = CASES["ragged_v1003"]
  data = make_case(case)
  weights = jnp.zeros(case.leading)
  loss_fn = lambda h, e: cutbce.cut_bce(h, e, data["targets"], weights, backend=backend)
  value, (dh, de) = jax.value_and_grad(loss_fn, argnums=(0, 1))(
      jnp.asarray(data["hidden"], jnp.float32), jnp.asarray(data["table"], jnp.float32))
  assert float(value) == 0.0
  assert not np.any(np.asarray(dh)) and not np.any(np.asarray(de))


@pytest.mark.parametrize("backend", TILED_BACKENDS + ["dense"])
@pytest.mark.parametrize("use_exclude", [False, True])
def test_stats_match_numpy_counts(backend, use_exclude):
  case = CASES["ragged_v1003"]
  data = make_case(case, seed=3)
  exclude = data["exclude"] if use_exclude else None
  _, stats = cutbce.cut_bce(
      jnp.asarray(data["hidden"], jnp.float32), jnp.asarray(data["table"], jnp.float32),
      data["targets"], jnp.asarray(data["weights"], jnp.float32),
      bias=jnp.asarray(data["bias"], jnp.float32), exclude=exclude,
      return_stats=True, backend=backend,
      plan=cutbce.TilePlan(block_v=128) if backend != "dense" else None,
  )
  assert isinstance(stats, cutbce.Stats)
  _, _, want = np_reference.bce(
      data["hidden"], data["table"], data["targets"], data["weights"], bias=data["bias"],
      exclude=exclude,
  )
  np.testing.assert_allclose([float(s) for s in stats], want, rtol=1e-6)
  assert float(stats.tp) > 0 and float(stats.fn) > 0 and float(stats.fp) > 0


@pytest.mark.parametrize("backend", TILED_BACKENDS + ["dense"])
@pytest.mark.parametrize("case_name", ["ragged_v1003", "flat_tokens"])
def test_target_ranks_match_numpy_sort(backend, case_name):
  case = CASES[case_name]
  data = make_case(case, seed=5)
  cast = lambda a: jnp.asarray(a, jnp.float32)
  for exclude in (None, data["exclude"]):
    ranks = cutbce.target_ranks(
        cast(data["hidden"]), cast(data["table"]), data["targets"], bias=cast(data["bias"]),
        exclude=exclude, backend=backend,
        plan=cutbce.TilePlan(block_v=case.block_v) if backend != "dense" else None,
    )
    assert ranks.dtype == jnp.int32 and ranks.shape == data["targets"].shape
    want = np_reference.ranks(
        np.asarray(cast(data["hidden"]), np.float64), np.asarray(cast(data["table"]), np.float64),
        data["targets"], bias=np.asarray(cast(data["bias"]), np.float64), exclude=exclude)
    np.testing.assert_array_equal(np.asarray(ranks), want)


def test_rank_of_a_target_with_ties_and_exclusion():
  # Logits 3, 2, 2, 1, 0 for items 0..4 (hidden=[1], table=[[3],[2],[2],[1],[0]]).
  hidden = jnp.ones((1, 1))
  table = jnp.array([[3.0], [2.0], [2.0], [1.0], [0.0]])
  targets = jnp.array([[2, 4, 1, -1, 2]])
  ranks = cutbce.target_ranks(hidden, table, targets, backend="xla",
                              plan=cutbce.TilePlan(block_v=2))
  # Ties count against the target: 2 and 1 (both 2.0) rank 3rd, after item 0.
  np.testing.assert_array_equal(np.asarray(ranks), [[3, 5, 3, 0, 0]])
  ranks = cutbce.target_ranks(hidden, table, targets, exclude=jnp.array([[0, 2, 3]]),
                              backend="xla", plan=cutbce.TilePlan(block_v=2))
  # Item 0 excluded; 2 is a target so it stays; 3 excluded.
  np.testing.assert_array_equal(np.asarray(ranks), [[2, 3, 2, 0, 0]])


def test_jit_and_vmap_agree_with_eager():
  case = CASES["ragged_v1003"]
  data = make_case(case, seed=7)
  hidden = jnp.asarray(data["hidden"], jnp.float32)
  table = jnp.asarray(data["table"], jnp.float32)
  weights = jnp.asarray(data["weights"], jnp.float32)
  plan = cutbce.TilePlan(block_v=256)
  loss = functools.partial(cutbce.cut_bce, backend="xla", plan=plan, vocab_reduction="sum",
                           reduction="sum")
  eager = loss(hidden, table, data["targets"], weights)
  jitted = jax.jit(loss)(hidden, table, data["targets"], weights)
  np.testing.assert_allclose(float(jitted), float(eager), rtol=1e-6)
  per_row = jax.vmap(loss, in_axes=(0, None, 0, 0))(hidden, table, data["targets"], weights)
  np.testing.assert_allclose(float(jnp.sum(per_row)), float(eager), rtol=1e-5)
  grad_fn = jax.grad(lambda h: jnp.sum(jax.vmap(loss, in_axes=(0, None, 0, 0))(
      h, table, data["targets"], weights)))
  np.testing.assert_allclose(
      np.asarray(jax.jit(grad_fn)(hidden)),
      np.asarray(jax.grad(lambda h: loss(h, table, data["targets"], weights))(hidden)),
      rtol=1e-5, atol=1e-6)


def _intermediate_sizes(jaxpr):
  for eqn in jaxpr.eqns:
    for var in eqn.outvars:
      yield int(np.prod(var.aval.shape)) if hasattr(var.aval, "shape") else 0
    for param in eqn.params.values():
      for sub in (param if isinstance(param, (list, tuple)) else [param]):
        inner = getattr(sub, "jaxpr", None)
        if inner is not None:
          yield from _intermediate_sizes(getattr(inner, "jaxpr", inner))


@pytest.mark.parametrize("use_bias,use_exclude,return_stats", [(True, True, True), (False, False, False)])
def test_no_token_by_vocab_array_in_forward_or_backward(use_bias, use_exclude, return_stats):
  tokens, vocab, dim = 64, 1003, 8
  hidden = jnp.ones((tokens, dim)); table = jnp.ones((vocab, dim)); bias = jnp.ones((vocab,))
  targets = jnp.zeros((tokens, 4), jnp.int32); exclude = jnp.zeros((tokens, 6), jnp.int32)

  def loss_fn(h, e, b):
    out = cutbce.cut_bce(h, e, targets, bias=b if use_bias else None,
                         exclude=exclude if use_exclude else None, return_stats=return_stats,
                         backend="xla", plan=cutbce.TilePlan(block_v=128))
    return out[0] if return_stats else out

  jaxpr = jax.make_jaxpr(jax.value_and_grad(loss_fn, argnums=(0, 1, 2)))(hidden, table, bias)
  largest = max(_intermediate_sizes(jaxpr.jaxpr))
  assert largest < tokens * vocab // 4, largest
  assert largest >= vocab * dim  # sanity: the walk saw the table gradient
  dense = jax.make_jaxpr(jax.value_and_grad(lambda h, e, b: cutbce.dense_bce(h, e, targets)))(
      hidden, table, bias)
  assert max(_intermediate_sizes(dense.jaxpr)) >= tokens * vocab  # the check can fail


@pytest.mark.skipif(jax.default_backend() == "tpu", reason="off a TPU only: on one, auto is Pallas")
def test_auto_backend_runs_the_xla_path_off_tpu():
  assert api.resolve_backend("auto") == "auto"  # chosen when lowered
  case = CASES["ragged_v1003"]
  data = make_case(case)
  args = (jnp.asarray(data["hidden"], jnp.float32), jnp.asarray(data["table"], jnp.float32))
  loss = lambda backend: jax.jit(jax.value_and_grad(  # noqa: E731
      lambda h, e: cutbce.cut_bce(h, e, data["targets"], backend=backend), argnums=(0, 1)))
  (value, grads), (want, want_grads) = loss("auto")(*args), loss("xla")(*args)
  assert float(value) == float(want)
  for got, ref in zip(grads, want_grads):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))
  assert "tpu_custom_call" not in loss("auto").lower(*args).as_text()


# ---------------------------------------------------------------- bad input --


def _ok():
  return dict(hidden=jnp.ones((2, 3, 4)), table=jnp.ones((10, 4)),
              targets=jnp.zeros((2, 3, 2), jnp.int32))


@pytest.mark.parametrize("change,error,match", [
    (dict(hidden=jnp.ones((4,))), ValueError, r"hidden must have shape \[..., D\]"),
    (dict(table=jnp.ones((10, 4, 1))), ValueError, r"table must have shape \[V, D\]"),
    (dict(table=jnp.ones((10, 5))), ValueError, r"hidden D=4 .* table D=5"),
    (dict(targets=jnp.zeros((2, 4, 2), jnp.int32)), ValueError,
     r"targets leading shape \(2, 4\) != hidden leading shape \(2, 3\)"),
    (dict(targets=jnp.zeros((2, 3), jnp.int32)), ValueError, r"targets must have shape"),
    (dict(targets=jnp.zeros((2, 3, 2))), TypeError, r"targets must hold integer item ids"),
    (dict(hidden=jnp.ones((2, 3, 4), jnp.int32)), TypeError, r"hidden must be a floating"),
    (dict(weights=jnp.ones((2, 4))), ValueError, r"weights shape \(2, 4\) != hidden leading"),
    (dict(bias=jnp.ones((9,))), ValueError, r"bias must have shape \[V\]=\(10,\), got \(9,\)"),
    (dict(exclude=jnp.zeros((3, 3, 1), jnp.int32)), ValueError, r"exclude leading shape"),
    (dict(exclude=jnp.zeros((2, 3, 1), jnp.float32)), TypeError, r"exclude must hold integer"),
    (dict(reduction="avg"), ValueError, r"reduction must be one of"),
    (dict(vocab_reduction="none"), ValueError, r"vocab_reduction must be one of"),
    (dict(backend="cuda"), ValueError, r"backend must be one of"),
    (dict(plan=dict(block_v=128)), TypeError, r"plan must be a cutbce.TilePlan"),
])
def test_bad_input_raises_at_trace_time(change, error, match):
  kwargs = {**_ok(), **change}
  for fn in (cutbce.cut_bce, cutbce.dense_bce):
    if fn is cutbce.dense_bce and "backend" in change:
      continue  # dense_bce takes `backend` only for signature compatibility.
    with pytest.raises(error, match=match):
      jax.jit(lambda: fn(**kwargs))()


@pytest.mark.parametrize("kwargs", [dict(block_v=0), dict(block_v=-128), dict(block_v=128, block_t=0),
                                    dict(block_v=128, token_chunk=-1)])
def test_tile_plan_rejects_non_positive_blocks(kwargs):
  with pytest.raises(ValueError, match="must be positive"):
    cutbce.TilePlan(**kwargs)


def test_tile_plan_is_hashable_and_keyword_only():
  assert hash(cutbce.TilePlan(block_v=128)) == hash(cutbce.TilePlan(block_v=128))
  with pytest.raises(TypeError):
    cutbce.TilePlan(128)  # pylint: disable=too-many-function-args


def test_docstring_examples_run():
  import doctest
  from cutbce import metrics
  for module in (api, metrics):
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and (module is metrics or result.attempted > 0)


@pytest.mark.parametrize("op", ["cut_bce", "cut_softmax_ce"])
@pytest.mark.parametrize("backend", ["pallas_gpu", "pallas_triton"])
def test_gpu_backends_are_refused_on_a_tpu_host(op, backend, monkeypatch):
  # On a TPU the GPU kernels' interpreter would run at the TPU's precision, or
  # not lower at all (Mosaic GPU's): a clear refusal instead.
  hidden = jnp.ones((2, 3, 8), jnp.float32)
  table = jnp.ones((16, 8), jnp.float32)
  targets = jnp.zeros((2, 3, 1), jnp.int32)
  monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
  with pytest.raises(NotImplementedError, match="not on a TPU host"):
    getattr(cutbce, op)(hidden, table, targets, backend=backend)
