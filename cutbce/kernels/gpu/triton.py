"""Pallas GPU kernels (Triton lowering): logit tiles live only in registers.

Honours the backend contract written in `cutbce/kernels/xla.py` on flattened
`[T, D]` tokens. A Triton program cannot keep an output block resident across
sequential grid steps the way a TPU kernel does, so every kernel walks one
axis of the logit matrix in an in-kernel `lax.fori_loop` and is gridded over
the other; no two programs write the same element, so there are no atomics
and the results are deterministic.

  forward      grid (token tiles, vocab splits): each program holds a
               `[block_t, D]` hidden tile and streams its split's table tiles,
               1 dot per tile; per-token sum of phi and count of x > 0 into
               `[splits, T]` partials, summed outside.
  backward     two kernels, 2 dots per tile each (4 in all, deterministic):
               - dh: grid (token tiles, vocab splits), recomputes the logits,
                 G = g phi'(X), dh += G @ E in a float32 `[block_t, D]`
                 register accumulator; `[splits, T, D]` partials.
                 One pass (`forward_backward`) also sums phi and counts here.
               - dE: grid (vocab tiles,), a resident `[block_v, D]` table tile,
                 streams the token tiles, dE += G^T @ H (and db += sum_t G) in
                 float32 registers, added once to the given sparse part in
                 place (`input_output_aliases`).
  rank_counts  grid (token tiles, vocab splits), 1 dot and L comparisons per
               tile, `[splits, T, L]` partial counts.
  softmax_*    the softmax cross-entropy's sweeps, laid out as the BCE ones:
               a forward keeping a running (max, sum of exponentials) per
               token (`[splits, T]` pairs, combined outside), and a dh and a
               dE kernel with G = g exp(x - lse) - o. Excluded ids (at most
               `MAX_SOFTMAX_EXCLUDE` per position) and a vocabulary shard's
               padding rows are masked inside the tile.

Ragged T, V and D: loads are masked (`other=0`) past T rows, past
`num_items` table rows and past D columns (D is padded to a power of two in
registers, never in memory); logit columns past `num_items` are masked out of
every sum. How a kernel runs is chosen when the program is lowered (`_run`):
for CUDA it is compiled by Triton; anywhere else it runs in Pallas'
interpreter, whose out-of-bounds reads are NaN, so a missing mask fails the
tests. Every dot is `_dot`: float32 operands as six bfloat16 piece products
on the tensor cores (`pieces.py`; Pallas' Triton lowering turns a float32
dot without a precision into a TF32 one, 10-bit mantissas: on an H200 that
put the float32 loss 5e-6 off the float64 oracle, and with precision
HIGHEST into FMA loops), bfloat16 operands once; float32 accumulation.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from cutbce import variants
from cutbce.kernels.gpu import plan as gpu_plan
from cutbce.kernels.gpu.pieces import PRODUCTS, split_pieces
from cutbce.kernels.gpu.plan import Geometry
from cutbce.kernels.tiling import TilePlan
from cutbce.variants import LossOptions

SUPPORTED_DTYPES = gpu_plan.SUPPORTED_DTYPES
# Targets per rank-kernel call: its comparison loop over L is unrolled.
MAX_RANK_TARGETS = 32
NT_DIMS = (((1,), (1,)), ((), ()))  # [M, K] x [N, K] -> [M, N]
TN_DIMS = (((0,), (0,)), ((), ()))  # [K, M] x [K, N] -> [M, N]
NN_DIMS = (((1,), (0,)), ((), ()))  # [M, K] x [K, N] -> [M, N]


def _dot(a, b, dims):
  """`lax.dot_general` on the tensor cores at the operands' precision, float32 out.

  float32 operands are split into three bfloat16 pieces and multiplied as the
  six piece products that reach float32's precision (`pieces.py`): never
  TF32 (10-bit mantissas), never the FMA loops Triton makes of a float32 dot
  at precision HIGHEST. bfloat16 operands multiply exactly once.
  """
  if a.dtype != jnp.float32:
    return lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)
  a_pieces, b_pieces = split_pieces(a, 3), split_pieces(b, 3)
  total = None
  for i, j in PRODUCTS[3]:
    product = lax.dot_general(a_pieces[i], b_pieces[j], dims, preferred_element_type=jnp.float32)
    total = product if total is None else total + product
  return total


def _run(impl, *operands, **static):
  """`impl(*operands, interpret=..., **static)`: Triton for CUDA, the interpreter elsewhere.

  A `lax.platform_dependent` resolved when the program is lowered: both calls
  are traced, only the lowering platform's is lowered, so one traced function
  runs interpreted on a CPU host and compiles for an NVIDIA GPU (attached or
  a topology compiled for). None operands (an absent bias) stay out.
  """
  present = [x for x in operands if x is not None]

  def branch(interpret):
    def call(*arrays):
      arrays = iter(arrays)
      return impl(*(None if x is None else next(arrays) for x in operands),
                  interpret=interpret, **static)
    return call

  return lax.platform_dependent(*present, cuda=branch(False), default=branch(True))


def _compiler_params(geom: Geometry):
  return plgpu.CompilerParams(num_warps=geom.num_warps, num_stages=gpu_plan.NUM_STAGES)


# --------------------------------------------------------------------------- #
# Support checks and plans.                                                    #
# --------------------------------------------------------------------------- #


def unsupported_reason(num_tokens, vocab, dim, hidden_dtype, table_dtype, plan=None) -> str | None:
  """Why these inputs cannot run on the GPU kernels, or None when they can."""
  problem = gpu_plan.input_problem(num_tokens, hidden_dtype, table_dtype)
  if problem is not None:
    return problem
  dtype = jnp.result_type(jnp.dtype(hidden_dtype), jnp.dtype(table_dtype))
  if plan is not None:
    problem = gpu_plan.plan_problem(plan)
    if problem:
      return f"TilePlan {plan} cannot tile the Pallas GPU kernels: {problem}"
  if plan is None or plan.block_t is None:
    for kernel in gpu_plan.KERNELS:
      try:
        gpu_plan.plan_tiles(kernel, num_tokens, vocab, dim, dtype)
      except ValueError as error:
        return str(error)
  return None


def plan_problem(num_tokens, vocab, dim, dtype, plan: TilePlan) -> str | None:
  """Why `plan` cannot tile these shapes on the GPU kernels, or None."""
  del num_tokens, vocab, dim, dtype
  return gpu_plan.plan_problem(plan)


def default_plan(kernel: str, num_tokens: int, vocab: int, dim: int, dtype,
                 num_targets: int = 1) -> TilePlan:
  """The GPU planner's plan of one kernel ("forward", "backward", "ranks") for the device planned for.

  Raises:
    NotImplementedError: the dtype is not float32/bfloat16 or no tile fits.
  """
  del num_targets
  if jnp.dtype(dtype) not in SUPPORTED_DTYPES:
    raise NotImplementedError(
        f"the Pallas GPU kernels take float32 or bfloat16, got {jnp.dtype(dtype)}")
  try:
    return gpu_plan.plan_tiles(kernel, num_tokens, vocab, dim, dtype)
  except ValueError as error:
    raise NotImplementedError(str(error)) from error


def _prepare(hidden, table, plan, kernel, num_items):
  """Common dtype, support check and the `Geometry` of one kernel call."""
  reason = unsupported_reason(hidden.shape[0], table.shape[0], table.shape[1], hidden.dtype,
                              table.dtype, plan)
  if reason is not None:
    raise NotImplementedError(reason)
  dtype = jnp.result_type(hidden.dtype, table.dtype)
  hidden, table = hidden.astype(dtype), table.astype(dtype)
  vocab = table.shape[0] if num_items is None else num_items
  geom = gpu_plan.geometry(kernel, plan, hidden.shape[0], vocab, hidden.shape[1], dtype)
  return hidden, table, geom


# --------------------------------------------------------------------------- #
# Pieces shared by the kernel bodies.                                          #
# --------------------------------------------------------------------------- #


def _tile_indices(start, num_rows: int, geom: Geometry):
  """Row and column indices `[num_rows, dim_padded]` int32 of a `[start:, :dim_padded]` tile.

  The tile is addressed by index arrays, not by `pl.ds` slices: the padded
  width runs past the D columns in memory, and a slice past a ref's bounds is
  an error in jax >= 0.11 (a Triton block must still be a power of two wide).
  Entries past the ref's bounds are masked by the callers; Triton computes the
  same pointers either way, and the interpreter gathers (and scatters) them.
  """
  shape = (num_rows, geom.dim_padded)
  rows = start + lax.broadcasted_iota(jnp.int32, shape, 0)
  columns = lax.broadcasted_iota(jnp.int32, shape, 1)
  return rows, columns


def _load_rows(ref, start, num_rows: int, limit: int, geom: Geometry):
  """`[num_rows, dim_padded]` rows [start, start + num_rows) of `ref`; 0 past `limit` or D."""
  rows, columns = _tile_indices(start, num_rows, geom)
  mask = (rows < limit) & (columns < geom.dim)
  return plgpu.load(ref.at[rows, columns], mask=mask, other=0)


def _load_vector(ref, start, size: int, limit: int):
  """`[size]` entries [start, start + size) of a 1-D ref, 0 past `limit`."""
  ok = start + lax.broadcasted_iota(jnp.int32, (size,), 0) < limit
  return plgpu.load(ref.at[pl.ds(start, size)], mask=ok, other=0)


def _store_rows(ref, value, start, limit: int, geom: Geometry, *leading):
  """Stores `[num_rows, dim_padded]` `value` at `ref[*leading, start:, :D]` (masked).

  `leading` indices (a split) go in the same indexer: a ref narrowed twice
  (`ref.at[i].at[...]`) is stored wrongly by the interpreter in jax 0.10.2.
  """
  rows, columns = _tile_indices(start, value.shape[0], geom)
  mask = (rows < limit) & (columns < geom.dim)
  plgpu.store(ref.at[(*leading, rows, columns)], value, mask=mask)


def _column_valid(start, geom: Geometry):
  """`[1, block_v]` bool: the tile's columns that are items (< num_items)."""
  return start + lax.broadcasted_iota(jnp.int32, (1, geom.block_v), 1) < geom.vocab


