"""Kernel set of `backend="pallas_gpu"`: fused Mosaic GPU kernels (TMA, wgmma).

Honours the backend contract written in `cutbce/kernels/xla.py` on flattened
`[T, D]` tokens, for the BCE and the softmax cross-entropy. Two kernels
(`mosaic_kernels.py`), each computing every logit tile once, on the tensor
cores, the tile living only in registers:

  sweep   grid (token blocks, vocab splits). Warp-specialized where it
          fits (all but float32 at D = 128): a producer warpgroup streams
          the split's `[block_v, Dp]` table tiles (and bias) through a TMA
          pipeline of `stages` buffers, and two consumer warpgroups, each
          with its own `[64, Dp]` hidden tile in shared memory (128 tokens
          per CTA), read every buffer; elsewhere one warpgroup holds one
          hidden tile and issues its own copies.
          Per tile X = H E^T (wgmma), then BCE: from one e = exp(-|x|) and
          one r = 1 / (1 + e), softplus sums, counts of x > 0 and
          G = g sigmoid(x); softmax: a running (max, sum of exp) and counts
          (forward) or G = g exp(x - log_z) - o (backward); the fixed
          columns set in float32; G to shared memory and dh += G E (wgmma).
          Outputs per split (`[splits, T]`, `[splits, T, Dp]` f32), combined
          here.
  table   grid (vocab blocks of 128 rows, warp-specialized the same way:
          two consumers of 64 rows each share the producer's token tiles;
          or of 64 rows with one warpgroup). A consumer holds its table
          tile and reads the streamed token tiles: it recomputes X and G
          as the sweep does and accumulates dE += G^T H (wgmma, transposed
          operand) and db += sum_t G in float32 registers, written once:
          deterministic, no atomics.

float32 inputs stay exact on the tensor cores: every operand is split into
three bfloat16 pieces (`pieces.py`) and each dot is the six piece products
that reach float32 precision (never TF32, never FMA loops); bfloat16 inputs
are one piece, one product. Shapes that do not divide the tiles are padded
here (`mosaic_plan`): T to 64 per consumer, 128 warp-specialized
(g = 0 there), D to 64 (zero columns), the
catalog to the tile (zero rows, masked columns past `num_items`). The
kernels are compiled by Mosaic GPU on a GPU or for a named target and run
in Pallas' Mosaic GPU interpreter anywhere else, chosen when traced
(`_call`; `mosaic_ops` keeps the few primitives the interpreter lacks).

What the Mosaic kernels do not take yet goes to the Pallas Triton kernel
set (`backend="pallas_triton"`, `triton.py`): BCE variants with a logit cap
or focal terms, more than `MAX_FIXED_COLUMNS` fixed columns or
`MOSAIC_MAX_EXCLUDE` excluded ids per position, the rank kernels, and any
call interpreted inside a mapped axis of several devices (the interpreter
cannot run concurrently; `_interpreted_on_several_devices`) (docs/kernels.md,
"Mosaic GPU kernels").
"""

from __future__ import annotations

import functools
import jax
from jax._src import core as jax_core
import jax.numpy as jnp

from cutbce import variants
from cutbce.kernels.gpu import mosaic_kernels as kernels
from cutbce.kernels.gpu import plan as gpu_plan
from cutbce.kernels.gpu import mosaic_plan, pieces
from cutbce.kernels.gpu import triton
from cutbce.kernels.gpu.mosaic_plan import BLOCK_T, Geometry
from cutbce.kernels.tiling import TilePlan
from cutbce.variants import LossOptions

# The rank kernels are the Triton set's (module docstring).
rank_logits = triton.rank_logits
rank_counts = triton.rank_counts

SUPPORTED_DTYPES = gpu_plan.SUPPORTED_DTYPES
PIECES = {jnp.dtype(jnp.bfloat16): 1, jnp.dtype(jnp.float32): 3}
# Fixed columns per token the kernels compare in a tile (unrolled); the
# sweeps of `cutbce.tiled` keep any past it as sparse corrections.
MAX_FIXED_COLUMNS = 16
# Excluded ids per token the Mosaic softmax kernels compare in a tile
# (unrolled); a call with more goes to the Triton kernels, so the set takes
# up to theirs (`MAX_SOFTMAX_EXCLUDE`, read by `cutbce.softmax`).
MOSAIC_MAX_EXCLUDE = 16
MAX_SOFTMAX_EXCLUDE = triton.MAX_SOFTMAX_EXCLUDE


