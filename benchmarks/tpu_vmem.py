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
    python benchmarks/tpu_vmem.py --grid              # the planner's own plans, every chip
    python benchmarks/tpu_vmem.py --plans40           # plans before and after issue 40
    python benchmarks/tpu_vmem.py --record-before     # the planner of BEFORE_ISSUE_40's plans

`--grid` (issue 40) takes, for every chip the planner knows and a grid of
shapes (D 64-512, T 512-65,536, V 10^4-10^7, bf16 and f32), the plan the
planner picks for each kernel, and measures Mosaic's need for it with XLA's
placement of whole arrays in VMEM off (`compiler.WINDOWS_ONLY_FLAGS`: every
operand through its window, the kernel's own worst case): the numbers
`tests/cutbce/kernels/test_vmem_band.py` holds the estimate to.
Measurements are keyed by plan, so a planner change measures only new plans.

`--record-before` keeps, for the same grid, the plans of the planner as it
was before issue 40 (its `tiling.py` read from git at `BEFORE_ISSUE_40`):
the test holds today's planner to them (never more token chunks; at as many,
never a smaller logit tile).

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
import os
import pathlib
import subprocess
import sys
import time
import types

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
# (T, V, D, dtype) of `--grid`: each D, T and dtype at least once, V from
# 10^4 to 10^7 (it sets only the grid's length and the ragged last tile).
# (The backward kernels' f32 [V, D] table gradient, in and out, must fit
# v5e's 16 GB of HBM: 10^7 items are compiled in bf16 at D = 64.)
GRID_SHAPES = [
    (4096, 876_939, 128, "bfloat16"),  # the paper's per-chip shape
    (512, 10_007, 512, "float32"),
    (65_536, 1_000_003, 64, "bfloat16"),
    (16_384, 10_000_019, 64, "bfloat16"),
    (16_384, 300_007, 256, "float32"),
    (8192, 131_071, 512, "bfloat16"),
    (2048, 300_007, 256, "bfloat16"),
]
GRID_CHIPS = ("v4", "v5e", "v5p", "v6e", "7x")
GRID_KERNELS = ("forward", "one_pass", "ranks", "backward")
GRID_TARGETS = 8  # L of the rank kernel and fixed columns of the backward ones

# The same, for the planner before issue 40's model (its plans at grid shapes
# where the new one picks others), compared by `--plans40`.
PLANS_BEFORE_ISSUE_40 = {
    ("v4", "backward", 4096, 876_939, 128, "bfloat16"): (128, 512, 1408),
    ("v4", "ranks", 16_384, 300_007, 256, "float32"): (512, 128, 2048),
    ("v5e", "backward", 65_536, 1_000_003, 64, "bfloat16"): (256, 2048, 13_312),
    ("v5p", "backward", 16_384, 300_007, 256, "float32"): (256, 1024, 4096),
    ("7x", "backward", 16_384, 10_000_019, 64, "bfloat16"): (256, 2048, 5632),
    ("v5e", "forward", 65_536, 1_000_003, 64, "bfloat16"): (256, 4096, 34_560),
}
# The planner before issue 40 (the commit before its first change to tiling.py).
BEFORE_ISSUE_40 = "88ba2e6"
ROOT = pathlib.Path(__file__).resolve().parents[1]
ESTIMATED_AS = {"forward": "forward", "backward": "backward", "one_pass": "backward",
                "ranks": "ranks"}


def case_key(chip: str, kernel: str, case: dict) -> str:
  return f"{chip}/{kernel}/" + ",".join(f"{k}={v}" for k, v in sorted(case.items()))


def estimate(r: dict) -> int:
  """`tiling.vmem_estimate` of a measured case's plan (the planner's current model)."""
  return tiling.vmem_estimate(
      ESTIMATED_AS[r["kernel"]], token_chunk=r["token_chunk"], block_t=r["block_t"],
      block_v=r["block_v"], dim=r["dim"], itemsize=jnp.dtype(r["dtype"]).itemsize,
      num_targets=r["num_targets"], extra_logit_tiles=2 if r["variant"] else 0,
      num_tokens=TOKENS)


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


def grid_key(chip, kernel, tokens, vocab, dim, dtype, plan) -> str:
  return (f"grid/{chip}/{kernel}/T{tokens}/V{vocab}/D{dim}/{dtype}/bt{plan.block_t}"
          f"/bv{plan.block_v}/c{min(plan.token_chunk, tokens)}")


