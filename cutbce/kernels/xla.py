"""The portable path: `lax.scan` over vocabulary tiles, no `[T, V]` array.

Every step slices `block_v` rows of the table (a view, never a copy of the
table), makes one `[T, block_v]` float32 logit tile, reduces it and drops it.
The vocabulary is walked as `V // block_v` full tiles in a scan plus, when
`block_v` does not divide V, one statically shaped tail tile after it, so no
tile is ragged and nothing needs masking or padding.

Backend contract (shared with `tpu.py`), all on flattened `[T, D]` tokens.
Only the first `num_items` rows of the table are items (a static int <= V);
the rest are never read. `options` is a `cutbce.variants.LossOptions` and
phi = `variants.tile_value(options, .)` the per-logit term a tile sums
(softplus for plain BCE), phi' its derivative (sigmoid for plain BCE).
`plan=None` lets each kernel take its own `default_plan`.

  forward(hidden, table, bias, *, plan, with_counts, options, num_items)
      -> (dense_sum [T] f32, positive_count [T] int32 or None)
      sum_v phi(x_tv), and #{v : x_tv > 0} when `with_counts`.
  backward(hidden, table, bias, scale, table_grad, bias_grad, fixed_ids=None,
           fixed_values=None, *, plan, options, num_items)
      -> (dh [T, D] f32, table_grad [V, D] f32, bias_grad [V] f32 or None)
      dh = sum_v G_tv e_v; adds sum_t G_tv h_t to `table_grad` (and
      sum_t G_tv to `bias_grad`), with G_tv = g_t phi'(x_tv), g = `scale` [T],
      except at the fixed columns (below).
  forward_backward(hidden, table, bias, scale, table_grad, bias_grad, fixed_ids=None,
                   fixed_values=None, *, plan, with_counts, options, num_items)
      -> (dense_sum, positive_count or None, dh, table_grad, bias_grad)
      forward and backward in one sweep, 3 GEMMs per tile: for callers that
      know g_t at forward time (reductions "mean" and "sum").

  Fixed columns (`fixed_ids` int32 [T, K], -1 or any id out of range for
  none, and `fixed_values` float32 [T, K], both or neither): the logit
  gradient is *set*, G_{t, fixed_ids[t, k]} = fixed_values[t, k], in float32
  before the tile is cast to the input dtype for its two GEMMs. The callers
  put the targets' (and excluded ids') exact terms there, e.g. sigmoid(x) - 1
  = -sigmoid(-x) for a plain BCE target: held in bfloat16, sigmoid(7) is 1 and
  a separate f32 correction of -1 would leave 0 (`cutbce/tiled.py`). The
  Pallas kernels compare each column with K ids (unrolled), so they take at
  most `MAX_FIXED_COLUMNS` of them; here K is unlimited (None).
  rank_logits(hidden, table, bias, ids, *, plan, num_targets, options, num_items)
      -> [T, K] f32: cap(x_{t, ids[t, k]}) for ids in [0, num_items), 0 for
      others, computed by the very tile computation `rank_counts` makes (the
      plan `rank_counts` makes for L = num_targets), so that a target and an
      item with an identical embedding get the same float.
  rank_counts(hidden, table, bias, target_logits, target_ids, *, plan, options, num_items)
      -> [T, L] int32: #{v != target_ids[t, l] : cap(x_tv) >= target_logits[t, l]
      or target_logits[t, l] is NaN}, with cap = `variants.cap(options, .)`
      (the identity without a soft cap): ties count against the target, a
      NaN target ranks after every item, a NaN item after every number.
  default_plan(kernel, num_tokens, vocab, dim, dtype, num_targets=1) -> TilePlan
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from cutbce import variants
from cutbce.kernels import matmul, numerics
from cutbce.kernels.tiling import TilePlan, default_xla_block_v
from cutbce.variants import LossOptions, softplus  # noqa: F401  (softplus: re-exported)

# Fixed columns per token a sweep takes (None: any number; see the contract).
MAX_FIXED_COLUMNS = None


def tile_logits(hidden, table_tile, bias_tile):
  """`[T, block_v]` float32 logits of one tile (MXU-style f32 accumulation)."""
  logits = lax.dot_general(
      hidden, table_tile, (((1,), (1,)), ((), ())),
      preferred_element_type=jnp.float32, precision=matmul.precision(hidden, table_tile),
  )
  if bias_tile is not None:
    logits = logits + bias_tile.astype(jnp.float32)[None, :]
  return logits


def walk_tiles(vocab: int, block_v: int, step, carry, rows=()):
  """Runs `step(carry, rows, start, size)` over all tiles: a scan, then the tail.

  `rows` are the `[V, ...]` arrays the step slices (table, bias). Those not in
  float32 ride in the scan carry behind an optimization barrier: XLA:CPU
  computes every bf16 op but dots in float32, converting the slice's whole
  operand, and would hoist that convert of a loop-invariant table out of the
  loop (a float32 copy of the table for the whole scan). Carried, the table is
  not invariant, the convert stays in the loop and fuses into the slice of
  one tile. float32 arrays are closed over as before (the same program).
  """
  block_v = min(block_v, vocab)
  num_full = vocab // block_v
  narrow = tuple(x is not None and x.dtype != jnp.float32 for x in rows)

  def pick(carried):
    return tuple(c if n else x for x, c, n in zip(rows, carried, narrow))

  def body(state, index):
    carry, carried = state
    if any(narrow):
      carried = lax.optimization_barrier(carried)
    carry = step(carry, pick(carried), index * block_v, block_v)
    return (carry, carried), None

  if num_full:
    carried = tuple(x if n else None for x, n in zip(rows, narrow))
    (carry, _), _ = lax.scan(body, (carry, carried), jnp.arange(num_full, dtype=jnp.int32))
  tail = vocab - num_full * block_v
  if tail:
    carry = step(carry, rows, num_full * block_v, tail)
  return carry


def slice_rows(array, start, size):
  """Rows [start, start + size) of `array` (a static or a dynamic slice); None stays None."""
  if array is None:
    return None
  if isinstance(start, int):
    return lax.slice_in_dim(array, start, start + size, axis=0)
  return lax.dynamic_slice_in_dim(array, start, size, axis=0)


def set_columns(logit_grad, fixed_ids, fixed_values, start, size: int):
  """`logit_grad` [T, size] with column fixed_ids[t, k] - start of row t set to fixed_values[t, k].

  Ids outside [start, start + size) (other tiles, -1) are dropped. Float32 in
  and out: the callers cast afterwards.
  """
  if fixed_ids is None:
    return logit_grad
  local = fixed_ids - start  # [T, K]
  local = jnp.where((local >= 0) & (local < size), local, size)  # out of tile: dropped
  rows = jnp.arange(logit_grad.shape[0], dtype=jnp.int32)[:, None]
  return logit_grad.at[rows, local].set(fixed_values.astype(logit_grad.dtype), mode="drop")


def _update_rows(array, update, start):
  if isinstance(start, int):
    start = jnp.int32(start)
  return lax.dynamic_update_slice_in_dim(array, update, start, axis=0)


def _plan(plan, kernel, hidden, num_items, num_targets=1):
  if plan is not None:
    return plan
  return default_plan(kernel, hidden.shape[0], num_items, hidden.shape[1], hidden.dtype,
                      num_targets=num_targets)


@functools.partial(jax.named_call, name="cutbce_xla_forward")
def forward(hidden, table, bias, *, plan: TilePlan | None, with_counts: bool,
            options: LossOptions = variants.PLAIN, num_items: int | None = None):
  num_tokens = hidden.shape[0]
  num_items = table.shape[0] if num_items is None else num_items
  plan = _plan(plan, "forward", hidden, num_items)

  def step(carry, rows, start, size):
    table, bias = rows
    dense_sum, positive_count = carry
    logits = tile_logits(
        hidden, slice_rows(table, start, size), slice_rows(bias, start, size)
    )  # [T, block_v]
    dense_sum = dense_sum + jnp.sum(variants.tile_value(options, logits), axis=-1)
    if with_counts:
      positive_count = positive_count + jnp.sum(logits > 0, axis=-1, dtype=jnp.int32)
    return dense_sum, positive_count

  init = (
      jnp.zeros((num_tokens,), jnp.float32),
      jnp.zeros((num_tokens,), jnp.int32) if with_counts else None,
  )
  return walk_tiles(num_items, plan.block_v, step, init, (table, bias))


@functools.partial(jax.named_call, name="cutbce_xla_backward")
def backward(hidden, table, bias, scale, table_grad, bias_grad, fixed_ids=None,
             fixed_values=None, *, plan: TilePlan | None,
             options: LossOptions = variants.PLAIN, num_items: int | None = None,
             shared_rows: SharedColumns | None = None):
  _, _, *grads = _sweep(hidden, table, bias, scale, table_grad, bias_grad, fixed_ids,
                        fixed_values, plan=plan,
                        options=options, num_items=num_items, with_loss=False,
                        with_counts=False, shared_rows=shared_rows)
  return tuple(grads)


@functools.partial(jax.named_call, name="cutbce_xla_forward_backward")
def forward_backward(hidden, table, bias, scale, table_grad, bias_grad, fixed_ids=None,
                     fixed_values=None, *, plan: TilePlan | None, with_counts: bool,
                     options: LossOptions = variants.PLAIN, num_items: int | None = None,
                     shared_rows: SharedColumns | None = None):
  return _sweep(hidden, table, bias, scale, table_grad, bias_grad, fixed_ids, fixed_values,
                plan=plan, options=options, num_items=num_items, with_loss=True,
                with_counts=with_counts, shared_rows=shared_rows)


class SharedColumns(NamedTuple):
  """BCE's excluded ids as rows shared by consecutive tokens, set in the backward's tiles.

  Attributes:
    rows: `[G, E]` int32, row g excluded for tokens g T/G ... (g + 1) T/G - 1
      (-1: none): each tile marks G rows (`shared_mask`), not T x E ids.
    value: `[T]` float32, what an excluded column of token t is set to
      (g_t B: 0 with the affine part the caller adds, `sparse.bce_columns`).
  The targets' own columns (`fixed_ids`) are set after, over these.
  """

  rows: jax.Array
  value: jax.Array


def _sweep(hidden, table, bias, scale, table_grad, bias_grad, fixed_ids, fixed_values, *,
           plan, options, num_items, with_loss: bool, with_counts: bool,
           shared_rows: SharedColumns | None = None):
  """The backward walk (3 GEMMs per tile), and with `with_loss` the forward's sums too.

  Returns (dense_sum or None, positive_count or None, dh, table_grad, bias_grad).
  """
  compute_dtype = jnp.result_type(hidden.dtype, table.dtype)
  num_tokens = hidden.shape[0]
  num_items = table.shape[0] if num_items is None else num_items
  plan = _plan(plan, "backward", hidden, num_items)

  def step(carry, rows, start, size):
    table, bias = rows
    dense_sum, positive_count, hidden_grad, table_grad, bias_grad = carry
    table_tile = slice_rows(table, start, size)  # [block_v, D]
    logits = tile_logits(hidden, table_tile, slice_rows(bias, start, size))
    # d l_t / d x_tv of the background is phi'(x_tv) (sigmoid for plain
    # BCE); scaled by g_t.
    if with_loss:
      value, grad = variants.tile_value_and_grad(options, logits)
      dense_sum = dense_sum + jnp.sum(value, axis=-1)
      if with_counts:
        positive_count = positive_count + jnp.sum(logits > 0, axis=-1, dtype=jnp.int32)
    else:
      grad = variants.tile_grad(options, logits)
    logit_grad = scale[:, None] * grad  # [T, block_v] f32
    if shared_rows is not None:
      excluded = shared_mask(shared_rows.rows, num_tokens, start, size)
      logit_grad = jnp.where(excluded, shared_rows.value[:, None], logit_grad)
    # Exact terms at the fixed columns, in f32 before the cast.
    logit_grad = set_columns(logit_grad, fixed_ids, fixed_values, start, size)
    logit_grad_c = logit_grad.astype(compute_dtype)
    hidden_grad = hidden_grad + lax.dot_general(
        logit_grad_c, table_tile, (((1,), (0,)), ((), ())),
        preferred_element_type=jnp.float32, precision=matmul.precision(logit_grad_c, table_tile),
    )  # [T, D]
    tile_grad = lax.dot_general(
        logit_grad_c, hidden, (((0,), (0,)), ((), ())),
        preferred_element_type=jnp.float32, precision=matmul.precision(logit_grad_c, hidden),
    )  # [block_v, D]
    table_grad = _update_rows(
        table_grad, slice_rows(table_grad, start, size) + tile_grad, start
    )
    if bias_grad is not None:
      bias_grad = _update_rows(
          bias_grad,
          slice_rows(bias_grad, start, size) + jnp.sum(logit_grad, axis=0),
          start,
      )
    return dense_sum, positive_count, hidden_grad, table_grad, bias_grad

  init = (
      jnp.zeros((num_tokens,), jnp.float32) if with_loss else None,
      jnp.zeros((num_tokens,), jnp.int32) if with_loss and with_counts else None,
      jnp.zeros(hidden.shape, jnp.float32), table_grad, bias_grad,
  )
  return walk_tiles(num_items, plan.block_v, step, init, (table, bias))


def _walk_rank_tiles(num_items: int, block_v: int, step, carry, rows):
  """`walk_tiles` for the rank kernels, every tile the same width.

  A ragged end is walked as one full-width tile ending at `num_items` (it
  overlaps the last scanned tile; `step` gets `fresh`, the first column id it
  may count). So every logit, the targets' and their twins', comes out of
  the same `[T, block_v]` dot and rounds alike: exact ties stay exact.
  `step(carry, rows, start, size, fresh)`.
  """
  block_v = min(block_v, num_items)
  num_full = num_items // block_v
  carry = walk_tiles(num_full * block_v, block_v,
                     lambda c, r, start, size: step(c, r, start, size, start), carry, rows)
  if num_full * block_v < num_items:
    carry = step(carry, rows, num_items - block_v, block_v, num_full * block_v)
  return carry


def _rank_tile(options, hidden, rows, start, size):
  """(`[T, size]` capped f32 logits, `[size]` int32 item ids) of one rank tile."""
  table, bias = rows
  logits = variants.cap(options, tile_logits(
      hidden, slice_rows(table, start, size), slice_rows(bias, start, size)
  ))  # [T, block_v]
  return logits, start + jnp.arange(size, dtype=jnp.int32)


def _rank_plan(plan, hidden, num_items, num_targets):
  return _plan(plan, "ranks", hidden, num_items, num_targets)


@functools.partial(jax.named_call, name="cutbce_xla_rank_logits")
def rank_logits(hidden, table, bias, ids, *, plan: TilePlan | None, num_targets: int,
                options: LossOptions = variants.PLAIN, num_items: int | None = None):
  num_items = table.shape[0] if num_items is None else num_items
  plan = _rank_plan(plan, hidden, num_items, num_targets)

  def step(found, rows, start, size, fresh):
    logits, _ = _rank_tile(options, hidden, rows, start, size)
    local = ids - start  # [T, K]
    inside = (ids >= fresh) & (local < size)
    picked = jnp.take_along_axis(logits, jnp.clip(local, 0, size - 1), axis=1)  # [T, K]
    return jnp.where(inside, picked, found)

  init = jnp.zeros(ids.shape, jnp.float32)
  return _walk_rank_tiles(num_items, plan.block_v, step, init, (table, bias))


@functools.partial(jax.named_call, name="cutbce_xla_rank_counts")
def rank_counts(hidden, table, bias, target_logits, target_ids, *, plan: TilePlan | None,
                options: LossOptions = variants.PLAIN, num_items: int | None = None):
  num_items = table.shape[0] if num_items is None else num_items
  plan = _rank_plan(plan, hidden, num_items, target_logits.shape[1])
  # A NaN target is ranked after every item (x >= NaN is False for all x).
  nan_target = jnp.isnan(target_logits)[:, None, :]  # [T, 1, L]

  def step(counts, rows, start, size, fresh):
    logits, item_ids = _rank_tile(options, hidden, rows, start, size)
    # Ties count against the target; a NaN item never ranks above a number.
    above = (logits[:, :, None] >= target_logits[:, None, :]) | nan_target  # [T, block_v, L]
    # A target's own column is left out.
    other = (item_ids[None, :, None] != target_ids[:, None, :]) & (item_ids >= fresh)[None, :, None]
    return counts + jnp.sum(above & other, axis=1, dtype=jnp.int32)

  init = jnp.zeros(target_logits.shape, jnp.int32)
  return _walk_rank_tiles(num_items, plan.block_v, step, init, (table, bias))


def default_plan(kernel: str, num_tokens: int, vocab: int, dim: int, dtype,
                 num_targets: int = 1) -> TilePlan:
  """The XLA path's plan for one kernel: only `block_v` matters.

  The rank kernel compares each logit with L targets, so its tile is sized
  for T * L rows (see `tiling.default_xla_block_v`).
  """
  del dim, dtype
  rows = num_tokens * num_targets if kernel == "ranks" else num_tokens
  return TilePlan(block_v=default_xla_block_v(rows, vocab))


# --------------------------------------------------------------------------- #
# Softmax cross-entropy (`cutbce.softmax`): a running log-sum-exp per token.   #
# --------------------------------------------------------------------------- #
#
#   softmax_forward(hidden, table, bias, exclude_ids, *, plan, with_counts,
#                   num_items, valid_rows=None)
#       -> (row_max [T] f32, row_sum [T] f32, positive_count [T] int32 or None)
#       over the softmax's items of each token (rows < num_items and
#       < valid_rows, not in exclude_ids[t]): row_max = max x_tv (at least
#       `SOFTMAX_FLOOR`), row_sum = sum exp(x_tv - row_max); and #{x_tv > 0}
#       over rows < num_items, < valid_rows (excluded ids included: the
#       caller's sparse counts take them off, as for BCE).
#   softmax_backward(hidden, table, bias, exclude_ids, log_z, scale, table_grad,
#                    bias_grad, offset=None, fixed_ids=None, fixed_values=None, *,
#                    plan, num_items, valid_rows=None, with_mass=False)
#       -> (dh [T, D] f32, table_grad, bias_grad) (+ mass [T] f32 with_mass)
#       with G_tv = g_t p_tv - o_t, p_tv = exp(x_tv - log_z_t), on those items
#       (0 elsewhere), g = `scale`, o = `offset` (0 when None), except at the
#       fixed columns, set as in `backward` (the targets: p - 1 = expm1(x - lse)):
#       dh = sum_v G_tv e_v; adds sum_t G_tv h_t to table_grad rows (and
#       sum_t G_tv to bias_grad). mass = sum_v p_tv over those items but the
#       fixed columns, from the very exponentials dh was made of (kernel sets
#       with `SOFTMAX_MASS`): `cutbce.softmax` rescales dh's p part by the
#       mass the forward says those items hold over it, so the p sum to it
#       even where exp is inexact (a TPU's float32 exp).
#
# `exclude_ids` is int32 [T, E] with -1 (or any id out of range) for "none", or
# None; here also a `SharedExclude` (rows shared by consecutive tokens: the
# mask is marked per row, not per token). `valid_rows` an int32 scalar
# (traced: a vocab shard's real rows) or None.

# The running max starts here, not at -inf: a token whose items are all
# masked so far keeps row_sum 0 and exp(floor - floor) = 1 scales nothing.
SOFTMAX_FLOOR = float(jnp.finfo(jnp.float32).min)
# softmax_backward returns the mass of its p (`with_mass`).
SOFTMAX_MASS = True


def excluded_by_scatter(exclude_ids, start, size: int):
  """`[T, size]` bool: column start + j is one of the token's `[T, E]` ids (a scatter)."""
  local = exclude_ids - start  # [T, E]
  local = jnp.where((local >= 0) & (local < size), local, size)  # out of tile: dropped
  rows = jnp.arange(exclude_ids.shape[0], dtype=jnp.int32)[:, None]
  return jnp.zeros((exclude_ids.shape[0], size), bool).at[rows, local].set(True, mode="drop")


