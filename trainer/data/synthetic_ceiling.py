"""The Bayes ceiling of the topic generator: expected NDCG@k of the true next-item law.

The generator knows the law of each user's next event given its latent state:
the user's slot topics and weights theta, the interest slot of the previous
event, and the history. For the leave-one-out test position T (each user's
last event) that law is

    P(v) = rho / w' * #{d in 1..w' : x_{T-d} = v}
         + (1 - rho) tau * 1(v = succ(x_{T-1}))
         + (1 - rho)(1 - tau) * sum_m pi_m * w_v / W_{topic_m} * 1(v in topic_m)
    pi = stay * onehot(slot_{T-1}) + (1 - stay) * theta

(rho = repeat_prob, w' = min(repeat_window, T), tau = transition_prob).
Ranking by P maximizes the expected DCG given that state (the gain
1 / log2(1 + rank) falls with the rank: the rearrangement inequality), and a
model sees only the history, which is less: the expected NDCG of this
ranking is an upper bound no model can beat in expectation. (The exact
Bayes-optimal model given the history alone would integrate over the latent
state; it is lower or equal.)

The protocol is the trainer's (`trainer/evaluate.py`, `cutbce.target_ranks`):
the history (every event before T) is excluded from the ranking, a target in
the history stays a target, rank = 1 + the number of other non-excluded items
scoring >= the target (ties count against the target), NDCG@k of one target
= 1 / log2(1 + rank) when rank <= k. Reported per user as the expectation
over the true law (exact, no sampling of the target) and as the realized
value on the generated target, averaged over the first `num_users` users.
The popularity baseline ranks by training counts (every event but each
user's last two, as leave-one-out trains) on the same users.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from trainer.data import synthetic_topics


def next_item_law(catalog: synthetic_topics.TopicCatalog,
                  params: synthetic_topics.TopicParams,
                  draws: synthetic_topics.UserDraws, user: int
                  ) -> tuple[np.ndarray, np.ndarray]:
  """The true law of user `user`'s last event given the latent state before it.

  Returns:
    ``(ids, probs)``: int64 ``[C]`` distinct items of positive probability
    and float64 ``[C]`` their probabilities (summing to 1); every other item
    has probability 0.
  """
  first, end = int(draws.offsets[user]), int(draws.offsets[user + 1])
  last = end - 1  # the test event T
  history = draws.items[first:last]
  slot_law = params.topic_stay_prob * (np.arange(params.topics_per_user)
                                       == draws.slot[last - 1])
  slot_law = slot_law + (1.0 - params.topic_stay_prob) * draws.theta[user]  # [M]
  topic_share = (1.0 - params.repeat_prob) * (1.0 - params.transition_prob)
  ids, probs = [], []
  for slot, topic in enumerate(draws.slot_topics[user].tolist()):
    ranks = catalog.ranks_of_topic(topic)
    ids.append(catalog.ids(ranks))
    probs.append(topic_share * slot_law[slot] * catalog.weights(ranks)
                 / catalog.topic_weight[topic])
  ids.append(catalog.next_in_chain(history[-1:]))
  probs.append(np.array([(1.0 - params.repeat_prob) * params.transition_prob]))
  window = min(params.repeat_window, history.shape[0])
  ids.append(history[history.shape[0] - window:].astype(np.int64))
  probs.append(np.full(window, params.repeat_prob / window))
  distinct, inverse = np.unique(np.concatenate(ids), return_inverse=True)
  total = np.bincount(inverse, weights=np.concatenate(probs))
  keep = total > 0
  return distinct[keep], total[keep]


def gains(ranks: np.ndarray, k: int) -> np.ndarray:
  """NDCG@k of one target at each of ``ranks``: 1 / log2(1 + rank), 0 past k."""
  ranks = np.asarray(ranks, np.float64)
  return np.where(ranks <= k, 1.0 / np.log2(1.0 + ranks), 0.0)


def ranks_among(scores: np.ndarray, allowed_scores_sorted: np.ndarray,
                allowed: np.ndarray) -> np.ndarray:
  """1 + the number of other allowed items scoring >= each score (ties against it).

  Args:
    scores: ``[C]`` the scores of the items ranked.
    allowed_scores_sorted: ascending scores of every allowed (non-excluded) item.
    allowed: bool ``[C]`` whether each ranked item is itself allowed (then it
      is not counted against itself).
  """
  at_least = allowed_scores_sorted.shape[0] - np.searchsorted(allowed_scores_sorted, scores,
                                                              side="left")
  return 1 + at_least - allowed.astype(np.int64)


def user_ndcg(ids: np.ndarray, probs: np.ndarray, history: np.ndarray, target: int,
              sorted_counts: np.ndarray, train_counts: np.ndarray, k: int
              ) -> tuple[float, float, float, float]:
  """(oracle expected, oracle realized, popularity expected, popularity realized) NDCG@k."""
  seen = np.unique(history)
  allowed = ~np.isin(ids, seen)
  oracle_ranks = ranks_among(probs, np.sort(probs[allowed]), allowed)
  oracle = gains(oracle_ranks, k)
  # Popularity: other items with count >= c, minus the seen ones among them.
  counts, seen_counts = train_counts[ids], np.sort(train_counts[seen])
  seen_at_least = seen_counts.shape[0] - np.searchsorted(seen_counts, counts, side="left")
  popularity = gains(ranks_among(counts, sorted_counts, allowed) - seen_at_least, k)
  where = np.flatnonzero(ids == target)
  hit = int(where[0]) if where.size else None
  return (float(probs @ oracle), float(oracle[hit]) if hit is not None else 0.0,
          float(probs @ popularity), float(popularity[hit]) if hit is not None else 0.0)


def train_counts_loo(items: np.ndarray, lengths: np.ndarray, num_items: int) -> np.ndarray:
  """int64 ``[V]`` counts over each user's training prefix (all but the last two events)."""
  offsets = np.concatenate([[0], np.cumsum(lengths)])
  train_end = np.repeat(offsets[:-1] + np.maximum(lengths - 2, 0), lengths)
  train = np.arange(items.shape[0]) < train_end
  return np.bincount(items[train], minlength=num_items).astype(np.int64)


