"""MovieLens-1M quality run: SASRec with full-catalog BCE (CutBCE), leave-one-out.

Data: the SASRec preparation of ML-1M (items with >= 5 ratings: 6,040 users,
3,416 items, 999,611 interactions), leave-one-out split (validation = second
to last item, test = last). Evaluation ranks the held-out item among all
items with the user's history excluded (filter-seen), recall/ndcg/hit@10/50/100
and mrr. Mesh: 8 devices, pure data parallelism, table replicated.

  python -m trainer.main --config=configs/ml1m.py --workdir=/tmp/ml1m
"""

from configs import base


def get_config():
  config = base.get_config()
  config.train_steps = 20_000
  config.batch_size = 128
  config.eval_batch_size = 512
  config.seq_len = 200
  config.num_targets = 1
  config.mesh.axis_names = ("data",)
  config.mesh.shape = (8,)
  config.mesh.token_axes = ("data",)
  config.model.dim = 64
  config.model.num_layers = 2
  config.model.num_heads = 1
  config.model.mlp_dim = 256
  config.model.dropout_rate = 0.2
  config.optimizer.learning_rate = 1e-3
  config.optimizer.warmup_steps = 200
  config.optimizer.schedule = "cosine"
  config.data.dataset = "ml-1m"
  config.data.source_options = {}
  config.data.split = "loo"
  config.eval.filter_seen = True
  config.eval_every = 2_000
  config.checkpoint_every = 1_000
  config.log_every = 100
  return config
