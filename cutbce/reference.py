"""The materializing reference: builds `[T, V]` logits and labels. The test oracle.

Deliberately simple and independent of the tiled code: labels by one-hot
scatter, exclusion by mask, the loss by `softplus(x) - y * x` summed over the
catalog, gradients by plain autodiff. Memory O(T * V): for tests and baselines.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from cutbce import inputs, variants
from cutbce.kernels import matmul
from cutbce.stats import Stats


def _id_mask(ids, vocab, num_items=None):
  """[T, V] bool with True at every valid id (< num_items) of each row (repeats count once)."""
  num_items = vocab if num_items is None else num_items
  valid = (ids >= 0) & (ids < num_items)
  rows = jnp.arange(ids.shape[0])[:, None]
  mask = jnp.zeros((ids.shape[0], vocab), bool)
  safe = jnp.where(valid, ids, 0).astype(jnp.int32)  # range checked before the cast
  return mask.at[rows, safe].max(valid)


def _item_columns(vocab, num_items):
  """[1, V] bool: the columns that are items (not padding rows)."""
  return (jnp.arange(vocab) < num_items)[None, :]


def _dense_logits(flat: inputs.Flat):
  logits = jnp.einsum(
      "td,vd->tv", flat.hidden, flat.table, preferred_element_type=jnp.float32,
      precision=matmul.precision(flat.hidden, flat.table),
  )  # [T, V]
  if flat.bias is not None:
    logits = logits + flat.bias.astype(jnp.float32)[None, :]
  return logits


def dense_bce(
    hidden, table, targets, weights=None, *, bias=None, exclude=None,
    reduction="mean", vocab_reduction="mean", return_stats=False,
    backend="dense", plan=None, num_items=None, pos_weight=None, label_smoothing=0.0,
    logit_soft_cap=None, focal_gamma=None, focal_alpha=None, one_pass=None,
):
  """`cutbce.cut_bce` computed densely; same signature and semantics.

  Every logit's loss is f(x, y) of `cutbce.variants` (plain BCE:
  softplus(x) - y x), summed over the items that count; gradients by autodiff.
  `backend`, `plan` and `one_pass` are accepted for signature compatibility
  and ignored (autodiff of the dense logits is one program either way).
  """
  del backend, one_pass
  inputs.check_choice("reduction", reduction, inputs.REDUCTIONS)
  inputs.check_choice("vocab_reduction", vocab_reduction, inputs.VOCAB_REDUCTIONS)
  inputs.check_plan(plan)
  options = variants.make_options(
      pos_weight=pos_weight, label_smoothing=label_smoothing, logit_soft_cap=logit_soft_cap,
      focal_gamma=focal_gamma, focal_alpha=focal_alpha,
  )
  flat = inputs.flatten_inputs(hidden, table, targets, weights, bias, exclude)
  vocab = flat.table.shape[0]
  num_items = inputs.check_num_items(num_items, vocab)
  logits = _dense_logits(flat)
  labels = _id_mask(flat.targets, vocab, num_items)  # [T, V]
  counted = jnp.broadcast_to(_item_columns(vocab, num_items), labels.shape)
  if flat.exclude is not None:
    counted = counted & ~(_id_mask(flat.exclude, vocab, num_items) & ~labels)
  if options.is_plain:
    elementwise = jax.nn.softplus(logits) - jnp.where(labels, logits, 0.0)
  else:
    elementwise = jnp.where(
        labels, variants.elementwise_loss(options, logits, 1),
        variants.elementwise_loss(options, logits, 0),
    )
  per_token = jnp.sum(jnp.where(counted, elementwise, 0.0), axis=-1)
  loss = inputs.reduce_losses(per_token, flat, reduction, vocab_reduction, num_items)
  if not return_stats:
    return loss
  predicted = logits > 0
  counts = (
      jnp.sum(counted & predicted & labels, axis=-1),
      jnp.sum(counted & predicted & ~labels, axis=-1),
      jnp.sum(counted & ~predicted & labels, axis=-1),
      jnp.sum(counted & ~predicted & ~labels, axis=-1),
  )
  return loss, inputs.weighted_stats(counts, flat.weights)


def dense_softmax_ce(
    hidden, table, targets, weights=None, *, bias=None, exclude=None, num_items=None,
    reduction="mean", label_smoothing=0.0, target_reduction="sum", return_stats=False,
    backend="dense", plan=None,
):
  """`cutbce.cut_softmax_ce` computed densely; same signature and semantics.

  Each position's target distribution over the softmax's items S_t is
  q_tv = (1 - e) r_t [v in P_t] + e k_t [v in S_t] / |S_t| (k_t, r_t as in
  `cut_softmax_ce`), and l_t = -sum_{v in S_t} q_tv log_softmax_S(x_t)_v;
  gradients by autodiff. Memory O(T * V) float32: the test oracle and the
  trainer's "dense" baseline. `backend` and `plan` are ignored.
  """
  del backend
  inputs.check_choice("reduction", reduction, inputs.REDUCTIONS)
  inputs.check_choice("target_reduction", target_reduction, ("sum", "mean"))
  inputs.check_plan(plan)
  flat = inputs.flatten_inputs(hidden, table, targets, weights, bias, exclude)
  vocab = flat.table.shape[0]
  num_items = inputs.check_num_items(num_items, vocab)
  logits = _dense_logits(flat)
  labels = _id_mask(flat.targets, vocab, num_items)  # [T, V]
  in_softmax = jnp.broadcast_to(_item_columns(vocab, num_items), labels.shape)
  if flat.exclude is not None:
    in_softmax = in_softmax & ~(_id_mask(flat.exclude, vocab, num_items) & ~labels)
  log_p = jax.nn.log_softmax(jnp.where(in_softmax, logits, -jnp.inf), axis=-1)
  count = jnp.sum(labels, axis=-1).astype(jnp.float32)  # n_t
  if target_reduction == "sum":
    k, r = count, jnp.ones_like(count)
  else:
    k = (count > 0).astype(jnp.float32)
    r = jnp.where(count > 0, 1.0 / jnp.maximum(count, 1.0), 0.0)
  size = jnp.sum(in_softmax, axis=-1).astype(jnp.float32)  # |S_t|
  smoothing = float(label_smoothing)
  q = ((1.0 - smoothing) * r[:, None] * labels
       + smoothing * (k / size)[:, None] * in_softmax)
  per_token = -jnp.sum(jnp.where(in_softmax & (q != 0), q * log_p, 0.0), axis=-1)
  loss = inputs.reduce_losses(per_token, flat, reduction, "sum", num_items)
  if not return_stats:
    return loss
  predicted = logits > 0
  counts = (
      jnp.sum(in_softmax & predicted & labels, axis=-1),
      jnp.sum(in_softmax & predicted & ~labels, axis=-1),
      jnp.sum(in_softmax & ~predicted & labels, axis=-1),
      jnp.sum(in_softmax & ~predicted & ~labels, axis=-1),
  )
  return loss, inputs.weighted_stats(counts, flat.weights)


def dense_target_ranks(hidden, table, targets, *, bias=None, exclude=None, num_items=None,
                       logit_soft_cap=None):
  """`cutbce.target_ranks` from dense logits: int32 `[..., L]`, 0 for padding."""
  flat = inputs.flatten_inputs(hidden, table, targets, None, bias, exclude)
  vocab = flat.table.shape[0]
  num_items = inputs.check_num_items(num_items, vocab)
  options = variants.make_options(logit_soft_cap=logit_soft_cap)
  logits = variants.cap(options, _dense_logits(flat))
  valid = (flat.targets >= 0) & (flat.targets < num_items)
  targets = jnp.where(valid, flat.targets, -1).astype(jnp.int32)
  target_logits = jnp.take_along_axis(logits, jnp.where(valid, targets, 0), axis=1)
  counted = jnp.broadcast_to(_item_columns(vocab, num_items), logits.shape)
  if flat.exclude is not None:
    counted = counted & ~(
        _id_mask(flat.exclude, vocab, num_items) & ~_id_mask(targets, vocab, num_items)
    )
  # Ties count against the target (its own column aside); a NaN target ranks
  # after every item, a NaN item after every number.
  own = jnp.arange(vocab, dtype=jnp.int32)[None, None, :] == targets[:, :, None]  # [T, L, V]
  above = ((logits[:, None, :] >= target_logits[:, :, None])
           | jnp.isnan(target_logits)[:, :, None])
  larger = above & counted[:, None, :] & ~own
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


__all__ = ["dense_bce", "dense_softmax_ce", "dense_target_ranks", "Stats"]
