"""Kernel set of `backend="pallas_gpu"`: fused Mosaic GPU kernels (TMA, wgmma).

Honours the backend contract written in `cutbce/kernels/xla.py` on flattened
`[T, D]` tokens. Two kernels, each computing every logit tile once, on the
tensor cores, the tile living only in registers:

  sweep   grid (token tiles, vocab splits). A CTA holds a `[64, Dp]` hidden
          tile in shared memory and streams its split's `[block_v, Dp]`
          table tiles (and bias) through a TMA pipeline of `stages` buffers.
          Per tile: X = H E^T (wgmma), then from one e = exp(-|x|) and one
          r = 1 / (1 + e): softplus(x) = max(x, 0) + log1p(e) (log1p from
          log(1 + e) and the rounding error of 1 + e, times r), the count
          of x > 0, and G = g sigmoid(x) = g [x >= 0 ? 1 : e] r with the
          fixed columns set in float32; G goes to shared memory and
          dh += G E (wgmma). Loss sums, counts and dh are written per split
          (`[splits, T]`, `[splits, T, Dp]` f32), summed outside.
          Forward only: the same kernel without G and dh.
  table   grid (vocab tiles of 64 rows). A CTA holds its table tile and
          streams the token tiles (hidden, g, fixed columns): it recomputes
          X and G as the sweep does and accumulates dE += G^T H (wgmma,
          transposed operand) and db += sum_t G in float32 registers,
          written once: deterministic, no atomics.

float32 inputs stay exact on the tensor cores: every operand is split into
three bfloat16 pieces (`mosaic_ops.split_pieces`) and each dot is the six
piece products that reach float32 precision (never TF32, never FMA loops);
bfloat16 inputs are one piece, one product. Shapes that do not divide the
tiles are padded outside (`mosaic_plan`): T to 64 (g = 0 there), D to 64
(zero columns), the catalog to the tile (zero rows, masked columns past
`num_items`). How a kernel runs is chosen when the program is traced
(`_run`): compiled by Mosaic GPU on a GPU or for a named target, in Pallas'
Mosaic GPU interpreter anywhere else (`mosaic_ops` keeps the few primitives the interpreter lacks).

What the Mosaic kernels do not take yet is delegated to the Pallas Triton
kernel set (`backend="pallas_triton"`, `triton.py`): loss variants with a
logit cap or focal terms, more than `MAX_FIXED_COLUMNS` fixed columns, the
rank kernels and the softmax cross-entropy kernels (docs/kernels.md,
"Mosaic GPU kernels").
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from cutbce import variants
from cutbce.kernels.gpu import mosaic_ops as ops
from cutbce.kernels.gpu import plan as gpu_plan
from cutbce.kernels.gpu import mosaic_plan
from cutbce.kernels.gpu import triton
from cutbce.kernels.gpu.mosaic_plan import BLOCK_T, TABLE_BLOCK_V, Geometry
from cutbce.kernels.tiling import TilePlan
from cutbce.variants import LossOptions

# What the Triton set does, this one delegates to it (module docstring).
MAX_SOFTMAX_EXCLUDE = triton.MAX_SOFTMAX_EXCLUDE
rank_logits = triton.rank_logits
rank_counts = triton.rank_counts
softmax_forward = triton.softmax_forward
softmax_backward = triton.softmax_backward

SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
PIECES = {jnp.dtype(jnp.bfloat16): 1, jnp.dtype(jnp.float32): 3}
# Fixed columns per token the kernels compare in a tile (unrolled); the
# sweeps of `cutbce.tiled` keep any past it as sparse corrections.
MAX_FIXED_COLUMNS = 16
_TILE_TRANSFORMS = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))


def _interpret_params():
  from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams  # pylint: disable=g-import-not-at-top
  return InterpretGPUParams()


# --------------------------------------------------------------------------- #
# Support checks and plans.                                                    #
# --------------------------------------------------------------------------- #


def unsupported_reason(num_tokens, vocab, dim, hidden_dtype, table_dtype, plan=None) -> str | None:
  """Why these inputs cannot run on the GPU kernels, or None when they can."""
  dtype = jnp.result_type(jnp.dtype(hidden_dtype), jnp.dtype(table_dtype))
  if dtype not in SUPPORTED_DTYPES:
    return (
        "the Pallas GPU kernels compute in float32 or bfloat16; got hidden "
        f"{jnp.dtype(hidden_dtype)} and table {jnp.dtype(table_dtype)} (common type {dtype})"
    )
  if num_tokens < 1:
    return f"the Pallas GPU kernels need at least one token, got T={num_tokens}"
  try:
    mosaic_plan.geometry(num_tokens, vocab, vocab, dim, PIECES[dtype], 0, plan)
  except ValueError as error:
    return str(error)
  return None


def plan_problem(num_tokens, vocab, dim, dtype, plan: TilePlan) -> str | None:
  """Why `plan` cannot tile these shapes on the Mosaic GPU kernels, or None."""
  del num_tokens, vocab, dim, dtype
  return mosaic_plan.plan_problem(plan)


def default_plan(kernel: str, num_tokens: int, vocab: int, dim: int, dtype,
                 num_targets: int = 1) -> TilePlan:
  """The planner's plan ("forward", "backward") for the device planned for; "ranks" is Triton's.

  Raises:
    NotImplementedError: the dtype is not float32/bfloat16 or no tile fits.
  """
  if kernel == "ranks":
    return triton.default_plan(kernel, num_tokens, vocab, dim, dtype, num_targets=num_targets)
  if jnp.dtype(dtype) not in SUPPORTED_DTYPES:
    raise NotImplementedError(
        f"the Pallas GPU kernels take float32 or bfloat16, got {jnp.dtype(dtype)}")
  try:
    geom = mosaic_plan.geometry(num_tokens, vocab, vocab, dim, PIECES[jnp.dtype(dtype)], 0)
  except ValueError as error:
    raise NotImplementedError(str(error)) from error
  return TilePlan(block_v=geom.block_v, block_t=BLOCK_T)


def _takes(options: LossOptions, fixed_ids) -> bool:
  """Whether the Mosaic kernels take this call (else it goes to the Triton set)."""
  num_fixed = 0 if fixed_ids is None else fixed_ids.shape[-1]
  return options.is_affine and num_fixed <= MAX_FIXED_COLUMNS


# --------------------------------------------------------------------------- #
# Operands: padded, split into pieces, laid out for TMA.                       #
# --------------------------------------------------------------------------- #


class _Operands(NamedTuple):
  """The kernels' inputs (padded) and which optional ones are present (static)."""

  hidden: list  # pieces [Tp, Dp] bf16
  table: list  # pieces [Vp, Dp] bf16
  bias: jax.Array | None  # [Vp] f32
  scale: jax.Array | None  # [Tp] f32, g_t (0 on padded tokens)
  fixed_ids: jax.Array | None  # [K, Tp] int32 (-1: none)
  fixed_values: jax.Array | None  # [K, Tp] f32


