"""The TPU tile planner: legal blocks under the VMEM budget for every chip and shape."""

from __future__ import annotations

import itertools

import jax.numpy as jnp
import pytest

import cutbce
from cutbce.kernels import tiling
from cutbce.kernels.tiling import TilePlan

CHIPS = ("v4", "v5e", "v5p", "v6e")
TOKENS = (256, 4096, 65_536)
VOCABS = (1_000, 876_939, 10_000_000)
DIMS = (64, 128, 512)
DTYPES = (jnp.float32, jnp.bfloat16)


@pytest.mark.parametrize("chip", CHIPS)
def test_plans_are_legal_and_fit_the_budget(chip):
  spec = tiling.chip_spec(chip)
  mxu = spec.mxu_column_size
  for tokens, vocab, dim, dtype in itertools.product(TOKENS, VOCABS, DIMS, DTYPES):
    plan = cutbce.plan_tiles(tokens, vocab, dim, dtype, chip=chip)
    where = f"{chip} T={tokens} V={vocab} D={dim} {jnp.dtype(dtype)}: {plan}"
    itemsize = jnp.dtype(dtype).itemsize
    assert plan.block_v % mxu == 0 and plan.block_t % mxu == 0, where
    assert plan.block_v % tiling.LANES == 0, where  # lane rule for [1, block_v] and [block_v, D]
    assert plan.token_chunk % plan.block_t == 0, where
    assert plan.token_chunk % tiling.sublane_rows(itemsize) == 0, where
    assert plan.block_v <= max(mxu, -(-vocab // mxu) * mxu), where
    assert plan.token_chunk <= -(-tokens // plan.block_t) * plan.block_t, where
    assert 4 * plan.block_t * plan.block_v <= tiling.MAX_LOGIT_TILE_BYTES, where
    assert plan.vmem_limit_bytes <= spec.vmem_capacity_bytes, where
    assert tiling.plan_vmem_bytes(plan, dim, itemsize) <= plan.vmem_limit_bytes, where


def test_one_chunk_at_the_paper_shape_on_v5e_and_v6e():
  # 4,096 tokens per chip fit VMEM whole: the table is read once per pass.
  for chip in ("v5e", "v6e"):
    plan = cutbce.plan_tiles(4096, 876_939, 128, jnp.bfloat16, chip=chip)
    assert plan.token_chunk == 4096


def test_large_token_counts_are_chunked():
  plan = cutbce.plan_tiles(65_536, 876_939, 512, jnp.float32, chip="v4")
  assert plan.token_chunk < 65_536


def test_chip_spec_comes_from_jax():
  from jax.experimental.pallas import tpu as pltpu
  info = pltpu.get_tpu_info_for_chip(pltpu.ChipVersion("v6e"), 1)
  spec = tiling.chip_spec("v6e")
  assert spec.vmem_capacity_bytes == info.vmem_capacity_bytes
  assert spec.mxu_column_size == info.mxu_column_size == 256
  assert tiling.chip_spec("v5e").mxu_column_size == 128
  # The built-in table agrees with jax where both know a chip.
  for chip in CHIPS:
    fallback, reported = tiling._FALLBACK_CHIPS[chip], tiling.chip_spec(chip)
    assert fallback.vmem_capacity_bytes == reported.vmem_capacity_bytes
    assert fallback.mxu_column_size == reported.mxu_column_size


def test_estimate_grows_with_every_tile_size():
  # A chunk of several block_t sub-tiles (a loop in the kernel) before and after.
  base = dict(token_chunk=2048, block_t=256, block_v=512, dim=128, itemsize=2)
  for kernel in ("forward", "backward", "ranks"):
    small = tiling.vmem_estimate(kernel, **base)
    for name in ("token_chunk", "block_t", "block_v", "dim", "itemsize"):
      bigger = dict(base, **{name: base[name] * 2})
      assert tiling.vmem_estimate(kernel, **bigger) > small, (kernel, name)


def test_estimate_counts_blocks_fixed_over_the_grid_once():
  # One chunk of every token: its blocks never change, Mosaic keeps one buffer.
  plan = dict(token_chunk=4096, block_t=256, block_v=4096, dim=128, itemsize=2)
  for kernel in ("forward", "ranks"):
    two = tiling.vmem_estimate(kernel, **plan, num_tokens=8192)
    one = tiling.vmem_estimate(kernel, **plan, num_tokens=4096)
    assert one < two == tiling.vmem_estimate(kernel, **plan), kernel
  # The backward runs one call per chunk: its token blocks are fixed within each.
  assert (tiling.vmem_estimate("backward", **plan, num_tokens=8192)
          == tiling.vmem_estimate("backward", **plan, num_tokens=4096))
  # A chunk of one sub-tile is straight-line code: the forward's logits stay in registers.
  unrolled = tiling.vmem_estimate("forward", **dict(plan, token_chunk=256))
  looped = tiling.vmem_estimate("forward", **dict(plan, token_chunk=512))
  assert looped - unrolled > tiling.buffer_bytes(256, 4096, 4)


def test_no_plan_fits_names_chip_shapes_and_budget():
  with pytest.raises(ValueError, match=r"chip v4: T=4096, V=1000, D=200000.*MiB.*budget is 14\.0 MiB"):
    cutbce.plan_tiles(4096, 1000, 200_000, jnp.float32, chip="v4")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(num_tokens=0, vocab=10, dim=8, dtype=jnp.float32), "num_tokens"),
        (dict(num_tokens=8, vocab=10, dim=8, dtype=jnp.float16), "float32 or bfloat16"),
        (dict(num_tokens=8, vocab=10, dim=8, dtype=jnp.float32, chip="v9z"), "chip must be one of"),
    ],
)
def test_bad_arguments(kwargs, message):
  with pytest.raises(ValueError, match=message):
    cutbce.plan_tiles(**kwargs)


