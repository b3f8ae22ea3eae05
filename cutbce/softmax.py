"""`cut_softmax_ce`: exact full-catalog softmax cross-entropy, tiled like `cut_bce`.

With x_tv = h_t . e_v (+ b_v), P_t the valid deduplicated targets of position
t, X_t its excluded ids that are not targets and S_t the softmax's items (rows
< num_items, not in X_t; targets always in), each target is one softmax
cross-entropy term against the whole catalog:

    l_t = sum_{p in P_t} [(1 - e) (lse_t - x_tp) + e (lse_t - mean_{v in S_t} x_tv)]
        = k_t lse_t - (1 - e) r_t sum_p x_tp - e k_t mean_S x_t

with lse_t = log sum_{v in S_t} exp(x_tv), e the label smoothing (the target
distribution (1 - e) one-hot + e uniform over S_t), and (k_t, r_t) = (n_t, 1)
for `target_reduction="sum"` or ([n_t > 0], 1 / n_t) for "mean", n_t = |P_t|.
A position without a valid target has l_t = 0.

The dense part is a running (max, sum of exponentials) per token over the
vocabulary tiles (`softmax_forward` of a kernel set: excluded ids and padding
rows masked inside the tile, never subtracted afterwards, so no cancellation
when excluded items hold most of the mass); the target and smoothing parts
are sparse or O(D) per token. Gradient of l_t w.r.t. x_tv:

    k_t p_tv - (1 - e) r_t [v in P_t] - e k_t [v in S_t] / |S_t|,   p_tv = exp(x_tv - lse_t)

The forward's sweep leaves the targets out of its sums and adds them back
from their own logits (`partition`), which also gives each target's
1 - p_tp = sigmoid(lse_{-p} - x_tp) without cancellation. The backward
recomputes each logit tile (`softmax_backward`: 3 GEMMs per tile) and takes
p_tv = exp(x_tv - top_t) / total_t as dense does, from the residual row max
and sum (`Normalizer`), with the smoothing's uniform part in the same tile; the
targets' columns are set in the tile, in float32, to their whole gradient
computed from 1 - p_tp (`target_columns`). Unlike BCE there is no one-pass form:
p_tv needs lse_t, known only after the whole sweep, so the loss with its
gradients costs 4 GEMMs per tile (BCE's one pass: 3).

The functions below work on flat `[T, D]` tokens against one table (or one
vocabulary shard of it: `cutbce.sharding` runs them per device and combines
the (max, sum) pairs and the linear partials across shards).
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from cutbce import backends, inputs, reference, sparse
from cutbce.kernels import matmul, numerics
from cutbce.kernels import xla as xla_kernels
from cutbce.kernels.tiling import TilePlan

TARGET_REDUCTIONS = ("sum", "mean")


class SoftmaxCall(NamedTuple):
  """Everything static one tiled softmax call is traced with (hashable).

  Attributes:
    backend: a kernel set with the softmax entry points ("xla", "pallas_tpu", "pallas_gpu",
      "pallas_triton", "auto").
    plan: a `TilePlan`, or None for the kernel's own plan.
    with_counts: also return per-token confusion counts (logit > 0).
    label_smoothing: e in [0, 1].
    target_reduction: "sum" or "mean" over a position's targets.
    num_items: rows of the (local) table that may be items (static, <= V).
    catalog: the whole catalog's item count (|S_t| = catalog - |X_t|).
  """

  backend: str
  plan: TilePlan | None
  with_counts: bool
  label_smoothing: float
  target_reduction: str
  num_items: int
  catalog: int

  @property
  def kernels(self):
    return backends.kernel_module(self.backend)


class Coefficients(NamedTuple):
  """Per-token f32 `[T]` factors of l_t, from the global ids.

  Attributes:
    lse: k_t, the factor of lse_t (n_t, or 1 when averaging over targets).
    target: (1 - e) r_t, minus the factor of sum_p x_tp.
    uniform: e k_t / |S_t|, minus the factor of sum_{v in S_t} x_tv.
  """

  lse: jax.Array
  target: jax.Array
  uniform: jax.Array


def coefficients(call: SoftmaxCall, global_ids: sparse.SparseIds) -> Coefficients:
  """The factors of every position's loss, from the (global) deduplicated ids."""
  count = jnp.sum(global_ids.target_mask, axis=-1).astype(jnp.float32)  # n_t
  if call.target_reduction == "sum":
    k, r = count, jnp.ones_like(count)
  else:
    k = (count > 0).astype(jnp.float32)
    r = jnp.where(count > 0, 1.0 / jnp.maximum(count, 1.0), 0.0)
  uniform = jnp.zeros_like(count)
  if call.label_smoothing:
    excluded = 0.0
    if global_ids.exclude_mask is not None:
      excluded = jnp.sum(global_ids.exclude_mask, axis=-1).astype(jnp.float32)
    uniform = call.label_smoothing * k / (call.catalog - excluded)
  return Coefficients(k, (1.0 - call.label_smoothing) * r, uniform)


