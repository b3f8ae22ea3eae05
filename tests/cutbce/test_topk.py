"""`cutbce.topk.top_k` against the float64 NumPy oracle (tests/cutbce/np_topk.py).

Small-integer hidden, table and bias make every logit exact in float32 and
full of ties, so scores and ids are compared exactly (ties to the smaller id);
random float inputs are compared within a tolerance, ids only where there is
no near-tie. V = 1003 divides no tile.
"""

from __future__ import annotations

import doctest

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from jax import lax

import cutbce
from cutbce import topk
from tests.cutbce import np_topk

LEADING, D, V, E = (3, 7), 5, 1003, 6
BACKENDS = ["xla", "dense"]


def integer_inputs(leading=LEADING, dim=D, vocab=V, num_exclude=E, seed=0, high=3):
  """Small-integer float32 hidden/table/bias and exclude ids of every kind."""
  rng = np.random.default_rng(seed)
  hidden = rng.integers(-high, high + 1, leading + (dim,)).astype(np.float32)
  table = rng.integers(-high, high + 1, (vocab, dim)).astype(np.float32)
  bias = rng.integers(-high, high + 1, (vocab,)).astype(np.float32)
  exclude = rng.integers(0, vocab, leading + (num_exclude,)).astype(np.int32)
  flat = exclude.reshape(-1, num_exclude)
  if num_exclude >= 4:
    flat[:, 0] = -1  # padding
    flat[0, 1], flat[1, 1] = vocab, 10**9  # out of range
    flat[:, 2] = flat[:, 3]  # repeated
  return hidden, table, bias, exclude


# --------------------------------------------------------------------------- #
# The property the running merge relies on.                                    #
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("width", [7, 228, 4196])
def test_lax_top_k_is_stable_by_position(width):
  """Equal values come out in input order, eagerly, under jit and inside a scan."""
  rng = np.random.default_rng(width)
  values = rng.integers(0, 4, (2, 16, width)).astype(np.float32)
  values[0, :3] = 1.0  # all equal
  values[1, :, ::3] = -np.inf
  k = min(100, width)
  want = np.stack([[np.lexsort((np.arange(width), -row))[:k] for row in block]
                   for block in values])
  np.testing.assert_array_equal(lax.top_k(values[0], k)[1], want[0])
  np.testing.assert_array_equal(jax.jit(lambda x: lax.top_k(x, k))(values[0])[1], want[0])
  scanned = lax.scan(lambda c, x: (c, lax.top_k(x, k)[1]), 0, jnp.asarray(values))[1]
  np.testing.assert_array_equal(scanned, want)


def test_negative_zero_ties_with_zero():
  # lax.top_k orders -0.0 below +0.0; top_k makes them tie (to the smaller id).
  hidden = jnp.array([[-1.0]])
  table = jnp.zeros((4, 1))
  bias = jnp.array([-0.0, 0.0, -0.0, 0.0])
  for backend in BACKENDS:
    for cap in (None, 2.0):
      scores, ids = topk.top_k(hidden, table, 2, bias=bias, logit_soft_cap=cap, backend=backend)
      np.testing.assert_array_equal(ids, [[0, 1]], err_msg=f"{backend} cap={cap}")


# --------------------------------------------------------------------------- #
# Exact comparisons on integer inputs.                                         #
# --------------------------------------------------------------------------- #

