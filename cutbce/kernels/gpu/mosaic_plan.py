"""Tiles and pipeline depth of the Mosaic GPU kernels, from the device's description.

The GPU twin of the TPU planner (`cutbce/kernels/tiling.py`), chosen when the
program is traced. Each logit tile is computed once, on the tensor cores
(wgmma, M = 64 rows per consumer warpgroup of 128 threads):

  sweep    (loss sums, counts and dh)  warp-specialized where it fits
           (`consumers` = 2): one producer warpgroup streams `block_v`-row
           table tiles by TMA through `stages` shared memory buffers, and
           two consumer warpgroups, each with its own resident `[64, Dp]`
           hidden tile (a CTA covers 128 tokens), read every buffer, so the
           table is streamed once per 128 tokens and one consumer's
           elementwise work overlaps the other's wgmma. Where the two
           consumers' buffers do not fit (float32 at D = 128), one
           warpgroup per CTA that issues its own copies (`consumers` = 1).
           The vocabulary of each token block is cut into `vocab_splits`
           parts so that every SM has work at small T.
  table    (dE and db)  a resident `[64, Dp]` table tile per consumer,
           `[64, Dp]` hidden tiles streamed the same way; warp-specialized
           where it fits (`table_consumers` = 2: a producer streams the
           token tiles, two consumers of 64 table rows each read them, so
           the tokens are streamed once per 128 rows), else one warpgroup;
           no splits (V / 128 or V / 64 CTAs).

Budgets, per CTA:

- registers: the float32 values one consumer thread keeps live, two `[64, block_v]`
  logit tiles (the logits and their gradient; three while float32's
  gradient is split into pieces) and the `[64, Dp]` dh
  accumulator, over 128 threads: the widest tile within
  `spill_free_values` (where ptxas spills nothing: bfloat16 at Dp = 64
  takes 128-column tiles, float32 and Dp >= 128 32-column ones), else,
  where none is, the widest within `REGISTER_VALUES` (it compiles, with
  spills). The budgets are what ptxas did, not a model of it: ptxas'
  report is the check, 0 spills in tests/cutbce/kernels/test_mosaic_compile.py;
- shared memory: per consumer the resident tiles, the gradient tile's pieces
  (the second dot's operand) and the output staging; `stages` buffers of
  every streamed operand and their barriers, within
  `SHARED_MEMORY_FRACTION` of the opt-in shared memory.

Shapes that do not divide the tiles are padded by the caller (`mosaic.py`):
T to a multiple of 64 per consumer (128 when warp-specialized: an odd
number of 64-row tiles gets a zero tile, g = 0), D to a multiple of `DIM_ALIGN` (a 128-byte swizzled
row of bfloat16; TMA needs 16-byte row strides), V to a multiple of the
sweep's `block_v`, so every TMA copy is in bounds and no lane reads garbage.
"""

from __future__ import annotations

from typing import NamedTuple

from cutbce.kernels.gpu import plan as gpu_plan
from cutbce.kernels.gpu import targets
from cutbce.kernels.tiling import TilePlan

