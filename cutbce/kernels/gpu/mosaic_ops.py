"""The few Mosaic GPU operations whose compiled and interpreted forms differ.

The Mosaic GPU kernels (`mosaic.py`) are written once and run two ways:
compiled by Mosaic GPU for an NVIDIA GPU (attached, or a target compiled for
with no GPU), and in Pallas' Mosaic GPU interpreter on a CPU. The
interpreter (jax 0.10.2 and 0.12) has no rule for a handful of primitives
the compiler needs to match register layouts and operand orders:
`layout_cast`, `plgpu.load(..., layout=...)`, `broadcasted_iota(...,
layout=...)` and the `transpose_ref` view of a wgmma operand; and it takes
the left operand of `wgmma` only from shared memory. Each helper here is
that primitive when compiled and its exact meaning when interpreted:

    zeros(shape, layout)        layout_cast of zeros     | zeros
    iota(shape, dim)            WGMMA-layout iota        | lax.broadcasted_iota
    load_vector(ref, layout)    plgpu.load with a layout | ref[...]
    dot_nt(a_refs, b_refs)      wgmma, B transposed      | sum_ij a_i @ b_j^T in float32
    dot_acc(acc, a_refs, b_refs, transpose_a)
                                wgmma into an accumulator | acc + sum_ij a_i(^T) @ b_j

The dots take lists of operand pieces and the (i, j) pairs to multiply
(`products`): one pair for bfloat16, six for float32 split into three
bfloat16 pieces (`cutbce/kernels/gpu/pieces.py`). Both forms multiply the same bfloat16
values exactly and accumulate in float32 (wgmma on the tensor cores,
`np.matmul` in float32 in the interpreter), so the interpreter checks every
other line of a kernel (indices, masks, pipeline slots, barriers, copies)
against the float64 oracle; only the operand layouts are left to the
compiled runs (docs/kernels.md, "Mosaic GPU kernels").
"""

from __future__ import annotations

import inspect

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu


WGMMA = plgpu.Layout.WGMMA  # an [M, N] wgmma accumulator tile in registers
ROWS = WGMMA.reduce(1)  # an [M] vector, one entry per row of such a tile
COLUMNS = WGMMA.reduce(0)  # an [N] vector, one entry per column

def zeros(shape, layout, interpret: bool):
  """float32 zeros in `layout` (a loop carry the compiler must place)."""
  value = jnp.zeros(shape, jnp.float32)
  return value if interpret else plgpu.layout_cast(value, layout)


def iota(shape, dimension: int, interpret: bool):
  """int32 indices along `dimension` of an `[M, N]` tile in the wgmma layout."""
  if interpret:
    return lax.broadcasted_iota(jnp.int32, shape, dimension)
  return plgpu.broadcasted_iota(jnp.int32, shape, dimension, layout=WGMMA)


# jax <= 0.11 takes `plgpu.load(ref, idx, layout=...)`, jax 0.12 `plgpu.load(ref, layout=...)`.
_LOAD_TAKES_INDEX = "idx" in inspect.signature(plgpu.load).parameters


def load_vector(ref, layout, interpret: bool):
  """A 1-D shared memory ref in registers, laid out for rows or columns of a tile."""
  if interpret:
    return ref[...]
  if _LOAD_TAKES_INDEX:
    return plgpu.load(ref, (), layout=layout)
  return plgpu.load(ref, layout=layout)


def _transposed(ref):
  """The `[K, M]` view of an `[M, K]` shared memory ref (a wgmma operand, no copy)."""
  if hasattr(ref, "transpose"):  # jax >= 0.12 deprecates plgpu.transpose_ref for it
    return ref.transpose((1, 0))
  return plgpu.transpose_ref(ref, (1, 0))


def dot_nt(a_refs, b_refs, products, interpret: bool):
  """`[M, N]` f32 sum over `products` of a_i @ b_j^T; a_i `[M, K]`, b_j `[N, K]` in shared memory."""
  rows, columns = a_refs[0].shape[0], b_refs[0].shape[0]
  if interpret:
    total = jnp.zeros((rows, columns), jnp.float32)
    for i, j in products:
      total = total + lax.dot_general(a_refs[i][...], b_refs[j][...], (((1,), (1,)), ((), ())),
                                      preferred_element_type=jnp.float32)
    return total

  def issue(acc_ref):
    for i, j in products:
      plgpu.wgmma(acc_ref, a_refs[i], _transposed(b_refs[j]))
    return acc_ref[...]

  return pl.run_scoped(issue, plgpu.ACC((rows, columns), jnp.float32))


def dot_acc(acc, a_refs, b_refs, products, interpret: bool, transpose_a: bool = False):
  """`acc + sum a_i @ b_j` (`a_i^T` with `transpose_a`); operands in shared memory, acc f32."""
  if interpret:
    for i, j in products:
      a = a_refs[i][...]
      acc = acc + jnp.dot(a.T if transpose_a else a, b_refs[j][...],
                          preferred_element_type=jnp.float32)
    return acc

  def issue(acc_ref):
    for i, j in products:
      a = _transposed(a_refs[i]) if transpose_a else a_refs[i]
      plgpu.wgmma(acc_ref, a, b_refs[j])

  return pl.run_state(issue)(plgpu.ACC.init(acc))