def _shared_rows(call: SoftmaxCall, ids: sparse.SparseIds) -> bool:
  """Whether the sweep masks the excluded ids per shared row (`xla.SharedExclude`).

  The XLA kernels only, which leave every target out of the forward's sums
  and set every target's column in the backward: a target among its row's
  ids is then masked to no effect.
  """
  return ids.exclude_rows is not None and call.backend == "xla"


def _exclude_or_none(ids: sparse.SparseIds):
  """`[T, E]` int32 excluded ids with -1 where there is none (the kernels' form), or None."""
  if ids.exclude_ids is None:
    return None
  return jnp.where(ids.exclude_mask, ids.exclude_ids, -1)


def _item_rows(table, num_items: int, valid_rows):
  """`[V]` bool: the table rows that are items (< num_items, < valid_rows)."""
  rows = jnp.arange(table.shape[0], dtype=jnp.int32)
  items = rows < num_items
  if valid_rows is not None:
    items = items & (rows < valid_rows)
  return items


def _item_sums(table, bias, items):
  """(sum over item rows of e_v `[D]` f32, of b_v f32 or 0): a mat-vec, no `[V, D]` copy."""
  table_sum = jax.lax.dot_general(items.astype(table.dtype), table, (((0,), (0,)), ((), ())),
                                  preferred_element_type=jnp.float32,
                                  precision=matmul.precision(table))
  bias_sum = 0.0 if bias is None else jnp.sum(jnp.where(items, bias.astype(jnp.float32), 0.0))
  return table_sum, bias_sum


def separated_targets(call: SoftmaxCall, ids: sparse.SparseIds) -> int:
  """How many target columns (the first ones) the forward sweep leaves out of its sums.

  All L where the kernels compare any number of ids per tile (XLA); else as
  many as fit beside the E excluded ids (`MAX_SOFTMAX_EXCLUDE`). The targets
  left out are added back from their own logits (`partition`), which gives
  each one's 1 - p_tp without cancellation.
  """
  kernels = backends.kernel_module("pallas_tpu" if call.backend == "auto" else call.backend)
  limit = getattr(kernels, "MAX_SOFTMAX_EXCLUDE", None)
  num_targets = ids.target_ids.shape[-1]
  if limit is None:
    return num_targets
  width = 0 if ids.exclude_ids is None else ids.exclude_ids.shape[-1]
  return max(0, min(num_targets, limit - width))


def _sum_exclude(call: SoftmaxCall, ids: sparse.SparseIds):
  """The forward sweep's masked ids: the excluded ids and the separated targets, or None."""
  count = separated_targets(call, ids)
  targets = None
  if count:
    targets = jnp.where(ids.target_mask[:, :count], ids.target_ids[:, :count], -1)
  if _shared_rows(call, ids):
    return xla_kernels.SharedExclude(ids.exclude_rows, targets)
  excluded = _exclude_or_none(ids)
  if targets is None:
    return excluded
  return targets if excluded is None else jnp.concatenate([excluded, targets], axis=-1)


