"""Tile sizes: the `TilePlan` every backend takes, and the planners that pick one.

`TilePlan` is a frozen, hashable, keyword-only dataclass so it can travel as a
static argument through `jax.jit` and `jax.custom_vjp`.

The XLA path only reads `block_v`. `default_xla_block_v` picks it so that one
`[T, block_v]` float32 logit tile and its few elementwise temporaries stay around
a few MiB: small enough to stay in cache-sized working sets on CPU and to keep
the compiled temp memory flat in V, large enough that each step is a real GEMM.
"""

from __future__ import annotations

import dataclasses

# Bytes the XLA path aims to spend on one float32 [T, block_v] logit tile.
XLA_TILE_BYTES = 4 * 1024 * 1024
XLA_MIN_BLOCK_V = 128
XLA_MAX_BLOCK_V = 8192


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class TilePlan:
  """Tile sizes for one call of the loss.

  Attributes:
    block_v: vocabulary rows per tile (every backend).
    block_t: token rows per tile (TPU kernels; None = planner's choice).
    token_chunk: tokens per outer chunk when the token side does not fit on
      chip (TPU kernels; None = no chunking).
    vmem_limit_bytes: scoped VMEM limit passed to Mosaic (TPU kernels).
  """

  block_v: int
  block_t: int | None = None
  token_chunk: int | None = None
  vmem_limit_bytes: int | None = None

  def __post_init__(self):
    for name in ("block_v", "block_t", "token_chunk", "vmem_limit_bytes"):
      value = getattr(self, name)
      if value is None and name != "block_v":
        continue
      if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(
            f"TilePlan.{name} must be an int, got {type(value).__name__} ({value!r})"
        )
      if value <= 0:
        raise ValueError(f"TilePlan.{name} must be positive, got {value}")


def default_xla_block_v(num_tokens: int, vocab: int) -> int:
  """`block_v` for the XLA path: a [T, block_v] f32 tile of about XLA_TILE_BYTES.

  Rounded down to a multiple of 128, clamped to [128, 8192], and never more
  than V (a catalog smaller than one tile is one tile).
  """
  block_v = XLA_TILE_BYTES // (4 * max(num_tokens, 1))
  block_v = max(XLA_MIN_BLOCK_V, min(XLA_MAX_BLOCK_V, block_v // 128 * 128))
  return max(1, min(block_v, vocab))
