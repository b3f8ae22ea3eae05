"""Mosaic GPU kernels (`backend="pallas_gpu"`): numerics in Pallas' Mosaic GPU interpreter.

Off a GPU the kernels run in the interpreter (jax 0.10.2 and 0.12), with the
few primitives it lacks replaced by their exact meaning (`mosaic_ops`).
Shapes divide no tile: T = 39 tokens (one 64-row tile, padded), D = 24
(padded to 64), V = 1003 rows of which 1000 are items, walked in 64-row
tiles over several vocab splits whose pipelines wrap their buffers more than
once, so slots, refills and masks are all exercised. References: the float64
NumPy oracle (`np_reference`) and `cutbce.dense_bce` in the same dtype.
Confident targets against float64 are in tests/cutbce/test_precision.py;
the kernels compiled for H100 / H200 in test_mosaic_compile.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cutbce
from cutbce.kernels.gpu import mosaic, mosaic_kernels, mosaic_plan, targets
from cutbce.kernels.gpu import pieces as gpu_pieces
from cutbce.kernels.gpu import plan as gpu_plan
from cutbce.kernels.tiling import TilePlan
from tests.cutbce import cases, np_reference
from tests.cutbce.kernels.test_gpu import _assert_grads, _jnp  # the Triton tests' helpers

PLAN = TilePlan(block_v=64, block_t=64)
CASE = cases.Case((3, 13), 1003, 24, 4, 5, 64)
NUM_ITEMS = 1000


def _run(fn, args, **kwargs):
  """(value, stats, (dh, dE, db)) of jit(value_and_grad), and the jaxpr's text."""
  def loss(hidden, table, bias):
    return fn(hidden, table, args["targets"], args["weights"], bias=bias,
              exclude=args["exclude"], return_stats=True, **kwargs)

  grad_fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))
  (value, stats), grads = grad_fn(args["hidden"], args["table"], args["bias"])
  jaxpr = str(jax.make_jaxpr(grad_fn)(args["hidden"], args["table"], args["bias"]))
  return value, stats, grads, jaxpr


@pytest.mark.parametrize("one_pass,plan", [(True, PLAN), (False, PLAN), (True, None)],
                         ids=["one-pass", "two-pass", "planned-32-column-tiles"])
def test_float32_matches_float64_and_runs_the_mosaic_kernels(one_pass, plan):
  raw = cases.make_case(CASE, seed=0, logit_scale=2.0)
  kwargs = dict(num_items=NUM_ITEMS, vocab_reduction="sum")
  value, stats, grads, jaxpr = _run(cutbce.cut_bce, _jnp(raw, jnp.float32),
                                    backend="pallas_gpu", plan=plan, one_pass=one_pass, **kwargs)
  # The planner's own tile for float32: 32 columns, one elementwise chunk each.
  assert ("_bv32_" in jaxpr) == (plan is None) and ("_bv64_" in jaxpr) == (plan is PLAN)
  want, want_grads, want_stats = np_reference.bce(
      raw["hidden"], raw["table"], raw["targets"], raw["weights"], bias=raw["bias"],
      exclude=raw["exclude"], **kwargs)
  # float32 on three bfloat16 pieces, six products: float32's precision.
  np.testing.assert_allclose(float(value), want, rtol=1e-6)
  _assert_grads(grads, [want_grads[k] for k in ("hidden", "table", "bias")], 1e-4, 1e-6)
  assert not np.any(np.asarray(grads[1])[NUM_ITEMS:]) and not np.any(np.asarray(grads[2])[NUM_ITEMS:])
  np.testing.assert_allclose(np.array(stats), np.array(want_stats), rtol=1e-6)
  # The Mosaic kernels ran (not the Triton ones it delegates to).
  assert "cutbce_mosaic_sweep" in jaxpr and "cutbce_mosaic_table_grad" in jaxpr
  assert "cutbce_gpu_" not in jaxpr


