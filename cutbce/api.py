"""The public door: `cut_bce` and `target_ranks`.

Each call validates its arguments, flattens the leading dims to T tokens, picks
a backend (`cutbce.backends`: the registry and "auto") and runs it. Tiled backends (`xla`, `pallas_tpu`)
share one custom VJP here: the backend computes the dense background over
vocabulary tiles, `cutbce.sparse` the corrections at target and excluded ids,
and the affine part of a loss variant (`cutbce.variants`) is applied here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from cutbce import inputs, reference, sparse, tiled, variants
from cutbce.backends import (BACKEND_CHOICES, BACKENDS, check_backend_supports,  # noqa: F401
                             default_plan, kernel_module, resolve_backend)
from cutbce.tiled import TiledCall
from cutbce.variants import LossOptions


def cut_bce(
    hidden, table, targets, weights=None, *, bias=None, exclude=None,
    reduction="mean", vocab_reduction="mean", return_stats=False,
    backend="auto", plan=None, num_items=None, pos_weight=None, label_smoothing=0.0,
    logit_soft_cap=None, focal_gamma=None, focal_alpha=None, one_pass=None,
):
  """Multi-label binary cross-entropy over the whole catalog, without `[T, V]` logits.

  With x_tv = h_t . e_v (+ b_v), P_t the valid deduplicated targets and X_t the
  excluded ids that are not targets, position t's loss is

      l_t = sum_{v not in X_t} softplus(x_tv) - sum_{p in P_t} x_tp,

  exactly BCE(x, y) = softplus(x) - y x summed over the catalog, computed as a
  tiled dense background plus sparse corrections. Accumulation is float32.
  The variants replace BCE(x, y) by f(x, y) of `cutbce.variants` (all of them
  composable): l_t = sum_{v not in X_t} f(x_tv, 0) + sum_P [f(x_tp, 1) - f(x_tp, 0)].

  Args:
    hidden: `[..., D]` float32 or bfloat16 hidden states (usually `[B, N, D]`).
    table: `[V, D]` item table.
    targets: int `[..., L]` positive ids; any id outside [0, num_items) is
      padding (use -1); an id repeated in a row counts once. The range is
      checked in the type this function receives: under `jax.jit` with x64
      off, jax has already converted an int64 NumPy argument to int32 by
      wrapping, so an id of 2^32 + 5 arrives as item 5, not as padding
      (eagerly it is padding). Check wider ids on the host before the jitted
      call (ids of a catalog fit int32: V < 2^31).
    weights: optional float `[...]` per position; 0 drops a position entirely
      (a NaN or inf hidden row of weight 0 changes nothing). Weights get no
      gradient.
    bias: optional `[V]` per-item bias.
    exclude: optional int `[..., E]` ids that are neither positives nor
      negatives for their position (ids that are also targets stay targets).
      Its leading axes broadcast to hidden's: `[B, 1, E]` gives one row to all
      N positions of a window (gathered and, on the softmax's XLA path,
      masked once per row, not per position).
    reduction: "mean" (sum_t w_t l_t / sum_t w_t, 0 when all weights are 0),
      "sum", or "none" (w_t l_t with the leading shape).
    vocab_reduction: "mean" divides l_t by num_items (the Keras convention),
      "sum" not.
    return_stats: also return a `cutbce.Stats` of weighted confusion counts
      at logit > 0 (excluded ids count in none; a soft cap keeps the sign, so
      the threshold is the same on the capped logit).
    backend: "auto" (Pallas on TPU, XLA elsewhere, chosen when the program
      is lowered, so exporting for TPU from a CPU host gives the Pallas
      kernels), "xla", "pallas_tpu" (Pallas' interpreter off-TPU),
      "pallas_gpu" (Mosaic GPU kernels; their interpreter on a CPU),
      "pallas_triton" (Pallas Triton kernels; the GPU kernels are refused
      on a TPU host), or "dense" (the materializing reference).
    plan: optional `cutbce.TilePlan` overriding the tile sizes (default: each
      kernel plans for itself).
    num_items: the catalog size when the table has padding rows: rows at or
      past it are never negatives, never targets, get exactly zero gradient.
      None means V.
    pos_weight: w > 0: positives weigh w, w y softplus(-x) + (1 - y) softplus(x).
    label_smoothing: e in [0, 1]: labels y (1 - e) + e/2.
    logit_soft_cap: c > 0: every logit becomes c tanh(x / c) first.
    focal_gamma, focal_alpha: binary focal loss a_t (1 - p_t)^g BCE (Keras'
      `binary_focal_crossentropy`; a_t only when `focal_alpha` is given).
    one_pass: differentiate in one sweep of the vocabulary (None: yes for
      reduction "mean" and "sum", where every position's cotangent is known
      at forward time up to one scalar). The forward then also makes the
      gradients (3 GEMMs per tile, against 4 for forward + backward) and keeps
      a float32 `[V, D]` dE (and dh, db) alive until the backward. False:
      two passes, residuals are the inputs only (the smallest memory between
      forward and backward). True with reduction="none" is a ValueError.
      Tiled backends only; the value is the same either way.

  Returns:
    float32 loss: a scalar, or `[...]` for reduction="none"; with
    `return_stats`, `(loss, stats)`.

  Raises:
    ValueError, TypeError: on bad shapes, dtypes or option values, naming the
      argument and the shapes seen.

  Example:
    >>> import jax.numpy as jnp, cutbce
    >>> hidden = jnp.ones((2, 3, 4)); table = jnp.zeros((10, 4))
    >>> targets = jnp.array([[[1], [2], [-1]], [[3], [3], [4]]])
    >>> # Every logit is 0: each position pays softplus(0) = log 2 per item.
    >>> round(float(cutbce.cut_bce(hidden, table, targets, vocab_reduction="sum")), 4)
    6.9315
    >>> # With 8 real items (rows 8, 9 padding) it pays 8 log 2.
    >>> round(float(cutbce.cut_bce(hidden, table, targets, vocab_reduction="sum", num_items=8)), 4)
    5.5452
  """
  inputs.check_choice("reduction", reduction, inputs.REDUCTIONS)
  inputs.check_choice("vocab_reduction", vocab_reduction, inputs.VOCAB_REDUCTIONS)
  inputs.check_plan(plan)
  inputs.check_choice("backend", backend, BACKEND_CHOICES)
  options = variants.make_options(
      pos_weight=pos_weight, label_smoothing=label_smoothing, logit_soft_cap=logit_soft_cap,
      focal_gamma=focal_gamma, focal_alpha=focal_alpha,
  )
  flat = inputs.flatten_inputs(hidden, table, targets, weights, bias, exclude)
  num_items = inputs.check_num_items(num_items, flat.table.shape[0])
  use_one_pass(one_pass, reduction)  # checked for every backend
  backend = resolve_backend(backend, flat, plan)
  if backend == "dense":
    return reference.dense_bce(
        hidden, table, targets, weights, bias=bias, exclude=exclude,
        reduction=reduction, vocab_reduction=vocab_reduction,
        return_stats=return_stats, num_items=num_items, **options_kwargs(options),
    )
  check_backend_supports(backend, flat, plan)
  ids = sparse.prepare_ids(flat.targets, flat.exclude, num_items, flat.exclude_rows)
  call = TiledCall(backend, plan, bool(return_stats), options, num_items)
  if use_one_pass(one_pass, reduction):
    divisor = num_items if vocab_reduction == "mean" else 1
    loss, counts = tiled.reduced_loss(
        call, tiled.Reduction(reduction, divisor), flat.hidden, flat.table, flat.bias, ids,
        flat.weights,
    )
  else:
    per_token, counts = tiled.per_token_loss(call, flat.hidden, flat.table, flat.bias, ids)
    loss = inputs.reduce_losses(per_token, flat, reduction, vocab_reduction, num_items)
  if not return_stats:
    return loss
  return loss, inputs.weighted_stats(counts, flat.weights)


def use_one_pass(one_pass, reduction: str) -> bool:
  """Resolves `one_pass` (None, True, False) for `reduction`; True with "none" is an error."""
  if one_pass is None:
    return reduction != "none"
  if not isinstance(one_pass, bool):
    raise TypeError(f"one_pass must be None, True or False, got {one_pass!r}")
  if one_pass and reduction == "none":
    raise ValueError(
        "one_pass=True needs reduction 'mean' or 'sum' (with 'none' the cotangent of "
        "each position is unknown at forward time)"
    )
  return one_pass


def options_kwargs(options: LossOptions) -> dict:
  """The public keyword arguments that make `options` (for forwarding a call)."""
  return {name: getattr(options, name) for name in variants.OPTION_NAMES}


def rank_logits(kernels, hidden, table, bias, ids: sparse.SparseIds, *, plan, options,
                num_items):
  """(`[T, L]` target, `[T, E]` excluded or None) capped logits from the rank tiles.

  Computed by `kernels.rank_logits`, the same tile computation that
  `kernels.rank_counts` compares with, so that exact ties stay exact. Ids not
  in their mask come back 0.
  """
  num_targets = ids.target_ids.shape[-1]
  wanted = jnp.where(ids.target_mask, ids.target_ids, -1)
  if ids.exclude_ids is not None:
    wanted = jnp.concatenate([wanted, jnp.where(ids.exclude_mask, ids.exclude_ids, -1)], axis=1)
  picked = kernels.rank_logits(hidden, table, bias, wanted, plan=plan, num_targets=num_targets,
                               options=options, num_items=num_items)  # [T, L + E]
  if ids.exclude_ids is None:
    return picked, None
  return picked[:, :num_targets], picked[:, num_targets:]


def target_ranks(hidden, table, targets, *, bias=None, exclude=None, backend="auto", plan=None,
                 num_items=None, logit_soft_cap=None):
  """1-based rank of each target among all non-excluded items, in two tiled passes.

  rank_tl = 1 + #{v not in X_t, v != p : x_tv >= x_tp} with p = targets_tl:
  ties count against the target (a constant model ranks every target last,
  never first), other targets count like any item, a NaN target logit ranks
  after every item and a NaN item after every number. So no two targets of
  a row share a rank below theirs, and `rank_metrics` never exceeds 1. The
  targets' (and excluded ids') logits come out of the same tile computation
  as every item's, so items with identical embeddings tie exactly, as in the
  dense reference (the first pass reads those logits from the tiles, the
  second counts). No top-k and no `[T, V]` array.

  Args:
    hidden: `[..., D]`; table: `[V, D]`; targets: int `[..., L]` (padding as
      in `cut_bce`; as there, an int64 NumPy id >= 2^31 passed to a jitted
      caller with x64 off arrives already wrapped to int32, an item, not
      padding: check it on the host); bias: optional `[V]`; exclude: optional
      int `[..., E]` (the same).
    backend, plan, num_items: as in `cut_bce` (rows past `num_items` are never
      ranked).
    logit_soft_cap: c > 0 ranks by the capped logit c tanh(x / c), as a model
      trained with that cap scores items (ties the cap's float rounding makes
      count against the target, like every tie).

  Returns:
    int32 `[..., L]`; 0 for padding ids and for repeats of an earlier id in the
    same row, so that every item is counted once by `rank_metrics`.

  Example:
    >>> import jax.numpy as jnp, cutbce
    >>> hidden = jnp.ones((1, 1)); table = jnp.array([[3.0], [2.0], [1.0]])
    >>> cutbce.target_ranks(hidden, table, jnp.array([[2, 0]])).tolist()
    [[3, 1]]
  """
  inputs.check_plan(plan)
  inputs.check_choice("backend", backend, BACKEND_CHOICES)
  options = variants.make_options(logit_soft_cap=logit_soft_cap)
  flat = inputs.flatten_inputs(hidden, table, targets, None, bias, exclude)
  num_items = inputs.check_num_items(num_items, flat.table.shape[0])
  backend = resolve_backend(backend, flat, plan)
  if backend == "dense":
    return reference.dense_target_ranks(hidden, table, targets, bias=bias, exclude=exclude,
                                        num_items=num_items, logit_soft_cap=logit_soft_cap)
  hidden_, table_, bias_ = (jax.lax.stop_gradient(x) for x in (flat.hidden, flat.table, flat.bias))
  num_targets = flat.targets.shape[-1]
  check_backend_supports(backend, flat, plan)
  ids = sparse.prepare_ids(flat.targets, flat.exclude, num_items)
  kernels = kernel_module(backend)
  target_logits, exclude_logits = rank_logits(
      kernels, hidden_, table_, bias_, ids, plan=plan, options=options, num_items=num_items)
  larger = kernels.rank_counts(
      hidden_, table_, bias_, target_logits, ids.target_ids, plan=plan, options=options,
      num_items=num_items,
  )  # [T, L]
  larger = larger - sparse.excluded_above(ids, exclude_logits, target_logits)
  ranks = jnp.where(ids.target_mask, 1 + larger, 0)
  return jnp.reshape(ranks, flat.leading_shape + (num_targets,))
