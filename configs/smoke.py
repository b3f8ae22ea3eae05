"""Smoke config: a tiny synthetic catalog that trains in seconds on CPU.

300 items, 200 users, N = 16, next 2 items as labels, 8 simulated devices
(mesh data=8) by default. Used by the tests and as a quick end-to-end check:

  XLA_FLAGS=--xla_force_host_platform_device_count=8 \
    python -m trainer.main --config=configs/smoke.py --workdir=/tmp/smoke
"""

from configs import base


def get_config():
  config = base.get_config()
  config.train_steps = 40
  config.batch_size = 16
  config.eval_batch_size = 64
  config.seq_len = 16
  config.num_targets = 2
  config.mesh.axis_names = ("data",)
  config.mesh.shape = (8,)
  config.mesh.token_axes = ("data",)
  config.model.dim = 16
  config.model.num_layers = 1
  config.model.num_heads = 2
  config.model.mlp_dim = 32
  config.model.dropout_rate = 0.1
  config.optimizer.learning_rate = 3e-3
  config.optimizer.warmup_steps = 5
  config.data.source_options = {
      "num_users": 200, "num_items": 300, "interactions_per_user": 20, "seed": 0}
  config.loss.backend = "xla"
  config.eval.backend = "xla"
  config.eval_every = 20
  config.checkpoint_every = 10
  config.log_every = 5
  config.profile.start_step = 3
  return config