def test_wide_tiles_do_their_elementwise_work_in_chunks():
  """bfloat16 with 128-column sweep tiles: four 32-column chunks, each storing its part of G
  (a chunk stored over another's columns, or its loss dropped: fails). The float32 tests'
  64-column tiles are two chunks each."""
  raw = cases.make_case(CASE, seed=4, logit_scale=2.0)
  args = _jnp(raw, jnp.bfloat16)
  kwargs = dict(num_items=NUM_ITEMS)
  plan = TilePlan(block_v=128, block_t=64)
  assert len(mosaic_kernels._column_chunks(plan.block_v)) == 4
  value, stats, grads, _ = _run(cutbce.cut_bce, args, backend="pallas_gpu", plan=plan,
                                one_pass=True, **kwargs)
  dense_value, dense_stats, dense_grads, _ = _run(cutbce.dense_bce, args, **kwargs)
  np.testing.assert_allclose(float(value), float(dense_value), rtol=2e-3)
  _assert_grads(grads, dense_grads, 3e-2, 2e-2)
  np.testing.assert_allclose(np.array(stats), np.array(dense_stats), rtol=5e-3, atol=2)


def test_bfloat16_matches_dense_bfloat16():
  raw = cases.make_case(CASE, seed=1, logit_scale=2.0)
  args = _jnp(raw, jnp.bfloat16)
  kwargs = dict(num_items=NUM_ITEMS)
  value, stats, grads, _ = _run(cutbce.cut_bce, args, backend="pallas_gpu", plan=PLAN, **kwargs)
  dense_value, dense_stats, dense_grads, _ = _run(cutbce.dense_bce, args, **kwargs)
  np.testing.assert_allclose(float(value), float(dense_value), rtol=2e-3)
  _assert_grads(grads, dense_grads, 3e-2, 2e-2)
  # Counts of x > 0: logits near 0 may round either way in bfloat16.
  np.testing.assert_allclose(np.array(stats), np.array(dense_stats), rtol=5e-3, atol=2)


@pytest.mark.parametrize("consumers", [2, 1], ids=["warp-specialized", "one-warpgroup"])
def test_planned_tiles_small_catalog_and_no_bias(monkeypatch, consumers):
  """The planner's own tiles (bf16 D = 24: 128-row sweep tiles), V smaller than one tile;
  also on the one-warpgroup sweep the planner falls back to where two consumers do not fit."""
  monkeypatch.setattr(mosaic_plan, "CONSUMERS", consumers)
  assert mosaic_plan.geometry(80, 100, 24, 3).consumers == consumers
  raw = cases.make_case(cases.Case((2, 40), 100, 24, 3, 0, 64), seed=2, logit_scale=3.0)
  args = _jnp(raw, jnp.float32)
  loss = lambda h, e: cutbce.cut_bce(h, e, args["targets"], args["weights"],  # noqa: E731
                                     backend="pallas_gpu", vocab_reduction="sum")
  value, grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(args["hidden"], args["table"])
  want, want_grads, _ = np_reference.bce(raw["hidden"], raw["table"], raw["targets"],
                                         raw["weights"], vocab_reduction="sum")
  np.testing.assert_allclose(float(value), want, rtol=1e-6)
  _assert_grads(grads, [want_grads["hidden"], want_grads["table"]], 1e-4, 1e-6)


@pytest.fixture
def six_sm_gpu(monkeypatch):
  """Plans for a GPU of six SMs and 2-stage pipelines: 4 token tiles get three vocab
  splits of 6 tiles, and the table kernel walks 4 token tiles: every buffer refilled."""
  small = targets.GpuSpec(**{**targets.spec("h100").__dict__, "core_count": 6})
  monkeypatch.setattr(gpu_plan, "current_spec", lambda: small)
  monkeypatch.setattr(mosaic_plan, "MAX_STAGES", 2)


