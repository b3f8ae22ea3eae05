"""The tiled loss under its custom VJPs: one backend's dense sweep plus the sparse parts.

Shared by `cut_bce` and the sharded op (which runs the same functions on
each device's shard). Two ways to differentiate, chosen per call:

- two passes (`per_token_loss`): the forward sweeps the vocabulary once for
  the loss (1 GEMM per tile) and keeps only the inputs; the backward sweeps
  again (3 GEMMs per tile: recomputed logits, G @ E, G^T @ H). Works for
  every reduction, because the reduction runs outside on the `[T]` losses and
  the cotangent reaching the backward is g_t.
- one pass (`reduced_loss`): with reduction "mean" or "sum" every g_t is
  known at forward time up to the scalar cotangent c of the reduced loss
  (g_t = c w_t / sum(w), or c w_t, times 1/num_items for the vocabulary
  mean). The forward rule then makes the loss and the gradients for c = 1 in
  the same sweep (3 GEMMs per tile instead of 4 in all) and keeps dh, dE, db
  as float32 residuals; the backward only scales them by c. The primal alone
  (no gradient) is still one GEMM per tile. Cost: the residuals hold a
  float32 `[V, D]` dE (per vocab shard) from the forward until the backward.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from cutbce import backends, inputs, sparse
from cutbce.kernels import matmul
from cutbce.kernels import xla as xla_kernels
from cutbce.kernels.tiling import TilePlan
from cutbce.variants import LossOptions


class TiledCall(NamedTuple):
  """Everything static one tiled call is traced with (hashable).

  Attributes:
    backend: a tiled backend name ("xla", "pallas_tpu", "auto").
    plan: a `TilePlan`, or None for each kernel's own plan.
    with_counts: also return per-token confusion counts.
    options: the loss variants.
    num_items: the table's rows that are items (a static int <= V).
  """

  backend: str
  plan: TilePlan | None
  with_counts: bool
  options: LossOptions
  num_items: int

  @property
  def kernels(self):
    return backends.kernel_module(self.backend)


class Reduction(NamedTuple):
  """The token and vocabulary reductions of a one-pass call (hashable)."""

  reduction: str  # "mean" or "sum"
  vocab_divisor: int  # num_items for vocab_reduction="mean", else 1


def _item_sums(table, bias, num_items: int):
  """(sum_{v < num_items} e_v `[D]` f32, sum_{v < num_items} b_v f32 or 0)."""
  items = table if num_items == table.shape[0] else table[:num_items]
  table_sum = jnp.sum(items.astype(jnp.float32), axis=0)
  bias_sum = 0.0
  if bias is not None:
    bias_sum = jnp.sum(bias[:num_items].astype(jnp.float32))
  return table_sum, bias_sum


def _finish_loss(call: TiledCall, dense_sum, positive_count, hidden, table, bias, ids, logits,
                 counted_items):
  """l_t = A dense_sum - B (h_t . sum_v e_v + sum_v b_v) + sparse corrections; counts."""
  scale, slope = call.options.affine_coefficients()
  per_token = dense_sum if scale == 1.0 else scale * dense_sum
  if slope:
    table_sum, bias_sum = _item_sums(table, bias, call.num_items)
    linear = jnp.dot(hidden.astype(jnp.float32), table_sum,
                     precision=matmul.precision(jnp.float32)) + bias_sum  # [T]
    per_token = per_token - slope * linear
  per_token = per_token + sparse.loss_correction(ids, logits, call.options)
  counts = None
  if call.with_counts:
    counted = call.num_items if counted_items is None else counted_items
    counts = sparse.token_counts(ids, logits, positive_count, counted)
  return per_token, counts


def tiled_forward(call: TiledCall, hidden, table, bias, ids, counted_items=None):
  """Per-token losses of one tiled backend on flat inputs, no custom VJP.

  l_t = A sum_v phi(x_tv) - B sum_v x_tv + corrections, with (A, B) the
  affine coefficients of the variant (`LossOptions.affine_coefficients`):
  the linear sum is h_t . sum_v e_v + sum_v b_v, O(D) per position.

  Args:
    call: the static `TiledCall`.
    hidden: `[T, D]`; table: `[V, D]`; bias: `[V]` or None.
    ids: `sparse.SparseIds` into `table`'s rows.
    counted_items: items counted as negatives by the counts (default
      `call.num_items`; a shard of a padded table passes its number of real
      rows, a traced value).

  Returns:
    (`[T]` float32 l_t, `sparse.TokenCounts` or None).
  """
  dense_sum, positive_count = call.kernels.forward(
      hidden, table, bias, plan=call.plan, with_counts=call.with_counts,
      options=call.options, num_items=call.num_items,
  )
  logits = sparse.sparse_logits(hidden, table, bias, ids)
  return _finish_loss(call, dense_sum, positive_count, hidden, table, bias, ids, logits,
                      counted_items)


def _sparse_start(call: TiledCall, hidden, table, bias, ids, scale):
  """Sparse logits, the columns the sweep sets, the sparse gradient parts it adds to (f32),
  and the kernels' keyword for shared rows (`{"shared_rows": ...}`, else `{}`).

  The targets' and excluded ids' gradients are set in the sweep's tiles in
  float32 (`sparse.bce_columns`): exact in every dtype, no cancellation
  against a background rounded to bfloat16. Only ids past the kernels'
  `MAX_FIXED_COLUMNS` per position are sparse corrections. Excluded ids in
  rows shared by consecutive tokens (`SparseIds.exclude_rows`) are set per
  row on the XLA path (`_shared_columns`), not per token.
  """
  logits = sparse.sparse_logits(hidden, table, bias, ids)
  shared = _shared_columns(call, ids, scale)
  column_ids = ids if shared is None else ids._replace(exclude_ids=None, exclude_mask=None)
  columns = sparse.bce_columns(column_ids, logits, scale, call.options,
                               getattr(call.kernels, "MAX_FIXED_COLUMNS", None))
  grads = sparse.rest_grads(hidden, table, bias is not None, columns)
  return logits, columns, grads, ({} if shared is None else {"shared_rows": shared})


def _shared_columns(call: TiledCall, ids, scale):
  """`xla.SharedColumns` where the XLA kernels set shared excluded rows, else None.

  An excluded id's column holds g_t B (`sparse.bce_columns`); the rows are
  marked once per tile each, where T x E per-token ids are a scatter of T x E
  updates per tile (applied one after another on a TPU).
  """
  if ids.exclude_rows is None or call.backend != "xla":
    return None
  _, slope = call.options.affine_coefficients()
  return xla_kernels.SharedColumns(ids.exclude_rows, slope * scale.astype(jnp.float32))


def _finish_grads(call: TiledCall, hidden, table, scale, hidden_grad, table_grad, bias_grad):
  """Adds the affine variants' linear part: -B g_t sum_v e_v to dh, -B sum_t g_t h_t to dE."""
  _, slope = call.options.affine_coefficients()
  if slope:
    table_sum, _ = _item_sums(table, None, call.num_items)
    hidden_grad = hidden_grad - slope * scale[:, None] * table_sum[None, :]
    item_rows = jnp.arange(table.shape[0]) < call.num_items  # [V]
    weighted_hidden = jnp.dot(scale, hidden.astype(jnp.float32),
                              precision=matmul.precision(jnp.float32))  # [D]
    table_grad = table_grad - slope * jnp.where(item_rows[:, None], weighted_hidden, 0.0)
    if bias_grad is not None:
      bias_grad = bias_grad - slope * jnp.where(item_rows, jnp.sum(scale), 0.0)
  return hidden_grad, table_grad, bias_grad


