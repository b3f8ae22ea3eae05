"""`sharded_cut_bce` and `sharded_target_ranks`: the tiled op on a device mesh.

Tokens (hidden, targets, weights, exclude) are split on their leading dim over
`token_axes`; the table (and bias) by rows over `vocab_axis`, padded with zero
rows to a multiple of its size. Forward and backward are each one
`jax.shard_map` under a custom VJP, so every collective is written here and
none sits inside the local loop over vocabulary tiles:

    forward   all_gather(hidden, ids)  over the vocab axis, if it splits tokens
              local scan over this shard's V/m rows            (no collective)
              psum_scatter(l_t, counts) over the vocab axis    (psum if it does
                                                                not split tokens)
    backward  all_gather(hidden, ids, g_t) as above
              local scan                                       (no collective)
              psum_scatter(dh) over the vocab axis
              psum(dE, db) over the token axes other than the vocab axis

The weighted token reduction ("mean"/"sum") runs outside, in plain JAX on the
`[T]` losses, exactly as `cut_bce` does (one all-reduce placed by XLA).

Padded rows. A padded row is e_v = 0 with b_v = 0, so x_tv = h_t . 0 = 0
exactly for finite h. Its only effects are: + A phi(0) on every token's dense
sum (log 2 for plain BCE; subtracted per shard: l_t -= n_pad A phi(0), exact
up to one float32 rounding), + 0 to the linear sum of a smoothed loss, + 0 to
the positive counts (0 > 0 is false), + phi'(0) e_v = 0 to dh, rows of dE/db
that are zeroed (and sliced off by the pad's transpose), and +1 to a rank
when 0 > x_target (subtracted exactly). Counts use each shard's number of
real rows, so padded rows are never negatives. Rows the caller marks as
padding with `num_items` hold arbitrary values: each shard zeroes them first
(`layout.zero_padding_rows`), and they are then padded rows like the others.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from cutbce import api, backends, inputs, reference, sparse, tiled, variants
from cutbce.sharding import layout as layout_lib
from cutbce.sharding.layout import Layout


class _Static(NamedTuple):
  """Everything the custom VJP is traced with (hashable)."""

  layout: Layout
  call: tiled.TiledCall  # the local op; its num_items is the shard's row count
  num_targets: int  # L: the packed ids are [T, L + E].


def _pack_ids(targets, exclude, exclude_rows=None):
  """`[T, L]` targets and `[T, E]` exclude -> one int32 `[T, L + E]` (one gather).

  With `exclude_rows` (`[G, E]`, each shared by T / G consecutive tokens),
  `(targets, rows)` instead: the rows travel apart, `exclude` is not needed.
  """
  targets = targets.astype(jnp.int32)
  if exclude_rows is not None:
    return targets, exclude_rows.astype(jnp.int32)
  if exclude is None:
    return targets
  return jnp.concatenate([targets, exclude.astype(jnp.int32)], axis=-1)


def _local_ids(static: _Static, ids, offset):
  """Packed global ids -> (global `SparseIds`, `SparseIds` into this shard)."""
  ids, rows = ids if isinstance(ids, tuple) else (ids, None)
  targets, exclude = layout_lib.split_ids(ids, static.num_targets)
  # Dedup and "exclude minus targets" need the global ids: decide, then rebase.
  global_ids = sparse.prepare_ids(targets, exclude, static.layout.num_items, rows)
  return global_ids, layout_lib.rebase_ids(global_ids, offset, static.layout.rows_per_shard)


def _padded_rows(layout: Layout, real_rows):
  return layout.rows_per_shard - real_rows  # int32 scalar


def _map(layout: Layout, fn, in_specs, out_specs):
  return jax.shard_map(
      fn, mesh=layout.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False
  )


def _sweep(static: _Static, mode: str, hidden, table, bias, ids, scale=None):
  """One shard_map over the local op: "forward", "backward" or "both" (one pass).

  Returns per mode: forward (l_t `[T]`, counts `[4, T]` or None); backward
  (dh, dE, db) float32; both (l_t, counts, (dh, dE, db)). Collectives: the
  token gather before the local sweep, then the reduce-scatter (or psum) of
  l_t, counts and dh over the vocab axis and the psum of dE, db over the
  other token axes, all after it.
  """
  layout = static.layout
  with_loss, with_grads = mode in ("forward", "both"), mode in ("backward", "both")
  with_counts = with_loss and static.call.with_counts

  def local(hidden, table, bias, ids, scale):
    hidden, ids, scale = layout_lib.gather_tokens(layout, hidden, ids, scale)
    offset, real_rows = layout_lib.shard_rows(layout)
    table, bias = layout_lib.zero_padding_rows(layout, real_rows, table, bias)
    _, local_ids = _local_ids(static, ids, offset)
    if mode == "forward":
      per_token, counts = tiled.tiled_forward(
          static.call, hidden, table, bias, local_ids, counted_items=real_rows)
    elif mode == "backward":
      grads = tiled.tiled_backward(static.call, hidden, table, bias, local_ids, scale)
    else:
      per_token, counts, grads = tiled.tiled_forward_backward(
          static.call, hidden, table, bias, local_ids, scale, counted_items=real_rows)
    outputs = ()
    if with_loss:
      # Each padded row added A phi(0) to every token (its logit is exactly 0).
      padded = _padded_rows(layout, real_rows).astype(jnp.float32)
      per_token = per_token - padded * _padding_row_loss(static.call.options)
      outputs += (layout_lib.scatter_tokens(layout, per_token),)  # [T_local]
      if with_counts:
        outputs += (layout_lib.scatter_tokens(layout, jnp.stack(counts), axis=1),)  # [4, T_local]
    if with_grads:
      hidden_grad, table_grad, bias_grad = grads  # f32 [T_group, D], [V_shard, D], [V_shard]
      if layout.num_items != layout.vocab:
        # Rows past num_items get exactly zero (the dense part reached them).
        table_grad, bias_grad = layout_lib.zero_padding_rows(
            layout, real_rows, table_grad, bias_grad)
      hidden_grad = layout_lib.scatter_tokens(layout, hidden_grad)  # [T_local, D]
      if layout.table_sum_axes:
        table_grad, bias_grad = lax.psum((table_grad, bias_grad), layout.table_sum_axes)
      outputs += (hidden_grad, table_grad) + ((bias_grad,) if bias is not None else ())
    return outputs

  token_spec = layout.token_spec
  specs = (token_spec, layout.table_spec, layout.bias_spec, token_spec, token_spec)
  args = (hidden, table, bias, ids, scale)
  present = [i for i, x in enumerate(args) if x is not None]

  def fn(*arrays):
    full = [None] * len(args)
    for i, x in zip(present, arrays):
      full[i] = x
    return local(*full)

  out_specs = ()
  if with_loss:
    out_specs += (token_spec,) + ((P(None, *token_spec),) if with_counts else ())
  if with_grads:
    out_specs += (token_spec, layout.table_spec) + ((layout.bias_spec,) if bias is not None else ())
  outputs = list(_map(layout, fn, tuple(specs[i] for i in present), out_specs)(
      *(args[i] for i in present)))
  loss_part = ()
  if with_loss:
    per_token = outputs.pop(0)
    loss_part = (per_token, outputs.pop(0) if with_counts else None)
  if not with_grads:
    return loss_part
  grads = (outputs[0], outputs[1], outputs[2] if bias is not None else None)
  return loss_part + (grads,) if with_loss else grads


# --------------------------------------------------------------------------- #
# Two passes: per-token losses under one custom VJP. Ids get no cotangent.     #
# --------------------------------------------------------------------------- #


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _sharded_loss(static: _Static, hidden, table, bias, ids):
  """([T] f32 l_t in the token layout, [4, T] int32 counts or None)."""
  return _sweep(static, "forward", hidden, table, bias, ids)


def _sharded_loss_fwd(static: _Static, hidden, table, bias, ids):
  # Residuals are the (ungathered) inputs: the backward gathers hidden again
  # rather than keeping an m-times larger gathered copy alive between passes.
  out = _sweep(static, "forward", hidden, table, bias, ids)
  return out, (hidden, table, bias, ids)


def _sharded_loss_bwd(static: _Static, residuals, cotangents):
  hidden, table, bias, ids = residuals
  scale = cotangents[0].astype(jnp.float32)  # g_t, [T]; counts get none.
  scale = layout_lib.place(static.layout, scale, static.layout.token_spec)
  grads = _sweep(static, "backward", hidden, table, bias, ids, scale)
  return tiled.cast_grads(grads, hidden, table, bias) + (None,)


_sharded_loss.defvjp(_sharded_loss_fwd, _sharded_loss_bwd)


# --------------------------------------------------------------------------- #
# One pass: the reduced loss, gradients made in the forward shard_map.         #
# --------------------------------------------------------------------------- #


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _sharded_reduced(static: _Static, reduction: tiled.Reduction, hidden, table, bias, ids,
                     weights):
  """(float32 reduced loss, [4, T] counts or None), differentiated in one pass."""
  per_token, counts = _sweep(static, "forward", hidden, table, bias, ids)
  return _reduce(per_token, weights, reduction), counts


def _reduce(per_token, weights, reduction: tiled.Reduction):
  return inputs.reduce_weighted(per_token, weights, reduction.reduction, reduction.vocab_divisor)


def _sharded_reduced_fwd(static, reduction, hidden, table, bias, ids, weights):
  scale = layout_lib.place(
      static.layout, tiled.unit_cotangents(weights, reduction), static.layout.token_spec)
  per_token, counts, grads = _sweep(static, "both", hidden, table, bias, ids, scale)
  loss = _reduce(per_token, weights, reduction)
  return (loss, counts), (grads, tiled.dtype_markers(hidden, table, bias), weights)


_sharded_reduced.defvjp(_sharded_reduced_fwd, tiled.reduced_loss_bwd)


def _prepare(layout: Layout, hidden, table, bias, ids):
  """Pads the table and puts every input in its shard_map layout."""
  table, bias = layout_lib.pad_rows(layout, table, bias)
  return (
      layout_lib.place(layout, hidden, layout.token_spec),
      layout_lib.place(layout, table, layout.table_spec),
      layout_lib.place(layout, bias, layout.bias_spec),
      layout_lib.place(layout, ids, layout.token_spec),
  )


def _padding_row_loss(options):
  """What one zero row (logit exactly 0) adds to every token's loss: A phi(0)."""
  scale, _ = options.affine_coefficients()
  return scale * variants.tile_value(options, jnp.float32(0.0))


