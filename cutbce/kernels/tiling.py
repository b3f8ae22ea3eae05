"""Tile sizes: the `TilePlan` every backend takes, and the planners that pick one.

`TilePlan` is a frozen, hashable, keyword-only dataclass so it can travel as a
static argument through `jax.jit` and `jax.custom_vjp`.

The XLA path only reads `block_v`. `default_xla_block_v` picks it so that one
`[T, block_v]` float32 logit tile and its few elementwise temporaries stay at a
size chosen per platform: on CPU a few MiB (cache-sized working sets, measured
fastest), on GPU and TPU tens of MiB, so that a 10^7-item catalog is a few
thousand scan steps rather than tens of thousands of small kernel launches.
Either way the compiled temp memory stays flat in V.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading

# Bytes the XLA path aims to spend on one float32 [T, block_v] logit tile, and
# the largest block_v, per platform. CPU: 2 MiB measured fastest (docs/loss.md).
# GPU/TPU (not measured here): each scan step is a few kernel launches, so the
# tile is made 16x larger; 32 MiB of HBM is small next to any accelerator's and
# keeps per-step overhead (~10 us) below 1% of a step's GEMM time.
XLA_TILE_BYTES = 2 * 1024 * 1024
XLA_MIN_BLOCK_V = 128
XLA_MAX_BLOCK_V = 8192
XLA_ACCELERATOR_TILE_BYTES = 32 * 1024 * 1024
XLA_ACCELERATOR_MAX_BLOCK_V = 65536


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class TilePlan:
  """Tile sizes for one call of the loss.

  Attributes:
    block_v: vocabulary rows per tile (every backend).
    block_t: token rows per tile (TPU kernels; None = planner's choice).
    token_chunk: tokens per outer chunk when the token side does not fit on
      chip (TPU kernels; None = no chunking).
    vmem_limit_bytes: scoped VMEM limit passed to Mosaic (TPU kernels).
  """

  block_v: int
  block_t: int | None = None
  token_chunk: int | None = None
  vmem_limit_bytes: int | None = None

  def __post_init__(self):
    for name in ("block_v", "block_t", "token_chunk", "vmem_limit_bytes"):
      value = getattr(self, name)
      if value is None and name != "block_v":
        continue
      if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(
            f"TilePlan.{name} must be an int, got {type(value).__name__} ({value!r})"
        )
      if value <= 0:
        raise ValueError(f"TilePlan.{name} must be positive, got {value}")


def default_xla_block_v(num_tokens: int, vocab: int, platform: str | None = None) -> int:
  """`block_v` for the XLA path: a [T, block_v] f32 tile of the platform's tile size.

  `XLA_TILE_BYTES` with at most `XLA_MAX_BLOCK_V` rows on CPU,
  `XLA_ACCELERATOR_TILE_BYTES` with at most `XLA_ACCELERATOR_MAX_BLOCK_V` on
  GPU and TPU (`platform` defaults to `jax.default_backend()`). Rounded down
  to a multiple of 128, at least 128, and never more than V (a catalog
  smaller than one tile is one tile).
  """
  if platform is None:
    import jax  # pylint: disable=g-import-not-at-top
    platform = jax.default_backend()
  if platform == "cpu":
    tile_bytes, most = XLA_TILE_BYTES, XLA_MAX_BLOCK_V
  else:
    tile_bytes, most = XLA_ACCELERATOR_TILE_BYTES, XLA_ACCELERATOR_MAX_BLOCK_V
  block_v = tile_bytes // (4 * max(num_tokens, 1))
  block_v = max(XLA_MIN_BLOCK_V, min(most, block_v // 128 * 128))
  return max(1, min(block_v, vocab))


# --------------------------------------------------------------------------- #
# The TPU planner.                                                             #
# --------------------------------------------------------------------------- #

LANES = 128  # minor (lane) dimension of a VMEM tile
SUBLANES = 8  # second-minor rows of a 32-bit VMEM tile (16 for 16-bit types)
MIB = 1024 * 1024
# Fraction of the core's VMEM the planner lets one kernel use. The estimate
# counts Mosaic's own scratch and is held at 1.0-1.5x of the compiler's need
# (issue 40), so the rest is left only to what XLA places in VMEM beside the
# kernel and to a libtpu that allocates differently (0.75 before issue 40,
# when the estimate could be under the need).
VMEM_BUDGET_FRACTION = 0.9
# Largest float32 logit tile [block_t, block_v]: past a few MiB a bigger tile
# only adds VMEM pressure, the MXU is already fed.
MAX_LOGIT_TILE_BYTES = 4 * MIB
BLOCK_T_CHOICES = (512, 256, 128)
BLOCK_V_CHOICES = (4096, 2048, 1024, 512, 256, 128)
# The chip planned for when none is named and no TPU is attached (interpret
# mode in tests): its 128-wide MXU gives the smallest legal tiles.
DEFAULT_CHIP = "v5e"
# Targets per position the rank kernel's blocks are sized for (one lane tile).
PLANNED_TARGETS = LANES
# Fixed columns per position (`tpu.MAX_FIXED_COLUMNS` = 64: the targets' and
# excluded ids' exact logit gradients) the backward's `[chunk, K]` blocks are
# sized for: any K up to one lane tile takes the same VMEM.
PLANNED_FIXED_COLUMNS = LANES


@dataclasses.dataclass(frozen=True, kw_only=True)
class ChipSpec:
  """What the planner and the roofline model need from one TensorCore."""

  name: str
  vmem_capacity_bytes: int
  mxu_column_size: int
  bf16_ops_per_second: float
  mem_bw_bytes_per_second: float
  hbm_capacity_bytes: int


# Used only when the installed jax cannot describe a chip itself; the values
# are the ones jax reports per TensorCore for these chips.
_FALLBACK_CHIPS = {
    "v4": ChipSpec(name="v4", vmem_capacity_bytes=16 * MIB, mxu_column_size=128,
                   bf16_ops_per_second=1.375e14, mem_bw_bytes_per_second=6.15e11,
                   hbm_capacity_bytes=17_200_000_000),
    "v5e": ChipSpec(name="v5e", vmem_capacity_bytes=128 * MIB, mxu_column_size=128,
                    bf16_ops_per_second=1.97e14, mem_bw_bytes_per_second=8.2e11,
                    hbm_capacity_bytes=17_200_000_000),
    "v5p": ChipSpec(name="v5p", vmem_capacity_bytes=64 * MIB, mxu_column_size=128,
                    bf16_ops_per_second=2.295e14, mem_bw_bytes_per_second=1.23e12,
                    hbm_capacity_bytes=51_500_000_000),
    "v6e": ChipSpec(name="v6e", vmem_capacity_bytes=128 * MIB, mxu_column_size=256,
                    bf16_ops_per_second=9.2e14, mem_bw_bytes_per_second=1.64e12,
                    hbm_capacity_bytes=34_400_000_000),
    # TPU7x (Ironwood), one of a chip's two TensorCores (each is a device):
    # half the chip's 192 GiB of HBM, 2,307 bf16 TFLOP/s and 7.37 TB/s
    # (Google Cloud, "TPU7x (Ironwood)", system architecture table), and
    # 64 MiB of VMEM with a 256-wide MXU (jax's Pallas TPU chip table,
    # `pltpu.get_tpu_info_for_chip(ChipVersion("7x"), 1)`, jax 0.10.2-0.12).
    "7x": ChipSpec(name="7x", vmem_capacity_bytes=64 * MIB, mxu_column_size=256,
                   bf16_ops_per_second=1.155e15, mem_bw_bytes_per_second=3.7e12,
                   hbm_capacity_bytes=103_000_000_000),
}


def _spec_from_info(name: str, info) -> ChipSpec:
  return ChipSpec(
      name=name,
      vmem_capacity_bytes=int(info.vmem_capacity_bytes),
      mxu_column_size=int(info.mxu_column_size),
      bf16_ops_per_second=float(info.bf16_ops_per_second),
      mem_bw_bytes_per_second=float(info.mem_bw_bytes_per_second),
      hbm_capacity_bytes=int(info.hbm_capacity_bytes),
  )


_TARGET = threading.local()


@contextlib.contextmanager
def target_chip(chip: str | None):
  """Plans for `chip` where no chip is named, while tracing inside this context.

  For compiling on a host without a TPU for one that is not attached
  (`cutbce.kernels.compiler`): the kernels' plans (`chip=None`) are then those
  of the chip compiled for, not of `DEFAULT_CHIP`. An attached TPU still wins.
  """
  if chip is not None:
    chip_spec(chip)  # an unknown name fails here, not at trace time
  previous = getattr(_TARGET, "chip", None)
  _TARGET.chip = chip
  try:
    yield
  finally:
    _TARGET.chip = previous


def chip_spec(chip: str | None = None) -> ChipSpec:
  """One TensorCore of `chip` ("v4", "v5e", "v5p", "v6e", ...), or of the attached TPU.

  With `chip=None`: the attached TPU (`pltpu.get_tpu_info()`), else the chip of
  the enclosing `target_chip(...)`, else `DEFAULT_CHIP`. Named chips come from
  `pltpu.get_tpu_info_for_chip(ChipVersion(chip), 1)` (per TensorCore), or
  from a small built-in table if this jax lacks it.

  Raises:
    ValueError: an unknown chip name (the message lists the known ones).
  """
  import jax  # pylint: disable=g-import-not-at-top
  try:
    from jax.experimental.pallas import tpu as pltpu  # pylint: disable=g-import-not-at-top
  except ImportError:  # pragma: no cover
    pltpu = None
  if chip is None:
    if jax.default_backend() == "tpu" and pltpu is not None:
      info = pltpu.get_tpu_info()
      # ChipVersion.TPU_V5P -> "v5p", the names the tables here use.
      return _spec_from_info(str(getattr(info.chip_version, "value", info.chip_version)), info)
    chip = getattr(_TARGET, "chip", None) or DEFAULT_CHIP
  versions = getattr(pltpu, "ChipVersion", None)
  for_chip = getattr(pltpu, "get_tpu_info_for_chip", None)
  if versions is not None and for_chip is not None:
    known = [v.value for v in versions]
    if chip not in known:
      raise ValueError(f"chip must be one of {known} or None, got {chip!r}")
    return _spec_from_info(chip, for_chip(versions(chip), 1))
  if chip not in _FALLBACK_CHIPS:  # pragma: no cover
    raise ValueError(f"chip must be one of {sorted(_FALLBACK_CHIPS)} or None, got {chip!r}")
  return _FALLBACK_CHIPS[chip]  # pragma: no cover


def _round_up(x: int, multiple: int) -> int:
  return -(-x // multiple) * multiple


def sublane_rows(itemsize: int) -> int:
  """Rows of one VMEM tile: 8 for 32-bit, 16 for 16-bit types."""
  return SUBLANES * max(1, 4 // itemsize)


def buffer_bytes(rows: int, cols: int, itemsize: int) -> int:
  """VMEM bytes of a `[rows, cols]` buffer after padding to whole (sublane, lane) tiles."""
  return _round_up(rows, sublane_rows(itemsize)) * _round_up(cols, LANES) * itemsize


KERNELS = ("forward", "backward", "ranks")


# Mosaic's own scoped VMEM beside the buffers counted below (its internal
# scratch is 36 KiB; the rest is slack for what the model rounds away).
MOSAIC_SCRATCH_BYTES = 1 * MIB
# And what Mosaic's allocation adds that grows with the plan (alignment of its
# buffers): the largest v5p plans of the grid needed 0.7-0.9% more than the
# sum of the buffers below (`benchmarks/tpu_vmem.py --grid`).
ALLOCATION_MARGIN = 1.02
# Live [block_t, block_v] float32 tiles of each kernel's body, as Mosaic
# allocates them (measured, `benchmarks/tpu_vmem.py --grid`, with XLA's VMEM
# placement of operands off, so every operand goes through its window). When
# the chunk is one `block_t` tile the body is straight-line code and Mosaic
# keeps the forward's elementwise chain in vector registers; when it walks
# several sub-tiles (`fori_loop`) the logits are materialized.
BODY_TILES = {
    # kernel: (one sub-tile, a loop of sub-tiles)
    "forward": (0.35, 1.25),  # the logits (+ the fused softplus chain)
    "backward": (2.0, 2.1),  # logits and the scaled gradient in f32
    "ranks": (1.5, 2.5),  # logits, one target's comparison, its f32 count
}
# Further live temporaries of the body, measured rather than derived: the
# backward's per-token [block_t, 1] f32 vectors (scale, row masks, sums: 8,
# each padded to 128 lanes), the rank kernel's [block_t, D] f32 rows (2 in one
# sub-tile, 3 in a loop of them) and, in a loop, the bf16 table tile
# transposed for the MXU (about half of it live; f32 keeps the whole). The
# wide tiles of the time-model planner set the loop figures (v4, 128 x 2048:
# 0.2 MiB more than without them at D = 64, about 1 MiB at D = 512) and the
# forward's 0.35 (TPU7x, f32, 512 x 2048 in one sub-tile: 0.32).
BODY_TOKEN_VECTORS = 8
BODY_ROWS = (2, 3)
BF16_TRANSPOSED = 0.5
# float32 products at float32's precision (`cutbce/kernels/matmul.py`: HIGHEST, not
# one bfloat16 pass): Mosaic multiplies bfloat16 pieces of both operands and
# keeps them in VMEM. Per kernel, the [block_t, block_v] f32 tiles and
# [block_v, D] f32 table tiles that adds, fitted to the grid's float32 plans
# measured with and without it (`benchmarks/tpu_vmem.py --grid`): the
# backward's two gradient products take the most (25 MiB more at 512 x 2048
# on v5e, D = 512).
F32_PIECES = {"forward": (1.0, 0.3), "backward": (3.5, 2.0), "ranks": (0.5, 1.0)}


def vmem_estimate(
    kernel: str, *, token_chunk: int, block_t: int, block_v: int, dim: int,
    itemsize: int, num_targets: int = PLANNED_TARGETS, extra_logit_tiles: int = 0,
    num_tokens: int | None = None, cores: int = 1, with_loss: bool = True,
) -> int:
  """Bytes of VMEM one of the TPU kernels needs (see docs/kernels.md, "VMEM accounting").

  Modelled on what Mosaic allocates (`benchmarks/tpu_vmem.py --grid` measures
  it, `tests/cutbce/kernels/test_vmem_band.py` holds the model to 1.0-1.5x
  of it): every BlockSpec'd operand's window, each buffer padded to whole
  (8 or 16 rows, 128 lanes) tiles, twice (the Pallas pipeline's two
  buffers) unless its block index never changes over the grid (one buffer:
  the backward's token-side inputs within its per-chunk call, and its
  outputs on one core; the forward's and rank kernel's token blocks when one
  chunk holds every token); the body's live f32 logit tiles (`BODY_TILES`)
  and other temporaries (`BODY_TOKEN_VECTORS`, `BODY_ROWS`, the dE product,
  f32's transposed table, f32 products' bfloat16 pieces `F32_PIECES`); and
  `MOSAIC_SCRATCH_BYTES`; the sum times
  `ALLOCATION_MARGIN`.
  Measured with XLA's placement of operands in VMEM off: with it on (the
  default) XLA may hold an operand in VMEM outside the kernel's scoped
  limit, and the kernel then needs less, never more.

  Args:
    kernel: "forward", "backward" or "ranks".
    token_chunk: token rows resident per grid step (the chunk).
    block_t: token rows of one logit tile (the chunk is walked in these).
    block_v: vocabulary rows per grid step.
    dim: D, taken whole.
    itemsize: bytes per element of hidden and table (2 for bf16, 4 for f32).
    num_targets: L, for the rank kernel.
    extra_logit_tiles: further `[block_t, block_v]` f32 temporaries of the
      loss variants (a soft cap's tanh, the focal factor and their derivatives).
    num_tokens: T, when known: a chunk holding all of it is one block for the
      whole grid (single-buffered). None counts the token blocks twice.
    cores: TensorCores the backward's sweep is split over (`tensor_cores`):
      with 2 its per-core dh (and sum) outputs are indexed by the core axis
      and get two buffers.
    with_loss: the backward also sums the loss and counts (the one-pass
      kernel); the planner counts them, for one plan that serves both.
  """
  c, bt, bv, d, s = token_chunk, block_t, block_v, dim, itemsize
  if kernel not in KERNELS:
    raise ValueError(f"kernel must be 'forward', 'backward' or 'ranks', got {kernel!r}")
  logit_tile = buffer_bytes(bt, bv, 4)  # one [block_t, block_v] f32 buffer
  looped = c > bt  # the chunk is walked in several sub-tiles
  # Token-side blocks of the forward and ranks grids: one buffer when a
  # single chunk holds every token (their index never changes).
  one_chunk = num_tokens is not None and c >= num_tokens
  tok = 1 if one_chunk else 2
  total = MOSAIC_SCRATCH_BYTES
  total += int(BODY_TILES[kernel][looped] * logit_tile)  # the body's f32 logit tiles
  if kernel == "backward":
    total += BODY_TOKEN_VECTORS * buffer_bytes(bt, 1, 4)  # [block_t, 1] f32 vectors
  elif kernel == "ranks":
    total += BODY_ROWS[looped] * buffer_bytes(bt, d, 4)  # [block_t, D] f32 rows
  if looped:
    # Logits h . e^T in a loop of sub-tiles: the table tile, transposed for
    # the MXU, is hoisted out of the loop ([D, block_v] f32 whole; in bf16
    # about half of it live).
    total += buffer_bytes(d, bv, 4) if s == 4 else int(BF16_TRANSPOSED * buffer_bytes(d, bv, s))
  total += extra_logit_tiles * logit_tile  # variants' elementwise temporaries
  if s == 4:  # the float32 products' bfloat16 pieces
    tiles, table_tiles = F32_PIECES[kernel]
    total += int(tiles * logit_tile + table_tiles * buffer_bytes(bv, d, 4))
  total += 2 * buffer_bytes(bv, d, s)  # table tile [block_v, D], x2 buffers
  total += 2 * buffer_bytes(1, bv, 4)  # bias tile [1, block_v] f32, x2 buffers
  if kernel == "forward":
    total += tok * buffer_bytes(c, d, s)  # hidden chunk block [chunk, D]
    total += 2 * tok * buffer_bytes(c, 1, 4)  # softplus-sum and count outputs [chunk, 1]
  elif kernel == "backward":
    # One call per chunk: the token-side inputs never change within it (one
    # buffer); the outputs neither, on one core.
    out = 2 if cores > 1 else 1
    total += buffer_bytes(c, d, s)  # hidden chunk block [chunk, D]
    total += buffer_bytes(c, 1, 4)  # scale g_t [chunk, 1] f32
    # Fixed columns' ids (int32) and values (f32) [chunk, K] (counted at one
    # lane tile, K <= 128, whether or not a call passes them).
    total += 2 * buffer_bytes(c, PLANNED_FIXED_COLUMNS, 4)
    total += out * buffer_bytes(c, d, 4)  # dh accumulator output block [chunk, D] f32
    if with_loss:
      total += 2 * out * buffer_bytes(c, 1, 4)  # loss-sum and count outputs [chunk, 1]
    total += 2 * buffer_bytes(bv, d, 4)  # dE input block (aliased, sparse part), x2
    total += 2 * buffer_bytes(bv, d, 4)  # dE output block [block_v, D] f32, x2
    total += 2 * 2 * buffer_bytes(1, bv, 4)  # db input and output blocks [1, block_v], x2
    total += buffer_bytes(bv, d, 4)  # the dE product G^T @ h [block_v, D] f32, then added
    if s < 4:  # the logit gradient cast for the MXU (about half of it live)
      total += buffer_bytes(bt, bv, s) // 2
  else:  # ranks
    total += tok * buffer_bytes(c, d, s)  # hidden chunk block [chunk, D]
    total += 3 * tok * buffer_bytes(c, num_targets, 4)  # target logits, ids, counts [chunk, L]
  return int(total * ALLOCATION_MARGIN)


def plan_vmem_bytes(plan: TilePlan, dim: int, itemsize: int, num_targets: int = PLANNED_TARGETS,
                    kernels=KERNELS, extra_logit_tiles: int = 0,
                    num_tokens: int | None = None, cores: int = 1) -> int:
  """Largest `vmem_estimate` over `kernels` (default: all three TPU kernels) for `plan`."""
  return max(
      vmem_estimate(
          kernel, token_chunk=plan.token_chunk, block_t=plan.block_t,
          block_v=plan.block_v, dim=dim, itemsize=itemsize, num_targets=num_targets,
          extra_logit_tiles=extra_logit_tiles, num_tokens=num_tokens, cores=cores,
      )
      for kernel in kernels
  )


def vmem_budget(spec: ChipSpec) -> int:
  """Bytes one kernel may use on `spec`: `VMEM_BUDGET_FRACTION` of its VMEM."""
  return int(spec.vmem_capacity_bytes * VMEM_BUDGET_FRACTION) // MIB * MIB


def _itemsize(dtype) -> int:
  import numpy as np  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  dtype = jnp.dtype(dtype)
  if dtype not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
    raise ValueError(f"dtype must be float32 or bfloat16 for the TPU kernels, got {dtype}")
  del np
  return dtype.itemsize


# TensorCores one device drives as one (megacore): Mosaic splits a kernel's
# "parallel" grid dimensions between them, and the kernels' parallel
# dimension is the token chunk, so a plan for these chips has at least this
# many chunks wherever T spans that many `block_t` tiles (else one core idles).
# TPU7x exposes each of its two TensorCores as its own device.
MEGACORE_TENSOR_CORES = {"v4": 2, "v5p": 2}


def tensor_cores(chip: str | None = None) -> int:
  """TensorCores one device of `chip` drives as one (2 on v4 and v5p, else 1).

  `chip=None`: the chip `chip_spec(None)` describes (the attached TPU, the
  enclosing `target_chip`, or `DEFAULT_CHIP`). The backward kernel splits its
  vocabulary sweep into this many "parallel" slices (`tpu._backward`).
  """
  return MEGACORE_TENSOR_CORES.get(chip_spec(chip).name, 1)


def plan_tiles(num_tokens: int, vocab: int, dim: int, dtype, *, chip: str | None = None,
               kernel: str | None = None, num_targets: int = PLANNED_TARGETS,
               extra_logit_tiles: int = 0) -> TilePlan:
  """Tile sizes for the Pallas TPU kernels, chosen at trace time from the chip's VMEM.

  The token side is walked in chunks of `token_chunk` rows held in VMEM for a
  whole sweep of the vocabulary (the table is read once per chunk), and each
  chunk in logit tiles of `[block_t, block_v]`. The planner prefers, in order:
  the least time by `plan_seconds` (table sweeps, one per chunk, against grid
  steps, one per vocab tile per chunk, and the matmuls' padding); among
  plans within `PLAN_SECONDS_TIE` of the fastest, the fewest grid steps, then
  the fewest chunks, the largest logit tile (up to `MAX_LOGIT_TILE_BYTES`)
  and the widest `block_v`. Every candidate's VMEM is `vmem_estimate` of the heaviest
  kernel, each at its largest chunk that fits; the chunks are then balanced
  (`balanced_chunk`): as many, of equal size.
  On a megacore chip (v4, v5p) a chunk holds at most 1/2 of the token tiles,
  so both TensorCores get a chunk (`MEGACORE_TENSOR_CORES`).

  Args:
    num_tokens: T, positions after flattening.
    vocab: V, catalog rows.
    dim: D, hidden size (taken whole by every block).
    dtype: float32 or bfloat16, of hidden and table.
    chip: "v4", "v5e", "v5p", "v6e" (or newer ones the installed jax knows),
      or None for the attached TPU (`DEFAULT_CHIP` off-TPU).
    kernel: "forward", "backward" or "ranks" to plan that kernel alone (each
      kernel call plans for itself), or None for one plan that fits all three.
    num_targets: L of the rank kernel's blocks.
    extra_logit_tiles: see `vmem_estimate` (loss variants).

  Returns:
    A `TilePlan` whose `block_t` and `block_v` are multiples of the chip's
    MXU width, `token_chunk` a multiple of `block_t`, and `vmem_limit_bytes`
    the budget the estimate stays under.

  Raises:
    ValueError: bad arguments, or no legal plan fits the budget (the message
      names the chip, the shapes and the budget).

  Example:
    >>> import cutbce
    >>> plan = cutbce.plan_tiles(4096, 876_939, 128, "bfloat16", chip="v6e")
    >>> plan.block_v % 256, plan.token_chunk
    (0, 4096)
  """
  for name, value in (("num_tokens", num_tokens), ("vocab", vocab), ("dim", dim)):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
      raise ValueError(f"{name} must be a positive int, got {value!r}")
  itemsize = _itemsize(dtype)
  if kernel is not None and kernel not in KERNELS:
    raise ValueError(f"kernel must be one of {list(KERNELS)} or None, got {kernel!r}")
  kernels = KERNELS if kernel is None else (kernel,)
  spec = chip_spec(chip)
  cores = MEGACORE_TENSOR_CORES.get(spec.name, 1)
  sizing = dict(num_targets=num_targets, kernels=kernels, extra_logit_tiles=extra_logit_tiles,
                cores=cores)
  budget = vmem_budget(spec)
  mxu = spec.mxu_column_size
  tokens_padded = _round_up(num_tokens, mxu)
  vocab_padded = _round_up(vocab, mxu)
  candidates = []  # (seconds, chunks, plan) of each tile shape at its largest chunk
  for block_t in sorted({min(bt, tokens_padded) for bt in BLOCK_T_CHOICES if bt % mxu == 0}):
    for block_v in sorted({min(bv, vocab_padded) for bv in BLOCK_V_CHOICES if bv % mxu == 0}):
      if 4 * block_t * block_v > MAX_LOGIT_TILE_BYTES:
        continue
      chunk = _largest_chunk(num_tokens, block_t, block_v, dim, itemsize, budget, sizing,
                             min_chunks=cores)
      if chunk is None:
        continue
      chunks = -(-num_tokens // chunk)
      plan = TilePlan(block_v=block_v, block_t=block_t,
                      token_chunk=balanced_chunk(num_tokens, chunk, block_t),
                      vmem_limit_bytes=budget)
      candidates.append((plan_seconds(plan, num_tokens, vocab, dim, itemsize, spec, kernels),
                         chunks, plan))
  if candidates:
    # A megacore chip's plans that give each core a chunk first, then: within
    # `PLAN_SECONDS_TIE` of the fastest by the model, the fewest grid steps
    # (chunks x vocab tiles), the fewest chunks, the largest tile, the widest.
    candidates = [c for c in candidates if c[1] >= cores] or candidates
    fastest = min(seconds for seconds, _, _ in candidates)
    best = min((c for c in candidates if c[0] <= fastest * (1 + PLAN_SECONDS_TIE)),
               key=lambda c: (c[1] * -(-vocab // c[2].block_v), c[1],
                              -c[2].block_t * c[2].block_v, -c[2].block_v))[2]
  else:
    smallest = plan_vmem_bytes(
        TilePlan(block_v=mxu, block_t=mxu, token_chunk=mxu), dim, itemsize, **sizing
    )
    raise ValueError(
        f"no TPU tile plan fits chip {spec.name}: T={num_tokens}, V={vocab}, D={dim}, "
        f"dtype={dtype}; the smallest legal tiles (block_t=block_v=token_chunk={mxu}) "
        f"need {smallest / MIB:.1f} MiB of VMEM, the budget is {budget / MIB:.1f} MiB "
        f"({VMEM_BUDGET_FRACTION:.0%} of {spec.vmem_capacity_bytes / MIB:.0f} MiB)"
    )
  return best


# What the planner's time model charges a Pallas TPU grid step beside its work
# (the Pallas TPU pipelining guide's figure), the matmuls each kernel makes
# per logit tile, and how much slower float32 operands go through the MXU
# (several bfloat16 passes).
GRID_STEP_SECONDS = 0.35e-6
KERNEL_MATMULS = {"forward": 1, "backward": 3, "ranks": 1}
F32_MATMUL_SLOWDOWN = 3
# Plans within this fraction of the fastest by the model count as equal (it
# is a ranking, not a measurement): the fewest grid steps, then chunks, win.
PLAN_SECONDS_TIE = 0.03


def plan_seconds(plan: TilePlan, num_tokens: int, vocab: int, dim: int, itemsize: int,
                 spec: ChipSpec, kernels=KERNELS) -> float:
  """The planner's time model of `kernels` under `plan`: a ranking, not a prediction.

  Per kernel, the longer of its matmuls (over the padded tiles, at the chip's
  bf16 rate, `F32_MATMUL_SLOWDOWN` times slower in f32) and its HBM traffic
  (the table read once per token chunk, the backward's f32 table gradient
  read and written once per chunk, the hidden states once), plus
  `GRID_STEP_SECONDS` per grid step (token chunks x vocab tiles). Fewer
  chunks save table sweeps; wider tiles save grid steps: the model weighs
  the two (a TPU7x backward at T = 16,384, V = 10M, D = 64: 256 x 4096 in 2
  chunks, 56 ms by the model, not 256 x 256 in 1, whose 39,063 grid steps
  cost 13.7 ms where a sweep costs 1.7 ms).
  """
  chunk = min(plan.token_chunk, num_tokens)
  chunks = -(-num_tokens // chunk)
  vocab_tiles = -(-vocab // plan.block_v)
  tokens_padded = chunks * _round_up(chunk, plan.block_t)
  rate = spec.bf16_ops_per_second / (F32_MATMUL_SLOWDOWN if itemsize == 4 else 1)
  seconds = 0.0
  for kernel in kernels:
    flops = 2 * KERNEL_MATMULS[kernel] * tokens_padded * vocab_tiles * plan.block_v * dim
    table_bytes = vocab * dim * (itemsize + (8 if kernel == "backward" else 0))
    traffic = chunks * table_bytes + num_tokens * dim * itemsize
    seconds += max(flops / rate, traffic / spec.mem_bw_bytes_per_second)
    seconds += chunks * vocab_tiles * GRID_STEP_SECONDS
  return seconds


def balanced_chunk(num_tokens: int, chunk: int, block_t: int) -> int:
  """The smallest multiple of `block_t` that cuts T into as many chunks as `chunk` does.

  The largest chunk that fits leaves the last chunk short (T = 65,536 in
  chunks of 34,560: 34,560 + 30,976); equal chunks of 32,768 read the table
  as often, hold less VMEM and pad at most `block_t` - 1 rows per chunk.
  """
  chunks = -(-num_tokens // chunk)
  return min(chunk, _round_up(-(-num_tokens // chunks), block_t))


def _largest_chunk(num_tokens, block_t, block_v, dim, itemsize, budget, sizing, min_chunks=1):
  """Largest multiple of `block_t` (up to T rounded up) whose estimate fits, or None.

  At most 1/`min_chunks` of the token tiles (rounded up), so that T spanning
  `min_chunks` tiles or more takes at least `min_chunks` chunks.
  """
  tiles = _round_up(num_tokens, block_t) // block_t
  most = -(-tiles // min_chunks)

  def fits(multiple, tokens=None):
    plan = TilePlan(block_v=block_v, block_t=block_t, token_chunk=multiple * block_t)
    return plan_vmem_bytes(plan, dim, itemsize, num_tokens=tokens, **sizing) <= budget

  if most == tiles and fits(most, num_tokens):
    return most * block_t  # one chunk of every token: its blocks are single-buffered
  if not fits(1):
    return None
  low, high = 1, most  # the estimate grows with the chunk: bisect
  while low < high:
    mid = (low + high + 1) // 2
    if fits(mid):
      low = mid
    else:
      high = mid - 1
  return low * block_t