BLOCK_T = 64  # token rows of one warpgroup's wgmma tile (its M)
TABLE_BLOCK_V = 64  # table rows of the dE kernel's tile (its wgmma M)
DIM_ALIGN = 64  # D padded to a multiple: 128 bytes of bfloat16, one swizzle row
MAX_DIM = 256  # the dh accumulator's width in registers (the register budget binds first)
VOCAB_BLOCKS = (256, 128, 64, 32)  # sweep tile candidates, most preferred first
MIN_STAGES, MAX_STAGES = 2, 4  # TMA pipeline depth
THREADS = 128  # one warpgroup
# The warp-specialized sweep: consumer warpgroups per CTA (each its own 64
# token rows) and one producer warpgroup. A CTA of three warpgroups starts
# with 65,536 / 384 = 168 registers per thread; `setmaxnreg` moves them
# from the producer (TMA issue only) to the consumers: 2 x 232 + 40 = 3 x 168.
CONSUMERS = 2
CONSUMER_REGISTERS = 232
PRODUCER_REGISTERS = 40
REGISTER_VALUES = 160  # float32 values per thread (of 255 registers): the hard limit
# Where ptxas (CUDA 12.9 and 13.0, jax 0.10.2 and 0.12) spilled nothing in the
# sweep, compiled for sm_90a (docs/kernels.md, "Compiled for sm_90a"): 160
# values for bfloat16 at Dp = 64 (128-column tiles); float32's six products
# and the wider dh of Dp >= 128 spilled at 128 values (64-column tiles: up to
# 432 B) and not at 80-112 (32-column tiles).
SPILL_FREE_VALUES = 112
SHARED_MEMORY_FRACTION = 0.95  # of shared_memory_per_block_optin
# The sweep's vocab splits aim for this many consumer warpgroups per SM (two
# CTAs of one, or one warp-specialized CTA of two: its 3 x 168 registers per
# thread leave no room for a second CTA).
CONSUMERS_PER_CORE = 2
MAX_VOCAB_SPLITS = 64
PIECE_BYTES = 2  # every operand piece is bfloat16
BARRIER_BYTES = 8  # one mbarrier


class Geometry(NamedTuple):
  """Static tiling of one call of the Mosaic GPU kernels."""

  num_tokens: int  # T
  num_items: int  # rows that are items (columns past it are masked)
  dim: int  # D
  tokens_padded: int  # T rounded up to BLOCK_T
  vocab_padded: int  # rows of the padded table (a multiple of block_v)
  dim_padded: int  # D rounded up to DIM_ALIGN
  block_v: int  # the sweep's table tile
  stages: int  # the sweep's TMA buffers
  consumers: int  # the sweep's consumer warpgroups per CTA (2: warp-specialized, 1: not)
  table_stages: int  # the dE kernel's TMA buffers
  table_consumers: int  # the dE kernel's consumer warpgroups per CTA (64 table rows each)
  vocab_splits: int
  tiles_per_split: int
  pieces: int  # bfloat16 pieces per operand: 1 (bf16) or 3 (f32)

  @property
  def num_token_tiles(self) -> int:
    return self.tokens_padded // BLOCK_T

  @property
  def num_token_blocks(self) -> int:
    """The sweep's CTAs along the tokens: `consumers` 64-row tiles each."""
    return self.tokens_padded // (BLOCK_T * self.consumers)

  @property
  def num_table_blocks(self) -> int:
    """The dE kernel's CTAs: `table_consumers` 64-row table tiles each."""
    return self.vocab_padded // (TABLE_BLOCK_V * self.table_consumers)

  @property
  def num_vocab_tiles(self) -> int:
    return self.vocab_padded // self.block_v