def sharded_cut_bce(
    hidden, table, targets, weights=None, *, mesh, token_axes=("data",), vocab_axis=None,
    bias=None, exclude=None, reduction="mean", vocab_reduction="mean",
    return_stats=False, backend="auto", plan=None, num_items=None, pos_weight=None,
    label_smoothing=0.0, logit_soft_cap=None, focal_gamma=None, focal_alpha=None,
    one_pass=None,
):
  """`cutbce.cut_bce` on a device mesh, collectives outside the vocabulary loop.

  Same value, stats and gradients as `cut_bce` (up to float32 summation order):

      l_t = sum_{v not in X_t} softplus(x_tv) - sum_{p in P_t} x_tp,

  with each device computing its token block against its vocabulary shard.

  Args:
    hidden: `[B, ..., D]`, B split over `token_axes` (divisible by their size).
    table: `[V, D]`, rows split over `vocab_axis` (padded with masked zero rows
      when V is not a multiple of its size); must not be split along D.
    targets: int `[B, ..., L]`; weights: optional `[B, ...]`; exclude: optional
      int `[B, ..., E]`: split like `hidden`.
    mesh: a `jax.sharding.Mesh` (auto or explicit axes).
    token_axes: mesh axis name(s) splitting B, major first; () replicates tokens.
    vocab_axis: mesh axis name splitting the table's rows, or None (replicated).
      It may also be one of `token_axes`: hidden is then all-gathered over it
      before the local op and dh reduce-scattered back after it.
    bias, exclude, reduction, vocab_reduction, return_stats, backend, plan,
      num_items, pos_weight, label_smoothing, logit_soft_cap, focal_gamma,
      focal_alpha, one_pass: as in `cut_bce`; `vocab_reduction="mean"` divides by
      `num_items` (default the caller's V). `plan` tiles the local op
      (default: each kernel's plan for the local shapes). backend="dense" runs
      the reference on the global arrays (XLA partitions).

  Returns:
    As `cut_bce`: float32 scalar, or `[B, ...]` for reduction="none" (split
    like `hidden`); with `return_stats`, `(loss, cutbce.Stats)`.

  Raises:
    ValueError, TypeError: bad inputs as in `cut_bce`, axis names not in the
      mesh, B not divisible by the token axes' size, a table split along D.

  Example:
    >>> import jax, jax.numpy as jnp, numpy as np
    >>> from jax.sharding import Mesh
    >>> mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
    >>> hidden = jnp.ones((2, 3, 4)); table = jnp.zeros((10, 4))
    >>> targets = jnp.array([[[1], [2], [-1]], [[3], [3], [4]]])
    >>> float(sharded_cut_bce(hidden, table, targets, mesh=mesh, vocab_axis="model",
    ...                       vocab_reduction="sum"))
    6.9314...
  """
  inputs.check_choice("reduction", reduction, inputs.REDUCTIONS)
  inputs.check_choice("vocab_reduction", vocab_reduction, inputs.VOCAB_REDUCTIONS)
  inputs.check_plan(plan)
  inputs.check_choice("backend", backend, backends.BACKEND_CHOICES)
  options = variants.make_options(
      pos_weight=pos_weight, label_smoothing=label_smoothing, logit_soft_cap=logit_soft_cap,
      focal_gamma=focal_gamma, focal_alpha=focal_alpha,
  )
  flat = inputs.flatten_inputs(hidden, table, targets, weights, bias, exclude)
  num_items = inputs.check_num_items(num_items, flat.table.shape[0])
  api.use_one_pass(one_pass, reduction)  # checked for every backend
  backend = backends.resolve_backend(backend, flat, plan)
  layout = layout_lib.make_layout(
      mesh, token_axes, vocab_axis, hidden_shape=jnp.shape(hidden), table=table,
      num_items=num_items,
  )
  if backend == "dense":
    return reference.dense_bce(
        hidden, table, targets, weights, bias=bias, exclude=exclude,
        reduction=reduction, vocab_reduction=vocab_reduction, return_stats=return_stats,
        num_items=num_items, **api.options_kwargs(options),
    )
  static = _Static(
      layout=layout,
      call=tiled.TiledCall(backend, plan, bool(return_stats), options, layout.rows_per_shard),
      num_targets=flat.targets.shape[-1],
  )
  args = _prepare(
      layout, flat.hidden, flat.table, flat.bias, _pack_ids(flat.targets, flat.exclude)
  )
  if api.use_one_pass(one_pass, reduction):
    divisor = num_items if vocab_reduction == "mean" else 1
    weights = layout_lib.place(layout, flat.weights, layout.token_spec)
    loss, counts = _sharded_reduced(static, tiled.Reduction(reduction, divisor), *args, weights)
  else:
    per_token, counts = _sharded_loss(static, *args)
    loss = inputs.reduce_losses(per_token, flat, reduction, vocab_reduction, num_items)
  if not return_stats:
    return loss
  return loss, inputs.weighted_stats(tuple(counts), flat.weights)


