"""Synthetic 10^6-item catalog: the scale test of full-catalog BCE.

Zipf popularity with planted item-to-item transitions (so a model can beat a
popularity ranking), 200,000 users x 60 events, 1,000,000 items. N = 100,
next 4 items as labels. Mesh: data=2 x model=4 on 8 devices: the batch is
split over both axes, the item table by rows over "model". Evaluation on
2,048 validation users every 2,000 steps (all users at the end).

  python -m trainer.main --config=configs/synthetic_1m.py --workdir=/tmp/syn1m
"""

from configs import base


def get_config():
  config = base.get_config()
  config.train_steps = 10_000
  config.batch_size = 256
  config.eval_batch_size = 256
  config.seq_len = 100
  config.num_targets = 4
  config.mesh.axis_names = ("data", "model")
  config.mesh.shape = (2, 4)
  config.mesh.token_axes = ("data", "model")
  config.mesh.vocab_axis = "model"
  config.model.dim = 64
  config.model.num_layers = 2
  config.model.num_heads = 2
  config.model.mlp_dim = 256
  config.model.dropout_rate = 0.1
  config.optimizer.learning_rate = 1e-3
  config.optimizer.warmup_steps = 500
  config.optimizer.schedule = "cosine"
  config.data.dataset = "synthetic"
  config.data.source_options = {
      "num_users": 200_000, "num_items": 1_000_000, "interactions_per_user": 60, "seed": 0}
  config.eval.max_batches = 8
  config.eval_every = 2_000
  config.checkpoint_every = 1_000
  config.log_every = 100
  return config
