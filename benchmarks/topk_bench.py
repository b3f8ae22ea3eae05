"""Top-k retrieval benchmark: `cutbce.top_k` (tiled) vs `lax.top_k` of dense logits.

At T tokens, D, V items and k (default T = 2048, D = 64, V = 1,048,576,
k = 100, float32) both contenders return the k best items of every token:

    cutbce  `cutbce.topk.top_k(hidden, table, k)`: a running top-k carried over
            vocabulary tiles, never a [T, V] array;
    dense   `lax.top_k(hidden @ table.T, k)`: the [T, V] float32 logits
            (8 GiB at the default size), then one top-k.

Reported: the compiled temp bytes (`memory_analysis().temp_size_in_bytes`,
exact and repeatable) and the median wall time over interleaved repeats (one
warm-up run each first), plus how many ids the two agree on. Several
`--block-v` values race as separate cutbce contenders (the sweep that picked
`cutbce.topk.default_block_v`).

    python benchmarks/topk_bench.py                                   # full size
    python benchmarks/topk_bench.py --vocab 131072 --block-v 2048 4096 8192 \\
        --no-dense --out /tmp                                         # block_v sweep

Prints a table and writes JSON (`topk_bench.json`, or --name) under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import cutbce
from cutbce import topk


def make_inputs(tokens, dim, vocab, dtype, seed=0):
  keys = jax.random.split(jax.random.PRNGKey(seed), 2)
  hidden = jax.random.normal(keys[0], (tokens, dim)).astype(dtype)
  table = (jax.random.normal(keys[1], (vocab, dim)) * 0.1).astype(dtype)
  return hidden, table


def cut_fn(k, block_v):
  plan = cutbce.TilePlan(block_v=block_v) if block_v else None

  def fn(hidden, table):
    return topk.top_k(hidden, table, k, backend="xla", plan=plan)

  return fn


def dense_fn(k):
  def fn(hidden, table):
    logits = lax.dot_general(
        hidden, table, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
    )  # [T, V]
    return lax.top_k(logits, k)

  return fn


def compile_with_temp(fn, args):
  compiled = jax.jit(fn).lower(*args).compile()
  return compiled, compiled.memory_analysis().temp_size_in_bytes


def interleaved_median_times(compiled_fns, args, repeats):
  """Median wall time of each compiled fn; runs are interleaved so that load on
  a shared machine hits every contender alike. One warm-up run each first."""
  outputs = {name: jax.block_until_ready(fn(*args)) for name, fn in compiled_fns.items()}
  times = {name: [] for name in compiled_fns}
  for _ in range(repeats):
    for name, fn in compiled_fns.items():
      start = time.perf_counter()
      jax.block_until_ready(fn(*args))
      times[name].append(time.perf_counter() - start)
  return {name: statistics.median(t) for name, t in times.items()}, times, outputs


def agreement(got, want):
  """Fraction of equal ids, and the max |score difference|, of two (scores, ids)."""
  return (float(np.mean(np.asarray(got[1]) == np.asarray(want[1]))),
          float(np.max(np.abs(np.asarray(got[0]) - np.asarray(want[0])))))


def compare(*, tokens, dim, vocab, k, dtype="float32", block_vs=(0,), repeats=3, dense=True):
  """cutbce top_k (each block_v; 0 = default plan) against dense `lax.top_k`, side by side.

  Prints a table; returns one row dict per contender (temp bytes, median and
  all times, and agreement with dense where it ran).
  """
  dtype = jnp.dtype(dtype)
  hidden, table = make_inputs(tokens, dim, vocab, dtype)
  operands = (hidden, table)
  print(f"topk_bench: T={tokens} D={dim} V={vocab} k={k} {dtype.name}, "
        f"jax {jax.__version__} on {jax.devices()[0].platform}, {os.cpu_count()} cores",
        flush=True)
  contenders, rows = {}, {}
  for block_v in block_vs:
    resolved = block_v or topk.default_block_v(tokens, vocab)
    name = f"cutbce[block_v={resolved}]"
    contenders[name], temp = compile_with_temp(cut_fn(k, block_v), operands)
    rows[name] = dict(contender="cutbce", block_v=resolved, temp_bytes=temp)
  if dense:
    contenders["dense"], temp = compile_with_temp(dense_fn(k), operands)
    rows["dense"] = dict(contender="dense", block_v=None, temp_bytes=temp)
  medians, all_times, outputs = interleaved_median_times(contenders, operands, repeats)
  reference = outputs.get("dense")
  print(f"{'contender':>24} {'median s':>9} {'temp MiB':>10} {'ids = dense':>11} "
        f"{'max |ds|':>9}")
  for name, row in rows.items():
    row["median_seconds"] = medians[name]
    row["seconds"] = all_times[name]
    if reference is not None and name != "dense":
      row["ids_equal_dense"], row["max_score_diff"] = agreement(outputs[name], reference)
    fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
    print(f"{name:>24} {row['median_seconds']:9.3f} {row['temp_bytes'] / 2**20:10.1f} "
          f"{fmt(row.get('ids_equal_dense'), '11.5f')} {fmt(row.get('max_score_diff'), '9.2e')}",
          flush=True)
  return list(rows.values())


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--tokens", type=int, default=2048)
  parser.add_argument("--dim", type=int, default=64)
  parser.add_argument("--vocab", type=int, default=1_048_576)
  parser.add_argument("--k", type=int, default=100)
  parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
  parser.add_argument("--block-v", type=int, nargs="+", default=[0],
                      help="cutbce block_v values to race (0 = the default plan)")
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--dense", action=argparse.BooleanOptionalAction, default=True)
  parser.add_argument("--out", default="docs/results")
  parser.add_argument("--name", default="topk_bench.json")
  args = parser.parse_args()
  rows = compare(tokens=args.tokens, dim=args.dim, vocab=args.vocab, k=args.k, dtype=args.dtype,
                 block_vs=args.block_v, repeats=args.repeats, dense=args.dense)
  os.makedirs(args.out, exist_ok=True)
  result = dict(
      config=vars(args), jax=jax.__version__,
      machine=dict(platform=platform.platform(), cores=os.cpu_count()),
      rows=rows,
  )
  path = os.path.join(args.out, args.name)
  with open(path, "w") as f:
    json.dump(result, f, indent=2)
  print(f"wrote {path}")


if __name__ == "__main__":
  main()
