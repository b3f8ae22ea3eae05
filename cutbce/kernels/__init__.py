"""How a tile is computed: the portable XLA path, Pallas TPU kernels, the tile planner.

`xla` (the portable path, and the contract every kernel set honours), `tpu`
(Pallas TPU kernels), `auto` (chosen when lowered), `gpu/` (Pallas GPU
kernels), `tiling` (`TilePlan`, the VMEM planner, chips), `compiler` (TPU
slices compiled for without a TPU). Imports: jax and the loss variants'
elementwise math (`cutbce.variants`); the ops import the kernels, never the
reverse (`gpu/compiled`, which compiles the whole op for a GPU target, is the
one module that imports `cutbce`, and no kernel imports it).
"""
