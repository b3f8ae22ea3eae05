"""`cut_softmax_ce` against a float64 NumPy oracle, on every backend (xla, dense,
auto, the Pallas TPU kernels in Pallas' interpreter and in TPU interpret mode,
and the Pallas GPU kernels in Pallas' interpreter, whose out-of-bounds reads
are NaN).

Shapes divide no tile (V = 1003 with block_v 128 and the default plans), rows
hold padding ids, repeats, ids past `num_items`, excluded ids (some of them
targets, which stay targets) and zero weights. Tolerances: float32 inputs,
loss to 2e-6 relative and gradients to 2e-5 of their largest entry (float32
accumulation over 1003 items); bfloat16 inputs are given to the oracle as
their bf16 values, so only the float32 arithmetic and the bf16 rounding of
the gradients differ (2^-8 relative).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import cutbce
from tests.cutbce import np_reference

T, D, V, L, E = 45, 24, 1003, 4, 7


@functools.lru_cache(maxsize=None)
def _inputs(dtype_name="float32", scale=0.5, seed=0):
  rng = np.random.default_rng(seed)
  dtype = jnp.dtype(dtype_name)
  hidden = jnp.asarray(scale * rng.normal(size=(3, T // 3, D)), dtype)
  table = jnp.asarray(scale * rng.normal(size=(V, D)), dtype)
  bias = jnp.asarray(0.3 * rng.normal(size=V), dtype)
  targets = rng.integers(-1, V + 3, size=(3, T // 3, L)).astype(np.int32)
  targets[0, 0] = [5, 5, 5, -1]  # one id, three times
  targets[0, 1] = -1  # no target: l_t = 0
  targets[0, 2] = [V - 1, V - 2, 7, 8]  # past num_items=1000 in some cases
  exclude = rng.integers(-1, V, size=(3, T // 3, E)).astype(np.int32)
  exclude[:, :, 0] = targets[:, :, 0]  # excluded targets stay targets
  weights = rng.uniform(0.5, 2.0, size=(3, T // 3)).astype(np.float32)
  weights[1, :3] = 0.0
  return hidden, table, bias, jnp.asarray(targets), jnp.asarray(exclude), jnp.asarray(weights)


def _run(backend, args, **options):
  hidden, table, bias, targets, exclude, weights = args
  use_exclude = options.pop("exclude", True)

  def loss(hidden, table, bias):
    return cutbce.cut_softmax_ce(hidden, table, targets, weights, bias=bias,
                                 exclude=exclude if use_exclude else None,
                                 return_stats=True, backend=backend, **options)

  (value, stats), grads = jax.jit(jax.value_and_grad(loss, (0, 1, 2), has_aux=True))(
      hidden, table, bias)
  return value, stats, grads


def _oracle(args, **options):
  hidden, table, bias, targets, exclude, weights = args
  use_exclude = options.pop("exclude", True)
  as64 = lambda x: np.asarray(jnp.asarray(x, jnp.float32), np.float64)  # noqa: E731
  return np_reference.softmax_ce(as64(hidden), as64(table), np.asarray(targets),
                                 np.asarray(weights), as64(bias),
                                 np.asarray(exclude) if use_exclude else None, **options)


def _check(got, want, loss_rtol, grad_rtol):
  value, stats, grads = got
  want_value, want_grads, want_counts = want
  np.testing.assert_allclose(float(value), want_value, rtol=loss_rtol, atol=loss_rtol)
  for name, g, w in zip(("dh", "dE", "db"), grads, want_grads):
    np.testing.assert_allclose(np.asarray(g, np.float64), w, rtol=grad_rtol,
                               atol=grad_rtol * np.abs(w).max(), err_msg=name)
  np.testing.assert_allclose(np.array(stats), want_counts, rtol=1e-6, err_msg="stats")


OPTIONS = [
    {},
    {"exclude": False},
    {"num_items": 1000, "label_smoothing": 0.1},
    {"target_reduction": "mean", "reduction": "sum"},
    {"target_reduction": "mean", "label_smoothing": 0.3, "num_items": 1000},
]


CASES = ([("xla", o) for o in OPTIONS] + [("dense", OPTIONS[0]), ("dense", OPTIONS[4]),
                                          ("auto", OPTIONS[2]), ("pallas_tpu", OPTIONS[0]),
                                          ("pallas_tpu", OPTIONS[4]), ("pallas_triton", OPTIONS[0]),
                                          ("pallas_triton", OPTIONS[1]), ("pallas_triton", OPTIONS[4]),
                                          ("pallas_gpu", OPTIONS[0]), ("pallas_gpu", OPTIONS[1]),
                                          ("pallas_gpu", OPTIONS[4])])


@pytest.mark.parametrize("backend,options", CASES,
                         ids=[f"{b}-" + (",".join(map(str, o.items())) or "-") for b, o in CASES])
def test_f32_matches_the_float64_oracle(backend, options):
  args = _inputs()
  _check(_run(backend, args, **dict(options)), _oracle(args, **dict(options)), 2e-6, 2e-5)


@pytest.mark.parametrize("backend", ["xla", "dense", "pallas_triton", "pallas_gpu"])
def test_bf16_matches_the_oracle_on_the_bf16_values(backend):
  args = _inputs("bfloat16")
  got = _run(backend, args, label_smoothing=0.1)
  for g, x in zip(got[2], args[:3]):
    assert g.dtype == x.dtype
  _check(got, _oracle(args, label_smoothing=0.1), 2e-6, 2**-8)


def test_tpu_kernels_in_tpu_interpret_mode_with_several_chunks_and_tiles():
  """TPU interpret mode (VMEM and the DMA pipeline simulated): 3 token chunks, 8
  vocabulary tiles with a ragged last one, sub-tiles past T skipped."""
  from cutbce.kernels import tpu  # pylint: disable=import-outside-toplevel
  args = _inputs()
  plan = cutbce.TilePlan(block_v=128, block_t=8, token_chunk=16)
  with tpu.tpu_interpret_mode():
    got = _run("pallas_tpu", args, label_smoothing=0.1, num_items=1000, plan=plan)
  _check(got, _oracle(args, label_smoothing=0.1, num_items=1000), 2e-6, 2e-5)


def test_pallas_tpu_refuses_more_excluded_ids_than_its_kernels_compare():
  from cutbce.kernels import tpu  # pylint: disable=import-outside-toplevel
  hidden, table = jnp.ones((2, 8)), jnp.ones((300, 8))
  targets, exclude = jnp.zeros((2, 1), jnp.int32), jnp.zeros((2, tpu.MAX_SOFTMAX_EXCLUDE + 1),
                                                            jnp.int32)
  with pytest.raises(NotImplementedError, match="excluded ids"):
    cutbce.cut_softmax_ce(hidden, table, targets, exclude=exclude, backend="pallas_tpu")
  want = cutbce.cut_softmax_ce(hidden, table, targets, exclude=exclude, backend="xla")
  got = cutbce.cut_softmax_ce(hidden, table, targets, exclude=exclude, backend="auto")
  assert float(got) == float(want)


def test_gpu_kernels_run_with_several_token_and_vocab_tiles():
  """3 token tiles (16, 16, 13 rows), 16 vocab tiles (the last one ragged) in
  vocab splits; the kernels are the GPU ones, not a fallback."""
  args = _inputs()
  plan = cutbce.TilePlan(block_v=64, block_t=16)
  got = _run("pallas_triton", args, label_smoothing=0.1, num_items=1000, plan=plan)
  _check(got, _oracle(args, label_smoothing=0.1, num_items=1000), 2e-6, 2e-5)
  hidden, table, bias, targets, exclude, weights = args
  jaxpr = str(jax.make_jaxpr(jax.grad(lambda h: cutbce.cut_softmax_ce(
      h, table, targets, weights, bias=bias, exclude=exclude, backend="pallas_triton",
      plan=plan)))(hidden))
  for kernel in ("softmax_forward", "softmax_dh", "softmax_de"):
    assert f"cutbce_gpu_{kernel}_bt16_bv64" in jaxpr, kernel


def test_pallas_triton_refuses_more_excluded_ids_than_its_kernels_compare():
  from cutbce.kernels.gpu import triton  # pylint: disable=import-outside-toplevel
  hidden, table = jnp.ones((2, 8)), jnp.ones((300, 8))
  targets = jnp.zeros((2, 1), jnp.int32)
  exclude = jnp.zeros((2, triton.MAX_SOFTMAX_EXCLUDE + 1), jnp.int32)
  with pytest.raises(NotImplementedError, match="excluded ids"):
    cutbce.cut_softmax_ce(hidden, table, targets, exclude=exclude, backend="pallas_triton")


def test_a_user_plan_is_honoured_and_changes_nothing():
  args = _inputs()
  want = _oracle(args, label_smoothing=0.1)
  for block_v in (128, 1000, 4096):
    got = _run("xla", args, label_smoothing=0.1, plan=cutbce.TilePlan(block_v=block_v))
    _check(got, want, 2e-6, 2e-5)


def test_extreme_logits_do_not_overflow():
  """Logits of +-1e4: the running max keeps every exponential finite."""
  args = _inputs(scale=20.0)  # |x| up to ~1e4 at D = 24
  hidden, table = args[0], args[1]
  assert float(jnp.max(jnp.abs(jnp.einsum("btd,vd->btv", hidden, table)))) > 5e3
  got = _run("xla", args, label_smoothing=0.05)
  want = _oracle(args, label_smoothing=0.05)
  assert np.isfinite(float(got[0])) and all(np.all(np.isfinite(g)) for g in got[2])
  _check(got, want, 2e-6, 2e-5)


def test_excluded_items_holding_the_mass_are_masked_not_subtracted():
  """The excluded ids have logits 60 above the rest: subtracting their share after
  the sweep would leave nothing of the softmax in float32; masking keeps it exact."""
  hidden = jnp.ones((2, 4), jnp.float32)
  table = jnp.zeros((300, 4), jnp.float32).at[:10].set(15.0)  # x = 60 for ids 0..9
  targets = jnp.array([[20], [250]])
  exclude = jnp.tile(jnp.arange(10)[None, :], (2, 1))
  loss = cutbce.cut_softmax_ce(hidden, table, targets, exclude=exclude, reduction="none",
                               backend="xla")
  np.testing.assert_allclose(np.asarray(loss), np.log(290.0), rtol=1e-6)


def test_no_target_or_no_weight_gives_zero_loss_and_gradients():
  hidden, table = jnp.ones((2, 3)), jnp.ones((5, 3))
  targets = jnp.array([[1, 2], [-1, -1]], jnp.int32)
  for weights in (jnp.array([0.0, 1.0]), jnp.zeros(2)):
    loss, grads = jax.value_and_grad(
        lambda h, e, w=weights: cutbce.cut_softmax_ce(h, e, targets, w, backend="xla"),
        argnums=(0, 1))(hidden, table)
    assert float(loss) == 0.0
    assert all(not np.any(np.asarray(g)) for g in grads)


def test_a_nan_row_of_weight_zero_changes_nothing():
  args = list(_inputs())
  hidden = args[0].at[1, 0].set(jnp.nan)  # weights[1, 0] == 0
  assert float(args[5][1, 0]) == 0.0
  got = _run("xla", (hidden, *args[1:]))
  _check(got, _oracle(args), 2e-6, 2e-5)


def test_reduction_none_keeps_the_leading_shape_and_sums_to_sum():
  hidden, table, bias, targets, exclude, weights = _inputs()
  per_position = cutbce.cut_softmax_ce(hidden, table, targets, weights, bias=bias,
                                       exclude=exclude, reduction="none", backend="xla")
  total = cutbce.cut_softmax_ce(hidden, table, targets, weights, bias=bias, exclude=exclude,
                                reduction="sum", backend="xla")
  assert per_position.shape == weights.shape
  np.testing.assert_allclose(float(jnp.sum(per_position)), float(total), rtol=1e-6)


def test_bad_options_are_refused_by_name():
  hidden, table, targets = jnp.ones((2, 3)), jnp.ones((5, 3)), jnp.zeros((2, 1), jnp.int32)
  with pytest.raises(ValueError, match="target_reduction"):
    cutbce.cut_softmax_ce(hidden, table, targets, target_reduction="max")
  with pytest.raises(ValueError, match="label_smoothing"):
    cutbce.cut_softmax_ce(hidden, table, targets, label_smoothing=1.5)
  with pytest.raises(ValueError, match="reduction"):
    cutbce.cut_softmax_ce(hidden, table, targets, reduction="avg")
  with pytest.raises(ValueError, match="backend"):
    cutbce.cut_softmax_ce(hidden, table, targets, backend="cuda")
  with pytest.raises(ValueError, match="hidden"):
    cutbce.cut_softmax_ce(jnp.ones((2, 4)), table, targets)


def test_temporaries_are_flat_in_v():
  """No [T, V] buffer: the compiled program's temp memory does not grow with V."""
  def temp(vocab):
    hidden = jax.ShapeDtypeStruct((256, 32), jnp.float32)
    table = jax.ShapeDtypeStruct((vocab, 32), jnp.float32)
    targets = jax.ShapeDtypeStruct((256, 4), jnp.int32)
    step = jax.jit(jax.grad(lambda h, e, t: cutbce.cut_softmax_ce(
        h, e, t, backend="xla", plan=cutbce.TilePlan(block_v=512)), (0, 1)))
    return step.lower(hidden, table, targets).compile().memory_analysis().temp_size_in_bytes

  small, large = temp(20_000), temp(400_000)
  # dE itself is [V, D] f32: allow it (and a few copies), never [T, V].
  assert large - small < 4 * (400_000 - 20_000) * 32 * 4, (small, large)
  assert large < 256 * 400_000 * 4 / 2, (small, large)


