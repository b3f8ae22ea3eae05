"""What a change to the op costs: the same fwd+bwd timed on two source trees, interleaved.

Issue 30 moved each target's (and each BCE excluded id's) gradient into the
backward tile, in float32, before the cast to the input dtype. This times
`jax.value_and_grad` of `cut_bce` and `cut_softmax_ce` (reduction "mean",
w.r.t. hidden and table; the default backend, XLA on CPU) on the code of
two trees: `--before`, a checkout of the older commit (e.g. made with
`git worktree add /tmp/before bca7168`), and this checkout. Each measurement
is a fresh process whose `PYTHONPATH` puts one tree's `cutbce` first; the
trees alternate within every repeat, so both see the same machine state.
Reported: the minimum over repeats of the per-call time (after one warm-up
call in each process), and after / before.

    git worktree add /tmp/before bca7168
    python benchmarks/fix_cost.py --before /tmp/before --out docs/results/precision_cost.json

Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]

# One measurement, run in a child process with one tree on its path.
_CHILD = r"""
import json, sys, time
import jax, jax.numpy as jnp, numpy as np
import cutbce
vocab, tokens, dim, targets, dtype, loss, calls = json.loads(sys.argv[1])
rng = np.random.default_rng(0)
dtype = jnp.dtype(dtype)
hidden = jnp.asarray(rng.normal(size=(tokens, dim)) / dim ** 0.5, dtype)
table = jnp.asarray(rng.normal(size=(vocab, dim)), dtype)
ids = jnp.asarray(rng.integers(0, vocab, size=(tokens, targets)), jnp.int32)
op = cutbce.cut_bce if loss == "bce" else cutbce.cut_softmax_ce
fn = jax.jit(jax.value_and_grad(lambda h, e: op(h, e, ids), argnums=(0, 1)))
jax.block_until_ready(fn(hidden, table))
best = float("inf")
for _ in range(calls):
  start = time.perf_counter()
  jax.block_until_ready(fn(hidden, table))
  best = min(best, time.perf_counter() - start)
print(json.dumps({"seconds": best}))
"""


def measure(tree: pathlib.Path, case: list) -> float:
  env = dict(os.environ, PYTHONPATH=str(tree))
  result = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(case)], env=env,
                          cwd=str(tree), capture_output=True, text=True, check=False)
  if result.returncode != 0:
    raise RuntimeError(f"{tree}: {result.stderr[-2000:]}")
  return json.loads(result.stdout.strip().splitlines()[-1])["seconds"]


def _commit(tree: pathlib.Path) -> str:
  result = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True, check=False)
  return result.stdout.strip() or "unknown"


def _other_args(argv: list[str]) -> list[str]:
  """The command line without `--before PATH` (a machine path)."""
  out, skip = [], False
  for arg in argv:
    if skip:
      skip = False
    elif arg == "--before":
      skip = True
    elif not arg.startswith("--before="):
      out.append(arg)
  return out


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--before", required=True, type=pathlib.Path,
                      help="a checkout of the older code (its cutbce/ is timed as 'before')")
  parser.add_argument("--vocab", type=int, nargs="+", default=[131_072, 1_048_576])
  parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
  parser.add_argument("--loss", nargs="+", default=["bce", "softmax_ce"])
  parser.add_argument("--tokens", type=int, default=2_048)
  parser.add_argument("--dim", type=int, default=64)
  parser.add_argument("--targets", type=int, default=4)
  parser.add_argument("--repeats", type=int, default=2, help="processes per tree and case")
  parser.add_argument("--calls", type=int, default=2, help="timed calls per process")
  parser.add_argument("--out", default=None)
  args = parser.parse_args()
  if not (args.before / "cutbce").is_dir():
    parser.error(f"--before={args.before}: no cutbce/ package there")
  trees = {"before": args.before.resolve(), "after": ROOT}
  rows = []
  print(f"{'loss':<11}{'dtype':<10}{'V':>10}{'before s':>10}{'after s':>10}{'ratio':>8}",
        flush=True)
  for loss in args.loss:
    for dtype in args.dtype:
      for vocab in args.vocab:
        case = [vocab, args.tokens, args.dim, args.targets, dtype, loss, args.calls]
        best = {name: float("inf") for name in trees}
        for _ in range(args.repeats):
          for name, tree in trees.items():
            best[name] = min(best[name], measure(tree, case))
        row = {"loss": loss, "dtype": dtype, "vocab": vocab, "before_s": best["before"],
               "after_s": best["after"], "ratio": best["after"] / best["before"]}
        rows.append(row)
        print(f"{loss:<11}{dtype:<10}{vocab:>10,}{row['before_s']:>10.3f}"
              f"{row['after_s']:>10.3f}{row['ratio']:>8.2f}", flush=True)
  if args.out:
    record = {"what": "fwd+bwd of the cut op, before and after a change, interleaved processes",
              "tokens": args.tokens, "dim": args.dim, "targets": args.targets,
              "repeats": args.repeats, "calls": args.calls,
              "before_commit": _commit(args.before), "after_commit": _commit(ROOT),
              "command": "python benchmarks/fix_cost.py --before <checkout of before_commit> "
                         + " ".join(_other_args(sys.argv[1:])),
              "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
              "rows": rows}
    pathlib.Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