def round_up(n: int, multiple: int) -> int:
  return -(-int(n) // multiple) * multiple


def sweep_registers(block_v: int, dim_padded: int, pieces: int) -> float:
  """float32 values per thread the sweep keeps live: two logit tiles (a third while G is
  split into pieces) and the dh accumulator."""
  tiles = 2 if pieces == 1 else 3
  return (tiles * BLOCK_T * block_v + BLOCK_T * dim_padded) / THREADS


def table_registers(dim_padded: int, pieces: int) -> float:
  """float32 values per thread the dE kernel keeps live: its [64, 64] logit tiles (as the
  sweep's) and the [64, Dp] dE accumulator."""
  return sweep_registers(TABLE_BLOCK_V, dim_padded, pieces)


def spill_free_values(dim_padded: int, pieces: int) -> int:
  """float32 values per thread the sweep may keep live with ptxas spilling none."""
  return REGISTER_VALUES if pieces == 1 and dim_padded <= DIM_ALIGN else SPILL_FREE_VALUES


def sweep_shared_bytes(block_v: int, dim_padded: int, pieces: int, token_rows: int,
                       stages: int, consumers: int = 1) -> int:
  """Shared memory of one sweep CTA (bytes); `token_rows` 4-byte values per token."""
  # Per consumer warpgroup (its own 64 tokens):
  resident = pieces * BLOCK_T * dim_padded * PIECE_BYTES  # hidden tile pieces
  resident += pieces * BLOCK_T * block_v * PIECE_BYTES  # gradient tile pieces (dot operand)
  resident += BLOCK_T * dim_padded * 4 + 3 * BLOCK_T * 4  # dh, sums, counts staging (f32)
  resident += token_rows * BLOCK_T * 4  # g, fixed ids and values, ...
  resident += (pieces + token_rows) * BARRIER_BYTES  # its resident copies' barriers
  # Per stage, read by every consumer:
  streamed = pieces * block_v * dim_padded * PIECE_BYTES + block_v * 4  # table pieces, bias
  streamed += (pieces + 1 + (consumers > 1)) * BARRIER_BYTES  # copies', "consumed" barriers
  return consumers * resident + stages * streamed


def table_shared_bytes(dim_padded: int, pieces: int, token_rows: int, stages: int,
                       consumers: int = 1) -> int:
  """Shared memory of one dE CTA (bytes); `token_rows` 4-byte values per token."""
  # Per consumer warpgroup (its own 64 table rows):
  resident = pieces * TABLE_BLOCK_V * dim_padded * PIECE_BYTES + TABLE_BLOCK_V * 4
  resident += pieces * BLOCK_T * TABLE_BLOCK_V * PIECE_BYTES  # gradient tile pieces
  resident += TABLE_BLOCK_V * dim_padded * 4 + TABLE_BLOCK_V * 4  # dE, db staging
  resident += (pieces + 1) * BARRIER_BYTES  # its resident copies' barriers
  # Per stage, read by every consumer: a token tile and its copies' (and consumed) barriers.
  streamed = pieces * BLOCK_T * dim_padded * PIECE_BYTES + token_rows * BLOCK_T * 4
  streamed += (pieces + token_rows + (consumers > 1)) * BARRIER_BYTES
  return consumers * resident + stages * streamed


def _stages(fits) -> int | None:
  """The deepest pipeline in [MIN_STAGES, MAX_STAGES] that `fits(stages)`, or None."""
  for stages in range(MAX_STAGES, MIN_STAGES - 1, -1):
    if fits(stages):
      return stages
  return None


def plan_problem(plan: TilePlan | None) -> str | None:
  """Why a user's `plan` cannot tile the Mosaic GPU kernels, or None."""
  if plan is None:
    return None
  problems = []
  if plan.block_t is not None and plan.block_t != BLOCK_T:
    problems.append(f"block_t={plan.block_t} (one warpgroup's wgmma tile is {BLOCK_T} rows)")
  if plan.block_v not in VOCAB_BLOCKS:
    problems.append(f"block_v={plan.block_v} is not one of {VOCAB_BLOCKS}")
  return "; ".join(problems) or None


def geometry(num_tokens: int, num_items: int, dim: int, pieces: int, token_rows: int = 1,
             plan: TilePlan | None = None, spec: targets.GpuSpec | None = None) -> Geometry:
  """The plan of one call for the device planned for (`plan.current_spec`).

  `num_items` rows are walked (the padded table's rows: a multiple of the
  tile); `token_rows` counts the 4-byte per-token operands the kernels stage
  (g, fixed ids and values, ...).

  Raises:
    ValueError: D is too wide, `plan` breaks the tile rules, or nothing fits.
  """
  spec = spec or gpu_plan.current_spec()
  if dim > MAX_DIM:
    raise ValueError(f"the Mosaic GPU kernels take D <= {MAX_DIM}, got D={dim}")
  problem = plan_problem(plan)
  if problem:
    raise ValueError(f"TilePlan {plan} cannot tile the Mosaic GPU kernels: {problem}")
  dim_padded = round_up(dim, DIM_ALIGN)
  budget = SHARED_MEMORY_FRACTION * spec.shared_memory_per_block_optin
  candidates = (plan.block_v,) if plan is not None else VOCAB_BLOCKS
  live = lambda v: sweep_registers(v, dim_padded, pieces)  # noqa: E731
  spill_free = [v for v in candidates if live(v) <= spill_free_values(dim_padded, pieces)]
  candidates = spill_free + [v for v in candidates
                             if v not in spill_free and live(v) <= REGISTER_VALUES]
  block_v = stages = consumers = None
  # Warp-specialized first, at any tile (spill-free ones first); one warpgroup
  # where two do not fit.
  for consumers in sorted({CONSUMERS, 1}, reverse=True):
    for candidate in candidates:
      stages = _stages(lambda s, v=candidate, c=consumers: sweep_shared_bytes(
          v, dim_padded, pieces, token_rows, s, c) <= budget)
      if stages is not None:
        block_v = candidate
        break
    if block_v is not None:
      break
  table_stages = None
  for table_consumers in sorted({CONSUMERS, 1}, reverse=True):
    table_stages = _stages(lambda s, c=table_consumers: table_shared_bytes(
        dim_padded, pieces, token_rows, s, c) <= budget)
    if table_stages is not None:
      break
  smallest = VOCAB_BLOCKS[-1] if plan is None else plan.block_v
  for kernel, tile, accumulator, values in (
      ("sweep", smallest, "dh", sweep_registers(smallest, dim_padded, pieces)),
      ("dE kernel", TABLE_BLOCK_V, "dE", table_registers(dim_padded, pieces))):
    if values > REGISTER_VALUES:
      raise ValueError(
          f"no Mosaic GPU tile fits D={dim} with {pieces} operand piece(s): the {kernel}'s "
          f"logit tiles and {accumulator} accumulator need {values:.0f} float32 values per "
          f"thread at {tile}-column tiles, budget {REGISTER_VALUES}")
  if block_v is None or table_stages is None:
    raise ValueError(
        f"no Mosaic GPU tile fits D={dim} with {pieces} operand piece(s) and {token_rows} "
        f"per-token values on {spec.name}: "
        f"{sweep_shared_bytes(smallest, dim_padded, pieces, token_rows, MIN_STAGES)} B of shared "
        f"memory at the smallest tile, budget {budget:.0f} B")
  # Never a tile much wider than the catalog.
  while block_v > VOCAB_BLOCKS[-1] and block_v // 2 >= num_items:
    block_v //= 2
  tokens_padded = round_up(max(num_tokens, 1), BLOCK_T * consumers)
  # A multiple of the sweep's tile and of the dE kernel's CTA (both powers of two).
  vocab_padded = round_up(max(num_items, 1), max(block_v, TABLE_BLOCK_V * table_consumers))
  num_token_blocks = tokens_padded // (BLOCK_T * consumers)
  num_vocab_tiles = vocab_padded // block_v
  wanted = -(-CONSUMERS_PER_CORE * spec.core_count // (consumers * num_token_blocks))
  splits = max(1, min(MAX_VOCAB_SPLITS, wanted, num_vocab_tiles))
  tiles_per_split = -(-num_vocab_tiles // splits)
  splits = -(-num_vocab_tiles // tiles_per_split)  # no empty split
  return Geometry(
      num_tokens=num_tokens, num_items=num_items, dim=dim, tokens_padded=tokens_padded,
      vocab_padded=vocab_padded, dim_padded=dim_padded, block_v=block_v, stages=stages,
      consumers=consumers, table_stages=table_stages, table_consumers=table_consumers,
      vocab_splits=splits,
      tiles_per_split=tiles_per_split,
      pieces=pieces)
