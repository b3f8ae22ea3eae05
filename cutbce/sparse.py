"""Sparse corrections shared by every tiled backend, written once.

The loss of position t splits exactly into a dense background over the whole
catalog and corrections at a few ids (DESIGN.md section 1):

    l_t = sum_v softplus(x_tv)                  dense, tiled by the backend
          - sum_{v in X_t} softplus(x_tv)       excluded ids (neither label)
          - sum_{p in P_t} x_tp                 targets (label 1)

because BCE(x, y) = softplus(x) - y * x for y in {0, 1}. P_t are the valid,
deduplicated target ids; X_t the valid, deduplicated exclude ids that are not
also targets. Both corrections touch L + E rows per position: a gather of table
rows in the forward, a gather and a scatter-add of rows in the backward.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class SparseIds(NamedTuple):
  """Ids of the sparse corrections, safe to gather with.

  Attributes:
    target_ids: [T, L] int32, clipped into [0, V).
    target_mask: [T, L] bool, valid and the first occurrence in its row.
    exclude_ids: [T, E] int32 clipped into [0, V), or None.
    exclude_mask: [T, E] bool, valid, first occurrence, and not a target; or None.
  """

  target_ids: jax.Array
  target_mask: jax.Array
  exclude_ids: jax.Array | None
  exclude_mask: jax.Array | None


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


def prepare_ids(targets: jax.Array, exclude: jax.Array | None, vocab: int) -> SparseIds:
  """Masks and clips the `[T, L]` targets and `[T, E]` exclude ids for `vocab` items."""
  targets = targets.astype(jnp.int32)
  target_valid = (targets >= 0) & (targets < vocab)
  target_mask = _first_occurrence(targets, target_valid)
  target_ids = jnp.where(target_valid, targets, 0)
  if exclude is None:
    return SparseIds(target_ids, target_mask, None, None)
  exclude = exclude.astype(jnp.int32)
  exclude_valid = (exclude >= 0) & (exclude < vocab)
  if exclude.shape[-1] <= 32:
    keep = _first_occurrence(exclude, exclude_valid)
  else:
    exclude, keep = _first_occurrence_sorted(exclude, exclude_valid)
  # Ids that are also targets stay targets: drop them from the excluded set.
  is_target = jnp.any(
      (exclude[:, :, None] == targets[:, None, :]) & target_mask[:, None, :], axis=-1
  )  # [T, E]
  exclude_mask = keep & ~is_target
  exclude_ids = jnp.where(exclude_mask, exclude, 0)
  return SparseIds(target_ids, target_mask, exclude_ids, exclude_mask)


def gather_logits(hidden, table, bias, ids):
  """x_tk = h_t . e_{ids_tk} (+ b): `[T, K]` float32 from `[T, D]`, `[V, D]`, `[T, K]`."""
  rows = jnp.take(table, ids, axis=0)  # [T, K, D]
  logits = jnp.einsum(
      "td,tkd->tk", hidden, rows, preferred_element_type=jnp.float32
  )
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


def sparse_logits(hidden, table, bias, ids: SparseIds) -> SparseLogits:
  target = gather_logits(hidden, table, bias, ids.target_ids)
  exclude = None
  if ids.exclude_ids is not None:
    exclude = gather_logits(hidden, table, bias, ids.exclude_ids)
  return SparseLogits(target, exclude)


def loss_correction(ids: SparseIds, logits: SparseLogits) -> jax.Array:
  """`[T]` float32 to add to the dense background: -sum_X softplus - sum_P x."""
  correction = -jnp.sum(jnp.where(ids.target_mask, logits.target, 0.0), axis=-1)
  if ids.exclude_mask is not None:
    excluded = jnp.where(ids.exclude_mask, jax.nn.softplus(logits.exclude), 0.0)
    correction = correction - jnp.sum(excluded, axis=-1)
  return correction


def excluded_above(ids: SparseIds, exclude_logits, target_logits) -> jax.Array:
  """`[T, L]` int32 #{v in X_t : x_tv > target_logits[t, l]}, 0 without exclude.

  What a rank count over the whole catalog must give back for excluded ids.
  """
  if ids.exclude_mask is None:
    return jnp.zeros(target_logits.shape, jnp.int32)
  above = exclude_logits[:, :, None] > target_logits[:, None, :]  # [T, E, L]
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


def logit_cotangents(ids: SparseIds, logits: SparseLogits, scale: jax.Array):
  """d loss / d x at the sparse ids, as (`ids [T, K]`, `coefficients [T, K]` f32).

  Targets give -g_t; excluded ids give -g_t * sigmoid(x_tv), cancelling the
  background's contribution. Masked entries get 0.
  """
  coefficients = jnp.where(ids.target_mask, -scale[:, None], 0.0)
  all_ids = ids.target_ids
  if ids.exclude_mask is not None:
    excluded = jnp.where(
        ids.exclude_mask, -scale[:, None] * jax.nn.sigmoid(logits.exclude), 0.0
    )
    coefficients = jnp.concatenate([coefficients, excluded], axis=-1)
    all_ids = jnp.concatenate([ids.target_ids, ids.exclude_ids], axis=-1)
  return all_ids, coefficients


def sparse_grads(hidden, table, has_bias: bool, all_ids, coefficients):
  """Sparse gradient parts, all float32.

  Returns:
    dh [T, D] = sum_k c_tk e_{id_tk}; dE [V, D] with c_tk h_t scattered into
    row id_tk; db [V] with c_tk scattered into id_tk (None without bias).
  """
  rows = jnp.take(table, all_ids, axis=0)  # [T, K, D]
  dh = jnp.einsum(
      "tk,tkd->td", coefficients, rows.astype(jnp.float32),
      preferred_element_type=jnp.float32,
  )
  contributions = coefficients[:, :, None] * hidden.astype(jnp.float32)[:, None, :]
  dtable = jnp.zeros(table.shape, jnp.float32).at[all_ids].add(contributions)
  dbias = None
  if has_bias:
    dbias = jnp.zeros(table.shape[:1], jnp.float32).at[all_ids].add(coefficients)
  return dh, dtable, dbias
