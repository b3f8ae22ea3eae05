"""Per-position sampled negatives: gathered rows against all logits and a take.

`trainer.sampled.sampled_loss` with `negatives_per="position"` computes a
position's k negative logits either from its k gathered table rows (a
`[T, k, D]` tensor, scatter-added back in the backward) or, where
`sampled.full_logits_pay`, from all `[T, V]` logits and a take of the k. This
times the loss's value and gradients (hidden, table, bias) both ways on one
device, interleaved (a warm-up, then --repeats rounds; min and median), and
reads each compiled program's temporaries from XLA's memory analysis. The
default shape is gSASRec's on MovieLens-1M (configs/ml1m_gsasrec.py: batch
128 x 200 positions, 256 negatives per position, D = 128, V = 3,417 rows).

    python benchmarks/sampled_logits.py [--vocab 3417] [--k 256] [--dim 128]

`--compile-for v5e-1` (a `cutbce.kernels.compiler` topology) also compiles
gSASRec's whole train step (configs/ml1m_gsasrec.py, one chip) for that TPU
with libtpu, no TPU attached, both ways: its temporaries and peak from the
compiled program's memory analysis and the compiler's FLOP count ("compiled
for", not a timing).

Prints a table and writes docs/results/sampled_logits.json (--out).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import pathlib
import platform
import shlex
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # trainer/

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from trainer import sampled  # noqa: E402

ROUTES = {"gathered": 0, "full": 1 << 30}  # route -> sampled.FULL_LOGITS_RATIO that forces it


@contextlib.contextmanager
def _forced(route: str):
  """Traces within it take `route` (`sampled.FULL_LOGITS_RATIO` set to force it)."""
  saved = sampled.FULL_LOGITS_RATIO
  sampled.FULL_LOGITS_RATIO = ROUTES[route]
  try:
    yield
  finally:
    sampled.FULL_LOGITS_RATIO = saved


def _step(route: str, args, inputs):
  """The jitted value-and-gradients of the gBCE loss, traced with `route` forced."""
  loss = sampled.SampledLoss(kind="gbce", num_negatives=args.k, negatives_per="position",
                             gbce_t=0.75)

  def value(h, table, bias, targets, weights, negatives):
    return sampled.sampled_loss(h, table, targets, weights, negatives, bias=bias,
                                num_items=args.vocab, loss=loss)[0]

  with _forced(route):
    return jax.jit(jax.value_and_grad(value, (0, 1, 2))).lower(*inputs).compile()


def _inputs(args):
  rng = np.random.default_rng(0)
  tokens = args.batch * args.seq
  h = jnp.asarray(rng.normal(size=(args.batch, args.seq, args.dim)).astype(np.float32))
  table = jnp.asarray((0.1 * rng.normal(size=(args.vocab, args.dim))).astype(np.float32))
  bias = jnp.asarray((0.1 * rng.normal(size=args.vocab)).astype(np.float32))
  targets = jnp.asarray(rng.integers(0, args.vocab, size=(args.batch, args.seq, 1)), jnp.int32)
  weights = jnp.ones((args.batch, args.seq), jnp.float32)
  ids = rng.integers(0, args.vocab, size=(tokens, args.k)).astype(np.int32)
  negatives = sampled.Negatives(jnp.asarray(ids), jnp.ones(ids.shape, bool),
                                jnp.zeros(ids.shape, jnp.float32))
  return h, table, bias, targets, weights, negatives


def compiled_for(topology: str) -> dict:
  """gSASRec's ML-1M train step compiled for `topology`, per route: memory and FLOPs."""
  # pylint: disable=import-outside-toplevel
  from configs import ml1m_gsasrec
  from cutbce.kernels import compiler
  from trainer.commands import compile as compile_lib
  from trainer.config import mesh as config_mesh
  devices = compiler.topology_devices(topology)
  hbm = compiler.tiling_chip(topology).hbm_capacity_bytes
  rows = {}
  for route in ROUTES:
    config = ml1m_gsasrec.get_config()
    config.mesh.shape = (len(devices),)
    config_mesh.check_config(config, devices=devices)
    mesh = config_mesh.make_mesh(config, devices)
    with _forced(route):
      jitted, args = compile_lib.step_programs(config, num_items=3416, mesh=mesh)["train"]
      result = compile_lib.compile_step("train", jitted, args, devices=devices, hbm_bytes=hbm)
    rows[route] = {name: result[name] for name in ("temp_bytes", "peak_bytes", "compiler_flops",
                                                   "compile_s")}
    print(f"{topology} {route:>9}  temporaries {result['temp_bytes'] / 2**20:,.0f} MiB  peak "
          f"{result['peak_bytes'] / 2**20:,.0f} MiB  {result['compiler_flops'] / 1e9:,.1f} GFLOP "
          f"(compiled for, gSASRec's train step)", flush=True)
  return {"topology": topology, "config": "configs/ml1m_gsasrec.py", "routes": rows}


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--batch", type=int, default=128)
  parser.add_argument("--seq", type=int, default=200)
  parser.add_argument("--k", type=int, default=256)
  parser.add_argument("--dim", type=int, default=128)
  parser.add_argument("--vocab", type=int, default=3417)
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--out", default="docs/results/sampled_logits.json")
  parser.add_argument("--compile-for", default=None,
                      help="also compile gSASRec's train step for this TPU topology (libtpu)")
  args = parser.parse_args(argv)
  inputs = _inputs(args)
  steps = {route: _step(route, args, inputs) for route in ROUTES}
  values = {route: step(*inputs) for route, step in steps.items()}  # warm-up
  gap = max(float(jnp.max(jnp.abs(a - b)) / (float(jnp.max(jnp.abs(b))) or 1.0))
            for a, b in zip(jax.tree.leaves(values["full"]), jax.tree.leaves(values["gathered"])))
  times = {route: [] for route in ROUTES}
  for _ in range(args.repeats):
    for route, step in steps.items():
      start = time.perf_counter()
      jax.block_until_ready(step(*inputs))
      times[route].append(time.perf_counter() - start)
  chosen = "full" if sampled.full_logits_pay(args.vocab, args.k, args.dim) else "gathered"
  report = {
      "command": "python benchmarks/sampled_logits.py " + shlex.join(sys.argv[1:] if argv is None
                                                                       else argv),
      "shape": {"tokens": args.batch * args.seq, "k": args.k, "dim": args.dim,
                "vocab": args.vocab},
      "machine": {"platform": jax.devices()[0].platform,
                  "device_kind": jax.devices()[0].device_kind, "devices": 1,
                  "processor": platform.processor() or platform.machine(), "jax": jax.__version__},
      "auto_route": chosen,
      "max_relative_gap": gap,
      "routes": {route: {"min_s": min(t), "median_s": float(np.median(t)),
                         "temp_bytes": steps[route].memory_analysis().temp_size_in_bytes}
                 for route, t in times.items()},
  }
  print(f"T = {args.batch * args.seq:,}, k = {args.k}, D = {args.dim}, V = {args.vocab:,} "
        f"(auto: {chosen}; values and gradients agree to {gap:.1e} of their largest)")
  for route, row in report["routes"].items():
    print(f"{route:>9}  min {row['min_s']:.3f} s  median {row['median_s']:.3f} s  "
          f"temporaries {row['temp_bytes'] / 2**20:,.0f} MiB")
  if args.compile_for:
    report["compiled_for"] = compiled_for(args.compile_for)
  out = pathlib.Path(args.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps(report, indent=2) + "\n")
  print(f"wrote {out}")
  return report


if __name__ == "__main__":
  main()
