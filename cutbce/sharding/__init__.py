"""The CutBCE op on a device mesh: shard_map, collectives outside the vocabulary loop.

`shard_map` (`sharded_cut_bce`, `sharded_target_ranks`), `softmax`
(`sharded_cut_softmax_ce`), `topk` (`sharded_top_k`), `layout` (which mesh
axes hold tokens and the vocabulary), `hlo` (collectives read from a compiled
program). Imports: the op (`cutbce.api`, `backends`, `tiled`, `sparse`, ...)
and its kernel sets; nothing here is imported by the op.
"""

from cutbce.sharding.hlo import CollectiveReport, collective_report
from cutbce.sharding.layout import Layout
from cutbce.sharding.shard_map import sharded_cut_bce, sharded_target_ranks
from cutbce.sharding.softmax import sharded_cut_softmax_ce
from cutbce.sharding.topk import sharded_top_k

__all__ = [
    "sharded_cut_bce", "sharded_cut_softmax_ce", "sharded_target_ranks", "sharded_top_k", "collective_report",
    "CollectiveReport", "Layout",
]
