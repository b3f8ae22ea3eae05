"""Floors of the loss on one Hopper GPU, per backend and shape, and measured / floor.

For fwd + bwd of the loss (T tokens, V items, D hidden, L targets) each
backend does a known amount of work (`WORK`): GEMMs of 2 T V D flops, special
function (MUFU) instructions per logit, and HBM bytes. Its floor on a part is
the largest of the three times, at the part's rates (`RATES`: dense tensor
throughput without sparsity, MUFU 16 per clock per SM, HBM bandwidth), i.e.
perfect overlap: no kernel can beat it, a fused one should come within a
small factor. The Mosaic kernels have a fourth, shared memory: each
`wgmma m64nNk16` reads its A (64 x 16) and B (N x 16) bfloat16 operands from
shared memory at 128 bytes per clock per SM, so narrow tiles (N = 32: 3 KB
per 32K multiply-adds) are bound by it, not by the tensor cores; its figure
is for the planner's tiles (and, as "pallas_gpu_bv64", the 64-column tile
where the planner takes 32: `benchmarks/gpu_run.py`'s WIDE_TILE). Float32 on the tensor cores costs six bfloat16 products
(`cutbce/kernels/gpu/pieces.py`); XLA and the dense loss use TF32 (three
TF32 products' worth of time would be the same).

`--measured` JSONs (`benchmarks/gpu_run.py device`'s loss.json) add the
measured time and measured / floor. `--static` (needs the CUDA plugin:
`make test-gpu`'s .venv-gpu) compiles the Mosaic GPU kernels for sm_90a at
two shapes per dtype and adds what their PTX and ptxas reports say
(registers, spills, wgmma and MUFU instructions per tile; for the
warp-specialized kernels ("_ws") ptxas' registers are the launch figure and
`consumer_registers` what setmaxnreg gives each consumer warpgroup). Floors are
arithmetic, static rows "compiled for", measured rows "ran on".

    python benchmarks/gpu_roofline.py --out docs/results/gpu_roofline.json
    .venv-gpu/bin/python benchmarks/gpu_roofline.py --static --out docs/results/gpu_roofline.json
    .venv-gpu-next/bin/python benchmarks/gpu_roofline.py --static \
        --out docs/results/gpu_roofline_jax012.json   # the same kernels by jax 0.12
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# Per part: dense tensor flop/s by operand type, MUFU instructions/s, HBM bytes/s.
RATES = {
    "h200": {"bfloat16": 989e12, "tf32": 494e12, "mufu": 132 * 16 * 1.98e9, "hbm": 4.8e12,
             "smem": 132 * 128 * 1.98e9},
    "h100": {"bfloat16": 989e12, "tf32": 494e12, "mufu": 132 * 16 * 1.98e9, "hbm": 3.35e12,
             "smem": 132 * 128 * 1.98e9},
}
# Per backend, BCE fwd + bwd in one pass: (GEMMs, MUFU per logit, HBM bytes per
# logit, table-sized f32 passes). Read from the code (docs/kernels.md, "Mosaic
# GPU kernels" and "Ran on one H200"):
# - pallas_gpu (Mosaic): sweep (logits, dh) + table kernel (logits, dE): 4 GEMMs,
#   ex2 + rcp in each kernel; no per-logit HBM; the table read by both kernels,
#   dE written in f32 and added to the sparse part (read, read, write).
# - pallas_triton: the same four GEMMs, exp / log / reciprocal per kernel (4 + 1).
# - xla: a scan over tiles, 3 GEMMs; its logits, sums, sigmoid, scatter and
#   split-K partials each round-trip HBM: ~26 bytes per logit (XLA dumps).
# - dense: 3 GEMMs on [T, V] f32 logits and their gradient: ~16 bytes per logit.
WORK = {
    "pallas_gpu": {"gemms": 4, "mufu": 4, "bytes_per_logit": 0, "table_passes": 5},
    "pallas_triton": {"gemms": 4, "mufu": 5, "bytes_per_logit": 0, "table_passes": 5},
    "xla": {"gemms": 3, "mufu": 3, "bytes_per_logit": 26, "table_passes": 5},
    "dense": {"gemms": 3, "mufu": 3, "bytes_per_logit": 16, "table_passes": 3},
}
WORK["pallas_gpu_bv64"] = WORK["pallas_gpu"]  # the same kernels at 64-column sweep tiles
SHAPES = [(2048, 131_072, 64), (2048, 1_048_576, 64), (2048, 1_048_576, 128)]
# Old runs whose "pallas_gpu" was the Triton set (before the Mosaic kernels).
TRITON_ERA = {"docs/results/gpu_h200/loss.json"}


def sweep_block_v(backend: str, part: str, tokens: int, vocab: int, dim: int,
                  dtype: str) -> int:
  """The Mosaic sweep's tile: the planner's, or 64 for "pallas_gpu_bv64"."""
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from cutbce.kernels.gpu import mosaic, mosaic_plan, targets  # pylint: disable=import-outside-toplevel
  if backend == "pallas_gpu_bv64":
    return 64
  return mosaic_plan.geometry(tokens, vocab, dim, mosaic.PIECES[jnp.dtype(dtype)],
                              spec=targets.spec(part)).block_v


def mosaic_smem_bytes(tokens: int, vocab: int, dim: int, dtype: str, block_v: int) -> float:
  """Shared memory the Mosaic kernels' wgmma read: each m64nNk16 its A (64 x 16) and B
  (N x 16) bfloat16 operands, every product of float32's pieces."""
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from cutbce.kernels.gpu import mosaic, mosaic_plan, pieces  # pylint: disable=import-outside-toplevel
  rows, table_rows = mosaic_plan.BLOCK_T, mosaic_plan.TABLE_BLOCK_V  # wgmma M of each kernel
  products = len(pieces.PRODUCTS[mosaic.PIECES[jnp.dtype(dtype)]])
  dim_padded = mosaic_plan.round_up(dim, mosaic_plan.DIM_ALIGN)
  k = 16  # wgmma K of bfloat16
  per_instruction = lambda n: 2 * k * (rows + n)  # noqa: E731  (bytes of A and B)
  tiles = (tokens / rows) * (vocab / block_v)  # the sweep's (token, table) tile pairs
  sweep = tiles * (dim_padded / k * per_instruction(block_v)  # logits: N = block_v, K = Dp
                   + block_v / k * per_instruction(dim_padded))  # dh: N = Dp, K = block_v
  pairs = (tokens / rows) * (vocab / table_rows)  # the dE kernel's tiles
  table = pairs * (dim_padded / k * per_instruction(table_rows)  # logits: N = 64, K = Dp
                   + rows / k * per_instruction(dim_padded))  # dE: N = Dp, K = 64 tokens
  return products * (sweep + table)