def sharded_target_ranks(
    hidden, table, targets, *, mesh, token_axes=("data",), vocab_axis=None,
    bias=None, exclude=None, backend="auto", plan=None, num_items=None, logit_soft_cap=None,
):
  """`cutbce.target_ranks` on a device mesh: int32 `[B, ..., L]`, 0 for padding.

  rank_tl = 1 + #{v not in X_t, v != p : x_tv >= x_tp} (the tie rule of
  `target_ranks`). Each target's logit is computed by the rank tiles of the
  shard owning its row and psummed over the vocab axis (zeros elsewhere, so
  exact), every shard counts its logits at or above it in one local tiled
  pass, and the counts are summed over the vocab axis.

  Args:
    hidden, table, targets, bias, exclude, backend, plan, num_items,
      logit_soft_cap: as in `target_ranks`.
    mesh, token_axes, vocab_axis: as in `sharded_cut_bce`.

  Returns:
    int32 `[B, ..., L]` split like `targets`.

  Raises:
    ValueError, TypeError: as `sharded_cut_bce`.
  """
  inputs.check_plan(plan)
  inputs.check_choice("backend", backend, backends.BACKEND_CHOICES)
  options = variants.make_options(logit_soft_cap=logit_soft_cap)
  flat = inputs.flatten_inputs(hidden, table, targets, None, bias, exclude)
  num_items = inputs.check_num_items(num_items, flat.table.shape[0])
  backend = backends.resolve_backend(backend, flat, plan)
  layout = layout_lib.make_layout(
      mesh, token_axes, vocab_axis, hidden_shape=jnp.shape(hidden), table=table,
      num_items=num_items,
  )
  if backend == "dense":
    return reference.dense_target_ranks(hidden, table, targets, bias=bias, exclude=exclude,
                                        num_items=num_items, logit_soft_cap=logit_soft_cap)
  num_targets = flat.targets.shape[-1]
  static = _Static(
      layout=layout,
      call=tiled.TiledCall(backend, plan, False, options, layout.rows_per_shard),
      num_targets=num_targets,
  )
  hidden_, table_, bias_ = (
      lax.stop_gradient(x) if x is not None else None
      for x in (flat.hidden, flat.table, flat.bias)
  )
  args = _prepare(layout, hidden_, table_, bias_, _pack_ids(flat.targets, flat.exclude))
  ranks = _ranks(static, *args)  # [T, L]
  return jnp.reshape(ranks, flat.leading_shape + (num_targets,))