def bayes_ceiling(options: Mapping, *, num_users: int = 2_000, k: int = 10,
                  data=None) -> dict:
  """Expected NDCG@k of the true law and of popularity, leave-one-out test, first users.

  Args:
    options: keyword arguments of :func:`synthetic_topics.generate_topics`.
    num_users: users evaluated (the first ones, at most the first chunk's;
      users with fewer than 3 events have no test position and are skipped).
    k: the cut-off.
    data: the generated Interactions of ``options`` (None: generated here),
      for the popularity counts.

  Returns:
    ``{"users", "ceiling_ndcg", "ceiling_ndcg_realized", "popularity_ndcg",
    "popularity_ndcg_realized"}`` (means over the users), with ``@k`` in the
    names.
  """
  if data is None:
    data = synthetic_topics.generate_topics(**options)
  lengths = np.bincount(data.user, minlength=int(data.user.max()) + 1)
  train_counts = train_counts_loo(np.asarray(data.item, np.int64), lengths, data.num_items)
  sorted_counts = np.sort(train_counts)
  catalog, params, draws = synthetic_topics.chunk_draws(**options)
  rows = []
  for user in range(min(num_users, draws.offsets.shape[0] - 1)):
    first, end = int(draws.offsets[user]), int(draws.offsets[user + 1])
    if end - first < 3:
      continue
    ids, probs = next_item_law(catalog, params, draws, user)
    rows.append(user_ndcg(ids, probs, draws.items[first:end - 1], int(draws.items[end - 1]),
                          sorted_counts, train_counts, k))
  means = np.mean(np.asarray(rows), axis=0) if rows else np.zeros(4)
  return {"users": len(rows), f"ceiling_ndcg@{k}": float(means[0]),
          f"ceiling_ndcg@{k}_realized": float(means[1]), f"popularity_ndcg@{k}": float(means[2]),
          f"popularity_ndcg@{k}_realized": float(means[3])}
