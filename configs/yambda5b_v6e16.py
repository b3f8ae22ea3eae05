"""Yambda-5B on a Cloud TPU v6e-16 (4 hosts): billions of events, ~9.4M items.

Yambda-5B's listens (4.79 billion events of all kinds over 9.39 million
items in the full release; the listens with played_ratio_pct >= 50 are the
training events here, as in configs/yambda50m_v6e8.py) are prepared out of
core by process 0 (DuckDB, `data.prepare_memory_limit`, spilling to the
host's temporary folder) into a bucket that every host reads, with the event
arrays cut by user into 16 shards: each of the 4 processes reads only its 4
shards (a quarter of the events). The same model and loss as the 50M config,
a larger global batch, and the mesh data=2 x model=8: the item table
(9.39M x 128, padded to a multiple of 8 rows) and its AdamW moments are split
over 8 chips.

  launch/tpu_vm.sh --tpu=NAME --zone=ZONE -- --config=configs/yambda5b_v6e16.py \
    --workdir=gs://BUCKET/yambda5b --config.data.source_options.path=/data/yambda/5b \
    --config.data.prepared_dir=gs://BUCKET/yambda5b-prepared
"""

from configs import yambda50m_v6e8


def get_config():
  config = yambda50m_v6e8.get_config()
  config.batch_size = 128
  config.eval_batch_size = 512
  config.mesh.shape = (2, 8)
  # The raw parquet folder on worker 0 (override); the prepared shards in a
  # bucket every host reads (override with your bucket).
  config.data.source_options = {
      "path": "/data/yambda/5b", "event": "listens", "min_played_ratio": 50}
  config.data.prepared_dir = "gs://BUCKET/yambda5b-prepared"
  # Out-of-core preparation on worker 0: DuckDB's buffers stay under this
  # (a v6e host has hundreds of GB; 64 GB leaves the rest to the trainer).
  config.data.prepare_memory_limit = "64GB"
  # A multiple of the 4 processes: each reads 4 of the 16 shards.
  config.data.prepare_shards = 16
  config.data.num_threads = 16
  # Yambda-5B holds 9.39 million items (what `python -m trainer.compile`
  # compiles for, rounded up; the prepared count is what a run uses).
  config.compile.num_items = 9_390_000
  return config
