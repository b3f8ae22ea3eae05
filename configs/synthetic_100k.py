"""Synthetic 10^5-item catalog with latent topics: the CPU leg of issue 39's catalog benchmark.

`synthetic_topics` data (`trainer/data/synthetic_topics.py`, docs/data.md):
popularity exponent 0.697, log-normal history lengths (mu 4.6047, sigma
0.9906, clipped to [18, 2,277]) and repeat rate 0 as measured on ML-1M by
benchmarks/synthetic_stats.py; 1,000 topics of 100 items, 8 interest slots
per user, interest kept with probability 0.8. 20,000 users, about 3.3M
interactions. Its Bayes ceiling (benchmarks/synthetic_ceiling.py, 2,000
users): test NDCG@10 0.40 for the true next-item law given the latent state,
0.022 for popularity.

A smaller model than the ML-1M recipes so that exact full-catalog BCE (with
the item bias, one target per position) trains on 2 CPU cores in about
20-30 minutes: d = 32, 2 blocks, N = 50, batch 64, 500 steps (0.35 steps/s on
8 simulated devices on 2 cores, so about 24 minutes; half an epoch of the
65,000 training windows). The sampled baselines of the benchmark override
`loss.*` only. Evaluation on 2,048 validation users every 250 steps (every
user at the end), history excluded. A 30-step smoke run reached test NDCG@10
0.035 (every user), against 0.023 for popularity
(`benchmarks/ml1m_quality.py`'s `popularity_baseline` on the prepared data).

  XLA_FLAGS=--xla_force_host_platform_device_count=8 \\
    python -m trainer.main --config=configs/synthetic_100k.py --workdir=runs/synthetic_100k
"""

from configs import base


def get_config():
  config = base.get_config()
  config.train_steps = 500
  config.batch_size = 64
  config.eval_batch_size = 256
  config.seq_len = 50
  config.num_targets = 1
  config.mesh.axis_names = ("data",)
  config.mesh.shape = (8,)
  config.mesh.token_axes = ("data",)
  config.model.dim = 32
  config.model.num_layers = 2
  config.model.num_heads = 1
  config.model.mlp_dim = 64
  config.model.dropout_rate = 0.1
  config.model.item_bias = True
  config.optimizer.learning_rate = 1e-3
  config.optimizer.warmup_steps = 50
  config.data.dataset = "synthetic_topics"
  config.data.source_options = {
      "num_users": 20_000, "num_items": 100_000, "num_topics": 1_000, "seed": 0}
  config.loss.backend = "xla"
  config.eval.backend = "xla"
  config.eval.max_batches = 8
  config.eval_every = 250
  config.checkpoint_every = 250
  config.log_every = 50
  return config