def _dense_scale(call: TiledCall, scale):
  affine_scale, _ = call.options.affine_coefficients()
  return scale if affine_scale == 1.0 else affine_scale * scale


def tiled_backward(call: TiledCall, hidden, table, bias, ids, scale):
  """Gradients of sum_t scale_t l_t on flat inputs, all float32.

  Returns:
    (dh `[T, D]`, dE `[V, D]`, db `[V]` or None), float32, not yet cast to
    the input dtypes (a sharded caller sums them across devices first). Rows
    past `call.num_items` get exactly zero.
  """
  _, columns, (hidden_grad, table_grad, bias_grad), shared = _sparse_start(
      call, hidden, table, bias, ids, scale)
  dense_hidden_grad, table_grad, bias_grad = call.kernels.backward(
      hidden, table, bias, _dense_scale(call, scale), table_grad, bias_grad,
      columns.fixed_ids, columns.fixed_values, plan=call.plan,
      options=call.options, num_items=call.num_items, **shared,
  )
  return _finish_grads(call, hidden, table, scale, hidden_grad + dense_hidden_grad,
                       table_grad, bias_grad)


def tiled_forward_backward(call: TiledCall, hidden, table, bias, ids, scale, counted_items=None):
  """`tiled_forward` and `tiled_backward` in one sweep of the vocabulary (3 GEMMs per tile).

  Returns:
    (`[T]` l_t, counts or None, (dh, dE, db) float32 gradients of sum_t scale_t l_t).
  """
  logits, columns, (hidden_grad, table_grad, bias_grad), shared = _sparse_start(
      call, hidden, table, bias, ids, scale)
  dense_sum, positive_count, dense_hidden_grad, table_grad, bias_grad = (
      call.kernels.forward_backward(
          hidden, table, bias, _dense_scale(call, scale), table_grad, bias_grad,
          columns.fixed_ids, columns.fixed_values, plan=call.plan,
          with_counts=call.with_counts, options=call.options, num_items=call.num_items,
          **shared,
      ))
  per_token, counts = _finish_loss(call, dense_sum, positive_count, hidden, table, bias, ids,
                                   logits, counted_items)
  grads = _finish_grads(call, hidden, table, scale, hidden_grad + dense_hidden_grad,
                        table_grad, bias_grad)
  return per_token, counts, grads


