"""The Mosaic GPU kernel bodies: the sweep over token tiles and the table-gradient kernel.

Both kernels make each `[64, block]` float32 logit tile once, on the tensor
cores, and keep it in registers; `cutbce/kernels/gpu/mosaic.py` prepares
their operands and honours the backend contract with them. A call is
described statically by `Flags` (the loss: "bce" or "softmax"; which
outputs) and `Side` (which per-token operands it has):

  vectors  `[Tp]` per token: scale (g_t), log_z and offset (softmax
           backward), limit (int32: a vocabulary shard's real rows)
  lists    `[n, Tp]` per token (ids transposed so a token tile is a
           contiguous block for TMA): fixed_ids (int32) and fixed_values
           (f32), the columns whose gradient is set exactly; exclude
           (int32), ids out of a softmax.

  sweep   grid (token blocks, vocab splits); the token side resident in
          shared memory, `block_v`-row table tiles (and bias) streamed
          through `stages` TMA buffers. BCE: loss sums, counts, dh.
          Softmax: running (max, sum of exp) and counts (forward) or dh
          (backward). Per split outputs, combined by the caller.
          Warp-specialized (`_sweep_ws_body`, `geom.consumers` = 2): a
          producer warpgroup issues the table copies, two consumer
          warpgroups (64 tokens each) read every slot and release it on a
          "consumed" barrier; else (`_sweep_body`) one warpgroup per CTA
          issues its own copies and refills a slot after its dots.
  table   grid (vocab blocks); the table tile resident, the token side
          streamed: dE += G^T H and db += sum_t G. Warp-specialized
          (`_table_ws_body`, `geom.table_consumers` = 2: a producer streams
          the token tiles, two consumers own 64 table rows each) or not
          (`_table_body`).

One exp and one reciprocal per logit for BCE (`bce_tile`), one exp for the
softmax. The compiled/interpreted differences live in `mosaic_ops`.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from cutbce.kernels.gpu import mosaic_ops as ops
from cutbce.kernels.gpu import pieces
from cutbce.kernels.gpu.mosaic_plan import (BLOCK_T, CONSUMER_REGISTERS, PRODUCER_REGISTERS,
                                            TABLE_BLOCK_V, Geometry)

VECTOR_FIELDS = ("scale", "log_z", "offset", "limit")
LIST_FIELDS = ("fixed_ids", "fixed_values", "exclude")
_INT_FIELDS = ("limit", "fixed_ids", "exclude")
# The softmax's running max starts here: finite, so a tile of masked (-inf)
# logits gives exp(-inf - floor) = 0, never a NaN.
SOFTMAX_FLOOR = float(jnp.finfo(jnp.float32).min)
WARPGROUPS = "warpgroups"  # the thread axis of a warp-specialized kernel
# A warp-specialized consumer holds its tokens' list rows (fixed ids and
# values, excluded ids: two registers a thread each) across its loop up to
# this many, else reads them in every elementwise chunk of a tile. Compiled
# for sm_90a (jax 0.10.2, before the chunks): bf16 at D = 128 with 8 fixed
# columns (16 rows) spills 696 B held, 136-152 B read per tile; f32 at D = 50
# with 7 fixed columns (4 targets, 3 excluded: 14 rows) 364 B held, 564-612 B
# per tile (ptxas' choices, not a model). With 32-column chunks and jax 0.12,
# the 16 rows read once per tile: 632 B, once per chunk: 408 B.
MAX_HELD_LIST_ROWS = 14
# Both kernels do a tile's elementwise work (exp, reciprocal, masks, G's pieces
# stored) this many columns at a time: the registers of one chunk's temporaries
# are live at once, not the whole tile's (ptxas issues a tile's exps, then its
# reciprocals). A chunk is whole tiles of G's shared memory, so the operands are
# tiled this wide, with the swizzle of that row width (wgmma wants its two
# operands' swizzles equal). Compiled for sm_90a (H200, T = 2,048, V = 2^20,
# L = 4, bias; spill bytes, whole tiles / 64 / 32 columns): bf16 D = 64 sweep,
# jax 0.12: 76 / 12 / 0 B; f32 D = 64 sweep, jax 0.12: 764 / 748 / 328 B, jax
# 0.10.2: 448 / 220 / 124 B; f32 D = 64 table, whole tiles / 32 columns: 140 / 0 B
# (0.10.2), 240 / 48 B (0.12) (docs/kernels.md).
ELEMENTWISE_COLUMNS = 32
_TILE_TRANSFORMS = (plgpu.TilingTransform((8, ELEMENTWISE_COLUMNS)),
                    plgpu.SwizzleTransform(2 * ELEMENTWISE_COLUMNS))


class Flags(NamedTuple):
  """What one kernel call computes (static)."""

  kind: str  # "bce" or "softmax"
  has_bias: bool
  with_loss: bool  # BCE: softplus sums; softmax: running (max, sum)
  with_counts: bool
  with_grad: bool  # dh (sweep); the table kernel always makes dE


class Side(NamedTuple):
  """The per-token operands present (static): vector names, (list name, rows) pairs."""

  vectors: tuple
  lists: tuple

  @property
  def names(self) -> tuple:
    return self.vectors + tuple(name for name, _ in self.lists)

  @property
  def rows(self) -> int:
    """4-byte values per token (for the planner's shared memory estimate)."""
    return len(self.vectors) + sum(rows for _, rows in self.lists)


def side_of(arrays: dict) -> Side:
  """The `Side` of a {name: array or None} dict (`[Tp]` vectors, `[n, Tp]` lists)."""
  vectors = tuple(name for name in VECTOR_FIELDS if arrays.get(name) is not None)
  lists = tuple((name, arrays[name].shape[0]) for name in LIST_FIELDS
                if arrays.get(name) is not None and arrays[name].shape[0])
  return Side(vectors, lists)


# --------------------------------------------------------------------------- #
# Tiles.                                                                       #
# --------------------------------------------------------------------------- #


def _rows(vector, shape):
  """An `[M]` vector (one value per row) broadcast over an `[M, N]` tile."""
  return lax.broadcast_in_dim(vector, shape, (0,))


def _columns(vector, shape):
  """An `[N]` vector (one value per column) broadcast over an `[M, N]` tile."""
  return lax.broadcast_in_dim(vector, shape, (1,))


def _counted(columns, geom: Geometry, side: dict):
  """`[64, block]` bool: the tile's columns that are items (< num_items, < the token's limit)."""
  valid = columns < geom.num_items
  if "limit" in side:
    valid = valid & (columns < _rows(side["limit"], columns.shape))
  return valid


def _set_fixed(grad, columns, side: dict):
  """G with each token's fixed columns set to their exact float32 values (before the split)."""
  for ids, values in zip(side.get("fixed_ids", ()), side.get("fixed_values", ())):
    grad = jnp.where(columns == _rows(ids, grad.shape), _rows(values, grad.shape), grad)
  return grad


def bce_tile(logits, columns, geom: Geometry, side: dict, *, with_loss=False, with_counts=False,
             with_grad=False):
  """(loss row sums, count row sums, G) of one BCE tile, None where not asked.

  One exp and one reciprocal per logit: e = exp(-|x|), r = 1 / (1 + e);
  sigmoid(x) = [x >= 0 ? 1 : e] r and log1p(e) = log(u) - ((u - 1) - e) r
  with u = 1 + e rounded: (u - 1) - e is u's rounding error, exact in
  float32, and log(u) - d / u is log(u - d) to first order, so the small e
  of confident logits are not lost to the rounding of 1 + e. (log lowers to
  a polynomial, not a MUFU instruction.)
  """
  valid = _counted(columns, geom, side)
  decay = jnp.exp(-jnp.abs(logits))
  one_plus = 1.0 + decay
  inverse = 1.0 / one_plus
  loss = counts = grad = None
  if with_loss:
    log1p = jnp.log(one_plus) - ((one_plus - 1.0) - decay) * inverse
    loss = jnp.sum(jnp.where(valid, jnp.maximum(logits, 0.0) + log1p, 0.0), axis=1)
  if with_counts:
    counts = jnp.sum(jnp.where(valid & (logits > 0.0), 1.0, 0.0), axis=1)
  if with_grad:
    sigmoid = jnp.where(logits >= 0.0, 1.0, decay) * inverse
    grad = jnp.where(valid, _rows(side["scale"], logits.shape) * sigmoid, 0.0)
    grad = _set_fixed(grad, columns, side)
  return loss, counts, grad


def _softmax_items(columns, geom: Geometry, side: dict):
  """(counted, items) `[64, block]` bool: counted at x > 0, and in the token's softmax."""
  counted = _counted(columns, geom, side)
  items = counted
  for ids in side.get("exclude", ()):  # E is small and static: unrolled
    items = items & (columns != _rows(ids, columns.shape))
  return counted, items


def softmax_grad_tile(logits, columns, geom: Geometry, side: dict):
  """G = g exp(x - log_z) - o on the token's softmax items (0 elsewhere), fixed columns set."""
  _, items = _softmax_items(columns, geom, side)
  shape = logits.shape
  grad = _rows(side["scale"], shape) * jnp.exp(logits - _rows(side["log_z"], shape))
  if "offset" in side:
    grad = grad - _rows(side["offset"], shape)
  return _set_fixed(jnp.where(items, grad, 0.0), columns, side)


def _grad_tile(kind, logits, columns, geom, side):
  if kind == "bce":
    return bce_tile(logits, columns, geom, side, with_grad=True)[2]
  return softmax_grad_tile(logits, columns, geom, side)


def _store_pieces(grad, smem_refs):
  """G split into bfloat16 pieces (`pieces.iter_pieces`), into the shared memory the next
  dot reads, each stored as soon as it is made (the caller commits before the dot)."""
  for ref, piece in zip(smem_refs, pieces.iter_pieces(grad, len(smem_refs), smem_refs[0].dtype)):
    ref[...] = piece


def _column_chunks(width: int) -> list:
  """The column slices of a `[64, width]` logit tile whose elementwise work is done one
  after the other (`ELEMENTWISE_COLUMNS` wide; the shared memory is tiled so)."""
  step = min(ELEMENTWISE_COLUMNS, width)
  return [slice(start, start + step) for start in range(0, width, step)]


def _smem(shape, dtype=jnp.bfloat16, tiled=False):
  return plgpu.SMEM(shape, dtype, transforms=_TILE_TRANSFORMS if tiled else ())


def _side_smem(side: Side, leading=()):
  """Shared memory for the token side: `[*leading, 64]` per vector, `[*leading, n, 64]` per list."""
  return {**{name: _smem((*leading, BLOCK_T), jnp.int32 if name in _INT_FIELDS else jnp.float32)
             for name in side.vectors},
          **{name: _smem((*leading, rows, BLOCK_T),
                         jnp.int32 if name in _INT_FIELDS else jnp.float32)
             for name, rows in side.lists}}


def _side_source(ref, name: str, side: Side, tokens):
  """The token tile `tokens` of one side operand in global memory."""
  return ref.at[tokens] if name in side.vectors else ref.at[:, tokens]


def _load_side(smem: dict, side: Side, interpret: bool, slot=None) -> dict:
  """The token side in registers: `[64]` row vectors, lists of them."""
  at = (lambda ref: ref) if slot is None else (lambda ref: ref.at[slot])  # noqa: E731
  values = {name: ops.load_vector(at(smem[name]), ops.ROWS, interpret) for name in side.vectors}
  for name, rows in side.lists:
    values[name] = [ops.load_vector(at(smem[name]).at[k], ops.ROWS, interpret)
                    for k in range(rows)]
  return values


# --------------------------------------------------------------------------- #
# The sweep over token tiles.                                                  #
# --------------------------------------------------------------------------- #


def _sweep_kernel(*refs, geom: Geometry, flags: Flags, side: Side, interpret: bool):
  if geom.consumers == 1:
    pl.run_scoped(functools.partial(_sweep_body, refs, geom=geom, flags=flags, side=side,
                                    interpret=interpret), *_sweep_scratch(geom, flags, side))
    return
  # Warp-specialized: the scratch is the CTA's, shared by its warpgroups.
  pl.run_scoped(functools.partial(_sweep_ws_body, refs, geom=geom, flags=flags, side=side,
                                  interpret=interpret), *_sweep_scratch(geom, flags, side),
                collective_axes=WARPGROUPS)


def _sweep_outputs(flags: Flags) -> tuple:
  """Names of the sweep's outputs, in order."""
  if flags.kind == "softmax" and flags.with_loss:
    return ("max", "sum") + (("counts",) if flags.with_counts else ())
  return ((("dh",) if flags.with_grad else ()) + (("loss",) if flags.with_loss else ())
          + (("counts",) if flags.with_counts else ()))


def _input_refs(refs, geom: Geometry, flags: Flags, side: Side):
  """Both kernels' inputs, in order: (hidden pieces, table pieces, bias or None,
  {side name: ref}, the refs after them: the outputs)."""
  refs = list(refs)
  hidden_refs = [refs.pop(0) for _ in range(geom.pieces)]  # [Tp, Dp] bf16 each
  table_refs = [refs.pop(0) for _ in range(geom.pieces)]  # [Vp, Dp] bf16 each
  bias_ref = refs.pop(0) if flags.has_bias else None  # [Vp] f32
  side_refs = {name: refs.pop(0) for name in side.names}  # [Tp] or [n, Tp]
  return hidden_refs, table_refs, bias_ref, side_refs, refs


def _sweep_refs(refs, geom: Geometry, flags: Flags, side: Side):
  """(hidden pieces, table pieces, bias or None, {side name: ref}, {output name: ref})."""
  hidden_refs, table_refs, bias_ref, side_refs, outputs = _input_refs(refs, geom, flags, side)
  out_refs = dict(zip(_sweep_outputs(flags), outputs, strict=True))  # [splits, Tp(, Dp)] f32
  return hidden_refs, table_refs, bias_ref, side_refs, out_refs


def _sweep_init(geom: Geometry, flags: Flags, interpret: bool):
  """The loop carry: (max, sum, counts) for the softmax forward, else (loss, counts, dh)."""
  rows_zero = ops.zeros((BLOCK_T,), ops.ROWS, interpret)
  if flags.kind == "softmax" and flags.with_loss:
    return (rows_zero + SOFTMAX_FLOOR, rows_zero, rows_zero)
  return (rows_zero, rows_zero,
          ops.zeros((BLOCK_T, geom.dim_padded), ops.WGMMA, interpret) if flags.with_grad
          else rows_zero)


def _sweep_logits(hidden_tile, table_tile, bias_slot_ref, tile_start, geom: Geometry,
                  interpret: bool):
  """(logits `[64, block_v]` f32, their columns' item ids) of one table tile."""
  logits = ops.dot_nt(hidden_tile, table_tile, pieces.PRODUCTS[geom.pieces], interpret)
  if bias_slot_ref is not None:
    logits = logits + _columns(ops.load_vector(bias_slot_ref, ops.COLUMNS, interpret),
                               logits.shape)
  columns = tile_start + ops.iota((BLOCK_T, geom.block_v), 1, interpret)
  return logits, columns


def _sweep_update(carry, logits, columns, table_tile, grad_smem, geom: Geometry, flags: Flags,
                  read_values, interpret: bool):
  """The carry after one tile: softmax (max, sum, counts), or BCE / softmax-backward (loss,
  counts, dh), dh += G E read from `table_tile` (G staged in `grad_smem`), the elementwise
  work `ELEMENTWISE_COLUMNS` columns at a time. `read_values()` gives the per-token
  operands, called once per chunk (held ones cost nothing; long lists are read from shared
  memory there, so they are not live across the chunks)."""
  if flags.kind == "softmax" and flags.with_loss:
    return _softmax_step(carry, logits, columns, geom, read_values(), flags.with_counts)
  loss, counts, dh = carry
  for chunk in _column_chunks(geom.block_v):
    values = read_values()
    tile_loss, tile_counts, grad = (
        bce_tile(logits[:, chunk], columns[:, chunk], geom, values, with_loss=flags.with_loss,
                 with_counts=flags.with_counts, with_grad=flags.with_grad)
        if flags.kind == "bce" else (None, None, softmax_grad_tile(
            logits[:, chunk], columns[:, chunk], geom, values)))
    if flags.with_loss:
      loss = loss + tile_loss
    if flags.with_counts:
      counts = counts + tile_counts
    if flags.with_grad:  # G's columns of this chunk, into its pieces' shared memory
      _store_pieces(grad, [ref.at[:, chunk] for ref in grad_smem])
  if flags.with_grad:
    plgpu.commit_smem()
    dh = ops.dot_acc(dh, grad_smem, table_tile, pieces.PRODUCTS[geom.pieces],
                     interpret)  # [64, Dp] f32
  return loss, counts, dh


def _sweep_store(carry, out_refs, dh_smem, sums_smem, split, tokens, flags: Flags):
  """The carry to this token tile's rows of the split's outputs (through shared memory)."""
  results = dict(zip(("max", "sum", "counts"), carry) if flags.kind == "softmax" and flags.with_loss
                 else zip(("loss", "counts", "dh"), carry))
  staged = []
  for index, name in enumerate(_sweep_outputs(flags)):
    if name == "dh":
      dh_smem[...] = results["dh"]
      staged.append((dh_smem, out_refs["dh"].at[split, tokens]))
    else:
      sums_smem.at[index][...] = results[name]
      staged.append((sums_smem.at[index], out_refs[name].at[split, tokens]))
  plgpu.commit_smem()
  for src, dst in staged:
    plgpu.copy_smem_to_gmem(src, dst)
  plgpu.wait_smem_to_gmem(0)


def _split_tiles(geom: Geometry):
  """(split, its first vocab tile, its number of tiles) of this CTA."""
  split = lax.axis_index("splits")
  first = split * geom.tiles_per_split
  return split, first, jnp.minimum(first + geom.tiles_per_split, geom.num_vocab_tiles) - first


def _table_tile_issue(first, block_v: int, table_refs, bias_ref, table_smem, bias_smem,
                      stream_barrier):
  """`issue(tile, slot)`: copy the split's table tile `first + tile` (its pieces, and its
  bias where `bias_ref` is given) into buffer `slot`, arriving on that slot's barrier."""

  def issue(tile, slot):
    rows = pl.ds((first + tile) * block_v, block_v)
    for ref, smem in zip(table_refs, table_smem):
      plgpu.copy_gmem_to_smem(ref.at[rows], smem.at[slot], stream_barrier.at[slot])
    if bias_ref is not None:
      plgpu.copy_gmem_to_smem(bias_ref.at[rows], bias_smem.at[slot], stream_barrier.at[slot])

  return issue


def _sweep_body(refs, *scratch, geom: Geometry, flags: Flags, side: Side, interpret: bool):
  """One warpgroup per CTA (`geom.consumers == 1`): it issues its own copies."""
  block_v, stages = geom.block_v, geom.stages
  hidden_refs, table_refs, bias_ref, side_refs, out_refs = _sweep_refs(refs, geom, flags, side)
  (hidden_smem, table_smem, bias_smem, side_smem, grad_smem, dh_smem, sums_smem,
   resident_barrier, stream_barrier, _) = scratch

  token_start = lax.axis_index("tokens") * BLOCK_T
  split, first, num_tiles = _split_tiles(geom)
  tokens = pl.ds(token_start, BLOCK_T)

  resident = [(ref.at[tokens], smem) for ref, smem in zip(hidden_refs, hidden_smem)]
  resident += [(_side_source(side_refs[name], name, side, tokens), side_smem[name])
               for name in side.names]
  for src, dst in resident:
    plgpu.copy_gmem_to_smem(src, dst, resident_barrier.at[0])

  issue = _table_tile_issue(first, block_v, table_refs, bias_ref, table_smem, bias_smem,
                            stream_barrier)

  for slot in range(stages):
    pl.when(slot < num_tiles)(functools.partial(issue, slot, slot))
  plgpu.barrier_wait(resident_barrier.at[0])
  values = _load_side(side_smem, side, interpret)  # resident: read once

  def step(tile, carry):
    slot = lax.rem(tile, stages)
    plgpu.barrier_wait(stream_barrier.at[slot])
    table_tile = [smem.at[slot] for smem in table_smem]
    logits, columns = _sweep_logits(hidden_smem, table_tile,
                                    bias_smem.at[slot] if flags.has_bias else None,
                                    (first + tile) * block_v, geom, interpret)
    carry = _sweep_update(carry, logits, columns, table_tile, grad_smem, geom, flags,
                          lambda: values, interpret)
    # Every read of the slot is done (the dots waited): refill it.
    refill = tile + stages
    pl.when(refill < num_tiles)(lambda: issue(refill, slot))
    return carry

  carry = lax.fori_loop(0, num_tiles, step, _sweep_init(geom, flags, interpret))
  _sweep_store(carry, out_refs, dh_smem, sums_smem, split, tokens, flags)


def _sweep_ws_body(refs, *scratch, geom: Geometry, flags: Flags, side: Side, interpret: bool):
  """Warp-specialized (`geom.consumers` consumer warpgroups and one producer).

  The producer (the last warpgroup) streams the split's table tiles into the
  `stages` slots, refilling a slot once every consumer has arrived on its
  "consumed" barrier. Consumer `c` owns token rows [64 c, 64 c + 64) of the
  CTA's block: its hidden tile and per-token operands (copied by itself), its
  G pieces, its output staging; it waits on a slot's copies, reads it (the
  logit dot, the bias, and with a gradient the dh dot) and arrives on the
  slot's consumed barrier as soon as those reads are done, before the
  elementwise work of a forward tile. Both consumers run the same code
  (`c` is a value, not a branch), so the compiled PTX holds one tile's dots.
  """
  block_v, stages, consumers = geom.block_v, geom.stages, geom.consumers
  hidden_refs, table_refs, bias_ref, side_refs, out_refs = _sweep_refs(refs, geom, flags, side)
  (hidden_smem, table_smem, bias_smem, side_smem, grad_smem, dh_smem, sums_smem,
   resident_barrier, stream_barrier, consumed_barrier) = scratch
  warpgroup = lax.axis_index(WARPGROUPS)
  split, first, num_tiles = _split_tiles(geom)

  @pl.when(warpgroup < consumers)
  def _consumer():
    plgpu.set_max_registers(CONSUMER_REGISTERS, action="increase")
    tokens = pl.ds((lax.axis_index("tokens") * consumers + warpgroup) * BLOCK_T, BLOCK_T)
    hidden_tile = [smem.at[warpgroup] for smem in hidden_smem]
    own_side = {name: smem.at[warpgroup] for name, smem in side_smem.items()}
    resident = [(ref.at[tokens], smem) for ref, smem in zip(hidden_refs, hidden_tile)]
    resident += [(_side_source(side_refs[name], name, side, tokens), own_side[name])
                 for name in side.names]
    for src, dst in resident:
      plgpu.copy_gmem_to_smem(src, dst, resident_barrier.at[warpgroup])
    plgpu.barrier_wait(resident_barrier.at[warpgroup])
    own_grad = [smem.at[warpgroup] for smem in grad_smem] if flags.with_grad else None
    # The per-token operands are read once and held, unless the lists are long: then
    # those are read from shared memory at every tile (`MAX_HELD_LIST_ROWS`).
    lists_held = sum(rows for _, rows in side.lists) <= MAX_HELD_LIST_ROWS
    held = _load_side(own_side, side if lists_held else Side(side.vectors, ()), interpret)

    def step(tile, carry):
      slot = lax.rem(tile, stages)
      plgpu.barrier_wait(stream_barrier.at[slot])
      table_tile = [smem.at[slot] for smem in table_smem]
      logits, columns = _sweep_logits(hidden_tile, table_tile,
                                      bias_smem.at[slot] if flags.has_bias else None,
                                      (first + tile) * block_v, geom, interpret)
      def read_values():
        return held if lists_held else {
            **held, **_load_side(own_side, Side((), side.lists), interpret)}

      if not flags.with_grad:  # the slot's last read was the logit dot's (it waited)
        plgpu.barrier_arrive(consumed_barrier.at[slot])
      carry = _sweep_update(carry, logits, columns, table_tile, own_grad, geom, flags,
                            read_values, interpret)
      if flags.with_grad:  # ... or the dh dot's (it waited too)
        plgpu.barrier_arrive(consumed_barrier.at[slot])
      return carry

    carry = lax.fori_loop(0, num_tiles, step, _sweep_init(geom, flags, interpret))
    _sweep_store(carry, out_refs, dh_smem.at[warpgroup] if flags.with_grad else None,
                 sums_smem.at[warpgroup], split, tokens, flags)

  issue = _table_tile_issue(first, block_v, table_refs, bias_ref, table_smem, bias_smem,
                            stream_barrier)

  pl.when(warpgroup == consumers)(
      lambda: _produce(issue, num_tiles, stages, consumed_barrier))


def _produce(issue, num_tiles, stages: int, consumed_barrier):
  """The producer warpgroup: `issue(tile, slot)` for every tile, each slot refilled once
  every consumer has arrived on its consumed barrier."""
  plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")

  def produce(tile, _):
    slot = lax.rem(tile, stages)

    @pl.when(tile >= stages)  # the slot's previous tile read by every consumer
    def _():
      plgpu.barrier_wait(consumed_barrier.at[slot])

    issue(tile, slot)
    return ()

  lax.fori_loop(0, num_tiles, produce, ())

  # Observe the last tiles' consumption too: every phase of a barrier is
  # waited by the warpgroup that waits on it (the interpreter checks it).
  def drain(tile, _):
    plgpu.barrier_wait(consumed_barrier.at[lax.rem(tile, stages)])
    return ()

  lax.fori_loop(jnp.maximum(num_tiles - stages, 0), num_tiles, drain, ())


def _softmax_step(carry, logits, columns, geom, side, with_counts):
  """The running (max, sum of exp) and counts of one softmax tile."""
  row_max, row_sum, counts = carry
  counted, items = _softmax_items(columns, geom, side)
  if with_counts:
    counts = counts + jnp.sum(jnp.where(counted & (logits > 0.0), 1.0, 0.0), axis=1)
  masked = jnp.where(items, logits, -jnp.inf)
  new_max = jnp.maximum(row_max, jnp.max(masked, axis=1))
  row_sum = (row_sum * jnp.exp(row_max - new_max)
             + jnp.sum(jnp.exp(masked - _rows(new_max, masked.shape)), axis=1))
  return new_max, row_sum, counts


def _sweep_scratch(geom: Geometry, flags: Flags, side: Side):
  num_pieces, stages, dim, block_v = geom.pieces, geom.stages, geom.dim_padded, geom.block_v
  # One per consumer warpgroup when warp-specialized: [consumers, ...].
  own = () if geom.consumers == 1 else (geom.consumers,)
  resident_copies = num_pieces + len(side.names)
  return (
      [_smem((*own, BLOCK_T, dim), tiled=True) for _ in range(num_pieces)],  # hidden pieces
      [_smem((stages, block_v, dim), tiled=True) for _ in range(num_pieces)],  # table pieces
      _smem((stages, block_v), jnp.float32) if flags.has_bias else None,
      _side_smem(side, own),
      [_smem((*own, BLOCK_T, block_v), tiled=True) for _ in range(num_pieces)]
      if flags.with_grad else None,  # G pieces
      _smem((*own, BLOCK_T, dim), jnp.float32) if flags.with_grad else None,  # dh staging
      _smem((*own, 3, BLOCK_T), jnp.float32),  # row sums staging
      # One barrier per consumer for its resident copies, one per slot for a tile's
      # streamed copies: each copy arrives on it (few barriers: their shared memory
      # addresses are made once and held in registers).
      plgpu.Barrier(num_arrivals=resident_copies, num_barriers=geom.consumers),
      plgpu.Barrier(num_arrivals=num_pieces + flags.has_bias, num_barriers=stages),
      # A slot is consumed once every consumer has read it (warp-specialized only).
      plgpu.Barrier(num_arrivals=geom.consumers, num_barriers=stages)
      if geom.consumers > 1 else None,
  )


def sweep(hidden, table, bias, side_arrays: dict, *, geom: Geometry, flags: Flags,
          interpret: bool, params) -> dict:
  """{output name: per-split array} of one sweep call (`_sweep_outputs`); operands padded."""
  side = side_of(side_arrays)
  inputs = [*hidden, *table] + ([bias] if flags.has_bias else [])
  inputs += [side_arrays[name] for name in side.names]
  splits, tokens = geom.vocab_splits, geom.tokens_padded
  names = _sweep_outputs(flags)
  out_type = [jax.ShapeDtypeStruct((splits, tokens, geom.dim_padded) if name == "dh"
                                   else (splits, tokens), jnp.float32) for name in names]
  kernel = functools.partial(_sweep_kernel, geom=geom, flags=flags, side=side,
                             interpret=interpret)
  kernel.__name__ = (f"cutbce_mosaic_{'softmax_' if flags.kind == 'softmax' else ''}sweep_"
                     f"{'loss_' if flags.with_loss else ''}{'dh_' if flags.with_grad else ''}"
                     f"bv{geom.block_v}_s{geom.stages}")
  kernel.__name__ += "_ws" if geom.consumers > 1 else ""
  threads = ({} if geom.consumers == 1
             else dict(num_threads=geom.consumers + 1, thread_name=WARPGROUPS))
  outputs = plgpu.kernel(kernel, out_type=out_type, grid=(geom.num_token_blocks, splits),
                         grid_names=("tokens", "splits"), interpret=params, **threads)(*inputs)
  return dict(zip(names, outputs))


# --------------------------------------------------------------------------- #
# The table gradient over vocab tiles.                                         #
# --------------------------------------------------------------------------- #


def _table_kernel(*refs, geom: Geometry, flags: Flags, side: Side, interpret: bool):
  if geom.table_consumers == 1:
    pl.run_scoped(functools.partial(_table_body, refs, geom=geom, flags=flags, side=side,
                                    interpret=interpret), *_table_scratch(geom, flags, side))
    return
  pl.run_scoped(functools.partial(_table_ws_body, refs, geom=geom, flags=flags, side=side,
                                  interpret=interpret), *_table_scratch(geom, flags, side),
                collective_axes=WARPGROUPS)


def _table_update(carry, hidden_tile, table_tile, grad_refs, bias_smem, vocab_start,
                  side_values, geom: Geometry, flags: Flags, interpret: bool):
  """(dE, db) after one token tile: its logits against the table tile, G (stored as pieces
  in `grad_refs`), db += sum_t G and dE += G^T H ([64 items, 64 tokens] x [64 tokens, Dp]).
  The elementwise work goes `ELEMENTWISE_COLUMNS` items at a time, as the sweep's does;
  db is carried as one vector per chunk (`_table_init`), so no vector is sliced."""
  table_grad, bias_grads = carry
  products = pieces.PRODUCTS[geom.pieces]
  logits = ops.dot_nt(hidden_tile, table_tile, products, interpret)  # [64 tokens, 64 items]
  if bias_smem is not None:  # read in each step: held across the loop it spilled (float32)
    logits = logits + _columns(ops.load_vector(bias_smem, ops.COLUMNS, interpret),
                               logits.shape)
  # Made in the step, not held across it: a tile of indices is 32 registers.
  columns = vocab_start + ops.iota((BLOCK_T, TABLE_BLOCK_V), 1, interpret)
  new_bias_grads = []
  for index, chunk in enumerate(_column_chunks(TABLE_BLOCK_V)):
    grad = _grad_tile(flags.kind, logits[:, chunk], columns[:, chunk], geom, side_values)
    if bias_smem is not None:
      new_bias_grads.append(bias_grads[index] + jnp.sum(grad, axis=0))
    _store_pieces(grad, [ref.at[:, chunk] for ref in grad_refs])
  plgpu.commit_smem()
  table_grad = ops.dot_acc(table_grad, grad_refs, hidden_tile, products, interpret,
                           transpose_a=True)
  return table_grad, tuple(new_bias_grads)


def _table_init(geom: Geometry, flags: Flags, interpret: bool):
  """The table kernel's loop carry: dE `[64, Dp]` and db, one `[32]` vector per chunk."""
  chunks = _column_chunks(TABLE_BLOCK_V)
  bias_grads = tuple(ops.zeros((chunk.stop - chunk.start,), ops.COLUMNS, interpret)
                     for chunk in chunks) if flags.has_bias else ()
  return ops.zeros((TABLE_BLOCK_V, geom.dim_padded), ops.WGMMA, interpret), bias_grads


def _table_store(carry, table_grad_smem, bias_grad_smem, table_grad_ref, bias_grad_ref, rows):
  """dE and db of this CTA's table rows to global memory (through shared memory)."""
  table_grad, bias_grads = carry
  table_grad_smem[...] = table_grad
  for chunk, bias_grad in zip(_column_chunks(TABLE_BLOCK_V), bias_grads):
    bias_grad_smem.at[chunk][...] = bias_grad
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(table_grad_smem, table_grad_ref.at[rows])
  if bias_grad_ref is not None:
    plgpu.copy_smem_to_gmem(bias_grad_smem, bias_grad_ref.at[rows])
  plgpu.wait_smem_to_gmem(0)


def _table_refs(refs, geom: Geometry, flags: Flags, side: Side):
  """(hidden pieces, table pieces, bias or None, {side name: ref}, dE, db or None)."""
  hidden_refs, table_refs, bias_ref, side_refs, outputs = _input_refs(refs, geom, flags, side)
  table_grad_ref = outputs[0]  # [Vp, Dp] f32
  bias_grad_ref = outputs[1] if flags.has_bias else None  # [Vp] f32
  return hidden_refs, table_refs, bias_ref, side_refs, table_grad_ref, bias_grad_ref


def _token_tile_issue(hidden_refs, side_refs, hidden_smem, side_smem, side: Side,
                      stream_barrier):
  """`issue(tile, slot)`: copy token tile `tile` (the hidden pieces, then the per-token
  operands) into buffer `slot`, every copy arriving on that slot's barrier."""
  streams = [(functools.partial(lambda r, tokens: r.at[tokens], ref), smem)
             for ref, smem in zip(hidden_refs, hidden_smem)]
  streams += [(functools.partial(_side_source, side_refs[name], name, side), side_smem[name])
              for name in side.names]

  def issue(tile, slot):
    tokens = pl.ds(tile * BLOCK_T, BLOCK_T)
    for source, smem in streams:
      plgpu.copy_gmem_to_smem(source(tokens), smem.at[slot], stream_barrier.at[slot])

  return issue


def _table_body(refs, *scratch, geom: Geometry, flags: Flags, side: Side, interpret: bool):
  stages, has_bias = geom.table_stages, flags.has_bias
  (hidden_refs, table_refs, bias_ref, side_refs, table_grad_ref,
   bias_grad_ref) = _table_refs(refs, geom, flags, side)
  (table_smem, bias_smem, hidden_smem, side_smem, grad_smem, table_grad_smem, bias_grad_smem,
   resident_barrier, stream_barrier, _) = scratch

  vocab_start = lax.axis_index("vocab") * TABLE_BLOCK_V
  rows = pl.ds(vocab_start, TABLE_BLOCK_V)
  resident = [(ref.at[rows], smem) for ref, smem in zip(table_refs, table_smem)]
  if has_bias:
    resident.append((bias_ref.at[rows], bias_smem))
  for src, dst in resident:
    plgpu.copy_gmem_to_smem(src, dst, resident_barrier.at[0])

  issue = _token_tile_issue(hidden_refs, side_refs, hidden_smem, side_smem, side,
                            stream_barrier)
  num_tiles = geom.num_token_tiles
  for slot in range(min(stages, num_tiles)):
    issue(slot, slot)
  plgpu.barrier_wait(resident_barrier.at[0])

  def step(tile, carry):
    slot = lax.rem(tile, stages)
    plgpu.barrier_wait(stream_barrier.at[slot])
    carry = _table_update(carry, [smem.at[slot] for smem in hidden_smem], table_smem,
                          grad_smem, bias_smem, vocab_start,
                          _load_side(side_smem, side, interpret, slot), geom, flags, interpret)
    refill = tile + stages
    pl.when(refill < num_tiles)(lambda: issue(refill, slot))
    return carry

  carry = lax.fori_loop(0, num_tiles, step, _table_init(geom, flags, interpret))
  _table_store(carry, table_grad_smem, bias_grad_smem, table_grad_ref, bias_grad_ref, rows)


def _table_ws_body(refs, *scratch, geom: Geometry, flags: Flags, side: Side, interpret: bool):
  """Warp-specialized dE kernel: a producer streams the token tiles (hidden pieces and
  per-token operands) into `table_stages` slots; consumer `c` owns table rows
  [64 c, 64 c + 64) of the CTA's block (its table tile, bias, G pieces, dE and db), reads
  every slot and arrives on its consumed barrier once its two dots have read it."""
  stages, has_bias = geom.table_stages, flags.has_bias
  consumers = geom.table_consumers
  (hidden_refs, table_refs, bias_ref, side_refs, table_grad_ref,
   bias_grad_ref) = _table_refs(refs, geom, flags, side)
  (table_smem, bias_smem, hidden_smem, side_smem, grad_smem, table_grad_smem, bias_grad_smem,
   resident_barrier, stream_barrier, consumed_barrier) = scratch
  warpgroup = lax.axis_index(WARPGROUPS)
  num_tiles = geom.num_token_tiles

  @pl.when(warpgroup < consumers)
  def _consumer():
    plgpu.set_max_registers(CONSUMER_REGISTERS, action="increase")
    vocab_start = (lax.axis_index("vocab") * consumers + warpgroup) * TABLE_BLOCK_V
    rows = pl.ds(vocab_start, TABLE_BLOCK_V)
    own_table = [smem.at[warpgroup] for smem in table_smem]
    resident = [(ref.at[rows], smem) for ref, smem in zip(table_refs, own_table)]
    if has_bias:
      resident.append((bias_ref.at[rows], bias_smem.at[warpgroup]))
    for src, dst in resident:
      plgpu.copy_gmem_to_smem(src, dst, resident_barrier.at[warpgroup])
    plgpu.barrier_wait(resident_barrier.at[warpgroup])
    own_bias = bias_smem.at[warpgroup] if has_bias else None
    own_grad = [smem.at[warpgroup] for smem in grad_smem]

    def step(tile, carry):
      slot = lax.rem(tile, stages)
      plgpu.barrier_wait(stream_barrier.at[slot])
      carry = _table_update(carry, [smem.at[slot] for smem in hidden_smem], own_table,
                            own_grad, own_bias, vocab_start,
                            _load_side(side_smem, side, interpret, slot), geom, flags,
                            interpret)
      plgpu.barrier_arrive(consumed_barrier.at[slot])
      return carry

    carry = lax.fori_loop(0, num_tiles, step, _table_init(geom, flags, interpret))
    _table_store(carry, table_grad_smem.at[warpgroup],
                 bias_grad_smem.at[warpgroup] if has_bias else None, table_grad_ref,
                 bias_grad_ref, rows)

  issue = _token_tile_issue(hidden_refs, side_refs, hidden_smem, side_smem, side,
                            stream_barrier)
  pl.when(warpgroup == consumers)(
      lambda: _produce(issue, num_tiles, stages, consumed_barrier))


def _table_scratch(geom: Geometry, flags: Flags, side: Side):
  num_pieces, stages, dim = geom.pieces, geom.table_stages, geom.dim_padded
  # One per consumer warpgroup when warp-specialized: [consumers, ...].
  own = () if geom.table_consumers == 1 else (geom.table_consumers,)
  return (
      [_smem((*own, TABLE_BLOCK_V, dim), tiled=True)
       for _ in range(num_pieces)],  # table tile pieces
      _smem((*own, TABLE_BLOCK_V), jnp.float32) if flags.has_bias else None,
      [_smem((stages, BLOCK_T, dim), tiled=True) for _ in range(num_pieces)],  # hidden pieces
      _side_smem(side, (stages,)),
      [_smem((*own, BLOCK_T, TABLE_BLOCK_V), tiled=True) for _ in range(num_pieces)],  # G pieces
      _smem((*own, TABLE_BLOCK_V, dim), jnp.float32),  # dE staging
      _smem((*own, TABLE_BLOCK_V), jnp.float32) if flags.has_bias else None,  # db staging
      plgpu.Barrier(num_arrivals=num_pieces + flags.has_bias, num_barriers=geom.table_consumers),
      plgpu.Barrier(num_arrivals=num_pieces + len(side.names), num_barriers=stages),
      # A slot is consumed once every consumer has read it (warp-specialized only).
      plgpu.Barrier(num_arrivals=geom.table_consumers, num_barriers=stages)
      if geom.table_consumers > 1 else None,
  )


def table_grad(hidden, table, bias, side_arrays: dict, *, geom: Geometry, flags: Flags,
               interpret: bool, params):
  """(dE `[Vp, Dp]` f32, db `[Vp]` f32 or None) of one table call; operands padded."""
  side = side_of(side_arrays)
  inputs = [*hidden, *table] + ([bias] if flags.has_bias else [])
  inputs += [side_arrays[name] for name in side.names]
  out_type = [jax.ShapeDtypeStruct((geom.vocab_padded, geom.dim_padded), jnp.float32)]
  if flags.has_bias:
    out_type.append(jax.ShapeDtypeStruct((geom.vocab_padded,), jnp.float32))
  kernel = functools.partial(_table_kernel, geom=geom, flags=flags, side=side,
                             interpret=interpret)
  kernel.__name__ = (f"cutbce_mosaic_{'softmax_' if flags.kind == 'softmax' else ''}"
                     f"table_grad_s{geom.table_stages}"
                     f"{'_ws' if geom.table_consumers > 1 else ''}")
  threads = ({} if geom.table_consumers == 1
             else dict(num_threads=geom.table_consumers + 1, thread_name=WARPGROUPS))
  outputs = plgpu.kernel(kernel, out_type=out_type, grid=(geom.num_table_blocks,),
                         grid_names=("vocab",), interpret=params, **threads)(*inputs)
  return outputs[0], (outputs[1] if flags.has_bias else None)
