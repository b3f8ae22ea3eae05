"""The public door: `cut_bce` and `target_ranks`.

Each call validates its arguments, flattens the leading dims to T tokens, picks
a backend from `BACKENDS` and runs it. Tiled backends (`xla`, `pallas_tpu`)
share one custom VJP here: the backend computes the dense background over
vocabulary tiles, `cutbce.sparse` the corrections at target and excluded ids.
"""

from __future__ import annotations

import functools
import importlib
import types
from typing import Callable

import jax
import jax.numpy as jnp

from cutbce import inputs, reference, sparse
from cutbce.kernels.tiling import TilePlan

# Backend name -> module path of a kernel set honouring the contract written in
# `cutbce/kernels/xla.py` (forward, backward, rank_counts, default_plan).
# "dense" is the materializing reference and takes no kernel set.
BACKENDS: types.MappingProxyType = types.MappingProxyType({
    "xla": "cutbce.kernels.xla",
    "pallas_tpu": "cutbce.kernels.tpu",
    "dense": None,
})
BACKEND_CHOICES = ("auto",) + tuple(BACKENDS)


def resolve_backend(backend: str, flat: inputs.Flat | None = None) -> str:
  """Maps "auto" to a concrete backend name: Pallas on TPU, XLA elsewhere.

  With `flat` inputs, "auto" picks Pallas only where its kernels take them
  (dtype, shapes, a tile plan that fits VMEM), so it never picks a path that
  would fail; an explicitly named backend that cannot take them raises
  `NotImplementedError` (see `check_backend_supports`).
  """
  inputs.check_choice("backend", backend, BACKEND_CHOICES)
  if backend != "auto":
    return backend
  if jax.default_backend() == "tpu" and _kernel_module_available("pallas_tpu"):
    if flat is None or _unsupported_reason("pallas_tpu", flat) is None:
      return "pallas_tpu"
  return "xla"


def _unsupported_reason(backend: str, flat: inputs.Flat, plan: TilePlan | None = None) -> str | None:
  """Why `backend`'s kernels cannot take `flat`, or None (kernel sets without a check take all)."""
  if BACKENDS[backend] is None:
    return None
  check = getattr(kernel_module(backend), "unsupported_reason", None)
  if check is None:
    return None
  hidden, table = flat.hidden, flat.table
  return check(
      hidden.shape[0], table.shape[0], table.shape[1], hidden.dtype, table.dtype, plan
  )


def check_backend_supports(backend: str, flat: inputs.Flat, plan: TilePlan | None = None) -> None:
  """Raises `NotImplementedError` naming the reason when `backend` cannot take `flat`.

  With a `plan` given, only the inputs are checked, not whether a plan fits.
  """
  reason = _unsupported_reason(backend, flat, plan)
  if reason is not None:
    raise NotImplementedError(f"backend {backend!r} cannot run these inputs: {reason}")


def _kernel_module_available(name: str) -> bool:
  try:
    kernel_module(name)
  except ImportError:
    return False
  return True


def kernel_module(name: str):
  """The kernel set (module) of a tiled backend name, e.g. `cutbce.kernels.xla`."""
  return importlib.import_module(BACKENDS[name])


# --------------------------------------------------------------------------- #
# The tiled loss: per-token l_t with a custom VJP. Weights and reductions are  #
# applied outside by plain JAX, so the cotangent reaching `_bwd` is g_t.       #
# --------------------------------------------------------------------------- #


def tiled_forward(backend, plan, with_counts, hidden, table, bias, ids, vocab):
  """Per-token losses of one tiled backend on flat inputs, no custom VJP.

  Args:
    backend: a tiled backend name ("xla", "pallas_tpu").
    plan: the `TilePlan` for these shapes.
    with_counts: also return per-token confusion counts.
    hidden: `[T, D]`; table: `[V, D]`; bias: `[V]` or None.
    ids: `sparse.SparseIds` into `table`'s rows.
    vocab: items counted as negatives by the counts (usually V; a shard of a
      padded table passes its number of real rows).

  Returns:
    (`[T]` float32 l_t, `sparse.TokenCounts` or None).
  """
  kernels = kernel_module(backend)
  softplus_sum, positive_count = kernels.forward(
      hidden, table, bias, plan=plan, with_counts=with_counts
  )
  logits = sparse.sparse_logits(hidden, table, bias, ids)
  per_token = softplus_sum + sparse.loss_correction(ids, logits)
  counts = None
  if with_counts:
    counts = sparse.token_counts(ids, logits, positive_count, vocab)
  return per_token, counts