@settings(max_examples=8, deadline=None)
@given(tokens=st.integers(1, 9), dim=st.integers(1, 6), vocab=st.integers(2, 40),
       padding=st.integers(0, 3), labels=st.integers(1, 4), excluded=st.integers(0, 5),
       smoothing=st.sampled_from([0.0, 0.2]), mean=st.booleans(), block_v=st.integers(1, 16),
       seed=st.integers(0, 2**31 - 1))
def test_any_shape_matches_the_oracle(tokens, dim, vocab, padding, labels, excluded,
                                      smoothing, mean, block_v, seed):
  rng = np.random.default_rng(seed)
  rows = vocab + padding
  hidden = jnp.asarray(rng.normal(size=(tokens, dim)), jnp.float32)
  table = jnp.asarray(rng.normal(size=(rows, dim)), jnp.float32)
  bias = jnp.asarray(rng.normal(size=rows), jnp.float32)
  targets = jnp.asarray(rng.integers(-1, rows + 1, size=(tokens, labels)), jnp.int32)
  exclude = None
  if excluded:
    # Never every item of a row: a softmax over nothing has no value.
    exclude = jnp.asarray(rng.integers(-1, vocab, size=(tokens, min(excluded, vocab - 1))),
                          jnp.int32)
  weights = jnp.asarray(rng.choice([0.0, 0.5, 1.0, 3.0], size=tokens), jnp.float32)
  options = dict(num_items=vocab, label_smoothing=smoothing,
                 target_reduction="mean" if mean else "sum")
  # Jitted: one compile an example (op by op, eagerly, took 6x as long).
  (value, stats), grads = jax.jit(jax.value_and_grad(
      lambda h, e, b: cutbce.cut_softmax_ce(
          h, e, targets, weights, bias=b, exclude=exclude, return_stats=True, backend="xla",
          plan=cutbce.TilePlan(block_v=block_v), **options),
      (0, 1, 2), has_aux=True))(hidden, table, bias)
  want = np_reference.softmax_ce(
      np.asarray(hidden, np.float64), np.asarray(table, np.float64), np.asarray(targets),
      np.asarray(weights), np.asarray(bias, np.float64),
      None if exclude is None else np.asarray(exclude), **options)
  _check((value, stats, grads), want, 2e-5, 2e-5)