@pytest.mark.parametrize("reduction,tokens", [("none", 199), ("mean", 150)])
def test_pipelines_wrap_their_buffers(six_sm_gpu, reduction, tokens):
  """T = 199 (4 token tiles: two warp-specialized CTAs of two) or 150 (3 tiles, an odd
  number: the second CTA's second consumer has only padded tokens), 16 vocab tiles in 3
  splits: both kernels refill every slot."""
  del six_sm_gpu
  raw = cases.make_case(cases.Case((1, tokens), 1003, 24, 2, 1, 64), seed=3, logit_scale=2.0)
  args = _jnp(raw, jnp.float32)
  geom = mosaic_plan.geometry(tokens, NUM_ITEMS, 24, 3, 7, PLAN)
  assert geom.consumers == 2 and geom.num_token_blocks == 2, geom
  assert geom.vocab_splits == 3 and geom.tiles_per_split > geom.stages == 2, geom
  assert geom.num_token_tiles > geom.table_stages, geom

  def loss(backend, hidden, table, bias):
    return jnp.sum(cutbce.cut_bce(hidden, table, args["targets"], args["weights"], bias=bias,
                                  exclude=args["exclude"], reduction=reduction,
                                  num_items=NUM_ITEMS, backend=backend,
                                  plan=PLAN if backend == "pallas_gpu" else None))

  got, got_grads = jax.value_and_grad(lambda *a: loss("pallas_gpu", *a), argnums=(0, 1, 2))(
      args["hidden"], args["table"], args["bias"])
  want, want_grads = jax.value_and_grad(lambda *a: loss("xla", *a), argnums=(0, 1, 2))(
      args["hidden"], args["table"], args["bias"])
  np.testing.assert_allclose(float(got), float(want), rtol=2e-6)
  _assert_grads(got_grads, want_grads, 1e-4, 1e-6)


def test_variants_it_does_not_take_go_to_the_triton_kernels():
  raw = cases.make_case(CASE, seed=4, logit_scale=2.0)
  args = _jnp(raw, jnp.float32)
  kwargs = dict(num_items=NUM_ITEMS, logit_soft_cap=20.0, focal_gamma=2.0)
  value, _, grads, jaxpr = _run(cutbce.cut_bce, args, backend="pallas_gpu", plan=PLAN, **kwargs)
  want, _, want_grads, _ = _run(cutbce.cut_bce, args, backend="xla", **kwargs)
  assert "cutbce_gpu_dh" in jaxpr and "cutbce_mosaic" not in jaxpr
  np.testing.assert_allclose(float(value), float(want), rtol=1e-5)
  _assert_grads(grads, want_grads, 1e-4, 1e-6)


def test_affine_variants_run_on_the_mosaic_kernels():
  raw = cases.make_case(CASE, seed=5, logit_scale=2.0)
  args = _jnp(raw, jnp.float32)
  kwargs = dict(num_items=NUM_ITEMS, pos_weight=3.0, label_smoothing=0.1)
  value, stats, grads, jaxpr = _run(cutbce.cut_bce, args, backend="pallas_gpu", plan=PLAN,
                                    **kwargs)
  want, want_stats, want_grads, _ = _run(cutbce.cut_bce, args, backend="xla", **kwargs)
  assert "cutbce_mosaic_sweep" in jaxpr
  np.testing.assert_allclose(float(value), float(want), rtol=1e-5)
  _assert_grads(grads, want_grads, 1e-4, 1e-6)
  np.testing.assert_allclose(np.array(stats), np.array(want_stats), rtol=1e-6)


def test_split_pieces_reach_float32_precision():
  x = jnp.asarray(np.random.default_rng(0).normal(size=4096) * 10.0 ** np.arange(-20, 20, 10 / 1024)[:4096],
                  jnp.float32)
  pieces = gpu_pieces.split_pieces(x, 3)
  assert all(p.dtype == jnp.bfloat16 for p in pieces)
  total = sum(np.asarray(p, np.float64) for p in pieces)
  np.testing.assert_allclose(total, np.asarray(x, np.float64), rtol=2.0 ** -23, atol=0)
  # Two pieces are not enough: ~2^-16.
  two = sum(np.asarray(p, np.float64) for p in gpu_pieces.split_pieces(x, 2))
  assert np.max(np.abs(two - np.asarray(x, np.float64)) / np.abs(np.asarray(x))) > 2.0 ** -20


