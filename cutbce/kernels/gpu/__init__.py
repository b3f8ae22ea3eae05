"""Kernel set of `backend="pallas_gpu"`: fused Pallas GPU (Triton) kernels.

Honours the backend contract written in `cutbce/kernels/xla.py` (forward,
backward, forward_backward, rank_logits, rank_counts, softmax_forward, softmax_backward,
default_plan, unsupported_reason).
`kernels` holds the Pallas kernels, `plan` the tile planner (from the
device's description), `targets` the NVIDIA target configs they are compiled
for without a GPU, `compiled` the loss compiled for a target. Imports:
`targets` nothing of cutbce, `plan` targets and the tiling types, `kernels`
the plan, `compiled` the ops (`cutbce`) and is imported by none of them.
Design and compiled memory: docs/kernels.md.
"""

from cutbce.kernels.gpu.kernels import (  # noqa: F401
    MAX_FIXED_COLUMNS,
    MAX_SOFTMAX_EXCLUDE,
    SUPPORTED_DTYPES,
    backward,
    default_plan,
    forward,
    forward_backward,
    plan_problem,
    rank_counts,
    rank_logits,
    softmax_backward,
    softmax_forward,
    unsupported_reason,
)
from cutbce.kernels.gpu.plan import target_gpu  # noqa: F401
