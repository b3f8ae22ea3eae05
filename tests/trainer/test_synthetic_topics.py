"""The topic generator (`synthetic_topics`): determinism, stated statistics, ceiling, errors."""

import hashlib
import json
import math

import numpy as np
import pytest

from configs import synthetic_100k, synthetic_1m_catalog, synthetic_1m_topics
from trainer.config import keys
from trainer.config.schema import ConfigError
from trainer.data import prepare, sources, synthetic, synthetic_ceiling, synthetic_topics

SMALL = dict(num_users=300, num_items=2_000, num_topics=20, seed=3)


def test_deterministic_and_seeded():
  a = synthetic_topics.generate_topics(**SMALL)
  b = synthetic_topics.generate_topics(**SMALL)
  c = synthetic_topics.generate_topics(**{**SMALL, "seed": 4})
  for field in ("user", "item", "timestamp"):
    np.testing.assert_array_equal(getattr(a, field), getattr(b, field))
  assert not np.array_equal(a.item[:500], c.item[:500])
  # What the ceiling reads is what was generated.
  _, _, draws = synthetic_topics.chunk_draws(**SMALL)
  np.testing.assert_array_equal(draws.items, a.item[:draws.items.shape[0]])
  # User-major, time strictly ascending within a user, ids in the catalog.
  same_user = a.user[1:] == a.user[:-1]
  assert (np.diff(a.user) >= 0).all() and (np.diff(a.timestamp)[same_user] > 0).all()
  assert a.num_items == 2_000 and 0 <= a.item.min() and a.item.max() < 2_000


def test_registered_as_a_source_and_the_old_generator_unchanged():
  data = sources.load_interactions("synthetic_topics", **SMALL)
  assert data.name == "synthetic_topics" and prepare.default_min_item_count(data.name) == 0
  options = prepare.full_source_options("synthetic_topics", {"num_items": 50})
  assert options["zipf_exponent"] == synthetic_topics.ZIPF_EXPONENT
  # The `synthetic` source draws exactly what it drew before this generator existed.
  old = synthetic.generate_synthetic(num_users=50, num_items=300, interactions_per_user=20,
                                     seed=3)
  digest = hashlib.sha256(old.item.tobytes() + old.user.tobytes()
                          + old.timestamp.tobytes()).hexdigest()
  assert digest == "5fc64994afcc5b86fb10363e8e762cfac147d9e56ffde79891eb6a586b056a8b"


@pytest.mark.parametrize("exponent", [synthetic_topics.ZIPF_EXPONENT, 1.2])
def test_popularity_exponent_recovered(exponent):
  data = synthetic_topics.generate_topics(num_users=2_000, num_items=2_000, num_topics=20,
                                          zipf_exponent=exponent, seed=0)
  # The fit of benchmarks/synthetic_stats.py: OLS of log count on log rank.
  ranked = np.sort(np.bincount(data.item, minlength=2_000))[::-1][:500].astype(np.float64)
  slope = np.polyfit(np.log(np.arange(1, 501)), np.log(ranked), 1)[0]
  assert abs(-slope - exponent) < 0.05, (slope, exponent)


def test_history_lengths_follow_the_stated_lognormal():
  mu, sigma = synthetic_topics.LENGTH_LOG_MEAN, synthetic_topics.LENGTH_LOG_STD
  data = synthetic_topics.generate_topics(num_users=5_000, num_items=1_000, num_topics=10,
                                          seed=1)
  lengths = np.bincount(data.user)
  assert lengths.min() >= synthetic_topics.MIN_LENGTH
  assert lengths.max() <= synthetic_topics.MAX_LENGTH
  for q, z in ((0.25, -0.6745), (0.5, 0.0), (0.75, 0.6745), (0.9, 1.2816)):
    expected = math.exp(mu + z * sigma)
    assert abs(np.quantile(lengths, q) / expected - 1) < 0.06, (q, np.quantile(lengths, q))


def test_repeats_and_successors_at_their_rates():
  data = synthetic_topics.generate_topics(num_users=400, num_items=100_000, num_topics=100,
                                          repeat_prob=0.3, transition_prob=0.4, seed=2)
  catalog = synthetic_topics.make_catalog(100_000, 100, synthetic_topics.ZIPF_EXPONENT, 2)
  same_user = data.user[1:] == data.user[:-1]
  follows = (data.item[1:] == catalog.next_in_chain(data.item[:-1]))[same_user].mean()
  assert abs(follows - 0.7 * 0.4) < 0.02
  repeated = []
  for u in range(100):
    items = data.item[data.user == u]
    repeated += [items[t] in items[max(0, t - 10):t] for t in range(1, items.shape[0])]
  assert 0.3 <= np.mean(repeated) < 0.36  # plus the chance that a draw repeats


def _brute_force_ndcg(catalog, params, draws, user, train_counts):
  """Expected NDCG@10 of the true law and of popularity over the whole catalog, naively."""
  ids, probs = synthetic_ceiling.next_item_law(catalog, params, draws, user)
  law = np.zeros(catalog.num_items)
  law[ids] = probs
  first, end = draws.offsets[user], draws.offsets[user + 1]
  allowed = np.ones(catalog.num_items, bool)
  allowed[draws.items[first:end - 1]] = False
  out = []
  for scores in (law, train_counts.astype(np.float64)):
    total = 0.0
    for v in np.flatnonzero(law):
      others = allowed.copy()
      others[v] = False
      rank = 1 + int(np.sum(others & (scores >= scores[v])))
      total += law[v] * (1 / math.log2(1 + rank) if rank <= 10 else 0.0)
    out.append(total)
  return out