def _add_terms(rest, terms):
  """log(exp(rest) + sum exp(terms)) over the last axis; -inf when all are -inf.

  `rest` (`[...]`) is a log-sum-exp already, its items' exps taken: it is
  rescaled exactly (`numerics`); each of `terms` (`[..., K]`) goes through
  the platform's exp once, as every item's term does in the sweep, in dense
  and in the backward's p, so that an exp's bias (a TPU's float32 exp errs
  by -6.9 ulp on average) cancels between lse and p instead of being mixed.
  """
  top = jnp.maximum(rest, jnp.max(terms, axis=-1, initial=-jnp.inf))  # K may be 0
  top = jnp.where(jnp.isfinite(top), top, 0.0)
  total = numerics.exp(rest - top) + jnp.sum(jnp.exp(terms - top[..., None]), axis=-1)
  return top + numerics.log(total)


def partition(row_max, row_sum, target_logits, target_mask, count: int):
  """(lse_t `[T]`, 1 - p_tp `[T, L]`) from the sweep's (max, sum) and the targets' own logits.

  The sweep summed every item but the first `count` targets (the separated
  ones, `separated_targets`); their exp(x_tp) are added back here. For a
  separated target,

      1 - p_tp = sum_{v != p} p_tv = sigmoid(lse_{-p} - x_tp),
      lse_{-p} = log(exp(rest_t) + sum_{q separated, q != p} exp(x_tq)),

  a float32 number with float32's relative precision however close p_tp is
  to 1, where reading it off lse_t - x_tp (~1e-5 next to lse_t ~ 7, whose
  float32 spacing is ~5e-7) keeps one or two digits. Targets past `count`
  (kernels that compare few ids) keep -expm1(x_tp - lse_t). Both from
  `numerics` (a TPU's own sigmoid and expm1 err by tens to hundreds of ulp).
  0 where not `target_mask`. lse_t is +inf for a token with no item (its
  gradient is 0).

  Args:
    row_max, row_sum: `[T]` f32, (max, sum exp(x - max)) over the rest.
    target_logits: `[T, L]` f32 x_tp (global: every shard's targets).
    target_mask: `[T, L]` bool, the valid deduplicated targets.
    count: the separated targets, the first `count` columns.
  """
  rest = jnp.where(row_sum > 0, row_max + numerics.log(jnp.where(row_sum > 0, row_sum, 1.0)),
                   -jnp.inf)  # [T]
  separated = target_mask[:, :count]  # [T, K]
  x = jnp.where(separated, target_logits[:, :count], -jnp.inf)  # [T, K]
  lse = _add_terms(rest, x)  # [T]
  lse = jnp.where(lse == -jnp.inf, jnp.inf, lse)
  # Row p of `others` holds the other separated targets' logits.
  others = jnp.where(jnp.eye(count, dtype=bool)[None], -jnp.inf, x[:, None, :])  # [T, K, K]
  lse_minus = _add_terms(jnp.broadcast_to(rest[:, None], others.shape[:2]), others)  # [T, K]
  complement = jnp.where(
      separated, numerics.sigmoid(lse_minus - jnp.where(separated, x, 0.0)), 0.0)
  tail = -numerics.expm1(target_logits[:, count:] - lse[:, None])
  tail = jnp.where(target_mask[:, count:], tail, 0.0)
  return lse, jnp.concatenate([complement, tail], axis=-1)


