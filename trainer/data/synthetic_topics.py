"""Synthetic interactions with latent topics and drifting interest, statistics from ML-1M.

The second synthetic source (``synthetic_topics``), for catalog-scale
benchmarks at V = 10^5 to 10^7. What it draws:

* Popularity: item of popularity rank r (0-based) has weight
  ``w_r = (r + 1)^-s``. Rank r belongs to topic ``r mod K``, so the K topics
  have V / K items each (within one), every topic's items are Zipf-popular
  with the same exponent (``w`` at ranks ``k, k + K, k + 2K, ...``), and the
  topic mass is ``Q_k = sum of w over the topic / sum of w``. An affine
  bijection ``id = (a r + c) mod V`` scatters ranks over ids.
* Users: ``M = topics_per_user`` topic slots drawn i.i.d. from Q, with
  weights ``theta_u ~ Dirichlet(topic_concentration * 1_M)`` (a finite
  Dirichlet process with base Q: ``E[sum_m theta_m 1(topic_m = k)] = Q_k``).
* Drifting interest, a Markov chain over the slots: the first event draws a
  slot from theta_u; every next event keeps the slot with probability
  ``topic_stay_prob`` and otherwise draws a slot from theta_u again (maybe the
  same). The chain starts stationary, so the marginal topic of every event is
  Q and the marginal item popularity is exactly Zipf(s): the measured
  exponent is what the data shows.
* Emission of event t >= 1: with probability ``repeat_prob`` a copy of one of
  the previous ``repeat_window`` items (uniform), else with probability
  ``transition_prob`` the planted successor of the previous item (the
  ``synthetic`` source's ``(a v + c) mod V``), else an item of the current
  topic by within-topic popularity. Event 0 is always a topic draw.
* History lengths: ``round(exp(Normal(mu, sigma)))`` clipped to
  ``[min_length, max_length]``.

Defaults come from MovieLens-1M as the trainer prepares it (>= 5 ratings per
item), measured by ``benchmarks/synthetic_stats.py`` into
``docs/results/synthetic_stats.json``: ``zipf_exponent`` 0.697 (least squares
of log count on log rank over ranks 10 to V / 2; ML-1M is no clean power law,
its local slope climbs from 0.12 over the top 10 to 5.1 over the last
1,400 ranks), ``length_log_mean`` 4.6047 and ``length_log_std`` 0.9906 (the
log-normal fit: mean and std of log length), ``min_length`` 18 and
``max_length`` 2,277 (its shortest and longest history), ``repeat_prob`` 0.0
(ML-1M ratings never repeat an item; a parameter so that listening data can
set its own). The topic parameters are not measured (ML-1M's event file has
no genres): K = 1,000, 8 slots per user, concentration 1, stay 0.8 are
choices, stated as such.

Memory: the catalog table is O(V) (float64 cumulative weights in topic
order, 8 bytes per item) plus O(K); nothing of size V x V. Generation runs
over chunks of about 4M interactions, each with its own generator seeded by
``(seed, 2, chunk)``, vectorized over the chunk's events (no padding to the
longest history). Results depend only on the arguments.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import numpy as np

from trainer.config.schema import ConfigError
from trainer.data import sources, synthetic

_CHUNK_INTERACTIONS = 1 << 22

# Measured on ML-1M by benchmarks/synthetic_stats.py (docs/results/synthetic_stats.json).
ZIPF_EXPONENT = 0.697          # OLS slope of log count on log rank, ranks 10 .. V/2
LENGTH_LOG_MEAN = 4.6047       # mean of log(history length): median ~100 events
LENGTH_LOG_STD = 0.9906        # std of log(history length)
MIN_LENGTH = 18                # shortest ML-1M history (after the 5-rating item filter)
MAX_LENGTH = 2_277             # longest ML-1M history
REPEAT_PROB = 0.0              # ML-1M: no item repeats within a user's previous 10


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class TopicCatalog:
  """The item side of the generator: ranks, topics, ids and within-topic weights.

  Positions ``p`` in ``[0, V)`` list ranks topic by topic: topic k holds
  positions ``[topic_start[k], topic_start[k + 1])``, rank
  ``k + (p - topic_start[k]) K`` each.

  Attributes:
    num_items: V.
    num_topics: K (<= V).
    zipf_exponent: s.
    cumulative: float64 ``[V]`` running sum of ``w`` over positions.
    topic_start: int64 ``[K + 1]``.
    topic_weight: float64 ``[K]`` W_k, the sum of w over topic k.
    scatter: (a, c) of ``id = (a rank + c) mod V``.
    successor: (a, c) of the planted successor ``v -> (a v + c) mod V``.
  """

  num_items: int
  num_topics: int
  zipf_exponent: float
  cumulative: np.ndarray
  topic_start: np.ndarray
  topic_weight: np.ndarray
  scatter: tuple[int, int]
  successor: tuple[int, int]

  @property
  def topic_mass(self) -> np.ndarray:
    """float64 ``[K]`` Q_k: the share of events on topic k."""
    return self.topic_weight / self.topic_weight.sum()

  def ranks_of_topic(self, topic: int) -> np.ndarray:
    """int64 ``[n_k]`` the ranks of topic k, most popular first."""
    size = self.topic_start[topic + 1] - self.topic_start[topic]
    return topic + np.arange(size, dtype=np.int64) * self.num_topics

  def weights(self, ranks: np.ndarray) -> np.ndarray:
    """float64 w of ``ranks``."""
    return (np.asarray(ranks, np.float64) + 1.0) ** -self.zipf_exponent

  def ids(self, ranks: np.ndarray) -> np.ndarray:
    """int64 item ids of popularity ``ranks``."""
    a, c = self.scatter
    return (a * np.asarray(ranks, np.int64) + c) % self.num_items

  def next_in_chain(self, ids: np.ndarray) -> np.ndarray:
    """int64 planted successors of ``ids``."""
    a, c = self.successor
    return (a * np.asarray(ids, np.int64) + c) % self.num_items

  def draw_ranks(self, topics: np.ndarray, uniforms: np.ndarray) -> np.ndarray:
    """Ranks drawn within ``topics`` by popularity (inverse CDF of the table).

    Args:
      topics: int ``[n]`` topic per draw.
      uniforms: float64 ``[n]`` in [0, 1).

    Returns:
      int64 ``[n]`` ranks, each of its topic.
    """
    start, end = self.topic_start[topics], self.topic_start[topics + 1]
    below = np.where(start > 0, self.cumulative[np.maximum(start - 1, 0)], 0.0)
    target = below + uniforms * self.topic_weight[topics]
    position = np.searchsorted(self.cumulative, target, side="right")
    position = np.clip(position, start, end - 1)  # float rounding at the topic's ends
    return topics + (position - start) * self.num_topics


def make_catalog(num_items: int, num_topics: int, zipf_exponent: float,
                 seed: int) -> TopicCatalog:
  """Builds the catalog table of a seed: O(V) memory, O(V) time."""
  setup = np.random.default_rng([seed, 0])
  # The same bijections as the `synthetic` source draws first from this stream.
  successor_a = synthetic._coprime_multiplier(num_items, setup)  # pylint: disable=protected-access
  successor_c = int(setup.integers(0, num_items))
  scatter_a = synthetic._coprime_multiplier(num_items, setup)  # pylint: disable=protected-access
  scatter_c = int(setup.integers(0, num_items))
  sizes = (num_items - np.arange(num_topics) + num_topics - 1) // num_topics  # [K]
  topic_start = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
  topic = np.repeat(np.arange(num_topics, dtype=np.int64), sizes)  # [V]
  rank = topic + (np.arange(num_items, dtype=np.int64) - topic_start[topic]) * num_topics
  del topic
  weight = (rank.astype(np.float64) + 1.0) ** -zipf_exponent
  del rank
  cumulative = np.cumsum(weight)
  ends = cumulative[topic_start[1:] - 1]
  topic_weight = np.diff(np.concatenate([[0.0], ends]))
  return TopicCatalog(num_items=num_items, num_topics=num_topics,
                      zipf_exponent=float(zipf_exponent), cumulative=cumulative,
                      topic_start=topic_start, topic_weight=topic_weight,
                      scatter=(scatter_a, scatter_c), successor=(successor_a, successor_c))


class UserDraws(NamedTuple):
  """One chunk of users as drawn, latent state included (for the Bayes ceiling).

  Attributes:
    items: int64 ``[n]`` item ids, user-major, time order.
    offsets: int64 ``[U_c + 1]`` event offsets of the chunk's users.
    slot: int64 ``[n]`` the interest slot of every event.
    slot_topics: int64 ``[U_c, M]`` each user's topic slots.
    theta: float64 ``[U_c, M]`` each user's slot weights.
  """

  items: np.ndarray
  offsets: np.ndarray
  slot: np.ndarray
  slot_topics: np.ndarray
  theta: np.ndarray


class TopicParams(NamedTuple):
  """The arguments of the user side, after checking."""

  topics_per_user: int
  topic_concentration: float
  topic_stay_prob: float
  repeat_prob: float
  repeat_window: int
  transition_prob: float


def draw_users(catalog: TopicCatalog, params: TopicParams, lengths: np.ndarray,
               rng: np.random.Generator) -> UserDraws:
  """Draws one chunk of users' sequences (see the module docstring for the law).

  Args:
    catalog: the item side.
    params: the user side.
    lengths: int64 ``[U_c]`` history lengths, each >= 1.
    rng: the chunk's generator.

  Returns:
    :class:`UserDraws`.
  """
  num_users, m = lengths.shape[0], params.topics_per_user
  offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
  n = int(offsets[-1])
  user = np.repeat(np.arange(num_users, dtype=np.int64), lengths)  # [n]
  t = np.arange(n, dtype=np.int64) - offsets[:-1][user]  # [n] position in the history
  slot_topics = np.searchsorted(np.cumsum(catalog.topic_mass),
                                rng.random((num_users, m)), side="right")
  slot_topics = np.minimum(slot_topics, catalog.num_topics - 1).astype(np.int64)
  theta = rng.dirichlet(np.full(m, params.topic_concentration), size=num_users)
  # Interest: a new slot at t = 0 and with probability 1 - stay, carried forward.
  jump = (rng.random(n) >= params.topic_stay_prob) | (t == 0)
  slot_uniforms = rng.random(n)
  where = np.flatnonzero(jump)
  drawn = (np.cumsum(theta, axis=1)[user[where]] <= slot_uniforms[where, None]).sum(axis=1)
  slot_at = np.zeros(n, np.int64)
  slot_at[where] = np.minimum(drawn, m - 1)
  last_jump = np.maximum.accumulate(np.where(jump, np.arange(n), 0))  # t = 0 jumps: per user
  slot = slot_at[last_jump]
  topic_items = catalog.ids(catalog.draw_ranks(slot_topics[user, slot], rng.random(n)))
  branch = rng.random(n)
  back = rng.random(n)
  repeat = (t >= 1) & (branch < params.repeat_prob)
  chain = (t >= 1) & ~repeat & (
      branch < params.repeat_prob + (1.0 - params.repeat_prob) * params.transition_prob)
  items = resolve_copies(catalog, topic_items, t, repeat, chain, back, params.repeat_window)
  return UserDraws(items=items, offsets=offsets, slot=slot, slot_topics=slot_topics,
                   theta=theta)


def resolve_copies(catalog: TopicCatalog, topic_items: np.ndarray, t: np.ndarray,
                   repeat: np.ndarray, chain: np.ndarray, back: np.ndarray,
                   repeat_window: int) -> np.ndarray:
  """Items of events that copy an earlier one (repeats) or follow it (successors).

  Each such event points to an earlier event of its user and applies an
  affine map mod V to that event's item (identity for a repeat,
  ``v -> a v + c`` for a successor); chains of pointers are followed by
  pointer doubling, composing the maps, in O(n log(longest chain)).

  Args:
    catalog: for V and the successor map.
    topic_items: int64 ``[n]`` the item each event would draw from its topic.
    t: int64 ``[n]`` position of each event in its history.
    repeat: bool ``[n]`` events that repeat one of the previous
      ``repeat_window`` items; chain: bool ``[n]`` events that take the
      previous item's successor (never both, never at t = 0).
    back: float64 ``[n]`` uniforms choosing how far back a repeat looks.
    repeat_window: w.

  Returns:
    int64 ``[n]`` items.
  """
  if not (repeat.any() or chain.any()):
    return topic_items
  n, v = topic_items.shape[0], catalog.num_items
  pointer = np.arange(n, dtype=np.int64)
  distance = 1 + np.floor(back * np.minimum(t, repeat_window)).astype(np.int64)
  pointer[repeat] -= np.minimum(distance, t)[repeat]
  pointer[chain] -= 1
  scale = np.where(chain, catalog.successor[0], 1).astype(np.int64)  # item = scale x + shift
  shift = np.where(chain, catalog.successor[1], 0).astype(np.int64)
  open_ = np.flatnonzero(pointer != np.arange(n))
  while open_.size:
    target = pointer[open_]
    # x_t = s_t (s_p x + h_p) + h_t: compose with the target's map (products < 2^62).
    scale_t, shift_t = scale[open_], shift[open_]
    shift[open_] = (scale_t * shift[target] + shift_t) % v
    scale[open_] = (scale_t * scale[target]) % v
    pointer[open_] = pointer[target]
    open_ = open_[pointer[open_] != pointer[pointer[open_]]]
  return (scale * topic_items[pointer] + shift) % v


def _check(name: str, value, ok: bool, allowed: str) -> None:
  if not ok:
    raise ConfigError(f"{name}={value!r}: {allowed}")


def _is_int(value) -> bool:
  return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _is_number(value) -> bool:
  return (isinstance(value, (int, float, np.integer, np.floating))
          and not isinstance(value, bool) and math.isfinite(value))


def check_arguments(*, num_users, num_items, num_topics, zipf_exponent, topics_per_user,
                    topic_concentration, topic_stay_prob, length_log_mean, length_log_std,
                    min_length, max_length, repeat_prob, repeat_window, transition_prob,
                    seed, mean_gap_seconds, horizon_seconds) -> None:
  """Raises one ConfigError naming the first bad argument and what it may be."""
  for name, value in (("num_users", num_users), ("num_items", num_items),
                      ("num_topics", num_topics), ("topics_per_user", topics_per_user),
                      ("min_length", min_length), ("max_length", max_length),
                      ("repeat_window", repeat_window),
                      ("mean_gap_seconds", mean_gap_seconds),
                      ("horizon_seconds", horizon_seconds)):
    _check(name, value, _is_int(value) and value >= 1, "an integer >= 1")
  _check("seed", seed, _is_int(seed) and seed >= 0, "an integer >= 0")
  for name, value in (("num_users", num_users), ("num_items", num_items)):
    _check(name, value, value < 2**31, "below 2**31 (int32 ids)")
  _check("num_topics", num_topics, num_topics <= num_items,
         f"at most num_items={num_items} (every topic holds an item)")
  _check("max_length", max_length, max_length >= min_length,
         f"at least min_length={min_length}")
  for name, value in (("zipf_exponent", zipf_exponent),
                      ("topic_concentration", topic_concentration)):
    _check(name, value, _is_number(value) and value > 0, "a finite number > 0")
  _check("length_log_mean", length_log_mean, _is_number(length_log_mean), "a finite number")
  _check("length_log_std", length_log_std, _is_number(length_log_std) and length_log_std >= 0,
         "a finite number >= 0")
  for name, value in (("topic_stay_prob", topic_stay_prob), ("repeat_prob", repeat_prob),
                      ("transition_prob", transition_prob)):
    _check(name, value, _is_number(value) and 0.0 <= value <= 1.0, "a probability in [0, 1]")
  synthetic.check_catalog_fits(num_items)


def history_lengths(rng: np.random.Generator, num_users: int, log_mean: float, log_std: float,
                    min_length: int, max_length: int) -> np.ndarray:
  """int64 ``[U]`` ``round(exp(Normal(log_mean, log_std)))`` clipped to the range."""
  raw = np.rint(np.exp(log_mean + log_std * rng.standard_normal(num_users)))
  return np.clip(raw, min_length, max_length).astype(np.int64)


def chunk_bounds(lengths: np.ndarray) -> list[tuple[int, int]]:
  """User ranges ``[first, last)`` of about `_CHUNK_INTERACTIONS` events each."""
  offsets = np.concatenate([[0], np.cumsum(lengths)])
  cuts = np.searchsorted(offsets, np.arange(_CHUNK_INTERACTIONS, int(offsets[-1]),
                                            _CHUNK_INTERACTIONS), side="right")
  edges = np.unique(np.concatenate([[0], cuts - 1, [lengths.shape[0]]]))
  edges = edges[(edges >= 0)]
  return [(int(a), int(b)) for a, b in zip(edges[:-1], edges[1:]) if b > a]


def generate_topics(num_users: int = 1_000, num_items: int = 10_000, num_topics: int = 1_000,
                    zipf_exponent: float = ZIPF_EXPONENT, topics_per_user: int = 8,
                    topic_concentration: float = 1.0, topic_stay_prob: float = 0.8,
                    length_log_mean: float = LENGTH_LOG_MEAN,
                    length_log_std: float = LENGTH_LOG_STD, min_length: int = MIN_LENGTH,
                    max_length: int = MAX_LENGTH, repeat_prob: float = REPEAT_PROB,
                    repeat_window: int = 10, transition_prob: float = 0.0, seed: int = 0,
                    mean_gap_seconds: int = 600, horizon_seconds: int = 100_000_000
                    ) -> sources.Interactions:
  """Generates interactions with latent topics and drifting interest (module docstring).

  Args:
    num_users: U >= 1.
    num_items: V >= 1, ids in ``[0, V)``.
    num_topics: K in [1, V]; topic k holds the ranks ``k, k + K, ...``.
    zipf_exponent: s > 0 of the global popularity ``(rank + 1)^-s``.
    topics_per_user: M >= 1 interest slots per user, topics drawn from Q.
    topic_concentration: Dirichlet concentration of the slot weights (small:
      one slot dominates; large: even).
    topic_stay_prob: probability that an event keeps the previous slot.
    length_log_mean: mu of the log-normal history length.
    length_log_std: sigma of the log-normal history length.
    min_length: shortest history (the clip; leave-one-out needs 3).
    max_length: longest history.
    repeat_prob: probability that an event repeats a recent item.
    repeat_window: how many previous items a repeat chooses from.
    transition_prob: probability (of the non-repeats) of the planted successor.
    seed: everything is a function of the arguments and this seed.
    mean_gap_seconds: mean time between two events of a user (gaps uniform in
      ``[1, 2 mean]``).
    horizon_seconds: range of user start times.

  Returns:
    Interactions, user-major and time-ascending, ``num_items=V`` declared.

  Raises:
    ConfigError: one line naming the first bad argument.

  Example:
    >>> data = generate_topics(num_users=4, num_items=50, num_topics=5, seed=1)
    >>> bool((data.item < 50).all()), data.num_items
    (True, 50)
  """
  check_arguments(**{k: v for k, v in locals().items()})
  catalog = make_catalog(num_items, num_topics, zipf_exponent, seed)
  params = TopicParams(topics_per_user, float(topic_concentration), float(topic_stay_prob),
                       float(repeat_prob), repeat_window, float(transition_prob))
  setup = np.random.default_rng([seed, 2])
  lengths = history_lengths(setup, num_users, length_log_mean, length_log_std, min_length,
                            max_length)
  starts = setup.integers(0, horizon_seconds, size=num_users)
  offsets = np.concatenate([[0], np.cumsum(lengths)])
  total = int(offsets[-1])
  user = np.repeat(np.arange(num_users, dtype=np.int32), lengths)
  item = np.empty(total, np.int32)
  timestamp = np.empty(total, np.int64)
  for chunk, (first, last) in enumerate(chunk_bounds(lengths)):
    rng = np.random.default_rng([seed, 2, chunk])
    draws = draw_users(catalog, params, lengths[first:last], rng)
    lo, hi = int(offsets[first]), int(offsets[last])
    item[lo:hi] = draws.items
    gaps = rng.integers(1, 2 * mean_gap_seconds + 1, size=hi - lo)
    times = np.cumsum(gaps)
    # Per user: its start plus the running sum of its own gaps.
    before = np.repeat(times[draws.offsets[:-1]] - gaps[draws.offsets[:-1]], lengths[first:last])
    timestamp[lo:hi] = np.repeat(starts[first:last], lengths[first:last]) + times - before
  return sources.Interactions(user=user, item=item, timestamp=timestamp,
                              num_items=num_items, name="synthetic_topics")


def chunk_draws(num_users: int = 1_000, num_items: int = 10_000, num_topics: int = 1_000,
                zipf_exponent: float = ZIPF_EXPONENT, topics_per_user: int = 8,
                topic_concentration: float = 1.0, topic_stay_prob: float = 0.8,
                length_log_mean: float = LENGTH_LOG_MEAN, length_log_std: float = LENGTH_LOG_STD,
                min_length: int = MIN_LENGTH, max_length: int = MAX_LENGTH,
                repeat_prob: float = REPEAT_PROB, repeat_window: int = 10,
                transition_prob: float = 0.0, seed: int = 0, **unused
                ) -> tuple[TopicCatalog, TopicParams, UserDraws]:
  """The catalog and the first chunk's draws, latent state included, of these arguments.

  The same draws as :func:`generate_topics` makes for the first users (its
  items equal the first interactions of the generated data); what the Bayes
  ceiling reads. Accepts (and ignores) the timing arguments.
  """
  del unused
  catalog = make_catalog(num_items, num_topics, zipf_exponent, seed)
  params = TopicParams(topics_per_user, float(topic_concentration), float(topic_stay_prob),
                       float(repeat_prob), repeat_window, float(transition_prob))
  lengths = history_lengths(np.random.default_rng([seed, 2]), num_users, length_log_mean,
                            length_log_std, min_length, max_length)
  first, last = chunk_bounds(lengths)[0]
  draws = draw_users(catalog, params, lengths[first:last], np.random.default_rng([seed, 2, 0]))
  return catalog, params, draws