def test_ceiling_matches_brute_force_and_is_well_above_popularity():
  options = dict(num_users=400, num_items=3_000, num_topics=30, repeat_prob=0.1,
                 transition_prob=0.2, seed=5)
  data = synthetic_topics.generate_topics(**options)
  lengths = np.bincount(data.user)
  counts = synthetic_ceiling.train_counts_loo(data.item.astype(np.int64), lengths, 3_000)
  catalog, params, draws = synthetic_topics.chunk_draws(**options)
  for user in range(3):
    ids, probs = synthetic_ceiling.next_item_law(catalog, params, draws, user)
    assert abs(probs.sum() - 1) < 1e-9
    first, end = draws.offsets[user], draws.offsets[user + 1]
    fast = synthetic_ceiling.user_ndcg(ids, probs, draws.items[first:end - 1],
                                       int(draws.items[end - 1]), np.sort(counts), counts, 10)
    slow = _brute_force_ndcg(catalog, params, draws, user, counts)
    np.testing.assert_allclose([fast[0], fast[2]], slow, rtol=1e-9)
  result = synthetic_ceiling.bayes_ceiling(options, num_users=400, data=data)
  assert result["users"] == 400
  # Learnable: knowing the topics beats popularity several times over, and
  # the realized value (one target per user) agrees with the expectation.
  assert result["ceiling_ndcg@10"] > 0.25
  assert result["ceiling_ndcg@10"] > 4 * result["popularity_ndcg@10"]
  assert abs(result["ceiling_ndcg@10_realized"] - result["ceiling_ndcg@10"]) < 0.06


@pytest.mark.parametrize("bad, named", [
    ({"num_users": 0}, "num_users=0: an integer >= 1"),
    ({"num_topics": 5_000}, "num_topics=5000: at most num_items=2000"),
    ({"zipf_exponent": 0.0}, "zipf_exponent=0.0: a finite number > 0"),
    ({"topic_concentration": float("nan")}, "topic_concentration=nan: a finite number > 0"),
    ({"topic_stay_prob": 1.5}, "topic_stay_prob=1.5: a probability in [0, 1]"),
    ({"repeat_prob": -0.1}, "repeat_prob=-0.1: a probability in [0, 1]"),
    ({"min_length": 50, "max_length": 20}, "max_length=20: at least min_length=50"),
    ({"seed": -1}, "seed=-1: an integer >= 0"),
    ({"num_items": 2.5}, "num_items=2.5: an integer >= 1"),
])
def test_bad_arguments_raise_one_config_error(bad, named):
  with pytest.raises(ConfigError) as error:
    synthetic_topics.generate_topics(**{**SMALL, **bad})
  message = str(error.value)
  assert message.startswith(named) and "\n" not in message, message


@pytest.mark.parametrize("module", [synthetic_100k, synthetic_1m_topics, synthetic_1m_catalog])
def test_configs_check(module):
  config = module.get_config()
  keys.check(config, keys.Context(device_count=8))
  config.data.source_options.num_topics = 0
  with pytest.raises(ConfigError, match=r"config.data.source_options.num_topics=0"):
    keys.check(config, keys.Context(device_count=8))


def test_doctests():
  import doctest  # pylint: disable=import-outside-toplevel
  for module in (synthetic_topics, synthetic_ceiling):
    failures, _ = doctest.testmod(module)
    assert failures == 0, module.__name__


def test_prepared_from_the_command_line(tmp_path, capsys):
  """`python -m trainer.data --dataset synthetic_topics` takes the topic flags, leaves
  the others at the source's defaults (ML-1M's exponent, not `synthetic`'s 1.0), and
  refuses a bad one in one line."""
  from trainer.data import __main__ as cli  # pylint: disable=import-outside-toplevel
  flags = ["--num-users", "40", "--num-items", "300", "--num-topics", "12",
           "--topics-per-user", "2", "--seed", "5"]
  assert cli.main(["--dataset", "synthetic_topics", "--out", str(tmp_path / "a"), *flags]) == 0
  summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  want = synthetic_topics.generate_topics(num_users=40, num_items=300, num_topics=12,
                                          topics_per_user=2, seed=5)
  assert summary["num_items"] == 300 and summary["num_interactions"] == len(want.item)
  args = cli.parse_args(["--dataset", "synthetic_topics", "--out", "x", *flags])
  assert cli.source_options(args) == {"num_users": 40, "num_items": 300, "num_topics": 12,
                                      "topics_per_user": 2, "topic_stay_prob": 0.8, "seed": 5}
  assert cli.source_options(cli.parse_args(["--dataset", "synthetic", "--out", "x"]))[
      "zipf_exponent"] == 1.0
  code = cli.main(["--dataset", "synthetic_topics", "--out", str(tmp_path / "b"),
                   "--num-topics", "0"])
  assert code == 2 and capsys.readouterr().err.startswith("bad config: --num-topics=0")
  code = cli.main(["--dataset", "synthetic_topics", "--out", str(tmp_path / "c"),
                   "--num-items", "10", "--num-topics", "20"])
  err = capsys.readouterr().err
  assert code == 2 and "num_topics=20" in err and len(err.strip().splitlines()) == 1, err