def _tile_logits(hidden, table_tile, bias_tile):
  """`[block_t, block_v]` float32 logits h . e (+ b) on the tensor cores."""
  logits = _dot(hidden, table_tile, NT_DIMS)
  if bias_tile is not None:
    logits = logits + bias_tile[None, :]
  return logits


def _split_range(split, geom: Geometry):
  """[first, last) vocab tiles of one split of the sweep."""
  first = split * geom.tiles_per_split
  return first, jnp.minimum(first + geom.tiles_per_split, geom.num_vocab_tiles)


def _vocab_step(table_ref, bias_ref, hidden, tile, geom: Geometry):
  """(table tile `[block_v, D]`, logits `[block_t, block_v]` f32, valid `[1, block_v]`)."""
  start = tile * geom.block_v
  table = _load_rows(table_ref, start, geom.block_v, geom.vocab, geom)
  bias = None
  if bias_ref is not None:
    bias = _load_vector(bias_ref, start, geom.block_v, geom.vocab)
  return table, _tile_logits(hidden, table, bias), _column_valid(start, geom)


def _token_rows_ok(start, geom: Geometry):
  return start + lax.broadcasted_iota(jnp.int32, (geom.block_t,), 0) < geom.num_tokens


# --------------------------------------------------------------------------- #
# Forward.                                                                     #
# --------------------------------------------------------------------------- #


def _forward_kernel(*refs, geom: Geometry, has_bias: bool, with_counts: bool,
                    options: LossOptions):
  refs = list(refs)
  hidden_ref = refs.pop(0)  # [T, D]
  table_ref = refs.pop(0)  # [V, D]
  bias_ref = refs.pop(0) if has_bias else None  # [V] f32
  dense_ref = refs.pop(0)  # [splits, T] f32
  count_ref = refs.pop(0) if with_counts else None  # [splits, T] int32
  token_start = pl.program_id(0) * geom.block_t
  split = pl.program_id(1)
  hidden = _load_rows(hidden_ref, token_start, geom.block_t, geom.num_tokens, geom)

  def accumulate(tile, carry):
    dense, count = carry
    _, logits, valid = _vocab_step(table_ref, bias_ref, hidden, tile, geom)
    # phi(x): softplus(x) = max(x, 0) + log1p(e^-|x|) for plain BCE (no
    # overflow), f(x, 0) of a variant otherwise; float32 row sums.
    value = jnp.where(valid, variants.tile_value(options, logits), 0.0)
    dense = dense + jnp.sum(value, axis=1)
    if with_counts:
      count = count + jnp.sum((logits > 0.0) & valid, axis=1, dtype=jnp.int32)
    return dense, count

  first, last = _split_range(split, geom)
  init = (jnp.zeros((geom.block_t,), jnp.float32), jnp.zeros((geom.block_t,), jnp.int32))
  dense, count = lax.fori_loop(first, last, accumulate, init)
  rows_ok = _token_rows_ok(token_start, geom)
  plgpu.store(dense_ref.at[split, pl.ds(token_start, geom.block_t)], dense, mask=rows_ok)
  if with_counts:
    plgpu.store(count_ref.at[split, pl.ds(token_start, geom.block_t)], count, mask=rows_ok)


@functools.partial(jax.named_call, name="cutbce_gpu_forward")
def forward(hidden, table, bias, *, plan: TilePlan | None, with_counts: bool,
            options: LossOptions = variants.PLAIN, num_items: int | None = None):
  """sum_v phi(x_tv) `[T]` f32 and #{x_tv > 0} `[T]` int32 (or None)."""
  return _run(_forward, hidden, table, bias, plan=plan, with_counts=with_counts,
              options=options, num_items=num_items)