def tiled_backward(backend, plan, hidden, table, bias, ids, scale):
  """Gradients of sum_t scale_t l_t on flat inputs, all float32.

  Returns:
    (dh `[T, D]`, dE `[V, D]`, db `[V]` or None), float32, not yet cast to
    the input dtypes (a sharded caller sums them across devices first).
  """
  logits = sparse.sparse_logits(hidden, table, bias, ids)
  all_ids, coefficients = sparse.logit_cotangents(ids, logits, scale)
  hidden_grad, table_grad, bias_grad = sparse.sparse_grads(
      hidden, table, bias is not None, all_ids, coefficients
  )
  dense_hidden_grad, table_grad, bias_grad = kernel_module(backend).backward(
      hidden, table, bias, scale, table_grad, bias_grad, plan=plan
  )
  return hidden_grad + dense_hidden_grad, table_grad, bias_grad


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _tiled_loss(backend, plan, with_counts, hidden, table, bias, ids):
  """`[T]` float32 losses l_t (and per-token counts) of one tiled backend."""
  return tiled_forward(
      backend, plan, with_counts, hidden, table, bias, ids, table.shape[0]
  )


def _tiled_loss_fwd(backend, plan, with_counts, hidden, table, bias, ids):
  # Residuals are the inputs only; the backward recomputes every logit tile.
  out = _tiled_loss(backend, plan, with_counts, hidden, table, bias, ids)
  return out, (hidden, table, bias, ids)


def _tiled_loss_bwd(backend, plan, with_counts, residuals, cotangents):
  del with_counts
  hidden, table, bias, ids = residuals
  scale = cotangents[0].astype(jnp.float32)  # g_t, [T]; counts get none.
  hidden_grad, table_grad, bias_grad = tiled_backward(
      backend, plan, hidden, table, bias, ids, scale
  )
  hidden_grad = hidden_grad.astype(hidden.dtype)
  table_grad = table_grad.astype(table.dtype)
  if bias is not None:
    bias_grad = bias_grad.astype(bias.dtype)
  # Ids get no cotangent (None = zero for every leaf).
  return hidden_grad, table_grad, bias_grad, None


_tiled_loss.defvjp(_tiled_loss_fwd, _tiled_loss_bwd)


def default_plan(backend: str, num_tokens: int, vocab: int, dim: int, dtype) -> TilePlan:
  """The tiled backend's own plan for `[num_tokens, dim]` tokens against `vocab` rows."""
  return kernel_module(backend).default_plan(num_tokens, vocab, dim, dtype)


def _resolve_plan(backend: str, plan: TilePlan | None, flat: inputs.Flat, num_rows: int):
  if plan is not None:
    return plan
  hidden, table = flat.hidden, flat.table
  return default_plan(
      backend, num_rows, table.shape[0], table.shape[1],
      jnp.result_type(hidden.dtype, table.dtype),
  )