# (k, num_items, bias, exclude, block_v): k = "max" means num_items - E.
EXACT_CASES = [
    (1, None, False, False, 128),
    (1, None, True, True, 128),
    (17, None, True, True, 7),
    (17, 900, True, True, 128),
    (50, 900, False, True, 37),  # block_v < K: the first tile is K wide
    ("max", 900, True, True, 128),  # every eligible item, in order
    ("max", None, True, False, 4096),  # one tile wider than V
    (100, 1003, True, True, 1003),  # exactly one tile
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("k,num_items,use_bias,use_exclude,block_v", EXACT_CASES)
def test_integer_inputs_exact(backend, k, num_items, use_bias, use_exclude, block_v):
  hidden, table, bias, exclude = integer_inputs()
  bias = bias if use_bias else None
  exclude = exclude if use_exclude else None
  width = E if use_exclude else 0
  k = (num_items or V) - width if k == "max" else k
  plan = cutbce.TilePlan(block_v=block_v)
  got = topk.top_k(hidden, table, k, bias=bias, exclude=exclude, num_items=num_items,
                   backend=backend, plan=plan)
  assert got[0].shape == LEADING + (k,)
  ref = np_topk.oracle(hidden, table, bias=bias, exclude=exclude, num_items=num_items)
  np_topk.assert_top_k(got, ref, k)


def test_auto_and_pallas_tpu_run_the_tiled_path():
  hidden, table, bias, exclude = integer_inputs()
  ref = np_topk.oracle(hidden, table, bias=bias, exclude=exclude, num_items=950)
  for backend in ("auto", "pallas_tpu"):
    got = topk.top_k(hidden, table, 9, bias=bias, exclude=exclude, num_items=950,
                     backend=backend)
    np_topk.assert_top_k(got, ref, 9)


def test_padding_rows_are_never_read():
  # Rows past num_items hold NaN and +inf: never walked, never returned.
  hidden, table, bias, exclude = integer_inputs()
  table[900:] = np.nan
  bias[900:] = np.inf
  got = topk.top_k(hidden, table, 20, bias=bias, exclude=exclude, num_items=900, backend="xla",
                   plan=cutbce.TilePlan(block_v=64))
  ref = np_topk.oracle(hidden, table[:900], bias=bias[:900], exclude=exclude)
  np_topk.assert_top_k(got, ref, 20)


def test_minus_inf_scores_rank_last_but_eligible():
  # A bias of -inf bans nothing: such items come after every finite score and
  # before no excluded or padding row, ties still to the smaller id.
  hidden, table, bias, exclude = integer_inputs(vocab=40, num_exclude=4)
  bias[::3] = -np.inf
  k = 30 - 4
  got = topk.top_k(hidden, table, k, bias=bias, exclude=exclude, num_items=30, backend="xla",
                   plan=cutbce.TilePlan(block_v=8))
  ref = np_topk.oracle(hidden, table, bias=bias, exclude=exclude, num_items=30)
  np_topk.assert_top_k(got, ref, k)


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")
@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_scores_count_as_minus_inf(backend):
  """A NaN table row (a diverged item) never takes a finite item's place.

  lax.top_k alone ranks a positive NaN above +inf. Here NaN scores come after
  every finite one, as -inf, tied with the -inf items (smaller id first).
  """
  hidden, table, bias, exclude = integer_inputs(vocab=40, num_exclude=4)
  table[5] = np.nan  # NaN for every position
  table[7, 0] = np.inf  # inf * 0 is NaN, inf * -1 is -inf: mixed across positions
  bias[[2, 11]] = -np.inf
  bias[17] = np.nan
  hidden[0, 0] = np.nan  # one position whose every score is NaN
  k = 40 - 4  # past every finite score
  if backend == "dense":  # its masked rows are -inf too (see dense_top_k): no exclude here
    exclude = None
  got = topk.top_k(hidden, table, k, bias=bias, exclude=exclude, backend=backend,
                   plan=cutbce.TilePlan(block_v=8))
  np_topk.assert_top_k(got, np_topk.oracle(hidden, table, bias=bias, exclude=exclude), k)
  scores, ids = (np.asarray(a).reshape(-1, k) for a in got)
  assert not np.isnan(scores).any()
  assert (scores[0] == -np.inf).all()
  np.testing.assert_array_equal(ids[0], np.sort(ids[0]))  # all tie: id order
  for row_ids, row_scores in zip(ids[1:], scores[1:]):
    assert set(row_ids[np.isfinite(row_scores)].tolist()).isdisjoint({5, 17})
  # A small k, no exclude: the NaN items are never returned.
  small = topk.top_k(hidden[1:], table, 3, bias=bias, backend=backend,
                     plan=cutbce.TilePlan(block_v=8))
  np_topk.assert_top_k(small, np_topk.oracle(hidden[1:], table, bias=bias), 3)
  assert not {5, 17} & set(np.asarray(small[1]).ravel().tolist())


def test_soft_cap_orders_by_capped_score():
  # With c = 1, x = 9 and x = 10 round to the same capped score 1.0 in float32:
  # they tie, so the smaller id wins although its raw logit is smaller.
  hidden = jnp.array([[1.0]])
  table = jnp.array([[3.0], [9.0], [10.0], [-2.0]])
  for backend in BACKENDS:
    scores, ids = topk.top_k(hidden, table, 3, logit_soft_cap=1.0, backend=backend)
    np.testing.assert_array_equal(ids, [[1, 2, 0]], err_msg=backend)
    np.testing.assert_allclose(scores, [[1.0, 1.0, np.tanh(3.0)]], rtol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_soft_cap_integer_inputs(backend):
  hidden, table, bias, exclude = integer_inputs()
  got = topk.top_k(hidden, table, 25, bias=bias, exclude=exclude, num_items=990,
                   logit_soft_cap=7.5, backend=backend, plan=cutbce.TilePlan(block_v=100))
  ref = np_topk.oracle(hidden, table, bias=bias, exclude=exclude, num_items=990, soft_cap=7.5)
  # Equal logits give equal capped scores; distinct ones stay far apart.
  np_topk.assert_top_k(got, ref, 25, atol=1e-5)
  np.testing.assert_array_equal(got[1].reshape(-1, 25), np_topk.expected(ref, 25)[1])


@pytest.mark.parametrize("backend", BACKENDS)
def test_bfloat16_integer_inputs_exact(backend):
  hidden, table, bias, exclude = integer_inputs()
  cast = lambda x: jnp.asarray(x, jnp.bfloat16)
  got = topk.top_k(cast(hidden), cast(table), 12, bias=cast(bias), exclude=exclude,
                   backend=backend, plan=cutbce.TilePlan(block_v=256))
  ref = np_topk.oracle(hidden, table, bias=bias, exclude=exclude)
  np_topk.assert_top_k(got, ref, 12)


# --------------------------------------------------------------------------- #
# Random float inputs: tolerance, ids where there is no near-tie.             #
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("dtype,atol", [(jnp.float32, 2e-5), (jnp.bfloat16, 2e-4)])
@pytest.mark.parametrize("cap", [None, 4.0])
def test_random_inputs(dtype, atol, cap):
  rng = np.random.default_rng(1)
  hidden = jnp.asarray(rng.normal(size=LEADING + (16,)), dtype)
  table = jnp.asarray(rng.normal(size=(V, 16)) * 0.5, dtype)
  bias = jnp.asarray(rng.normal(size=(V,)) * 0.1, dtype)
  _, _, _, exclude = integer_inputs()
  got = topk.top_k(hidden, table, 33, bias=bias, exclude=exclude, num_items=999,
                   logit_soft_cap=cap, backend="xla", plan=cutbce.TilePlan(block_v=96))
  ref = np_topk.oracle(hidden, table, bias=bias, exclude=exclude, num_items=999, soft_cap=cap)
  np_topk.assert_top_k(got, ref, 33, atol=atol)


# --------------------------------------------------------------------------- #
# Transformations and memory.                                                  #
# --------------------------------------------------------------------------- #


def test_jit_and_vmap():
  hidden, table, bias, exclude = integer_inputs()
  plan = cutbce.TilePlan(block_v=128)
  fn = lambda h, ex: topk.top_k(h, table, 10, bias=bias, exclude=ex, num_items=950, plan=plan)
  want = fn(hidden, exclude)
  for got in (jax.jit(fn)(hidden, exclude), jax.vmap(fn)(hidden, exclude),
              jax.jit(jax.vmap(fn, in_axes=(1, 1), out_axes=1))(hidden, exclude)):
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])


