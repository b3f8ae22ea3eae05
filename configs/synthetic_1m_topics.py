"""Synthetic 10^6-item catalog with latent topics: the GPU leg of issue 39's catalog benchmark.

`configs/synthetic_1m.py` (model, mesh data=2 x model=4, N = 100, next 4
items) on `synthetic_topics` data instead of planted successors: the ML-1M
statistics of `configs/synthetic_100k.py` (exponent 0.697, log-normal
lengths, no repeats), 10,000 topics of 100 items (the same topic size as at
10^5, so the two ceilings are comparable), 60,000 users, about 9.7M
interactions (generated in about 3 s). Bayes ceiling
(benchmarks/synthetic_ceiling.py, 2,000 users): test NDCG@10 0.41 for the
true law given the latent state, 0.011 for popularity.

  python -m trainer.main --config=configs/synthetic_1m_topics.py --workdir=/tmp/syn1m_topics
"""

from configs import synthetic_1m


def get_config():
  config = synthetic_1m.get_config()
  config.data.dataset = "synthetic_topics"
  config.data.source_options = {
      "num_users": 60_000, "num_items": 1_000_000, "num_topics": 10_000, "seed": 0}
  return config