def _interpret_params():
  from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams  # pylint: disable=g-import-not-at-top
  return InterpretGPUParams()


# --------------------------------------------------------------------------- #
# Support checks and plans.                                                    #
# --------------------------------------------------------------------------- #


def unsupported_reason(num_tokens, vocab, dim, hidden_dtype, table_dtype, plan=None) -> str | None:
  """Why these inputs cannot run on the GPU kernels, or None when they can."""
  problem = gpu_plan.input_problem(num_tokens, hidden_dtype, table_dtype)
  if problem is not None:
    return problem
  dtype = jnp.result_type(jnp.dtype(hidden_dtype), jnp.dtype(table_dtype))
  try:
    mosaic_plan.geometry(num_tokens, vocab, dim, PIECES[dtype], plan=plan)
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
    geom = mosaic_plan.geometry(num_tokens, vocab, dim, PIECES[jnp.dtype(dtype)])
  except ValueError as error:
    raise NotImplementedError(str(error)) from error
  return TilePlan(block_v=geom.block_v, block_t=BLOCK_T)


def _interpreted_on_several_devices() -> bool:
  """Whether the kernels would be interpreted inside a mapped axis of size > 1.

  Pallas' Mosaic GPU interpreter keeps one global simulated memory: kernels
  interpreted concurrently on several devices (a `shard_map` over CPU
  devices) corrupt it (jax 0.10.2 and 0.12: "Barrier remains allocated",
  then a hang). Compiled kernels are unaffected.
  """
  if _compiled_here():
    return False
  try:
    sizes = jax_core.get_axis_env().axis_sizes
  except AttributeError:  # a jax without the axis environment: assume none
    return False
  return any(size > 1 for size in sizes.values())


def _takes(options: LossOptions, fixed_ids) -> bool:
  """Whether the Mosaic kernels take this call (else it goes to the Triton set)."""
  num_fixed = 0 if fixed_ids is None else fixed_ids.shape[-1]
  return (options.is_affine and num_fixed <= MAX_FIXED_COLUMNS
          and not _interpreted_on_several_devices())


# --------------------------------------------------------------------------- #
# Operands: padded, split into pieces, laid out for TMA.                       #
# --------------------------------------------------------------------------- #


def _pad_to(x, shape, value=0):
  """`x` padded at the end of every axis to `shape` (no copy when it already fits)."""
  widths = [(0, want - have) for have, want in zip(x.shape, shape)]
  if not any(w for _, w in widths):
    return x
  return jnp.pad(x, widths, constant_values=value)


def _token_lists(ids, values, tokens: int):
  """`[T, n]` ids and values -> `[n, Tp]` (ids -1 past T), or (None, None) for none."""
  if ids is None or not ids.shape[-1]:
    return None, None
  ids = _pad_to(ids.astype(jnp.int32).T, (ids.shape[-1], tokens), value=-1)
  values = None if values is None else _pad_to(values.astype(jnp.float32).T,
                                               (values.shape[-1], tokens))
  return ids, values


def _prepared(hidden, table, bias, geom: Geometry):
  """(hidden pieces `[Tp, Dp]`, table pieces `[Vp, Dp]`, bias `[Vp]` f32 or None).

  Only the first num_items rows are read; rows past them up to the tile are
  zeros, as are the padded tokens and columns.
  """
  tokens, rows, dim = geom.tokens_padded, geom.vocab_padded, geom.dim_padded
  if table.shape[0] != rows:
    table = _pad_to(table[:min(table.shape[0], geom.num_items)], (rows, table.shape[1]))
  table = _pad_to(table, (rows, dim))
  hidden = _pad_to(hidden, (tokens, dim))
  if bias is not None:
    bias = _pad_to(bias.astype(jnp.float32)[:geom.num_items], (rows,))
  return (pieces.split_pieces(hidden, geom.pieces), pieces.split_pieces(table, geom.pieces),
          bias)