def _forward(hidden, table, bias, *, plan, with_counts, options, num_items, interpret):
  hidden, table, geom = _prepare(hidden, table, plan, "forward", num_items)
  num_tokens = hidden.shape[0]
  has_bias = bias is not None
  operands = [hidden, table] + ([bias.astype(jnp.float32)] if has_bias else [])
  partial_shape = (geom.vocab_splits, num_tokens)
  out_shape = [jax.ShapeDtypeStruct(partial_shape, jnp.float32)]
  if with_counts:
    out_shape.append(jax.ShapeDtypeStruct(partial_shape, jnp.int32))
  outputs = pl.pallas_call(
      functools.partial(_forward_kernel, geom=geom, has_bias=has_bias,
                        with_counts=with_counts, options=options),
      grid=(geom.num_token_tiles, geom.vocab_splits),
      out_shape=out_shape,
      compiler_params=_compiler_params(geom),
      interpret=interpret,
      name=f"cutbce_gpu_forward_bt{geom.block_t}_bv{geom.block_v}_s{geom.vocab_splits}",
  )(*operands)
  dense_sum = jnp.sum(outputs[0], axis=0)
  positive_count = jnp.sum(outputs[1], axis=0) if with_counts else None
  return dense_sum, positive_count


# --------------------------------------------------------------------------- #
# Backward: dh (and one pass's sums) over token tiles, dE over vocab tiles.    #
# --------------------------------------------------------------------------- #


def _hidden_grad_kernel(*refs, geom: Geometry, has_bias: bool, options: LossOptions,
                        with_loss: bool, with_counts: bool, num_fixed: int = 0):
  refs = list(refs)
  hidden_ref = refs.pop(0)  # [T, D]
  scale_ref = refs.pop(0)  # [T] f32, g_t
  table_ref = refs.pop(0)  # [V, D]
  bias_ref = refs.pop(0) if has_bias else None  # [V] f32
  fixed_refs = (refs.pop(0), refs.pop(0)) if num_fixed else None  # [T, K] int32, f32
  hidden_grad_ref = refs.pop(0)  # [splits, T, D] f32
  dense_ref = refs.pop(0) if with_loss else None  # [splits, T] f32
  count_ref = refs.pop(0) if with_counts else None  # [splits, T] int32
  token_start = pl.program_id(0) * geom.block_t
  split = pl.program_id(1)
  hidden = _load_rows(hidden_ref, token_start, geom.block_t, geom.num_tokens, geom)
  scale = _load_vector(scale_ref, token_start, geom.block_t, geom.num_tokens)  # 0 past T
  fixed = _load_fixed(fixed_refs, token_start, num_fixed, geom)
  compute_dtype = hidden.dtype

  def accumulate(tile, carry):
    hidden_grad, dense, count = carry
    table, logits, valid = _vocab_step(table_ref, bias_ref, hidden, tile, geom)
    # d l_t / d x_tv of the dense background is phi'(x_tv) (sigmoid for
    # plain BCE), times g_t.
    if with_loss:
      value, derivative = variants.tile_value_and_grad(options, logits)
      dense = dense + jnp.sum(jnp.where(valid, value, 0.0), axis=1)
      if with_counts:
        count = count + jnp.sum((logits > 0.0) & valid, axis=1, dtype=jnp.int32)
    else:
      derivative = variants.tile_grad(options, logits, sigmoid=jax.nn.sigmoid)
    grad = jnp.where(valid, scale[:, None] * derivative, 0.0)  # [block_t, block_v] f32
    grad = _set_fixed(grad, tile * geom.block_v, fixed, geom)  # exact terms, before the cast
    hidden_grad = hidden_grad + _dot(grad.astype(compute_dtype), table, NN_DIMS)  # [block_t, D]
    return hidden_grad, dense, count

  first, last = _split_range(split, geom)
  init = (
      jnp.zeros((geom.block_t, geom.dim_padded), jnp.float32),
      jnp.zeros((geom.block_t,), jnp.float32),
      jnp.zeros((geom.block_t,), jnp.int32),
  )
  hidden_grad, dense, count = lax.fori_loop(first, last, accumulate, init)
  _store_rows(hidden_grad_ref, hidden_grad, token_start, geom.num_tokens, geom, split)
  rows_ok = _token_rows_ok(token_start, geom)
  if with_loss:
    plgpu.store(dense_ref.at[split, pl.ds(token_start, geom.block_t)], dense, mask=rows_ok)
  if with_counts:
    plgpu.store(count_ref.at[split, pl.ds(token_start, geom.block_t)], count, mask=rows_ok)


def _table_grad_sweep(hidden_ref, out_refs, vocab_start, geom: Geometry, has_bias: bool,
                      tile_grad):
  """One vocab tile's dE (and db): sum over the token tiles of G^T @ H (and sum_t G).

  `tile_grad(token_start, hidden)` gives the tile's `[block_t, block_v]` f32 G
  (0 past T and on columns that are not items); the float32 sums, kept in
  registers, are added once to the given sparse part (`out_refs`: the given
  table and bias gradients, then their aliased outputs).
  """
  table_grad_in_ref, bias_grad_in_ref, table_grad_ref, bias_grad_ref = out_refs

  def accumulate(token_tile, carry):
    table_grad, bias_grad = carry
    token_start = token_tile * geom.block_t
    hidden = _load_rows(hidden_ref, token_start, geom.block_t, geom.num_tokens, geom)
    grad = tile_grad(token_start, hidden)
    table_grad = table_grad + _dot(grad.astype(hidden.dtype), hidden, TN_DIMS)  # [block_v, D]
    if has_bias:
      bias_grad = bias_grad + jnp.sum(grad, axis=0)
    return table_grad, bias_grad

  init = (jnp.zeros((geom.block_v, geom.dim_padded), jnp.float32),
          jnp.zeros((geom.block_v,), jnp.float32))
  table_grad, bias_grad = lax.fori_loop(0, geom.num_token_tiles, accumulate, init)
  given = _load_rows(table_grad_in_ref, vocab_start, geom.block_v, geom.vocab, geom)
  _store_rows(table_grad_ref, given + table_grad, vocab_start, geom.vocab, geom)
  if has_bias:
    rows_ok = vocab_start + lax.broadcasted_iota(jnp.int32, (geom.block_v,), 0) < geom.vocab
    given_bias = _load_vector(bias_grad_in_ref, vocab_start, geom.block_v, geom.vocab)
    plgpu.store(bias_grad_ref.at[pl.ds(vocab_start, geom.block_v)], given_bias + bias_grad,
                mask=rows_ok)


def _table_grad_outputs(refs: list, has_bias: bool):
  """The dE kernels' last refs: given table (and bias) gradient, then their aliased outputs."""
  table_grad_in = refs.pop(0)  # [V, D] f32, the given (sparse) part
  bias_grad_in = refs.pop(0) if has_bias else None  # [V] f32
  table_grad = refs.pop(0)  # [V, D] f32, aliased with table_grad_in
  bias_grad = refs.pop(0) if has_bias else None  # [V] f32, aliased
  return table_grad_in, bias_grad_in, table_grad, bias_grad


