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

Ragged T, V and D: loads are masked (`other=0`) past T rows, past
`num_items` table rows and past D columns (D is padded to a power of two in
registers, never in memory); logit columns past `num_items` are masked out of
every sum. How a kernel runs is chosen when the program is lowered (`_run`):
for CUDA it is compiled by Triton; anywhere else it runs in Pallas'
interpreter, whose out-of-bounds reads are NaN, so a missing mask fails the
tests. float32 dots use IEEE float32 (Triton's default for f32 operands in
this lowering), bfloat16 dots accumulate in float32.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from cutbce import variants
from cutbce.kernels.gpu import plan as gpu_plan
from cutbce.kernels.gpu.plan import Geometry
from cutbce.kernels.tiling import TilePlan
from cutbce.variants import LossOptions

SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
# Targets per rank-kernel call: its comparison loop over L is unrolled.
MAX_RANK_TARGETS = 32
NT_DIMS = (((1,), (1,)), ((), ()))  # [M, K] x [N, K] -> [M, N]
TN_DIMS = (((0,), (0,)), ((), ()))  # [K, M] x [K, N] -> [M, N]
NN_DIMS = (((1,), (0,)), ((), ()))  # [M, K] x [K, N] -> [M, N]


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
  dtype = jnp.result_type(jnp.dtype(hidden_dtype), jnp.dtype(table_dtype))
  if dtype not in SUPPORTED_DTYPES:
    return (
        "the Pallas GPU kernels compute in float32 or bfloat16; got hidden "
        f"{jnp.dtype(hidden_dtype)} and table {jnp.dtype(table_dtype)} (common type {dtype})"
    )
  if num_tokens < 1:
    return f"the Pallas GPU kernels need at least one token, got T={num_tokens}"
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


def _load_rows(ref, start, num_rows: int, limit: int, geom: Geometry):
  """`[num_rows, dim_padded]` rows [start, start + num_rows) of `ref`; 0 past `limit` or D."""
  row_ok = start + lax.broadcasted_iota(jnp.int32, (num_rows, 1), 0) < limit
  column_ok = lax.broadcasted_iota(jnp.int32, (1, geom.dim_padded), 1) < geom.dim
  mask = jnp.broadcast_to(row_ok & column_ok, (num_rows, geom.dim_padded))
  return plgpu.load(ref.at[pl.ds(start, num_rows), pl.ds(0, geom.dim_padded)], mask=mask,
                    other=0)


def _load_vector(ref, start, size: int, limit: int):
  """`[size]` entries [start, start + size) of a 1-D ref, 0 past `limit`."""
  ok = start + lax.broadcasted_iota(jnp.int32, (size,), 0) < limit
  return plgpu.load(ref.at[pl.ds(start, size)], mask=ok, other=0)


def _store_rows(ref, value, start, limit: int, geom: Geometry, *leading):
  """Stores `[num_rows, dim_padded]` `value` at `ref[*leading, start:, :D]` (masked).

  `leading` indices (a split) go in the same indexer: a ref narrowed twice
  (`ref.at[i].at[...]`) is stored wrongly by the interpreter in jax 0.10.2.
  """
  num_rows = value.shape[0]
  row_ok = start + lax.broadcasted_iota(jnp.int32, (num_rows, 1), 0) < limit
  column_ok = lax.broadcasted_iota(jnp.int32, (1, geom.dim_padded), 1) < geom.dim
  mask = jnp.broadcast_to(row_ok & column_ok, value.shape)
  index = (*leading, pl.ds(start, num_rows), pl.ds(0, geom.dim_padded))
  plgpu.store(ref.at[index], value, mask=mask)


def _column_valid(start, geom: Geometry):
  """`[1, block_v]` bool: the tile's columns that are items (< num_items)."""
  return start + lax.broadcasted_iota(jnp.int32, (1, geom.block_v), 1) < geom.vocab