def _pad_to(x, shape):
  """`x` zero-padded at the end of every axis to `shape` (no copy when it already fits)."""
  widths = [(0, want - have) for have, want in zip(x.shape, shape)]
  return x if not any(w for _, w in widths) else jnp.pad(x, widths)


def _operands(hidden, table, bias, scale, fixed_ids, fixed_values, geom: Geometry) -> _Operands:
  tokens, rows, dim = geom.tokens_padded, geom.vocab_padded, geom.dim_padded
  # Only the first num_items rows are read; rows up to the tile are zeros.
  if table.shape[0] != rows:
    table = _pad_to(table[:min(table.shape[0], geom.num_items)], (rows, table.shape[1]))
  table = _pad_to(table, (rows, dim))
  hidden = _pad_to(hidden, (tokens, dim))
  if bias is not None:
    bias = _pad_to(bias.astype(jnp.float32)[:geom.num_items], (rows,))
  if scale is not None:
    scale = _pad_to(scale.astype(jnp.float32), (tokens,))
  if geom.num_fixed:
    fixed_ids = jnp.pad(fixed_ids.astype(jnp.int32).T, ((0, 0), (0, tokens - geom.num_tokens)),
                        constant_values=-1)
    fixed_values = _pad_to(fixed_values.astype(jnp.float32).T, (geom.num_fixed, tokens))
  else:
    fixed_ids = fixed_values = None
  return _Operands(ops.split_pieces(hidden, geom.pieces), ops.split_pieces(table, geom.pieces),
                   bias, scale, fixed_ids, fixed_values)