def _table_grad_kernel(*refs, geom: Geometry, has_bias: bool, options: LossOptions,
                       num_fixed: int = 0):
  refs = list(refs)
  hidden_ref = refs.pop(0)  # [T, D]
  scale_ref = refs.pop(0)  # [T] f32
  table_ref = refs.pop(0)  # [V, D]
  bias_ref = refs.pop(0) if has_bias else None  # [V] f32
  fixed_refs = (refs.pop(0), refs.pop(0)) if num_fixed else None  # [T, K] int32, f32
  out_refs = _table_grad_outputs(refs, has_bias)
  vocab_start = pl.program_id(0) * geom.block_v
  table = _load_rows(table_ref, vocab_start, geom.block_v, geom.vocab, geom)  # [block_v, D]
  bias = _load_vector(bias_ref, vocab_start, geom.block_v, geom.vocab) if has_bias else None
  valid = _column_valid(vocab_start, geom)

  def tile_grad(token_start, hidden):
    scale = _load_vector(scale_ref, token_start, geom.block_t, geom.num_tokens)  # 0 past T
    logits = _tile_logits(hidden, table, bias)  # [block_t, block_v] f32
    derivative = variants.tile_grad(options, logits, sigmoid=jax.nn.sigmoid)
    grad = jnp.where(valid, scale[:, None] * derivative, 0.0)
    return _set_fixed(grad, vocab_start, _load_fixed(fixed_refs, token_start, num_fixed, geom),
                      geom)

  _table_grad_sweep(hidden_ref, out_refs, vocab_start, geom, has_bias, tile_grad)


@functools.partial(jax.named_call, name="cutbce_gpu_backward")
def backward(hidden, table, bias, scale, table_grad, bias_grad, fixed_ids=None,
             fixed_values=None, *, plan: TilePlan | None,
             options: LossOptions = variants.PLAIN, num_items: int | None = None):
  """dh `[T, D]` f32; `table_grad` (+ dense part) `[V, D]` f32; `bias_grad` `[V]` or None."""
  _, _, *grads = _sweeps(hidden, table, bias, scale, table_grad, bias_grad, fixed_ids,
                         fixed_values, plan=plan, options=options, num_items=num_items,
                         with_loss=False, with_counts=False)
  return tuple(grads)


@functools.partial(jax.named_call, name="cutbce_gpu_forward_backward")
def forward_backward(hidden, table, bias, scale, table_grad, bias_grad, fixed_ids=None,
                     fixed_values=None, *, plan: TilePlan | None, with_counts: bool,
                     options: LossOptions = variants.PLAIN, num_items: int | None = None):
  """The dh kernel also sums phi and counts x > 0: one pass, 4 dots per tile in two kernels.

  Returns (dense_sum [T] f32, positive_count [T] int32 or None, dh, table_grad, bias_grad).
  """
  return _sweeps(hidden, table, bias, scale, table_grad, bias_grad, fixed_ids, fixed_values,
                 plan=plan, options=options, num_items=num_items, with_loss=True,
                 with_counts=with_counts)


def _fixed_operands(fixed_ids, fixed_values):
  """(int32 `[T, K]` ids, f32 `[T, K]` values), or (None, None) without fixed columns (or K = 0).

  Two operands of `_run`; the kernels' wrappers take them as the list `fixed`.
  """
  if fixed_ids is None or not fixed_ids.shape[-1]:
    return None, None
  if fixed_ids.shape[-1] > MAX_FIXED_COLUMNS:
    raise NotImplementedError(
        f"the Pallas GPU kernels set at most {MAX_FIXED_COLUMNS} fixed columns per position, "
        f"got {fixed_ids.shape[-1]}")
  return fixed_ids.astype(jnp.int32), fixed_values.astype(jnp.float32)


def _fixed_list(fixed_ids, fixed_values):
  return [] if fixed_ids is None else [fixed_ids, fixed_values]


def _load_fixed(fixed_refs, token_start, num_fixed: int, geom: Geometry):
  """The token tile's fixed columns: [(ids `[block_t]` int32, values `[block_t]` f32)] (-1 past T)."""
  if not num_fixed:
    return []
  ids_ref, values_ref = fixed_refs
  rows, rows_ok = pl.ds(token_start, geom.block_t), _token_rows_ok(token_start, geom)
  return [(plgpu.load(ids_ref.at[rows, jnp.int32(k)], mask=rows_ok, other=-1),
           plgpu.load(values_ref.at[rows, jnp.int32(k)], mask=rows_ok, other=0.0))
          for k in range(num_fixed)]


def _set_fixed(grad, vocab_start, fixed, geom: Geometry):
  """`grad` `[block_t, block_v]` f32 with column fixed id - vocab_start of each row set to its value.

  The targets' exact terms (see xla.py), set in float32 before the cast for
  the dots. Ids are items (< num_items) or -1, so they never hit a masked column.
  """
  if not fixed:
    return grad
  column_ids = vocab_start + lax.broadcasted_iota(jnp.int32, (1, geom.block_v), 1)
  for ids, values in fixed:  # K is small and static: unrolled
    grad = jnp.where(column_ids == ids[:, None], values[:, None], grad)
  return grad


def _sweeps(hidden, table, bias, scale, table_grad, bias_grad, fixed_ids, fixed_values, *, plan,
            options, num_items, with_loss, with_counts):
  fixed = _fixed_operands(fixed_ids, fixed_values)
  dense_sum, positive_count, hidden_grad = _run(
      _hidden_grad, hidden, table, bias, scale, *fixed, plan=plan, options=options,
      num_items=num_items, with_loss=with_loss, with_counts=with_counts)
  table_grad, bias_grad = _run(
      _table_grad, hidden, table, bias, scale, *fixed, table_grad, bias_grad, plan=plan,
      options=options, num_items=num_items)
  return dense_sum, positive_count, hidden_grad, table_grad, bias_grad