def _side(geom: Geometry, *, scale=None, log_z=None, offset=None, limit=None, fixed_ids=None,
          fixed_values=None, exclude=None) -> dict:
  """The per-token operands, padded to Tp (g = 0 on padded tokens), lists transposed."""
  tokens = geom.tokens_padded
  vector = lambda x, dtype: None if x is None else _pad_to(x.astype(dtype), (tokens,))  # noqa: E731
  fixed_ids, fixed_values = _token_lists(fixed_ids, fixed_values, tokens)
  exclude, _ = _token_lists(exclude, None, tokens)
  return {"scale": vector(scale, jnp.float32), "log_z": vector(log_z, jnp.float32),
          "offset": vector(offset, jnp.float32), "limit": vector(limit, jnp.int32),
          "fixed_ids": fixed_ids, "fixed_values": fixed_values, "exclude": exclude}


def _geometry(hidden, table, plan, num_items, side: dict) -> Geometry:
  dtype = jnp.result_type(hidden.dtype, table.dtype)
  reason = unsupported_reason(hidden.shape[0], table.shape[0], table.shape[1], hidden.dtype,
                              table.dtype, plan)
  if reason is not None:
    raise NotImplementedError(reason)
  num_items = table.shape[0] if num_items is None else num_items
  token_rows = len(kernels.VECTOR_FIELDS) + sum(
      0 if side.get(name) is None else side[name].shape[-1] for name in kernels.LIST_FIELDS)
  return mosaic_plan.geometry(hidden.shape[0], num_items, hidden.shape[1], PIECES[dtype],
                              token_rows, plan)


def _compiled_here() -> bool:
  """Whether the kernels are compiled (a GPU attached, or a target named) or interpreted."""
  return jax.default_backend() == "gpu" or gpu_plan.current_target_name() is not None


def _call(hidden, table, bias, plan, num_items, **side):
  """(Geometry, prepared operands, padded side, interpret, params) of one call.

  The kernels are compiled by Mosaic GPU where a GPU is jax's default backend
  or inside `cutbce.kernels.gpu.target_gpu(name)` (compiling for a target with
  no GPU attached), and interpreted everywhere else: chosen when traced.
  Unlike the Triton set's, the choice cannot wait for lowering
  (`lax.platform_dependent`): the interpreter's ordered callbacks give its
  branch effects the compiled branch lacks.
  """
  geom = _geometry(hidden, table, plan, num_items, side)
  interpret = not _compiled_here()
  params = _interpret_params() if interpret else None
  return (geom, _prepared(hidden, table, bias, geom), _side(geom, **side), interpret, params)


def _sum_splits(array, geom: Geometry):
  return jnp.sum(array, axis=0)[:geom.num_tokens]


def _sweep(hidden, table, bias, *, plan, num_items, kind, with_loss, with_counts, with_grad,
           **side):
  geom, (hidden_p, table_p, bias_p), side_arrays, interpret, params = _call(
      hidden, table, bias, plan, num_items, **side)
  flags = kernels.Flags(kind, bias is not None, with_loss, with_counts, with_grad)
  out = kernels.sweep(hidden_p, table_p, bias_p, side_arrays, geom=geom, flags=flags,
                      interpret=interpret, params=params)
  if "dh" in out:
    out["dh"] = _sum_splits(out["dh"], geom)[:, :geom.dim]
  if "counts" in out:  # per split exact in float32 (< 2^24); summed as integers
    out["counts"] = _sum_splits(out["counts"].astype(jnp.int32), geom)
  if "loss" in out:
    out["loss"] = _sum_splits(out["loss"], geom)
  return out


def _table_grad(hidden, table, bias, *, plan, num_items, kind, **side):
  """dE `[V, D]` f32 (rows past num_items 0) and db `[V]` f32 or None of the dense part."""
  geom, (hidden_p, table_p, bias_p), side_arrays, interpret, params = _call(
      hidden, table, bias, plan, num_items, **side)
  flags = kernels.Flags(kind, bias is not None, False, False, True)
  table_grad, bias_grad = kernels.table_grad(hidden_p, table_p, bias_p, side_arrays, geom=geom,
                                             flags=flags, interpret=interpret, params=params)
  rows = table.shape[0]
  table_grad = _pad_to(table_grad[:geom.num_items, :geom.dim], (rows, geom.dim))
  bias_grad = None if bias is None else _pad_to(bias_grad[:geom.num_items], (rows,))
  return table_grad, bias_grad


def _add_dense(table_grad, bias_grad, dense_table_grad, dense_bias_grad):
  return (table_grad + dense_table_grad,
          None if bias_grad is None else bias_grad + dense_bias_grad)


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
  out = _sweep(hidden, table, bias, plan=plan, num_items=num_items, kind="bce", with_loss=True,
               with_counts=with_counts, with_grad=False)
  return out["loss"], out.get("counts")