def _geometry(hidden, table, plan, num_items, fixed_ids) -> Geometry:
  dtype = jnp.result_type(hidden.dtype, table.dtype)
  reason = unsupported_reason(hidden.shape[0], table.shape[0], table.shape[1], hidden.dtype,
                              table.dtype, plan)
  if reason is not None:
    raise NotImplementedError(reason)
  num_items = table.shape[0] if num_items is None else num_items
  num_fixed = 0 if fixed_ids is None else fixed_ids.shape[-1]
  return mosaic_plan.geometry(hidden.shape[0], num_items, num_items, hidden.shape[1],
                              PIECES[dtype], num_fixed, plan)


def _compiled_here() -> bool:
  """Whether the kernels are compiled (a GPU attached, or a target named) or interpreted."""
  return jax.default_backend() == "gpu" or gpu_plan.current_target_name() is not None


def _run(impl, *operands, **static):
  """`impl(*operands, interpret=..., **static)`: Mosaic GPU or the interpreter, chosen when traced.

  Compiled by Mosaic GPU where a GPU is jax's default backend or inside
  `cutbce.kernels.gpu.target_gpu(name)` (compiling for a target with no GPU
  attached); interpreted everywhere else. Unlike the Triton set, the choice
  cannot wait for lowering (`lax.platform_dependent`): the interpreter's
  ordered callbacks give its branch effects the compiled branch lacks.
  """
  return impl(*operands, interpret=not _compiled_here(), **static)


# --------------------------------------------------------------------------- #
# The tile: logits, loss terms and the logit gradient, shared by both kernels. #
# --------------------------------------------------------------------------- #


def _tile(logits, columns, geom: Geometry, *, scale=None, fixed=(), with_loss=False,
          with_counts=False):
  """Loss row sums, count row sums and G `[64, block]` f32 of one logit tile (None where not asked).

  `scale` and the fixed columns' ids and values are `[64]` vectors, one per
  row. `columns` are the tile's item ids (int32, the tile's shape); those at or
  past num_items are masked. One exp and one reciprocal per logit:
  e = exp(-|x|), r = 1 / (1 + e); sigmoid(x) = [x >= 0 ? 1 : e] r and
  log1p(e) = log(u) - ((u - 1) - e) r with u = 1 + e rounded: (u - 1) - e
  is u's rounding error, exact in float32, and log(u) - d / u is log(u - d)
  to first order, so the small e of confident logits are not lost to the
  rounding of 1 + e.
  """
  valid = columns < geom.num_items
  decay = jnp.exp(-jnp.abs(logits))
  one_plus = 1.0 + decay
  inverse = 1.0 / one_plus
  loss = counts = grad = None
  if with_loss:
    log1p = jnp.log(one_plus) - ((one_plus - 1.0) - decay) * inverse
    loss = jnp.sum(jnp.where(valid, jnp.maximum(logits, 0.0) + log1p, 0.0), axis=1)
  if with_counts:
    counts = jnp.sum(jnp.where(valid & (logits > 0.0), 1.0, 0.0), axis=1)
  if scale is not None:
    sigmoid = jnp.where(logits >= 0.0, 1.0, decay) * inverse
    grad = jnp.where(valid, _rows(scale, logits.shape) * sigmoid, 0.0)
    for ids, values in fixed:  # exact target terms, set in float32 before the split
      grad = jnp.where(columns == _rows(ids, logits.shape), _rows(values, logits.shape), grad)
  return loss, counts, grad


def _rows(vector, shape):
  """An `[M]` vector (one value per row) broadcast over an `[M, N]` tile."""
  return lax.broadcast_in_dim(vector, shape, (0,))


def _columns(vector, shape):
  """An `[N]` vector (one value per column) broadcast over an `[M, N]` tile."""
  return lax.broadcast_in_dim(vector, shape, (1,))


def _store_pieces(grad, smem_refs):
  """G split into bfloat16 pieces (`ops.split_pieces`), into the shared memory the next dot reads.

  Each piece is stored as soon as it is made, so at most G's rest and one
  piece are live in registers.
  """
  rest = grad
  for index, ref in enumerate(smem_refs):
    piece = rest.astype(ref.dtype)
    ref[...] = piece
    if index + 1 < len(smem_refs):
      rest = rest - piece.astype(jnp.float32)
  plgpu.commit_smem()


def _smem(shape, dtype=jnp.bfloat16, tiled=False):
  return plgpu.SMEM(shape, dtype, transforms=_TILE_TRANSFORMS if tiled else ())