def grid_points(chips=GRID_CHIPS, kernels=GRID_KERNELS, shapes=GRID_SHAPES):
  """(key, chip, kernel, T, V, D, dtype, plan) of each planner plan in the grid."""
  for chip in chips:
    for kernel in kernels:
      for tokens, vocab, dim, dtype in shapes:
        plan = tiling.plan_tiles(tokens, vocab, dim, dtype, chip=chip,
                                 kernel=ESTIMATED_AS[kernel], num_targets=GRID_TARGETS)
        yield (grid_key(chip, kernel, tokens, vocab, dim, dtype, plan), chip, kernel, tokens,
               vocab, dim, dtype, plan)


def planner_points(chips=GRID_CHIPS, shapes=GRID_SHAPES):
  """(key, chip, kernel, T, V, D, dtype) of each plan the planner makes over the grid."""
  for chip in chips:
    for kernel in tiling.KERNELS:
      for tokens, vocab, dim, dtype in shapes:
        yield (f"{chip}/{kernel}/T{tokens}/V{vocab}/D{dim}/{dtype}", chip, kernel, tokens, vocab,
               dim, dtype)


def plans_of_revision(revision: str) -> dict:
  """{planner_points key: [block_t, block_v, token_chunk]} of the planner at git `revision`."""
  source = subprocess.run(["git", "show", f"{revision}:cutbce/kernels/tiling.py"], cwd=ROOT,
                          capture_output=True, text=True, check=True).stdout
  module = types.ModuleType(f"tiling_at_{revision}")
  sys.modules[module.__name__] = module  # dataclasses look their module up
  try:
    exec(compile(source, f"{revision}:cutbce/kernels/tiling.py", "exec"), module.__dict__)  # noqa: S102
    plans = {}
    for key, chip, kernel, tokens, vocab, dim, dtype in planner_points():
      plan = module.plan_tiles(tokens, vocab, dim, dtype, chip=chip, kernel=kernel,
                               num_targets=GRID_TARGETS)
      plans[key] = [plan.block_t, plan.block_v, min(plan.token_chunk, tokens)]
    return plans
  finally:
    del sys.modules[module.__name__]


def grid_estimate(r: dict) -> int:
  """`tiling.vmem_estimate` of a grid point's plan (the chunk clamped to T, as the kernels do)."""
  return tiling.vmem_estimate(
      ESTIMATED_AS[r["kernel"]], token_chunk=min(r["token_chunk"], r["tokens"]),
      block_t=r["block_t"], block_v=r["block_v"], dim=r["dim"],
      itemsize=jnp.dtype(r["dtype"]).itemsize, num_targets=GRID_TARGETS, num_tokens=r["tokens"],
      cores=r.get("cores", 1), with_loss=r["kernel"] != "backward")


def measure_grid(grid: dict, save, chips=GRID_CHIPS, kernels=GRID_KERNELS) -> None:
  """Measures every planner plan of the grid not measured yet; prints estimate / need."""
  print(f"{'chip':>4} {'kernel':>8} {'T':>6} {'V':>10} {'D':>4} {'dtype':>8} "
        f"{'bt':>4} {'bv':>5} {'chunk':>6} {'need MiB':>9} {'est MiB':>8} {'est/need':>8}",
        flush=True)
  devices = {}
  for key, chip, kernel, tokens, vocab, dim, dtype, plan in grid_points(chips, kernels):
    if key not in grid:
      device = devices.setdefault(chip, compiler.chip_device(chip))
      start = time.perf_counter()
      try:
        need, error = compiler.measured_vmem_bytes(
            kernel, plan=plan, num_tokens=tokens, vocab=vocab, dim=dim,
            dtype=jnp.dtype(dtype), device=device, num_targets=GRID_TARGETS), None
      except RuntimeError as failure:  # e.g. over the chip's whole VMEM: a planner bug
        need, error = None, str(failure).splitlines()[0][:300]
      cores = (tiling.tensor_cores(chip) if ESTIMATED_AS[kernel] == "backward"
               and plan.block_v < vocab else 1)
      grid[key] = {"chip": chip, "kernel": kernel, "tokens": tokens, "vocab": vocab,
                   "dim": dim, "dtype": dtype, "block_t": plan.block_t,
                   "block_v": plan.block_v, "token_chunk": min(plan.token_chunk, tokens),
                   "cores": cores, "vmem_limit_bytes": plan.vmem_limit_bytes,
                   "actual_bytes": need, "error": error,
                   "seconds": round(time.perf_counter() - start, 1)}
      save()
    r = grid[key]
    if r["actual_bytes"] is None:
      print(f"{chip:>4} {kernel:>8} {tokens:>6} {vocab:>10} {dim:>4} {dtype:>8} does not "
            f"compile: {r['error']}", flush=True)
      continue
    est = grid_estimate(r)
    print(f"{chip:>4} {kernel:>8} {tokens:>6} {vocab:>10} {dim:>4} {dtype:>8} "
          f"{r['block_t']:>4} {r['block_v']:>5} {r['token_chunk']:>6} "
          f"{r['actual_bytes'] / MIB:>9.2f} {est / MIB:>8.2f} {est / r['actual_bytes']:>8.2f}",
          flush=True)