def floor(backend: str, part: str, tokens: int, vocab: int, dim: int, dtype: str) -> dict:
  """Milliseconds of each bound and the floor (their maximum) for fwd + bwd of BCE."""
  work, rates = WORK[backend], RATES[part]
  logits = tokens * vocab
  flops = work["gemms"] * 2 * logits * dim
  if dtype == "float32":
    # Fused kernels: six bf16 products; XLA and dense: TF32 on the tensor cores.
    flops_rate = rates["bfloat16"] / 6 if backend.startswith("pallas") else rates["tf32"]
  else:
    flops_rate = rates["bfloat16"]
  itemsize = 4 if dtype == "float32" else 2
  hbm_bytes = (logits * work["bytes_per_logit"]
               + work["table_passes"] * vocab * dim * max(itemsize, 4))
  bounds = {"gemm_ms": 1e3 * flops / flops_rate,
            "mufu_ms": 1e3 * work["mufu"] * logits / rates["mufu"],
            "hbm_ms": 1e3 * hbm_bytes / rates["hbm"]}
  if backend.startswith("pallas_gpu"):
    block_v = sweep_block_v(backend, part, tokens, vocab, dim, dtype)
    bounds["smem_ms"] = 1e3 * mosaic_smem_bytes(tokens, vocab, dim, dtype,
                                                block_v) / rates["smem"]
  return {**{k: round(v, 3) for k, v in bounds.items()},
          "floor_ms": round(max(bounds.values()), 3)}


def measured_rows(paths) -> dict:
  """{(backend, vocab, dim, dtype): seconds} from gpu_run loss.json files (BCE rows)."""
  found = {}
  for path in paths:
    data = json.loads(pathlib.Path(path).read_text())
    rename = {"pallas_gpu": "pallas_triton"} if str(path) in TRITON_ERA else {}
    for row in data["rows"]:
      if row.get("kind") == "bce" and row.get("seconds"):
        backend = rename.get(row["backend"], row["backend"])
        found[backend, row["vocab"], row.get("dim", 64), row["dtype"]] = {
            "seconds": row["seconds"], "source": str(path),
            "device": data.get("environment", {}).get("devices", ["?"])[0]}
  return found


