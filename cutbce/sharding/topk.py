"""`sharded_top_k`: exact full-catalog top-k on a device mesh, one collective.

Tokens (hidden, exclude) are split on their leading dim over `token_axes`; the
table (and bias) by rows over `vocab_axis`, padded with zero rows to a
multiple of its size m. Inside one `jax.shard_map`:

    all_gather(hidden, exclude) over the vocab axis, if it splits tokens
    local running top-K over this shard's rows          (no collective)
        rows at or past num_items (padding and the pad to a multiple of m)
        score -inf inside the walk: real rows = clip(num_items - offset, 0,
        rows_per_shard) is a traced value, the same program runs on every shard
    ids += shard offset; locally excluded ids removed; keep k per token
    ONE collective of the [T, k] candidates (scores and ids packed into one
    int32 array): an all_to_all back to each token block's owner when the
    vocab axis also splits tokens, else an all_gather over the vocab axis
    final selection of k among m k candidates, by (score desc, id asc)

Exact: the global top-k of eligible items is contained in the union of every
shard's top-k of its eligible items, and each shard's list is exact by the
argument of `cutbce/topk.py` (K = min(k + E, rows_per_shard) candidates,
then at most E removed). Ineligible entries (excluded ids, padding rows) are
(-inf, int32 max) and sort after every real candidate, so they never come
back: k <= num_items - E guarantees k eligible items per position.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from cutbce import backends, inputs, topk
from cutbce.sharding import layout as layout_lib
from cutbce.sharding.layout import Layout


def _pack(scores, ids):
  """float32 scores and int32 ids `[..., k]` -> one int32 `[..., k, 2]` (one collective)."""
  return jnp.stack([lax.bitcast_convert_type(scores, jnp.int32), ids], axis=-1)


def _unpack(packed):
  return lax.bitcast_convert_type(packed[..., 0], jnp.float32), packed[..., 1]


def _merge_shards(layout: Layout, scores, ids):
  """`[T_group, k]` candidates of this shard -> `[T_local, m k]` of every shard.

  The single collective of the call. When the vocab axis also splits the
  tokens, token block j of every shard goes to device j (all_to_all); else
  every device of the vocab axis gathers the candidates of the same tokens.
  """
  shards, k = layout.vocab_shards, scores.shape[-1]
  packed = _pack(scores, ids)  # [T_group, k, 2]
  if layout.gathers_tokens:
    packed = packed.reshape((shards, -1) + packed.shape[1:])  # [m, T_local, k, 2]
    packed = lax.all_to_all(packed, layout.vocab_axis, 0, 0)  # [m (source), T_local, k, 2]
  else:
    packed = lax.all_gather(packed, layout.vocab_axis, axis=0)  # [m, T_local, k, 2]
  packed = jnp.moveaxis(packed, 0, 1).reshape((packed.shape[1], shards * k, 2))
  return _unpack(packed)  # [T_local, m k] each


def _local_top_k(layout: Layout, spec: topk.TopKSpec, block_v: int,
                 hidden, table, bias, exclude):
  """The shard_map body: this device's token block, all shards' best k of it."""
  if layout.vocab_shards > 1:  # (a size-1 vocab axis gathers nothing)
    hidden, exclude = layout_lib.gather_tokens(layout, hidden, exclude)  # [T_group, ...]
  if layout.vocab_shards == 1:
    # One shard holds every row: walk the first num_items statically, no mask.
    offset, num_rows, real_rows = jnp.int32(0), spec.num_items, None
  else:
    offset, _ = layout_lib.shard_rows(layout)
    num_rows = layout.rows_per_shard
    real_rows = jnp.clip(spec.num_items - offset, 0, num_rows)  # traced int32
  scores, ids = topk.running_top_k(
      hidden, table, bias, num_rows=num_rows, num_candidates=spec.num_candidates,
      block_v=block_v, soft_cap=spec.soft_cap, real_rows=real_rows,
  )  # [T_group, K] local ids
  ids = ids + offset  # global ids; shard order is id order
  eligible = (ids < spec.num_items) & ~topk.excluded(ids, exclude)
  scores, ids = topk.select(scores, ids, eligible, min(spec.k, scores.shape[-1]))
  if layout.vocab_shards == 1:
    return scores, ids  # [T_local, k]: this device saw every row
  scores, ids = _merge_shards(layout, scores, ids)  # [T_local, m k]
  # Ineligible entries are (-inf, int32 max): last in the (score, id) order.
  return topk.select(scores, ids, ids < spec.num_items, spec.k)


def sharded_top_k(
    hidden, table, k, *, mesh, token_axes=("data",), vocab_axis=None,
    bias=None, exclude=None, num_items=None, logit_soft_cap=None,
    backend="auto", plan=None,
):
  """`cutbce.top_k` on a device mesh: the same scores and global ids.

  Per position t, the top-k over v in [0, num_items) \\ X_t of
  s_tv = x_tv (or c tanh(x_tv / c)) by (s_tv desc, v asc), with
  x_tv = h_t . e_v (+ b_v) in float32; each device walks its token block
  against its vocabulary shard, and one collective merges k candidates per
  shard (see the module docstring).

  Args:
    hidden: `[B, ..., D]`, B split over `token_axes` (divisible by their size).
    table: `[V, D]`, rows split over `vocab_axis` (padded with masked zero rows
      when V is not a multiple of its size); must not be split along D.
    k, bias, exclude, num_items, logit_soft_cap: as in `cutbce.top_k`;
      exclude `[B, ..., E]` is split like `hidden`.
    mesh: a `jax.sharding.Mesh` (auto or explicit axes).
    token_axes: mesh axis name(s) splitting B, major first; () replicates tokens.
    vocab_axis: mesh axis name splitting the table's rows, or None (replicated).
      It may also be one of `token_axes`: hidden is then all-gathered over it
      before the walk and the candidates sent back by one all_to_all.
    backend: "auto", "xla", "pallas_tpu" (the tiled XLA path) or "dense" (the
      reference on the global arrays; XLA partitions it).
    plan: optional `cutbce.TilePlan`; its `block_v` tiles each shard's walk.

  Returns:
    (scores float32 `[B, ..., k]`, ids int32 `[B, ..., k]`), sorted
    descending, split like `hidden`'s leading dim.

  Raises:
    ValueError, TypeError: bad inputs as in `cutbce.top_k`, axis names not in
      the mesh, B not divisible by the token axes' size, a table split along D.

  Example:
    >>> import jax, jax.numpy as jnp, numpy as np
    >>> from jax.sharding import Mesh
    >>> mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
    >>> hidden = jnp.array([[1.0, 0.0], [0.0, 1.0]])
    >>> table = jnp.array([[3.0, 0.0], [1.0, 2.0], [3.0, 5.0], [0.0, 2.0]])
    >>> scores, ids = sharded_top_k(hidden, table, 2, mesh=mesh, vocab_axis="model")
    >>> scores.tolist(), ids.tolist()
    ([[3.0, 3.0], [5.0, 2.0]], [[0, 2], [2, 1]])
  """
  inputs.check_choice("backend", backend, backends.BACKEND_CHOICES)
  inputs.check_plan(plan)
  args = topk.check_args(
      hidden, table, k, bias=bias, exclude=exclude, num_items=num_items,
      logit_soft_cap=logit_soft_cap,
  )
  layout = layout_lib.make_layout(
      mesh, token_axes, vocab_axis, hidden_shape=jnp.shape(hidden), table=table
  )
  if backend == "dense":
    return topk.top_k(
        hidden, table, k, bias=bias, exclude=exclude, num_items=num_items,
        logit_soft_cap=logit_soft_cap, backend="dense",
    )
  num_rows = args.spec.num_items if layout.vocab_shards == 1 else layout.rows_per_shard
  block_v = plan.block_v if plan is not None else topk.default_block_v(
      layout.group_tokens(args.hidden.shape[0]), num_rows
  )
  table_, bias_ = layout_lib.pad_rows(layout, args.table, args.bias)
  token_spec = layout.token_spec
  operands = (
      (layout_lib.place(layout, args.hidden, token_spec), token_spec),
      (layout_lib.place(layout, table_, layout.table_spec), layout.table_spec),
      (layout_lib.place(layout, bias_, layout.bias_spec), layout.bias_spec),
      (layout_lib.place(layout, args.exclude, token_spec), token_spec),
  )
  present = tuple(x is not None for x, _ in operands)

  def local(*arrays):
    it = iter(arrays)
    hidden, table, bias, exclude = (next(it) if p else None for p in present)
    return _local_top_k(layout, args.spec, block_v, hidden, table, bias, exclude)

  scores, ids = jax.shard_map(
      local, mesh=layout.mesh,
      in_specs=tuple(spec for x, spec in operands if x is not None),
      out_specs=(token_spec, token_spec), check_vma=False,
  )(*(x for x, _ in operands if x is not None))
  shape = args.leading_shape + (args.spec.k,)
  return jnp.reshape(scores, shape), jnp.reshape(ids, shape)