@pytest.mark.parametrize("backend", ["xla", "pallas_tpu"])
def test_the_backward_sums_the_p_of_its_unset_columns(backend):
  # `with_mass`: sum_v exp(x_tv - lse_t) over the items, not excluded, not fixed.
  from cutbce import backends  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(3)
  tokens, vocab, dim, num_items = 21, 300, 16, 290
  hidden = rng.normal(size=(tokens, dim)).astype(np.float32)
  table = rng.normal(size=(vocab, dim)).astype(np.float32)
  bias = rng.normal(size=vocab).astype(np.float32)
  exclude = rng.integers(-1, vocab, size=(tokens, 3)).astype(np.int32)
  fixed = rng.integers(-1, num_items, size=(tokens, 2)).astype(np.int32)
  log_z = rng.normal(size=tokens).astype(np.float32) + 5.0
  kernels = backends.kernel_module(backend)
  *_, mass = kernels.softmax_backward(
      hidden, table, bias, exclude, log_z, np.ones(tokens, np.float32),
      np.zeros((vocab, dim), np.float32), np.zeros(vocab, np.float32), None, fixed,
      np.zeros((tokens, 2), np.float32), plan=cutbce.TilePlan(block_v=128, block_t=8,
                                                              token_chunk=16,
                                                              vmem_limit_bytes=64 << 20),
      num_items=num_items, with_mass=True)
  x = hidden.astype(np.float64) @ table.T.astype(np.float64) + bias
  swept = np.broadcast_to(np.arange(vocab) < num_items, (tokens, vocab))
  for ids in (exclude, fixed):
    swept = swept & ~np.any(np.arange(vocab)[None, :, None] == ids[:, None, :], axis=-1)
  want = np.sum(np.where(swept, np.exp(x - log_z[:, None]), 0.0), axis=1)
  # Within 2e-6 of float64, or 1.25x the same sum's error taken densely in
  # float32 on this platform (a v5e's exp: 2.2e-6 on one row).
  x32 = jnp.dot(hidden, table.T, precision=jax.lax.Precision.HIGHEST) + bias
  dense = jnp.sum(jnp.where(swept, jnp.exp(x32 - log_z[:, None]), 0.0), axis=1)
  dense_error = np.abs(np.asarray(dense, np.float64) / want - 1.0)
  error = np.abs(np.asarray(mass, np.float64) / want - 1.0)
  assert np.all(error <= max(2e-6, 1.25 * dense_error.max())), (error.max(), dense_error.max())


