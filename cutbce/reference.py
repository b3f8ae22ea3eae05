"""The materializing reference: builds `[T, V]` logits and labels. The test oracle.

Deliberately simple and independent of the tiled code: labels by one-hot
scatter, exclusion by mask, the loss by `softplus(x) - y * x` summed over the
catalog, gradients by plain autodiff. Memory O(T * V): for tests and baselines.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from cutbce import inputs
from cutbce.stats import Stats


def _id_mask(ids, vocab):
  """[T, V] bool with True at every valid id of each row (repeats count once)."""
  valid = (ids >= 0) & (ids < vocab)
  rows = jnp.arange(ids.shape[0])[:, None]
  mask = jnp.zeros((ids.shape[0], vocab), bool)
  return mask.at[rows, jnp.where(valid, ids, 0)].max(valid)


def _dense_logits(flat: inputs.Flat):
  logits = jnp.einsum(
      "td,vd->tv", flat.hidden, flat.table, preferred_element_type=jnp.float32
  )  # [T, V]
  if flat.bias is not None:
    logits = logits + flat.bias.astype(jnp.float32)[None, :]
  return logits


def dense_bce(
    hidden, table, targets, weights=None, *, bias=None, exclude=None,
    reduction="mean", vocab_reduction="mean", return_stats=False,
    backend="dense", plan=None,
):
  """`cutbce.cut_bce` computed densely; same signature and semantics.

  `backend` and `plan` are accepted for signature compatibility and ignored.
  """
  del backend
  inputs.check_choice("reduction", reduction, inputs.REDUCTIONS)
  inputs.check_choice("vocab_reduction", vocab_reduction, inputs.VOCAB_REDUCTIONS)
  inputs.check_plan(plan)
  flat = inputs.flatten_inputs(hidden, table, targets, weights, bias, exclude)
  vocab = flat.table.shape[0]
  logits = _dense_logits(flat)
  labels = _id_mask(flat.targets, vocab)  # [T, V]
  counted = jnp.ones_like(labels)
  if flat.exclude is not None:
    counted = ~(_id_mask(flat.exclude, vocab) & ~labels)
  elementwise = jax.nn.softplus(logits) - jnp.where(labels, logits, 0.0)
  per_token = jnp.sum(jnp.where(counted, elementwise, 0.0), axis=-1)
  loss = inputs.reduce_losses(per_token, flat, reduction, vocab_reduction)
  if not return_stats:
    return loss
  predicted = logits > 0
  counts = (
      jnp.sum(counted & predicted & labels, axis=-1),
      jnp.sum(counted & predicted & ~labels, axis=-1),
      jnp.sum(counted & ~predicted & labels, axis=-1),
      jnp.sum(counted & ~predicted & ~labels, axis=-1),
  )
  return loss, inputs.weighted_stats(counts, jax.lax.stop_gradient(flat.weights))


def dense_target_ranks(hidden, table, targets, *, bias=None, exclude=None):
  """`cutbce.target_ranks` from dense logits: int32 `[..., L]`, 0 for padding."""
  flat = inputs.flatten_inputs(hidden, table, targets, None, bias, exclude)
  vocab = flat.table.shape[0]
  logits = _dense_logits(flat)
  targets = flat.targets.astype(jnp.int32)
  valid = (targets >= 0) & (targets < vocab)
  target_logits = jnp.take_along_axis(logits, jnp.where(valid, targets, 0), axis=1)
  counted = jnp.ones(logits.shape, bool)
  if flat.exclude is not None:
    counted = ~(_id_mask(flat.exclude, vocab) & ~_id_mask(targets, vocab))
  larger = (logits[:, None, :] > target_logits[:, :, None]) & counted[:, None, :]
  ranks = 1 + jnp.sum(larger, axis=-1, dtype=jnp.int32)  # [T, L]
  # A repeated id counts once: later copies are padding.
  length = targets.shape[-1]
  earlier = jnp.tril(jnp.ones((length, length), bool), k=-1)
  repeated = jnp.any(
      (targets[:, :, None] == targets[:, None, :]) & earlier & valid[:, None, :], axis=-1
  )
  ranks = jnp.where(valid & ~repeated, ranks, 0)
  return jnp.reshape(ranks, _leading(hidden) + (length,))


def _leading(hidden):
  return tuple(jnp.shape(hidden)[:-1])


__all__ = ["dense_bce", "dense_target_ranks", "Stats"]
