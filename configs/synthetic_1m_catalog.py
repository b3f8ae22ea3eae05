"""Issue 39's catalog benchmark at 10^6 items: the 10^5 recipe on a 10x catalog (a GPU's run).

`configs/synthetic_100k.py`'s model, batch, optimizer and evaluation (d = 32,
2 blocks, N = 50, batch 64, one target, item bias, every loss on the same
model) on the `synthetic_topics` data of `configs/synthetic_1m_topics.py`:
1,000,000 items in 10,000 topics of 100, 60,000 users, about 9.7M
interactions, the same ML-1M statistics (Bayes ceiling: test NDCG@10 0.41,
popularity 0.011). `benchmarks/gpu_run.py device --runs catalog_1m_...` runs
the entries of `benchmarks/catalog_queue.py` on one GPU (mesh data=1); on 8
simulated CPU devices `python benchmarks/catalog_queue.py --catalog 1m` (an
exact step scores 3,200 positions against 10^6 items: hours on 2 cores).

  python -m trainer.main --config=configs/synthetic_1m_catalog.py --workdir=runs/catalog_1m/x
"""

from configs import synthetic_100k, synthetic_1m_topics


def get_config():
  config = synthetic_100k.get_config()
  config.data.source_options = dict(synthetic_1m_topics.get_config().data.source_options)
  return config