def cast_grads(grads, hidden, table, bias, factor=None):
  """float32 (dh, dE, db) times an optional scalar, cast to the inputs' dtypes."""
  scale = (lambda g: g) if factor is None else (lambda g: factor * g)  # noqa: E731
  hidden_grad, table_grad, bias_grad = grads
  return (
      scale(hidden_grad).astype(hidden.dtype),
      scale(table_grad).astype(table.dtype),
      None if bias is None else scale(bias_grad).astype(bias.dtype),
  )


# --------------------------------------------------------------------------- #
# Two passes: per-token l_t, the reduction outside, g_t reaches the backward.  #
# --------------------------------------------------------------------------- #


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def per_token_loss(call: TiledCall, hidden, table, bias, ids):
  """`[T]` float32 losses l_t (and per-token counts) of one tiled backend."""
  return tiled_forward(call, hidden, table, bias, ids)


def _per_token_loss_fwd(call: TiledCall, hidden, table, bias, ids):
  # Residuals are the inputs only; the backward recomputes every logit tile.
  out = per_token_loss(call, hidden, table, bias, ids)
  return out, (hidden, table, bias, ids)


def _per_token_loss_bwd(call: TiledCall, residuals, cotangents):
  hidden, table, bias, ids = residuals
  scale = cotangents[0].astype(jnp.float32)  # g_t, [T]; counts get none.
  grads = tiled_backward(call, hidden, table, bias, ids, scale)
  # Ids get no cotangent (None = zero for every leaf).
  return cast_grads(grads, hidden, table, bias) + (None,)


per_token_loss.defvjp(_per_token_loss_fwd, _per_token_loss_bwd)


# --------------------------------------------------------------------------- #
# One pass: the reduced loss, gradients made in the forward sweep.             #
# --------------------------------------------------------------------------- #


def unit_cotangents(weights, reduction: Reduction):
  """`[T]` f32 d loss / d l_t for a cotangent of 1 on the reduced loss.

  "mean": w_t / sum(w) (0 when every weight is 0), "sum": w_t; both divided
  by the vocabulary divisor. Weight-0 positions get exactly 0.
  """
  scale = weights
  if reduction.reduction == "mean":
    total = jnp.sum(weights)
    scale = jnp.where(total != 0, weights / jnp.where(total != 0, total, 1.0), 0.0)
  if reduction.vocab_divisor != 1:
    scale = scale / reduction.vocab_divisor
  return scale.astype(jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def reduced_loss(call: TiledCall, reduction: Reduction, hidden, table, bias, ids, weights):
  """(float32 reduced loss, per-token counts or None), differentiated in one pass."""
  per_token, counts = tiled_forward(call, hidden, table, bias, ids)
  return inputs.reduce_weighted(per_token, weights, reduction.reduction, reduction.vocab_divisor), counts


def _reduced_loss_fwd(call, reduction, hidden, table, bias, ids, weights):
  scale = unit_cotangents(weights, reduction)
  per_token, counts, grads = tiled_forward_backward(call, hidden, table, bias, ids, scale)
  loss = inputs.reduce_weighted(per_token, weights, reduction.reduction, reduction.vocab_divisor)
  # Residuals: the float32 gradients for a cotangent of 1, and the dtypes.
  return (loss, counts), (grads, dtype_markers(hidden, table, bias), weights)


def dtype_markers(hidden, table, bias):
  """Scalars carrying the inputs' dtypes into a backward rule (None for no bias)."""
  return tuple(None if x is None else jnp.zeros((), x.dtype) for x in (hidden, table, bias))


def reduced_loss_bwd(call, reduction, residuals, cotangents):
  """The one-pass backward: the forward's gradients times the scalar cotangent c."""
  del call, reduction
  grads, (hidden, table, bias), weights = residuals
  factor = cotangents[0].astype(jnp.float32)  # c, the reduced loss's cotangent
  # Ids and weights get no cotangent (weights are stop_gradient'ed by the API).
  return cast_grads(grads, hidden, table, bias, factor) + (None, jnp.zeros_like(weights))


reduced_loss.defvjp(_reduced_loss_fwd, reduced_loss_bwd)