def cut_bce(
    hidden, table, targets, weights=None, *, bias=None, exclude=None,
    reduction="mean", vocab_reduction="mean", return_stats=False,
    backend="auto", plan=None,
):
  """Multi-label binary cross-entropy over the whole catalog, without `[T, V]` logits.

  With x_tv = h_t . e_v (+ b_v), P_t the valid deduplicated targets and X_t the
  excluded ids that are not targets, position t's loss is

      l_t = sum_{v not in X_t} softplus(x_tv) - sum_{p in P_t} x_tp,

  exactly BCE(x, y) = softplus(x) - y x summed over the catalog, computed as a
  tiled dense background plus sparse corrections. Accumulation is float32.

  Args:
    hidden: `[..., D]` float32 or bfloat16 hidden states (usually `[B, N, D]`).
    table: `[V, D]` item table.
    targets: int `[..., L]` positive ids; any id outside [0, V) is padding
      (use -1); an id repeated in a row counts once.
    weights: optional float `[...]` per position; 0 drops a position.
    bias: optional `[V]` per-item bias.
    exclude: optional int `[..., E]` ids that are neither positives nor
      negatives for their position (ids that are also targets stay targets).
    reduction: "mean" (sum_t w_t l_t / sum_t w_t, 0 when all weights are 0),
      "sum", or "none" (w_t l_t with the leading shape).
    vocab_reduction: "mean" divides l_t by V (the Keras convention), "sum" not.
    return_stats: also return a `cutbce.Stats` of weighted confusion counts
      at logit > 0 (excluded ids count in none).
    backend: "auto" (Pallas on TPU, XLA elsewhere), "xla", "pallas_tpu"
      (interpret mode off-TPU), or "dense" (the materializing reference).
    plan: optional `cutbce.TilePlan` overriding the tile sizes.

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
  """
  inputs.check_choice("reduction", reduction, inputs.REDUCTIONS)
  inputs.check_choice("vocab_reduction", vocab_reduction, inputs.VOCAB_REDUCTIONS)
  inputs.check_plan(plan)
  inputs.check_choice("backend", backend, BACKEND_CHOICES)
  flat = inputs.flatten_inputs(hidden, table, targets, weights, bias, exclude)
  backend = resolve_backend(backend, flat)
  if backend == "dense":
    return reference.dense_bce(
        hidden, table, targets, weights, bias=bias, exclude=exclude,
        reduction=reduction, vocab_reduction=vocab_reduction,
        return_stats=return_stats,
    )
  check_backend_supports(backend, flat, plan)
  plan = _resolve_plan(backend, plan, flat, flat.hidden.shape[0])
  ids = sparse.prepare_ids(flat.targets, flat.exclude, flat.table.shape[0])
  per_token, counts = _tiled_loss(
      backend, plan, bool(return_stats), flat.hidden, flat.table, flat.bias, ids
  )
  loss = inputs.reduce_losses(per_token, flat, reduction, vocab_reduction)
  if not return_stats:
    return loss
  return loss, inputs.weighted_stats(counts, jax.lax.stop_gradient(flat.weights))


def target_ranks(hidden, table, targets, *, bias=None, exclude=None, backend="auto", plan=None):
  """1-based rank of each target among all non-excluded items, in one tiled pass.

  rank_tl = 1 + #{v not in X_t : x_tv > x_{t, targets_tl}}: ties are resolved
  in the target's favour, other targets count like any item. No top-k and no
  `[T, V]` array.

  Args:
    hidden: `[..., D]`; table: `[V, D]`; targets: int `[..., L]` (padding as
      in `cut_bce`); bias: optional `[V]`; exclude: optional int `[..., E]`.
    backend, plan: as in `cut_bce`.

  Returns:
    int32 `[..., L]`; 0 for padding ids and for repeats of an earlier id in the
    same row, so that every item is counted once by `rank_metrics`.
  """
  inputs.check_plan(plan)
  inputs.check_choice("backend", backend, BACKEND_CHOICES)
  flat = inputs.flatten_inputs(hidden, table, targets, None, bias, exclude)
  backend = resolve_backend(backend, flat)
  if backend == "dense":
    return reference.dense_target_ranks(hidden, table, targets, bias=bias, exclude=exclude)
  hidden_, table_, bias_ = (jax.lax.stop_gradient(x) for x in (flat.hidden, flat.table, flat.bias))
  num_targets = flat.targets.shape[-1]
  check_backend_supports(backend, flat, plan)
  plan = _resolve_plan(backend, plan, flat, flat.hidden.shape[0] * num_targets)
  ids = sparse.prepare_ids(flat.targets, flat.exclude, table_.shape[0])
  logits = sparse.sparse_logits(hidden_, table_, bias_, ids)
  larger = kernel_module(backend).rank_counts(
      hidden_, table_, bias_, logits.target, ids.target_ids, plan=plan
  )  # [T, L]
  larger = larger - sparse.excluded_above(ids, logits.exclude, logits.target)
  ranks = jnp.where(ids.target_mask, 1 + larger, 0)
  return jnp.reshape(ranks, flat.leading_shape + (num_targets,))
