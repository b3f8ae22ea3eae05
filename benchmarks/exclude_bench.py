"""Where a softmax step with `loss.exclude="window"` spends its time.

Issue 39's exclusion runs (the best recipe, `configs/ml1m_best.py` with
`loss.exclude='window'`: B = 128 windows of N = 200, E = N + L = 201
excluded ids a position, V = 3,416, D = 128) ran at 0.99 steps/s on one TPU
v5e, on the XLA path (E is past the Pallas kernels' `MAX_SOFTMAX_EXCLUDE`).
This times, side by side in one process (min over interleaved repeats), the
whole op with its gradients and stats (`cut_softmax_ce`, backend xla) without
exclusion, with the trainer's per-position `[B, N, E]` ids, and with one row
of ids per window, `[B, 1, E]`, shared by its N positions (and the same three
for `cut_bce`, each against BCE without exclusion); and the parts of
the per-position form: the ids' preparation (`sparse.prepare_ids`), the
logits at the excluded ids, the vocabulary sweep (`softmax_forward` of the
XLA kernels) with and without its mask, and the mask alone, by a scatter and
by compares (`xla.excluded_columns`).

    python benchmarks/exclude_bench.py --out docs/results/exclude_bench_cpu.json
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import sys

import jax
import jax.numpy as jnp
import numpy as np

import cutbce
from cutbce import sparse
from cutbce.kernels import xla as xla_kernels

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from loss_bench import interleaved_min_times  # noqa: E402  pylint: disable=wrong-import-position


def excluded_by_product(exclude_ids, start, size: int):
  """`xla.excluded_columns` as a product of one-hots on the matrix unit (a candidate).

  Column j = 128 a + b is excluded for token t where sum_e [hi_te = a] [lo_te = b]
  > 0: a batched `[A, E] x [E, 128]` product per token, exact in bfloat16.
  """
  local = exclude_ids - start
  inside = (local >= 0) & (local < size)
  lanes = 128
  rows = -(-size // lanes)
  high = jax.nn.one_hot(jnp.where(inside, local // lanes, -1), rows, dtype=jnp.bfloat16)
  low = jax.nn.one_hot(local % lanes, lanes, dtype=jnp.bfloat16)
  counts = jnp.einsum("tea,teb->tab", high, low, preferred_element_type=jnp.float32)
  return (counts.reshape(exclude_ids.shape[0], rows * lanes) > 0)[:, :size]


def excluded_by_unique_scatter(exclude_ids, start, size: int):
  """`xla.excluded_columns` as a scatter promised unique indices (a candidate).

  Ids out of the tile go to distinct slots past the end (dropped), so the
  promise holds for rows without repeated ids (the op dedups its rows).
  """
  tokens, width = exclude_ids.shape
  local = exclude_ids - start
  inside = (local >= 0) & (local < size)
  index = jnp.arange(tokens, dtype=jnp.int32)[:, None] * size + local
  spare = tokens * size + jnp.arange(tokens * width, dtype=jnp.int32).reshape(tokens, width)
  index = jnp.where(inside, index, spare).reshape(-1)
  flat = jnp.zeros((tokens * size,), bool).at[index].set(True, mode="drop", unique_indices=True)
  return flat.reshape(tokens, size)


def make_inputs(batch, seq, dim, vocab, seed=0):
  """A window per row: distinct items, left padding, next-item targets."""
  rng = np.random.default_rng(seed)
  items = np.stack([rng.permutation(vocab)[:seq + 1] for _ in range(batch)])  # [B, N + 1]
  lengths = rng.integers(seq // 4, seq + 1, size=batch)
  keep = np.arange(seq + 1)[None, :] >= (seq - lengths)[:, None]
  items = np.where(keep, items, -1)
  inputs, targets = items[:, :-1], items[:, 1:, None]  # [B, N], [B, N, 1]
  window = np.concatenate([inputs, targets[:, -1, :]], axis=-1)  # [B, N + L]
  hidden = rng.normal(size=(batch, seq, dim)) * 0.3
  table = rng.normal(size=(vocab, dim)) * 0.3
  return dict(
      hidden=jnp.asarray(hidden, jnp.float32), table=jnp.asarray(table, jnp.float32),
      targets=jnp.asarray(targets, jnp.int32),
      weights=jnp.asarray(targets[..., 0] >= 0, jnp.float32),
      window=jnp.asarray(window, jnp.int32))


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--batch", type=int, default=128)
  parser.add_argument("--seq", type=int, default=200)
  parser.add_argument("--dim", type=int, default=128)
  parser.add_argument("--vocab", type=int, default=3416)
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--out", default=None)
  args = parser.parse_args()
  x = make_inputs(args.batch, args.seq, args.dim, args.vocab)
  batch, seq = args.batch, args.seq
  per_position = jnp.broadcast_to(x["window"][:, None, :], (batch, seq, x["window"].shape[-1]))
  shared = x["window"][:, None, :]
  tokens = batch * seq

  # Every array is an argument (none is folded into the program as a constant).
  operands = (x["hidden"], x["table"], x["targets"], x["weights"], per_position, shared)

  def op(which, loss_fn=cutbce.cut_softmax_ce):
    def loss(hidden, table, targets, weights, exclude):
      return loss_fn(hidden, table, targets, weights, exclude=exclude, backend="xla",
                     return_stats=True)
    grad = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)
    exclude = {"none": lambda *e: None, "per_position": lambda p, s: p,
               "shared": lambda p, s: s}[which]
    return lambda h, t, y, w, p, s: grad(h, t, y, w, exclude(p, s))

  def sweep(masked):
    return lambda h, t, y, w, p, s: xla_kernels.softmax_forward(
        h.reshape(tokens, -1), t, None, p.reshape(tokens, -1) if masked else None, plan=None,
        with_counts=True)

  fns = {
      "op, no exclusion": op("none"),
      "op, exclude [B, N, E]": op("per_position"),
      "op, exclude [B, 1, E]": op("shared"),
      # The same for cut_bce, whose backward sets the excluded ids' columns.
      "bce op, no exclusion": op("none", cutbce.cut_bce),
      "bce op, exclude [B, N, E]": op("per_position", cutbce.cut_bce),
      "bce op, exclude [B, 1, E]": op("shared", cutbce.cut_bce),
      "prepare_ids [T, E]": lambda h, t, y, w, p, s: sparse.prepare_ids(
          y.reshape(tokens, -1), p.reshape(tokens, -1), args.vocab),
      "logits at [T, E] ids": lambda h, t, y, w, p, s: sparse.gather_logits(
          h.reshape(tokens, -1), t, None, jnp.maximum(p.reshape(tokens, -1), 0)),
      "sweep, no mask": sweep(False),
      "sweep, [T, E] mask": sweep(True),
      # The two ways to mark a tile's excluded columns (`xla.excluded_columns`
      # picks one per platform), over the whole catalog as one tile.
      "mask by scatter": lambda h, t, y, w, p, s: xla_kernels.excluded_by_scatter(
          p.reshape(tokens, -1), 0, args.vocab),
      "mask by compare": lambda h, t, y, w, p, s: xla_kernels.excluded_by_compare(
          p.reshape(tokens, -1), 0, args.vocab),
      "mask by product": lambda h, t, y, w, p, s: excluded_by_product(
          p.reshape(tokens, -1), 0, args.vocab),
      "mask by unique scatter": lambda h, t, y, w, p, s: excluded_by_unique_scatter(
          p.reshape(tokens, -1), 0, args.vocab),
  }
  masks = {name: jax.jit(fn)(*operands) for name, fn in fns.items() if name.startswith("mask")}
  for name, mask in masks.items():  # every candidate marks the same columns
    np.testing.assert_array_equal(mask, masks["mask by scatter"], err_msg=name)
  compiled, skipped = {}, {}
  for name, fn in fns.items():
    try:
      compiled[name] = jax.jit(fn).lower(*operands).compile()
    except (ValueError, TypeError, NotImplementedError) as error:
      skipped[name] = f"{type(error).__name__}: {error}"
      print(f"{name}: skipped ({skipped[name][:120]})", flush=True)
  times = interleaved_min_times(compiled, operands, args.repeats)
  rows = []
  for name, seconds in times.items():
    base = times["bce op, no exclusion" if name.startswith("bce") else "op, no exclusion"]
    rows.append({"case": name, "ms": round(seconds * 1e3, 2),
                 "vs_no_exclusion": round(seconds / base, 2)})
    print(f"{name:28s} {seconds * 1e3:10.2f} ms  {seconds / base:6.2f}x", flush=True)
  result = {
      "command": "python benchmarks/exclude_bench.py",
      "device": str(jax.devices()[0].device_kind), "backend": jax.default_backend(),
      "host": platform.machine(), "jax": jax.__version__,
      "shape": {"batch": batch, "seq": seq, "dim": args.dim, "vocab": args.vocab,
                "exclude": int(x["window"].shape[-1]), "dtype": "float32"},
      "repeats": args.repeats, "rows": rows, "skipped": skipped,
  }
  if args.out:
    with open(args.out, "w") as f:
      json.dump(result, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
