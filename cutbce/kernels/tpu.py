"""Pallas TPU (Mosaic) kernels: logit tiles live only in VMEM, in both passes.

Honours the backend contract written in `cutbce/kernels/xla.py` (forward,
backward, rank_counts, default_plan) on flattened `[T, D]` tokens. How a
kernel runs is chosen when the program is lowered (`_run`): lowered for a
TPU it is compiled by Mosaic, lowered for any other platform it runs in
Pallas' interpreter (which fills out-of-bounds block reads with NaN, so a
missing mask shows up in tests). So one traced function runs on a CPU host
and exports for TPU (`jax.export.export(jax.jit(f), platforms=("tpu",))`)
with nothing else to set. Inside `tpu_interpret_mode()` (the kernel tests)
an off-TPU trace instead runs in TPU interpret mode, which also simulates
VMEM and the DMA pipeline; that trace cannot be exported for TPU, and inside
a `shard_map` over several devices it is not used (see `_run`).

The grids, block shapes, VMEM accounting and matmul counts are written down
in docs/kernels.md. In short: the token side is cut into chunks held in VMEM
for a whole vocabulary sweep (the table is read once per chunk) and walked in
`[block_t, block_v]` float32 logit tiles; D is taken whole; the ragged last
vocab tile (table rows and logit columns past V) and the ragged token count
(rows past T, where tokens are contracted) are masked in the kernel.

  forward      grid (chunks "parallel", vocab tiles "arbitrary"), 1 matmul
               per tile; per-token sums accumulate in `[chunk, 1]` output blocks.
  backward     one call per chunk, grid (vocab tiles "arbitrary"), or on a
               megacore chip (v4, v5p) (cores "parallel", tiles per core
               "arbitrary"): each TensorCore its own dE rows and its own dh
               partial, summed after the call. 3 matmuls
               per tile (logits, G @ E, G^T @ H); dh accumulates in a resident
               f32 `[chunk, D]` output block written once, dE in a
               `[block_v, D]` f32 block written once per step, updated in place
               over the given sparse part (`input_output_aliases`). No HBM
               buffer grows with the number of vocab tiles; nothing is T x V.
  rank_counts  grid (chunks "parallel", vocab tiles "arbitrary"), 1 matmul
               and L comparisons per tile, counts in a `[chunk, L]` block.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from cutbce import variants
from cutbce.kernels import matmul, numerics, tiling
from cutbce.kernels.tiling import TilePlan
from cutbce.kernels.xla import SOFTMAX_FLOOR
from cutbce.variants import LossOptions

SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
# Targets per rank-kernel call: its comparison loop over L is unrolled, so
# wider rows are split into groups of this many (one table sweep per group).
MAX_RANK_TARGETS = tiling.LANES
NT_DIMS = (((1,), (1,)), ((), ()))  # [M, K] x [N, K] -> [M, N]


_TPU_INTERPRET = threading.local()


@contextlib.contextmanager
def tpu_interpret_mode(enabled: bool = True):
  """Off a TPU, traces the kernels in TPU interpret mode (`pltpu.InterpretParams()`).

  TPU interpret mode simulates VMEM, the DMA pipeline and Mosaic's
  semantics on CPU, closer to a TPU than Pallas' generic interpreter, which
  kernels use by default off a TPU. A function traced inside this context
  runs only off a TPU (it cannot be exported for TPU).
  """
  previous = getattr(_TPU_INTERPRET, "on", False)
  _TPU_INTERPRET.on = enabled
  try:
    yield
  finally:
    _TPU_INTERPRET.on = previous


_VMEM_CHECK = threading.local()


@contextlib.contextmanager
def unchecked_vmem_limit():
  """Plans whose VMEM estimate exceeds their `vmem_limit_bytes` are let through.

  For measuring what Mosaic really needs (`benchmarks/tpu_vmem.py`): compile a
  plan with a limit far below its need, and the compiler's error names the
  kernel's whole scoped allocation (`compiler.scoped_vmem_bytes`). Never for
  running: a plan over its limit fails to compile.
  """
  previous = getattr(_VMEM_CHECK, "off", False)
  _VMEM_CHECK.off = True
  try:
    yield
  finally:
    _VMEM_CHECK.off = previous


def _manual_devices() -> int:
  """Devices of the `jax.shard_map` being traced (1 outside any shard_map)."""
  mesh = jax.sharding.get_abstract_mesh()
  size = 1
  for axis in getattr(mesh, "manual_axes", ()):
    size *= mesh.shape[axis]
  return size


def _run(impl, *operands, **static):
  """`impl(*operands, interpret=..., **static)`, compiled or interpreted by platform.

  On a TPU: compiled. Elsewhere: a `lax.platform_dependent` resolved when the
  program is lowered (both calls are traced, only the lowering platform's is
  lowered): Mosaic for TPU, Pallas' generic interpreter (`interpret=True`,
  no host callbacks, no effects) for anything else. Inside
  `tpu_interpret_mode()` and outside a multi-device `shard_map`, TPU
  interpret mode instead: it runs every grid step as host callbacks, and on
  several simulated CPU devices those deadlock (the CPU client copies a
  callback's argument of 100 KiB or more on the thread pool that runs the
  devices, which all wait at the interpreter's per-call barrier; see
  docs/kernels.md). None operands (an absent bias) stay out of the branches.
  """
  if jax.default_backend() == "tpu":
    return impl(*operands, interpret=False, **static)
  if getattr(_TPU_INTERPRET, "on", False) and _manual_devices() == 1:
    return impl(*operands, interpret=pltpu.InterpretParams(), **static)
  present = [x for x in operands if x is not None]

  def branch(interpret):
    def call(*arrays):
      arrays = iter(arrays)
      return impl(*(None if x is None else next(arrays) for x in operands),
                  interpret=interpret, **static)
    return call

  return lax.platform_dependent(*present, tpu=branch(False), default=branch(True))


def _cdiv(a: int, b: int) -> int:
  return -(-a // b)


# --------------------------------------------------------------------------- #
# Support checks and plans.                                                    #
# --------------------------------------------------------------------------- #


def unsupported_reason(num_tokens, vocab, dim, hidden_dtype, table_dtype, plan=None) -> str | None:
  """Why these inputs cannot run on the TPU kernels, or None when they can.

  Hidden and table of different float dtypes are cast to their common type
  (bf16 hidden with an f32 table runs in f32), not refused.
  """
  dtype = jnp.result_type(jnp.dtype(hidden_dtype), jnp.dtype(table_dtype))
  if dtype not in SUPPORTED_DTYPES:
    return (
        "the Pallas TPU kernels compute in float32 or bfloat16; got hidden "
        f"{jnp.dtype(hidden_dtype)} and table {jnp.dtype(table_dtype)} (common type {dtype})"
    )
  if num_tokens < 1:
    return f"the Pallas TPU kernels need at least one token, got T={num_tokens}"
  if plan is None:
    for kernel in ("forward", "backward"):
      try:
        tiling.plan_tiles(num_tokens, vocab, dim, dtype, kernel=kernel)
      except ValueError as error:
        return str(error)
  return None


def plan_problem(num_tokens, vocab, dim, dtype, plan: TilePlan) -> str | None:
  """Why `plan` cannot tile these shapes on the three kernels (layout, VMEM), or None."""
  hidden = jax.ShapeDtypeStruct((num_tokens, dim), dtype)
  table = jax.ShapeDtypeStruct((vocab, dim), dtype)
  for kernel in ("forward", "backward", "ranks"):
    try:
      _geometry(plan, hidden, table, kernel)
    except (ValueError, NotImplementedError) as error:
      return str(error)
  return None


def _check_supported(hidden, table, plan=None):
  reason = unsupported_reason(
      hidden.shape[0], table.shape[0], table.shape[1], hidden.dtype, table.dtype, plan
  )
  if reason is not None:
    raise NotImplementedError(reason)


def _common_dtype(hidden, table):
  """Hidden and table cast to their common dtype (a no-op when they agree)."""
  dtype = jnp.result_type(hidden.dtype, table.dtype)
  return hidden.astype(dtype), table.astype(dtype)


def _extra_logit_tiles(options: LossOptions) -> int:
  """VMEM temporaries a variant adds per logit tile (see `tiling.vmem_estimate`)."""
  return 0 if options.is_affine else 2


def default_plan(kernel: str, num_tokens: int, vocab: int, dim: int, dtype,
                 num_targets: int = 1, options: LossOptions = variants.PLAIN,
                 extra_logit_tiles: int | None = None) -> TilePlan:
  """`tiling.plan_tiles` of one kernel for the attached TPU (the default chip off-TPU).

  Raises:
    NotImplementedError: the dtype is not float32/bfloat16 or no plan fits.
  """
  if jnp.dtype(dtype) not in SUPPORTED_DTYPES:
    raise NotImplementedError(
        f"the Pallas TPU kernels take float32 or bfloat16, got {jnp.dtype(dtype)}"
    )
  try:
    return tiling.plan_tiles(
        num_tokens, vocab, dim, dtype, kernel=kernel, num_targets=num_targets,
        extra_logit_tiles=(_extra_logit_tiles(options) if extra_logit_tiles is None
                           else extra_logit_tiles),
    )
  except ValueError as error:
    raise NotImplementedError(str(error)) from error


class _Geometry(NamedTuple):
  """Static tiling of one call, after clamping the plan to the shapes."""

  num_tokens: int  # T
  vocab: int  # num_items: rows walked (the table's rows past it are never used)
  chunk: int  # token rows per chunk (a multiple of block_t)
  block_t: int  # token rows per logit tile
  block_v: int  # vocab rows per grid step (the table's V when one tile covers it)
  num_chunks: int
  num_subtiles: int  # chunk // block_t
  num_vocab_tiles: int
  vmem_limit_bytes: int
  # Backward only: TensorCores the vocabulary sweep is split over (2 on a
  # megacore chip, v4 and v5p, when there are two tiles or more; else 1).
  cores: int = 1

  @property
  def ragged_vocab(self) -> bool:
    return self.vocab % self.block_v != 0

  @property
  def tiles_per_core(self) -> int:
    """Vocab tiles each core sweeps (the last core's last step may be past V: skipped)."""
    return _cdiv(self.num_vocab_tiles, self.cores)


def _geometry(plan: TilePlan | None, hidden, table, kernel: str, num_targets: int = 0, *,
              num_items: int | None = None, options: LossOptions = variants.PLAIN,
              softmax: "_Softmax | None" = None, with_loss: bool = True) -> _Geometry:
  """Clamps `plan` to the shapes, checks layout legality and the VMEM estimate.

  With `plan=None` the kernel plans for itself (`default_plan` of `kernel`).

  Raises:
    ValueError: the plan breaks a layout rule or its estimate exceeds its VMEM
      limit (the message names the plan, shapes and budget).
  """
  num_tokens, (rows, dim) = hidden.shape[0], table.shape
  vocab = rows if num_items is None else num_items
  itemsize = hidden.dtype.itemsize
  extra_tiles = _extra_logit_tiles(options) if softmax is None else SOFTMAX_EXTRA_TILES
  if plan is None or plan.block_t is None or plan.token_chunk is None or plan.vmem_limit_bytes is None:
    # Fields left None are taken from the planner's plan of this kernel.
    planned = default_plan(kernel, num_tokens, vocab, dim, hidden.dtype,
                           num_targets=max(num_targets, 1), options=options,
                           extra_logit_tiles=extra_tiles)
    plan = plan or planned
    block_t = plan.block_t or planned.block_t
    plan = TilePlan(
        block_v=plan.block_v,
        block_t=block_t,
        token_chunk=plan.token_chunk or max(planned.token_chunk // block_t, 1) * block_t,
        vmem_limit_bytes=plan.vmem_limit_bytes or planned.vmem_limit_bytes,
    )
  sublanes = tiling.sublane_rows(itemsize)
  problems = []
  if plan.block_v % tiling.LANES:
    problems.append(f"block_v={plan.block_v} is not a multiple of {tiling.LANES}")
  if plan.block_t % sublanes:
    problems.append(f"block_t={plan.block_t} is not a multiple of {sublanes} for {hidden.dtype}")
  if plan.token_chunk % plan.block_t:
    problems.append(f"token_chunk={plan.token_chunk} is not a multiple of block_t={plan.block_t}")
  if problems:
    raise ValueError(f"TilePlan {plan} cannot tile T={num_tokens}, V={vocab}: " + "; ".join(problems))
  block_t = min(plan.block_t, tiling._round_up(num_tokens, sublanes))  # pylint: disable=protected-access
  chunk = min(plan.token_chunk, tiling._round_up(num_tokens, block_t))  # pylint: disable=protected-access
  chunk = chunk // block_t * block_t
  if plan.block_v < vocab:
    block_v = plan.block_v
  else:
    # One tile covers the items: the whole table, or (when rows past
    # num_items follow) the items rounded up to whole lanes.
    block_v = min(tiling._round_up(vocab, tiling.LANES), rows)  # pylint: disable=protected-access
    block_v = rows if block_v >= rows else block_v
  num_vocab_tiles = _cdiv(vocab, block_v)
  # The backward's vocab axis carries dh, so it is "arbitrary": on a megacore
  # chip it is cut into one slice per TensorCore, a "parallel" axis of its own.
  cores = tiling.tensor_cores() if kernel == "backward" and num_vocab_tiles > 1 else 1
  estimate = tiling.vmem_estimate(
      kernel, token_chunk=chunk, block_t=block_t, block_v=block_v, dim=dim,
      itemsize=itemsize, num_targets=max(num_targets, 1), extra_logit_tiles=extra_tiles,
      num_tokens=num_tokens, cores=cores, with_loss=with_loss,
  )
  if estimate > plan.vmem_limit_bytes and not getattr(_VMEM_CHECK, "off", False):
    raise ValueError(
        f"TilePlan {plan} needs {estimate / tiling.MIB:.1f} MiB of VMEM for the {kernel} "
        f"kernel at T={num_tokens}, V={vocab}, D={dim}, {hidden.dtype}, over its "
        f"vmem_limit_bytes of {plan.vmem_limit_bytes / tiling.MIB:.1f} MiB"
    )
  return _Geometry(
      num_tokens=num_tokens, vocab=vocab, chunk=chunk, block_t=block_t, block_v=block_v,
      num_chunks=_cdiv(num_tokens, chunk), num_subtiles=chunk // block_t,
      num_vocab_tiles=num_vocab_tiles, vmem_limit_bytes=plan.vmem_limit_bytes, cores=cores,
  )


def _compiler_params(geom: _Geometry, semantics):
  return pltpu.CompilerParams(
      dimension_semantics=semantics, vmem_limit_bytes=geom.vmem_limit_bytes
  )


# --------------------------------------------------------------------------- #
# Pieces shared by the kernel bodies.                                          #
# --------------------------------------------------------------------------- #


def _table_tile(table_ref, vocab_index, geom: _Geometry):
  """`[block_v, D]` table tile with rows past V zeroed on the ragged last tile."""
  table = table_ref[...]
  if not geom.ragged_vocab:
    return table
  rows = vocab_index * geom.block_v + lax.broadcasted_iota(jnp.int32, (geom.block_v, 1), 0)
  return jnp.where(rows < geom.vocab, table, jnp.zeros_like(table))


def _column_ids(vocab_index, geom: _Geometry):
  """`[1, block_v]` int32 item ids of the tile's columns."""
  return vocab_index * geom.block_v + lax.broadcasted_iota(jnp.int32, (1, geom.block_v), 1)


def _tile_logits(hidden, table, bias_ref):
  """`[block_t, block_v]` float32 logits h . e (+ b) on the MXU."""
  logits = lax.dot_general(hidden, table, NT_DIMS, preferred_element_type=jnp.float32,
                           precision=matmul.precision(hidden, table))
  if bias_ref is not None:
    logits = logits + bias_ref[...]  # [1, block_v] f32
  return logits


def _row_slice(subtile, geom: _Geometry):
  if geom.num_subtiles == 1:
    return slice(None)
  return pl.ds(pl.multiple_of(subtile * geom.block_t, geom.block_t), geom.block_t)


def _for_each_subtile(count: int, body):
  """Runs `body(subtile)` for subtile in [0, count): unrolled when count is 1."""
  if count == 1:
    body(0)
    return

  def step(subtile, carry):
    body(subtile)
    return carry

  lax.fori_loop(0, count, step, 0)


# --------------------------------------------------------------------------- #
# Forward.                                                                     #
# --------------------------------------------------------------------------- #


def _forward_kernel(*refs, geom: _Geometry, has_bias: bool, with_counts: bool,
                    options: LossOptions):
  refs = list(refs)
  hidden_ref = refs.pop(0)  # [chunk, D]
  table_ref = refs.pop(0)  # [block_v, D]
  bias_ref = refs.pop(0) if has_bias else None  # [1, block_v] f32
  softplus_ref = refs.pop(0)  # [chunk, 1] f32, resident along the vocab axis
  count_ref = refs.pop(0) if with_counts else None  # [chunk, 1] int32
  vocab_index = pl.program_id(1)

  @pl.when(vocab_index == 0)
  def init():
    softplus_ref[...] = jnp.zeros_like(softplus_ref)
    if with_counts:
      count_ref[...] = jnp.zeros_like(count_ref)

  table = _table_tile(table_ref, vocab_index, geom)  # [block_v, D]
  valid = _column_ids(vocab_index, geom) < geom.vocab if geom.ragged_vocab else None

  def accumulate(subtile):
    rows = _row_slice(subtile, geom)
    logits = _tile_logits(hidden_ref[rows, :], table, bias_ref)  # [block_t, block_v]
    # phi(x): softplus(x) = max(x, 0) + log1p(e^-|x|) for plain BCE (no
    # overflow, log1p keeps the tail accurate), f(x, 0) of a variant otherwise.
    dense = variants.tile_value(options, logits)
    if valid is not None:
      dense = jnp.where(valid, dense, 0.0)
    # Row sums in float32: each tile adds at most block_v terms to the
    # per-token total, itself float32 across tiles.
    softplus_ref[rows, :] += jnp.sum(dense, axis=1, keepdims=True)
    if with_counts:
      positive = logits > 0.0
      if valid is not None:
        positive = positive & valid
      # Summed as float32 (exact up to 2^24 > block_v), stored as int32.
      count_ref[rows, :] += jnp.sum(
          positive.astype(jnp.float32), axis=1, keepdims=True
      ).astype(jnp.int32)

  _for_each_subtile(geom.num_subtiles, accumulate)


def _token_by_vocab_inputs(geom, hidden, table, bias):
  """Specs and operands of a (token chunks, vocab tiles) grid: hidden, table, bias.

  The forward and rank kernels walk the same grid: a `[chunk, D]` hidden block
  that stays put along the vocab axis, a `[block_v, D]` table block per step
  and, with a bias, its `[1, block_v]` float32 slice.
  """
  dim = hidden.shape[1]
  in_specs = [
      pl.BlockSpec((geom.chunk, dim), _token_index_map),
      pl.BlockSpec((geom.block_v, dim), lambda chunk, tile: (tile, 0)),
  ]
  operands = [hidden, table]
  if bias is not None:
    in_specs.append(pl.BlockSpec((1, geom.block_v), lambda chunk, tile: (0, tile)))
    operands.append(bias.astype(jnp.float32).reshape(1, -1))
  return in_specs, operands


def _token_index_map(chunk, tile):
  del tile
  return chunk, 0


@functools.partial(jax.named_call, name="cutbce_tpu_forward")
def forward(hidden, table, bias, *, plan: TilePlan | None, with_counts: bool,
            options: LossOptions = variants.PLAIN, num_items: int | None = None):
  """sum_v phi(x_tv) `[T]` f32 and #{x_tv > 0} `[T]` int32 (or None)."""
  return _run(_forward, hidden, table, bias, plan=plan, with_counts=with_counts,
              options=options, num_items=num_items)


def _forward(hidden, table, bias, *, plan, with_counts, options, num_items, interpret):
  _check_supported(hidden, table, plan)
  hidden, table = _common_dtype(hidden, table)
  geom = _geometry(plan, hidden, table, "forward", num_items=num_items, options=options)
  num_tokens, dim = hidden.shape
  has_bias = bias is not None
  in_specs, operands = _token_by_vocab_inputs(geom, hidden, table, bias)
  token_spec = pl.BlockSpec((geom.chunk, 1), _token_index_map)
  out_specs = [token_spec]
  out_shape = [jax.ShapeDtypeStruct((num_tokens, 1), jnp.float32)]
  if with_counts:
    out_specs.append(token_spec)
    out_shape.append(jax.ShapeDtypeStruct((num_tokens, 1), jnp.int32))
  vocab = geom.vocab
  outputs = pl.pallas_call(
      functools.partial(_forward_kernel, geom=geom, has_bias=has_bias, with_counts=with_counts,
                        options=options),
      grid=(geom.num_chunks, geom.num_vocab_tiles),
      in_specs=in_specs,
      out_specs=out_specs,
      out_shape=out_shape,
      compiler_params=_compiler_params(geom, (pltpu.PARALLEL, pltpu.ARBITRARY)),
      cost_estimate=pl.CostEstimate(
          flops=2 * num_tokens * vocab * dim,
          transcendentals=2 * num_tokens * vocab,
          bytes_accessed=geom.num_chunks * table.size * table.dtype.itemsize
          + hidden.size * hidden.dtype.itemsize,
      ),
      interpret=interpret,
      name=f"cutbce_forward_bt{geom.block_t}_bv{geom.block_v}_chunk{geom.chunk}",
  )(*operands)
  softplus_sum = outputs[0][:, 0]
  positive_count = outputs[1][:, 0] if with_counts else None
  return softplus_sum, positive_count


# --------------------------------------------------------------------------- #
# Backward.                                                                    #
# --------------------------------------------------------------------------- #


def _backward_kernel(*refs, geom: _Geometry, rows_in_chunk: int, has_bias: bool,
                     options: LossOptions, with_loss: bool, with_counts: bool,
                     softmax: "_Softmax | None" = None, num_fixed: int = 0):
  refs = list(refs)
  hidden_ref = refs.pop(0)  # [chunk, D]
  scale_ref = refs.pop(0)  # [chunk, 1] f32, g_t
  # Softmax CE: lse_t, the excluded ids and the shard's real rows (see _Softmax).
  log_z_ref = refs.pop(0) if softmax else None  # [chunk, 1] f32
  offset_ref = refs.pop(0) if softmax and softmax.offset else None  # [chunk, 1] f32
  exclude_ref = refs.pop(0) if softmax and softmax.num_exclude else None  # [chunk, E] int32
  valid_rows_ref = refs.pop(0) if softmax and softmax.valid_rows else None  # [1, 1] int32
  # The fixed columns (see xla.py): ids and the f32 logit gradient set there.
  fixed_ids_ref = refs.pop(0) if num_fixed else None  # [chunk, K] int32, -1 for none
  fixed_values_ref = refs.pop(0) if num_fixed else None  # [chunk, K] f32
  table_ref = refs.pop(0)  # [block_v, D]
  bias_ref = refs.pop(0) if has_bias else None  # [1, block_v] f32
  table_grad_in_ref = refs.pop(0)  # [block_v, D] f32, the given (sparse) part
  bias_grad_in_ref = refs.pop(0) if has_bias else None  # [1, block_v] f32
  # dh and the per-token sums: this core's partial (summed over cores after
  # the call), resident along its sweep. dE: its own rows, no partial.
  hidden_grad_ref = refs.pop(0)  # [chunk, D] f32 accumulator, resident all sweep
  table_grad_ref = refs.pop(0)  # [block_v, D] f32, written once per step
  bias_grad_ref = refs.pop(0) if has_bias else None  # [1, block_v] f32
  # One pass only: per-token sums, resident along the vocab axis like dh.
  dense_ref = refs.pop(0) if with_loss else None  # [chunk, 1] f32
  count_ref = refs.pop(0) if with_counts else None  # [chunk, 1] int32
  if geom.cores == 1:
    step = vocab_index = pl.program_id(0)
  else:  # grid (cores "parallel", tiles per core "arbitrary")
    step = pl.program_id(1)
    vocab_index = pl.program_id(0) * geom.tiles_per_core + step

  @pl.when(step == 0)
  def init():
    hidden_grad_ref[...] = jnp.zeros_like(hidden_grad_ref)
    if with_loss:
      dense_ref[...] = jnp.zeros_like(dense_ref)
    if with_counts:
      count_ref[...] = jnp.zeros_like(count_ref)

  tile = functools.partial(
      _backward_tile,
      refs=(hidden_ref, scale_ref, log_z_ref, offset_ref, exclude_ref, valid_rows_ref,
            fixed_ids_ref, fixed_values_ref, table_ref, bias_ref, table_grad_in_ref,
            bias_grad_in_ref, hidden_grad_ref, table_grad_ref, bias_grad_ref, dense_ref,
            count_ref),
      geom=geom, rows_in_chunk=rows_in_chunk, options=options, with_loss=with_loss,
      with_counts=with_counts, softmax=softmax, num_fixed=num_fixed)
  if geom.cores * geom.tiles_per_core == geom.num_vocab_tiles:
    tile(vocab_index)
    return

  # An odd tile count: the last core's last step maps to its previous tile
  # (see `_backward`'s index maps), whose blocks stay resident; it does nothing.
  @pl.when(vocab_index < geom.num_vocab_tiles)
  def sweep():
    tile(vocab_index)


def _backward_tile(vocab_index, *, refs, geom: _Geometry, rows_in_chunk: int,
                   options: LossOptions, with_loss: bool, with_counts: bool,
                   softmax: "_Softmax | None", num_fixed: int):
  """One vocab tile of the backward: dE's tile, and dh (and the sums) accumulated."""
  (hidden_ref, scale_ref, log_z_ref, offset_ref, exclude_ref, valid_rows_ref, fixed_ids_ref,
   fixed_values_ref, table_ref, bias_ref, table_grad_in_ref, bias_grad_in_ref, hidden_grad_ref,
   table_grad_ref, bias_grad_ref, dense_ref, count_ref) = refs
  has_bias = bias_ref is not None
  compute_dtype = table_ref.dtype
  table = _table_tile(table_ref, vocab_index, geom)  # [block_v, D]
  valid = _column_ids(vocab_index, geom) < geom.vocab if geom.ragged_vocab else None
  if softmax:
    valid = _softmax_columns(vocab_index, geom, valid_rows_ref)
  table_grad_ref[...] = table_grad_in_ref[...]
  if has_bias:
    bias_grad_ref[...] = bias_grad_in_ref[...]

  def accumulate(subtile, valid_rows=None):
    rows = _row_slice(subtile, geom)
    hidden = hidden_ref[rows, :]  # [block_t, D]
    scale = scale_ref[rows, :]  # [block_t, 1]
    if valid_rows is not None:
      # Rows past T hold garbage: zero them before they are contracted.
      row_ok = lax.broadcasted_iota(jnp.int32, (geom.block_t, 1), 0) < valid_rows
      hidden = jnp.where(row_ok, hidden, jnp.zeros_like(hidden))
      scale = jnp.where(row_ok, scale, 0.0)
    logits = _tile_logits(hidden, table, bias_ref)  # [block_t, block_v] f32
    # d l_t / d x_tv of the dense background is phi'(x_tv) (sigmoid for
    # plain BCE), times g_t; for the softmax, p_tv = exp(x_tv - lse_t).
    if softmax:
      keep = _softmax_keep(vocab_index, geom, valid, exclude_ref, rows, softmax)
      log_z = log_z_ref[rows, :]  # [block_t, 1]
      if valid_rows is not None:
        log_z = jnp.where(row_ok, log_z, 0.0)  # garbage rows past T: finite, scale 0
      p = jnp.where(keep, jnp.exp(jnp.where(keep, logits - log_z, 0.0)), 0.0)
      if offset_ref is not None:
        offset = offset_ref[rows, :]  # [block_t, 1]
        if valid_rows is not None:
          offset = jnp.where(row_ok, offset, 0.0)
        # G = g p - o: scale * (p - o / g) would divide by g; o is added below.
        derivative = jnp.where(keep, scale * p - offset, 0.0)
      else:
        derivative = scale * p
    elif with_loss:
      value, derivative = variants.tile_value_and_grad(options, logits)
      if valid is not None:
        value = jnp.where(valid, value, 0.0)
      dense_ref[rows, :] += jnp.sum(value, axis=1, keepdims=True)  # [block_t, 1]
      if with_counts:
        positive = logits > 0.0
        if valid is not None:
          positive = positive & valid
        count_ref[rows, :] += jnp.sum(
            positive.astype(jnp.float32), axis=1, keepdims=True).astype(jnp.int32)
    else:
      derivative = variants.tile_grad(options, logits, sigmoid=variants.sigmoid_from_exp)
    grad = derivative if softmax else scale * derivative  # [block_t, block_v] f32
    if valid is not None and not softmax:
      grad = jnp.where(valid, grad, 0.0)
    if num_fixed:
      # Set in f32, before the cast for the MXU: exact targets' terms.
      columns = _column_ids(vocab_index, geom)  # [1, block_v]
      fixed_ids = fixed_ids_ref[rows, :]  # [block_t, K]
      fixed_values = fixed_values_ref[rows, :]  # [block_t, K]
      if valid_rows is not None:
        fixed_ids = jnp.where(row_ok, fixed_ids, -1)
        fixed_values = jnp.where(row_ok, fixed_values, 0.0)
      for k in range(num_fixed):  # K is small and static: unrolled
        fixed = columns == fixed_ids[:, k:k + 1]
        grad = jnp.where(fixed, fixed_values[:, k:k + 1], grad)
        if softmax and with_loss:
          p = jnp.where(fixed, 0.0, p)
    if softmax and with_loss:
      # The mass of the p dh is made of, the fixed columns' not counted (see xla.py).
      if valid_rows is not None:
        p = jnp.where(row_ok, p, 0.0)
      dense_ref[rows, :] += jnp.sum(p, axis=1, keepdims=True)  # [block_t, 1]
    grad_mxu = grad.astype(compute_dtype)
    hidden_grad_ref[rows, :] += lax.dot(
        grad_mxu, table, preferred_element_type=jnp.float32,
        precision=matmul.precision(grad_mxu, table),
    )  # [block_t, D]
    table_grad_ref[...] += lax.dot(
        grad_mxu.T, hidden, preferred_element_type=jnp.float32,
        precision=matmul.precision(grad_mxu, hidden),
    )  # [block_v, D]
    if has_bias:
      bias_grad_ref[...] += jnp.sum(grad, axis=0, keepdims=True)  # [1, block_v]

  # Static per call: sub-tiles wholly inside T run unmasked, the one
  # straddling T (last chunk only) masks its rows, those past T are skipped.
  full, rest = divmod(rows_in_chunk, geom.block_t)
  if full:
    _for_each_subtile(full, accumulate)
  if rest:
    accumulate(full, valid_rows=rest)


@functools.partial(jax.named_call, name="cutbce_tpu_backward")
def backward(hidden, table, bias, scale, table_grad, bias_grad, fixed_ids=None,
             fixed_values=None, *, plan: TilePlan | None,
             options: LossOptions = variants.PLAIN, num_items: int | None = None):
  """dh `[T, D]` f32; `table_grad` (+ dense part) `[V, D]` f32; `bias_grad` `[V]` or None."""
  _, _, *grads = _run(_backward, hidden, table, bias, scale, table_grad, bias_grad,
                      None, None, None, None, fixed_ids, fixed_values, plan=plan,
                      options=options, num_items=num_items, with_loss=False, with_counts=False)
  return tuple(grads)


@functools.partial(jax.named_call, name="cutbce_tpu_forward_backward")
def forward_backward(hidden, table, bias, scale, table_grad, bias_grad, fixed_ids=None,
                     fixed_values=None, *, plan: TilePlan | None, with_counts: bool,
                     options: LossOptions = variants.PLAIN, num_items: int | None = None):
  """The backward kernel that also sums phi and counts x > 0: one pass, 3 matmuls per tile.

  Returns (dense_sum [T] f32, positive_count [T] int32 or None, dh, table_grad, bias_grad).
  """
  return _run(_backward, hidden, table, bias, scale, table_grad, bias_grad,
              None, None, None, None, fixed_ids, fixed_values, plan=plan,
              options=options, num_items=num_items, with_loss=True, with_counts=with_counts)


def _backward(hidden, table, bias, scale, table_grad, bias_grad, log_z=None, offset=None,
              exclude_ids=None, valid_rows=None, fixed_ids=None, fixed_values=None, *, plan, options, num_items, with_loss, with_counts, interpret,
              softmax=None):
  _check_supported(hidden, table, plan)
  hidden, table = _common_dtype(hidden, table)
  geom = _geometry(plan, hidden, table, "backward", num_items=num_items, options=options,
                   softmax=softmax, with_loss=with_loss or with_counts)
  num_tokens, dim = hidden.shape
  vocab = table.shape[0]
  has_bias = bias is not None
  scale = scale.astype(jnp.float32).reshape(num_tokens, 1)
  table_grad = table_grad.astype(jnp.float32)
  bias_row = bias.astype(jnp.float32).reshape(1, vocab) if has_bias else None
  bias_grad_row = bias_grad.astype(jnp.float32).reshape(1, vocab) if has_bias else None
  # Interpret mode in this jax returns an aliased output at its padded shape
  # when the block does not divide it; there (and only there) the ragged
  # case takes the gradient through a fresh output instead. Same kernel,
  # same numerics; compiled on a TPU the update is always in place.
  alias = not (interpret is not False and vocab % geom.block_v)
  walked_rows = geom.num_vocab_tiles * geom.block_v  # rows past it: never visited
  given_table_grad, given_bias_grad = table_grad, bias_grad_row
  num_fixed = 0 if fixed_ids is None else fixed_ids.shape[1]
  hidden_grads, dense_sums, positive_counts = [], [], []

  cores, per_core = geom.cores, geom.tiles_per_core
  if cores == 1:
    grid, semantics = (geom.num_vocab_tiles,), (pltpu.ARBITRARY,)
    tile_of = lambda tile: tile  # noqa: E731
  else:
    # Megacore (v4, v5p): core c sweeps tiles [c * per_core, (c + 1) * per_core),
    # writing its own dE rows and its own dh partial. An odd tile count leaves
    # the last core one step past V: it maps to the core's previous tile.
    grid, semantics = (cores, per_core), (pltpu.PARALLEL, pltpu.ARBITRARY)
    tile_of = lambda core, step: jnp.minimum(  # noqa: E731
        core * per_core + step, geom.num_vocab_tiles - 1)
  # A core's partials (dh, the sums): a [cores, rows, ...] output, one block each.
  partial = (lambda *shape: shape) if cores == 1 else (lambda *shape: (cores,) + shape)
  partial_block = (lambda *shape: shape) if cores == 1 else (
      lambda *shape: (pl.Squeezed(),) + shape)
  partial_map = (lambda *ids: (0, 0)) if cores == 1 else (lambda core, step: (core, 0, 0))

  for chunk in range(geom.num_chunks):  # the outer loop over token chunks
    rows_in_chunk = min(geom.chunk, num_tokens - chunk * geom.chunk)
    hidden_index_map = lambda *ids, chunk=chunk: (chunk, 0)
    table_index_map = lambda *ids: (tile_of(*ids), 0)
    bias_index_map = lambda *ids: (0, tile_of(*ids))
    in_specs = [
        pl.BlockSpec((geom.chunk, dim), hidden_index_map),
        pl.BlockSpec((geom.chunk, 1), hidden_index_map),
        pl.BlockSpec((geom.block_v, dim), table_index_map),
    ]
    operands = [hidden, scale]
    if softmax:
      softmax_specs, softmax_operands = _softmax_inputs(
          geom, softmax, hidden_index_map, lambda *ids: (0, 0), exclude_ids, valid_rows)
      vectors = [log_z] + ([offset] if softmax.offset else [])
      in_specs[2:2] = [pl.BlockSpec((geom.chunk, 1), hidden_index_map)] * len(vectors)
      in_specs[2 + len(vectors):2 + len(vectors)] = softmax_specs
      operands += [v.astype(jnp.float32).reshape(num_tokens, 1) for v in vectors]
      operands += softmax_operands
    if num_fixed:
      in_specs[-1:-1] = [pl.BlockSpec((geom.chunk, num_fixed), hidden_index_map)] * 2
      operands += [fixed_ids.astype(jnp.int32), fixed_values.astype(jnp.float32)]
    operands.append(table)
    if has_bias:
      in_specs.append(pl.BlockSpec((1, geom.block_v), bias_index_map))
      operands.append(bias_row)
    aliases = {len(operands): 1}  # given table_grad -> dE output, updated in place
    in_specs.append(pl.BlockSpec((geom.block_v, dim), table_index_map))
    operands.append(table_grad)
    if has_bias:
      aliases[len(operands)] = 2
      in_specs.append(pl.BlockSpec((1, geom.block_v), bias_index_map))
      operands.append(bias_grad_row)
    out_specs = [
        # This chunk's dh (per core): one block, constant index, resident for the sweep.
        pl.BlockSpec(partial_block(geom.chunk, dim), partial_map),
        pl.BlockSpec((geom.block_v, dim), table_index_map),
    ]
    out_shape = [
        jax.ShapeDtypeStruct(partial(rows_in_chunk, dim), jnp.float32),
        jax.ShapeDtypeStruct((vocab, dim), jnp.float32),
    ]
    if has_bias:
      out_specs.append(pl.BlockSpec((1, geom.block_v), bias_index_map))
      out_shape.append(jax.ShapeDtypeStruct((1, vocab), jnp.float32))
    token_spec = pl.BlockSpec(partial_block(geom.chunk, 1), partial_map)
    if with_loss:
      out_specs.append(token_spec)
      out_shape.append(jax.ShapeDtypeStruct(partial(rows_in_chunk, 1), jnp.float32))
    if with_counts:
      out_specs.append(token_spec)
      out_shape.append(jax.ShapeDtypeStruct(partial(rows_in_chunk, 1), jnp.int32))
    outputs = pl.pallas_call(
        functools.partial(
            _backward_kernel, geom=geom, rows_in_chunk=rows_in_chunk, has_bias=has_bias,
            options=options, with_loss=with_loss, with_counts=with_counts, softmax=softmax,
            num_fixed=num_fixed,
        ),
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        input_output_aliases=aliases if alias else {},
        compiler_params=_compiler_params(geom, semantics),
        cost_estimate=pl.CostEstimate(
            flops=3 * 2 * rows_in_chunk * geom.vocab * dim,
            transcendentals=rows_in_chunk * geom.vocab,
            bytes_accessed=table.size * table.dtype.itemsize + 2 * table_grad.size * 4
            + rows_in_chunk * dim * (hidden.dtype.itemsize + 4),
        ),
        interpret=interpret,
        name=f"cutbce_{'softmax_' if softmax else ''}backward_bt{geom.block_t}"
        f"_bv{geom.block_v}_chunk{geom.chunk}" + (f"_cores{cores}" if cores > 1 else ""),
    )(*operands)
    outputs = list(outputs)
    # The cores' partials summed once, after the sweep ([cores, chunk, D]: tiny).
    total = (lambda x: x) if cores == 1 else (lambda x: jnp.sum(x, axis=0))  # noqa: E731
    hidden_grads.append(total(outputs.pop(0)))
    table_grad = outputs.pop(0)
    if has_bias:
      bias_grad_row = outputs.pop(0)
    if with_loss:
      dense_sums.append(total(outputs.pop(0))[:, 0])
    if with_counts:
      positive_counts.append(total(outputs.pop(0))[:, 0])
  if not alias and walked_rows < vocab:
    # A fresh output holds garbage in the rows the grid never visited (past
    # num_items): they keep the given (sparse) part there.
    rows = jnp.arange(vocab)
    table_grad = jnp.where((rows < walked_rows)[:, None], table_grad, given_table_grad)
    if has_bias:
      bias_grad_row = jnp.where(rows[None, :] < walked_rows, bias_grad_row, given_bias_grad)
  # [T, D] f32: the chunks' dh side by side (no copy with a single chunk).
  join = lambda parts: parts[0] if len(parts) == 1 else jnp.concatenate(parts)  # noqa: E731
  bias_grad = bias_grad_row.reshape(vocab) if has_bias else None
  dense_sum = join(dense_sums) if with_loss else None
  positive_count = join(positive_counts) if with_counts else None
  return dense_sum, positive_count, join(hidden_grads), table_grad, bias_grad


# --------------------------------------------------------------------------- #
# Rank counts.                                                                 #
# --------------------------------------------------------------------------- #


def _rank_kernel(*refs, geom: _Geometry, has_bias: bool, num_targets: int,
                 options: LossOptions):
  refs = list(refs)
  hidden_ref = refs.pop(0)  # [chunk, D]
  table_ref = refs.pop(0)  # [block_v, D]
  bias_ref = refs.pop(0) if has_bias else None  # [1, block_v] f32
  target_logits_ref = refs.pop(0)  # [chunk, L] f32
  target_ids_ref = refs.pop(0)  # [chunk, L] int32
  count_ref = refs.pop(0)  # [chunk, L] int32, resident along the vocab axis
  vocab_index = pl.program_id(1)

  @pl.when(vocab_index == 0)
  def init():
    count_ref[...] = jnp.zeros_like(count_ref)

  table = _table_tile(table_ref, vocab_index, geom)
  column_ids = _column_ids(vocab_index, geom)  # [1, block_v]
  valid = column_ids < geom.vocab if geom.ragged_vocab else None
  lanes = lax.broadcasted_iota(jnp.int32, (1, num_targets), 1)

  def accumulate(subtile):
    rows = _row_slice(subtile, geom)
    logits = variants.cap(options, _tile_logits(hidden_ref[rows, :], table, bias_ref))
    target_logits = target_logits_ref[rows, :]  # [block_t, L]
    target_ids = target_ids_ref[rows, :]  # [block_t, L]
    counts = jnp.zeros((geom.block_t, num_targets), jnp.float32)
    for target in range(num_targets):  # L is small and static: unrolled
      # Ties count against the target (its own column left out); a NaN
      # target ranks after every item, a NaN item after every number.
      target_logit = target_logits[:, target:target + 1]  # [block_t, 1]
      larger = ((logits >= target_logit) | (target_logit != target_logit)) & (
          column_ids != target_ids[:, target:target + 1]
      )  # [block_t, block_v]
      if valid is not None:
        larger = larger & valid
      count = jnp.sum(larger.astype(jnp.float32), axis=1, keepdims=True)  # [block_t, 1]
      counts = jnp.where(lanes == target, count, counts)
    count_ref[rows, :] += counts.astype(jnp.int32)

  _for_each_subtile(geom.num_subtiles, accumulate)


def _rank_logits_kernel(*refs, geom: _Geometry, has_bias: bool, num_ids: int,
                        options: LossOptions):
  refs = list(refs)
  hidden_ref = refs.pop(0)  # [chunk, D]
  table_ref = refs.pop(0)  # [block_v, D]
  bias_ref = refs.pop(0) if has_bias else None  # [1, block_v] f32
  ids_ref = refs.pop(0)  # [chunk, K] int32
  found_ref = refs.pop(0)  # [chunk, K] f32, resident along the vocab axis
  vocab_index = pl.program_id(1)

  @pl.when(vocab_index == 0)
  def init():
    found_ref[...] = jnp.zeros_like(found_ref)

  table = _table_tile(table_ref, vocab_index, geom)
  column_ids = _column_ids(vocab_index, geom)  # [1, block_v]
  lanes = lax.broadcasted_iota(jnp.int32, (1, num_ids), 1)

  def accumulate(subtile):
    rows = _row_slice(subtile, geom)
    # The very dot `_rank_kernel` makes, so a twin's logit and the target's agree.
    logits = variants.cap(options, _tile_logits(hidden_ref[rows, :], table, bias_ref))
    ids = ids_ref[rows, :]  # [block_t, K]
    found = jnp.zeros((geom.block_t, num_ids), jnp.float32)
    for column in range(num_ids):  # unrolled
      # One column matches at most: x + 0 + ... = x exactly (a NaN stays NaN).
      own = column_ids == ids[:, column:column + 1]  # [block_t, block_v]
      value = jnp.sum(jnp.where(own, logits, 0.0), axis=1, keepdims=True)  # [block_t, 1]
      found = jnp.where(lanes == column, value, found)
    found_ref[rows, :] += found

  _for_each_subtile(geom.num_subtiles, accumulate)


@functools.partial(jax.named_call, name="cutbce_tpu_rank_logits")
def rank_logits(hidden, table, bias, ids, *, plan: TilePlan | None, num_targets: int,
                options: LossOptions = variants.PLAIN, num_items: int | None = None):
  """`[T, K]` f32 cap(x_{t, ids[t, k]}) from `rank_counts`' own tiles (0 for other ids)."""
  plan_targets = min(num_targets, MAX_RANK_TARGETS)
  groups = [
      _run(_rank_logits, hidden, table, bias, ids[:, start:start + MAX_RANK_TARGETS],
           plan=plan, options=options, num_items=num_items, plan_targets=plan_targets)
      for start in range(0, ids.shape[1], MAX_RANK_TARGETS)
  ]
  return groups[0] if len(groups) == 1 else jnp.concatenate(groups, axis=1)


def _rank_logits(hidden, table, bias, ids, *, plan, options, num_items, plan_targets, interpret):
  _check_supported(hidden, table, plan)
  hidden, table = _common_dtype(hidden, table)
  num_tokens, dim = hidden.shape
  num_ids = ids.shape[1]
  geom = _geometry(plan, hidden, table, "ranks", plan_targets, num_items=num_items)
  has_bias = bias is not None
  in_specs, operands = _token_by_vocab_inputs(geom, hidden, table, bias)
  ids_spec = pl.BlockSpec((geom.chunk, num_ids), _token_index_map)
  in_specs += [ids_spec]
  operands += [ids.astype(jnp.int32)]
  return pl.pallas_call(
      functools.partial(_rank_logits_kernel, geom=geom, has_bias=has_bias, num_ids=num_ids,
                        options=options),
      grid=(geom.num_chunks, geom.num_vocab_tiles),
      in_specs=in_specs,
      out_specs=ids_spec,
      out_shape=jax.ShapeDtypeStruct((num_tokens, num_ids), jnp.float32),
      compiler_params=_compiler_params(geom, (pltpu.PARALLEL, pltpu.ARBITRARY)),
      cost_estimate=pl.CostEstimate(
          flops=2 * num_tokens * geom.vocab * dim,
          transcendentals=0,
          bytes_accessed=geom.num_chunks * table.size * table.dtype.itemsize
          + hidden.size * hidden.dtype.itemsize,
      ),
      interpret=interpret,
      name=f"cutbce_rank_logits_bt{geom.block_t}_bv{geom.block_v}_chunk{geom.chunk}",
  )(*operands)


@functools.partial(jax.named_call, name="cutbce_tpu_rank_counts")
def rank_counts(hidden, table, bias, target_logits, target_ids, *, plan: TilePlan | None,
                options: LossOptions = variants.PLAIN, num_items: int | None = None):
  """`[T, L]` int32 #{v != target_ids[t, l] : cap(x_tv) >= target_logits[t, l] or it is NaN}."""
  num_targets = target_logits.shape[1]
  # Every group's tiles as `rank_logits` planned them.
  plan_targets = min(num_targets, MAX_RANK_TARGETS)
  # Groups of at most MAX_RANK_TARGETS targets, one kernel call each.
  groups = [
      _run(_rank_counts, hidden, table, bias, target_logits[:, start:start + MAX_RANK_TARGETS],
           target_ids[:, start:start + MAX_RANK_TARGETS], plan=plan, options=options,
           num_items=num_items, plan_targets=plan_targets)
      for start in range(0, num_targets, MAX_RANK_TARGETS)
  ]
  return groups[0] if len(groups) == 1 else jnp.concatenate(groups, axis=1)


def _rank_counts(hidden, table, bias, target_logits, target_ids, *, plan, options, num_items,
                 interpret, plan_targets=None):
  _check_supported(hidden, table, plan)
  hidden, table = _common_dtype(hidden, table)
  num_tokens, dim = hidden.shape
  num_targets = target_logits.shape[1]
  geom = _geometry(plan, hidden, table, "ranks", plan_targets or num_targets,
                   num_items=num_items)
  has_bias = bias is not None
  in_specs, operands = _token_by_vocab_inputs(geom, hidden, table, bias)
  target_spec = pl.BlockSpec((geom.chunk, num_targets), _token_index_map)
  in_specs += [target_spec, target_spec]
  operands += [target_logits.astype(jnp.float32), target_ids.astype(jnp.int32)]
  vocab = geom.vocab
  return pl.pallas_call(
      functools.partial(_rank_kernel, geom=geom, has_bias=has_bias, num_targets=num_targets,
                        options=options),
      grid=(geom.num_chunks, geom.num_vocab_tiles),
      in_specs=in_specs,
      out_specs=target_spec,
      out_shape=jax.ShapeDtypeStruct((num_tokens, num_targets), jnp.int32),
      compiler_params=_compiler_params(geom, (pltpu.PARALLEL, pltpu.ARBITRARY)),
      cost_estimate=pl.CostEstimate(
          flops=2 * num_tokens * vocab * dim,
          transcendentals=0,
          bytes_accessed=geom.num_chunks * table.size * table.dtype.itemsize
          + hidden.size * hidden.dtype.itemsize,
      ),
      interpret=interpret,
      name=f"cutbce_ranks_bt{geom.block_t}_bv{geom.block_v}_chunk{geom.chunk}",
  )(*operands)


# --------------------------------------------------------------------------- #
# Softmax cross-entropy (`cutbce.softmax`): running (max, sum exp) per token.  #
# --------------------------------------------------------------------------- #

# VMEM the softmax kernels add to the plain ones, counted as f32 logit tiles in
# the planner's estimate: the lse / running (max, sum) vectors, the excluded
# ids' block and the mask of one tile (measured against Mosaic by the compile
# tests at E up to 128).
SOFTMAX_EXTRA_TILES = 2
# Excluded ids per token the kernels compare in one tile (unrolled); wider rows
# take the XLA path.
MAX_SOFTMAX_EXCLUDE = 128
# Fixed columns per token the backward sets in f32 (compared per tile,
# unrolled; see xla.py). Ids past it stay sparse corrections (`sparse.sweep_columns`).
MAX_FIXED_COLUMNS = 64
# softmax_backward returns the mass of its p (`with_mass`; see xla.py).
SOFTMAX_MASS = True


class _Softmax(NamedTuple):
  """Static shape of a softmax call's masks (hashable)."""

  num_exclude: int  # E: excluded-id columns (0: none)
  valid_rows: bool  # a traced count of the table's real rows is given
  offset: bool = False  # a per-token offset o_t is subtracted from the logit gradient


def _softmax_inputs(geom: _Geometry, softmax: _Softmax, token_map, fixed_map, exclude_ids,
                    valid_rows):
  """Specs and operands of the excluded ids `[chunk, E]` and the real-row count `[1, 1]`."""
  specs, operands = [], []
  if softmax.num_exclude:
    specs.append(pl.BlockSpec((geom.chunk, softmax.num_exclude), token_map))
    operands.append(exclude_ids.astype(jnp.int32))
  if softmax.valid_rows:
    specs.append(pl.BlockSpec((1, 1), fixed_map))
    operands.append(jnp.asarray(valid_rows, jnp.int32).reshape(1, 1))
  return specs, operands


def _softmax_columns(vocab_index, geom: _Geometry, valid_rows_ref):
  """`[1, block_v]` bool: the tile's columns that are items (< V, < real rows), or None."""
  columns = _column_ids(vocab_index, geom)
  valid = columns < geom.vocab if geom.ragged_vocab else None
  if valid_rows_ref is not None:
    real = columns < valid_rows_ref[...]  # [1, 1] int32, broadcast
    valid = real if valid is None else valid & real
  return valid


def _softmax_keep(vocab_index, geom: _Geometry, valid, exclude_ref, rows, softmax: _Softmax):
  """`[block_t, block_v]` bool: in the token's softmax (an item, not excluded)."""
  keep = jnp.ones((geom.block_t, geom.block_v), bool) if valid is None else jnp.broadcast_to(
      valid, (geom.block_t, geom.block_v))
  if softmax.num_exclude:
    columns = _column_ids(vocab_index, geom)  # [1, block_v]
    excluded = exclude_ref[rows, :]  # [block_t, E] int32, -1 for none
    for column in range(softmax.num_exclude):  # E is small and static: unrolled
      keep = keep & (columns != excluded[:, column:column + 1])
  return keep


def _softmax_forward_kernel(*refs, geom: _Geometry, has_bias: bool, with_counts: bool,
                            softmax: _Softmax):
  refs = list(refs)
  hidden_ref = refs.pop(0)  # [chunk, D]
  table_ref = refs.pop(0)  # [block_v, D]
  bias_ref = refs.pop(0) if has_bias else None  # [1, block_v] f32
  exclude_ref = refs.pop(0) if softmax.num_exclude else None  # [chunk, E] int32
  valid_rows_ref = refs.pop(0) if softmax.valid_rows else None  # [1, 1] int32
  max_ref = refs.pop(0)  # [chunk, 1] f32, resident along the vocab axis
  sum_ref = refs.pop(0)  # [chunk, 1] f32
  count_ref = refs.pop(0) if with_counts else None  # [chunk, 1] int32
  vocab_index = pl.program_id(1)

  @pl.when(vocab_index == 0)
  def init():
    max_ref[...] = jnp.full_like(max_ref, SOFTMAX_FLOOR)
    sum_ref[...] = jnp.zeros_like(sum_ref)
    if with_counts:
      count_ref[...] = jnp.zeros_like(count_ref)

  table = _table_tile(table_ref, vocab_index, geom)
  valid = _softmax_columns(vocab_index, geom, valid_rows_ref)

  def accumulate(subtile):
    rows = _row_slice(subtile, geom)
    logits = _tile_logits(hidden_ref[rows, :], table, bias_ref)  # [block_t, block_v] f32
    if with_counts:
      positive = logits > 0.0
      if valid is not None:
        positive = positive & valid
      count_ref[rows, :] += jnp.sum(
          positive.astype(jnp.float32), axis=1, keepdims=True).astype(jnp.int32)
    keep = _softmax_keep(vocab_index, geom, valid, exclude_ref, rows, softmax)
    old_max = max_ref[rows, :]  # [block_t, 1]
    new_max = jnp.maximum(old_max, jnp.max(jnp.where(keep, logits, SOFTMAX_FLOOR), axis=1,
                                           keepdims=True))
    shifted = jnp.where(keep, jnp.exp(jnp.where(keep, logits - new_max, 0.0)), 0.0)
    sum_ref[rows, :] = (sum_ref[rows, :] * numerics.exp(old_max - new_max)
                        + jnp.sum(shifted, axis=1, keepdims=True))
    max_ref[rows, :] = new_max

  _for_each_subtile(geom.num_subtiles, accumulate)


def _softmax_static(exclude_ids, valid_rows) -> _Softmax:
  return _Softmax(0 if exclude_ids is None else exclude_ids.shape[1], valid_rows is not None)


@functools.partial(jax.named_call, name="cutbce_tpu_softmax_forward")
def softmax_forward(hidden, table, bias, exclude_ids, *, plan: TilePlan | None,
                    with_counts: bool, num_items: int | None = None, valid_rows=None):
  """Running (max, sum exp(x - max)) `[T]` f32 per token, and #{x > 0} (see xla.py)."""
  return _run(_softmax_forward, hidden, table, bias, exclude_ids, valid_rows, plan=plan,
              with_counts=with_counts, num_items=num_items)


def _softmax_forward(hidden, table, bias, exclude_ids, valid_rows, *, plan, with_counts,
                     num_items, interpret):
  _check_supported(hidden, table, plan)
  hidden, table = _common_dtype(hidden, table)
  softmax = _softmax_static(exclude_ids, valid_rows)
  geom = _geometry(plan, hidden, table, "forward", num_items=num_items, softmax=softmax)
  num_tokens, dim = hidden.shape
  in_specs, operands = _token_by_vocab_inputs(geom, hidden, table, bias)
  specs, extra = _softmax_inputs(geom, softmax, _token_index_map, lambda chunk, tile: (0, 0),
                                 exclude_ids, valid_rows)
  in_specs += specs
  operands += extra
  token_spec = pl.BlockSpec((geom.chunk, 1), _token_index_map)
  out_specs = [token_spec, token_spec] + ([token_spec] if with_counts else [])
  out_shape = [jax.ShapeDtypeStruct((num_tokens, 1), jnp.float32)] * 2 + (
      [jax.ShapeDtypeStruct((num_tokens, 1), jnp.int32)] if with_counts else [])
  vocab = geom.vocab
  outputs = pl.pallas_call(
      functools.partial(_softmax_forward_kernel, geom=geom, has_bias=bias is not None,
                        with_counts=with_counts, softmax=softmax),
      grid=(geom.num_chunks, geom.num_vocab_tiles),
      in_specs=in_specs,
      out_specs=out_specs,
      out_shape=out_shape,
      compiler_params=_compiler_params(geom, (pltpu.PARALLEL, pltpu.ARBITRARY)),
      cost_estimate=pl.CostEstimate(
          flops=2 * num_tokens * vocab * dim,
          transcendentals=num_tokens * vocab,
          bytes_accessed=geom.num_chunks * table.size * table.dtype.itemsize
          + hidden.size * hidden.dtype.itemsize,
      ),
      interpret=interpret,
      name=f"cutbce_softmax_forward_bt{geom.block_t}_bv{geom.block_v}_chunk{geom.chunk}",
  )(*operands)
  return outputs[0][:, 0], outputs[1][:, 0], (outputs[2][:, 0] if with_counts else None)


@functools.partial(jax.named_call, name="cutbce_tpu_softmax_backward")
def softmax_backward(hidden, table, bias, exclude_ids, log_z, scale, table_grad, bias_grad,
                     offset=None, fixed_ids=None, fixed_values=None, *,
                     plan: TilePlan | None, num_items: int | None = None, valid_rows=None,
                     with_mass: bool = False):
  """dh `[T, D]` f32 and the dense parts added to `table_grad`, `bias_grad` (see xla.py).

  With `with_mass`, also the mass `[T]` f32 of the p the sweep used (the
  per-token sum the BCE kernels fill with their loss).
  """
  softmax = _softmax_static(exclude_ids, valid_rows)._replace(offset=offset is not None)
  mass, _, *grads = _run(_backward, hidden, table, bias, scale, table_grad, bias_grad, log_z,
                         offset, exclude_ids, valid_rows, fixed_ids, fixed_values, plan=plan,
                         options=variants.PLAIN, num_items=num_items, with_loss=with_mass,
                         with_counts=False, softmax=softmax)
  return (*grads, mass) if with_mass else tuple(grads)
