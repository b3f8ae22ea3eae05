"""Where tokens and vocabulary rows live on the mesh, and the per-shard id view.

A `Layout` is the static description one sharded call is traced with: the
mesh, the axes splitting the tokens, the axis splitting the table's rows, the
global V and the padded V. The helpers below run inside `jax.shard_map` and
turn a device's blocks into the inputs of the local op:

    tokens  [T_local, ...]  --all_gather(vocab axis)-->  [T_group, ...]
    ids     global, deduplicated, "exclude minus targets" decided globally,
            then rebased to the shard: local = global - offset, ids of other
            shards masked out.

T_local = T / prod(token axis sizes); T_group = T_local * m when the vocab axis
(size m) also splits the tokens, else T_local. V_shard = V_padded / m.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from cutbce import sparse


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Layout:
  """Static placement of one sharded call (hashable: it is a static argument).

  Attributes:
    mesh: the device mesh.
    token_axes: mesh axes splitting the leading (token) dimension, major first.
    vocab_axis: mesh axis splitting the table's rows, or None (replicated).
    vocab: the caller's V (the table's rows).
    padded_vocab: V rounded up to a multiple of the vocab axis size.
    num_items: the rows that are items (<= V); rows past it are padding.
  """

  mesh: Mesh
  token_axes: tuple[str, ...]
  vocab_axis: str | None
  vocab: int
  padded_vocab: int
  num_items: int

  @property
  def vocab_shards(self) -> int:
    return 1 if self.vocab_axis is None else self.mesh.shape[self.vocab_axis]

  @property
  def rows_per_shard(self) -> int:
    return self.padded_vocab // self.vocab_shards

  @property
  def token_shards(self) -> int:
    size = 1
    for axis in self.token_axes:
      size *= self.mesh.shape[axis]
    return size

  @property
  def gathers_tokens(self) -> bool:
    """True when the vocab axis also splits the tokens (all-gather before the loop)."""
    return self.vocab_axis is not None and self.vocab_axis in self.token_axes

  @property
  def table_sum_axes(self) -> tuple[str, ...]:
    """Axes whose devices hold different tokens for the same rows: dE is psummed over them."""
    return tuple(axis for axis in self.token_axes if axis != self.vocab_axis)

  def group_tokens(self, num_tokens: int) -> int:
    """Tokens each device runs the local op on (T_group)."""
    local = num_tokens // self.token_shards
    return local * self.vocab_shards if self.gathers_tokens else local

  @property
  def token_spec(self) -> P:
    return P(self.token_axes or None)

  @property
  def table_spec(self) -> P:
    return P(self.vocab_axis, None)

  @property
  def bias_spec(self) -> P:
    return P(self.vocab_axis)


def _axis_tuple(name: str, value) -> tuple[str, ...]:
  if isinstance(value, str):
    return (value,)
  if isinstance(value, (tuple, list)) and all(isinstance(a, str) for a in value):
    return tuple(value)
  raise TypeError(f"{name} must be a mesh axis name or a tuple of names, got {value!r}")


def _table_dim_is_sharded(table) -> bool:
  """Whether the table arrives split along D (concrete arrays and explicit meshes)."""
  if isinstance(table, jax.Array) and not isinstance(table, jax.core.Tracer):
    sharding = table.sharding
    return sharding.shard_shape(table.shape)[1] != table.shape[1]
  sharding = getattr(jax.typeof(table), "sharding", None)
  spec = getattr(sharding, "spec", None)
  return spec is not None and len(spec) > 1 and spec[1] is not None


def make_layout(mesh, token_axes, vocab_axis, *, hidden_shape, table, num_items=None) -> Layout:
  """Checks the mesh arguments against the inputs and returns the `Layout`.

  Raises:
    TypeError: `mesh` is not a `jax.sharding.Mesh`, or an axis argument has
      the wrong type (the vocab axis is one name, not a tuple).
    ValueError: an axis is not in the mesh or is repeated, the leading dim of
      `hidden` is not divisible by the token axes' size, or the table is
      sharded along D.
  """
  if not isinstance(mesh, Mesh):
    raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
  token_axes = _axis_tuple("token_axes", token_axes)
  names = tuple(mesh.axis_names)
  for axis in token_axes:
    if axis not in names:
      raise ValueError(f"token_axes {token_axes}: axis {axis!r} is not in the mesh axes {names}")
  if len(set(token_axes)) != len(token_axes):
    raise ValueError(f"token_axes {token_axes} names an axis twice")
  if vocab_axis is not None:
    if not isinstance(vocab_axis, str):
      raise TypeError(
          f"vocab_axis must be one mesh axis name or None, got {vocab_axis!r} "
          "(the table's rows are split over a single axis)"
      )
    if vocab_axis not in names:
      raise ValueError(f"vocab_axis {vocab_axis!r} is not in the mesh axes {names}")
  vocab = table.shape[0]
  shards = 1 if vocab_axis is None else mesh.shape[vocab_axis]
  layout = Layout(
      mesh=mesh, token_axes=token_axes, vocab_axis=vocab_axis, vocab=vocab,
      padded_vocab=-(-vocab // shards) * shards,
      num_items=vocab if num_items is None else num_items,
  )
  batch = hidden_shape[0]
  if batch % layout.token_shards:
    sizes = {axis: mesh.shape[axis] for axis in token_axes}
    raise ValueError(
        f"hidden leading dim {batch} (shape {tuple(hidden_shape)}) is not divisible by "
        f"the token axes {sizes} of total size {layout.token_shards}"
    )
  if _table_dim_is_sharded(table):
    raise ValueError(
        f"table (shape {tuple(table.shape)}) is sharded along D; shard its rows over "
        "vocab_axis or replicate it (a D-split table needs a psum of every logit "
        "tile, a collective inside the vocabulary loop)"
    )
  return layout


def place(layout: Layout, x, spec: P):
  """Puts `x` in the layout `spec` before a shard_map.

  On a mesh with explicit axes, shard_map only takes inputs already in its
  in_specs, so `x` is resharded (a no-op when it is already there); on an
  auto mesh shard_map reshards by itself.
  """
  if all(t == AxisType.Explicit for t in layout.mesh.axis_types):
    return jax.tree.map(lambda leaf: jax.reshard(leaf, NamedSharding(layout.mesh, spec)), x)
  return x


# --------------------------------------------------------------------------- #
# Inside the shard_map.                                                       #
# --------------------------------------------------------------------------- #


def gather_tokens(layout: Layout, *arrays):
  """All-gathers token blocks over the vocab axis when it also splits the tokens."""
  if not layout.gathers_tokens:
    return arrays
  return tuple(
      jax.tree.map(lambda leaf: lax.all_gather(leaf, layout.vocab_axis, axis=0, tiled=True), x)
      for x in arrays
  )


def scatter_tokens(layout: Layout, x, *, axis: int = 0):
  """Sums per-device partials over the vocab axis, back in the token layout.

  A reduce-scatter when the vocab axis also split the tokens (the inverse of
  `gather_tokens`), a psum when it did not, nothing without a vocab axis.
  """
  if layout.vocab_axis is None:
    return x
  if layout.gathers_tokens:
    return lax.psum_scatter(x, layout.vocab_axis, scatter_dimension=axis, tiled=True)
  return lax.psum(x, layout.vocab_axis)


def own_block(layout: Layout, x, *, axis: int = 0):
  """This device's token block of a gathered array (the inverse of the gather)."""
  if not layout.gathers_tokens:
    return x
  size = x.shape[axis] // layout.vocab_shards
  start = lax.axis_index(layout.vocab_axis) * size
  return lax.dynamic_slice_in_dim(x, start, size, axis=axis)


