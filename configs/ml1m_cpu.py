"""MovieLens-1M on 8 simulated CPU devices, sized for about 20 minutes on 2 cores (`make train`).

The SASRec+ training of `configs/ml1m_sasrec_plus.py` (one window per user
per epoch, the most recent one; next-item cut softmax CE over the full
catalog; d = 64, 2 blocks, dropout 0.1; Adam 1e-3 constant, batch 128),
with N = 100 instead of 200 (half the step: 1.8-1.9 steps/s on 2 idle cores
against 1.1) and 2,000 steps. Evaluation on every validation user every 500
steps, and on validation and test at the end (full catalog, history
excluded), from the checkpoint with the best validation NDCG@10.

One run (seed 0, docs/results/ml1m_quality/sasrec_plus_n100_2000steps.json):
test NDCG@10 0.1609, HR@10 0.2767, MRR 0.1402 (validation at steps 500 to
2,000: 0.119 / 0.150 / 0.164 / 0.169), against 0.153 for the previous
`make train` (configs/ml1m.py with an item bias, 4,000 steps, 13.4 minutes).
Seeds 1 and 2 (`--set seed=S`, docs/results/ml1m_quality/losses/): 0.1643 and
0.1649, so 0.1634 +- 0.0022 over three.
The best recipes, `configs/ml1m_best.py` (0.1924) and
`configs/ml1m_best_bce.py` (0.1882), take hours on 2 cores: a GPU's job.

  XLA_FLAGS=--xla_force_host_platform_device_count=8 \\
    python -m trainer.main --config=configs/ml1m_cpu.py --workdir=/tmp/ml1m_cpu
"""

from configs import ml1m_sasrec_plus


def get_config():
  config = ml1m_sasrec_plus.get_config()
  config.seq_len = 100
  config.train_steps = 2_000
  config.eval_every = 500
  config.checkpoint_every = 500
  config.log_every = 50
  return config
