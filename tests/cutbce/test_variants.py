"""Loss variants, `num_items`, and the op's fixes, against the float64 oracle.

Tolerances as in test_api.py: float32 loss rtol 1e-5, gradients atol 1e-4 x
max |reference|; bfloat16 at most the dense bfloat16 error plus 2e-3 (loss,
relative) / 2e-2 x max |reference| (gradients). The oracle's derivative is a
float64 central difference (error ~1e-9, far below the tolerances).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cutbce
from cutbce import variants
from tests.cutbce import np_reference
from tests.cutbce.cases import CASES, make_case

OPTION_SETS = {
    "pos_weight": dict(pos_weight=3.0),
    "label_smoothing": dict(label_smoothing=0.2),
    "smoothing_and_pos_weight": dict(pos_weight=0.5, label_smoothing=0.1),
    "soft_cap": dict(logit_soft_cap=2.5),
    "focal": dict(focal_gamma=2.0, focal_alpha=0.25),
    "focal_gamma_only": dict(focal_gamma=1.5),
    "focal_smoothed": dict(focal_gamma=2.0, label_smoothing=0.3),
    "all": dict(pos_weight=2.0, label_smoothing=0.1, logit_soft_cap=4.0, focal_gamma=2.0,
                focal_alpha=0.3),
}
# Interpret-mode Pallas is slow: one affine and one general option set.
PALLAS_OPTION_SETS = ["smoothing_and_pos_weight", "all"]
PALLAS_PLAN = cutbce.TilePlan(block_v=128, block_t=8, token_chunk=16,
                              vmem_limit_bytes=64 * 1024 * 1024)


def _plan(backend, block_v):
  if backend == "dense":
    return None
  return PALLAS_PLAN if backend == "pallas_tpu" else cutbce.TilePlan(block_v=block_v)


def _run(backend, options, *, case_name="ragged_v1003", dtype=jnp.float32, reduction="mean",
         vocab_reduction="sum", num_items=None, use_exclude=True, seed=0, data=None):
  """jax value_and_grad of cut_bce and the float64 oracle, on one case."""
  case = CASES[case_name]
  data = make_case(case, seed) if data is None else data
  cast = lambda a: jnp.asarray(a, dtype)  # noqa: E731
  exclude = data["exclude"] if use_exclude else None
  upstream = np.random.default_rng(seed + 1).normal(size=case.leading) if reduction == "none" else None

  def loss_fn(hidden, table, bias):
    loss = cutbce.cut_bce(
        hidden, table, data["targets"], jnp.asarray(data["weights"], jnp.float32), bias=bias,
        exclude=exclude, reduction=reduction, vocab_reduction=vocab_reduction,
        backend=backend, plan=_plan(backend, case.block_v), num_items=num_items, **options,
    )
    return jnp.sum(loss * upstream) if upstream is not None else loss

  value, grads = jax.jit(jax.value_and_grad(loss_fn, argnums=(0, 1, 2)))(
      cast(data["hidden"]), cast(data["table"]), cast(data["bias"]))
  rounded = {k: np.asarray(cast(data[k]).astype(jnp.float32), np.float64)
             for k in ("hidden", "table", "bias")}
  ref_loss, ref_grads, ref_stats = np_reference.bce(
      rounded["hidden"], rounded["table"], data["targets"], data["weights"],
      bias=rounded["bias"], exclude=exclude, reduction=reduction,
      vocab_reduction=vocab_reduction, upstream=upstream, num_items=num_items, **options)
  if upstream is not None:
    ref_loss = np.sum(ref_loss * upstream)
  return value, grads, ref_loss, ref_grads


def _grad_error(got, want):
  got = np.asarray(jnp.asarray(got, jnp.float32), np.float64)
  return np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30)


def _assert_matches(value, grads, ref_loss, ref_grads, value_rtol=1e-5):
  np.testing.assert_allclose(float(value), ref_loss, rtol=value_rtol)
  for got, name in zip(grads, ("hidden", "table", "bias")):
    assert _grad_error(got, ref_grads[name]) < 1e-4, name


@pytest.mark.parametrize("backend", ["xla", "dense"])
@pytest.mark.parametrize("name", sorted(OPTION_SETS))
def test_variant_matches_float64_oracle(backend, name):
  _assert_matches(*_run(backend, OPTION_SETS[name]))


@pytest.mark.parametrize("name", PALLAS_OPTION_SETS)
def test_variant_on_pallas_tpu_matches_float64_oracle(name):
  _assert_matches(*_run("pallas_tpu", OPTION_SETS[name], num_items=950))


@pytest.mark.parametrize("reduction", ["none", "sum"])
@pytest.mark.parametrize("case_name", ["flat_tokens", "tiny_tiles"])
def test_all_variants_with_other_reductions_and_cases(reduction, case_name):
  run = lambda backend: _run(backend, OPTION_SETS["all"], reduction=reduction,  # noqa: E731
                             case_name=case_name, vocab_reduction="mean")
  value, grads, ref_loss, ref_grads = run("xla")
  # "none" sums each position's loss times a random cotangent, terms of both
  # signs: on a TPU, whose float32 log1p errs by up to 2,900 ulp, that sum sat
  # 1.2e-5 from float64. The rule's bound, 1.25x dense's error on the same
  # platform, where it is larger (this CPU: 1e-5 stays).
  dense_error = abs(float(run("dense")[0]) / ref_loss - 1.0)
  _assert_matches(value, grads, ref_loss, ref_grads, value_rtol=max(1e-5, 1.25 * dense_error))


@pytest.mark.parametrize("name", ["smoothing_and_pos_weight", "all"])
def test_variant_with_num_items_matches_oracle(name):
  _assert_matches(*_run("xla", OPTION_SETS[name], num_items=777, vocab_reduction="mean"))


@pytest.mark.parametrize("name", ["label_smoothing", "all"])
def test_bfloat16_variant_error_within_dense_bfloat16_error(name):
  value, grads, ref_loss, ref_grads = _run("xla", OPTION_SETS[name], dtype=jnp.bfloat16)
  dense_value, dense_grads, _, _ = _run("dense", OPTION_SETS[name], dtype=jnp.bfloat16)
  assert all(g.dtype == jnp.bfloat16 for g in grads)
  error = abs(float(value) - ref_loss) / abs(ref_loss)
  assert error <= abs(float(dense_value) - ref_loss) / abs(ref_loss) + 2e-3
  for got, dense, key in zip(grads, dense_grads, ("hidden", "table", "bias")):
    assert _grad_error(got, ref_grads[key]) <= _grad_error(dense, ref_grads[key]) + 2e-2, key


def test_stats_keep_their_meaning_under_every_option():
  data = make_case(CASES["ragged_v1003"], seed=3)
  f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
  args = (f32(data["hidden"]), f32(data["table"]), data["targets"], f32(data["weights"]))

  def stats(**options):
    return cutbce.cut_bce(*args, bias=f32(data["bias"]), exclude=data["exclude"],
                          return_stats=True, backend="xla", **options)[1]

  plain = [float(s) for s in stats()]
  assert plain[0] > 0 and plain[1] > 0
  np.testing.assert_allclose([float(s) for s in stats(**OPTION_SETS["all"])], plain, rtol=1e-6)


def test_affine_options_add_no_tile_work():
  # Smoothing and pos_weight keep the tiles' softplus: the tiles are the
  # plain ones, the linear part is O(D) per position.
  assert variants.make_options(label_smoothing=0.2, pos_weight=2.0).is_affine
  assert not variants.make_options(logit_soft_cap=1.0).is_affine
  a, b = variants.make_options(label_smoothing=0.2, pos_weight=2.0).affine_coefficients()
  x = np.linspace(-5, 5, 11)
  np.testing.assert_allclose(a * np.logaddexp(0, x) - b * x,
                             np_reference.elementwise(x, 0, label_smoothing=0.2, pos_weight=2.0),
                             rtol=1e-12)


@pytest.mark.parametrize("options,error,match", [
    (dict(pos_weight=0.0), ValueError, "pos_weight must be > 0"),
    (dict(pos_weight=float("nan")), ValueError, "pos_weight must be finite"),
    (dict(label_smoothing=1.5), ValueError, r"label_smoothing must be in \[0, 1\]"),
    (dict(label_smoothing=None), TypeError, "label_smoothing must be a float"),
    (dict(logit_soft_cap=-1.0), ValueError, "logit_soft_cap must be > 0"),
    (dict(focal_gamma=-0.5), ValueError, "focal_gamma must be >= 0"),
    (dict(focal_alpha=2.0), ValueError, r"focal_alpha must be in \[0, 1\]"),
    (dict(focal_alpha="0.5"), TypeError, "focal_alpha must be a Python float"),
    (dict(num_items=0), ValueError, r"num_items must be in \[1, V=10\]"),
    (dict(num_items=11), ValueError, r"num_items must be in \[1, V=10\]"),
    (dict(num_items=5.0), TypeError, "num_items must be a Python int"),
])
def test_bad_option_values_raise(options, error, match):
  hidden, table = jnp.ones((2, 3, 4)), jnp.ones((10, 4))
  targets = jnp.zeros((2, 3, 2), jnp.int32)
  for fn in (cutbce.cut_bce, cutbce.dense_bce):
    with pytest.raises(error, match=match):
      fn(hidden, table, targets, **options)


# ------------------------------------------------------------- num_items --


@pytest.mark.parametrize("backend", ["xla", "pallas_tpu", "dense"])
def test_rows_past_num_items_are_padding(backend):
  case = CASES["ragged_v1003"]
  data = make_case(case, seed=2)
  num_items = 700
  table = np.array(data["table"])
  table[num_items:] *= 50.0  # padding rows hold garbage that must not matter
  f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
  plan = _plan(backend, case.block_v)

  def loss(hidden, table, bias, num_items=num_items):
    return cutbce.cut_bce(hidden, table, data["targets"], f32(data["weights"]), bias=bias,
                          exclude=data["exclude"], num_items=num_items, backend=backend,
                          plan=plan, return_stats=True, label_smoothing=0.1)

  grad = jax.jit(jax.value_and_grad(lambda *a: loss(*a)[0], argnums=(0, 1, 2)))
  value, (dh, de, db) = grad(f32(data["hidden"]), f32(table), f32(data["bias"]))
  # The same loss on the table cut to its items (ids >= num_items are padding there too).
  cut_value, (cut_dh, cut_de, cut_db) = jax.value_and_grad(
      lambda *a: loss(*a, num_items=None)[0], argnums=(0, 1, 2))(
          f32(data["hidden"]), f32(table[:num_items]), f32(data["bias"][:num_items]))
  np.testing.assert_allclose(float(value), float(cut_value), rtol=1e-6)
  np.testing.assert_allclose(np.asarray(dh), np.asarray(cut_dh), rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(np.asarray(de[:num_items]), np.asarray(cut_de), rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(np.asarray(db[:num_items]), np.asarray(cut_db), rtol=1e-5, atol=1e-7)
  assert not np.any(np.asarray(de[num_items:])) and not np.any(np.asarray(db[num_items:]))
  _, stats = loss(f32(data["hidden"]), f32(table), f32(data["bias"]))
  _, cut_stats = loss(f32(data["hidden"]), f32(table[:num_items]), f32(data["bias"][:num_items]),
                      num_items=None)
  np.testing.assert_allclose([float(s) for s in stats], [float(s) for s in cut_stats], rtol=1e-6)


@pytest.mark.parametrize("backend", ["xla", "pallas_tpu", "dense"])
def test_target_ranks_never_rank_padding_rows(backend):
  case = CASES["flat_tokens"]
  data = make_case(case, seed=4)
  num_items = 400
  table = np.array(data["table"]); table[num_items:] = 100.0  # would outrank everything
  f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
  plan = None if backend == "dense" else cutbce.TilePlan(
      block_v=128, block_t=8, token_chunk=16, vmem_limit_bytes=64 * 1024 * 1024)
  kwargs = dict(bias=f32(data["bias"]), exclude=data["exclude"], backend=backend, plan=plan)
  ranks = cutbce.target_ranks(f32(data["hidden"]), f32(table), data["targets"],
                              num_items=num_items, **kwargs)
  want = np_reference.ranks(np.asarray(f32(data["hidden"]), np.float64),
                            np.asarray(f32(table), np.float64), data["targets"],
                            bias=np.asarray(f32(data["bias"]), np.float64),
                            exclude=data["exclude"], num_items=num_items)
  np.testing.assert_array_equal(np.asarray(ranks), want)
  assert np.all(np.asarray(ranks)[np.asarray(data["targets"]) >= num_items] == 0)


@pytest.mark.parametrize("backend", ["xla", "dense"])
def test_soft_capped_ranks_match_oracle(backend):
  case = CASES["ragged_v1003"]
  data = make_case(case, seed=6)
  f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
  ranks = cutbce.target_ranks(f32(data["hidden"]), f32(data["table"]), data["targets"],
                              bias=f32(data["bias"]), exclude=data["exclude"], backend=backend,
                              logit_soft_cap=5.0, plan=_plan(backend, case.block_v))
  want = np_reference.ranks(*(np.asarray(f32(data[k]), np.float64) for k in ("hidden", "table")),
                            data["targets"], bias=np.asarray(f32(data["bias"]), np.float64),
                            exclude=data["exclude"], logit_soft_cap=5.0)
  np.testing.assert_array_equal(np.asarray(ranks), want)


# ------------------------------------------------------------------ fixes --


@pytest.mark.parametrize("backend", ["xla", "dense"])
def test_int64_ids_out_of_int32_range_are_padding(backend):
  case = CASES["one_tile"]
  data = make_case(case, seed=1)
  with jax.enable_x64(True):
    targets = np.array(data["targets"], np.int64)
    wide = targets.copy()
    wide[:, :, 0] = 2**32 + 5  # wraps to item 5 if cast before the range check
    exclude = np.array(data["exclude"], np.int64)
    exclude[:, :, 0] = 2**33 + 1
    f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
    padded = targets.copy(); padded[:, :, 0] = -1
    padded_exclude = exclude.copy(); padded_exclude[:, :, 0] = -1

    def loss(t, e):
      return float(cutbce.cut_bce(f32(data["hidden"]), f32(data["table"]), t, exclude=e,
                                  backend=backend, plan=_plan(backend, case.block_v)))

    assert loss(wide, exclude) == loss(padded, padded_exclude)
    ranks = cutbce.target_ranks(f32(data["hidden"]), f32(data["table"]), wide, backend=backend,
                                plan=_plan(backend, case.block_v))
    assert np.all(np.asarray(ranks)[:, :, 0] == 0)


@pytest.mark.parametrize("backend", ["xla", "pallas_tpu", "dense"])
def test_weight_zero_drops_a_non_finite_position_entirely(backend):
  case = CASES["ragged_v1003"]
  data = make_case(case, seed=8)
  hidden = np.array(data["hidden"], np.float32)
  weights = np.array(data["weights"], np.float32)
  weights[0, 1] = 0.0
  hidden[0, 1] = np.nan
  hidden[0, 2] = np.inf
  weights[0, 2] = 0.0
  f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731

  def run(h, reduction):
    fn = lambda h, e: jnp.sum(cutbce.cut_bce(  # noqa: E731
        h, e, data["targets"], f32(weights), exclude=data["exclude"], reduction=reduction,
        backend=backend, plan=_plan(backend, case.block_v), focal_gamma=1.0))
    return jax.value_and_grad(fn, argnums=(0, 1))(f32(h), f32(data["table"]))

  clean = hidden.copy(); clean[0, 1:3] = 0.0
  for reduction in ("mean", "none"):
    (value, (dh, de)), (want, (want_dh, want_de)) = run(hidden, reduction), run(clean, reduction)
    assert np.isfinite(float(value)) and np.all(np.isfinite(dh)) and np.all(np.isfinite(de))
    np.testing.assert_allclose(float(value), float(want), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(de), np.asarray(want_de), rtol=1e-5, atol=1e-8)
    assert not np.any(np.asarray(dh)[0, 1:3])


@pytest.mark.parametrize("backend", ["xla", "dense"])
def test_weights_get_no_gradient(backend):
  case = CASES["one_tile"]
  data = make_case(case)
  f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
  for reduction in ("mean", "sum", "none"):
    grad = jax.grad(lambda w: jnp.sum(cutbce.cut_bce(
        f32(data["hidden"]), f32(data["table"]), data["targets"], w, reduction=reduction,
        backend=backend)))(f32(data["weights"]))
    assert not np.any(np.asarray(grad)), reduction


def _lowered(fn, platform):
  return jax.jit(fn).trace(jnp.ones((4, 8))).lower(lowering_platforms=(platform,)).as_text()


def test_tiles_make_sigmoid_from_exp_of_non_positive_arguments_on_a_tpu():
  """A TPU's tiles take exp(-|x|) (the one-pass backward's form), others the platform's sigmoid.

  JAX lowers sigmoid as 1 / (1 + exp(-x)): exp of positive arguments for
  x < 0. On a TPU v5e the two-pass BCE dE that took it broke the precision
  rule where the one-pass, from exp(-|x|), kept it; on this CPU that form
  costs 3-10x the platform's.
  """
  tile = lambda x: variants.tile_grad(variants.PLAIN, x)  # noqa: E731
  assert "stablehlo.abs" in _lowered(tile, "tpu")
  assert "stablehlo.abs" not in _lowered(tile, "cpu")
  x = jnp.linspace(-80.0, 80.0, 4001)
  np.testing.assert_allclose(variants.sigmoid_from_exp(x), jax.nn.sigmoid(x), rtol=2e-6,
                             atol=0)