def shard_rows(layout: Layout):
  """(offset, real_rows) of this device's vocab shard, int32 scalars.

  Rows [offset, offset + rows_per_shard) of the padded table live here; the
  first `real_rows` of them are items (global row < `num_items`), the rest
  padding.
  """
  if layout.vocab_axis is None:
    return jnp.int32(0), jnp.int32(layout.num_items)
  offset = lax.axis_index(layout.vocab_axis).astype(jnp.int32) * layout.rows_per_shard
  real_rows = jnp.clip(layout.num_items - offset, 0, layout.rows_per_shard)
  return offset, real_rows


def pad_rows(layout: Layout, table, bias):
  """Zero rows (and zero bias) from V up to `padded_vocab`, so the vocab axis splits evenly."""
  extra = layout.padded_vocab - layout.vocab
  if not extra:
    return table, bias
  table = jnp.pad(table, ((0, extra), (0, 0)))
  if bias is not None:
    bias = jnp.pad(bias, (0, extra))
  return table, bias


def zero_padding_rows(layout: Layout, real_rows, table, bias):
  """This shard's table and bias with rows at or past `real_rows` set to 0.

  Only needed when the caller's table holds rows past `num_items` (rows
  added by `make_layout`'s padding are zeros already); then each shard makes
  one masked copy of its rows, so that every padding row has logit exactly 0.
  """
  if layout.num_items == layout.vocab:
    return table, bias
  rows = lax.broadcasted_iota(jnp.int32, (table.shape[0], 1), 0)
  table = jnp.where(rows < real_rows, table, jnp.zeros_like(table))
  if bias is not None:
    bias = jnp.where(rows[:, 0] < real_rows, bias, jnp.zeros_like(bias))
  return table, bias


def split_ids(ids, num_targets: int):
  """`[T, L + E]` packed ids -> (targets `[T, L]`, exclude `[T, E]` or None)."""
  if ids.shape[-1] == num_targets:
    return ids, None
  return ids[:, :num_targets], ids[:, num_targets:]


def rebase_ids(global_ids: sparse.SparseIds, offset, rows: int) -> sparse.SparseIds:
  """Global `SparseIds` -> ids into this shard's `rows` rows; other shards' ids masked.

  Deduplication and "excluded ids that are targets stay targets" were decided
  on the global ids, so masking out foreign ids keeps them exact. Global ids are
  < V, so no id ever points at a padded row.
  """

  def rebase(ids, mask):
    if ids is None:
      return None, None
    local = ids - offset
    owned = mask & (local >= 0) & (local < rows)
    return jnp.where(owned, local, 0), owned

  target_ids, target_mask = rebase(global_ids.target_ids, global_ids.target_mask)
  exclude_ids, exclude_mask = rebase(global_ids.exclude_ids, global_ids.exclude_mask)
  exclude_rows = global_ids.exclude_rows
  if exclude_rows is not None:  # -1 for none, as in sparse.prepare_ids
    local_rows, owned = rebase(exclude_rows, exclude_rows >= 0)
    exclude_rows = jnp.where(owned, local_rows, -1)
  return sparse.SparseIds(target_ids, target_mask, exclude_ids, exclude_mask, exclude_rows)