def test_the_backward_normalizer_is_the_rows_max_and_the_sum_below_it():
  # p_tv = exp(x_tv - top_t) / total_t, as dense takes them (`softmax.Normalizer`).
  from cutbce import softmax  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(5)
  tokens, width, count = 9, 3, 2
  row_max = rng.normal(size=tokens).astype(np.float32) * 5
  row_sum = rng.uniform(1.0, 50.0, size=tokens).astype(np.float32)
  row_sum[3] = 0.0  # every item of the rest masked: its targets alone
  row_sum[4], row_max[4] = 0.0, np.finfo(np.float32).min  # and no target: no item at all
  targets = rng.normal(size=(tokens, width)).astype(np.float32) * 5
  targets[0, 0] = row_max[0] + 20.0  # a confident target on top
  mask = rng.random((tokens, width)) < 0.7
  mask[4] = False
  mask[3, 0] = True
  norm = softmax.normalizer(row_max, row_sum, targets, mask, count)
  x = np.where(mask[:, :count], targets[:, :count], -np.inf).astype(np.float64)
  top = np.maximum(np.where(row_sum > 0, row_max, -np.inf), x.max(axis=1))
  with np.errstate(invalid="ignore"):
    total = (np.where(row_sum > 0, row_sum * np.exp(row_max - top), 0.0)
             + np.exp(x - top[:, None]).sum(axis=1))
  live = np.isfinite(top)
  np.testing.assert_allclose(np.asarray(norm.top)[live], top[live], rtol=1e-7)
  np.testing.assert_allclose(np.asarray(norm.total)[live], total[live], rtol=2e-6)
  assert float(norm.top[4]) == np.inf and float(norm.total[4]) == 1.0  # its p: 0, not 0 / 0
  lse, _ = softmax.partition(row_max, row_sum, targets, mask, count)
  np.testing.assert_allclose(np.asarray(lse)[live], top[live] + np.log(total[live]), rtol=2e-6)