class Normalizer(NamedTuple):
  """How the backward takes p_tv: exp(x_tv - top_t) / total_t, as the dense reference does.

  dense's p_tv (jax.nn.log_softmax's gradient) is the exp of x_tv less the
  row's max, over the sum of those exps; the backward's p through exp(x_tv -
  lse_t) puts every item through the exp at another argument. Where the
  platform's float32 exp errs from one argument to the next (a TPU's by up to
  68 ulp), each p then errs otherwise than dense's, and an item's dE row,
  made of few tokens' p, kept that error (under an exp that errs like the
  chip's, on CPU: 8.6e-6 of a row against dense's 9.0e-7; on the chip a
  row kept 3.3e-6 against dense's 8.6e-8). With the max and the sum the
  exps come from the same arguments as dense's, and dE keeps the precision
  rule on the chip too (docs/results/tpu_v5e/tests_normalizer.log).

  Attributes:
    top: `[T]` f32, the largest logit over the softmax's items (+inf for a
      token with none: its p are 0).
    total: `[T]` f32, sum_v exp(x_tv - top_t) over them (1 for a token with none).
  """

  top: jax.Array
  total: jax.Array


def normalizer(row_max, row_sum, target_logits, target_mask, count: int) -> Normalizer:
  """The backward's (top_t, total_t) from the sweep's (max, sum) and the separated targets'.

  Arguments as for `partition`. The sweep's sum is rescaled to the top by an
  exact exp (`numerics`), the separated targets' terms go through the
  platform's exp once, as in `partition` and dense.
  """
  x = jnp.where(target_mask[:, :count], target_logits[:, :count], -jnp.inf)  # [T, K]
  swept = row_sum > 0
  top = jnp.maximum(jnp.where(swept, row_max, -jnp.inf), jnp.max(x, axis=-1, initial=-jnp.inf))
  empty = top == -jnp.inf
  top = jnp.where(empty, 0.0, top)
  total = (jnp.where(swept, row_sum * numerics.exp(jnp.where(swept, row_max, top) - top), 0.0)
           + jnp.sum(jnp.exp(x - top[:, None]), axis=-1))
  return Normalizer(jnp.where(empty, jnp.inf, top), jnp.where(empty, 1.0, total))


class LocalForward(NamedTuple):
  """One table's (or vocabulary shard's) part of the forward, all `[T]`.

  Attributes:
    row_max, row_sum: the running (max, sum exp(x - max)) over its items,
      the separated targets (`separated_targets`) left out.
    linear: its part of -(1 - e) r_t sum_p x_tp - e k_t/|S_t| sum_S x_tv.
    positive_count: int32 #{x_tv > 0} over its items (excluded ids in), or None.
    logits: the sparse logits at the ids it owns (for the counts).
  """

  row_max: jax.Array
  row_sum: jax.Array
  linear: jax.Array
  positive_count: jax.Array | None
  logits: sparse.SparseLogits


def local_forward(call: SoftmaxCall, hidden, table, bias, ids: sparse.SparseIds,
                  coeffs: Coefficients, valid_rows=None) -> LocalForward:
  """The dense sweep and the sparse parts of the loss over this table's rows.

  `ids` point into this table (a shard's rebased ids: others' masked out).
  """
  row_max, row_sum, positive_count = call.kernels.softmax_forward(
      hidden, table, bias, _sum_exclude(call, ids), plan=call.plan,
      with_counts=call.with_counts, num_items=call.num_items, valid_rows=valid_rows)
  logits = sparse.sparse_logits(hidden, table, bias, ids)
  linear = -coeffs.target * jnp.sum(jnp.where(ids.target_mask, logits.target, 0.0), axis=-1)
  if call.label_smoothing:
    table_sum, bias_sum = _item_sums(table, bias, _item_rows(table, call.num_items, valid_rows))
    item_logits = jnp.dot(hidden.astype(jnp.float32), table_sum,
                          precision=matmul.precision(jnp.float32)) + bias_sum  # sum_v x_tv
    if ids.exclude_mask is not None:
      item_logits = item_logits - jnp.sum(
          jnp.where(ids.exclude_mask, logits.exclude, 0.0), axis=-1)
    linear = linear - coeffs.uniform * item_logits
  return LocalForward(row_max, row_sum, linear, positive_count, logits)