def _hidden_grad(hidden, table, bias, scale, fixed_ids, fixed_values, *, plan, options,
                 num_items, with_loss, with_counts, interpret):
  fixed = _fixed_list(fixed_ids, fixed_values)
  hidden, table, geom = _prepare(hidden, table, plan, "backward", num_items)
  num_tokens, dim = hidden.shape
  has_bias = bias is not None
  operands = [hidden, scale.astype(jnp.float32), table]
  if has_bias:
    operands.append(bias.astype(jnp.float32))
  operands += fixed
  partial_shape = (geom.vocab_splits, num_tokens)
  out_shape = [jax.ShapeDtypeStruct(partial_shape + (dim,), jnp.float32)]
  if with_loss:
    out_shape.append(jax.ShapeDtypeStruct(partial_shape, jnp.float32))
  if with_counts:
    out_shape.append(jax.ShapeDtypeStruct(partial_shape, jnp.int32))
  outputs = list(pl.pallas_call(
      functools.partial(_hidden_grad_kernel, geom=geom, has_bias=has_bias, options=options,
                        with_loss=with_loss, with_counts=with_counts,
                        num_fixed=fixed[0].shape[1] if fixed else 0),
      grid=(geom.num_token_tiles, geom.vocab_splits),
      out_shape=out_shape,
      compiler_params=_compiler_params(geom),
      interpret=interpret,
      name=f"cutbce_gpu_dh_bt{geom.block_t}_bv{geom.block_v}_s{geom.vocab_splits}",
  )(*operands))
  # Splits > 1 only where T is small (too few token tiles to fill the SMs),
  # so the [splits, T, D] partials stay about 2 x SMs x block_t x D floats.
  hidden_grad = jnp.sum(outputs.pop(0), axis=0)
  dense_sum = jnp.sum(outputs.pop(0), axis=0) if with_loss else None
  positive_count = jnp.sum(outputs.pop(0), axis=0) if with_counts else None
  return dense_sum, positive_count, hidden_grad


def _table_grad(hidden, table, bias, scale, fixed_ids, fixed_values, table_grad, bias_grad, *,
                plan, options, num_items, interpret):
  fixed = _fixed_list(fixed_ids, fixed_values)
  hidden, table, geom = _prepare(hidden, table, plan, "table_grad", num_items)
  operands = [hidden, scale.astype(jnp.float32), table]
  if bias is not None:
    operands.append(bias.astype(jnp.float32))
  operands += fixed
  kernel = functools.partial(_table_grad_kernel, geom=geom, has_bias=bias is not None,
                             options=options, num_fixed=fixed[0].shape[1] if fixed else 0)
  return _call_table_grad(kernel, operands, table_grad, bias_grad, geom, interpret,
                          name=f"cutbce_gpu_de_bt{geom.block_t}_bv{geom.block_v}")


def _call_table_grad(kernel, operands: list, table_grad, bias_grad, geom: Geometry, interpret,
                     *, name: str):
  """A dE kernel over the vocab tiles: the given gradients updated in place (aliased)."""
  aliases = {len(operands): 0}  # given table_grad -> dE output, updated in place
  operands = operands + [table_grad.astype(jnp.float32)]
  out_shape = [jax.ShapeDtypeStruct(table_grad.shape, jnp.float32)]
  if bias_grad is not None:
    aliases[len(operands)] = 1
    operands.append(bias_grad.astype(jnp.float32))
    out_shape.append(jax.ShapeDtypeStruct(bias_grad.shape, jnp.float32))
  outputs = pl.pallas_call(
      kernel,
      grid=(geom.num_vocab_tiles,),
      out_shape=out_shape,
      input_output_aliases=aliases,
      compiler_params=_compiler_params(geom),
      interpret=interpret,
      name=name,
  )(*operands)
  return outputs[0], (outputs[1] if bias_grad is not None else None)


# --------------------------------------------------------------------------- #
# Rank counts.                                                                 #
# --------------------------------------------------------------------------- #


def _rank_kernel(*refs, geom: Geometry, has_bias: bool, num_targets: int,
                 options: LossOptions):
  refs = list(refs)
  hidden_ref = refs.pop(0)  # [T, D]
  table_ref = refs.pop(0)  # [V, D]
  bias_ref = refs.pop(0) if has_bias else None  # [V] f32
  target_logits_ref = refs.pop(0)  # [T, L] f32
  target_ids_ref = refs.pop(0)  # [T, L] int32
  count_ref = refs.pop(0)  # [splits, T, L] int32
  token_start = pl.program_id(0) * geom.block_t
  split = pl.program_id(1)
  hidden = _load_rows(hidden_ref, token_start, geom.block_t, geom.num_tokens, geom)
  rows = pl.ds(token_start, geom.block_t)
  rows_ok = _token_rows_ok(token_start, geom)
  # One [block_t] column per target: Triton has no static tensor slicing.
  # (Column indices as int32 scalars: the interpreter rejects a Python int.)
  target_logits = [plgpu.load(target_logits_ref.at[rows, jnp.int32(target)], mask=rows_ok, other=0.0)
                   for target in range(num_targets)]
  target_ids = [plgpu.load(target_ids_ref.at[rows, jnp.int32(target)], mask=rows_ok, other=-1)
                for target in range(num_targets)]

  def accumulate(tile, counts):
    _, logits, valid = _vocab_step(table_ref, bias_ref, hidden, tile, geom)
    logits = variants.cap(options, logits)
    column_ids = tile * geom.block_v + lax.broadcasted_iota(jnp.int32, (1, geom.block_v), 1)
    updated = []
    for target, count in enumerate(counts):  # L is small and static: unrolled
      # Ties count against the target (its own column left out); a NaN
      # target ranks after every item, a NaN item after every number.
      target_logit = target_logits[target][:, None]  # [block_t, 1]
      larger = (((logits >= target_logit) | (target_logit != target_logit))
                & (column_ids != target_ids[target][:, None]) & valid)
      updated.append(count + jnp.sum(larger, axis=1, dtype=jnp.int32))
    return tuple(updated)

  first, last = _split_range(split, geom)
  init = tuple(jnp.zeros((geom.block_t,), jnp.int32) for _ in range(num_targets))
  counts = lax.fori_loop(first, last, accumulate, init)
  for target, count in enumerate(counts):
    plgpu.store(count_ref.at[split, rows, jnp.int32(target)], count, mask=rows_ok)


def _rank_logits_kernel(*refs, geom: Geometry, has_bias: bool, num_ids: int,
                        options: LossOptions):
  refs = list(refs)
  hidden_ref = refs.pop(0)  # [T, D]
  table_ref = refs.pop(0)  # [V, D]
  bias_ref = refs.pop(0) if has_bias else None  # [V] f32
  ids_ref = refs.pop(0)  # [T, K] int32
  found_ref = refs.pop(0)  # [splits, T, K] f32
  token_start = pl.program_id(0) * geom.block_t
  split = pl.program_id(1)
  hidden = _load_rows(hidden_ref, token_start, geom.block_t, geom.num_tokens, geom)
  rows = pl.ds(token_start, geom.block_t)
  rows_ok = _token_rows_ok(token_start, geom)
  ids = [plgpu.load(ids_ref.at[rows, jnp.int32(column)], mask=rows_ok, other=-1)
         for column in range(num_ids)]

  def accumulate(tile, found):
    # The very tile `_rank_kernel` computes, so a twin's logit and the target's agree.
    _, logits, valid = _vocab_step(table_ref, bias_ref, hidden, tile, geom)
    logits = variants.cap(options, logits)
    column_ids = tile * geom.block_v + lax.broadcasted_iota(jnp.int32, (1, geom.block_v), 1)
    # One column matches at most: x + 0 + ... = x exactly (a NaN stays NaN).
    return tuple(
        value + jnp.sum(jnp.where((column_ids == ids[column][:, None]) & valid, logits, 0.0),
                        axis=1)
        for column, value in enumerate(found))

  first, last = _split_range(split, geom)
  init = tuple(jnp.zeros((geom.block_t,), jnp.float32) for _ in range(num_ids))
  found = lax.fori_loop(first, last, accumulate, init)
  for column, value in enumerate(found):
    plgpu.store(found_ref.at[split, rows, jnp.int32(column)], value, mask=rows_ok)


