"""The rank tie rule: ties count against the target, NaN ranks last, every path alike.

rank = 1 + #{counted v != target : x_v >= x_target}; a NaN target ranks after
every counted item. Items with identical embeddings ("twins") tie exactly,
and the tiled backends, the sharded op, the dense reference and the float64
NumPy oracle must give the same ranks for them. A dead model (zero or NaN
hidden) must score no better than chance, and no metric may exceed 1.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cutbce
from cutbce.sharding import sharded_target_ranks
from tests.cutbce import meshes, np_reference

T, D, V, L, E = 12, 16, 203, 3, 4
BLOCK_V = 32  # 203 = 6 * 32 + 11: a ragged end
# Each tiled backend with tiles that leave a ragged end (Pallas interpreted off-device).
PLANS = {
    "xla": cutbce.TilePlan(block_v=BLOCK_V),
    "pallas_tpu": cutbce.TilePlan(block_v=128, block_t=16, token_chunk=16),
    "pallas_triton": cutbce.TilePlan(block_v=64, block_t=16),
}
TILED = list(PLANS)


def _twins(dtype, seed=0):
  """Inputs whose targets each have identical rows elsewhere (also in the ragged tail)."""
  rng = np.random.default_rng(seed)
  hidden = rng.normal(size=(T, D)).astype(np.float32)
  table = rng.normal(size=(V, D)).astype(np.float32)
  bias = (0.1 * rng.normal(size=(V,))).astype(np.float32)
  # Rows 3, 40, 100, 200 (tail) are copies of row 3; 7, 71, 199 copies of row 7.
  for source, copies in ((3, (40, 100, 200)), (7, (71, 199))):
    table[list(copies)] = table[source]
    bias[list(copies)] = bias[source]
  targets = rng.integers(0, V, size=(T, L)).astype(np.int32)
  targets[:, 0] = np.where(np.arange(T) % 2, 3, 200)
  targets[:, 1] = np.where(np.arange(T) % 3, 71, 7)
  targets[0, 2] = -1
  exclude = rng.integers(-1, V, size=(T, E)).astype(np.int32)
  exclude[:, 0] = 100  # an excluded twin of a target
  cast = lambda a: jnp.asarray(a, dtype)  # noqa: E731
  return cast(hidden), cast(table), cast(bias), jnp.asarray(targets), jnp.asarray(exclude)


def _oracle(hidden, table, bias, targets, exclude):
  f64 = lambda a: np.asarray(jnp.asarray(a, jnp.float32), np.float64)  # noqa: E731
  bias = None if bias is None else f64(bias)
  return np_reference.ranks(f64(hidden), f64(table), np.asarray(targets), bias=bias,
                            exclude=None if exclude is None else np.asarray(exclude))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("backend", TILED)
def test_twins_rank_alike_on_every_path(backend, dtype):
  hidden, table, bias, targets, exclude = _twins(dtype)
  for excluded in (None, exclude):
    kwargs = dict(bias=bias, exclude=excluded)
    got = cutbce.target_ranks(hidden, table, targets, backend=backend, plan=PLANS[backend],
                              **kwargs)
    dense = cutbce.target_ranks(hidden, table, targets, backend="dense", **kwargs)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(dense))
    np.testing.assert_array_equal(np.asarray(got), _oracle(hidden, table, bias, targets, excluded))
  # A target and its three twins: the target ranks after all of them.
  assert int(dense[0, 0]) >= 4


@pytest.mark.parametrize("backend", TILED + ["dense"])
@pytest.mark.parametrize("fill", [0.0, np.nan])
def test_a_dead_model_ranks_every_target_last(backend, fill):
  _, table, _, targets, exclude = _twins(jnp.float32)
  hidden = jnp.full((T, D), fill, jnp.float32)
  plan = PLANS.get(backend)
  ranks = np.asarray(cutbce.target_ranks(hidden, table, targets, backend=backend, plan=plan))
  np.testing.assert_array_equal(ranks, _oracle(hidden, table, None, targets, None))
  assert set(np.unique(ranks)) == {0, V}  # 0: padding and repeats
  with_exclude = cutbce.target_ranks(hidden, table, targets, exclude=exclude, backend=backend,
                                     plan=plan)
  np.testing.assert_array_equal(np.asarray(with_exclude),
                                _oracle(hidden, table, None, targets, exclude))
  metrics = cutbce.rank_metrics(ranks, ks=(1, 10))
  for name in ("hit@1", "recall@1", "ndcg@1", "hit@10", "recall@10", "ndcg@10"):
    assert float(metrics[name]) == 0.0, name
  assert float(metrics["mrr"]) <= 1.0 / (V - E)


def test_a_nan_target_ranks_after_every_item_and_nan_items_after_numbers():
  hidden = jnp.ones((1, 1))
  table = jnp.array([[3.0], [np.nan], [2.0], [1.0]])
  targets = jnp.array([[2, 1]])
  for backend in ("xla", "dense"):
    ranks = cutbce.target_ranks(hidden, table, targets, backend=backend)
    # Item 2 (2.0): only 3.0 above it (NaN is not). Item 1 (NaN): after all 3 others.
    np.testing.assert_array_equal(np.asarray(ranks), [[2, 4]])
  np.testing.assert_array_equal(
      _oracle(hidden, table, jnp.zeros(4), targets, None), [[2, 4]])


@pytest.mark.parametrize("backend", ["xla", "dense"])
def test_metrics_never_exceed_one_when_targets_tie(backend):
  # Every item scores the same; several targets per row.
  rng = np.random.default_rng(1)
  hidden = jnp.asarray(rng.normal(size=(6, 4)), jnp.float32)
  table = jnp.tile(jnp.asarray(rng.normal(size=(1, 4)), jnp.float32), (30, 1))
  targets = jnp.asarray([[0, 1, 2, 3], [5, 6, -1, -1], [9, -1, -1, -1]] * 2)
  ranks = cutbce.target_ranks(hidden, table, targets, backend=backend)
  metrics = cutbce.rank_metrics(ranks, ks=(1, 2, 5, 50))
  for name, value in metrics.items():
    if name != "num_rows":
      assert 0.0 <= float(value) <= 1.0, (name, float(value))
  assert float(metrics["recall@50"]) == 1.0  # all 30 items are within 50


def test_sharded_twins_equal_dense():
  hidden, table, bias, targets, exclude = _twins(jnp.float32, seed=2)
  mesh = meshes.mesh((2, 4))
  hidden = jnp.reshape(hidden, (4, 3, D))
  targets, exclude = jnp.reshape(targets, (4, 3, L)), jnp.reshape(exclude, (4, 3, E))
  ranks = jax.jit(lambda h: sharded_target_ranks(
      h, table, targets, mesh=mesh, token_axes=("data",), vocab_axis="model", bias=bias,
      exclude=exclude, backend="xla", plan=cutbce.TilePlan(block_v=BLOCK_V)))
  for fill in (None, 0.0, np.nan):
    h = hidden if fill is None else jnp.full_like(hidden, fill)
    got = ranks(h)
    want = cutbce.target_ranks(h, table, targets, bias=bias, exclude=exclude, backend="dense")
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=str(fill))
