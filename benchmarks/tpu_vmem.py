"""The VMEM planner against the TPU compiler: estimate / actual per kernel per chip.

For each chip and each Pallas kernel (forward, backward, one_pass, ranks) and
a set of plans around the planner's usual one (tiles, token chunk, D, dtype,
bias, a loss variant, L), compiles the kernel alone with libtpu for one chip
of that generation (no TPU needed) and finds the smallest
`vmem_limit_bytes` Mosaic accepts (`compiler.measured_vmem_bytes`: the
compiler's own out-of-VMEM report, followed until it compiles). Beside it:
`tiling.vmem_estimate` of the same plan, the number the planner budgets with.

    python benchmarks/tpu_vmem.py                     # v5e and v6e, the full set
    python benchmarks/tpu_vmem.py --chips v6e --quick # the base plan only

Needs the `tpu` extra (`pip install 'cutbce[tpu]'`). Prints a table and
writes JSON to docs/results/tpu_vmem.json (kept between runs: a measured
case is not compiled again unless --fresh).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax.numpy as jnp  # noqa: E402

from cutbce import variants  # noqa: E402
from cutbce.kernels import compiler, tiling  # noqa: E402
from cutbce.kernels.tiling import TilePlan  # noqa: E402

MIB = 2**20
# T and V of every case: T a multiple of every chunk below, V ragged.
TOKENS, VOCAB = 8192, 131_071
BASE = dict(dtype="bfloat16", dim=128, block_t=256, block_v=4096, token_chunk=4096,
            bias=False, variant=False, num_targets=8)
# One factor at a time around BASE.
CASES = [
    {},
    {"dtype": "float32"},
    {"dim": 256}, {"dim": 256, "dtype": "float32"},
    {"block_v": 1024},
    {"block_t": 512, "block_v": 2048},
    {"token_chunk": 256}, {"token_chunk": 1024},
    {"token_chunk": 8192, "dim": 256, "dtype": "float32"},
    {"bias": True},
    {"variant": True},
]
# The cases measured on every chip; the others on the first chip named.
CORE_CASES = 4
SOFT_CAP = variants.LossOptions(logit_soft_cap=30.0)
ESTIMATED_AS = {"forward": "forward", "backward": "backward", "one_pass": "backward",
                "ranks": "ranks"}


def case_key(chip: str, kernel: str, case: dict) -> str:
  return f"{chip}/{kernel}/" + ",".join(f"{k}={v}" for k, v in sorted(case.items()))


def measure(chip: str, kernel: str, case: dict, device) -> dict:
  c = {**BASE, **case}
  dtype = jnp.dtype(c["dtype"])
  plan = TilePlan(block_v=c["block_v"], block_t=c["block_t"], token_chunk=c["token_chunk"],
                  vmem_limit_bytes=128 * MIB)
  options = SOFT_CAP if c["variant"] else variants.PLAIN
  start = time.perf_counter()
  actual = compiler.measured_vmem_bytes(
      kernel, plan=plan, num_tokens=TOKENS, vocab=VOCAB, dim=c["dim"], dtype=dtype,
      device=device, bias=c["bias"], num_targets=c["num_targets"], options=options)
  estimate = tiling.vmem_estimate(
      ESTIMATED_AS[kernel], token_chunk=c["token_chunk"], block_t=c["block_t"],
      block_v=c["block_v"], dim=c["dim"], itemsize=dtype.itemsize,
      num_targets=c["num_targets"], extra_logit_tiles=0 if options.is_affine else 4)
  return {"chip": chip, "kernel": kernel, **c, "actual_bytes": actual,
          "estimate_bytes": estimate, "ratio": round(estimate / actual, 2),
          "seconds": round(time.perf_counter() - start, 1)}


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--chips", nargs="+", default=["v5e", "v6e"])
  parser.add_argument("--kernels", nargs="+", default=list(compiler.KERNEL_CALLS))
  parser.add_argument("--quick", action="store_true", help="the base plan only")
  parser.add_argument("--fresh", action="store_true", help="measure every case again")
  parser.add_argument("--out", default="docs/results/tpu_vmem.json")
  args = parser.parse_args(argv)
  reason = compiler.libtpu_missing_reason()
  if reason:
    raise SystemExit(reason)
  out = pathlib.Path(args.out)
  results = {} if args.fresh or not out.exists() else json.loads(out.read_text())["cases"]
  cases = CASES[:1] if args.quick else CASES
  print(f"{'chip':>4} {'kernel':>8} {'case':<40} {'actual MiB':>10} {'estimate MiB':>12} "
        f"{'est/act':>7}", flush=True)
  for chip in args.chips:
    device = compiler.topology_devices(f"{chip}-1")[0]
    for kernel in args.kernels:
      for case in (cases if chip == args.chips[0] else cases[:CORE_CASES]):
        key = case_key(chip, kernel, case)
        if key not in results:
          results[key] = measure(chip, kernel, case, device)
          out.parent.mkdir(parents=True, exist_ok=True)
          out.write_text(json.dumps({"tokens": TOKENS, "vocab": VOCAB, "base": BASE,
                                     "cases": results}, indent=1) + "\n")
        r = results[key]
        label = ",".join(f"{k}={v}" for k, v in sorted(case.items())) or "base"
        print(f"{chip:>4} {kernel:>8} {label:<40} {r['actual_bytes'] / MIB:>10.2f} "
              f"{r['estimate_bytes'] / MIB:>12.2f} {r['ratio']:>7.2f}", flush=True)
  print(f"wrote {out}")


if __name__ == "__main__":
  main()