# --------------------------------------------------------------------------- #
# The sweep: loss sums, counts and dh over token tiles.                        #
# --------------------------------------------------------------------------- #


class _SweepFlags(NamedTuple):
  has_bias: bool
  with_loss: bool
  with_counts: bool
  with_grad: bool


def _sweep_kernel(*refs, geom: Geometry, flags: _SweepFlags, interpret: bool):
  pl.run_scoped(functools.partial(_sweep_body, refs, geom=geom, flags=flags, interpret=interpret),
                *_sweep_scratch(geom, flags))


def _sweep_body(refs, *scratch, geom: Geometry, flags: _SweepFlags, interpret: bool):
  pieces, num_fixed, block_v, stages = geom.pieces, geom.num_fixed, geom.block_v, geom.stages
  refs = list(refs)
  hidden_refs = [refs.pop(0) for _ in range(pieces)]  # [Tp, Dp] bf16 each
  table_refs = [refs.pop(0) for _ in range(pieces)]  # [Vp, Dp] bf16 each
  bias_ref = refs.pop(0) if flags.has_bias else None  # [Vp] f32
  scale_ref = refs.pop(0) if flags.with_grad else None  # [Tp] f32
  fixed_refs = (refs.pop(0), refs.pop(0)) if flags.with_grad and num_fixed else None  # [K, Tp]
  dh_ref = refs.pop(0) if flags.with_grad else None  # [splits, Tp, Dp] f32
  loss_ref = refs.pop(0) if flags.with_loss else None  # [splits, Tp] f32
  count_ref = refs.pop(0) if flags.with_counts else None  # [splits, Tp] f32
  (hidden_smem, table_smem, bias_smem, scale_smem, fixed_smem, grad_smem, dh_smem, sums_smem,
   resident_barrier, stream_barriers) = scratch

  token_start = lax.axis_index("tokens") * BLOCK_T
  split = lax.axis_index("splits")
  first = split * geom.tiles_per_split
  num_tiles = jnp.minimum(first + geom.tiles_per_split, geom.num_vocab_tiles) - first
  tokens = pl.ds(token_start, BLOCK_T)

  # Resident token side: hidden pieces, g, fixed ids and values (one barrier each).
  resident = [(ref.at[tokens], smem) for ref, smem in zip(hidden_refs, hidden_smem)]
  if flags.with_grad:
    resident.append((scale_ref.at[tokens], scale_smem))
    if num_fixed:
      resident += [(fixed_refs[0].at[:, tokens], fixed_smem[0]),
                   (fixed_refs[1].at[:, tokens], fixed_smem[1])]
  for index, (src, dst) in enumerate(resident):
    plgpu.copy_gmem_to_smem(src, dst, resident_barrier.at[index])

  def issue(tile, slot):  # table tile `first + tile` (and its bias) into buffer `slot`
    rows = pl.ds((first + tile) * block_v, block_v)
    for ref, smem, barrier in zip(table_refs, table_smem, stream_barriers):
      plgpu.copy_gmem_to_smem(ref.at[rows], smem.at[slot], barrier.at[slot])
    if flags.has_bias:
      plgpu.copy_gmem_to_smem(bias_ref.at[rows], bias_smem.at[slot], stream_barriers[-1].at[slot])

  for slot in range(stages):
    pl.when(slot < num_tiles)(functools.partial(issue, slot, slot))
  for index in range(len(resident)):
    plgpu.barrier_wait(resident_barrier.at[index])
  scale = fixed = None
  if flags.with_grad:
    scale = ops.load_vector(scale_smem, ops.ROWS, interpret)
    fixed = [(ops.load_vector(fixed_smem[0].at[k], ops.ROWS, interpret),
              ops.load_vector(fixed_smem[1].at[k], ops.ROWS, interpret))
             for k in range(num_fixed)]
  products = ops.PRODUCTS[pieces]

  def step(tile, carry):
    loss, counts, dh = carry
    slot = lax.rem(tile, stages)
    for barrier in stream_barriers:
      plgpu.barrier_wait(barrier.at[slot])
    table_tile = [smem.at[slot] for smem in table_smem]
    logits = ops.dot_nt(hidden_smem, table_tile, products, interpret)  # [64, block_v] f32
    if flags.has_bias:
      logits = logits + _columns(ops.load_vector(bias_smem.at[slot], ops.COLUMNS, interpret),
                                 logits.shape)
    columns = (first + tile) * block_v + ops.iota((BLOCK_T, block_v), 1, interpret)
    tile_loss, tile_counts, grad = _tile(logits, columns, geom, scale=scale, fixed=fixed or (),
                                         with_loss=flags.with_loss,
                                         with_counts=flags.with_counts)
    if flags.with_loss:
      loss = loss + tile_loss
    if flags.with_counts:
      counts = counts + tile_counts
    if flags.with_grad:
      _store_pieces(grad, grad_smem)
      dh = ops.dot_acc(dh, grad_smem, table_tile, products, interpret)  # [64, Dp] f32
    # Every read of the slot is done (the dots waited): refill it.
    refill = tile + stages
    pl.when(refill < num_tiles)(lambda: issue(refill, slot))
    return loss, counts, dh

  rows_zero = ops.zeros((BLOCK_T,), ops.ROWS, interpret)
  init = (rows_zero, rows_zero,
          ops.zeros((BLOCK_T, geom.dim_padded), ops.WGMMA, interpret) if flags.with_grad
          else rows_zero)
  loss, counts, dh = lax.fori_loop(0, num_tiles, step, init)
  outputs = []
  if flags.with_grad:
    dh_smem[...] = dh
    outputs.append((dh_smem, dh_ref.at[split, tokens]))
  if flags.with_loss:
    sums_smem.at[0][...] = loss
    outputs.append((sums_smem.at[0], loss_ref.at[split, tokens]))
  if flags.with_counts:
    sums_smem.at[1][...] = counts
    outputs.append((sums_smem.at[1], count_ref.at[split, tokens]))
  plgpu.commit_smem()
  for src, dst in outputs:
    plgpu.copy_smem_to_gmem(src, dst)
  plgpu.wait_smem_to_gmem(0)