def test_planner_fits_shared_memory_and_registers_on_hopper():
  spec = targets.spec("h100")
  budget = mosaic_plan.SHARED_MEMORY_FRACTION * spec.shared_memory_per_block_optin
  for dim in (24, 64, 128, 192, 256):
    for pieces in (1, 3):
      try:
        geom = mosaic_plan.geometry(2048, 1_000_000, dim, pieces, 19, spec=spec)
      except ValueError as error:
        # One warpgroup's registers hold a [64, D] f32 accumulator: up to D = 192 in
        # bfloat16, 128 in float32 (whose split of G keeps a third logit tile live).
        assert dim == 256 or (pieces == 3 and dim > 128), error
        assert "float32 values per thread" in str(error), error
        continue
      assert mosaic_plan.sweep_shared_bytes(geom.block_v, geom.dim_padded, pieces, 19,
                                            geom.stages, geom.consumers) <= budget
      # Warp-specialized (two consumers) wherever their buffers fit: all sweeps but
      # float32 at D = 128, all dE kernels but that one and bfloat16 at D = 192.
      assert geom.consumers == (1 if (pieces, dim) == (3, 128) else 2), geom
      assert geom.tokens_padded % (64 * geom.consumers) == 0, geom
      assert mosaic_plan.table_shared_bytes(geom.dim_padded, pieces, 19,
                                            geom.table_stages, geom.table_consumers) <= budget
      assert geom.table_consumers == (1 if (pieces, dim) in ((3, 128), (1, 192)) else 2), geom
      # The widest tile where ptxas spilled nothing: 128 columns for bfloat16 at D <= 64,
      # 32 for float32 and D = 128; bfloat16 at D = 192 has none and takes 32 (it spills).
      want = {(1, 24): 128, (1, 64): 128, (3, 24): 32, (3, 64): 32, (1, 128): 32,
              (3, 128): 32, (1, 192): 32}[pieces, dim]
      assert geom.block_v == want, geom
      assert (mosaic_plan.sweep_registers(geom.block_v, geom.dim_padded, pieces)
              <= mosaic_plan.spill_free_values(geom.dim_padded, pieces)) == (dim != 192), geom
      assert geom.vocab_padded % (64 * geom.table_consumers) == 0, geom
      assert mosaic_plan.sweep_registers(geom.block_v, geom.dim_padded, pieces) <= (
          mosaic_plan.REGISTER_VALUES)
      assert geom.vocab_padded % geom.block_v == 0 and geom.tokens_padded % 64 == 0
      # About two consumer warpgroups per SM.
      assert geom.vocab_splits * geom.num_token_tiles >= 2 * spec.core_count, geom
  # bf16 at D = 64: 128-row tiles, the deepest pipeline.
  geom = mosaic_plan.geometry(2048, 1 << 20, 64, 1, spec=spec)
  assert (geom.block_v, geom.stages) == (128, mosaic_plan.MAX_STAGES)


