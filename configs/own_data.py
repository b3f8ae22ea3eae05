"""Your own interactions: SASRec on a table of (user, item, time) rows.

The `files` source (docs/data.md, "Your own data") reads parquet, CSV, TSV or
JSON lines; name the file, folder or glob and the three columns on the
command line:

  XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m trainer.main \\
    --config=configs/own_data.py --workdir=runs/mine \\
    --config.data.source_options.path='events/*.parquet' \\
    --config.data.source_options.user_col=user_id \\
    --config.data.source_options.item_col=item_id \\
    --config.data.source_options.time_col=timestamp

then `python -m trainer.recommend --workdir=runs/mine --top_k=10
--out=recs.jsonl` (raw ids in, raw ids out). Every device holds a data shard
(`mesh.shape = (-1,)`: all devices on the "data" axis) and the whole item
table; for catalogs past a few million items split the table too (see
docs/trainer.md, "Choosing a mesh"). The recipe is configs/ml1m.py's at a
smaller step budget: leave-one-out split, next 4 items as labels, N = 50.
"""

from configs import base


def get_config():
  config = base.get_config()
  config.data.dataset = "files"
  config.data.source_options = {}
  config.data.min_item_count = 5
  config.data.split = "loo"
  config.mesh.axis_names = ("data",)
  config.mesh.shape = (-1,)
  config.mesh.token_axes = ("data",)
  config.train_steps = 2_000
  config.batch_size = 64
  config.eval_batch_size = 256
  config.seq_len = 50
  config.num_targets = 4
  config.model.dim = 64
  config.model.num_layers = 2
  config.model.num_heads = 1
  config.model.mlp_dim = 256
  config.model.dropout_rate = 0.1
  config.optimizer.learning_rate = 2e-3
  config.optimizer.warmup_steps = 100
  config.eval_every = 500
  config.checkpoint_every = 500
  config.log_every = 50
  return config