def _sweeps(hidden, table, bias, scale, table_grad, bias_grad, fixed_ids, fixed_values, *, plan,
            num_items, with_loss, with_counts):
  side = dict(scale=scale, fixed_ids=fixed_ids, fixed_values=fixed_values)
  out = _sweep(hidden, table, bias, plan=plan, num_items=num_items, kind="bce",
               with_loss=with_loss, with_counts=with_counts, with_grad=True, **side)
  table_grad, bias_grad = _add_dense(table_grad, bias_grad, *_table_grad(
      hidden, table, bias, plan=plan, num_items=num_items, kind="bce", **side))
  return out.get("loss"), out.get("counts"), out["dh"], table_grad, bias_grad


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


def _softmax_takes(exclude_ids, fixed_ids=None) -> bool:
  num_exclude = 0 if exclude_ids is None else exclude_ids.shape[-1]
  num_fixed = 0 if fixed_ids is None else fixed_ids.shape[-1]
  return (num_exclude <= MOSAIC_MAX_EXCLUDE and num_fixed <= MAX_FIXED_COLUMNS
          and not _interpreted_on_several_devices())


def _limit(hidden, valid_rows):
  """A vocabulary shard's real rows, per token (`[T]` int32), or None."""
  return None if valid_rows is None else jnp.full((hidden.shape[0],), valid_rows, jnp.int32)


@functools.partial(jax.named_call, name="cutbce_mosaic_softmax_forward")
def softmax_forward(hidden, table, bias, exclude_ids, *, plan: TilePlan | None,
                    with_counts: bool, num_items: int | None = None, valid_rows=None):
  """Per token: running max `[T]` f32, sum exp(x - max) `[T]` f32, #{x > 0} int32 or None."""
  if not _softmax_takes(exclude_ids):
    return triton.softmax_forward(hidden, table, bias, exclude_ids, plan=None,
                                  with_counts=with_counts, num_items=num_items,
                                  valid_rows=valid_rows)
  out = _sweep(hidden, table, bias, plan=plan, num_items=num_items, kind="softmax",
               with_loss=True, with_counts=with_counts, with_grad=False,
               exclude=exclude_ids, limit=_limit(hidden, valid_rows))
  num_tokens = hidden.shape[0]
  # The splits' (max, sum) pairs, combined: both finite (the floor), no NaN.
  split_max, split_sum = out["max"][:, :num_tokens], out["sum"][:, :num_tokens]
  row_max = jnp.max(split_max, axis=0)
  row_sum = jnp.sum(split_sum * jnp.exp(split_max - row_max[None, :]), axis=0)
  return row_max, row_sum, out.get("counts")


@functools.partial(jax.named_call, name="cutbce_mosaic_softmax_backward")
def softmax_backward(hidden, table, bias, exclude_ids, log_z, scale, table_grad, bias_grad,
                     offset=None, fixed_ids=None, fixed_values=None, *,
                     plan: TilePlan | None, num_items: int | None = None, valid_rows=None):
  """dh `[T, D]` f32, `table_grad` (+ dense part) `[V, D]` f32, `bias_grad` or None.

  G_tv = g_t exp(x_tv - log_z_t) - o_t on each token's softmax items, 0
  elsewhere, fixed columns set (the contract in `cutbce/kernels/xla.py`).
  """
  if not _softmax_takes(exclude_ids, fixed_ids):
    return triton.softmax_backward(hidden, table, bias, exclude_ids, log_z, scale, table_grad,
                                   bias_grad, offset, fixed_ids, fixed_values, plan=None,
                                   num_items=num_items, valid_rows=valid_rows)
  side = dict(scale=scale, log_z=log_z, offset=offset, limit=_limit(hidden, valid_rows),
              fixed_ids=fixed_ids, fixed_values=fixed_values, exclude=exclude_ids)
  out = _sweep(hidden, table, bias, plan=plan, num_items=num_items, kind="softmax",
               with_loss=False, with_counts=False, with_grad=True, **side)
  table_grad, bias_grad = _add_dense(table_grad, bias_grad, *_table_grad(
      hidden, table, bias, plan=plan, num_items=num_items, kind="softmax", **side))
  return out["dh"], table_grad, bias_grad
