"""MovieLens-1M, the best BCE recipe: `configs/ml1m_best.py` with full-catalog BCE.

Everything of `configs/ml1m_best.py` (SASRec+ training, d = 128, 3 blocks,
2 heads, dropout 0.3, 5,000 steps), with the mission's loss: binary
cross-entropy of the next item against every other item of the catalog,
exact (`cut_bce`), in place of the softmax cross-entropy.

Three seeds, test split, all 6,040 users (ran on one H200,
docs/results/ml1m_quality/h200/bce_capacity_seeds.json): NDCG@10 0.1882 +-
0.0007, HR@10 0.3251 +- 0.0011, MRR 0.1612 +- 0.0005: 0.004 under the
softmax CE of the same recipe, above every published SASRec row on this data
(SASRec+ full softmax CE 0.1821, gSASRec 0.1726).

  python benchmarks/ml1m_quality.py seeds --config configs/ml1m_best_bce.py \\
      --seeds 0 1 2 --workdir runs/ml1m_best_bce --out docs/results/ml1m_best_bce.json
"""

from configs import ml1m_best


def get_config():
  config = ml1m_best.get_config()
  config.loss.kind = "bce"
  return config