def excluded_by_compare(exclude_ids, start, size: int):
  """As `excluded_by_scatter`, from E compares per entry reduced in one fusion."""
  columns = start + jnp.arange(size, dtype=jnp.int32)
  return jnp.any(exclude_ids[:, None, :] == columns[None, :, None], axis=-1)


def excluded_columns(exclude_ids, start, size: int):
  """`[T, size]` bool: column start + j is one of the token's excluded ids.

  Chosen when the program is lowered (`lax.platform_dependent`): a scatter of
  the T x E ids where scatters are cheap (CPU, GPU), E compares per entry on
  a TPU, whose scatter applies its updates one after another (T = 25,600,
  E = 201, V = 3,416 on a v5e: 489 ms a sweep against 1.8 ms unmasked,
  `benchmarks/exclude_bench.py`).
  """
  return lax.platform_dependent(
      exclude_ids, jnp.asarray(start, jnp.int32),
      tpu=lambda ids, first: excluded_by_compare(ids, first, size),
      default=lambda ids, first: excluded_by_scatter(ids, first, size))


class SharedExclude(NamedTuple):
  """The softmax kernels' excluded ids as rows shared by consecutive tokens.

  Attributes:
    rows: `[G, E]` int32, row g excluded for tokens g T/G ... (g + 1) T/G - 1
      (-1: none); each tile marks G rows, not T.
    tokens: `[T, K]` int32 each token's own excluded ids (-1: none), or None.
  """

  rows: jax.Array
  tokens: jax.Array | None = None