def per_token_losses(coeffs: Coefficients, lse, linear):
  """l_t = k_t lse_t + linear_t (0 where k_t = 0, whatever lse_t is)."""
  return jnp.where(coeffs.lse > 0, coeffs.lse * lse, 0.0) + linear


class Rescale(NamedTuple):
  """How `local_backward` rescales dh's p part (`_rescale_to_mass`).

  Attributes:
    total: the swept mass `[T]` of every table shard from this one's (identity
      on one table; a psum over the vocabulary axis on a mesh).
    target_mask: `[T, L]` bool, the valid deduplicated targets of the whole
      catalog (`complement`'s columns).
  """

  total: Callable[[jax.Array], jax.Array]
  target_mask: jax.Array


def local_backward(call: SoftmaxCall, hidden, table, bias, ids: sparse.SparseIds,
                   coeffs: Coefficients, norm: Normalizer, complement, scale, valid_rows=None,
                   rescale: Rescale | None = None):
  """float32 (dh, dE, db) of sum_t scale_t l_t through this table's rows.

  The dense sweep makes G_tv = g_t (k_t p_tv - u_t) on the softmax's items
  (the uniform part of label smoothing included, so excluded ids and padding
  get none of it), p_tv = exp(x_tv - top_t) / total_t (`Normalizer`: the
  kernels take top_t for their log_z and 1 / total_t in their scale); the
  targets' columns are set to their whole gradient (`target_columns`, from
  `complement` = 1 - p_tp `[T, L]` of `partition`).
  With `rescale`, float32 inputs and kernels that sum their p
  (`SOFTMAX_MASS`), dh's p part is rescaled to the mass the forward gives
  those items (`_rescale_to_mass`).
  """
  g = scale.astype(jnp.float32)
  columns = target_columns(call, ids, coeffs, complement, g)
  hidden_grad, table_grad, bias_grad = sparse.rest_grads(hidden, table, bias is not None, columns)
  offset = g * coeffs.uniform if call.label_smoothing else None
  # In bfloat16 the tile's cast (2^-9 per entry) dwarfs the p sum's error: float32 only.
  with_mass = (rescale is not None and getattr(call.kernels, "SOFTMAX_MASS", False)
               and jnp.result_type(hidden.dtype, table.dtype) == jnp.float32)
  excluded = (xla_kernels.SharedExclude(ids.exclude_rows) if _shared_rows(call, ids)
              else _exclude_or_none(ids))
  swept = call.kernels.softmax_backward(
      hidden, table, bias, excluded, norm.top, g * coeffs.lse / norm.total, table_grad, bias_grad,
      offset, columns.fixed_ids, columns.fixed_values, plan=call.plan,
      num_items=call.num_items, valid_rows=valid_rows, **({"with_mass": True} if with_mass else {}))
  dense_hidden_grad, table_grad, bias_grad = swept[:3]
  if with_mass:
    dense_hidden_grad = _rescale_to_mass(
        call, table, ids, complement, columns, g * coeffs.uniform, dense_hidden_grad,
        rescale.total(swept[3]) / norm.total, rescale.target_mask, valid_rows)
  return hidden_grad + dense_hidden_grad, table_grad, bias_grad