def _sweep_scratch(geom: Geometry, flags: _SweepFlags):
  pieces, stages, dim, block_v = geom.pieces, geom.stages, geom.dim_padded, geom.block_v
  num_resident = pieces + (1 + 2 * bool(geom.num_fixed) if flags.with_grad else 0)
  num_streams = pieces + flags.has_bias
  fixed = geom.num_fixed if flags.with_grad else 0
  return (
      [_smem((BLOCK_T, dim), tiled=True) for _ in range(pieces)],  # hidden pieces
      [_smem((stages, block_v, dim), tiled=True) for _ in range(pieces)],  # table pieces
      _smem((stages, block_v), jnp.float32) if flags.has_bias else None,
      _smem((BLOCK_T,), jnp.float32) if flags.with_grad else None,  # g
      (_smem((fixed, BLOCK_T), jnp.int32), _smem((fixed, BLOCK_T), jnp.float32)) if fixed
      else None,
      [_smem((BLOCK_T, block_v), tiled=True) for _ in range(pieces)] if flags.with_grad
      else None,  # G pieces
      _smem((BLOCK_T, dim), jnp.float32) if flags.with_grad else None,  # dh staging
      _smem((2, BLOCK_T), jnp.float32),  # loss and count staging
      plgpu.Barrier(num_barriers=num_resident),
      [plgpu.Barrier(num_barriers=stages) for _ in range(num_streams)],
  )