def shared_mask(rows, num_tokens: int, start, size: int):
  """`[T, size]` bool from `[G, E]` rows, each shared by T / G consecutive tokens.

  Marked once per row (`excluded_columns`), then broadcast over its tokens.
  """
  marked = excluded_columns(rows, start, size)  # [G, size]
  group = num_tokens // rows.shape[0]
  return jnp.broadcast_to(marked[:, None, :], (rows.shape[0], group, size)).reshape(
      num_tokens, size)


def _softmax_mask(exclude_ids, valid_rows, num_tokens: int, start, size: int):
  """`[T, size]` bool: True where column start + j is not in the token's softmax, or None.

  `exclude_ids`: `[T, E]` int32 (-1: none), a `SharedExclude`, or None.
  """
  masked = None
  if isinstance(exclude_ids, SharedExclude):
    masked = shared_mask(exclude_ids.rows, num_tokens, start, size)
    if exclude_ids.tokens is not None:
      masked = masked | excluded_columns(exclude_ids.tokens, start, size)
  elif exclude_ids is not None:
    masked = excluded_columns(exclude_ids, start, size)
  if valid_rows is not None:
    past = (start + jnp.arange(size, dtype=jnp.int32) >= valid_rows)[None, :]
    masked = past if masked is None else masked | past
  return masked