def _tile_logits(hidden, table_tile, bias_tile):
  """`[block_t, block_v]` float32 logits h . e (+ b) on the tensor cores."""
  logits = lax.dot_general(hidden, table_tile, NT_DIMS, preferred_element_type=jnp.float32)
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
                        with_loss: bool, with_counts: bool):
  refs = list(refs)
  hidden_ref = refs.pop(0)  # [T, D]
  scale_ref = refs.pop(0)  # [T] f32, g_t
  table_ref = refs.pop(0)  # [V, D]
  bias_ref = refs.pop(0) if has_bias else None  # [V] f32
  hidden_grad_ref = refs.pop(0)  # [splits, T, D] f32
  dense_ref = refs.pop(0) if with_loss else None  # [splits, T] f32
  count_ref = refs.pop(0) if with_counts else None  # [splits, T] int32
  token_start = pl.program_id(0) * geom.block_t
  split = pl.program_id(1)
  hidden = _load_rows(hidden_ref, token_start, geom.block_t, geom.num_tokens, geom)
  scale = _load_vector(scale_ref, token_start, geom.block_t, geom.num_tokens)  # 0 past T
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
      derivative = variants.tile_grad(options, logits)
    grad = jnp.where(valid, scale[:, None] * derivative, 0.0)  # [block_t, block_v] f32
    hidden_grad = hidden_grad + lax.dot_general(
        grad.astype(compute_dtype), table, NN_DIMS, preferred_element_type=jnp.float32
    )  # [block_t, D]
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


def _table_grad_kernel(*refs, geom: Geometry, has_bias: bool, options: LossOptions):
  refs = list(refs)
  hidden_ref = refs.pop(0)  # [T, D]
  scale_ref = refs.pop(0)  # [T] f32
  table_ref = refs.pop(0)  # [V, D]
  bias_ref = refs.pop(0) if has_bias else None  # [V] f32
  table_grad_in_ref = refs.pop(0)  # [V, D] f32, the given (sparse) part
  bias_grad_in_ref = refs.pop(0) if has_bias else None  # [V] f32
  table_grad_ref = refs.pop(0)  # [V, D] f32, aliased with table_grad_in
  bias_grad_ref = refs.pop(0) if has_bias else None  # [V] f32, aliased
  vocab_start = pl.program_id(0) * geom.block_v
  table = _load_rows(table_ref, vocab_start, geom.block_v, geom.vocab, geom)  # [block_v, D]
  bias = _load_vector(bias_ref, vocab_start, geom.block_v, geom.vocab) if has_bias else None
  valid = _column_valid(vocab_start, geom)
  compute_dtype = table.dtype

  def accumulate(token_tile, carry):
    table_grad, bias_grad = carry
    token_start = token_tile * geom.block_t
    hidden = _load_rows(hidden_ref, token_start, geom.block_t, geom.num_tokens, geom)
    scale = _load_vector(scale_ref, token_start, geom.block_t, geom.num_tokens)  # 0 past T
    logits = _tile_logits(hidden, table, bias)  # [block_t, block_v] f32
    grad = jnp.where(valid, scale[:, None] * variants.tile_grad(options, logits), 0.0)
    table_grad = table_grad + lax.dot_general(
        grad.astype(compute_dtype), hidden, TN_DIMS, preferred_element_type=jnp.float32
    )  # [block_v, D]
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


@functools.partial(jax.named_call, name="cutbce_gpu_backward")
def backward(hidden, table, bias, scale, table_grad, bias_grad, *, plan: TilePlan | None,
             options: LossOptions = variants.PLAIN, num_items: int | None = None):
  """dh `[T, D]` f32; `table_grad` (+ dense part) `[V, D]` f32; `bias_grad` `[V]` or None."""
  _, _, *grads = _sweeps(hidden, table, bias, scale, table_grad, bias_grad, plan=plan,
                         options=options, num_items=num_items, with_loss=False,
                         with_counts=False)
  return tuple(grads)


@functools.partial(jax.named_call, name="cutbce_gpu_forward_backward")
def forward_backward(hidden, table, bias, scale, table_grad, bias_grad, *,
                     plan: TilePlan | None, with_counts: bool,
                     options: LossOptions = variants.PLAIN, num_items: int | None = None):
  """The dh kernel also sums phi and counts x > 0: one pass, 4 dots per tile in two kernels.

  Returns (dense_sum [T] f32, positive_count [T] int32 or None, dh, table_grad, bias_grad).
  """
  return _sweeps(hidden, table, bias, scale, table_grad, bias_grad, plan=plan, options=options,
                 num_items=num_items, with_loss=True, with_counts=with_counts)


