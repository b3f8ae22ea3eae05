"""The portable path: `lax.scan` over vocabulary tiles, no `[T, V]` array.

Every step slices `block_v` rows of the table (a view, never a copy of the
table), makes one `[T, block_v]` float32 logit tile, reduces it and drops it.
The vocabulary is walked as `V // block_v` full tiles in a scan plus, when
`block_v` does not divide V, one statically shaped tail tile after it, so no
tile is ragged and nothing needs masking or padding.

Backend contract (shared with `tpu.py`), all on flattened `[T, D]` tokens:

  forward(hidden, table, bias, *, plan, with_counts)
      -> (softplus_sum [T] f32, positive_count [T] int32 or None)
      sum_v softplus(x_tv), and #{v : x_tv > 0} when `with_counts`.
  backward(hidden, table, bias, scale, table_grad, bias_grad, *, plan)
      -> (dh [T, D] f32, table_grad [V, D] f32, bias_grad [V] f32 or None)
      dh = sum_v g_t s_tv e_v; adds sum_t g_t s_tv h_t to `table_grad` (and
      sum_t g_t s_tv to `bias_grad`), with s = sigmoid(x), g = `scale` [T].
  rank_counts(hidden, table, bias, target_logits, target_ids, *, plan)
      -> [T, L] int32: #{v != target_ids[t, l] : x_tv > target_logits[t, l]}.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from cutbce.kernels.tiling import TilePlan, default_xla_block_v


def softplus(x):
  """log(1 + e^x) = max(x, 0) + log1p(e^-|x|): stable for every x, and vectorizes.

  The same identity `jax.nn.softplus` uses, without its inf/nan special cases,
  which on CPU cost about 3x the whole tile's elementwise time.
  """
  return jnp.maximum(x, 0.0) + jnp.log1p(jnp.exp(-jnp.abs(x)))


def tile_logits(hidden, table_tile, bias_tile):
  """`[T, block_v]` float32 logits of one tile (MXU-style f32 accumulation)."""
  logits = lax.dot_general(
      hidden, table_tile, (((1,), (1,)), ((), ())),
      preferred_element_type=jnp.float32,
  )
  if bias_tile is not None:
    logits = logits + bias_tile.astype(jnp.float32)[None, :]
  return logits


def _walk_tiles(vocab: int, block_v: int, step, carry):
  """Runs `step(carry, start, size)` over all tiles: a scan, then the tail."""
  block_v = min(block_v, vocab)
  num_full = vocab // block_v

  def body(carry, index):
    return step(carry, index * block_v, block_v), None

  if num_full:
    carry, _ = lax.scan(body, carry, jnp.arange(num_full, dtype=jnp.int32))
  tail = vocab - num_full * block_v
  if tail:
    carry = step(carry, num_full * block_v, tail)
  return carry


def _slice_rows(array, start, size):
  if array is None:
    return None
  if isinstance(start, int):
    return lax.slice_in_dim(array, start, start + size, axis=0)
  return lax.dynamic_slice_in_dim(array, start, size, axis=0)


def _update_rows(array, update, start):
  if isinstance(start, int):
    start = jnp.int32(start)
  return lax.dynamic_update_slice_in_dim(array, update, start, axis=0)


@functools.partial(jax.named_call, name="cutbce_xla_forward")
def forward(hidden, table, bias, *, plan: TilePlan, with_counts: bool):
  num_tokens = hidden.shape[0]

  def step(carry, start, size):
    softplus_sum, positive_count = carry
    logits = tile_logits(
        hidden, _slice_rows(table, start, size), _slice_rows(bias, start, size)
    )  # [T, block_v]
    softplus_sum = softplus_sum + jnp.sum(softplus(logits), axis=-1)
    if with_counts:
      positive_count = positive_count + jnp.sum(logits > 0, axis=-1, dtype=jnp.int32)
    return softplus_sum, positive_count

  init = (
      jnp.zeros((num_tokens,), jnp.float32),
      jnp.zeros((num_tokens,), jnp.int32) if with_counts else None,
  )
  return _walk_tiles(table.shape[0], plan.block_v, step, init)


@functools.partial(jax.named_call, name="cutbce_xla_backward")
def backward(hidden, table, bias, scale, table_grad, bias_grad, *, plan: TilePlan):
  compute_dtype = jnp.result_type(hidden.dtype, table.dtype)

  def step(carry, start, size):
    hidden_grad, table_grad, bias_grad = carry
    table_tile = _slice_rows(table, start, size)  # [block_v, D]
    logits = tile_logits(hidden, table_tile, _slice_rows(bias, start, size))
    # d l_t / d x_tv of the background is sigmoid(x_tv); scaled by g_t.
    logit_grad = scale[:, None] * jax.nn.sigmoid(logits)  # [T, block_v] f32
    logit_grad_c = logit_grad.astype(compute_dtype)
    hidden_grad = hidden_grad + lax.dot_general(
        logit_grad_c, table_tile, (((1,), (0,)), ((), ())),
        preferred_element_type=jnp.float32,
    )  # [T, D]
    tile_grad = lax.dot_general(
        logit_grad_c, hidden, (((0,), (0,)), ((), ())),
        preferred_element_type=jnp.float32,
    )  # [block_v, D]
    table_grad = _update_rows(
        table_grad, _slice_rows(table_grad, start, size) + tile_grad, start
    )
    if bias_grad is not None:
      bias_grad = _update_rows(
          bias_grad,
          _slice_rows(bias_grad, start, size) + jnp.sum(logit_grad, axis=0),
          start,
      )
    return hidden_grad, table_grad, bias_grad

  init = (jnp.zeros(hidden.shape, jnp.float32), table_grad, bias_grad)
  return _walk_tiles(table.shape[0], plan.block_v, step, init)


@functools.partial(jax.named_call, name="cutbce_xla_rank_counts")
def rank_counts(hidden, table, bias, target_logits, target_ids, *, plan: TilePlan):
  def step(counts, start, size):
    logits = tile_logits(
        hidden, _slice_rows(table, start, size), _slice_rows(bias, start, size)
    )  # [T, block_v]
    item_ids = start + jnp.arange(size, dtype=jnp.int32)  # [block_v]
    larger = logits[:, :, None] > target_logits[:, None, :]  # [T, block_v, L]
    # A target's own column is left out, so its rank does not depend on
    # whether the tile's GEMM and the sparse gather round x_tp alike.
    other = item_ids[None, :, None] != target_ids[:, None, :]
    return counts + jnp.sum(larger & other, axis=1, dtype=jnp.int32)

  init = jnp.zeros(target_logits.shape, jnp.int32)
  return _walk_tiles(table.shape[0], plan.block_v, step, init)


def default_plan(num_tokens: int, vocab: int, dim: int, dtype) -> TilePlan:
  """The XLA path's plan: only `block_v` matters (see `tiling.default_xla_block_v`)."""
  del dim, dtype
  return TilePlan(block_v=default_xla_block_v(num_tokens, vocab))
