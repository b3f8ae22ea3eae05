"""CutBCE: exact binary cross-entropy over huge catalogs without `[T, V]` logits.

The op and its public names live here: `api` (`cut_bce`, `target_ranks`: checks,
flattening, the custom VJPs' entry), `backends` (the kernel-set registry and
"auto"), `tiled` (the custom VJPs), `sparse` (corrections at target and
excluded ids), `variants`, `softmax` (`cut_softmax_ce`), `topk`, `reference`
(the dense oracles), `inputs`, `stats`, `metrics`; `kernels/` computes a tile,
`sharding/` runs the op on a mesh. Imports: jax and NumPy, never `trainer`.
"""

from cutbce.api import cut_bce, target_ranks
from cutbce.kernels.tiling import TilePlan, plan_tiles
from cutbce.metrics import rank_metrics
from cutbce.reference import dense_bce, dense_softmax_ce
from cutbce.softmax import cut_softmax_ce
from cutbce.stats import Stats
from cutbce.topk import top_k
from cutbce.variants import LossOptions

__all__ = [
    "cut_bce", "dense_bce", "cut_softmax_ce", "dense_softmax_ce", "target_ranks", "top_k", "rank_metrics", "Stats", "TilePlan",
    "plan_tiles", "LossOptions",
]
__version__ = "0.1.0"