def static_rows() -> list:
  """The Mosaic kernels compiled for H200 at two shapes per dtype: their PTX and ptxas facts."""
  os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from cutbce.kernels.gpu import compiled as gpu_compiled  # pylint: disable=import-outside-toplevel
  from cutbce.kernels.gpu import mosaic_plan, ptx  # pylint: disable=import-outside-toplevel
  rows = []
  for dtype in ("bfloat16", "float32"):
    for tokens, vocab, dim in ((2048, 1_048_576, 64), (2048, 1_048_576, 128)):
      _, reports = ptx.compile_with_reports(lambda: gpu_compiled.compile_loss(  # noqa: B023
          "h200", "pallas_gpu", tokens=tokens, vocab=vocab, dim=dim, dtype=jnp.dtype(dtype),
          num_targets=4, bias=True))
      for name, report in sorted(reports.items()):
        # A warp-specialized kernel ("_ws") launches with ptxas' figure (65,536 / 384) and
        # gives its consumer warpgroups more with setmaxnreg (mosaic_plan).
        specialized = name.endswith("_ws")
        rows.append({"compiled_for": "h200 (sm_90a)", "jax": jax.__version__, "dtype": dtype, "tokens": tokens,
                     "vocab": vocab, "dim": dim, "kernel": name, "registers": report.registers,
                     "warp_specialized": specialized,
                     "consumer_registers": (mosaic_plan.CONSUMER_REGISTERS if specialized
                                            else report.registers),
                     "spill_bytes": report.spill_bytes, "wgmma_per_tile": report.wgmma,
                     "mufu_per_tile": report.mufu})
        print(f"compiled for h200  {dtype:>8} D={dim:<4} {name:<42} regs {report.registers:>3} "
              f"spill {report.spill_bytes:>4} B  wgmma {report.wgmma_count():>3}  "
              f"mufu {report.mufu}", flush=True)
  return rows


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--part", choices=sorted(RATES), default="h200")
  parser.add_argument("--measured", nargs="*", default=["docs/results/gpu_h200/loss.json"])
  parser.add_argument("--static", action="store_true")
  parser.add_argument("--out", default=None)
  args = parser.parse_args()
  measured = measured_rows(p for p in args.measured if pathlib.Path(p).exists())
  rows = []
  print(f"{'backend':>15} {'dtype':>8} {'V':>9} {'D':>4} {'gemm':>7} {'mufu':>7} {'hbm':>7} "
        f"{'smem':>7} {'floor ms':>9} {'measured':>9} {'x floor':>8}")
  for tokens, vocab, dim in SHAPES:
    for dtype in ("bfloat16", "float32"):
      for backend in WORK:
        if backend == "pallas_gpu_bv64" and sweep_block_v(
            "pallas_gpu", args.part, tokens, vocab, dim, dtype) >= 64:
          continue  # the planner's own tile
        row = {"backend": backend, "part": args.part, "tokens": tokens, "vocab": vocab,
               "dim": dim, "dtype": dtype, **floor(backend, args.part, tokens, vocab, dim, dtype)}
        hit = measured.get((backend, vocab, dim, dtype))
        if hit:
          row.update(measured_ms=round(1e3 * hit["seconds"], 2), ran_on=hit["device"],
                     source=hit["source"],
                     measured_over_floor=round(1e3 * hit["seconds"] / row["floor_ms"], 1))
        rows.append(row)
        shown = (f"{row['measured_ms']:9.2f} {row['measured_over_floor']:8.1f}" if hit
                 else f"{'-':>9} {'-':>8}")
        smem = f"{row['smem_ms']:7.2f}" if "smem_ms" in row else f"{'-':>7}"
        print(f"{backend:>15} {dtype:>8} {vocab:>9} {dim:>4} {row['gemm_ms']:7.2f} "
              f"{row['mufu_ms']:7.2f} {row['hbm_ms']:7.2f} {smem} {row['floor_ms']:9.2f} {shown}")
  result = {"what": "BCE fwd + bwd floors per backend (arithmetic), measured where a device ran",
            "command": " ".join(sys.argv), "rates": RATES[args.part], "work": WORK, "rows": rows}
  if args.static:
    result["static"] = static_rows()
  if args.out:
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
  main()