@functools.partial(jax.named_call, name="cutbce_gpu_rank_logits")
def rank_logits(hidden, table, bias, ids, *, plan: TilePlan | None, num_targets: int,
                options: LossOptions = variants.PLAIN, num_items: int | None = None):
  """`[T, K]` f32 cap(x_{t, ids[t, k]}) from `rank_counts`' own tiles (0 for other ids)."""
  del num_targets  # the rank kernel's geometry does not depend on L
  groups = [
      _run(_rank_logits, hidden, table, bias, ids[:, start:start + MAX_RANK_TARGETS],
           plan=plan, options=options, num_items=num_items)
      for start in range(0, ids.shape[1], MAX_RANK_TARGETS)
  ]
  return groups[0] if len(groups) == 1 else jnp.concatenate(groups, axis=1)


def _rank_logits(hidden, table, bias, ids, *, plan, options, num_items, interpret):
  hidden, table, geom = _prepare(hidden, table, plan, "ranks", num_items)
  num_tokens = hidden.shape[0]
  num_ids = ids.shape[1]
  has_bias = bias is not None
  operands = [hidden, table] + ([bias.astype(jnp.float32)] if has_bias else [])
  operands += [ids.astype(jnp.int32)]
  partial = pl.pallas_call(
      functools.partial(_rank_logits_kernel, geom=geom, has_bias=has_bias, num_ids=num_ids,
                        options=options),
      grid=(geom.num_token_tiles, geom.vocab_splits),
      out_shape=jax.ShapeDtypeStruct((geom.vocab_splits, num_tokens, num_ids), jnp.float32),
      compiler_params=_compiler_params(geom),
      interpret=interpret,
      name=f"cutbce_gpu_rank_logits_bt{geom.block_t}_bv{geom.block_v}_s{geom.vocab_splits}",
  )(*operands)
  # One split holds each id: the others add 0, so exact.
  return jnp.sum(partial, axis=0)


@functools.partial(jax.named_call, name="cutbce_gpu_rank_counts")
def rank_counts(hidden, table, bias, target_logits, target_ids, *, plan: TilePlan | None,
                options: LossOptions = variants.PLAIN, num_items: int | None = None):
  """`[T, L]` int32 #{v != target_ids[t, l] : cap(x_tv) >= target_logits[t, l] or it is NaN}."""
  num_targets = target_logits.shape[1]
  groups = [
      _run(_rank_counts, hidden, table, bias, target_logits[:, start:start + MAX_RANK_TARGETS],
           target_ids[:, start:start + MAX_RANK_TARGETS], plan=plan, options=options,
           num_items=num_items)
      for start in range(0, num_targets, MAX_RANK_TARGETS)
  ]
  return groups[0] if len(groups) == 1 else jnp.concatenate(groups, axis=1)


def _rank_counts(hidden, table, bias, target_logits, target_ids, *, plan, options, num_items,
                 interpret):
  hidden, table, geom = _prepare(hidden, table, plan, "ranks", num_items)
  num_tokens = hidden.shape[0]
  num_targets = target_logits.shape[1]
  has_bias = bias is not None
  operands = [hidden, table] + ([bias.astype(jnp.float32)] if has_bias else [])
  operands += [target_logits.astype(jnp.float32), target_ids.astype(jnp.int32)]
  partial = pl.pallas_call(
      functools.partial(_rank_kernel, geom=geom, has_bias=has_bias, num_targets=num_targets,
                        options=options),
      grid=(geom.num_token_tiles, geom.vocab_splits),
      out_shape=jax.ShapeDtypeStruct((geom.vocab_splits, num_tokens, num_targets), jnp.int32),
      compiler_params=_compiler_params(geom),
      interpret=interpret,
      name=f"cutbce_gpu_ranks_bt{geom.block_t}_bv{geom.block_v}_s{geom.vocab_splits}",
  )(*operands)
  return jnp.sum(partial, axis=0)


# --------------------------------------------------------------------------- #
# Softmax cross-entropy: a running (max, sum) forward; dh and dE backward.     #
# --------------------------------------------------------------------------- #

# Excluded ids per position the softmax kernels compare in a tile (the loop
# over them is unrolled); a wider `exclude` takes the XLA path under "auto"
# and is refused under "pallas_gpu" (`cutbce.softmax.softmax_backend`).
MAX_SOFTMAX_EXCLUDE = 32
# Fixed columns per position (exact target terms set in f32 before the cast,
# see xla.py), compared per tile (unrolled); ids past it stay sparse
# corrections (`sparse.sweep_columns`).
MAX_FIXED_COLUMNS = 32
# The running max starts here, as in the XLA path: a finite floor, so that a
# tile of masked (-inf) logits gives exp(-inf - floor) = 0, never a NaN.
SOFTMAX_FLOOR = float(jnp.finfo(jnp.float32).min)


def _softmax_operands(hidden, exclude_ids, valid_rows):
  """(`[T, E]` int32 excluded ids or None, `[T]` int32 row limit or None) for the kernels."""
  exclude = None
  if exclude_ids is not None and exclude_ids.shape[-1]:
    if exclude_ids.shape[-1] > MAX_SOFTMAX_EXCLUDE:
      raise NotImplementedError(
          f"the Pallas GPU softmax kernels compare at most {MAX_SOFTMAX_EXCLUDE} excluded ids "
          f"per position, got {exclude_ids.shape[-1]}")
    exclude = exclude_ids.astype(jnp.int32)
  limit = None
  if valid_rows is not None:  # a vocabulary shard's real rows, per token (no scalar loads)
    limit = jnp.full((hidden.shape[0],), valid_rows, jnp.int32)
  return exclude, limit


def _load_excluded(exclude_ref, token_start, num_exclude: int, geom: Geometry):
  """The token tile's excluded ids: one `[block_t]` int32 column each (-1 past T)."""
  rows, rows_ok = pl.ds(token_start, geom.block_t), _token_rows_ok(token_start, geom)
  return [plgpu.load(exclude_ref.at[rows, jnp.int32(column)], mask=rows_ok, other=-1)
          for column in range(num_exclude)]


def _softmax_columns(vocab_start, valid, limit, excluded, geom: Geometry):
  """(`[block_t, block_v]` bool items counted at x > 0, in each token's softmax).

  Counted: items (< num_items) below the shard's row limit, excluded ids in
  (the caller's sparse counts take them off, as for BCE). In the softmax: those
  minus the token's excluded ids.
  """
  column_ids = vocab_start + lax.broadcasted_iota(jnp.int32, (1, geom.block_v), 1)
  counted = jnp.broadcast_to(valid, (geom.block_t, geom.block_v))
  if limit is not None:
    counted = counted & (column_ids < limit[:, None])
  items = counted
  for ids in excluded:  # E is small and static: unrolled
    items = items & (column_ids != ids[:, None])
  return counted, items


