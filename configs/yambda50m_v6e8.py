"""Yambda-50M on a Cloud TPU v6e-8: the paper's setting.

876,939 items (the listens of Yambda-50M with played_ratio_pct >= 50, from
its parquet files in a local folder you download yourself),
global batch 64, N = 256, the next 8 items of each position as labels,
bfloat16 compute, Pallas TPU kernels (backend "auto" picks them on TPU).
Global temporal split (test window, validation window, a gap before each).

Mesh: the 8 chips as data=2 x model=4. Tokens (64 x 256 = 16,384 positions)
are split over both axes; the item table (876,939 x 128, padded to a multiple
of 4 rows) by rows over "model", so each chip holds a quarter of the table
and of its AdamW moments, and the loss gathers hidden states over "model"
once per step.

  launch/tpu_vm.sh --tpu=NAME --zone=ZONE -- --config=configs/yambda50m_v6e8.py \
    --workdir=gs://BUCKET/yambda50m --config.data.source_options.path=/data/yambda/50m
"""

from configs import base

DAY = 86_400  # Yambda timestamps are in seconds.


def get_config():
  config = base.get_config()
  config.train_steps = 100_000
  config.batch_size = 64
  config.eval_batch_size = 256
  config.seq_len = 256
  config.num_targets = 8
  config.mesh.axis_names = ("data", "model")
  config.mesh.shape = (2, 4)
  config.mesh.token_axes = ("data", "model")
  config.mesh.vocab_axis = "model"
  config.model.dim = 128
  config.model.num_layers = 2
  config.model.num_heads = 2
  config.model.mlp_dim = 512
  config.model.dropout_rate = 0.1
  config.model.dtype = "bfloat16"
  config.optimizer.learning_rate = 1e-3
  config.optimizer.warmup_steps = 2_000
  config.optimizer.schedule = "cosine"
  config.data.dataset = "yambda"
  # The folder of the Yambda-50M parquet files (override on the command line).
  config.data.source_options = {
      "path": "/data/yambda/50m", "event": "listens", "min_played_ratio": 50}
  config.data.min_item_count = 1
  config.data.split = "gts"
  config.data.split_options = {
      "test_window": DAY, "validation_window": DAY, "gap": 30 * 60}
  config.data.num_threads = 8
  config.data.prefetch_buffer_size = 16
  config.loss.backend = "auto"
  config.eval.backend = "auto"
  config.eval.max_batches = 64
  config.eval_every = 5_000
  config.checkpoint_every = 2_500
  config.log_every = 100
  config.profile = {"start_step": 100, "num_steps": 5}
  # Yambda-50M's listens with played_ratio_pct >= 50 hold 876,939 items (the
  # paper's catalog): what `python -m trainer.compile` compiles for.
  config.compile.num_items = 876_939
  return config
