"""float32 on bfloat16 tensor cores, exactly: operands split into three bfloat16 pieces.

A float32 x is p0 + p1 + p2 + r with p_k = bfloat16(x - p0 - ... - p_{k-1})
and |r| <= 2^-24 |x| (bfloat16 keeps 8 significant bits of float32's 24 and
its exponent range, so no piece underflows before float32 would). A product
a b is then the sum of the piece products p_i q_j with i + j <= 2: the six
that reach float32's precision (those dropped are below 2^-24 |a b|). Each
piece product is exact on the tensor cores (8 x 8 bits) and accumulates in
float32, so a float32 dot costs six bfloat16 ones (three TF32 ones would
cost the same tensor-core time, but TF32 operands must be K-major in
shared memory, which the gradient dots' operands are not), never FMA loops.
The Mosaic GPU kernels and the Triton kernels share this.
"""

from __future__ import annotations

import jax.numpy as jnp

# The (i, j) piece products of one dot: one for bfloat16, six for float32, smallest first.
PRODUCTS = {1: ((0, 0),), 3: ((1, 1), (0, 2), (2, 0), (0, 1), (1, 0), (0, 0))}


def iter_pieces(x, num_pieces: int, piece_dtype=jnp.bfloat16):
  """The pieces of `split_pieces`, one at a time: the rest is computed only when
  the next piece is asked for (a kernel storing each piece as it is made keeps
  at most the rest and one piece live)."""
  rest = x.astype(jnp.float32)
  for index in range(num_pieces):
    piece = rest.astype(piece_dtype)
    yield piece
    if index + 1 < num_pieces:
      rest = rest - piece.astype(jnp.float32)


def split_pieces(x, num_pieces: int, piece_dtype=jnp.bfloat16):
  """`num_pieces` arrays of `piece_dtype` summing to float32 `x` (to 2^-24 relative).

  One piece is a plain cast.
  """
  return list(iter_pieces(x, num_pieces, piece_dtype))
