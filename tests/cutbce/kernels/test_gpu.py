"""Pallas Triton kernels (`backend="pallas_triton"`): numerics in Pallas' interpreter on CPU, the planner.

Off a GPU the kernels run in Pallas' interpreter, whose out-of-bounds reads
are NaN, so every shape here that does not divide the tiles (T, V and D all
ragged: D is padded to a power of two in registers) also checks the masks.
References: the float64 NumPy oracle (`np_reference`) and `cutbce.dense_bce`.
Compilation for H100 / H200 is in test_gpu_compile.py (needs the CUDA plugin).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend import core as jex_core
import numpy as np
import pytest

import cutbce
from cutbce import api
from cutbce.kernels import xla
from cutbce.kernels.gpu import triton as gpu_kernels
from cutbce.kernels.gpu import plan as gpu_plan
from cutbce.kernels.gpu import targets
from cutbce.kernels.tiling import TilePlan
from tests.cutbce import cases, np_reference

# T = 3 x 13 = 39 tokens in 16-row tiles (16, 16, 7); V = 1003 rows of which
# 1000 are items, in 64-row tiles (the last one ragged); D = 24 (padded to 32).
PLAN = TilePlan(block_v=64, block_t=16)
CASE = cases.Case((3, 13), 1003, 24, 4, 5, 64)
NUM_ITEMS = 1000


def _jnp(raw, dtype=jnp.float32):
  return {k: (jnp.asarray(v, dtype) if k in ("hidden", "table", "bias") else jnp.asarray(v))
          for k, v in raw.items()}


def _value_grads_stats(fn, args, **kwargs):
  """jit(value_and_grad) over hidden, table, bias, with stats as aux."""
  def loss(hidden, table, bias):
    return fn(hidden, table, args["targets"], args["weights"], bias=bias,
              exclude=args["exclude"], return_stats=True, **kwargs)

  grad_fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))
  (value, stats), grads = grad_fn(args["hidden"], args["table"], args["bias"])
  return value, stats, grads


def _assert_grads(grads, want, rtol, atol_fraction):
  for got, ref in zip(grads, want):
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got, ref, rtol=rtol, atol=atol_fraction * np.abs(ref).max())


@pytest.mark.parametrize("one_pass", [True, False])
def test_float32_loss_grads_stats_match_float64(one_pass):
  raw = cases.make_case(CASE, seed=0, logit_scale=2.0)
  args = _jnp(raw)
  kwargs = dict(num_items=NUM_ITEMS, vocab_reduction="sum")
  value, stats, grads = _value_grads_stats(cutbce.cut_bce, args, backend="pallas_triton", plan=PLAN,
                                           one_pass=one_pass, **kwargs)
  want, want_grads, want_stats = np_reference.bce(
      raw["hidden"], raw["table"], raw["targets"], raw["weights"], bias=raw["bias"],
      exclude=raw["exclude"], **kwargs)
  np.testing.assert_allclose(float(value), want, rtol=1e-6)
  _assert_grads(grads, [want_grads[k] for k in ("hidden", "table", "bias")], 1e-4, 1e-6)
  # Rows past num_items are padding: exactly zero gradient.
  assert not np.any(np.asarray(grads[1])[NUM_ITEMS:]) and not np.any(np.asarray(grads[2])[NUM_ITEMS:])
  np.testing.assert_allclose(np.array(stats), np.array(want_stats), rtol=1e-6)
  # On a GPU, jnp's float32 dots default to TF32: compare with true float32.
  with jax.default_matmul_precision("float32"):
    dense_value, dense_stats, dense_grads = _value_grads_stats(cutbce.dense_bce, args, **kwargs)
  np.testing.assert_allclose(float(value), float(dense_value), rtol=1e-6)
  _assert_grads(grads, dense_grads, 1e-4, 1e-6)
  np.testing.assert_array_equal(np.array(stats), np.array(dense_stats))


def test_bfloat16_matches_dense_and_float64_of_the_rounded_inputs():
  raw = cases.make_case(cases.Case((40,), 517, 64, 3, 2, 64), seed=1)
  args = _jnp(raw, jnp.bfloat16)
  args["weights"] = args["weights"].astype(jnp.float32)
  value, stats, grads = _value_grads_stats(cutbce.cut_bce, args, backend="pallas_triton",
                                           plan=TilePlan(block_v=128, block_t=16))
  dense_value, dense_stats, dense_grads = _value_grads_stats(cutbce.dense_bce, args)
  rounded = {k: np.asarray(args[k].astype(jnp.float32), np.float64)
             for k in ("hidden", "table", "bias")}
  want, _, _ = np_reference.bce(rounded["hidden"], rounded["table"], raw["targets"],
                                raw["weights"], bias=rounded["bias"], exclude=raw["exclude"])
  np.testing.assert_allclose(float(value), want, rtol=1e-5)
  np.testing.assert_allclose(float(value), float(dense_value), rtol=1e-5)
  assert all(g.dtype == jnp.bfloat16 for g in grads)
  # The logit gradient is rounded to bf16 before its dot, as in the XLA path.
  _assert_grads(grads, dense_grads, 2e-2, 2e-2)
  np.testing.assert_allclose(np.array(stats), np.array(dense_stats), rtol=1e-3)


VARIANTS = [
    {"logit_soft_cap": 3.0, "focal_gamma": 2.0, "focal_alpha": 0.25},
    {"pos_weight": 4.0, "label_smoothing": 0.1},
]


@pytest.mark.parametrize("options", VARIANTS, ids=["cap-focal", "pos_weight-smoothing"])
def test_loss_variants_match_float64(options):
  raw = cases.make_case(cases.Case((21,), 301, 16, 3, 2, 32), seed=2, logit_scale=3.0)
  args = _jnp(raw)
  value, _, grads = _value_grads_stats(cutbce.cut_bce, args, backend="pallas_triton",
                                       plan=TilePlan(block_v=32, block_t=16), **options)
  want, want_grads, _ = np_reference.bce(
      raw["hidden"], raw["table"], raw["targets"], raw["weights"], bias=raw["bias"],
      exclude=raw["exclude"], **options)
  np.testing.assert_allclose(float(value), want, rtol=1e-5)
  _assert_grads(grads, [want_grads[k] for k in ("hidden", "table", "bias")], 1e-4, 1e-5)


def test_reduction_none_with_an_upstream_cotangent_matches_float64():
  raw = cases.make_case(cases.Case((2, 9), 200, 20, 2, 3, 32), seed=3)
  args = _jnp(raw)
  upstream = np.random.default_rng(3).normal(size=(2, 9))

  def loss(hidden, table, bias):
    return cutbce.cut_bce(hidden, table, args["targets"], args["weights"], bias=bias,
                          exclude=args["exclude"], reduction="none", backend="pallas_triton")

  value, vjp = jax.vjp(jax.jit(loss), args["hidden"], args["table"], args["bias"])
  grads = vjp(jnp.asarray(upstream, jnp.float32))
  want, want_grads, _ = np_reference.bce(
      raw["hidden"], raw["table"], raw["targets"], raw["weights"], bias=raw["bias"],
      exclude=raw["exclude"], reduction="none", upstream=upstream)
  np.testing.assert_allclose(np.asarray(value), want, rtol=1e-5, atol=1e-7)
  _assert_grads(grads, [want_grads[k] for k in ("hidden", "table", "bias")], 1e-4, 1e-6)


def test_target_ranks_exact_in_groups_of_targets(monkeypatch):
  # Two targets per rank-kernel call: L = 5 runs as 3 calls.
  monkeypatch.setattr(gpu_kernels, "MAX_RANK_TARGETS", 2)
  raw = cases.make_case(cases.Case((3, 11), 777, 24, 5, 4, 64), seed=4)
  args = _jnp(raw)
  kwargs = dict(bias=args["bias"], exclude=args["exclude"], num_items=770, logit_soft_cap=4.0)
  got = jax.jit(lambda h, e, t: cutbce.target_ranks(h, e, t, backend="pallas_triton",
                                                    plan=PLAN, **kwargs))(
      args["hidden"], args["table"], args["targets"])
  want = np_reference.ranks(raw["hidden"], raw["table"], raw["targets"], bias=raw["bias"],
                            exclude=raw["exclude"], num_items=770, logit_soft_cap=4.0)
  np.testing.assert_array_equal(np.asarray(got), want)
  dense = cutbce.target_ranks(args["hidden"], args["table"], args["targets"], backend="dense",
                              **kwargs)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(dense))


def test_planned_tiles_and_vocab_splits_match_xla():
  # No plan: the H100 plan, clamped to T = 20 (one token tile), and the vocab
  # sweep cut into splits whose partials are summed outside.
  rng = np.random.default_rng(5)
  hidden = jnp.asarray(rng.normal(size=(20, 40)) * 0.3, jnp.float32)
  table = jnp.asarray(rng.normal(size=(1500, 40)), jnp.float32)
  bias = jnp.asarray(rng.normal(size=(1500,)), jnp.float32)
  scale = jnp.asarray(rng.random(20), jnp.float32)
  given = jnp.asarray(rng.normal(size=(1500, 40)), jnp.float32)
  given_bias = jnp.asarray(rng.normal(size=(1500,)), jnp.float32)
  geom = gpu_plan.geometry("backward", None, 20, 1500, 40, jnp.float32)
  assert geom.vocab_splits > 1 and geom.dim_padded == 64
  got = jax.jit(lambda *a: gpu_kernels.forward_backward(*a, plan=None, with_counts=True))(
      hidden, table, bias, scale, given, given_bias)
  want = xla.forward_backward(hidden, table, bias, scale, given, given_bias, plan=None,
                              with_counts=True)
  for g, w in zip(got, want):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)
  forward = jax.jit(lambda *a: gpu_kernels.forward(*a, plan=None, with_counts=True))(hidden, table, bias)
  np.testing.assert_allclose(forward[0], want[0], rtol=1e-6)
  np.testing.assert_array_equal(forward[1], want[1])


def test_mixed_dtypes_are_cast_not_refused():
  raw = cases.make_case(cases.Case((2, 5), 300, 16, 2, 2, 64), seed=6)
  hidden = jnp.asarray(raw["hidden"], jnp.bfloat16)
  table = jnp.asarray(raw["table"], jnp.float32)
  run = lambda backend: jax.value_and_grad(  # noqa: E731
      lambda h, e: cutbce.cut_bce(h, e, raw["targets"], backend=backend, plan=PLAN),
      argnums=(0, 1))(hidden, table)
  (value, (dh, de)), (want, (want_dh, want_de)) = run("pallas_triton"), run("xla")
  assert dh.dtype == jnp.bfloat16 and de.dtype == jnp.float32
  np.testing.assert_allclose(float(value), float(want), rtol=1e-6)
  np.testing.assert_allclose(np.asarray(de), np.asarray(want_de), rtol=1e-5, atol=1e-7)


def test_unsupported_inputs_and_plans_raise_not_implemented():
  hidden = jnp.ones((4, 8), jnp.float32)
  targets = jnp.zeros((4, 1), jnp.int32)
  with pytest.raises(NotImplementedError, match="float16"):
    cutbce.cut_bce(hidden.astype(jnp.float16), jnp.ones((10, 8), jnp.float16), targets,
                   backend="pallas_triton")
  with pytest.raises(NotImplementedError, match="block_v=100 is not a power of two"):
    cutbce.cut_bce(hidden, jnp.ones((10, 8)), targets, backend="pallas_triton",
                   plan=TilePlan(block_v=100))
  # D is padded to 1024: the backward's float32 [16, 1024] dh accumulator
  # alone is half of the registers the planner lets a program use.
  with pytest.raises(NotImplementedError, match="no GPU tile fits the (forward|backward) kernel at D=1000"):
    cutbce.cut_bce(jnp.ones((4, 1000)), jnp.ones((10, 1000)), targets, backend="pallas_triton")


def test_auto_never_picks_the_gpu_kernels(monkeypatch):
  flat = cutbce.inputs.flatten_inputs(jnp.ones((4, 8)), jnp.ones((10, 8)),
                                      jnp.zeros((4, 1), jnp.int32))
  assert {"pallas_gpu", "pallas_triton"} <= set(api.BACKEND_CHOICES)
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  assert api.resolve_backend("auto", flat) in ("auto", "xla")


# --------------------------------------------------------------------------- #
# The planner and the target configs.                                          #
# --------------------------------------------------------------------------- #


def test_target_configs_describe_h100_and_h200():
  h100, h200 = targets.spec("h100"), targets.spec("h200")
  assert (h100.core_count, h200.core_count) == (132, 132)
  assert h100.shared_memory_per_block_optin == 232_448 == h200.shared_memory_per_block_optin
  assert h100.device_memory_size < 80 * 2**30 < h200.device_memory_size
  assert h200.memory_bandwidth > h100.memory_bandwidth
  assert targets.spec_for_device_kind("NVIDIA H100 80GB HBM3") == h100
  assert targets.spec_for_device_kind("NVIDIA H200") == h200
  assert targets.spec_for_device_kind("Tesla T4") is None
  with pytest.raises(ValueError, match="unknown GPU target"):
    targets.spec("a100")


@pytest.mark.parametrize("dim", [50, 64, 128, 256, 512])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kernel", gpu_plan.KERNELS)
def test_planned_tiles_fit_the_device_budgets(kernel, dtype, dim):
  spec = targets.spec("h100")
  plan = gpu_plan.plan_tiles(kernel, 8192, 1_000_000, dim, dtype, spec)
  padded = gpu_plan.next_power_of_two(dim)
  assert gpu_plan.is_power_of_two(plan.block_t) and gpu_plan.is_power_of_two(plan.block_v)
  assert plan.block_t >= gpu_plan.MIN_DOT and plan.block_v >= plan.block_t
  assert (gpu_plan.live_floats(kernel, plan.block_t, plan.block_v, padded)
          <= gpu_plan.REGISTER_FRACTION * spec.registers_per_block_limit)
  assert (gpu_plan.shared_bytes(kernel, plan.block_t, plan.block_v, padded,
                                jnp.dtype(dtype).itemsize)
          <= gpu_plan.SHARED_MEMORY_FRACTION * spec.shared_memory_per_block_optin)


@pytest.mark.parametrize("tokens", [1, 20, 1000, 4096, 16_384, 100_000])
def test_vocab_splits_fill_the_sms_and_stay_bounded(tokens):
  with gpu_plan.target_gpu("h200"):
    geom = gpu_plan.geometry("backward", None, tokens, 1_000_003, 128, jnp.bfloat16)
  spec = targets.spec("h200")
  programs = geom.num_token_tiles * geom.vocab_splits
  assert programs >= min(gpu_plan.PROGRAMS_PER_CORE * spec.core_count,
                         geom.num_token_tiles * gpu_plan.MAX_VOCAB_SPLITS)
  # The [splits, T, D] dh partials: about 2 x SMs token tiles, never V.
  assert geom.vocab_splits * geom.num_token_tiles <= max(
      geom.num_token_tiles, 2 * gpu_plan.PROGRAMS_PER_CORE * spec.core_count)
  assert (geom.vocab_splits - 1) * geom.tiles_per_split < geom.num_vocab_tiles


def test_target_gpu_context_names_the_planned_device_and_restores():
  with gpu_plan.target_gpu("h200"):
    assert gpu_plan.current_spec() == targets.spec("h200")
  if jax.default_backend() != "gpu":  # on a GPU: the attached device's spec
    assert gpu_plan.current_spec() == targets.spec(targets.DEFAULT_TARGET)
  with pytest.raises(ValueError, match="unknown GPU target"):
    with gpu_plan.target_gpu("v100"):
      pass


def _kernel_dots(jaxpr):
  """The dot_general equations inside every pallas_call of `jaxpr`, nested jaxprs included."""
  dots = []

  def visit(jaxpr, in_kernel):
    for eqn in jaxpr.eqns:
      inside = in_kernel or eqn.primitive.name == "pallas_call"
      if inside and eqn.primitive.name == "dot_general":
        dots.append(eqn)
      for sub in jex_core.jaxprs_in_params(eqn.params):
        visit(sub, inside)

  visit(jaxpr.jaxpr, False)
  return dots


@pytest.mark.parametrize("fn", [cutbce.cut_bce, cutbce.cut_softmax_ce])
def test_float32_kernel_dots_are_bfloat16_pieces_never_tf32_or_fma(fn):
  """Pallas' Triton lowering makes a float32 dot without a precision TF32
  (10-bit mantissas: on an H200 the float32 loss was 5e-6 off the float64
  oracle) and one at precision HIGHEST into FMA loops (no tensor cores).
  Every dot in the kernels is on bfloat16 operands: float32 ones as six
  products of three-piece splits (`pieces.py`), exact to float32."""
  args = _jnp(cases.make_case(CASE, seed=0))

  def loss(hidden, table):
    return fn(hidden, table, args["targets"], args["weights"], exclude=args["exclude"],
              num_items=NUM_ITEMS, backend="pallas_triton", plan=PLAN)

  jaxpr = jax.make_jaxpr(jax.value_and_grad(loss, argnums=(0, 1)))(args["hidden"], args["table"])
  dots = _kernel_dots(jaxpr)
  assert len(dots) >= 3 * 6  # forward, dh and dE, six products each
  for eqn in dots:
    assert all(v.aval.dtype == jnp.bfloat16 for v in eqn.invars), eqn
    assert eqn.params["preferred_element_type"] == jnp.float32, eqn