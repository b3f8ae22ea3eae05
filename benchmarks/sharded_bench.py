"""Sharded CutBCE against what a user would otherwise write, on 8 simulated devices.

For each mesh shape (data x model) of 8 devices, with hidden split over both
axes and the table's rows over "model", compiles fwd+bwd (value_and_grad) of

  sharded  cutbce.sharding.sharded_cut_bce (shard_map, explicit collectives)
  xla_jit  cutbce.cut_bce(backend="xla") under jax.jit with NamedShardings
           (XLA's partitioner places the collectives)
  dense    cutbce.dense_bce under jax.jit with NamedShardings ([T, V] logits)

and reports per-device compiled temp bytes, the collectives in the compiled
program and whether any sits inside a while loop, and the fwd+bwd wall time
(programs whose temp bytes across all devices exceed --max-run-gib are only
compiled). Prints a table and writes JSON under benchmarks/results/.

    python benchmarks/sharded_bench.py                     # T = 8 x 2048, V = 262,144, D = 64
    python benchmarks/sharded_bench.py --seq 256 --vocab 32768 --no-time   # quick
"""

from __future__ import annotations

import os

_DEVICE_FLAG = "--xla_force_host_platform_device_count=8"
if _DEVICE_FLAG not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _DEVICE_FLAG).strip()

import argparse  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import cutbce  # noqa: E402
from cutbce.sharding import collective_report, sharded_cut_bce  # noqa: E402

MESH_SHAPES = ((8, 1), (4, 2), (2, 4), (1, 8))
TOKEN_AXES = ("data", "model")
VOCAB_AXIS = "model"
GIB = 2**30


def _inputs(args, mesh):
  token_sharding = NamedSharding(mesh, P(TOKEN_AXES))
  keys = jax.random.split(jax.random.key(0), 3)
  dtype = jnp.dtype(args.dtype)
  hidden = (0.1 * jax.random.normal(keys[0], (args.batch, args.seq, args.dim))).astype(dtype)
  table = (0.1 * jax.random.normal(keys[1], (args.vocab, args.dim))).astype(dtype)
  targets = jax.random.randint(keys[2], (args.batch, args.seq, args.num_targets), 0, args.vocab)
  return (
      jax.device_put(hidden, token_sharding),
      jax.device_put(table, NamedSharding(mesh, P(VOCAB_AXIS, None))),
      jax.device_put(targets, token_sharding),
  )


def _losses(mesh):
  return {
      "sharded": lambda h, e, y: sharded_cut_bce(
          h, e, y, mesh=mesh, token_axes=TOKEN_AXES, vocab_axis=VOCAB_AXIS, backend="xla"),
      "xla_jit": lambda h, e, y: cutbce.cut_bce(h, e, y, backend="xla"),
      "dense": lambda h, e, y: cutbce.dense_bce(h, e, y),
  }


def _measure(name, loss, inputs, args):
  hidden, table, targets = inputs
  step = jax.jit(
      jax.value_and_grad(loss, (0, 1)),
      in_shardings=(hidden.sharding, table.sharding, targets.sharding),
      out_shardings=(NamedSharding(hidden.sharding.mesh, P()), (hidden.sharding, table.sharding)),
  )
  start = time.perf_counter()
  compiled = step.lower(hidden, table, targets).compile()
  compile_s = time.perf_counter() - start
  memory = compiled.memory_analysis()
  report = collective_report(compiled.as_text())
  row = {
      "variant": name,
      "temp_bytes_per_device": int(memory.temp_size_in_bytes),
      "argument_bytes_per_device": int(memory.argument_size_in_bytes),
      "output_bytes_per_device": int(memory.output_size_in_bytes),
      "collectives": report.count,
      "collective_ops": list(report.ops),
      "collectives_in_loop": len(report.in_loop),
      "collective_ops_in_loop": list(report.in_loop),
      "compile_s": round(compile_s, 2),
      "fwd_bwd_s": None,
  }
  runnable = memory.temp_size_in_bytes * len(jax.devices()) <= args.max_run_gib * GIB
  if args.time and runnable:
    jax.block_until_ready(compiled(hidden, table, targets))  # warm up
    times = []
    for _ in range(args.repeats):
      start = time.perf_counter()
      jax.block_until_ready(compiled(hidden, table, targets))
      times.append(time.perf_counter() - start)
    row["fwd_bwd_s"] = round(float(np.median(times)), 3)
  elif args.time:
    row["skipped"] = f"temp bytes over --max-run-gib={args.max_run_gib} across devices"
  return row


def _print_row(row):
  time_s = "-" if row["fwd_bwd_s"] is None else f"{row['fwd_bwd_s']:.2f}"
  print(
      f"{row['mesh']:>6} {row['variant']:>8} {row['temp_bytes_per_device'] / 2**20:>12.1f} "
      f"{row['collectives']:>11} {row['collectives_in_loop']:>8} {time_s:>10}",
      flush=True,
  )


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--seq", type=int, default=2048)
  parser.add_argument("--vocab", type=int, default=262_144)
  parser.add_argument("--dim", type=int, default=64)
  parser.add_argument("--num-targets", type=int, default=4)
  parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
  parser.add_argument("--variants", default="sharded,xla_jit,dense")
  parser.add_argument("--meshes", default=",".join(f"{a}x{b}" for a, b in MESH_SHAPES))
  parser.add_argument("--repeats", type=int, default=1)
  parser.add_argument("--no-time", dest="time", action="store_false")
  parser.add_argument("--max-run-gib", type=float, default=8.0)
  parser.add_argument("--out", default="benchmarks/results/sharded_bench.json")
  args = parser.parse_args()

  config = {k: v for k, v in vars(args).items() if k not in ("out",)}
  config.update(num_tokens=args.batch * args.seq, devices=len(jax.devices()),
                platform=jax.default_backend(), jax_version=jax.__version__)
  results = {"config": config, "rows": []}
  out = pathlib.Path(args.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  print(f"T = {args.batch} x {args.seq}, V = {args.vocab:,}, D = {args.dim}, "
        f"L = {args.num_targets}, {args.dtype}; hidden over {TOKEN_AXES}, table rows over "
        f"{VOCAB_AXIS!r}")
  print(f"{'mesh':>6} {'variant':>8} {'temp MiB/dev':>12} {'collectives':>11} "
        f"{'in loop':>8} {'fwd+bwd s':>10}")
  for mesh_name in args.meshes.split(","):
    shape = tuple(int(n) for n in mesh_name.split("x"))
    mesh = Mesh(np.array(jax.devices()[: shape[0] * shape[1]]).reshape(shape), ("data", "model"))
    inputs = _inputs(args, mesh)
    losses = _losses(mesh)
    for variant in args.variants.split(","):
      row = {"mesh": mesh_name, **_measure(variant, losses[variant], inputs, args)}
      results["rows"].append(row)
      _print_row(row)
      out.write_text(json.dumps(results, indent=2))  # partial results survive
  print(f"wrote {out}")


if __name__ == "__main__":
  main()
