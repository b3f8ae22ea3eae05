"""`sharded_cut_bce` / `sharded_target_ranks` against the unsharded XLA path.

Runs on the 8 simulated CPU devices of tests/conftest.py. V = 1003 divides no
vocab axis size, so every vocab-sharded case pads and masks rows.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

import cutbce
from cutbce.sharding import collective_report, sharded_cut_bce, sharded_target_ranks
from tests.cutbce import meshes

B, N, D, V, L, E = 8, 16, 32, 1003, 4, 6

# (mesh shape, token_axes, vocab_axis) for mesh axes ("data", "model").
LAYOUTS = [
    ((8, 1), ("data",), None),
    ((8, 1), ("data",), "model"),
    ((4, 2), ("data",), "model"),
    ((4, 2), ("data", "model"), "model"),
    ((2, 4), ("data", "model"), "model"),
    ((2, 4), ("model", "data"), "model"),
    ((1, 8), ("model",), "model"),
    ((1, 8), (), "model"),
]
BF16_LAYOUTS = [LAYOUTS[0], LAYOUTS[4], LAYOUTS[6]]


def _mesh(shape, axis_type=AxisType.Auto):
  return meshes.mesh(shape, axis_types=(axis_type, axis_type))


@functools.lru_cache(maxsize=None)
def _inputs(dtype_name, vocab=V, num_targets=L):
  dtype = jnp.dtype(dtype_name)
  keys = jax.random.split(jax.random.key(0), 6)
  hidden = (0.5 * jax.random.normal(keys[0], (B, N, D))).astype(dtype)
  table = (0.5 * jax.random.normal(keys[1], (vocab, D))).astype(dtype)
  bias = (0.1 * jax.random.normal(keys[2], (vocab,))).astype(dtype)
  targets = jax.random.randint(keys[3], (B, N, num_targets), -1, vocab)
  targets = targets.at[:, :, 1].set(targets[:, :, 0])  # repeats count once
  exclude = jax.random.randint(keys[4], (B, N, E), -1, vocab)
  exclude = exclude.at[:, :, 0].set(targets[:, :, 0])  # excluded targets stay targets
  weights = jax.random.uniform(keys[5], (B, N)).at[0].set(0.0)
  return hidden, table, bias, targets, exclude, weights


def _all_outputs(loss_fn, ranks_fn, args, num_items=None, options=()):
  """Loss, stats, (dh, dE, db) and ranks from one jitted program."""
  hidden, table, bias, targets, exclude, weights = args
  options = dict(options)
  cap = {"logit_soft_cap": options["logit_soft_cap"]} if "logit_soft_cap" in options else {}

  def run(hidden, table, bias):
    def loss(hidden, table, bias):
      return loss_fn(hidden, table, targets, weights, bias=bias, exclude=exclude,
                     return_stats=True, num_items=num_items, **options)
    (value, stats), grads = jax.value_and_grad(loss, (0, 1, 2), has_aux=True)(
        hidden, table, bias)
    ranks = ranks_fn(hidden, table, targets, bias=bias, exclude=exclude, num_items=num_items,
                     **cap)
    return value, stats, grads, ranks

  return jax.jit(run)(hidden, table, bias)


@functools.lru_cache(maxsize=None)
def _reference(dtype_name, vocab=V, num_targets=L, num_items=None, options=()):
  args = _inputs(dtype_name, vocab, num_targets)
  return _all_outputs(
      functools.partial(cutbce.cut_bce, backend="xla"),
      functools.partial(cutbce.target_ranks, backend="xla"), args, num_items, options)


def _sharded(mesh, token_axes, vocab_axis, args, num_items=None, options=()):
  kw = dict(mesh=mesh, token_axes=token_axes, vocab_axis=vocab_axis, backend="xla")
  return _all_outputs(functools.partial(sharded_cut_bce, **kw),
                      functools.partial(sharded_target_ranks, **kw), args, num_items, options)


def _assert_close(got, want, rtol):
  value, stats, grads, ranks = got
  value_ref, stats_ref, grads_ref, ranks_ref = want
  np.testing.assert_allclose(value, value_ref, rtol=rtol)
  for name, a, b in zip(stats._fields, stats, stats_ref):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-3, err_msg=f"stats.{name}")
  for name, a, b in zip(("dh", "dE", "db"), grads, grads_ref):
    assert a.dtype == b.dtype, name
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    np.testing.assert_allclose(a, b, rtol=rtol, atol=rtol * np.abs(b).max(), err_msg=name)
  np.testing.assert_array_equal(ranks, ranks_ref)


@pytest.mark.parametrize("shape,token_axes,vocab_axis", LAYOUTS)
def test_matches_unsharded_f32(shape, token_axes, vocab_axis):
  args = _inputs("float32")
  got = _sharded(_mesh(shape), token_axes, vocab_axis, args)
  _assert_close(got, _reference("float32"), rtol=1e-5)


@pytest.mark.parametrize("shape,token_axes,vocab_axis", BF16_LAYOUTS)
def test_matches_unsharded_bf16(shape, token_axes, vocab_axis):
  args = _inputs("bfloat16")
  got = _sharded(_mesh(shape), token_axes, vocab_axis, args)
  _assert_close(got, _reference("bfloat16"), rtol=2e-2)


# Every variant at once (soft cap and focal run in the tiles, smoothing and
# pos_weight outside them), and a catalog of 900 items in a 1003-row table
# whose rows past 900 hold ordinary values that must not count.
ALL_VARIANTS = (("pos_weight", 2.0), ("label_smoothing", 0.1), ("logit_soft_cap", 4.0),
                ("focal_gamma", 2.0), ("focal_alpha", 0.3))


@pytest.mark.parametrize("shape,token_axes,vocab_axis", [LAYOUTS[0], LAYOUTS[2], LAYOUTS[4],
                                                         LAYOUTS[6]])
@pytest.mark.parametrize("num_items,options", [(900, ()), (None, ALL_VARIANTS),
                                               (900, (("label_smoothing", 0.2),))])
def test_variants_and_num_items_match_unsharded(shape, token_axes, vocab_axis, num_items, options):
  args = _inputs("float32")
  got = _sharded(_mesh(shape), token_axes, vocab_axis, args, num_items, options)
  want = _reference("float32", num_items=num_items, options=options)
  _assert_close(got, want, rtol=1e-5)
  if num_items is not None:
    de, db = got[2][1], got[2][2]
    assert not np.any(np.asarray(de)[num_items:]) and not np.any(np.asarray(db)[num_items:])


def test_whole_shards_of_padding():
  # V = 5 over 8 vocab shards: shards 5..7 hold only padded rows.
  args = _inputs("float32", vocab=5, num_targets=2)
  got = _sharded(_mesh((1, 8)), (), "model", args)
  _assert_close(got, _reference("float32", vocab=5, num_targets=2), rtol=1e-5)


@pytest.mark.parametrize("reduction,vocab_reduction", [("none", "mean"), ("sum", "sum")])
def test_reductions_and_explicit_mesh(reduction, vocab_reduction):
  hidden, table, bias, targets, exclude, weights = _inputs("float32")
  mesh = _mesh((2, 4), AxisType.Explicit)
  hidden = jax.device_put(hidden, NamedSharding(mesh, P("data")))
  kw = dict(reduction=reduction, vocab_reduction=vocab_reduction, bias=bias)
  sharded = jax.jit(functools.partial(
      sharded_cut_bce, mesh=mesh, token_axes=("data", "model"), vocab_axis="model", **kw))
  want = cutbce.cut_bce(hidden, table, targets, weights, backend="xla", **kw)
  got = sharded(hidden, table, targets, weights)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
  dense = sharded_cut_bce(hidden, table, targets, weights, mesh=mesh, backend="dense", **kw)
  np.testing.assert_allclose(dense, want, rtol=1e-5, atol=1e-7)


def _fwd_bwd_report(vocab, shape, token_axes, vocab_axis):
  hidden, _, _, targets, exclude, weights = _inputs("float32")
  table = jnp.ones((vocab, D), jnp.float32)
  bias = jnp.zeros((vocab,), jnp.float32)
  kw = dict(mesh=_mesh(shape), token_axes=token_axes, vocab_axis=vocab_axis,
            backend="xla", plan=cutbce.TilePlan(block_v=128), return_stats=True)

  def loss(hidden, table, bias):
    return sharded_cut_bce(hidden, table, targets, weights, bias=bias, exclude=exclude, **kw)

  step = jax.jit(jax.value_and_grad(loss, (0, 1, 2), has_aux=True))
  return collective_report(step.lower(hidden, table, bias).compile().as_text())


@pytest.mark.parametrize("shape,token_axes,vocab_axis", [LAYOUTS[4], LAYOUTS[2]])
def test_collectives_outside_loops_and_constant_in_v(shape, token_axes, vocab_axis):
  small = _fwd_bwd_report(V, shape, token_axes, vocab_axis)
  large = _fwd_bwd_report(8 * V + 1, shape, token_axes, vocab_axis)  # padded too
  assert small.in_loop == () and large.in_loop == (), (small, large)
  assert 0 < small.count <= 12, small
  assert sorted(small.ops) == sorted(large.ops), (small, large)


def test_bad_inputs():
  hidden, table, _, targets, _, _ = _inputs("float32")
  mesh = _mesh((2, 4))
  with pytest.raises(ValueError, match=r"axis 'batch' is not in the mesh axes"):
    sharded_cut_bce(hidden, table, targets, mesh=mesh, token_axes=("batch",))
  with pytest.raises(ValueError, match=r"vocab_axis 'vocab' is not in the mesh"):
    sharded_cut_bce(hidden, table, targets, mesh=mesh, vocab_axis="vocab")
  with pytest.raises(TypeError, match=r"vocab_axis must be one mesh axis name"):
    sharded_cut_bce(hidden, table, targets, mesh=mesh, vocab_axis=("data", "model"))
  with pytest.raises(ValueError, match=r"names an axis twice"):
    sharded_cut_bce(hidden, table, targets, mesh=mesh, token_axes=("data", "data"))
  with pytest.raises(ValueError, match=r"hidden leading dim 6 .* not divisible .* size 8"):
    sharded_target_ranks(hidden[:6], table, targets[:6], mesh=mesh,
                         token_axes=("data", "model"), vocab_axis="model")
  with pytest.raises(TypeError, match=r"mesh must be a jax.sharding.Mesh"):
    sharded_cut_bce(hidden, table, targets, mesh="mesh")
  split_d = jax.device_put(table, NamedSharding(mesh, P(None, "model")))
  with pytest.raises(ValueError, match=r"table .* is sharded along D"):
    sharded_cut_bce(hidden, split_d, targets, mesh=mesh, vocab_axis="model")
  with pytest.raises(ValueError, match=r"targets leading shape"):
    sharded_cut_bce(hidden, table, targets[:, :3], mesh=mesh)
  with pytest.raises(ValueError, match=r"reduction must be one of"):
    sharded_cut_bce(hidden, table, targets, mesh=mesh, reduction="avg")


def test_collective_report_sees_loops():
  mesh = _mesh((8, 1))

  def local(x):
    return jax.lax.fori_loop(0, 3, lambda i, c: jax.lax.psum(c, "data") * 0.5, x)

  looped = jax.jit(jax.shard_map(
      local, mesh=mesh, in_specs=P("data"), out_specs=P("data"), check_vma=False))
  report = collective_report(looped.lower(jnp.ones((8, 4))).compile().as_text())
  assert report.in_loop == ("all-reduce",), report
