"""MovieLens-1M on 8 simulated CPU devices, sized to finish in < 30 min on 2 cores.

`configs/ml1m.py` with fewer steps and a shorter history: N = 50, 2,000
steps of 128 sequences (about 0.5 s each on 2 cores), a higher peak rate, evaluation on every user at the end (validation and
test, full catalog, history excluded). A converged run is `configs/ml1m.py`.

  XLA_FLAGS=--xla_force_host_platform_device_count=8 \
    python -m trainer.main --config=configs/ml1m_cpu.py --workdir=/tmp/ml1m_cpu
"""

from configs import ml1m


def get_config():
  config = ml1m.get_config()
  config.train_steps = 2_000
  config.seq_len = 50
  config.optimizer.learning_rate = 2e-3
  config.optimizer.warmup_steps = 100
  config.eval_every = 500
  config.checkpoint_every = 500
  config.log_every = 25
  return config