def _sweep(hidden, table, bias, scale, fixed_ids, fixed_values, *, plan, num_items,
           flags_wanted, interpret):
  """(loss sums [T] f32 or None, counts [T] int32 or None, dh [T, D] f32 or None)."""
  with_loss, with_counts, with_grad = flags_wanted
  geom = _geometry(hidden, table, plan, num_items, fixed_ids if with_grad else None)
  flags = _SweepFlags(bias is not None, with_loss, with_counts, with_grad)
  operands = _operands(hidden, table, bias, scale, fixed_ids, fixed_values, geom)
  inputs = [*operands.hidden, *operands.table]
  inputs += [x for x in (operands.bias,) if x is not None]
  if with_grad:
    inputs += [operands.scale] + ([operands.fixed_ids, operands.fixed_values]
                                  if geom.num_fixed else [])
  splits, tokens = geom.vocab_splits, geom.tokens_padded
  out_type = []
  if with_grad:
    out_type.append(jax.ShapeDtypeStruct((splits, tokens, geom.dim_padded), jnp.float32))
  out_type += [jax.ShapeDtypeStruct((splits, tokens), jnp.float32)] * (with_loss + with_counts)
  kernel = functools.partial(_sweep_kernel, geom=geom, flags=flags, interpret=interpret)
  kernel.__name__ = (f"cutbce_mosaic_sweep_{'loss_' if with_loss else ''}"
                     f"{'dh_' if with_grad else ''}bv{geom.block_v}_s{geom.stages}")
  outputs = iter(plgpu.kernel(
      kernel, out_type=out_type,
      grid=(geom.num_token_tiles, splits), grid_names=("tokens", "splits"),
      interpret=_interpret_params() if interpret else None,
  )(*inputs))
  num_tokens = geom.num_tokens
  dh = jnp.sum(next(outputs), axis=0)[:num_tokens, :geom.dim] if with_grad else None
  loss = jnp.sum(next(outputs), axis=0)[:num_tokens] if with_loss else None
  # Counts per split are exact in float32 (< 2^24); summed as integers.
  counts = (jnp.sum(next(outputs).astype(jnp.int32), axis=0)[:num_tokens] if with_counts
            else None)
  return loss, counts, dh


# --------------------------------------------------------------------------- #
# The table gradient: dE (and db) over vocab tiles.                            #
# --------------------------------------------------------------------------- #


def _token_rows(ref, tokens):
  return ref.at[tokens]


def _token_columns(ref, tokens):
  return ref.at[:, tokens]


def _table_kernel(*refs, geom: Geometry, has_bias: bool, interpret: bool):
  pl.run_scoped(functools.partial(_table_body, refs, geom=geom, has_bias=has_bias,
                                  interpret=interpret), *_table_scratch(geom, has_bias))


def _table_body(refs, *scratch, geom: Geometry, has_bias: bool, interpret: bool):
  pieces, num_fixed, stages = geom.pieces, geom.num_fixed, geom.table_stages
  refs = list(refs)
  hidden_refs = [refs.pop(0) for _ in range(pieces)]  # [Tp, Dp] bf16 each
  table_refs = [refs.pop(0) for _ in range(pieces)]  # [Vp, Dp] bf16 each
  bias_ref = refs.pop(0) if has_bias else None  # [Vp] f32
  scale_ref = refs.pop(0)  # [Tp] f32
  fixed_refs = (refs.pop(0), refs.pop(0)) if num_fixed else ()  # [K, Tp] int32, f32
  table_grad_ref = refs.pop(0)  # [Vp, Dp] f32
  bias_grad_ref = refs.pop(0) if has_bias else None  # [Vp] f32
  (table_smem, bias_smem, hidden_smem, scale_smem, fixed_smem, grad_smem, table_grad_smem,
   bias_grad_smem, resident_barrier, stream_barriers) = scratch

  vocab_start = lax.axis_index("vocab") * TABLE_BLOCK_V
  rows = pl.ds(vocab_start, TABLE_BLOCK_V)
  resident = [(ref.at[rows], smem) for ref, smem in zip(table_refs, table_smem)]
  if has_bias:
    resident.append((bias_ref.at[rows], bias_smem))
  for index, (src, dst) in enumerate(resident):
    plgpu.copy_gmem_to_smem(src, dst, resident_barrier.at[index])

  # Streams, one barrier array each: hidden pieces, g, fixed ids, fixed values
  # (the fixed columns are [K, Tp]: a token tile is a column block).
  streams = [(functools.partial(_token_rows, ref), smem)
             for ref, smem in zip(hidden_refs + [scale_ref], hidden_smem + [scale_smem])]
  streams += [(functools.partial(_token_columns, ref), smem)
              for ref, smem in zip(fixed_refs, fixed_smem or ())]

  def issue(tile, slot):  # token tile `tile` into buffer `slot`
    tokens = pl.ds(tile * BLOCK_T, BLOCK_T)
    for (source, smem), barrier in zip(streams, stream_barriers):
      plgpu.copy_gmem_to_smem(source(tokens), smem.at[slot], barrier.at[slot])

  num_tiles = geom.num_token_tiles
  for slot in range(min(stages, num_tiles)):
    issue(slot, slot)
  for index in range(len(resident)):
    plgpu.barrier_wait(resident_barrier.at[index])
  bias = ops.load_vector(bias_smem, ops.COLUMNS, interpret) if has_bias else None
  products = ops.PRODUCTS[pieces]

  def step(tile, carry):
    table_grad, bias_grad = carry
    slot = lax.rem(tile, stages)
    for barrier in stream_barriers:
      plgpu.barrier_wait(barrier.at[slot])
    hidden_tile = [smem.at[slot] for smem in hidden_smem]
    logits = ops.dot_nt(hidden_tile, table_smem, products, interpret)  # [64 tokens, 64 items]
    if has_bias:
      logits = logits + _columns(bias, logits.shape)
    scale = ops.load_vector(scale_smem.at[slot], ops.ROWS, interpret)
    fixed = [(ops.load_vector(fixed_smem[0].at[slot, k], ops.ROWS, interpret),
              ops.load_vector(fixed_smem[1].at[slot, k], ops.ROWS, interpret))
             for k in range(num_fixed)]
    # Made in the step, not held across it: a tile of indices is 32 registers.
    columns = vocab_start + ops.iota((BLOCK_T, TABLE_BLOCK_V), 1, interpret)
    _, _, grad = _tile(logits, columns, geom, scale=scale, fixed=fixed)
    if has_bias:
      bias_grad = bias_grad + jnp.sum(grad, axis=0)
    _store_pieces(grad, grad_smem)
    # dE += G^T H: [64 items, 64 tokens] x [64 tokens, Dp].
    table_grad = ops.dot_acc(table_grad, grad_smem, hidden_tile, products, interpret,
                             transpose_a=True)
    refill = tile + stages
    pl.when(refill < num_tiles)(lambda: issue(refill, slot))
    return table_grad, bias_grad

  init = (ops.zeros((TABLE_BLOCK_V, geom.dim_padded), ops.WGMMA, interpret),
          ops.zeros((TABLE_BLOCK_V,), ops.COLUMNS, interpret))
  table_grad, bias_grad = lax.fori_loop(0, num_tiles, step, init)
  table_grad_smem[...] = table_grad
  if has_bias:
    bias_grad_smem[...] = bias_grad
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(table_grad_smem, table_grad_ref.at[rows])
  if has_bias:
    plgpu.copy_smem_to_gmem(bias_grad_smem, bias_grad_ref.at[rows])
  plgpu.wait_smem_to_gmem(0)