@pytest.mark.parametrize("backend", ["xla", "pallas_tpu"])
def test_a_weighted_position_without_items_or_targets_gets_zero_gradients(backend):
  # Every item excluded, no target: no softmax, l_t = 0; its backward must
  # not divide 0 by 0.
  hidden = jnp.asarray(np.random.default_rng(6).normal(size=(2, 4)), jnp.float32)
  table = jnp.asarray(np.random.default_rng(7).normal(size=(6, 4)), jnp.float32)
  targets = jnp.array([[1, 2], [-1, -1]], jnp.int32)
  exclude = jnp.array([[-1, -1, -1, -1], [0, 1, 2, 3]], jnp.int32)

  def loss(h, e, rows):
    return cutbce.cut_softmax_ce(h[rows], e, targets[rows], exclude=exclude[rows],
                                 num_items=4, reduction="sum", backend=backend)

  both = jax.grad(loss, argnums=(0, 1))(hidden, table, np.array([0, 1]))
  first = jax.grad(loss, argnums=(0, 1))(hidden, table, np.array([0]))
  assert all(np.all(np.isfinite(g)) for g in both)
  np.testing.assert_array_equal(np.asarray(both[0][1]), 0.0)
  np.testing.assert_allclose(np.asarray(both[0][0]), np.asarray(first[0][0]), rtol=1e-6)
  np.testing.assert_allclose(np.asarray(both[1]), np.asarray(first[1]), rtol=1e-6, atol=1e-7)