def test_bad_plans_and_shapes_are_refused_with_the_reason():
  targets_ = jnp.zeros((4, 1), jnp.int32)
  with pytest.raises(NotImplementedError, match="block_t=16"):
    cutbce.cut_bce(jnp.ones((4, 8)), jnp.ones((10, 8)), targets_, backend="pallas_gpu",
                   plan=TilePlan(block_v=64, block_t=16))
  with pytest.raises(NotImplementedError, match="D <= 256"):
    cutbce.cut_bce(jnp.ones((4, 300)), jnp.ones((10, 300)), targets_, backend="pallas_gpu")
  with pytest.raises(NotImplementedError, match="float32 or bfloat16"):
    cutbce.cut_bce(jnp.ones((4, 8), jnp.float16), jnp.ones((10, 8), jnp.float16), targets_,
                   backend="pallas_gpu")
  assert mosaic.unsupported_reason(4, 10, 8, jnp.float32, jnp.float32) is None


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_softmax_runs_the_mosaic_kernels_and_wraps_the_pipelines(six_sm_gpu, dtype):
  """cut_softmax_ce on the Mosaic kernels (forward sweep, dh sweep, table kernel) against
  the XLA path: exclusion, label smoothing, padding rows, buffers refilled."""
  del six_sm_gpu
  raw = cases.make_case(cases.Case((1, 199), 1003, 24, 2, 3, 64), seed=6, logit_scale=2.0)
  args = _jnp(raw, dtype)
  kwargs = dict(num_items=NUM_ITEMS, label_smoothing=0.1)
  value, stats, grads, jaxpr = _run(cutbce.cut_softmax_ce, args, backend="pallas_gpu",
                                    plan=PLAN, **kwargs)
  want, want_stats, want_grads, _ = _run(cutbce.cut_softmax_ce, args, backend="xla", **kwargs)
  for name in ("softmax_sweep_loss", "softmax_sweep_dh", "softmax_table_grad"):
    assert f"cutbce_mosaic_{name}" in jaxpr, name
  assert "cutbce_gpu_" not in jaxpr
  if dtype == jnp.float32:
    np.testing.assert_allclose(float(value), float(want), rtol=2e-6)
    _assert_grads(grads, want_grads, 1e-4, 1e-6)
    np.testing.assert_allclose(np.array(stats), np.array(want_stats), rtol=1e-6)
  else:  # both round each gradient tile to bfloat16 for its dots, in different tiles
    np.testing.assert_allclose(float(value), float(want), rtol=1e-3)
    _assert_grads(grads, want_grads, 3e-2, 2e-2)


@pytest.mark.skipif(jax.default_backend() == "gpu" or jax.device_count() < 8,
                    reason="interpreter only, on 8 simulated devices")
def test_interpreted_in_a_shard_map_of_several_devices_runs_the_triton_kernels():
  """The Mosaic interpreter cannot run on several devices at once (its one simulated
  memory breaks, then hangs): there the Triton kernels' interpreter runs instead."""
  from cutbce.sharding import sharded_cut_bce  # pylint: disable=import-outside-toplevel
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))
  raw = cases.make_case(cases.Case((8, 5), 300, 16, 2, 0, 64), seed=7, logit_scale=2.0)
  args = _jnp(raw, jnp.float32)

  def loss(backend, hidden, table):
    return sharded_cut_bce(hidden, table, args["targets"], args["weights"], mesh=mesh,
                           token_axes=("data", "model"), vocab_axis="model", backend=backend)

  grad_fn = jax.jit(jax.value_and_grad(lambda h, e: loss("pallas_gpu", h, e), argnums=(0, 1)))
  jaxpr = str(jax.make_jaxpr(grad_fn)(args["hidden"], args["table"]))
  assert "cutbce_gpu_" in jaxpr and "cutbce_mosaic" not in jaxpr
  got, got_grads = grad_fn(args["hidden"], args["table"])
  want, want_grads = jax.jit(jax.value_and_grad(lambda h, e: loss("xla", h, e), argnums=(0, 1)))(
      args["hidden"], args["table"])
  np.testing.assert_allclose(float(got), float(want), rtol=2e-6)
  _assert_grads(got_grads, want_grads, 1e-4, 1e-6)


def test_roofline_counts_the_shared_memory_wgmma_reads():
  """Each m64nNk16 reads A (64 x 16) and B (N x 16) bfloat16 operands: at T = V = D = 64
  the sweep's 4 + 4 and the dE kernel's 4 + 4 instructions read 4 KB each; float32's
  six products six times that. 32-column tiles read more per multiply-add than 64."""
  from benchmarks import gpu_roofline  # pylint: disable=import-outside-toplevel
  assert gpu_roofline.mosaic_smem_bytes(64, 64, 64, "bfloat16", 64) == 16 * 4096
  assert gpu_roofline.mosaic_smem_bytes(64, 64, 64, "float32", 64) == 6 * 16 * 4096
  narrow, wide = (gpu_roofline.floor(backend, "h200", 2048, 1 << 20, 64, "float32")
                  for backend in ("pallas_gpu", "pallas_gpu_bv64"))
  assert narrow["smem_ms"] > wide["smem_ms"] and narrow["floor_ms"] >= narrow["gemm_ms"]