def _softmax_forward_kernel(*refs, geom: Geometry, has_bias: bool, num_exclude: int,
                            has_limit: bool, with_counts: bool):
  refs = list(refs)
  hidden_ref = refs.pop(0)  # [T, D]
  table_ref = refs.pop(0)  # [V, D]
  bias_ref = refs.pop(0) if has_bias else None  # [V] f32
  exclude_ref = refs.pop(0) if num_exclude else None  # [T, E] int32
  limit_ref = refs.pop(0) if has_limit else None  # [T] int32
  max_ref = refs.pop(0)  # [splits, T] f32
  sum_ref = refs.pop(0)  # [splits, T] f32
  count_ref = refs.pop(0) if with_counts else None  # [splits, T] int32
  token_start = pl.program_id(0) * geom.block_t
  split = pl.program_id(1)
  hidden = _load_rows(hidden_ref, token_start, geom.block_t, geom.num_tokens, geom)
  excluded = _load_excluded(exclude_ref, token_start, num_exclude, geom) if num_exclude else []
  limit = None
  if has_limit:
    limit = _load_vector(limit_ref, token_start, geom.block_t, geom.num_tokens)

  def accumulate(tile, carry):
    row_max, row_sum, count = carry
    _, logits, valid = _vocab_step(table_ref, bias_ref, hidden, tile, geom)
    counted, items = _softmax_columns(tile * geom.block_v, valid, limit, excluded, geom)
    if with_counts:
      count = count + jnp.sum((logits > 0.0) & counted, axis=1, dtype=jnp.int32)
    logits = jnp.where(items, logits, -jnp.inf)
    new_max = jnp.maximum(row_max, jnp.max(logits, axis=1))
    row_sum = (row_sum * jnp.exp(row_max - new_max)
               + jnp.sum(jnp.exp(logits - new_max[:, None]), axis=1))
    return new_max, row_sum, count

  first, last = _split_range(split, geom)
  init = (jnp.full((geom.block_t,), SOFTMAX_FLOOR, jnp.float32),
          jnp.zeros((geom.block_t,), jnp.float32), jnp.zeros((geom.block_t,), jnp.int32))
  row_max, row_sum, count = lax.fori_loop(first, last, accumulate, init)
  rows, rows_ok = pl.ds(token_start, geom.block_t), _token_rows_ok(token_start, geom)
  plgpu.store(max_ref.at[split, rows], row_max, mask=rows_ok)
  plgpu.store(sum_ref.at[split, rows], row_sum, mask=rows_ok)
  if with_counts:
    plgpu.store(count_ref.at[split, rows], count, mask=rows_ok)


@functools.partial(jax.named_call, name="cutbce_gpu_softmax_forward")
def softmax_forward(hidden, table, bias, exclude_ids, *, plan: TilePlan | None,
                    with_counts: bool, num_items: int | None = None, valid_rows=None):
  """Per token: running max `[T]` f32, sum exp(x - max) `[T]` f32, #{x > 0} int32 or None."""
  exclude, limit = _softmax_operands(hidden, exclude_ids, valid_rows)
  return _run(_softmax_forward, hidden, table, bias, exclude, limit, plan=plan,
              with_counts=with_counts, num_items=num_items)


def _softmax_forward(hidden, table, bias, exclude, limit, *, plan, with_counts, num_items,
                     interpret):
  hidden, table, geom = _prepare(hidden, table, plan, "forward", num_items)
  num_tokens = hidden.shape[0]
  has_bias = bias is not None
  num_exclude = 0 if exclude is None else exclude.shape[1]
  operands = [hidden, table] + ([bias.astype(jnp.float32)] if has_bias else [])
  operands += [x for x in (exclude, limit) if x is not None]
  partial_shape = (geom.vocab_splits, num_tokens)
  out_shape = [jax.ShapeDtypeStruct(partial_shape, jnp.float32)] * 2
  if with_counts:
    out_shape.append(jax.ShapeDtypeStruct(partial_shape, jnp.int32))
  outputs = pl.pallas_call(
      functools.partial(_softmax_forward_kernel, geom=geom, has_bias=has_bias,
                        num_exclude=num_exclude, has_limit=limit is not None,
                        with_counts=with_counts),
      grid=(geom.num_token_tiles, geom.vocab_splits),
      out_shape=out_shape,
      compiler_params=_compiler_params(geom),
      interpret=interpret,
      name=f"cutbce_gpu_softmax_forward_bt{geom.block_t}_bv{geom.block_v}_s{geom.vocab_splits}",
  )(*operands)
  # The splits' (max, sum) pairs, combined: both finite (the floor), no NaN.
  row_max = jnp.max(outputs[0], axis=0)
  row_sum = jnp.sum(outputs[1] * jnp.exp(outputs[0] - row_max[None, :]), axis=0)
  positive_count = jnp.sum(outputs[2], axis=0) if with_counts else None
  return row_max, row_sum, positive_count


def _softmax_grad(logits, items, log_z, scale, offset):
  """`[block_t, block_v]` f32 G = g (exp(x - log_z) - o) on the softmax's items, 0 elsewhere.

  (`offset` is g_t o_t already; rows past T have g = 0 and log_z = 0.)
  """
  grad = scale[:, None] * jnp.exp(logits - log_z[:, None])
  if offset is not None:
    grad = grad - offset[:, None]
  return jnp.where(items, grad, 0.0)


class _BackwardOperands(NamedTuple):
  """Which optional operands the softmax backward kernels take (static)."""

  has_bias: bool
  num_exclude: int
  has_limit: bool
  has_offset: bool
  num_fixed: int = 0


def _backward_operands(hidden, table, bias, exclude, limit, log_z, scale, offset, fixed):
  """(operand list, `_BackwardOperands`) of the softmax backward kernels, absent ones left out."""
  present = _BackwardOperands(bias is not None, 0 if exclude is None else exclude.shape[1],
                              limit is not None, offset is not None,
                              fixed[0].shape[1] if fixed else 0)
  operands = [hidden, table] + ([] if bias is None else [bias.astype(jnp.float32)])
  operands += [x for x in (exclude, limit, log_z, scale, offset) if x is not None]
  return operands + fixed, present


def _pop_backward_refs(refs: list, present: _BackwardOperands):
  """hidden `[T, D]`, table `[V, D]`, bias `[V]` f32, then the token side: exclude `[T, E]`
  int32, limit `[T]` int32, log_z, scale, offset `[T]` f32, fixed ids and values `[T, K]`
  (None where absent)."""
  hidden, table = refs.pop(0), refs.pop(0)
  bias = refs.pop(0) if present.has_bias else None
  exclude = refs.pop(0) if present.num_exclude else None
  limit = refs.pop(0) if present.has_limit else None
  log_z, scale = refs.pop(0), refs.pop(0)
  offset = refs.pop(0) if present.has_offset else None
  fixed = (refs.pop(0), refs.pop(0)) if present.num_fixed else None
  return hidden, table, bias, (exclude, limit, log_z, scale, offset, fixed)