def _table_scratch(geom: Geometry, has_bias: bool):
  pieces, stages, dim, fixed = geom.pieces, geom.table_stages, geom.dim_padded, geom.num_fixed
  return (
      [_smem((TABLE_BLOCK_V, dim), tiled=True) for _ in range(pieces)],  # table tile pieces
      _smem((TABLE_BLOCK_V,), jnp.float32) if has_bias else None,
      [_smem((stages, BLOCK_T, dim), tiled=True) for _ in range(pieces)],  # hidden pieces
      _smem((stages, BLOCK_T), jnp.float32),  # g
      (_smem((stages, fixed, BLOCK_T), jnp.int32), _smem((stages, fixed, BLOCK_T), jnp.float32))
      if fixed else None,
      [_smem((BLOCK_T, TABLE_BLOCK_V), tiled=True) for _ in range(pieces)],  # G pieces
      _smem((TABLE_BLOCK_V, dim), jnp.float32),  # dE staging
      _smem((TABLE_BLOCK_V,), jnp.float32) if has_bias else None,  # db staging
      plgpu.Barrier(num_barriers=pieces + has_bias),
      [plgpu.Barrier(num_barriers=stages) for _ in range(pieces + 1 + 2 * bool(fixed))],
  )


def _table_grad(hidden, table, bias, scale, fixed_ids, fixed_values, *, plan, num_items,
                interpret):
  """dE `[V, D]` f32 (rows past num_items 0) and db `[V]` f32 or None of the dense part."""
  geom = _geometry(hidden, table, plan, num_items, fixed_ids)
  has_bias = bias is not None
  operands = _operands(hidden, table, bias, scale, fixed_ids, fixed_values, geom)
  inputs = [*operands.hidden, *operands.table]
  inputs += [x for x in (operands.bias, operands.scale, operands.fixed_ids,
                         operands.fixed_values) if x is not None]
  out_type = [jax.ShapeDtypeStruct((geom.vocab_padded, geom.dim_padded), jnp.float32)]
  if has_bias:
    out_type.append(jax.ShapeDtypeStruct((geom.vocab_padded,), jnp.float32))
  kernel = functools.partial(_table_kernel, geom=geom, has_bias=has_bias, interpret=interpret)
  kernel.__name__ = f"cutbce_mosaic_table_grad_s{geom.table_stages}"
  outputs = plgpu.kernel(
      kernel, out_type=out_type, grid=(geom.vocab_padded // TABLE_BLOCK_V,), grid_names=("vocab",),
      interpret=_interpret_params() if interpret else None,
  )(*inputs)
  rows = table.shape[0]
  table_grad = _pad_to(outputs[0][:geom.num_items, :geom.dim], (rows, geom.dim))
  bias_grad = _pad_to(outputs[1][:geom.num_items], (rows,)) if has_bias else None
  return table_grad, bias_grad


# --------------------------------------------------------------------------- #
# The contract (cutbce/kernels/xla.py).                                        #
# --------------------------------------------------------------------------- #


@functools.partial(jax.named_call, name="cutbce_mosaic_forward")
def forward(hidden, table, bias, *, plan: TilePlan | None, with_counts: bool,
            options: LossOptions = variants.PLAIN, num_items: int | None = None):
  """sum_v phi(x_tv) `[T]` f32 and #{x_tv > 0} `[T]` int32 (or None)."""
  if not _takes(options, None):
    return triton.forward(hidden, table, bias, plan=None, with_counts=with_counts,
                          options=options, num_items=num_items)
  loss, counts, _ = _run(_sweep, hidden, table, bias, None, None, None, plan=plan,
                         num_items=num_items, flags_wanted=(True, with_counts, False))
  return loss, counts


def _sweeps(hidden, table, bias, scale, table_grad, bias_grad, fixed_ids, fixed_values, *, plan,
            num_items, with_loss, with_counts):
  if fixed_ids is not None and not fixed_ids.shape[-1]:
    fixed_ids = fixed_values = None
  loss, counts, hidden_grad = _run(
      _sweep, hidden, table, bias, scale, fixed_ids, fixed_values, plan=plan,
      num_items=num_items, flags_wanted=(with_loss, with_counts, True))
  dense_table_grad, dense_bias_grad = _run(
      _table_grad, hidden, table, bias, scale, fixed_ids, fixed_values, plan=plan,
      num_items=num_items)
  table_grad = table_grad + dense_table_grad
  if bias_grad is not None:
    bias_grad = bias_grad + dense_bias_grad
  return loss, counts, hidden_grad, table_grad, bias_grad


@functools.partial(jax.named_call, name="cutbce_mosaic_backward")
def backward(hidden, table, bias, scale, table_grad, bias_grad, fixed_ids=None,
             fixed_values=None, *, plan: TilePlan | None,
             options: LossOptions = variants.PLAIN, num_items: int | None = None):
  """dh `[T, D]` f32; `table_grad` (+ dense part) `[V, D]` f32; `bias_grad` `[V]` or None."""
  if not _takes(options, fixed_ids):
    return triton.backward(hidden, table, bias, scale, table_grad, bias_grad, fixed_ids,
                           fixed_values, plan=None, options=options, num_items=num_items)
  _, _, *grads = _sweeps(hidden, table, bias, scale, table_grad, bias_grad, fixed_ids,
                         fixed_values, plan=plan, num_items=num_items, with_loss=False,
                         with_counts=False)
  return tuple(grads)


@functools.partial(jax.named_call, name="cutbce_mosaic_forward_backward")
def forward_backward(hidden, table, bias, scale, table_grad, bias_grad, fixed_ids=None,
                     fixed_values=None, *, plan: TilePlan | None, with_counts: bool,
                     options: LossOptions = variants.PLAIN, num_items: int | None = None):
  """The sweep also sums phi and counts x > 0: one pass, 4 dots per tile in two kernels.

  Returns (dense_sum [T] f32, positive_count [T] int32 or None, dh, table_grad, bias_grad).
  """
  if not _takes(options, fixed_ids):
    return triton.forward_backward(hidden, table, bias, scale, table_grad, bias_grad,
                                   fixed_ids, fixed_values, plan=None, with_counts=with_counts,
                                   options=options, num_items=num_items)
  return _sweeps(hidden, table, bias, scale, table_grad, bias_grad, fixed_ids, fixed_values,
                 plan=plan, num_items=num_items, with_loss=True, with_counts=with_counts)
