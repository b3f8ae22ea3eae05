"""Ranking metrics from target ranks."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rank_metrics(ranks, ks=(10, 50, 100)) -> dict[str, jax.Array]:
  """recall@k, ndcg@k, hit@k and mrr from 1-based target ranks.

  Rows are the leading positions of `ranks` `[..., L]`; 0 marks padding. For a
  row with n >= 1 targets and ranks r_1..r_n:

    hit@k    = 1 if any r_i <= k
    recall@k = #{r_i <= k} / min(n, k)
    ndcg@k   = sum_{r_i <= k} 1/log2(r_i + 1) / sum_{j=1}^{min(n, k)} 1/log2(j + 1)
    mrr      = 1 / min_i r_i

  each averaged over the rows with at least one target (0 when there are none).
  `num_rows` is that number of rows, for combining batches.

  Args:
    ranks: int `[..., L]` ranks from `cutbce.target_ranks`.
    ks: cut-offs.

  Returns:
    dict of float32 scalars: "recall@k", "ndcg@k", "hit@k" per k, "mrr", "num_rows".
  """
  ranks = jnp.asarray(ranks)
  if ranks.ndim < 1:
    raise ValueError(f"ranks must have shape [..., L], got shape {ranks.shape}")
  if not jnp.issubdtype(ranks.dtype, jnp.integer):
    raise TypeError(f"ranks must be integers, got dtype {ranks.dtype}")
  for k in ks:
    if not isinstance(k, int) or k < 1:
      raise ValueError(f"every k in ks must be a positive int, got {k!r} in {ks!r}")
  ranks = jnp.reshape(ranks, (-1, ranks.shape[-1]))
  valid = ranks > 0
  num_targets = jnp.sum(valid, axis=-1)  # [R]
  has_target = num_targets > 0
  num_rows = jnp.sum(has_target).astype(jnp.float32)

  def average(per_row):
    total = jnp.sum(jnp.where(has_target, per_row, 0.0))
    return jnp.where(num_rows > 0, total / jnp.maximum(num_rows, 1.0), 0.0)

  ranks_f = ranks.astype(jnp.float32)
  gains = jnp.where(valid, 1.0 / jnp.log2(ranks_f + 1.0), 0.0)  # [R, L]
  positions = jnp.arange(1, ranks.shape[-1] + 1, dtype=jnp.float32)
  ideal_gains = 1.0 / jnp.log2(positions + 1.0)  # [L]
  metrics = {}
  for k in ks:
    within = valid & (ranks <= k)
    hits = jnp.sum(within, axis=-1).astype(jnp.float32)
    ideal_count = jnp.minimum(num_targets, k)
    ideal = jnp.sum(jnp.where(positions[None, :] <= ideal_count[:, None], ideal_gains, 0.0), -1)
    dcg = jnp.sum(jnp.where(within, gains, 0.0), axis=-1)
    metrics[f"recall@{k}"] = average(hits / jnp.maximum(ideal_count, 1))
    metrics[f"ndcg@{k}"] = average(dcg / jnp.where(ideal > 0, ideal, 1.0))
    metrics[f"hit@{k}"] = average((hits > 0).astype(jnp.float32))
  best = jnp.min(jnp.where(valid, ranks_f, jnp.inf), axis=-1)
  metrics["mrr"] = average(jnp.where(has_target, 1.0 / best, 0.0))
  metrics["num_rows"] = num_rows
  return metrics
