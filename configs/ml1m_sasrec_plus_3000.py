"""MovieLens-1M, SASRec+ with 3,000 sampled negatives, as its code draws them (issue 39).

SASRec+ reports test NDCG@10 0.1857 with a sampled softmax over 3,000
negatives (against 0.1821 for the full softmax): its code
(antklen/sasrec-bert4rec-recsys23, `+dataset.num_negatives=3000`) draws,
per training sequence, 3,000 distinct items outside the sequence's window,
shared by the window's positions, and scores each position's next item
against them (softmax CE, no logQ correction). On this trainer:
`loss.kind="sampled_softmax"`, `loss.negatives_per="sequence"` (k distinct
items per sequence, Gumbel top-k), `loss.exclude="window"`, on the replica
of SASRec+'s model and training (`configs/ml1m_sasrec_plus_replica.py`).

  python benchmarks/ml1m_quality.py train --config configs/ml1m_sasrec_plus_3000.py \\
      --workdir runs/ml1m_sasrec_plus_3000 --out docs/results/ml1m_quality/sasrec_plus_3000.json
"""

from configs import ml1m_sasrec_plus_replica


def get_config():
  config = ml1m_sasrec_plus_replica.get_config()
  config.loss.kind = "sampled_softmax"
  config.loss.num_negatives = 3_000
  config.loss.negatives_per = "sequence"
  config.loss.exclude = "window"
  config.loss.sampler = "uniform"
  config.loss.logq = False
  return config
