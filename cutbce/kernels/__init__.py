"""How a tile is computed: the portable XLA path, Pallas TPU kernels, the tile planner."""