def test_no_gradient_flows():
  hidden, table, bias, _ = integer_inputs()
  grad = jax.grad(lambda h: jnp.sum(topk.top_k(h, table, 5, bias=bias)[0]))(hidden)
  np.testing.assert_array_equal(grad, 0.0)


def test_temp_memory_is_flat_in_vocab():
  # No [T, V] array: compiled temp bytes stay far below T x V x 4.
  tokens, vocab, dim, block_v = 256, 65_536, 8, 512
  args = (jax.ShapeDtypeStruct((tokens, dim), jnp.float32),
          jax.ShapeDtypeStruct((vocab, dim), jnp.float32))
  fn = lambda h, t: topk.top_k(h, t, 100, plan=cutbce.TilePlan(block_v=block_v))
  temp = jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes
  assert temp < 8 * tokens * (block_v + 100) * 4 < tokens * vocab * 4 / 4, temp


def test_default_block_v():
  assert topk.default_block_v(2048, 1_048_576) == 4096
  assert topk.default_block_v(2048, 1003) == 1003
  assert topk.default_block_v(10**6, 10**6) == topk.TOPK_MIN_BLOCK_V
  assert topk.default_block_v(1, 10**7) == topk.TOPK_MAX_BLOCK_V


# --------------------------------------------------------------------------- #
# Bad input.                                                                   #
# --------------------------------------------------------------------------- #

_H, _T = np.zeros((2, 3, 4), np.float32), np.zeros((10, 4), np.float32)
_X = np.zeros((2, 3, 2), np.int32)

