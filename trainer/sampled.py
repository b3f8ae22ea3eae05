"""Sampled losses: the negative-sampling baselines beside the exact full-catalog ones.

`config.loss.kind` chooses the trainer's loss. "bce" and "softmax_ce" are
exact over the whole catalog (the cut ops, `trainer/train.py`); the three
kinds here score each position against its targets and k sampled negatives
only, as the published recipes do (HSTU, eSASRec, gSASRec, YouTube):

- "sampled_softmax": per distinct target p of position t, with x the logits
  and the negatives n_1..n_k (a negative equal to one of t's targets masked),

      l_tp = -x_tp + log(exp(x_tp) + sum_j exp(x_tn_j - c_j))
           = softplus(LSE_j(x_tn_j - c_j) - x_tp)

  where c_j = log(k q(n_j)) with `loss.logq` (q the sampler's probability of
  the item; k q is its expected number of draws), else 0. The positive is
  not corrected: sum_j exp(x_j) / (k q(n_j)) is an unbiased estimate of the
  catalog's sum of exp(x_v), so the loss estimates the full softmax CE.
- "gbce" (gSASRec, Petrov & Macdonald, RecSys 2023): with alpha = k / (V - 1)
  and calibration t in [0, 1], beta = alpha (t (1 - 1/alpha) + 1/alpha)
  = 1 + t (alpha - 1), and

      l_t = sum_p -log(sigmoid(x_tp)^beta) + sum_j -log(1 - sigmoid(x_tn_j))
          = beta sum_p softplus(-x_tp) + sum_j softplus(x_tn_j).

  With t = 0, beta = 1: plain BCE over the positives and the sampled
  negatives; with k = V - 1 (alpha = 1), beta = 1 for every t.
- "in_batch": the negatives are the targets of the batch's positions (every
  target slot of the global batch, S = B x N x L of them, padding slots
  masked): all S slots with `loss.num_negatives=None`, else k slots drawn
  uniformly. An item with c_v slots among the S is drawn k c_v / S times in
  expectation, so the logQ correction is log(k c_v / S) (log c_v with all
  slots); otherwise the loss is sampled_softmax's.

Negatives are drawn once per batch (`loss.negatives_per="batch"`: one set of
k ids shared by every position, logits `[T, k]` from one `[T, D] x [D, k]`
matmul), per sequence (`"sequence"`: ids `[B, k]`, shared by the sequence's
positions, rows `[B, k, D]`, as SASRec+ draws them) or per position
(`"position"`: ids `[T, k]`, rows `[T, k, D]`). The samplers: "uniform" over
[0, V) (q = 1/V), or "popularity", proportional to each item's count in the
training interactions (`train_item_counts`), drawn by inverse CDF: an
integer r uniform in [0, C) and the item whose cumulative count range holds
it (`jnp.searchsorted` on the int32 cumulative counts, replicated on every
device: 4 V bytes). Draws are with replacement, except per sequence: k
distinct items by Gumbel top-k over a `[B, V]` array of keys
(`draw_sequence_negatives`), with `loss.exclude="window"` none of them from
the sequence's window (its inputs and its last position's targets), as
SASRec+'s 3,000 negatives are drawn.

Weighting and reduction as the exact losses: padding positions have weight
0, a target id repeated in a row counts once, the loss is
sum_t w_t l_t / sum_t w_t. With `loss.target_reduction="mean"` a position's
sampled-softmax terms are averaged over its distinct targets. The
confusion counts (`cutbce.Stats`) are over the sampled pairs only: each
position's distinct targets and its unmasked negatives, threshold logit > 0.

Cost: per step, T x k x D multiply-adds for the negatives' logits (and the
same twice in the backward), T x L x D for the targets', and a gather of k
(per batch) or T x k (per position) table rows; no pass over the catalog.
On a mesh whose vocab axis splits the table, the rows come from
`take_rows`, one `shard_map`: each vocab shard reads the ids that fall in
its own rows, and the rows are summed over the vocab axis (an all-reduce of
`[k, D]`, or a reduce-scatter of `[T_local, k, D]`); the backward
scatter-adds the rows' cotangents into each shard. The table is never
gathered whole (XLA's own partitioning of `jnp.take` all-gathered it).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from cutbce.stats import Stats
from trainer.config.keys import NEGATIVES_PER, SAMPLED_KINDS, SAMPLERS  # noqa: F401 (re-exported)
# The negatives' key is fold_in(step key, NEGATIVES_STREAM); the step key itself
# feeds dropout (`nnx.Rngs` folds in small counters), so the streams never meet.
NEGATIVES_STREAM = 0x6E6567
# The popularity sampler draws an int32 in [0, C): counts summing past this are scaled.
MAX_TOTAL_COUNT = 2**31 - 1


class SampledLoss(NamedTuple):
  """The settings of a sampled loss (hashable: part of the step's static settings)."""
  kind: str  # one of SAMPLED_KINDS
  num_negatives: int | None  # k; None: in_batch with every target slot of the batch
  sampler: str = "uniform"  # sampled_softmax, gbce: "uniform" or "popularity"
  logq: bool = False  # subtract log(k q(item)) from the negatives' logits
  gbce_t: float = 0.75  # gBCE calibration t
  negatives_per: str = "batch"  # one set of negatives per "batch", "sequence" or "position"
  target_reduction: str = "sum"  # sampled_softmax, in_batch: a position's targets added or averaged
  exclude_window: bool = False  # "sequence": never draw an item of the sequence's window


# --------------------------------------------------------------------------- #
# Popularity: item counts of the training interactions.                        #
# --------------------------------------------------------------------------- #


def _count_users(data, start: int, stop: int, counts: np.ndarray,
                 chunk_events: int = 1 << 24) -> None:
  """Adds the training items of users [start, stop) to `counts`, a chunk of users at a time."""
  offsets, lengths = np.asarray(data.offsets), np.asarray(data.train_lengths)
  user = start
  while user < stop:
    last = int(np.searchsorted(offsets, offsets[user] + chunk_events, side="right")) - 1
    last = min(stop, max(last, user + 1))
    first_row, end_row = int(offsets[user]), int(offsets[last])
    items = np.asarray(data.items[first_row:end_row])
    sizes = np.diff(offsets[user:last + 1])
    position = np.arange(end_row - first_row) - np.repeat(offsets[user:last] - first_row, sizes)
    train = position < np.repeat(lengths[user:last], sizes)
    counts += np.bincount(items[train], minlength=counts.shape[0])[:counts.shape[0]]
    user = last


def train_item_counts(data, process_index: int = 0, process_count: int = 1) -> np.ndarray:
  """int64 `[V]`: how often each item occurs in the training interactions.

  Training interactions are each user's training prefix (`train_lengths`),
  what the training windows read. With the events in S user shards and the
  process count P dividing S, process p counts only its shards p, p + P, ...
  (the files it opens anyway) and the caller sums over processes
  (`global_train_item_counts`); otherwise every process counts every user.

  Args:
    data: a `trainer.data.PreparedDataset`.
    process_index, process_count: this process and the processes of the run.
  """
  counts = np.zeros(data.num_items, np.int64)
  bounds = np.asarray(data.shard_users)
  shards = range(len(bounds) - 1)
  if process_count > 1 and data.num_shards % process_count == 0:
    shards = range(process_index, len(bounds) - 1, process_count)
  for shard in shards:
    _count_users(data, int(bounds[shard]), int(bounds[shard + 1]), counts)
  return counts


def global_train_item_counts(data) -> np.ndarray:
  """`train_item_counts` of the whole run: summed over processes when each counted a part."""
  count = jax.process_count()
  local = train_item_counts(data, jax.process_index(), count)
  if count == 1 or data.num_shards % count:
    return local
  from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
  return np.asarray(multihost_utils.process_allgather(local)).sum(0)


def cumulative_counts(counts: np.ndarray, rows: int) -> np.ndarray:
  """int32 `[rows]`: the popularity sampler's table, cumulative counts, padding rows last.

  Counts summing past 2^31 - 1 are scaled down, each rounded up so that an
  item seen once stays drawable; q is then the scaled counts' share (the
  sampler and the logQ correction read the same table). Rows past
  `len(counts)` (the table's padding) repeat the total: they are never drawn.

  Raises:
    ValueError: no item has a positive count.
  """
  counts = np.asarray(counts, np.int64)
  total = int(counts.sum())
  if total <= 0:
    raise ValueError("the popularity sampler needs training interactions; every item "
                     "count is 0")
  if total > MAX_TOTAL_COUNT:
    scale = (MAX_TOTAL_COUNT - counts.shape[0]) / total
    counts = np.ceil(counts * scale).astype(np.int64)
  cumulative = np.cumsum(counts)
  padded = np.full(rows, cumulative[-1], np.int64)
  padded[:counts.shape[0]] = cumulative
  return padded.astype(np.int32)


# --------------------------------------------------------------------------- #
# Drawing negatives.                                                           #
# --------------------------------------------------------------------------- #


class Negatives(NamedTuple):
  """Sampled negatives: `[k]` (per batch), `[B, k]` (per sequence) or `[T, k]` (per position)."""
  ids: jax.Array  # int32; masked ones may hold any id
  valid: jax.Array  # bool: drawn from a real slot (in_batch padding slots are not)
  log_expected: jax.Array  # float32 log(k q(id)): expected draws of the id, for logQ


def negatives_shape(loss: SampledLoss, num_tokens: int, num_slots: int,
                    num_sequences: int = 1) -> tuple[int, ...]:
  """`[k]`, `[B, k]` or `[T, k]`; in_batch with k None: `[S]`, every target slot, shared."""
  if loss.num_negatives is None:
    return (num_slots,)
  k = loss.num_negatives
  return {"batch": (k,), "sequence": (num_sequences, k),
          "position": (num_tokens, k)}[loss.negatives_per]


def draw_sequence_negatives(key, shape, *, num_items: int, window=None,
                            cumulative=None) -> Negatives:
  """k distinct negatives per sequence, drawn without replacement, none from its window.

  SASRec+'s sampled softmax draws so: k of the items outside the user's
  window, without replacement, shared by the window's positions. Here by
  Gumbel top-k: each item's key is log q(item) plus a Gumbel draw, the
  window's items get -inf, and the k largest are taken (uniform: a random
  k-subset of the allowed items; popularity: successive sampling in
  proportion to the counts). Where fewer than k items are allowed, the
  excluded ones fill the rest and are masked (`valid` False).

  `log_expected` is log(k q(item)), the with-replacement expectation: for a
  draw without replacement it is an approximation (exact in the limit of
  k << V), stated where logQ is used.

  Args:
    key: the step's negatives key.
    shape: `[B, k]`.
    num_items: V; ids are drawn in [0, V).
    window: int `[B, W]` item ids of each sequence's window (padding outside
      [0, V)), or None: nothing excluded.
    cumulative: int32 `[V_padded]` (`cumulative_counts`), or None: uniform.
  """
  sequences, k = shape
  if cumulative is None:
    log_q = jnp.full((num_items,), -math.log(num_items), jnp.float32)
  else:
    counts = jnp.diff(cumulative[:num_items], prepend=0).astype(jnp.float32)
    log_q = jnp.log(counts) - jnp.log(jnp.sum(counts))
  scores = log_q[None, :] + jax.random.gumbel(key, (sequences, num_items), jnp.float32)
  if window is not None:
    inside = (window >= 0) & (window < num_items)
    rows = jnp.broadcast_to(jnp.arange(sequences)[:, None], window.shape)
    scores = scores.at[rows, jnp.where(inside, window, num_items)].set(-jnp.inf, mode="drop")
  top, ids = jax.lax.top_k(scores, k)
  ids = ids.astype(jnp.int32)
  return Negatives(ids, jnp.isfinite(top), math.log(k) + log_q[ids])


def draw_catalog_negatives(key, shape, *, num_items: int, cumulative=None) -> Negatives:
  """Negatives drawn from the catalog: uniform, or by popularity from `cumulative`.

  Args:
    key: the step's negatives key.
    shape: `[k]` or `[T, k]`.
    num_items: V; ids are drawn in [0, V).
    cumulative: int32 `[V_padded]` (`cumulative_counts`), or None: uniform.
  """
  k = shape[-1]
  if cumulative is None:
    ids = jax.random.randint(key, shape, 0, num_items, jnp.int32)
    log_expected = jnp.full(shape, math.log(k / num_items), jnp.float32)
    return Negatives(ids, jnp.ones(shape, bool), log_expected)
  total = cumulative[num_items - 1]
  draw = jax.random.randint(key, shape, 0, total, jnp.int32)
  # The item whose range [cumulative[v - 1], cumulative[v]) holds the draw.
  ids = jnp.searchsorted(cumulative[:num_items], draw, side="right").astype(jnp.int32)
  ids = jnp.minimum(ids, num_items - 1)
  below = jnp.where(ids > 0, cumulative[jnp.maximum(ids - 1, 0)], 0)
  count = (cumulative[ids] - below).astype(jnp.float32)
  log_expected = jnp.log(k * count) - jnp.log(total.astype(jnp.float32))
  return Negatives(ids, jnp.ones(shape, bool), log_expected)


def draw_batch_negatives(key, shape, targets, *, num_items: int, all_slots: bool) -> Negatives:
  """in_batch negatives: target slots of the global batch (`[S]` all, or k drawn per set).

  Args:
    key: the step's negatives key.
    shape: `[k]` or `[T, k]` (`[S]` with `all_slots`).
    targets: int `[..., L]` of the global batch; ids outside [0, V) are padding.
    num_items: V.
    all_slots: every slot once, in order (k = S), instead of k uniform draws.
  """
  slots = targets.reshape(-1)  # [S]
  num_slots = slots.shape[0]
  if all_slots:
    picked = jnp.arange(num_slots)
  else:
    picked = jax.random.randint(key, shape, 0, num_slots, jnp.int32)
  ids = slots[picked]
  valid = (ids >= 0) & (ids < num_items)
  ids = jnp.where(valid, ids, 0)
  # c_v: slots holding the id, from the sorted slots (no [k, S] comparison).
  ordered = jnp.sort(slots)
  count = (jnp.searchsorted(ordered, ids, side="right")
           - jnp.searchsorted(ordered, ids, side="left")).astype(jnp.float32)
  k = shape[-1]
  log_expected = jnp.log(k * jnp.maximum(count, 1.0)) - math.log(num_slots)
  return Negatives(ids, valid, log_expected)


# --------------------------------------------------------------------------- #
# The loss.                                                                    #
# --------------------------------------------------------------------------- #


def gbce_beta(num_negatives: int, num_items: int, t: float) -> float:
  """gSASRec's beta = alpha (t (1 - 1/alpha) + 1/alpha), alpha = k / (V - 1).

  >>> gbce_beta(128, 1_001, 0.0), gbce_beta(1_000, 1_001, 0.75)
  (1.0, 1.0)
  """
  alpha = num_negatives / (num_items - 1)
  # The same as alpha (t (1 - 1/alpha) + 1/alpha), and exactly 1 at t = 0 or alpha = 1.
  return 1.0 + t * (alpha - 1.0)


def _distinct_targets(targets, num_items: int):
  """bool `[T, L]`: a real target, and the first of its id in the row."""
  valid = (targets >= 0) & (targets < num_items)
  length = targets.shape[-1]
  earlier = jnp.tril(jnp.ones((length, length), bool), -1)  # [L, L]: l' < l
  repeated = jnp.any((targets[:, :, None] == targets[:, None, :]) & earlier & valid[:, None, :],
                     axis=-1)
  return valid & ~repeated


class RowLayout(NamedTuple):
  """Where the table's rows and the ids live on the mesh (hashable; None: one device)."""
  mesh: jax.sharding.Mesh
  token_axes: tuple[str, ...]  # split the positions (the ids' leading axis, per position)
  vocab_axis: str | None  # splits the table's rows


def take_rows(table, ids, layout: RowLayout | None = None):
  """`table[ids]` from a table whose rows are split over `layout.vocab_axis`.

  In one `shard_map`: the ids are all-gathered over the vocab axis when it
  also splits the positions (int32, T x k / token shards ids); every
  device reads the ids of its own rows from its shard (others give 0); the
  rows are summed over the vocab axis (`psum_scatter` back to the position
  split, or `psum` for ids every device holds). Its autodiff transpose
  scatter-adds the rows' cotangents into each device's own `[V / shards,
  D]` rows and sums them over the axes that replicate the table. No
  device holds the table, or a `[V, D]` gradient, whole (XLA's own
  partitioning of `jnp.take` all-gathers the table when the ids are split
  over the vocab axis, and all-reduces a whole `[V, D]` gradient).

  Args:
    table: `[V_padded, ...]`, rows split over `layout.vocab_axis`.
    ids: int `[k]` (every position's; replicated) or `[T, ...]` (per
      position; leading axis split over `layout.token_axes`), in [0, V).
    layout: the mesh, or None (or no vocab axis): `jnp.take`.

  Returns:
    `[*ids.shape, ...]` rows, sharded as the ids.
  """
  if layout is None or layout.vocab_axis is None:
    return jnp.take(table, ids, axis=0)
  axis, tokens = layout.vocab_axis, tuple(layout.token_axes)
  per_position = ids.ndim > 1
  ids_spec = P(tokens) if per_position else P()
  split = per_position and axis in tokens

  def local(table_shard, ids_shard):
    if split:  # The ids of every device of this vocab group.
      ids_shard = jax.lax.all_gather(ids_shard, axis, axis=0, tiled=True)
    rows = table_shard.shape[0]
    offset = jax.lax.axis_index(axis) * rows
    shifted = ids_shard - offset
    inside = (shifted >= 0) & (shifted < rows)
    found = jnp.take(table_shard, jnp.where(inside, shifted, 0), axis=0)
    found = jnp.where(inside.reshape(inside.shape + (1,) * (found.ndim - inside.ndim)),
                      found, jnp.zeros((), found.dtype))
    if split:
      return jax.lax.psum_scatter(found, axis, scatter_dimension=0, tiled=True)
    return jax.lax.psum(found, axis)

  return jax.shard_map(local, mesh=layout.mesh, in_specs=(P(axis), ids_spec),
                       out_specs=ids_spec)(table, ids)


def _bias_of(bias, ids, layout=None):
  """float32 bias `[...]` of `ids` (0 without one)."""
  if bias is None:
    return jnp.zeros(ids.shape, jnp.float32)
  return take_rows(bias, ids, layout).astype(jnp.float32)


# Per-position negatives (`negatives_per="position"`) gather k rows per
# position: a `[T, k, D]` tensor written and read, and as many rows
# scatter-added into the table's gradient. Where the catalog is small beside
# k, all `[T, V]` logits (one GEMM, two in the backward) and a take of the k
# cost less: on this machine's CPU at gSASRec's MovieLens-1M shape (T =
# 25,600, k = 256, D = 128, V = 3,417) the loss's value and gradients take
# 1.1 s against 3.3-3.9 s, in 843 MiB of temporaries against 6,541, and its
# whole train step compiles for a TPU v5e in 741 MiB of temporaries against
# 3,496 (127 GFLOP against 66; `python benchmarks/sampled_logits.py
# --compile-for v5e-1`; not yet ran on a chip). The full logits are taken when
# V <= k * min(FULL_LOGITS_RATIO, D): their GEMM is then at most
# FULL_LOGITS_RATIO times the gathered products' work, and their `[T, V]`
# float32 no larger than the gathered rows. Both give the same logits (each
# a length-D dot accumulated in float32); 10^5-item and larger catalogs keep
# the gather. A table split over a vocabulary axis always gathers
# (`take_rows`: no device holds every row).
FULL_LOGITS_RATIO = 32


def full_logits_pay(num_rows: int, k: int, dim: int) -> bool:
  """Whether `[T, k]` per-position logits come cheaper from all `[T, num_rows]` ones."""
  return num_rows <= k * min(FULL_LOGITS_RATIO, dim)


def _position_logits(h, table, ids, layout=None):
  """float32 `[T, k]` logits `h_t . table[ids_tk]` (`full_logits_pay`: from all T x V)."""
  if (layout is None or layout.vocab_axis is None) and full_logits_pay(
      table.shape[0], ids.shape[-1], h.shape[-1]):
    logits = jnp.einsum("td,vd->tv", h, table, preferred_element_type=jnp.float32)
    return jnp.take_along_axis(logits, ids, axis=1)
  return jnp.einsum("td,tkd->tk", h, take_rows(table, ids, layout),
                    preferred_element_type=jnp.float32)


def _masked_logsumexp(values, mask):
  """log sum over the masked entries of the last axis; -inf where none (finite gradients)."""
  peak = jnp.max(jnp.where(mask, values, -jnp.inf), axis=-1, keepdims=True)
  peak = jnp.where(jnp.isfinite(peak), peak, 0.0)
  total = jnp.sum(jnp.where(mask, jnp.exp(values - peak), 0.0), axis=-1)
  some = total > 0
  return jnp.where(some, jnp.log(jnp.where(some, total, 1.0)) + peak[..., 0], -jnp.inf)


def sampled_loss(hidden, table, targets, weights, negatives: Negatives, *, bias=None,
                 num_items: int, loss: SampledLoss, layout: RowLayout | None = None):
  """The weighted mean sampled loss and its confusion counts over the sampled pairs.

  Args:
    hidden: `[..., D]` hidden states (any float dtype; logits are float32).
    table: `[V_padded, D]` item table (rows past V never drawn).
    targets: int `[..., L]`, padding outside [0, V).
    weights: float `[...]` per position (0: padding).
    negatives: `Negatives` of shape `[k]` or `[T, k]` (T = the positions).
    bias: optional `[V_padded]` item bias.
    num_items: V.
    loss: the kind and its settings.
    layout: the mesh the table's rows are split on (`take_rows`), or None.

  Returns:
    `(loss, stats)`: float32 scalar, `cutbce.Stats`.
  """
  dim = hidden.shape[-1]
  h = hidden.reshape(-1, dim)  # [T, D]
  targets = targets.reshape(h.shape[0], -1)  # [T, L]
  w = weights.reshape(-1).astype(jnp.float32)  # [T]
  distinct = _distinct_targets(targets, num_items)  # [T, L]
  target_ids = jnp.where(distinct, targets, 0)
  target_rows = take_rows(table, target_ids, layout)
  target_bias = _bias_of(bias, target_ids, layout)
  x_pos = jnp.einsum("td,tld->tl", h, target_rows,
                     preferred_element_type=jnp.float32) + target_bias  # [T, L]
  neg_bias = _bias_of(bias, negatives.ids, layout)
  if negatives.ids.ndim == 1:  # One set for the batch: one matmul.
    x_neg = jnp.einsum("td,kd->tk", h, take_rows(table, negatives.ids, layout),
                       preferred_element_type=jnp.float32)
    neg_ids = negatives.ids[None, :]
  elif loss.negatives_per == "sequence":  # One set per sequence: one matmul per sequence.
    sequences, k = negatives.ids.shape
    per_token = lambda a: jnp.broadcast_to(  # noqa: E731  [B, k] -> [T, k]
        a[:, None, :], (sequences, h.shape[0] // sequences, k)).reshape(-1, k)
    x_neg = jnp.einsum("bnd,bkd->bnk", h.reshape(sequences, -1, dim),
                       take_rows(table, negatives.ids, layout),
                       preferred_element_type=jnp.float32).reshape(-1, k)
    neg_ids, neg_bias = per_token(negatives.ids), per_token(neg_bias)
    negatives = Negatives(neg_ids, per_token(negatives.valid), per_token(negatives.log_expected))
  else:
    x_neg = _position_logits(h, table, negatives.ids, layout)
    neg_ids = negatives.ids
  x_neg = x_neg + neg_bias  # [T, k]
  # A negative equal to one of the position's targets is masked (an accidental hit).
  hit = jnp.any((neg_ids[:, :, None] == targets[:, None, :]) & distinct[:, None, :], axis=-1)
  neg_mask = negatives.valid & ~hit  # [T, k]
  pos_mask = distinct.astype(jnp.float32)
  if loss.kind == "gbce":
    beta = gbce_beta(loss.num_negatives, num_items, loss.gbce_t)
    per_position = (beta * jnp.sum(pos_mask * jax.nn.softplus(-x_pos), axis=-1)
                    + jnp.sum(jnp.where(neg_mask, jax.nn.softplus(x_neg), 0.0), axis=-1))
  else:
    corrected = x_neg - negatives.log_expected if loss.logq else x_neg
    background = _masked_logsumexp(corrected, neg_mask)  # [T]
    # -x_p + log(exp(x_p) + exp(background)) = softplus(background - x_p) (0 with no negative).
    per_target = pos_mask * jax.nn.softplus(background[:, None] - x_pos)  # [T, L]
    per_position = jnp.sum(per_target, axis=-1)
    if loss.target_reduction == "mean":
      per_position = per_position / jnp.maximum(jnp.sum(pos_mask, axis=-1), 1.0)
  total_weight = jnp.sum(w)
  value = jnp.where(total_weight > 0,
                    jnp.sum(w * per_position) / jnp.where(total_weight > 0, total_weight, 1.0),
                    0.0)
  return value, _stats(x_pos, pos_mask, x_neg, neg_mask, w)


def _stats(x_pos, pos_mask, x_neg, neg_mask, w) -> Stats:
  """Weighted confusion counts at logit > 0 over the targets and unmasked negatives."""
  neg = neg_mask.astype(jnp.float32)
  count = lambda values: jnp.sum(w * jnp.sum(values, axis=-1))  # noqa: E731
  return Stats(tp=count(pos_mask * (x_pos > 0)), fn=count(pos_mask * (x_pos <= 0)),
               fp=count(neg * (x_neg > 0)), tn=count(neg * (x_neg <= 0)))


def recipe_advice(loss_kind: str, item_bias: bool) -> str | None:
  """One line for a setting known to train poorly (printed at the start of training), or None.

  gBCE without an item bias: its k negatives a position push every logit below
  zero through the item table itself in the first steps; the table collapses
  onto one shared direction and the model stays near the popularity ranking
  (MovieLens-1M, `make train` recipe: test NDCG@10 0.0164 at 2,000 steps,
  0.1031 with the bias; docs/results.md, "Which loss should I use?").
  """
  if loss_kind == "gbce" and not item_bias:
    return ("note: loss.kind='gbce' without model.item_bias=True learns little (its negatives "
            "collapse the item table onto one direction; on MovieLens-1M it stayed near "
            "the popularity ranking); set model.item_bias=True (docs/trainer.md, "
            "'Sampled losses')")
  return None


def draw_negatives(key, loss: SampledLoss, targets, *, num_items: int,
                   cumulative=None, window=None) -> Negatives:
  """The step's negatives for `loss` (the catalog samplers, or the batch's target slots).

  `targets` is `[B, N, L]` (`[T, L]` without sequences); `window` the
  `[B, W]` items of each sequence's window, read by "sequence" negatives
  with `loss.exclude_window`.
  """
  num_tokens = math.prod(targets.shape[:-1])
  shape = negatives_shape(loss, num_tokens, targets.size, targets.shape[0])
  if loss.negatives_per == "sequence" and loss.kind != "in_batch":
    return draw_sequence_negatives(
        key, shape, num_items=num_items, window=window if loss.exclude_window else None,
        cumulative=cumulative if loss.sampler == "popularity" else None)
  if loss.kind == "in_batch":
    return draw_batch_negatives(key, shape, targets, num_items=num_items,
                                all_slots=loss.num_negatives is None)
  return draw_catalog_negatives(key, shape, num_items=num_items,
                                cumulative=cumulative if loss.sampler == "popularity" else None)