@functools.partial(jax.named_call, name="cutbce_xla_softmax_forward")
def softmax_forward(hidden, table, bias, exclude_ids, *, plan: TilePlan | None,
                    with_counts: bool, num_items: int | None = None, valid_rows=None):
  num_tokens = hidden.shape[0]
  num_items = table.shape[0] if num_items is None else num_items
  plan = _plan(plan, "forward", hidden, num_items)

  def step(carry, rows, start, size):
    table, bias = rows
    row_max, row_sum, positive_count = carry
    logits = tile_logits(hidden, slice_rows(table, start, size), slice_rows(bias, start, size))
    masked = _softmax_mask(exclude_ids, valid_rows, num_tokens, start, size)
    if with_counts:
      above = logits > 0
      if valid_rows is not None:
        above = above & (start + jnp.arange(size, dtype=jnp.int32) < valid_rows)[None, :]
      positive_count = positive_count + jnp.sum(above, axis=-1, dtype=jnp.int32)
    if masked is not None:
      logits = jnp.where(masked, -jnp.inf, logits)
    new_max = jnp.maximum(row_max, jnp.max(logits, axis=-1))
    row_sum = (row_sum * numerics.exp(row_max - new_max)
               + jnp.sum(jnp.exp(logits - new_max[:, None]), axis=-1))
    return new_max, row_sum, positive_count

  init = (
      jnp.full((num_tokens,), SOFTMAX_FLOOR, jnp.float32),
      jnp.zeros((num_tokens,), jnp.float32),
      jnp.zeros((num_tokens,), jnp.int32) if with_counts else None,
  )
  return walk_tiles(num_items, plan.block_v, step, init, (table, bias))


