"""CutBCE: exact binary cross-entropy over huge catalogs without `[T, V]` logits."""

from cutbce.api import cut_bce, target_ranks
from cutbce.kernels.tiling import TilePlan
from cutbce.metrics import rank_metrics
from cutbce.reference import dense_bce
from cutbce.stats import Stats

try:  # The planner lands with the TPU kernels.
  from cutbce.kernels.tiling import plan_tiles
except ImportError:  # pragma: no cover
  pass

__all__ = [
    "cut_bce", "dense_bce", "target_ranks", "rank_metrics", "Stats", "TilePlan", "plan_tiles",
]
__version__ = "0.1.0"