def test_plan_is_a_static_hashable_value():
  plan = cutbce.plan_tiles(1000, 5000, 64, jnp.float32, chip="v5e")
  assert hash(plan) == hash(TilePlan(block_v=plan.block_v, block_t=plan.block_t,
                                     token_chunk=plan.token_chunk,
                                     vmem_limit_bytes=plan.vmem_limit_bytes))


def test_each_kernel_plans_for_itself():
  # A training call is not sized for the rank kernel's 128-lane target blocks.
  tokens, vocab, dim = 65_536, 876_939, 256
  shared = tiling.plan_tiles(tokens, vocab, dim, "bfloat16", chip="v5e")
  forward = tiling.plan_tiles(tokens, vocab, dim, "bfloat16", chip="v5e", kernel="forward")
  ranks = tiling.plan_tiles(tokens, vocab, dim, "bfloat16", chip="v5e", kernel="ranks",
                            num_targets=8)
  chunks = lambda plan: -(-tokens // plan.token_chunk)  # noqa: E731
  assert chunks(forward) <= chunks(shared) and chunks(ranks) <= chunks(shared)
  # The room the backward's blocks would take goes to fewer chunks or wider tiles.
  order = lambda plan: (chunks(plan), -plan.block_t * plan.block_v)  # noqa: E731
  assert order(forward) < order(shared)
  budget = tiling.vmem_budget(tiling.chip_spec("v5e"))
  assert tiling.plan_vmem_bytes(forward, dim, 2, kernels=("forward",), num_tokens=tokens) <= budget
  with pytest.raises(ValueError, match="kernel must be one of"):
    tiling.plan_tiles(tokens, vocab, dim, "bfloat16", kernel="sideways")


def test_xla_tile_depends_on_the_platform():
  cpu = tiling.default_xla_block_v(2048, 10_000_000, platform="cpu")
  gpu = tiling.default_xla_block_v(2048, 10_000_000, platform="gpu")
  assert cpu == 256 and gpu == 4096
  assert tiling.default_xla_block_v(2048, 1000, platform="tpu") == 1000


@pytest.mark.parametrize("chip", ("v4", "v5e", "v5p", "v6e", "7x"))
def test_token_chunks_are_balanced(chip):
  # As many chunks as the largest chunk that fits gives, of equal size: no
  # chunk is padded by a block_t tile or more, and none holds more VMEM.
  for tokens, dim, dtype in itertools.product((1000, 20_000, 65_536, 100_003), (128, 512),
                                              ("bfloat16", "float32")):
    for kernel in ("forward", "backward"):
      plan = cutbce.plan_tiles(tokens, 876_939, dim, dtype, chip=chip, kernel=kernel)
      chunks = -(-tokens // plan.token_chunk)
      where = f"{chip} T={tokens} D={dim} {dtype} {kernel}: {plan}"
      assert chunks * plan.token_chunk - tokens < chunks * plan.block_t, where
      assert plan.token_chunk % plan.block_t == 0, where
  assert tiling.balanced_chunk(65_536, 34_560, 256) == 32_768
  assert tiling.balanced_chunk(1000, 1024, 256) == 1024
  assert tiling.balanced_chunk(5000, 2048, 256) == 1792  # 3 chunks of 1,792, not 2,048 + 2,048 + 904


def test_the_time_model_weighs_grid_steps_against_table_sweeps():
  """TPU7x backward, T = 16,384, V = 10M, D = 64, bf16: one chunk needs 256 x 256 tiles
  (39,063 grid steps); the model prefers wider tiles in two chunks, and the planner
  takes them (the fewest-chunk rule took the first)."""
  spec, args = tiling.chip_spec("7x"), (16_384, 10_000_019, 64, 2)
  one_chunk = tiling.TilePlan(block_t=256, block_v=256, token_chunk=16_384)
  seconds = lambda p: tiling.plan_seconds(p, *args, spec, ("backward",))  # noqa: E731
  plan = tiling.plan_tiles(16_384, 10_000_019, 64, "bfloat16", chip="7x", kernel="backward",
                           num_targets=8)
  assert (plan.block_t, plan.block_v, plan.token_chunk) == (256, 4096, 8192)
  assert seconds(plan) < seconds(one_chunk) / 1.15
  # In one chunk, wider tiles save GRID_STEP_SECONDS a grid step (less a little
  # padding of the last vocab tile: the matmuls bound this kernel).
  step = tiling.GRID_STEP_SECONDS
  wider = tiling.TilePlan(block_t=256, block_v=512, token_chunk=16_384)
  assert seconds(one_chunk) - seconds(wider) == pytest.approx(
      (-(-10_000_019 // 256) - -(-10_000_019 // 512)) * step, rel=1e-3)