def _sweeps(hidden, table, bias, scale, table_grad, bias_grad, *, plan, options, num_items,
            with_loss, with_counts):
  dense_sum, positive_count, hidden_grad = _run(
      _hidden_grad, hidden, table, bias, scale, plan=plan, options=options,
      num_items=num_items, with_loss=with_loss, with_counts=with_counts)
  table_grad, bias_grad = _run(
      _table_grad, hidden, table, bias, scale, table_grad, bias_grad, plan=plan,
      options=options, num_items=num_items)
  return dense_sum, positive_count, hidden_grad, table_grad, bias_grad


def _hidden_grad(hidden, table, bias, scale, *, plan, options, num_items, with_loss,
                 with_counts, interpret):
  hidden, table, geom = _prepare(hidden, table, plan, "backward", num_items)
  num_tokens, dim = hidden.shape
  has_bias = bias is not None
  operands = [hidden, scale.astype(jnp.float32), table]
  if has_bias:
    operands.append(bias.astype(jnp.float32))
  partial_shape = (geom.vocab_splits, num_tokens)
  out_shape = [jax.ShapeDtypeStruct(partial_shape + (dim,), jnp.float32)]
  if with_loss:
    out_shape.append(jax.ShapeDtypeStruct(partial_shape, jnp.float32))
  if with_counts:
    out_shape.append(jax.ShapeDtypeStruct(partial_shape, jnp.int32))
  outputs = list(pl.pallas_call(
      functools.partial(_hidden_grad_kernel, geom=geom, has_bias=has_bias, options=options,
                        with_loss=with_loss, with_counts=with_counts),
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


def _table_grad(hidden, table, bias, scale, table_grad, bias_grad, *, plan, options, num_items,
                interpret):
  hidden, table, geom = _prepare(hidden, table, plan, "table_grad", num_items)
  has_bias = bias is not None
  operands = [hidden, scale.astype(jnp.float32), table]
  if has_bias:
    operands.append(bias.astype(jnp.float32))
  aliases = {len(operands): 0}  # given table_grad -> dE output, updated in place
  operands.append(table_grad.astype(jnp.float32))
  out_shape = [jax.ShapeDtypeStruct(table_grad.shape, jnp.float32)]
  if has_bias:
    aliases[len(operands)] = 1
    operands.append(bias_grad.astype(jnp.float32))
    out_shape.append(jax.ShapeDtypeStruct(bias_grad.shape, jnp.float32))
  outputs = pl.pallas_call(
      functools.partial(_table_grad_kernel, geom=geom, has_bias=has_bias, options=options),
      grid=(geom.num_vocab_tiles,),
      out_shape=out_shape,
      input_output_aliases=aliases,
      compiler_params=_compiler_params(geom),
      interpret=interpret,
      name=f"cutbce_gpu_de_bt{geom.block_t}_bv{geom.block_v}",
  )(*operands)
  return outputs[0], (outputs[1] if has_bias else None)


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
      # A target's own column is left out (as in the XLA path), so its rank
      # does not depend on the tile and the gather rounding x_tp alike.
      larger = ((logits > target_logits[target][:, None])
                & (column_ids != target_ids[target][:, None]) & valid)
      updated.append(count + jnp.sum(larger, axis=1, dtype=jnp.int32))
    return tuple(updated)

  first, last = _split_range(split, geom)
  init = tuple(jnp.zeros((geom.block_t,), jnp.int32) for _ in range(num_targets))
  counts = lax.fori_loop(first, last, accumulate, init)
  for target, count in enumerate(counts):
    plgpu.store(count_ref.at[split, rows, jnp.int32(target)], count, mask=rows_ok)


@functools.partial(jax.named_call, name="cutbce_gpu_rank_counts")
def rank_counts(hidden, table, bias, target_logits, target_ids, *, plan: TilePlan | None,
                options: LossOptions = variants.PLAIN, num_items: int | None = None):
  """`[T, L]` int32 #{v != target_ids[t, l] : cap(x_tv) > target_logits[t, l]}."""
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
