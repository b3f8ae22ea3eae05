"""`sharded_top_k` against the float64 oracle and the unsharded `top_k`.

Runs on the 8 simulated CPU devices of tests/conftest.py. V = 1003 divides no
vocab axis size, so every vocab-sharded case pads rows, and num_items < V
masks real rows too. Small-integer inputs make logits exact and full of
ties, so ids and scores are compared exactly (ties to the smaller id across
shards as well as within one).
"""

import doctest
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import cutbce
from cutbce.sharding import collective_report
from cutbce.sharding import topk as sharded_topk_module
from cutbce.sharding.topk import sharded_top_k
from cutbce.topk import top_k
from tests.cutbce import meshes, np_topk

B, N, D, V, E = 8, 3, 4, 1003, 5

# (mesh shape, token_axes, vocab_axis) for mesh axes ("data", "model").
LAYOUTS = [
    ((2, 4), ("data", "model"), "model"),
    ((2, 4), ("data",), "model"),
    ((2, 4), ("data",), None),
    ((8, 1), ("data",), None),
    ((8, 1), ("data",), "model"),
    ((8, 1), ("data", "model"), "model"),  # a vocab axis of size 1 that splits tokens
    ((1, 8), ("model",), "model"),
    ((1, 8), (), "model"),
]


def _mesh(shape, axis_type=AxisType.Auto):
  return meshes.mesh(shape, axis_types=(axis_type, axis_type))


@functools.lru_cache(maxsize=None)
def _inputs(vocab=V, num_exclude=E, seed=0):
  rng = np.random.default_rng(seed)
  hidden = rng.integers(-2, 3, (B, N, D)).astype(np.float32)
  table = rng.integers(-2, 3, (vocab, D)).astype(np.float32)
  bias = rng.integers(-2, 3, (vocab,)).astype(np.float32)
  exclude = rng.integers(-1, vocab + 3, (B, N, num_exclude)).astype(np.int32)
  exclude[..., 1] = exclude[..., 2]  # repeated
  exclude[0, 0, 0] = 10**9
  return hidden, table, bias, exclude


def _run(mesh, token_axes, vocab_axis, k, *, num_items=None, use_exclude=True,
         logit_soft_cap=None, dtype=jnp.float32, block_v=64, vocab=V):
  hidden, table, bias, exclude = _inputs(vocab)
  cast = lambda x: jnp.asarray(x, dtype)
  exclude = exclude if use_exclude else None
  fn = functools.partial(
      sharded_top_k, k=k, mesh=mesh, token_axes=token_axes, vocab_axis=vocab_axis,
      num_items=num_items, logit_soft_cap=logit_soft_cap, plan=cutbce.TilePlan(block_v=block_v),
  )
  got = jax.jit(lambda h, t, b, x: fn(h, t, bias=b, exclude=x))(
      cast(hidden), cast(table), cast(bias), exclude)
  ref = np_topk.oracle(cast(hidden), cast(table), bias=cast(bias), exclude=exclude,
                       num_items=num_items, soft_cap=logit_soft_cap)
  return got, ref


@pytest.mark.parametrize("shape,token_axes,vocab_axis", LAYOUTS[:3] + LAYOUTS[6:7])
def test_nan_rows_count_as_minus_inf_on_every_shard(shape, token_axes, vocab_axis):
  """NaN table rows never take a finite item's place, across shards, as unsharded."""
  hidden, table, bias, exclude = _inputs()
  table, bias, hidden = table.copy(), bias.copy(), hidden.copy()
  table[:130] = np.nan  # the first shard's rows and more, on 4 or 8 vocab shards
  table[500:510] = np.nan
  bias[600] = -np.inf
  hidden[1, 2] = np.nan  # a position whose every score is NaN
  for k in (17, 1003 - 140 - E + 3):  # within the finite scores, and past them
    fn = functools.partial(sharded_top_k, k=k, mesh=_mesh(shape), token_axes=token_axes,
                           vocab_axis=vocab_axis, plan=cutbce.TilePlan(block_v=64))
    got = jax.jit(lambda h, t, b, x, fn=fn: fn(h, t, bias=b, exclude=x))(
        hidden, table, bias, exclude)
    np_topk.assert_top_k(got, np_topk.oracle(hidden, table, bias=bias, exclude=exclude), k)
    unsharded = top_k(hidden, table, k, bias=bias, exclude=exclude, backend="xla")
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(unsharded[1]))


@pytest.mark.parametrize("shape,token_axes,vocab_axis", LAYOUTS)
def test_matches_oracle(shape, token_axes, vocab_axis):
  got, ref = _run(_mesh(shape), token_axes, vocab_axis, 17, num_items=950)
  assert got[0].shape == (B, N, 17)
  np_topk.assert_top_k(got, ref, 17)


