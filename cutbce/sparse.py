"""Sparse corrections shared by every tiled backend, written once.

The loss of position t splits exactly into a dense background over the whole
catalog and corrections at a few ids (DESIGN.md section 1):

    l_t = sum_v f(x_tv, 0)                      dense, tiled by the backend
          - sum_{v in X_t} f(x_tv, 0)           excluded ids (neither label)
          + sum_{p in P_t} f(x_tp, 1) - f(x_tp, 0)   targets (label 1)

with f the per-logit loss of `cutbce.variants` (plain BCE: f(x, y) =
softplus(x) - y x, so the target term is -x_tp). P_t are the valid,
deduplicated target ids; X_t the valid, deduplicated exclude ids that are not
also targets. Both corrections touch L + E rows per position: a gather of table
rows in the forward, a gather and a scatter-add of rows in the backward.

An id is valid when 0 <= id < num_items (the table's rows past `num_items`
are padding); the range is checked in the caller's integer type before any
cast, so an int64 id of 2**32 + 5 is padding, not item 5.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from cutbce import variants
from cutbce.kernels import matmul
from cutbce.variants import LossOptions


class SparseIds(NamedTuple):
  """Ids of the sparse corrections, safe to gather with.

  Attributes:
    target_ids: [T, L] int32, clipped into [0, V).
    target_mask: [T, L] bool, valid and the first occurrence in its row.
    exclude_ids: [T, E] int32 clipped into [0, V), or None.
    exclude_mask: [T, E] bool, valid, first occurrence, and not a target; or None.
    exclude_rows: [G, E] int32 when each row of ids is shared by T / G
      consecutive tokens (`inputs.Flat.exclude_rows`): the valid ids, first
      occurrences, targets among them (-1 elsewhere), column for column as in
      each of its tokens' `exclude_ids`; else None.
  """

  target_ids: jax.Array
  target_mask: jax.Array
  exclude_ids: jax.Array | None
  exclude_mask: jax.Array | None
  exclude_rows: jax.Array | None = None


def _first_occurrence(ids: jax.Array, valid: jax.Array) -> jax.Array:
  """[T, K] bool: valid and no earlier valid equal id in the row."""
  k = ids.shape[-1]
  equal = ids[:, :, None] == ids[:, None, :]  # [T, K, K]
  earlier = jnp.tril(jnp.ones((k, k), dtype=bool), k=-1)  # j < i
  duplicate = jnp.any(equal & earlier & valid[:, None, :], axis=-1)
  return valid & ~duplicate


def _first_occurrence_sorted(ids: jax.Array, valid: jax.Array):
  """For wide rows: sort, then keep the first of each run. Order is not kept."""
  sentinel = jnp.iinfo(jnp.int32).max
  ids_sorted = jnp.sort(jnp.where(valid, ids, sentinel), axis=-1)  # [T, E]
  previous = jnp.pad(ids_sorted[:, :-1], ((0, 0), (1, 0)), constant_values=-1)
  keep = (ids_sorted != sentinel) & (ids_sorted != previous)
  return ids_sorted, keep


def valid_ids(ids: jax.Array, vocab: int) -> tuple[jax.Array, jax.Array]:
  """(int32 ids with invalid ones set to -1, bool validity): 0 <= id < vocab.

  The range is checked in the ids' own integer type first, so no wide id
  wraps into range when cast to int32.
  """
  valid = (ids >= 0) & (ids < vocab)
  return jnp.where(valid, ids, -1).astype(jnp.int32), valid


def _unique_ids(exclude, vocab: int):
  """(ids, bool keep): valid and the first of their row; sorted when rows are wide."""
  exclude, exclude_valid = valid_ids(exclude, vocab)
  if exclude.shape[-1] <= 32:
    return exclude, _first_occurrence(exclude, exclude_valid)
  return _first_occurrence_sorted(exclude, exclude_valid)


def prepare_ids(targets: jax.Array, exclude: jax.Array | None, vocab: int,
                exclude_rows: jax.Array | None = None) -> SparseIds:
  """Masks and clips the `[T, L]` targets and `[T, E]` exclude ids for `vocab` items.

  With `exclude_rows` (`[G, E]`, each shared by T / G consecutive tokens;
  `exclude`, their repetition per token, is then not read), the rows are
  deduplicated once and `SparseIds.exclude_rows` keeps them.
  """
  targets, target_valid = valid_ids(targets, vocab)
  target_mask = _first_occurrence(targets, target_valid)
  target_ids = jnp.where(target_valid, targets, 0)
  if exclude is None and exclude_rows is None:
    return SparseIds(target_ids, target_mask, None, None)
  rows = None
  if exclude_rows is None:
    exclude, keep = _unique_ids(exclude, vocab)
  else:
    rows, row_keep = _unique_ids(exclude_rows, vocab)
    group = targets.shape[0] // rows.shape[0]
    exclude, keep = jnp.repeat(rows, group, axis=0), jnp.repeat(row_keep, group, axis=0)
    rows = jnp.where(row_keep, rows, -1)
  # Ids that are also targets stay targets: drop them from the excluded set.
  is_target = jnp.any(
      (exclude[:, :, None] == targets[:, None, :]) & target_mask[:, None, :], axis=-1
  )  # [T, E]
  exclude_mask = keep & ~is_target
  exclude_ids = jnp.where(exclude_mask, exclude, 0)
  return SparseIds(target_ids, target_mask, exclude_ids, exclude_mask, rows)


def gather_logits(hidden, table, bias, ids):
  """x_tk = h_t . e_{ids_tk} (+ b): `[T, K]` float32 from `[T, D]`, `[V, D]`, `[T, K]`."""
  rows = jnp.take(table, ids, axis=0)  # [T, K, D]
  # A broadcast product summed over D, not a batched dot: on a mesh with
  # explicit axes `hidden` may be sharded over T while the gathered rows are
  # not, and dot_general demands equal batch shardings (jax >= 0.11) where a
  # broadcast takes the sharded side's. Both factors are cast to float32
  # first, so every product (exact for bfloat16 inputs) and the sum over D
  # are float32, as the dot with preferred_element_type=float32 was.
  products = hidden.astype(jnp.float32)[:, None, :] * rows.astype(jnp.float32)  # [T, K, D]
  logits = jnp.sum(products, axis=-1)
  if bias is not None:
    logits = logits + jnp.take(bias, ids, axis=0).astype(jnp.float32)
  return logits


class SparseLogits(NamedTuple):
  """Logits at the sparse ids, float32.

  Attributes:
    target: [T, L] logits of the target ids (masked entries are garbage).
    exclude: [T, E] logits of the excluded ids, or None.
  """

  target: jax.Array
  exclude: jax.Array | None


def shared_row_logits(hidden, table, bias, rows):
  """`gather_logits` for `[G, K]` ids each shared by T / G consecutive tokens: `[T, K]`.

  A batched product per row (`[T / G, D] x [D, K]`): the `[G, K, D]` rows are
  gathered once, not once per token. Ids < 0 give garbage (mask them).
  """
  num_rows, width = rows.shape
  group = hidden.shape[0] // num_rows
  gathered = jnp.take(table, jnp.maximum(rows, 0), axis=0).astype(jnp.float32)  # [G, K, D]
  tokens = hidden.astype(jnp.float32).reshape(num_rows, group, hidden.shape[-1])
  logits = jnp.einsum("gnd,gkd->gnk", tokens, gathered, preferred_element_type=jnp.float32,
                      precision=matmul.precision(jnp.float32))
  if bias is not None:
    logits = logits + jnp.take(bias, jnp.maximum(rows, 0), axis=0).astype(jnp.float32)[:, None]
  return logits.reshape(num_rows * group, width)


def sparse_logits(hidden, table, bias, ids: SparseIds) -> SparseLogits:
  target = gather_logits(hidden, table, bias, ids.target_ids)
  exclude = None
  if ids.exclude_rows is not None:
    exclude = shared_row_logits(hidden, table, bias, ids.exclude_rows)
  elif ids.exclude_ids is not None:
    exclude = gather_logits(hidden, table, bias, ids.exclude_ids)
  return SparseLogits(target, exclude)


def _target_terms(options: LossOptions, x):
  """f(x, 1) - f(x, 0) and its derivative at target logits `x`."""
  if options.is_affine and options.pos_weight is None:
    # softplus(x) - y' x: the difference of the labels is (1 - e) x exactly.
    keep = 1.0 - options.label_smoothing
    return -keep * x, jnp.full_like(x, -keep)
  return variants.target_value_and_grad(options, x)


def _excluded_terms(options: LossOptions, x):
  """f(x, 0) and its derivative at excluded logits `x` (to be removed)."""
  if options.is_plain:
    return jax.nn.softplus(x), jax.nn.sigmoid(x)
  return variants.negative_value_and_grad(options, x)


def loss_correction(ids: SparseIds, logits: SparseLogits, options: LossOptions) -> jax.Array:
  """`[T]` float32 to add to the dense background: sum_P [f(x,1) - f(x,0)] - sum_X f(x,0)."""
  target_terms, _ = _target_terms(options, logits.target)
  correction = jnp.sum(jnp.where(ids.target_mask, target_terms, 0.0), axis=-1)
  if ids.exclude_mask is not None:
    excluded, _ = _excluded_terms(options, logits.exclude)
    correction = correction - jnp.sum(jnp.where(ids.exclude_mask, excluded, 0.0), axis=-1)
  return correction


def excluded_above(ids: SparseIds, exclude_logits, target_logits) -> jax.Array:
  """`[T, L]` int32 #{v in X_t : x_tv >= target_logits[t, l] or it is NaN}, 0 without exclude.

  What a rank count over the whole catalog must give back for excluded ids
  (the tie rule of `rank_counts`: ties against the target, a NaN target last).
  """
  if ids.exclude_mask is None:
    return jnp.zeros(target_logits.shape, jnp.int32)
  above = ((exclude_logits[:, :, None] >= target_logits[:, None, :])
           | jnp.isnan(target_logits)[:, None, :])  # [T, E, L]
  return jnp.sum(ids.exclude_mask[:, :, None] & above, axis=1, dtype=jnp.int32)


class TokenCounts(NamedTuple):
  """Per-position confusion counts at logit > 0, int32 `[T]` each."""

  tp: jax.Array
  fp: jax.Array
  fn: jax.Array
  tn: jax.Array


def token_counts(
    ids: SparseIds, logits: SparseLogits, positive_count: jax.Array, vocab: int
) -> TokenCounts:
  """Confusion counts from the dense `[T]` count of logits > 0 and the sparse logits."""
  num_targets = jnp.sum(ids.target_mask, axis=-1, dtype=jnp.int32)
  tp = jnp.sum(ids.target_mask & (logits.target > 0), axis=-1, dtype=jnp.int32)
  predicted = positive_count
  num_items = jnp.full_like(num_targets, vocab)
  if ids.exclude_mask is not None:
    predicted = predicted - jnp.sum(
        ids.exclude_mask & (logits.exclude > 0), axis=-1, dtype=jnp.int32
    )
    num_items = num_items - jnp.sum(ids.exclude_mask, axis=-1, dtype=jnp.int32)
  fp = predicted - tp
  fn = num_targets - tp
  tn = num_items - num_targets - fp
  return TokenCounts(tp, fp, fn, tn)


def logit_cotangents(ids: SparseIds, logits: SparseLogits, scale: jax.Array,
                     options: LossOptions):
  """d loss / d x at the sparse ids, as (`ids [T, K]`, `coefficients [T, K]` f32).

  Targets give g_t (f'(x, 1) - f'(x, 0)) (plain BCE: -g_t); excluded ids give
  -g_t f'(x, 0) (plain: -g_t sigmoid(x)), cancelling the background's
  contribution. Masked entries get 0.
  """
  _, target_grads = _target_terms(options, logits.target)
  coefficients = jnp.where(ids.target_mask, scale[:, None] * target_grads, 0.0)
  all_ids = ids.target_ids
  if ids.exclude_mask is not None:
    _, excluded_grads = _excluded_terms(options, logits.exclude)
    excluded = jnp.where(ids.exclude_mask, -scale[:, None] * excluded_grads, 0.0)
    coefficients = jnp.concatenate([coefficients, excluded], axis=-1)
    all_ids = jnp.concatenate([ids.target_ids, ids.exclude_ids], axis=-1)
  return all_ids, coefficients


def combine_rows(table, ids, weights):
  """sum_k w_tk e_{ids_tk} `[T, D]` float32 from `[T, K]` ids (< 0: none) and weights."""
  rows = jnp.take(table, jnp.maximum(ids, 0), axis=0).astype(jnp.float32)  # [T, K, D]
  return jnp.einsum("tk,tkd->td", jnp.where(ids >= 0, weights, 0.0), rows,
                    preferred_element_type=jnp.float32, precision=matmul.precision(jnp.float32))


def sparse_grads(hidden, table, has_bias: bool, all_ids, coefficients):
  """Sparse gradient parts, all float32.

  Returns:
    dh [T, D] = sum_k c_tk e_{id_tk}; dE [V, D] with c_tk h_t scattered into
    row id_tk; db [V] with c_tk scattered into id_tk (None without bias).
  """
  dh = combine_rows(table, all_ids, coefficients)
  contributions = coefficients[:, :, None] * hidden.astype(jnp.float32)[:, None, :]
  dtable = jnp.zeros(table.shape, jnp.float32).at[all_ids].add(contributions)
  dbias = None
  if has_bias:
    dbias = jnp.zeros(table.shape[:1], jnp.float32).at[all_ids].add(coefficients)
  return dh, dtable, dbias


class SweepColumns(NamedTuple):
  """The sparse ids' gradient, split between the dense sweep and the sparse scatter.

  Attributes:
    fixed_ids: [T, K'] int32 columns whose logit gradient the sweep sets
      (-1 for none), K' <= the kernels' `MAX_FIXED_COLUMNS`; None when that is 0.
    fixed_values: [T, K'] float32, the whole logit gradient there; or None.
    rest_ids: [T, K - K'] int32 ids left to `sparse_grads`, or None.
    rest_coefficients: [T, K - K'] float32, their corrections to the
      sweep's background value (0 where masked), or None.
  """

  fixed_ids: jax.Array
  fixed_values: jax.Array
  rest_ids: jax.Array | None
  rest_coefficients: jax.Array | None


def sweep_columns(all_ids, mask, values, corrections, limit: int | None) -> SweepColumns:
  """Gives the first `limit` of K sparse columns to the sweep (all of them when None).

  Why: a column's exact gradient is often a tiny difference of numbers near 1
  (plain BCE target: sigmoid(x) - 1; softmax target: p - 1). Computed from the
  target's own logit in float32 and *set* in the tile before its cast to the
  input dtype, it survives; as the tile's background value rounded to the
  input dtype plus a separate float32 correction, it cancels to 0 in
  bfloat16. Columns past `limit` (the Pallas kernels' unrolled compare) keep
  the correction form: `corrections` are their differences to the background.

  Args:
    all_ids: [T, K] int32 ids (garbage where not `mask`).
    mask: [T, K] bool, the valid deduplicated ids.
    values: [T, K] float32 exact logit gradients at those ids.
    corrections: [T, K] float32 corrections to the background, or None when
      `limit` cannot be exceeded.
    limit: the kernels' `MAX_FIXED_COLUMNS` (None: unlimited).
  """
  if limit == 0:
    return SweepColumns(None, None, all_ids, jnp.where(mask, corrections, 0.0))
  fixed_ids = jnp.where(mask, all_ids, -1)
  fixed_values = jnp.where(mask, values, 0.0)
  k = all_ids.shape[-1]
  if limit is None or k <= limit:
    return SweepColumns(fixed_ids, fixed_values, None, None)
  rest = jnp.where(mask, corrections, 0.0)[:, limit:]
  return SweepColumns(fixed_ids[:, :limit], fixed_values[:, :limit], all_ids[:, limit:], rest)


def bce_columns(ids: SparseIds, logits: SparseLogits, scale: jax.Array, options: LossOptions,
                limit: int | None) -> SweepColumns:
  """`sweep_columns` of `cut_bce`: targets and excluded ids, with g_t = `scale`.

  A target's column holds g_t (f'(x, 1) + B) (plain BCE: -g_t sigmoid(-x)),
  an excluded id's g_t B, so that with the linear -B g_t that the caller adds
  to every item's column (affine options, `tiled._finish_grads`) the
  excluded id gets exactly 0 and the target exactly g_t f'(x, 1).
  """
  _, slope = options.affine_coefficients()
  values = scale[:, None] * variants.target_column_grad(options, logits.target)
  all_ids, mask = ids.target_ids, ids.target_mask
  if ids.exclude_mask is not None:
    excluded = jnp.broadcast_to((slope * scale)[:, None], ids.exclude_ids.shape)
    values = jnp.concatenate([values, excluded], axis=-1)
    all_ids = jnp.concatenate([all_ids, ids.exclude_ids], axis=-1)
    mask = jnp.concatenate([mask, ids.exclude_mask], axis=-1)
  corrections = None
  if limit is not None and all_ids.shape[-1] > limit:
    _, corrections = logit_cotangents(ids, logits, scale, options)
  return sweep_columns(all_ids, mask, values, corrections, limit)


def rest_grads(hidden, table, has_bias: bool, columns: SweepColumns):
  """`sparse_grads` of the columns the sweep does not set; zeros when there are none."""
  if columns.rest_ids is None:
    return (jnp.zeros(hidden.shape, jnp.float32), jnp.zeros(table.shape, jnp.float32),
            jnp.zeros(table.shape[:1], jnp.float32) if has_bias else None)
  return sparse_grads(hidden, table, has_bias, columns.rest_ids, columns.rest_coefficients)
