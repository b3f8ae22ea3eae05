"""GPU kernel sets: Mosaic GPU (`backend="pallas_gpu"`) and Pallas Triton (`"pallas_triton"`).

`mosaic` is the kernel set of "pallas_gpu" (TMA, wgmma, one warpgroup per
CTA; `mosaic_ops` the primitives whose interpreted form differs,
`mosaic_plan` its planner); `triton` the kernel set of "pallas_triton", the
fused Pallas Triton kernels it replaces (Pallas Triton is deprecated
upstream), kept until a GPU run shows the Mosaic ones faster, and the set
the Mosaic one delegates to for what it does not take yet. Both honour the
backend contract written in `cutbce/kernels/xla.py`. `plan` is the Triton
planner and the device planned for, `targets` the NVIDIA target configs the
kernels are compiled for without a GPU, `compiled` the loss compiled for a
target, `ptx` what the compiler made of the Mosaic kernels (PTX, ptxas).
Imports: `targets` and `pieces` nothing of cutbce; `plan` targets and the
tiling types; `mosaic_plan` plan and targets; `mosaic_ops` pieces;
`mosaic_kernels` mosaic_ops and mosaic_plan; `triton` plan, pieces and the
variants; `mosaic` the kernel modules and triton; `compiled` the ops
(`cutbce`) and is imported by none of them. Design and compiled evidence:
docs/kernels.md.
"""

from cutbce.kernels.gpu.plan import target_gpu  # noqa: F401