def _token_side(token_refs, token_start, present: _BackwardOperands, geom: Geometry):
  """One token tile's (excluded id columns, limit, log_z, scale, offset, fixed columns);
  0 or -1 past T."""
  exclude_ref, limit_ref, log_z_ref, scale_ref, offset_ref, fixed_refs = token_refs

  def vector(ref):
    return None if ref is None else _load_vector(ref, token_start, geom.block_t,
                                                 geom.num_tokens)

  excluded = (_load_excluded(exclude_ref, token_start, present.num_exclude, geom)
              if present.num_exclude else [])
  return (excluded, vector(limit_ref), vector(log_z_ref), vector(scale_ref), vector(offset_ref),
          _load_fixed(fixed_refs, token_start, present.num_fixed, geom))


def _softmax_hidden_grad_kernel(*refs, geom: Geometry, present: _BackwardOperands):
  refs = list(refs)
  hidden_ref, table_ref, bias_ref, token_refs = _pop_backward_refs(refs, present)
  hidden_grad_ref = refs.pop(0)  # [splits, T, D] f32
  token_start = pl.program_id(0) * geom.block_t
  split = pl.program_id(1)
  hidden = _load_rows(hidden_ref, token_start, geom.block_t, geom.num_tokens, geom)
  excluded, limit, log_z, scale, offset, fixed = _token_side(token_refs, token_start, present,
                                                              geom)

  def accumulate(tile, hidden_grad):
    table, logits, valid = _vocab_step(table_ref, bias_ref, hidden, tile, geom)
    _, items = _softmax_columns(tile * geom.block_v, valid, limit, excluded, geom)
    grad = _set_fixed(_softmax_grad(logits, items, log_z, scale, offset), tile * geom.block_v,
                      fixed, geom)
    return hidden_grad + _dot(grad.astype(hidden.dtype), table, NN_DIMS)

  first, last = _split_range(split, geom)
  hidden_grad = lax.fori_loop(first, last, accumulate,
                              jnp.zeros((geom.block_t, geom.dim_padded), jnp.float32))
  _store_rows(hidden_grad_ref, hidden_grad, token_start, geom.num_tokens, geom, split)


def _softmax_table_grad_kernel(*refs, geom: Geometry, present: _BackwardOperands):
  refs = list(refs)
  hidden_ref, table_ref, bias_ref, token_refs = _pop_backward_refs(refs, present)
  out_refs = _table_grad_outputs(refs, present.has_bias)
  vocab_start = pl.program_id(0) * geom.block_v
  table = _load_rows(table_ref, vocab_start, geom.block_v, geom.vocab, geom)  # [block_v, D]
  bias = (_load_vector(bias_ref, vocab_start, geom.block_v, geom.vocab)
          if present.has_bias else None)
  valid = _column_valid(vocab_start, geom)

  def tile_grad(token_start, hidden):
    excluded, limit, log_z, scale, offset, fixed = _token_side(token_refs, token_start,
                                                                present, geom)
    _, items = _softmax_columns(vocab_start, valid, limit, excluded, geom)
    logits = _tile_logits(hidden, table, bias)  # [block_t, block_v] f32
    return _set_fixed(_softmax_grad(logits, items, log_z, scale, offset), vocab_start, fixed,
                      geom)

  _table_grad_sweep(hidden_ref, out_refs, vocab_start, geom, present.has_bias, tile_grad)


@functools.partial(jax.named_call, name="cutbce_gpu_softmax_backward")
def softmax_backward(hidden, table, bias, exclude_ids, log_z, scale, table_grad, bias_grad,
                     offset=None, fixed_ids=None, fixed_values=None, *,
                     plan: TilePlan | None, num_items: int | None = None, valid_rows=None):
  """dh `[T, D]` f32, `table_grad` (+ dense part) `[V, D]` f32, `bias_grad` or None.

  G_tv = g_t exp(x_tv - log_z_t) - o_t on each token's softmax items, 0
  elsewhere (the contract in `cutbce/kernels/xla.py`): a dh kernel over token
  tiles and a dE kernel over vocab tiles, 2 dots per tile each, as for BCE.
  """
  exclude, limit = _softmax_operands(hidden, exclude_ids, valid_rows)
  scale = scale.astype(jnp.float32)
  offset = None if offset is None else offset.astype(jnp.float32)
  fixed = _fixed_operands(fixed_ids, fixed_values)
  hidden_grad = _run(_softmax_hidden_grad, hidden, table, bias, exclude, limit,
                     log_z.astype(jnp.float32), scale, offset, *fixed, plan=plan,
                     num_items=num_items)
  table_grad, bias_grad = _run(
      _softmax_table_grad, hidden, table, bias, exclude, limit, log_z.astype(jnp.float32),
      scale, offset, *fixed, table_grad, bias_grad, plan=plan, num_items=num_items)
  return hidden_grad, table_grad, bias_grad


def _softmax_hidden_grad(hidden, table, bias, exclude, limit, log_z, scale, offset, fixed_ids,
                         fixed_values, *, plan, num_items, interpret):
  fixed = _fixed_list(fixed_ids, fixed_values)
  hidden, table, geom = _prepare(hidden, table, plan, "backward", num_items)
  operands, present = _backward_operands(hidden, table, bias, exclude, limit, log_z, scale,
                                         offset, fixed)
  partial = pl.pallas_call(
      functools.partial(_softmax_hidden_grad_kernel, geom=geom, present=present),
      grid=(geom.num_token_tiles, geom.vocab_splits),
      out_shape=jax.ShapeDtypeStruct((geom.vocab_splits,) + hidden.shape, jnp.float32),
      compiler_params=_compiler_params(geom),
      interpret=interpret,
      name=f"cutbce_gpu_softmax_dh_bt{geom.block_t}_bv{geom.block_v}_s{geom.vocab_splits}",
  )(*operands)
  return jnp.sum(partial, axis=0)


def _softmax_table_grad(hidden, table, bias, exclude, limit, log_z, scale, offset, fixed_ids,
                        fixed_values, table_grad, bias_grad, *, plan, num_items, interpret):
  fixed = _fixed_list(fixed_ids, fixed_values)
  hidden, table, geom = _prepare(hidden, table, plan, "table_grad", num_items)
  operands, present = _backward_operands(hidden, table, bias, exclude, limit, log_z, scale,
                                         offset, fixed)
  kernel = functools.partial(_softmax_table_grad_kernel, geom=geom, present=present)
  return _call_table_grad(kernel, operands, table_grad, bias_grad, geom, interpret,
                          name=f"cutbce_gpu_softmax_de_bt{geom.block_t}_bv{geom.block_v}")
