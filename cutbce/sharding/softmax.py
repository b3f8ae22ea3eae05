"""`sharded_cut_softmax_ce`: the cut softmax cross-entropy on a device mesh.

The same placement as `sharded_cut_bce` (tokens over `token_axes`, table rows
over `vocab_axis`, padded to a multiple of its size), one `shard_map` per pass
under a custom VJP, every collective outside the local tile loop:

    forward   all_gather(hidden, ids)              over the vocab axis, if it splits tokens
              local sweep: (max, sum exp) per token over this shard's rows  (no collective)
              pmax(max), psum(sum exp(max - pmax), target logits)  over the vocab axis:
                                                     lse_t, 1 - p_tp and the backward's
                                                     (top_t, total_t), all shards
              psum_scatter(linear part, counts)      over the vocab axis
    backward  all_gather(hidden, ids, g_t, top_t, total_t, 1 - p_tp)  as above
              local sweep                                                   (no collective)
              psum_scatter(dh) over the vocab axis; psum(dE, db) over the other token axes

Padding rows (the even split's, and rows at or past `num_items`) are masked
inside each tile by the shard's count of real rows, never subtracted after
the sweep: a softmax over logits far below 0 would otherwise lose its real
items to a padded row's exp(0).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from cutbce import inputs, reference, sparse, softmax
from cutbce.kernels import numerics
from cutbce.sharding import layout as layout_lib
from cutbce.sharding.shard_map import _local_ids, _map, _pack_ids, _prepare, _Static


def _forward_map(static: _Static, hidden, table, bias, ids):
  """One shard_map: (l_t `[T]`, counts `[4, T]` or None, residuals), in the token layout.

  The residuals: the backward's (top_t, total_t) (`softmax.Normalizer`) and 1 - p_tp.
  """
  layout, call = static.layout, static.call

  def local(hidden, table, bias, ids):
    hidden, ids = layout_lib.gather_tokens(layout, hidden, ids)
    offset, real_rows = layout_lib.shard_rows(layout)
    table, bias = layout_lib.zero_padding_rows(layout, real_rows, table, bias)
    global_ids, local_ids = _local_ids(static, ids, offset)
    coeffs = softmax.coefficients(call, global_ids)
    part = softmax.local_forward(call, hidden, table, bias, local_ids, coeffs,
                                 valid_rows=real_rows)
    row_max, row_sum = part.row_max, part.row_sum
    # Each target's logit, from the shard that owns its row (0 elsewhere).
    target_logits = jnp.where(local_ids.target_mask, part.logits.target, 0.0)
    if layout.vocab_axis is not None:
      top = lax.pmax(row_max, layout.vocab_axis)
      row_sum = lax.psum(row_sum * numerics.exp(row_max - top), layout.vocab_axis)
      row_max = top
      target_logits = lax.psum(target_logits, layout.vocab_axis)
    sweep = (row_max, row_sum, target_logits, global_ids.target_mask,
             softmax.separated_targets(call, global_ids))
    lse, complement = softmax.partition(*sweep)
    lse, complement, top, total = (layout_lib.own_block(layout, x)
                                   for x in (lse, complement, *softmax.normalizer(*sweep)))
    linear = layout_lib.scatter_tokens(layout, part.linear)
    own = softmax.Coefficients(*(layout_lib.own_block(layout, c) for c in coeffs))
    outputs = (softmax.per_token_losses(own, lse, linear), top, total, complement)
    if call.with_counts:
      counts = sparse.token_counts(local_ids, part.logits, part.positive_count, real_rows)
      outputs += (layout_lib.scatter_tokens(layout, jnp.stack(counts), axis=1),)
    return outputs

  token_spec = layout.token_spec
  out_specs = (token_spec,) * 4 + (
      (jax.sharding.PartitionSpec(None, *token_spec),) if call.with_counts else ())
  if bias is None:
    fn = lambda hidden, table, ids: local(hidden, table, None, ids)  # noqa: E731
    outputs = _map(layout, fn, (token_spec, layout.table_spec, token_spec), out_specs)(
        hidden, table, ids)
  else:
    outputs = _map(layout, local, (token_spec, layout.table_spec, layout.bias_spec, token_spec),
                   out_specs)(hidden, table, bias, ids)
  per_token, top, total, complement = outputs[:4]
  return per_token, (outputs[4] if call.with_counts else None), (top, total, complement)


def _backward_map(static: _Static, hidden, table, bias, ids, scale, top, total, complement):
  """One shard_map: float32 (dh, dE, db) of sum_t scale_t l_t."""
  layout, call = static.layout, static.call

  def local(hidden, table, bias, ids, scale, top, total, complement):
    hidden, ids, scale, top, total, complement = layout_lib.gather_tokens(
        layout, hidden, ids, scale, top, total, complement)
    offset, real_rows = layout_lib.shard_rows(layout)
    table, bias = layout_lib.zero_padding_rows(layout, real_rows, table, bias)
    global_ids, local_ids = _local_ids(static, ids, offset)
    coeffs = softmax.coefficients(call, global_ids)
    # The complement's columns follow the global targets; a shard sets only its own.
    whole = ((lambda mass: mass) if layout.vocab_axis is None
             else functools.partial(lax.psum, axis_name=layout.vocab_axis))
    hidden_grad, table_grad, bias_grad = softmax.local_backward(
        call, hidden, table, bias, local_ids, coeffs, softmax.Normalizer(top, total),
        complement, scale, valid_rows=real_rows,
        rescale=softmax.Rescale(whole, global_ids.target_mask))
    hidden_grad = layout_lib.scatter_tokens(layout, hidden_grad)
    if layout.table_sum_axes:
      table_grad, bias_grad = lax.psum((table_grad, bias_grad), layout.table_sum_axes)
    return (hidden_grad, table_grad) + ((bias_grad,) if bias is not None else ())

  token_spec = layout.token_spec
  out_specs = (token_spec, layout.table_spec) + ((layout.bias_spec,) if bias is not None else ())
  if bias is None:
    fn = lambda hidden, table, ids, *rest: local(hidden, table, None, ids, *rest)  # noqa: E731
    grads = _map(layout, fn, (token_spec, layout.table_spec) + (token_spec,) * 5,
                 out_specs)(hidden, table, ids, scale, top, total, complement)
    return grads[0], grads[1], None
  grads = _map(layout, local, (token_spec, layout.table_spec, layout.bias_spec)
               + (token_spec,) * 5, out_specs)(hidden, table, bias, ids, scale, top, total,
                                               complement)
  return grads[0], grads[1], grads[2]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _sharded_ce(static: _Static, hidden, table, bias, ids):
  """([T] f32 l_t in the token layout, [4, T] int32 counts or None)."""
  per_token, counts, _ = _forward_map(static, hidden, table, bias, ids)
  return per_token, counts


def _sharded_ce_fwd(static: _Static, hidden, table, bias, ids):
  per_token, counts, norm = _forward_map(static, hidden, table, bias, ids)
  # Residuals: the ungathered inputs, (top_t, total_t) and 1 - p_tp; the
  # backward gathers again.
  return (per_token, counts), (hidden, table, bias, ids, *norm)


def _sharded_ce_bwd(static: _Static, residuals, cotangents):
  hidden, table, bias, ids, top, total, complement = residuals
  scale = layout_lib.place(static.layout, cotangents[0].astype(jnp.float32),
                           static.layout.token_spec)
  hidden_grad, table_grad, bias_grad = _backward_map(static, hidden, table, bias, ids, scale,
                                                     top, total, complement)
  return (hidden_grad.astype(hidden.dtype), table_grad.astype(table.dtype),
          None if bias is None else bias_grad.astype(bias.dtype), None)


_sharded_ce.defvjp(_sharded_ce_fwd, _sharded_ce_bwd)


def sharded_cut_softmax_ce(
    hidden, table, targets, weights=None, *, mesh, token_axes=("data",), vocab_axis=None,
    bias=None, exclude=None, num_items=None, reduction="mean", label_smoothing=0.0,
    target_reduction="sum", return_stats=False, backend="auto", plan=None,
):
  """`cutbce.cut_softmax_ce` on a device mesh, collectives outside the vocabulary loop.

  Same value, stats and gradients as `cut_softmax_ce` (up to float32
  summation order). The log-sum-exp of each token is combined across the
  vocab shards with one max and one sum of the shards' (max, sum exp) pairs.

  Args:
    hidden, table, targets, weights, mesh, token_axes, vocab_axis, bias,
      exclude, num_items, reduction, return_stats, plan: as in
      `sharded_cut_bce`.
    label_smoothing, target_reduction, backend: as in `cut_softmax_ce`
      ("dense" runs the reference on the global arrays; XLA partitions it).

  Returns:
    As `cut_softmax_ce`: float32 scalar, or `[B, ...]` for reduction="none"
    (split like `hidden`); with `return_stats`, `(loss, cutbce.Stats)`.

  Raises:
    ValueError, TypeError: bad inputs as in `cut_softmax_ce`, axis names not
      in the mesh, B not divisible by the token axes' size, a table split
      along D.
  """
  inputs.check_choice("reduction", reduction, inputs.REDUCTIONS)
  inputs.check_plan(plan)
  label_smoothing = softmax.check_options(target_reduction, label_smoothing)
  flat = inputs.flatten_inputs(hidden, table, targets, weights, bias, exclude)
  num_items = inputs.check_num_items(num_items, flat.table.shape[0])
  backend = softmax.softmax_backend(backend, flat, plan)
  layout = layout_lib.make_layout(
      mesh, token_axes, vocab_axis, hidden_shape=jnp.shape(hidden), table=table,
      num_items=num_items,
  )
  if backend == "dense":
    return reference.dense_softmax_ce(
        hidden, table, targets, weights, bias=bias, exclude=exclude, num_items=num_items,
        reduction=reduction, label_smoothing=label_smoothing,
        target_reduction=target_reduction, return_stats=return_stats)
  call = softmax.SoftmaxCall(backend, plan, bool(return_stats), label_smoothing,
                             target_reduction, layout.rows_per_shard, num_items)
  static = _Static(layout=layout, call=call, num_targets=flat.targets.shape[-1])
  args = _prepare(layout, flat.hidden, flat.table, flat.bias,
                  _pack_ids(flat.targets, flat.exclude, flat.exclude_rows))
  per_token, counts = _sharded_ce(static, *args)
  loss = inputs.reduce_weighted(per_token, flat.weights, reduction, 1, flat.leading_shape)
  if not return_stats:
    return loss
  return loss, inputs.weighted_stats(tuple(counts), flat.weights)