def compare_plans(results: dict, before_plans=None, prefix: str = "plans",
                  num_targets: int = tiling.PLANNED_TARGETS) -> None:
  """The compiler's optimal_seconds of each kernel of `before_plans`, before and after."""
  before_plans = PLANS_BEFORE if before_plans is None else before_plans
  print(f"{'chip':>4} {'kernel':>8} {'T':>6} {'D':>4} {'dtype':>8} {'plan before':>20} "
        f"{'plan after':>20} {'chunks':>7} {'est. ms before':>14} {'after':>7}", flush=True)
  for (chip, kernel, tokens, vocab, dim, dtype), before in before_plans.items():
    key = f"{prefix}/{chip}/{kernel}/T{tokens}/V{vocab}/D{dim}/{dtype}"
    if key not in results:
      device = compiler.chip_device(chip)
      after = tiling.plan_tiles(tokens, vocab, dim, dtype, chip=chip, kernel=kernel,
                                num_targets=num_targets)
      row = {"before": before,
             "after": (after.block_t, after.block_v, min(after.token_chunk, tokens))}
      for name, (block_t, block_v, chunk) in (("before", before), ("after", row["after"])):
        plan = TilePlan(block_t=block_t, block_v=block_v, token_chunk=chunk,
                        vmem_limit_bytes=after.vmem_limit_bytes)
        compiled = compiler.compile_kernel(kernel, plan=plan, num_tokens=tokens, vocab=vocab,
                                           dim=dim, dtype=jnp.dtype(dtype), device=device,
                                           num_targets=num_targets)
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
  parser.add_argument("--plans40", action="store_true",
                      help="compare the plans before and after issue 40's VMEM model")
  parser.add_argument("--grid", action="store_true",
                      help="measure the planner's plans over the grid of chips and shapes")
  parser.add_argument("--record-before", action="store_true",
                      help=f"record the plans of the planner at {BEFORE_ISSUE_40} (git) over the grid")
  parser.add_argument("--out", default="docs/results/tpu_vmem.json")
  args = parser.parse_args(argv)
  reason = compiler.libtpu_missing_reason()
  if reason:
    raise SystemExit(reason)
  out = pathlib.Path(args.out)
  saved = {} if args.fresh or not out.exists() else json.loads(out.read_text())
  results, plans = saved.get("cases", {}), saved.get("plans", {})
  grid = saved.get("grid", {})
  before = saved.get("planner_before_issue_40", {})

  def save():
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"tokens": TOKENS, "vocab": VOCAB, "base": BASE,
                               "cases": results, "plans": plans, "grid": grid,
                               "planner_before_issue_40": before}, indent=1) + "\n")

  if args.record_before:
    before = {"revision": BEFORE_ISSUE_40, "plans": plans_of_revision(BEFORE_ISSUE_40)}
    save()
    print(f"{len(before['plans'])} plans of the planner at {BEFORE_ISSUE_40}; wrote {out}")
    return

  if args.grid:
    # Before libtpu loads: every operand through its window (see the flags).
    os.environ["LIBTPU_INIT_ARGS"] = " ".join(
        [os.environ.get("LIBTPU_INIT_ARGS", ""), compiler.WINDOWS_ONLY_FLAGS]).strip()
    chips = GRID_CHIPS if args.chips == parser.get_default("chips") else args.chips
    kernels = (GRID_KERNELS if args.kernels == parser.get_default("kernels")
               else args.kernels)
    measure_grid(grid, save, chips=chips, kernels=kernels)
    print(f"wrote {out}")
    return

  cases = CASES[:1] if args.quick else CASES
  if args.plans40:
    for key in [key for key in plans if key.startswith("plans40/")]:
      del plans[key]  # compiled again: the planner's plans may have changed since
    compare_plans(plans, PLANS_BEFORE_ISSUE_40, prefix="plans40", num_targets=GRID_TARGETS)
    save()
    print(f"wrote {out}")
    return
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