def _rescale_to_mass(call: SoftmaxCall, table, ids: sparse.SparseIds, complement,
                     columns: sparse.SweepColumns, offset, hidden_grad, mass, target_mask,
                     valid_rows):
  """The sweep's dh with its p part scaled so that its p sum to the forward's mass.

  The sweep's p_tv = exp(x_tv - top_t) / total_t are other exp calls than the
  forward's sums behind total_t (those took each tile's running max): where
  exp is inexact (a TPU's float32 exp errs by up to 68 ulp, with a bias)
  their sum over the swept items, `mass`, is not the
  1 - sum_p p_tp those items hold, and dh_t = sum_v G_tv e_v carries the
  difference times the part of e_v all items share (docs/loss.md). The p
  part of dh (dh less the fixed columns' and the smoothing offset's parts,
  both sparse or O(D)) is multiplied by want / mass: the shared part then
  comes out exact, the rest keeps each p's own error, as in the dense
  reference, which divides by the sum of its own exponentials. On a vocabulary
  shard: `mass` and `target_mask` are the whole catalog's, the p part this
  shard's (the factor is per token, so the shards' parts sum to the whole).
  dE's sum runs over tokens and takes no such factor; its p come from the
  same exp arguments as dense's (`Normalizer`), which keeps it within the rule.
  """
  fixed = columns.fixed_ids
  p_part = hidden_grad
  count = 0
  if fixed is not None:
    p_part = p_part - sparse.combine_rows(table, fixed, columns.fixed_values)
    count = fixed.shape[-1]
  if call.label_smoothing:  # -o_t on every swept column: items, not excluded, not fixed
    swept_rows, _ = _item_sums(table, None, _item_rows(table, call.num_items, valid_rows))
    swept_rows = jnp.broadcast_to(swept_rows, hidden_grad.shape)
    for skipped in (_exclude_or_none(ids), fixed):
      if skipped is not None:
        swept_rows = swept_rows - sparse.combine_rows(table, skipped, jnp.ones(skipped.shape))
    p_part = p_part + offset[:, None] * swept_rows
  # want = 1 - sum_p p_tp over the fixed targets = sum_p (1 - p_tp) - (n - 1):
  # exactly 1 - p for one target, however close p is to 1.
  fixed_targets = target_mask[:, :count]
  want = (jnp.sum(jnp.where(fixed_targets, complement[:, :count], 0.0), axis=-1)
          - (jnp.sum(fixed_targets, axis=-1) - 1).astype(jnp.float32))
  factor = jnp.where(mass > 0, jnp.maximum(want, 0.0) / jnp.where(mass > 0, mass, 1.0) - 1.0, 0.0)
  return hidden_grad + factor[:, None] * p_part


def target_columns(call: SoftmaxCall, ids: sparse.SparseIds, coeffs: Coefficients,
                   complement, g) -> sparse.SweepColumns:
  """The targets' whole logit gradient, set in the backward sweep's tiles in float32.

  G_tp = g_t (k_t p_tp - (1 - e) r_t - u_t), written -k_t (1 - p_tp)
  + (k_t - (1 - e) r_t) - u_t with 1 - p_tp = `complement` from `partition`:
  for one confident target (k = (1 - e) r = 1) that is -(1 - p), to
  float32's relative precision, where p - 1 from p ~ 1 - 1e-5 would lose
  most digits in float32 and all of them once p is rounded to bfloat16
  (`sparse.sweep_columns`).
  """
  k = coeffs.lse[:, None]
  values = (g[:, None] * (-k * complement + (k - coeffs.target[:, None]))
            - (g * coeffs.uniform)[:, None])
  limit = getattr(call.kernels, "MAX_FIXED_COLUMNS", None)
  corrections = None
  if limit is not None and ids.target_ids.shape[-1] > limit:
    # Past the limit: the target part only, the tile keeps k p - u there.
    corrections = jnp.broadcast_to(-(g * coeffs.target)[:, None], complement.shape)
  return sparse.sweep_columns(ids.target_ids, ids.target_mask, values, corrections, limit)


