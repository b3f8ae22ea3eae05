"""Ciao, 105,114 real items: the catalog benchmark's real dataset (issue 39).

Ciao's ratings with times (`trainer/data/ciao.py`; docs/data.md says where to
get `rating_with_timestamp.mat`): 7,375 users, 105,114 products, 284,086
ratings from 2000 to 2011, every product kept (`min_item_count` 1: the
catalog's size is the point), leave-one-out. A long tail: 64% of the products
are rated once, so many test items were never seen in training by any loss.

The model of `configs/synthetic_100k.py` (d = 32, 2 blocks, N = 50, batch
64, item bias, 500 steps) with two changes for sparse data, dropout 0.5 and
learning rate 3e-3: chosen on validation NDCG@10 (2,048 users at step 500,
every user at the end) from 500-step runs of sampled softmax with 128
negatives, the baseline, not the exact loss: 1e-3 / 3e-3 / 1e-2 at dropout
0.1 gave 0.0092 / 0.0108 / 0.0095, 3e-3 at dropout 0.5 0.0125 (every user:
0.0157 and 0.0167 for the last two). The first recipe's runs (dropout 0.1,
1e-3) are in docs/results/catalog/ciao/first_recipe/. 10,111 training windows
(158 steps an epoch), validation on 2,048 users every 50 steps.
Put the file in `$CUTBCE_DATA/ciao/` (default `~/.cache/cutbce/ciao/`) or set
`data.source_options.path`:

  XLA_FLAGS=--xla_force_host_platform_device_count=8 \\
    python benchmarks/catalog_queue.py --catalog ciao --only exact_bce
"""

from configs import synthetic_100k
from trainer.data import ciao


def get_config():
  config = synthetic_100k.get_config()
  config.data.dataset = "ciao"
  config.data.source_options = {"path": ciao.default_path()}
  config.data.min_item_count = 1
  config.model.dropout_rate = 0.5
  config.optimizer.learning_rate = 3e-3
  config.eval_every = 50
  config.checkpoint_every = 50
  return config