def _ranks(static: _Static, hidden, table, bias, ids):
  layout = static.layout
  call = static.call
  kernels = backends.kernel_module(call.backend)

  def local(hidden, table, bias, ids):
    hidden, ids = layout_lib.gather_tokens(layout, hidden, ids)
    offset, real_rows = layout_lib.shard_rows(layout)
    table, bias = layout_lib.zero_padding_rows(layout, real_rows, table, bias)
    global_ids, local_ids = _local_ids(static, ids, offset)
    # From the rank tiles themselves (every shard's tiles alike), so exact
    # ties stay exact across shards too.
    target_logits, exclude_logits = api.rank_logits(
        kernels, hidden, table, bias, local_ids, plan=call.plan, options=call.options,
        num_items=call.num_items)
    # x_tp lives on the shard that owns row p; the others add 0, so exact.
    target_logits = jnp.where(local_ids.target_mask, target_logits, 0.0)  # [T_group, L]
    if layout.vocab_axis is not None:
      target_logits = lax.psum(target_logits, layout.vocab_axis)
    # -1 matches no local column: only the owning shard leaves out x_tp itself.
    own_ids = jnp.where(local_ids.target_mask, local_ids.target_ids, -1)
    larger = kernels.rank_counts(
        hidden, table, bias, target_logits, own_ids, plan=call.plan, options=call.options,
        num_items=call.num_items,
    )  # [T_group, L]
    larger = larger - sparse.excluded_above(local_ids, exclude_logits, target_logits)
    # Padded rows have logit exactly cap(0) = 0: counted wherever 0 >= x_target
    # (or x_target is NaN).
    padded = _padded_rows(layout, real_rows)
    counted_padding = (target_logits <= 0) | jnp.isnan(target_logits)
    larger = larger - padded * counted_padding.astype(jnp.int32)
    larger = layout_lib.scatter_tokens(layout, larger)  # [T_local, L]
    target_mask = layout_lib.own_block(layout, global_ids.target_mask)
    return jnp.where(target_mask, 1 + larger, 0)

  token_spec = layout.token_spec
  in_specs = (token_spec, layout.table_spec, layout.bias_spec, token_spec)
  if bias is None:
    fn = lambda hidden, table, ids: local(hidden, table, None, ids)  # noqa: E731
    return _map(layout, fn, in_specs[:2] + in_specs[3:], token_spec)(hidden, table, ids)
  return _map(layout, local, in_specs, token_spec)(hidden, table, bias, ids)
