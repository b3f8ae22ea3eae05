"""Exact full-catalog top-k retrieval: a running top-k over vocabulary tiles.

`top_k` returns, per position t, the k items v with the largest scores

    x_tv = h_t . e_v (+ b_v)      (c tanh(x_tv / c) with a soft cap c),

sorted descending with ties to the smaller id, never returning an excluded id
or a padding row (v >= num_items); a NaN score counts as -inf (`score_tile`),
so it never takes a finite item's place. No `[T, V]` array exists: the first
`num_items` rows of the table are walked in tiles of `block_v` rows (a
`lax.scan` over the full tiles and one statically shaped tail tile, as in
`cutbce/kernels/xla.py`), and a `[T, K]` carry of the best K candidates so far
is merged with each `[T, block_v]` score tile by ONE `lax.top_k` over
concat(carry, tile).

Why the merge is exact with ties. `lax.top_k` is stable: equal values come
out in input position order (checked on jax 0.10.2 in tests/cutbce/test_topk.py;
XLA's CPU TopK also orders floats totally, so -0.0 ranks below +0.0, which is
why every score tile maps -0.0 to +0.0). By induction the carry is sorted by
(score desc, id asc), its ids are smaller than every id of the next tile and
the carry comes first in the concat, so position order is id order among
equal scores. The carry starts as the top-K of the first tile (at least K rows
wide) rather than a -inf sentinel, so an item scoring -inf (a bias of -inf)
is never pushed out by a fake entry.

Why exclusion is exact and cheap. At most E distinct ids are excluded per
position, so the walk keeps K = min(k + E, num_items) candidates, blind to the
exclude list (no per-tile comparison against it); at the end the candidates
whose id is excluded are marked ineligible and `select` keeps the first k
eligible ones. k <= num_items - E (checked) guarantees k eligible items. The
final selection is a small `lax.sort` of the `[T, K]` candidates by (eligible
first, score desc, id asc), so an ineligible candidate never ties with an
eligible one even at -inf.

Why there is no Pallas TPU kernel. A Mosaic kernel would have to take the top
k of a `[block_t, k + block_v]` VMEM tile, and Mosaic lowers neither sort nor
top-k (on jax 0.10.2, `jax.export(..., platforms=("tpu",))` of a kernel calling
either fails with "Unimplemented primitive in Pallas TPU lowering"); the
alternative, k passes of max-and-mask over each tile, costs k times
the tile's elementwise work (k = 100: hundreds of VPU passes per MXU tile).
The XLA path below keeps one `[T, block_v]` score tile live and lets XLA lower
`lax.top_k` natively on each platform, so "pallas_tpu" runs it too. Nothing
here was measured on a TPU.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from cutbce import backends, inputs, sparse, variants
from cutbce.kernels import xla as xla_kernels

# Default tile: one [T, block_v] float32 score tile of about TOPK_TILE_BYTES.
# Each tile costs a [T, D] x [D, block_v] GEMM plus a top-k over k + block_v
# candidates per token; larger tiles amortize re-sorting the K carried
# candidates and the per-step overhead, smaller ones keep the live tile small.
# Measured with benchmarks/topk_bench.py --vocab 131072 --block-v 1024 ... 32768
# on the project's shared 2-core CPU box (jax 0.10.2, T = 2048, D = 64,
# V = 131_072, k = 100, float32; median seconds of interleaved repeats, two
# sweeps at machine load ~2.5 and ~5):
#   block_v       1024    2048    4096    8192   16384   32768
#   seconds       3.48    1.84    1.21    1.17    1.21    1.16   (3 repeats)
#   seconds       1.50    1.30    1.12    1.13    1.00    1.03   (5 repeats)
#   temp MiB      16.8    32.8    64.8   128.8   256.8   512.8
# Below 4096 the per-tile cost (re-sorting the 100 carried candidates, loop
# overhead) shows; from 4096 up the time is flat within the machine's noise
# (the top-k over every tile element dominates) while temp memory doubles per
# step. 4096 rows at T = 2048 is a 32 MiB tile: TOPK_TILE_BYTES.
TOPK_TILE_BYTES = 32 * 1024 * 1024
TOPK_MIN_BLOCK_V = 128
TOPK_MAX_BLOCK_V = 65_536

# Id of an ineligible candidate in `select`: sorts after every real id.
_NO_ID = np.iinfo(np.int32).max


class TopKSpec(NamedTuple):
  """The static options of one call (hashable: a static argument).

  Attributes:
    k: results per position; num_items: rows [0, num_items) are items;
    num_exclude: E, the exclude width (0 without exclude); soft_cap: c or None.
  """

  k: int
  num_items: int
  num_exclude: int
  soft_cap: float | None

  @property
  def num_candidates(self) -> int:
    """K = min(k + E, num_items): candidates kept before removing excluded ids."""
    return min(self.k + self.num_exclude, self.num_items)


class TopKArgs(NamedTuple):
  """Validated `top_k` inputs, flattened to T = prod(leading shape) tokens.

  Attributes:
    hidden: [T, D]; table: [V, D]; bias: [V] or None; exclude: [T, E] int32
      or None; leading_shape: the caller's leading shape; spec: the options.
  """

  hidden: jax.Array
  table: jax.Array
  bias: jax.Array | None
  exclude: jax.Array | None
  leading_shape: tuple[int, ...]
  spec: TopKSpec


def check_k(k, num_items: int, num_exclude: int) -> int:
  """`k` as a static int in [1, num_items - E]: every position then has k eligible items.

  Raises:
    TypeError: not an int.
    ValueError: outside [1, num_items - E].
  """
  if isinstance(k, (bool, np.bool_)) or not isinstance(k, (int, np.integer)):
    raise TypeError(f"k must be a Python int (static), got {type(k).__name__} ({k!r})")
  if not 1 <= k <= num_items - num_exclude:
    raise ValueError(
        f"k must be in [1, num_items - E] so that every position has k eligible items; "
        f"got k={k}, num_items={num_items}, E={num_exclude} (exclude width)"
    )
  return int(k)


def check_args(hidden, table, k, *, bias, exclude, num_items, logit_soft_cap) -> TopKArgs:
  """Checks shapes, dtypes and options at trace time and flattens the tokens.

  Raises:
    TypeError: hidden, table or bias not floating, exclude not integer, k or
      num_items not an int, logit_soft_cap not a float.
    ValueError: ranks, D mismatch, exclude leading shape, bias shape, k,
      num_items or logit_soft_cap out of range.
  """
  hidden_shape, table_shape = tuple(np.shape(hidden)), tuple(np.shape(table))
  inputs.check_hidden_and_table(hidden, table)
  vocab, leading = table_shape[0], hidden_shape[:-1]
  if bias is not None:
    inputs._check_float("bias", bias)  # pylint: disable=protected-access
    if tuple(np.shape(bias)) != (vocab,):
      raise ValueError(f"bias must have shape [V]=({vocab},), got {tuple(np.shape(bias))}")
  num_exclude = 0
  if exclude is not None:
    inputs.check_exclude(exclude, hidden_shape)
    num_exclude = np.shape(exclude)[-1]
  num_items = inputs.check_num_items(num_items, vocab)
  k = check_k(k, num_items, num_exclude)
  soft_cap = variants.make_options(logit_soft_cap=logit_soft_cap).logit_soft_cap
  num_tokens = int(np.prod(leading))
  hidden = jnp.reshape(lax.stop_gradient(hidden), (num_tokens, table_shape[1]))
  table = lax.stop_gradient(jnp.asarray(table))
  if bias is not None:
    bias = lax.stop_gradient(jnp.asarray(bias))
  if exclude is not None:
    # Ids outside [0, num_items) become -1 (checked in their own integer type,
    # so no wide id wraps into range on the int32 cast) and match no candidate.
    # NumPy ids keep their own integer type until `valid_ids` has checked them.
    xp = np if isinstance(exclude, np.ndarray) else jnp
    exclude = xp.reshape(xp.broadcast_to(exclude, (*leading, num_exclude)),
                         (num_tokens, num_exclude))
    exclude, _ = sparse.valid_ids(exclude, num_items)
  spec = TopKSpec(k=k, num_items=num_items, num_exclude=num_exclude, soft_cap=soft_cap)
  return TopKArgs(hidden, table, bias, exclude, leading, spec)


def default_block_v(num_tokens: int, num_rows: int) -> int:
  """Rows per tile: a [T, block_v] f32 tile of about TOPK_TILE_BYTES (4096 at T = 2048).

  Rounded down to a multiple of 128, clamped to [TOPK_MIN_BLOCK_V,
  TOPK_MAX_BLOCK_V] and to the rows walked.
  """
  block_v = TOPK_TILE_BYTES // (4 * max(num_tokens, 1)) // 128 * 128
  block_v = max(TOPK_MIN_BLOCK_V, min(TOPK_MAX_BLOCK_V, block_v))
  return max(1, min(block_v, num_rows))


# --------------------------------------------------------------------------- #
# Scores, the running top-k, the final selection.                              #
# --------------------------------------------------------------------------- #


def score_tile(hidden, table_tile, bias_tile, soft_cap):
  """`[T, block_v]` float32 scores: x (or c tanh(x / c)), -0.0 made +0.0, NaN made -inf.

  The soft cap is monotone, so ordering by the capped score is what a caller
  that caps its logits expects; distinct x may round to one capped score and
  then tie (to the smaller id). lax.top_k orders floats totally (-0.0 < +0.0):
  mapping -0.0 to +0.0 makes numerically equal scores tie. In that order a
  positive NaN is above +inf: a NaN table row (a diverged item) would be
  every position's first candidate and take a finite item's place. So a NaN
  score is -inf: after every finite score, tied with -inf scores (to the
  smaller id), returned as -inf. One fused select per tile element; keeping
  NaN apart from -inf (int32 order keys for lax.top_k) was measured 34x
  slower on CPU, where XLA's TopK has a fast path for float32 only.
  """
  scores = xla_kernels.tile_logits(hidden, table_tile, bias_tile)  # [T, block_v] f32
  if soft_cap is not None:
    scores = soft_cap * jnp.tanh(scores / soft_cap)
  return jnp.where(scores == 0.0, 0.0, jnp.where(jnp.isnan(scores), -jnp.inf, scores))


def running_top_k(hidden, table, bias, *, num_rows: int, num_candidates: int,
                  block_v: int, soft_cap: float | None, real_rows=None):
  """Top `num_candidates` of table rows [0, num_rows) per token, by (score desc, id asc).

  Args:
    hidden: `[T, D]`; table: `[R, D]` with R >= num_rows; bias: `[R]` or None.
    num_rows: static number of rows walked (rows past it are never read).
    num_candidates: K <= num_rows.
    block_v: rows per tile after the first tile, which is max(block_v, K)
      rows so that the carry starts full of real candidates.
    soft_cap: c or None.
    real_rows: optional traced int32 scalar: rows at or past it score -inf
      (a vocabulary shard's padding; their ids sort after every real row's).

  Returns:
    (scores `[T, K]` float32, ids `[T, K]` int32 row indices), sorted.
  """
  num_candidates = min(num_candidates, num_rows)

  def scores_of(start, size):
    scores = score_tile(hidden, xla_kernels.slice_rows(table, start, size),
                        xla_kernels.slice_rows(bias, start, size), soft_cap)
    if real_rows is not None:
      row_ids = start + jnp.arange(size, dtype=jnp.int32)  # [size]
      scores = jnp.where(row_ids[None, :] < real_rows, scores, -jnp.inf)
    return scores  # [T, size]

  def step(carry, start, size):
    carry_scores, carry_ids = carry  # [T, K] each
    tile = scores_of(start, size)  # [T, block_v]
    # Carry first: lax.top_k is stable, and every carried id < every tile id.
    scores, positions = lax.top_k(jnp.concatenate([carry_scores, tile], axis=-1), num_candidates)
    from_carry = positions < num_candidates
    carried = jnp.take_along_axis(
        carry_ids, jnp.minimum(positions, num_candidates - 1), axis=-1
    )
    ids = jnp.where(from_carry, carried, start + positions - num_candidates)
    return scores, ids.astype(jnp.int32)

  first = min(num_rows, max(block_v, num_candidates))
  scores, ids = lax.top_k(scores_of(0, first), num_candidates)  # [T, K]
  carry = (scores, ids.astype(jnp.int32))
  rest = num_rows - first
  if not rest:
    return carry
  block_v = min(block_v, rest)
  num_full = rest // block_v

  def body(carry, index):
    return step(carry, first + index * block_v, block_v), None

  if num_full:
    carry, _ = lax.scan(body, carry, jnp.arange(num_full, dtype=jnp.int32))
  tail = rest - num_full * block_v
  if tail:
    carry = step(carry, first + num_full * block_v, tail)
  return carry


def excluded(ids, exclude):
  """`[T, K]` bool: candidate id appears in its row of `exclude` `[T, E]` (or None).

  Exclude ids that are not items are -1 (see `check_args`) and match nothing.
  """
  if exclude is None:
    return jnp.zeros(ids.shape, bool)
  return jnp.any(ids[:, :, None] == exclude[:, None, :], axis=-1)  # [T, K, E] -> [T, K]


def select(scores, ids, eligible, k: int):
  """The first k of `[T, n]` candidates by (eligible first, score desc, id asc).

  A sort of n candidates per token (n = K, or the shards' candidates in a
  sharded merge), once per call. Ineligible candidates come back, if at all,
  as (-inf, int32 max); the callers' k guarantees they never do.
  """
  neg_scores = jnp.where(eligible, -scores, jnp.inf)
  ids = jnp.where(eligible, ids, _NO_ID)
  neg_scores, ids = lax.sort((neg_scores, ids), dimension=-1, num_keys=2)
  return -neg_scores[:, :k], ids[:, :k]


def dense_top_k(hidden, table, bias, exclude, spec: TopKSpec):
  """The materializing reference: `[T, V]` scores, ineligible rows to -inf, lax.top_k.

  An eligible item scoring exactly -inf ties with the masked rows here and may
  lose its place to one of them (the tiled path never returns an ineligible id).
  """
  vocab = table.shape[0]
  scores = score_tile(hidden, table, bias, spec.soft_cap)  # [T, V]
  eligible = jnp.broadcast_to(jnp.arange(vocab) < spec.num_items, scores.shape)
  if exclude is not None:  # [T, E], -1 where not an item
    valid = exclude >= 0
    rows = jnp.arange(scores.shape[0])[:, None]
    eligible = eligible.at[rows, jnp.where(valid, exclude, 0)].min(~valid)
  return lax.top_k(jnp.where(eligible, scores, -jnp.inf), spec.k)


@functools.partial(jax.jit, static_argnames=("spec", "block_v"))
def _flat_top_k(hidden, table, bias, exclude, *, spec: TopKSpec, block_v: int | None):
  """(scores `[T, k]`, ids `[T, k]`) of flat inputs; block_v None runs the dense reference."""
  if block_v is None:
    return dense_top_k(hidden, table, bias, exclude, spec)
  scores, ids = running_top_k(
      hidden, table, bias, num_rows=spec.num_items, num_candidates=spec.num_candidates,
      block_v=block_v, soft_cap=spec.soft_cap,
  )  # [T, K]
  return select(scores, ids, ~excluded(ids, exclude), spec.k)


def top_k(hidden, table, k, *, bias=None, exclude=None, num_items=None,
          logit_soft_cap=None, backend="auto", plan=None):
  """The k best items per position over the whole catalog, without `[T, V]` scores.

  With x_tv = h_t . e_v (+ b_v) accumulated in float32 (and s_tv = c tanh(x_tv / c)
  with `logit_soft_cap=c`, else s_tv = x_tv), returns per position t

      top-k over v in [0, num_items) \\ X_t of s_tv, by (s_tv desc, v asc).

  Args:
    hidden: `[..., D]` float32 or bfloat16 hidden states (usually `[B, N, D]`).
    table: `[V, D]` item table.
    k: results per position, 1 <= k <= num_items - E.
    bias: optional `[V]` per-item bias.
    exclude: optional int `[..., E]` ids never returned for that position
      (e.g. the user's history); ids outside [0, num_items) are ignored,
      repeats are fine.
    num_items: rows [0, num_items) are items, rows past it padding that is
      never read or returned; None means V.
    logit_soft_cap: optional positive float c: scores are c tanh(x / c).
    backend: "auto", "xla" or "pallas_tpu" (all the tiled XLA path: there is
      no Pallas top-k kernel, see the module docstring) or "dense" (the
      materializing reference).
    plan: optional `cutbce.TilePlan`; only `block_v` is read.

  Returns:
    (scores float32 `[..., k]`, ids int32 `[..., k]`), sorted descending; a
    NaN score (a NaN table row, hidden state or bias) counts as -inf: it
    ranks after every finite score, tied with -inf ones (smaller id first),
    and comes back as -inf.

  Raises:
    ValueError: bad ranks, D mismatch, exclude leading shape, bias shape, k
      outside [1, num_items - E], num_items outside [1, V], a non-positive or
      non-finite logit_soft_cap, or an unknown backend.
    TypeError: non-float hidden/table/bias, non-integer exclude, k or
      num_items not an int, logit_soft_cap not a float, a plan that is not a
      `cutbce.TilePlan`.

  Example:
    >>> import jax.numpy as jnp
    >>> from cutbce.topk import top_k
    >>> hidden = jnp.array([[1.0, 0.0], [0.0, 1.0]])
    >>> table = jnp.array([[3.0, 0.0], [1.0, 2.0], [3.0, 5.0], [0.0, 2.0]])
    >>> scores, ids = top_k(hidden, table, 2, exclude=jnp.array([[0], [-1]]))
    >>> scores.tolist(), ids.tolist()  # row 0: items 0 and 2 tie at 3, 0 is excluded
    ([[3.0, 1.0], [5.0, 2.0]], [[2, 1], [2, 1]])
  """
  inputs.check_choice("backend", backend, backends.BACKEND_CHOICES)
  inputs.check_plan(plan)
  args = check_args(
      hidden, table, k, bias=bias, exclude=exclude, num_items=num_items,
      logit_soft_cap=logit_soft_cap,
  )
  spec = args.spec
  if backend == "dense":
    block_v = None
  elif plan is not None:
    block_v = plan.block_v
  else:
    block_v = default_block_v(args.hidden.shape[0], spec.num_items)
  scores, ids = _flat_top_k(
      args.hidden, args.table, args.bias, args.exclude, spec=spec, block_v=block_v
  )
  shape = args.leading_shape + (spec.k,)
  return jnp.reshape(scores, shape), jnp.reshape(ids, shape)