@functools.partial(jax.named_call, name="cutbce_xla_softmax_backward")
def softmax_backward(hidden, table, bias, exclude_ids, log_z, scale, table_grad, bias_grad,
                     offset=None, fixed_ids=None, fixed_values=None, *,
                     plan: TilePlan | None, num_items: int | None = None, valid_rows=None,
                     with_mass: bool = False):
  compute_dtype = jnp.result_type(hidden.dtype, table.dtype)
  num_tokens = hidden.shape[0]
  num_items = table.shape[0] if num_items is None else num_items
  plan = _plan(plan, "backward", hidden, num_items)

  def step(carry, rows, start, size):
    table, bias = rows
    hidden_grad, table_grad, bias_grad, mass = carry
    table_tile = slice_rows(table, start, size)
    logits = tile_logits(hidden, table_tile, slice_rows(bias, start, size))
    masked = _softmax_mask(exclude_ids, valid_rows, num_tokens, start, size)
    if masked is not None:
      logits = jnp.where(masked, -jnp.inf, logits)
    p = jnp.exp(logits - log_z[:, None])  # [T, block_v] f32
    if with_mass:  # the fixed columns' p are not summed: their gradient is set
      swept = p
      if fixed_ids is not None:  # compares, fused with the sum (a scatter costs more)
        columns = start + jnp.arange(size, dtype=jnp.int32)
        fixed = jnp.any(columns[None, :, None] == fixed_ids[:, None, :], axis=-1)
        swept = jnp.where(fixed, 0.0, p)
      mass = mass + jnp.sum(swept, axis=-1)
    logit_grad = scale[:, None] * p
    if offset is not None:
      uniform = jnp.broadcast_to(offset[:, None], logit_grad.shape)
      logit_grad = logit_grad - (uniform if masked is None else jnp.where(masked, 0.0, uniform))
    logit_grad = set_columns(logit_grad, fixed_ids, fixed_values, start, size)
    logit_grad_c = logit_grad.astype(compute_dtype)
    hidden_grad = hidden_grad + lax.dot_general(
        logit_grad_c, table_tile, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32,
        precision=matmul.precision(logit_grad_c, table_tile))
    tile_grad = lax.dot_general(
        logit_grad_c, hidden, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32,
        precision=matmul.precision(logit_grad_c, hidden))
    table_grad = _update_rows(table_grad, slice_rows(table_grad, start, size) + tile_grad, start)
    if bias_grad is not None:
      bias_grad = _update_rows(
          bias_grad, slice_rows(bias_grad, start, size) + jnp.sum(logit_grad, axis=0), start)
    return hidden_grad, table_grad, bias_grad, mass

  init = (jnp.zeros(hidden.shape, jnp.float32), table_grad, bias_grad,
          jnp.zeros((num_tokens,), jnp.float32) if with_mass else None)
  *grads, mass = walk_tiles(num_items, plan.block_v, step, init, (table, bias))
  return (*grads, mass) if with_mass else tuple(grads)
