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
    python benchmarks/tpu_vmem.py --plans             # what the calibration bought

`--plans` compiles, for a few shapes where the calibrated planner picks other
tiles than the planner before it (whose plans are kept below as data), the
kernel with each plan and prints the compiler's `optimal_seconds` for it: an
estimate of XLA:TPU's cost model, which for a Mosaic kernel is built from the
kernel's declared `pl.CostEstimate` (flops, and bytes read: the table once per
token chunk), not a timing.

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
# (chip, kernel, T, V, D, dtype) -> (block_t, block_v, token_chunk) that
# `plan_tiles` picked before its VMEM model was calibrated against the compiler.
PLANS_BEFORE = {
    ("v5e", "backward", 16_384, 219_235, 256, "float32"): (256, 2048, 9472),
    ("v6e", "backward", 32_768, 219_235, 128, "bfloat16"): (256, 2048, 17408),
    ("v5p", "backward", 8192, 219_235, 256, "float32"): (256, 1024, 4608),
    ("v4", "backward", 8192, 219_235, 128, "bfloat16"): (256, 256, 2048),
    ("v5e", "forward", 65_536, 219_235, 128, "bfloat16"): (128, 4096, 33792),
}
ESTIMATED_AS = {"forward": "forward", "backward": "backward", "one_pass": "backward",
                "ranks": "ranks"}


def case_key(chip: str, kernel: str, case: dict) -> str:
  return f"{chip}/{kernel}/" + ",".join(f"{k}={v}" for k, v in sorted(case.items()))


def estimate(r: dict) -> int:
  """`tiling.vmem_estimate` of a measured case's plan (the planner's current model)."""
  return tiling.vmem_estimate(
      ESTIMATED_AS[r["kernel"]], token_chunk=r["token_chunk"], block_t=r["block_t"],
      block_v=r["block_v"], dim=r["dim"], itemsize=jnp.dtype(r["dtype"]).itemsize,
      num_targets=r["num_targets"], extra_logit_tiles=2 if r["variant"] else 0)


def measure(chip: str, kernel: str, case: dict, device) -> dict:
  c = {**BASE, **case}
  plan = TilePlan(block_v=c["block_v"], block_t=c["block_t"], token_chunk=c["token_chunk"],
                  vmem_limit_bytes=128 * MIB)
  options = SOFT_CAP if c["variant"] else variants.PLAIN
  start = time.perf_counter()
  actual = compiler.measured_vmem_bytes(
      kernel, plan=plan, num_tokens=TOKENS, vocab=VOCAB, dim=c["dim"], dtype=jnp.dtype(c["dtype"]),
      device=device, bias=c["bias"], num_targets=c["num_targets"], options=options)
  return {"chip": chip, "kernel": kernel, **c, "actual_bytes": actual,
          "seconds": round(time.perf_counter() - start, 1)}


def compare_plans(results: dict) -> None:
  """The compiler's optimal_seconds of each PLANS_BEFORE kernel, before and after."""
  print(f"{'chip':>4} {'kernel':>8} {'T':>6} {'D':>4} {'dtype':>8} {'plan before':>20} "
        f"{'plan after':>20} {'chunks':>7} {'est. ms before':>14} {'after':>7}", flush=True)
  for (chip, kernel, tokens, vocab, dim, dtype), before in PLANS_BEFORE.items():
    key = f"plans/{chip}/{kernel}/T{tokens}/V{vocab}/D{dim}/{dtype}"
    if key not in results:
      device = compiler.chip_device(chip)
      after = tiling.plan_tiles(tokens, vocab, dim, dtype, chip=chip, kernel=kernel)
      row = {"before": before, "after": (after.block_t, after.block_v, after.token_chunk)}
      for name, (block_t, block_v, chunk) in (("before", before), ("after", row["after"])):
        plan = TilePlan(block_t=block_t, block_v=block_v, token_chunk=chunk,
                        vmem_limit_bytes=after.vmem_limit_bytes)
        compiled = compiler.compile_kernel(kernel, plan=plan, num_tokens=tokens, vocab=vocab,
                                           dim=dim, dtype=jnp.dtype(dtype), device=device)
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, (list, tuple)) else cost
        row[f"optimal_seconds_{name}"] = float(cost["optimal_seconds"])
        row[f"chunks_{name}"] = -(-tokens // chunk)
      results[key] = row
    r = results[key]
    # A negative optimal_seconds is the cost model's "no estimate".
    ms = lambda s: "-" if s < 0 else f"{s * 1e3:.3f}"  # noqa: E731
    print(f"{chip:>4} {kernel:>8} {tokens:>6} {dim:>4} {dtype:>8} {str(tuple(r['before'])):>20} "
          f"{str(tuple(r['after'])):>20} {r['chunks_before']:>3}->{r['chunks_after']:<3} "
          f"{ms(r['optimal_seconds_before']):>14} {ms(r['optimal_seconds_after']):>7}",
          flush=True)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--chips", nargs="+", default=["v5e", "v6e"])
  parser.add_argument("--kernels", nargs="+", default=list(compiler.KERNEL_CALLS))
  parser.add_argument("--quick", action="store_true", help="the base plan only")
  parser.add_argument("--fresh", action="store_true", help="measure every case again")
  parser.add_argument("--plans", action="store_true",
                      help="only compare the plans before and after the calibration")
  parser.add_argument("--out", default="docs/results/tpu_vmem.json")
  args = parser.parse_args(argv)
  reason = compiler.libtpu_missing_reason()
  if reason:
    raise SystemExit(reason)
  out = pathlib.Path(args.out)
  saved = {} if args.fresh or not out.exists() else json.loads(out.read_text())
  results, plans = saved.get("cases", {}), saved.get("plans", {})

  def save():
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"tokens": TOKENS, "vocab": VOCAB, "base": BASE,
                               "cases": results, "plans": plans}, indent=1) + "\n")

  cases = CASES[:1] if args.quick else CASES
  if args.plans:
    compare_plans(plans)
    save()
    print(f"wrote {out}")
    return
  print(f"{'chip':>4} {'kernel':>8} {'case':<40} {'actual MiB':>10} {'estimate MiB':>12} "
        f"{'est/act':>7} {'before MiB':>10}", flush=True)
  for chip in args.chips:
    device = compiler.chip_device(chip)
    for kernel in args.kernels:
      for case in (cases if chip == args.chips[0] else cases[:CORE_CASES]):
        if kernel == "one_pass" and case.get("token_chunk", TOKENS) < 1024:
          continue  # one kernel call per chunk, as "backward" (measured there)
        key = case_key(chip, kernel, case)
        if key not in results:
          results[key] = measure(chip, kernel, case, device)
          save()
        r = results[key]
        label = ",".join(f"{k}={v}" for k, v in sorted(case.items())) or "base"
        # estimate_before_bytes: the planner's model before its calibration.
        before = r.get("estimate_before_bytes")
        print(f"{chip:>4} {kernel:>8} {label:<40} {r['actual_bytes'] / MIB:>10.2f} "
              f"{estimate(r) / MIB:>12.2f} {estimate(r) / r['actual_bytes']:>7.2f} "
              f"{'-' if before is None else f'{before / MIB:.2f}':>10}", flush=True)
  print(f"wrote {out}")


if __name__ == "__main__":
  main()