BAD_INPUTS = [
    (dict(hidden=np.zeros((4,), np.float32)), ValueError, "rank >= 2"),
    (dict(table=np.zeros((10, 4, 1), np.float32)), ValueError, r"table must have shape \[V, D\]"),
    (dict(table=np.zeros((10, 5), np.float32)), ValueError, "hidden D=4"),
    (dict(hidden=np.zeros((2, 3, 4), np.int32)), TypeError, "hidden must be a floating"),
    (dict(bias=np.zeros((9,), np.float32)), ValueError, r"bias must have shape \[V\]"),
    (dict(exclude=np.zeros((2, 4, 2), np.int32)), ValueError, r"exclude leading shape \(2, 4\)"),
    (dict(exclude=np.zeros((2, 3), np.int32)), ValueError, "exclude leading shape"),
    (dict(exclude=np.zeros((2, 3, 2), np.float32)), TypeError, "exclude must hold integer"),
    (dict(k=0), ValueError, "k=0, num_items=10, E=2"),
    (dict(k=9), ValueError, "k=9, num_items=10, E=2"),
    (dict(k=3, num_items=4), ValueError, "k=3, num_items=4, E=2"),
    (dict(k=2.0), TypeError, r"k must be a Python int .* \(2.0\)"),
    (dict(k=True), TypeError, "k must be a Python int"),
    (dict(num_items=0), ValueError, r"num_items must be in \[1, V=10\]"),
    (dict(num_items=11), ValueError, "got 11"),
    (dict(num_items=5.0), TypeError, "num_items must be a Python int"),
    (dict(logit_soft_cap=0.0), ValueError, "logit_soft_cap must be > 0"),
    (dict(logit_soft_cap=-1), ValueError, "logit_soft_cap must be > 0"),
    (dict(logit_soft_cap=float("inf")), ValueError, "logit_soft_cap must be finite"),
    (dict(logit_soft_cap="30"), TypeError, "logit_soft_cap must be a Python float"),
    (dict(backend="cuda"), ValueError, "backend must be one of"),
    (dict(plan=128), TypeError, "plan must be a cutbce.TilePlan"),
]


@pytest.mark.parametrize("override,error,match", BAD_INPUTS)
def test_bad_inputs_raise(override, error, match):
  kwargs = dict(hidden=_H, table=_T, k=3, exclude=_X)
  kwargs.update(override)
  hidden, table, k = kwargs.pop("hidden"), kwargs.pop("table"), kwargs.pop("k")
  with pytest.raises(error, match=match):
    topk.top_k(hidden, table, k, **kwargs)


def test_docstring_example_runs():
  result = doctest.testmod(topk, optionflags=doctest.ELLIPSIS)
  assert result.failed == 0 and result.attempted > 0


# --------------------------------------------------------------------------- #
# Property: random small shapes, integer values (exact ties), any tile size.   #
# --------------------------------------------------------------------------- #


@st.composite
def problems(draw):
  tokens = draw(st.integers(1, 6))
  vocab = draw(st.integers(1, 60))
  num_items = draw(st.integers(1, vocab))
  num_exclude = draw(st.integers(0, min(4, num_items - 1)))
  k = draw(st.integers(1, num_items - num_exclude))
  seed = draw(st.integers(0, 2**31 - 1))
  rng = np.random.default_rng(seed)
  dim = draw(st.integers(1, 4))
  return dict(
      hidden=rng.integers(-2, 3, (tokens, dim)).astype(np.float32),
      table=rng.integers(-2, 3, (vocab, dim)).astype(np.float32),
      k=k,
      bias=rng.integers(-2, 3, (vocab,)).astype(np.float32) if draw(st.booleans()) else None,
      exclude=(rng.integers(-2, vocab + 2, (tokens, num_exclude)).astype(np.int32)
               if num_exclude else None),
      num_items=num_items,
      logit_soft_cap=draw(st.sampled_from([None, 2.5])),
      plan=cutbce.TilePlan(block_v=draw(st.integers(1, 70))),
  )


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems())
def test_property_matches_oracle(problem):
  got = topk.top_k(**problem, backend="xla")
  ref = np_topk.oracle(problem["hidden"], problem["table"], bias=problem["bias"],
                       exclude=problem["exclude"], num_items=problem["num_items"],
                       soft_cap=problem["logit_soft_cap"])
  k = problem["k"]
  np_topk.assert_top_k(got, ref, k, atol=0 if problem["logit_soft_cap"] is None else 1e-5)
  np.testing.assert_array_equal(got[1], np_topk.expected(ref, k)[1])


def test_wide_exclude_ids_do_not_wrap_into_range():
  # 2**32 + 1 wraps to 1 in int32: it is not an item, so item 1 stays eligible.
  hidden = jnp.ones((1, 1))
  table = jnp.array([[1.0], [5.0], [3.0]])
  exclude = np.array([[2**32 + 1]], np.int64)
  for backend in BACKENDS:
    _, ids = topk.top_k(hidden, table, 1, exclude=exclude, backend=backend)
    np.testing.assert_array_equal(ids, [[1]], err_msg=backend)