@pytest.mark.parametrize("shape,token_axes,vocab_axis", [LAYOUTS[0], LAYOUTS[5]])
def test_every_eligible_item(shape, token_axes, vocab_axis):
  # k = num_items - E: each shard keeps all its rows, the merge needs them all.
  got, ref = _run(_mesh(shape), token_axes, vocab_axis, 950 - E, num_items=950, block_v=128)
  np_topk.assert_top_k(got, ref, 950 - E)


def test_whole_shards_of_padding():
  # num_items = 100 over 8 vocab shards of 126 rows: shards 1..7 hold no item.
  got, ref = _run(_mesh((1, 8)), ("model",), "model", 1, num_items=100)
  np_topk.assert_top_k(got, ref, 1)
  got, ref = _run(_mesh((1, 8)), ("model",), "model", 95, num_items=100)
  np_topk.assert_top_k(got, ref, 95)


def test_small_catalog_fewer_rows_per_shard_than_k():
  # V = 21 over 4 shards of 6 rows (3 padded), k = 12 > rows per shard.
  got, ref = _run(_mesh((2, 4)), ("data", "model"), "model", 12, vocab=21, block_v=4)
  np_topk.assert_top_k(got, ref, 12)


def test_soft_cap_bfloat16_without_exclude():
  got, ref = _run(_mesh((2, 4)), ("data", "model"), "model", 9, use_exclude=False,
                  logit_soft_cap=5.0, dtype=jnp.bfloat16)
  np_topk.assert_top_k(got, ref, 9, atol=1e-5)
  np.testing.assert_array_equal(got[1].reshape(-1, 9), np_topk.expected(ref, 9)[1])


def test_explicit_mesh():
  mesh = _mesh((2, 4), AxisType.Explicit)
  hidden, table, bias, exclude = _inputs()
  hidden_ = jax.device_put(hidden, NamedSharding(mesh, P("data")))
  fn = jax.jit(lambda h, t, b, x: sharded_top_k(
      h, t, 10, mesh=mesh, token_axes=("data", "model"), vocab_axis="model", bias=b,
      exclude=x, num_items=1000))
  scores, ids = fn(hidden_, table, bias, exclude)
  want = top_k(hidden, table, 10, bias=bias, exclude=exclude, num_items=1000, backend="xla")
  np.testing.assert_array_equal(scores, want[0])
  np.testing.assert_array_equal(ids, want[1])


def test_dense_backend_and_default_plan_agree():
  hidden, table, bias, exclude = _inputs()
  mesh = _mesh((2, 4))
  kw = dict(mesh=mesh, token_axes=("data", "model"), vocab_axis="model", bias=bias,
            exclude=exclude, num_items=990)
  tiled = jax.jit(lambda h: sharded_top_k(h, table, 7, **kw))(hidden)
  dense = sharded_top_k(hidden, table, 7, backend="dense", **kw)
  for a, b in zip(tiled, dense):
    np.testing.assert_array_equal(a, b)


def test_one_collective_after_the_loop():
  hidden, table, bias, exclude = _inputs()
  mesh = _mesh((2, 4))

  def report(token_axes, exclude):
    fn = lambda h, t, b, x: sharded_top_k(
        h, t, 10, mesh=mesh, token_axes=token_axes, vocab_axis="model", bias=b, exclude=x,
        plan=cutbce.TilePlan(block_v=64))
    text = jax.jit(fn).lower(hidden, table, bias, exclude).compile().as_text()
    return collective_report(text)

  # Vocab axis also splits tokens: all-gather hidden and exclude before the
  # walk, one all-to-all of the packed candidates after it.
  gathered = report(("data", "model"), exclude)
  assert gathered.in_loop == ()
  assert sorted(gathered.ops) == ["all-gather", "all-gather", "all-to-all"], gathered.ops
  assert report(("data", "model"), None).count == 2
  # Tokens split over data only: nothing to gather; one all-gather of candidates.
  replicated = report(("data",), exclude)
  assert replicated.in_loop == () and replicated.ops == ("all-gather",), replicated.ops


def test_bad_mesh_arguments_raise():
  hidden, table, _, _ = _inputs()
  with pytest.raises(ValueError, match="not divisible"):
    sharded_top_k(hidden[:3], table, 5, mesh=_mesh((2, 4)), token_axes=("data",))
  with pytest.raises(ValueError, match="not in the mesh"):
    sharded_top_k(hidden, table, 5, mesh=_mesh((2, 4)), vocab_axis="tensor")
  with pytest.raises(ValueError, match="k=0"):
    sharded_top_k(hidden, table, 0, mesh=_mesh((2, 4)))
  split_d = jax.device_put(table, NamedSharding(_mesh((2, 4)), P(None, "model")))
  with pytest.raises(ValueError, match="sharded along D"):
    sharded_top_k(hidden, split_d, 5, mesh=_mesh((2, 4)), vocab_axis="model")


def test_docstring_example_runs():
  result = doctest.testmod(sharded_topk_module, optionflags=doctest.ELLIPSIS)
  assert result.failed == 0 and result.attempted > 0
