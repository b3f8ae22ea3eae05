"""MovieLens-1M, SASRec+ as its published code builds and trains it (issue 39).

`configs/ml1m_sasrec_plus.py` is the SASRec+ recipe on this trainer's own
model; test NDCG@10 0.1752 +- 0.0017 over 3 seeds against the published
0.1821. This config is the replica of what the published code
(antklen/sasrec-bert4rec-recsys23, read to learn) does beyond the recipe,
all at once:

- the original SASRec block (`model.block="sasrec"`: LayerNorm on the
  queries only, the residual from the normalized stream, ReLU feed-forward of
  width D with dropout inside, LayerNorm eps 1e-8) instead of pre-LN + GELU
  with a 4D feed-forward;
- positions counted from the window's first item (`model.positions=
  "from_first"`: the code pads on the right);
- its initializers (`model.init="sasrec_plus"`: embeddings, feed-forward and the
  attention's output normal(0.02), the attention's input projections as
  PyTorch's MultiheadAttention makes them, biases 0);
- no gradient clipping (`optimizer.clip_norm=None`: plain Adam);
- up to 100 epochs with the checkpoint of the best validation NDCG@10
  (4,000 steps of 128 users, about 85 epochs, evaluated every 125 steps,
  about 2.6 epochs; the code evaluates every epoch and stops 10 epochs after
  its best).

Seeds 0, 1, 2 (8 simulated CPU devices): test NDCG@10 0.1784 +- 0.0011
(seed 0: 0.1793, best validation 0.1884 at step 4,000), against A's
0.1752 +- 0.0017 and the published 0.1821 (docs/results.md, "SASRec+ as its
code does it"). One change at a time on A, the initializers alone
(`--set model.init='sasrec_plus'`, 0.1826 +- 0.0017) do better than all six
together, mostly through the item and position tables' normal(0.02)
(`--set model.embedding_std=0.02` alone: 0.1806 +- 0.0008, 3 seeds); the
original block alone does worse than A, and no clipping changes nothing on
A (the gradient norm stays under 1.0). The replica with A's block instead
(`--set model.block='pre_ln' --set model.mlp_dim=256`) reaches 0.1821 on
seed 0, the published figure: the original block is what holds it back.

  python benchmarks/ml1m_quality.py train --config configs/ml1m_sasrec_plus_replica.py \\
      --workdir runs/ml1m_replica --out docs/results/ml1m_quality/sasrec_plus_replica.json
"""

from configs import ml1m_sasrec_plus


def get_config():
  config = ml1m_sasrec_plus.get_config()
  config.model.block = "sasrec"
  config.model.positions = "from_first"
  config.model.init = "sasrec_plus"
  config.model.mlp_dim = 64
  config.optimizer.clip_norm = None
  config.train_steps = 4_000
  config.eval_every = 125
  config.checkpoint_every = 125
  return config