def _cast_grads(grads, hidden, table, bias):
  hidden_grad, table_grad, bias_grad = grads
  return (hidden_grad.astype(hidden.dtype), table_grad.astype(table.dtype),
          None if bias is None else bias_grad.astype(bias.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _per_token(call: SoftmaxCall, hidden, table, bias, ids):
  """(`[T]` float32 l_t, per-token counts or None) on one table."""
  return _forward(call, hidden, table, bias, ids)[0]


def _forward(call: SoftmaxCall, hidden, table, bias, ids):
  coeffs = coefficients(call, ids)
  local = local_forward(call, hidden, table, bias, ids, coeffs)
  sweep = (local.row_max, local.row_sum, local.logits.target, ids.target_mask,
           separated_targets(call, ids))
  lse, complement = partition(*sweep)
  per_token = per_token_losses(coeffs, lse, local.linear)
  counts = None
  if call.with_counts:
    counts = sparse.token_counts(ids, local.logits, local.positive_count, call.num_items)
  return (per_token, counts), (normalizer(*sweep), complement)


def _per_token_fwd(call: SoftmaxCall, hidden, table, bias, ids):
  out, (norm, complement) = _forward(call, hidden, table, bias, ids)
  # Residuals: the inputs, (top_t, total_t) [T] and 1 - p_tp [T, L]; the
  # backward recomputes every tile.
  return out, (hidden, table, bias, ids, norm, complement)


def _per_token_bwd(call: SoftmaxCall, residuals, cotangents):
  hidden, table, bias, ids, norm, complement = residuals
  coeffs = coefficients(call, ids)
  grads = local_backward(call, hidden, table, bias, ids, coeffs, norm, complement,
                         cotangents[0], rescale=Rescale(lambda mass: mass, ids.target_mask))
  return _cast_grads(grads, hidden, table, bias) + (None,)


_per_token.defvjp(_per_token_fwd, _per_token_bwd)


def softmax_backend(backend: str, flat: inputs.Flat, plan=None) -> str:
  """The backend a softmax call runs: "dense", or a kernel set with the softmax kernels.

  "auto" resolves as for `cut_bce` (`backends.resolve_backend`: the Pallas TPU
  kernels where they take the inputs, chosen when the program is lowered),
  and to the XLA path where they do not, or where a row holds more excluded
  ids than the kernels compare per tile (`MAX_SOFTMAX_EXCLUDE` of the kernel
  set: TPU 128, GPU 32: the Mosaic set compares 16 and gives wider rows to
  its Triton fallback).

  Raises:
    NotImplementedError: "pallas_tpu", "pallas_gpu" or "pallas_triton" named for
      inputs its kernels cannot take.
  """
  inputs.check_choice("backend", backend, backends.BACKEND_CHOICES)
  if backend == "dense":
    return "dense"
  resolved = backends.resolve_backend(backend, flat, plan)
  if resolved == "xla":
    return "xla"
  # The "auto" kernel set lowers to the TPU kernels: their limit applies.
  kernels = backends.kernel_module("pallas_tpu" if resolved == "auto" else resolved)
  width = 0 if flat.exclude is None else flat.exclude.shape[-1]
  if width > kernels.MAX_SOFTMAX_EXCLUDE:
    if backend != "auto":
      raise NotImplementedError(
          f"backend {backend!r} compares at most {kernels.MAX_SOFTMAX_EXCLUDE} excluded ids per "
          f"position in its softmax kernels, got exclude of width {width}")
    return "xla"
  backends.check_backend_supports(resolved, flat, plan)
  return resolved


def check_options(target_reduction, label_smoothing):
  """Validates the softmax's own options; returns label_smoothing as a float."""
  inputs.check_choice("target_reduction", target_reduction, TARGET_REDUCTIONS)
  if isinstance(label_smoothing, bool) or not isinstance(label_smoothing, (int, float)):
    raise TypeError(f"label_smoothing must be a number in [0, 1], got {label_smoothing!r}")
  if not 0.0 <= label_smoothing <= 1.0:
    raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
  return float(label_smoothing)


def cut_softmax_ce(hidden, table, targets, weights=None, *, bias=None, exclude=None,
                   num_items=None, reduction="mean", label_smoothing=0.0,
                   target_reduction="sum", return_stats=False, backend="auto", plan=None):
  """Full-catalog softmax cross-entropy with several targets per position, no `[T, V]` logits.

  Position t's loss, with lse_t the log-sum-exp of its logits over the
  softmax's items S_t (rows < num_items, minus excluded ids that are not
  targets), P_t its valid deduplicated targets and e the label smoothing:

      l_t = sum_{p in P_t} [(1 - e) (lse_t - x_tp) + e (lse_t - mean_{v in S_t} x_tv)]

  (`target_reduction="sum"`, the default: each target is one softmax
  cross-entropy term, as SASRec's and the trainer's dense baseline sum them,
  so a position with more targets weighs more, as in `cut_bce`; "mean"
  divides l_t by |P_t|). A position with no valid target contributes 0.
  Same input contract as `cut_bce`: padding ids, a repeated id counted once,
  weight-0 positions dropped, rows at or past `num_items` never in the
  softmax. Accumulation is float32; logits of any finite size are safe (the
  log-sum-exp is shifted by each token's running max).

  Args:
    hidden, table, targets, weights, bias, exclude, num_items, plan: as in
      `cut_bce`.
    reduction: "mean" (sum_t w_t l_t / sum_t w_t), "sum", or "none".
    label_smoothing: e in [0, 1].
    target_reduction: "sum" or "mean" over a position's targets.
    return_stats: also return `cutbce.Stats`, the weighted confusion counts
      at logit > 0 as `cut_bce` defines them.
    backend: as in `cut_bce`: "auto" (the Pallas TPU softmax kernels when
      lowered for TPU, the tiled XLA path elsewhere), "xla", "pallas_tpu"
      (Pallas' interpreter off-TPU), "pallas_gpu" (the Mosaic GPU softmax
      kernels: compiled on a GPU, Pallas' Mosaic GPU interpreter on a CPU),
      "pallas_triton" (the Pallas Triton ones; both refused on a TPU host), or "dense"
      (`cutbce.dense_softmax_ce`, the materializing reference).

  Returns:
    float32 loss (scalar, or `[...]` for reduction="none"); with
    `return_stats`, `(loss, stats)`.

  Example:
    >>> import jax.numpy as jnp, cutbce
    >>> hidden = jnp.zeros((1, 2, 4)); table = jnp.ones((8, 4))
    >>> # Equal logits: each target costs log 8.
    >>> round(float(cutbce.cut_softmax_ce(hidden, table, jnp.array([[[1, 2], [3, -1]]]),
    ...                                   reduction="sum")), 4)
    6.2383
  """
  inputs.check_choice("reduction", reduction, inputs.REDUCTIONS)
  inputs.check_plan(plan)
  label_smoothing = check_options(target_reduction, label_smoothing)
  flat = inputs.flatten_inputs(hidden, table, targets, weights, bias, exclude)
  num_items = inputs.check_num_items(num_items, flat.table.shape[0])
  backend = softmax_backend(backend, flat, plan)
  if backend == "dense":
    return reference.dense_softmax_ce(
        hidden, table, targets, weights, bias=bias, exclude=exclude, num_items=num_items,
        reduction=reduction, label_smoothing=label_smoothing,
        target_reduction=target_reduction, return_stats=return_stats)
  ids = sparse.prepare_ids(flat.targets, flat.exclude, num_items, flat.exclude_rows)
  call = SoftmaxCall(backend, plan, bool(return_stats), label_smoothing, target_reduction,
                     num_items, num_items)
  per_token, counts = _per_token(call, flat.hidden, flat.table, flat.bias, ids)
  loss = inputs.reduce_weighted(per_token, flat.weights, reduction, 1, flat.leading_shape)
  if not return_stats:
    return loss
  return loss, inputs.weighted_stats(counts, flat.weights)
