"""Loss micro-benchmark: dense BCE vs the XLA path of cut_bce vs the matmul floor.

For each catalog size V: fwd+bwd (`jax.value_and_grad` w.r.t. hidden and
table) at T = B x N tokens, reporting the compiled temp bytes
(`memory_analysis().temp_size_in_bytes`, exact and repeatable) and the time
(min over repeats after one warm-up). The matmul floor does the same four
GEMMs of size T x V x D tile by tile with no elementwise work: what cut_bce
would cost if softplus and sigmoid were free. Dense runs only where its temp
memory fits `--dense-limit-gib`; above that it is compiled, not run.

`cut` is `cut_bce`'s default for reduction "mean": one pass (loss and
gradients in one sweep, 3 GEMMs per tile); `two-pass` is `one_pass=False`
(forward sweep, then a backward sweep: 4 GEMMs per tile).

Also, side by side in the same run: `cut_bce` with every loss variant on
(`VARIANTS`: pos_weight, label_smoothing, logit_soft_cap, focal) against the
plain one (`--variant-detail` adds each option set alone), and the compiled
temp memory of cut_bce in the other dtype (bf16 when timing f32 and vice
versa). `--topk` adds the top-k rows of
`benchmarks/topk_bench.py` (cut `top_k` against `lax.top_k` of dense logits).

    python benchmarks/loss_bench.py                     # the issue's sweep
    python benchmarks/loss_bench.py --vocab 16384 --repeats 2 --no-plot   # quick
    python benchmarks/loss_bench.py --softmax --out docs/results   # softmax CE vs BCE

Prints a table and writes JSON (and a PNG with --plot) under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np

import cutbce
from cutbce.kernels import xla as xla_kernels

DEFAULT_VOCABS = (16_384, 32_768, 65_536, 131_072, 262_144, 524_288, 1_048_576, 10_000_000)
# Every loss variant at once (soft cap and focal run in the tiles).
VARIANTS = dict(pos_weight=2.0, label_smoothing=0.1, logit_soft_cap=30.0, focal_gamma=2.0,
                focal_alpha=0.25)
# Each option set alone (--variant-detail).
VARIANT_SETS = {
    "affine": dict(pos_weight=2.0, label_smoothing=0.1),
    "soft_cap": dict(logit_soft_cap=30.0),
    "focal": dict(focal_gamma=2.0, focal_alpha=0.25),
}


def make_inputs(batch, seq, dim, vocab, num_targets, dtype, seed=0):
  keys = jax.random.split(jax.random.PRNGKey(seed), 3)
  hidden = (jax.random.normal(keys[0], (batch, seq, dim)) * 0.5).astype(dtype)
  table = (jax.random.normal(keys[1], (vocab, dim)) * 0.05).astype(dtype)
  targets = jax.random.randint(keys[2], (batch, seq, num_targets), -1, vocab)
  return hidden, table, targets


def loss_fn(backend, plan=None, kind="bce", **options):
  """`cut_bce` (or, `kind="softmax_ce"`, `cut_softmax_ce`) on `backend` as f(hidden, table, targets)."""
  op = {"bce": cutbce.cut_bce, "softmax_ce": cutbce.cut_softmax_ce}[kind]

  def fn(hidden, table, targets):
    return op(hidden, table, targets, backend=backend, plan=plan, **options)
  return fn


def matmul_floor_fn(block_v):
  """The four GEMMs of fwd+bwd, tile by tile, no elementwise work."""

  def fn(hidden, table, targets):
    del targets
    flat = hidden.reshape(-1, hidden.shape[-1])
    vocab = table.shape[0]
    num_tiles = vocab // block_v
    table_tiles = table[: num_tiles * block_v].reshape(num_tiles, block_v, -1)

    def forward(total, tile):
      return total + jnp.sum(flat @ tile.T), None

    def backward(hidden_grad, tile):
      logits = flat @ tile.T  # [T, block_v]
      return hidden_grad + logits @ tile, logits.T @ flat

    total, _ = jax.lax.scan(forward, jnp.float32(0), table_tiles)
    hidden_grad, table_grad = jax.lax.scan(backward, jnp.zeros_like(flat), table_tiles)
    return total, hidden_grad, table_grad

  return fn


def compile_with_temp(fn, args):
  compiled = jax.jit(fn).lower(*args).compile()
  return compiled, compiled.memory_analysis().temp_size_in_bytes


def interleaved_min_times(compiled_fns, args, repeats):
  """Min wall time of each compiled fn; runs are interleaved so that load on a
  shared machine hits every contender alike. One warm-up run each first."""
  for fn in compiled_fns.values():
    jax.block_until_ready(fn(*args))
  best = {name: float("inf") for name in compiled_fns}
  for _ in range(repeats):
    for name, fn in compiled_fns.items():
      start = time.perf_counter()
      jax.block_until_ready(fn(*args))
      best[name] = min(best[name], time.perf_counter() - start)
  return best


def peak_flops_estimate():
  """Cores x 2 FMA units x (SIMD lanes) x 2 FLOPs x clock, from /proc/cpuinfo."""
  try:
    info = open("/proc/cpuinfo").read()
  except OSError:
    return None
  lanes = 16 if "avx512f" in info else 8 if "avx2" in info else 4
  mhz = [float(line.split(":")[1]) for line in info.splitlines() if line.startswith("cpu MHz")]
  if not mhz:
    return None
  return os.cpu_count() * 2 * lanes * 2 * max(mhz) * 1e6


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--vocab", type=int, nargs="+", default=list(DEFAULT_VOCABS))
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--seq", type=int, default=256)
  parser.add_argument("--dim", type=int, default=64)
  parser.add_argument("--targets", type=int, default=4)
  parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
  parser.add_argument("--block-v", type=int, default=None, help="override the XLA path's block_v")
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--dense-limit-gib", type=float, default=6.0)
  parser.add_argument("--cut-only-above", type=int, default=1_048_576,
                      help="above this V only cut_bce is measured")
  parser.add_argument("--out", default="benchmarks/results")
  parser.add_argument("--variant-detail", action="store_true",
                      help="also time each variant option set alone")
  parser.add_argument("--topk", action="store_true",
                      help="also race top_k against dense lax.top_k (benchmarks/topk_bench.py)")
  parser.add_argument("--topk-vocab", type=int, default=1_048_576)
  parser.add_argument("--topk-k", type=int, default=100)
  parser.add_argument("--plot", action=argparse.BooleanOptionalAction, default=True)
  parser.add_argument("--softmax", action="store_true",
                      help="only race softmax CE: dense, cut, and cut BCE beside them")
  parser.add_argument("--softmax-vocab", type=int, nargs="+", default=[131_072, 1_048_576])
  args = parser.parse_args()
  if args.softmax:
    softmax_compare(args)
    return

  dtype = jnp.dtype(args.dtype)
  tokens = args.batch * args.seq
  peak = peak_flops_estimate()
  rows = []
  print(f"loss_bench: T={tokens} D={args.dim} L={args.targets} {args.dtype} fwd+bwd, "
        f"jax {jax.__version__} on {jax.devices()[0].platform}, {os.cpu_count()} cores", flush=True)
  other = jnp.dtype("float32" if dtype == jnp.bfloat16 else "bfloat16")
  header = (f"{'V':>10} {'block_v':>7} {'dense s':>8} {'dense MiB':>10} {'cut s':>8} "
            f"{'cut MiB':>8} {'floor s':>8} {'cut/dense':>9} {'cut/floor':>9} {'%peak':>6} "
            f"{'var s':>7} {'var/cut':>7} {'var MiB':>7} {other.name[:4] + ' MiB':>9} "
            f"{'2pass s':>8} {'1p/2p':>6} {'2p MiB':>7}")
  print(header)
  for vocab in args.vocab:
    hidden, table, targets = make_inputs(args.batch, args.seq, args.dim, vocab, args.targets, dtype)
    operands = (hidden, table, targets)
    plan = (cutbce.TilePlan(block_v=args.block_v) if args.block_v
            else xla_kernels.default_plan("forward", tokens, vocab, args.dim, dtype))
    grad = lambda f: jax.value_and_grad(f, argnums=(0, 1))
    contenders, row = {}, dict(vocab=vocab, block_v=plan.block_v)
    contenders["cut"], row["cut_temp_bytes"] = compile_with_temp(grad(loss_fn("xla", plan)), operands)
    contenders["variants"], row["variants_temp_bytes"] = compile_with_temp(
        grad(loss_fn("xla", plan, **VARIANTS)), operands)
    contenders["two_pass"], row["two_pass_temp_bytes"] = compile_with_temp(
        grad(loss_fn("xla", plan, one_pass=False)), operands)
    if args.variant_detail:
      for name, options in VARIANT_SETS.items():
        contenders[f"variant_{name}"], _ = compile_with_temp(
            grad(loss_fn("xla", plan, **options)), operands)
    other_operands = (hidden.astype(other), table.astype(other), targets)
    _, row[f"cut_temp_bytes_{other.name}"] = compile_with_temp(
        grad(loss_fn("xla", plan)), other_operands)
    if vocab <= args.cut_only_above:
      dense, row["dense_temp_bytes"] = compile_with_temp(grad(loss_fn("dense")), operands)
      if row["dense_temp_bytes"] <= args.dense_limit_gib * 2**30:
        contenders["dense"] = dense
      contenders["floor"], _ = compile_with_temp(matmul_floor_fn(plan.block_v), operands)
    times = interleaved_min_times(contenders, operands, args.repeats)
    for name, seconds in times.items():
      row[f"{name}_seconds"] = seconds
    cut_time, cut_temp = row["cut_seconds"], row["cut_temp_bytes"]
    flops = 8 * tokens * vocab * args.dim
    row["cut_fraction_of_peak"] = flops / cut_time / peak if peak else None
    rows.append(row)
    fmt = lambda v, f: "-" if v is None else format(v, f)
    ratio = lambda a, b: None if a is None or b is None else a / b
    print(f"{vocab:>10} {plan.block_v:>7} {fmt(row.get('dense_seconds'), '8.3f')} "
          f"{fmt(ratio(row.get('dense_temp_bytes'), 2**20), '10.1f')} {cut_time:8.3f} "
          f"{cut_temp / 2**20:8.1f} {fmt(row.get('floor_seconds'), '8.3f')} "
          f"{fmt(ratio(cut_time, row.get('dense_seconds')), '9.3f')} "
          f"{fmt(ratio(cut_time, row.get('floor_seconds')), '9.3f')} "
          f"{fmt(None if not peak else 100 * row['cut_fraction_of_peak'], '6.1f')} "
          f"{row['variants_seconds']:7.3f} {row['variants_seconds'] / cut_time:7.3f} "
          f"{row['variants_temp_bytes'] / 2**20:7.1f} "
          f"{row[f'cut_temp_bytes_{other.name}'] / 2**20:9.1f} "
          f"{row['two_pass_seconds']:8.3f} {cut_time / row['two_pass_seconds']:6.3f} "
          f"{row['two_pass_temp_bytes'] / 2**20:7.1f}", flush=True)
    if args.variant_detail:
      print("    variants alone, time / plain cut: " + ", ".join(
          f"{name} {row[f'variant_{name}_seconds'] / cut_time:.3f}" for name in VARIANT_SETS))
  topk_rows = None
  if args.topk:
    import topk_bench  # pylint: disable=g-import-not-at-top  (benchmarks/ is on sys.path)
    topk_rows = topk_bench.compare(tokens=tokens, dim=args.dim, vocab=args.topk_vocab,
                                   k=args.topk_k, dtype=args.dtype, repeats=args.repeats)

  os.makedirs(args.out, exist_ok=True)
  result = dict(
      config=dict(vars(args), tokens=tokens), jax=jax.__version__,
      machine=dict(platform=platform.platform(), cores=os.cpu_count(), peak_flops=peak), rows=rows,
      topk_rows=topk_rows,
  )
  path = os.path.join(args.out, f"loss_bench_{args.dtype}.json")
  with open(path, "w") as f:
    json.dump(result, f, indent=2)
  print(f"wrote {path}")
  if args.plot:
    plot(rows, os.path.join(args.out, f"loss_bench_{args.dtype}.png"))


def softmax_compare(args):
  """fwd+bwd of dense softmax CE, cut softmax CE and cut BCE (one pass), side by side.

  The cut CE has no one-pass form (p_tv needs lse_t, known after the sweep):
  a forward sweep (1 GEMM per tile) and a backward sweep (3 GEMMs), against
  one-pass BCE's 3 GEMMs in one sweep.
  """
  dtype = jnp.dtype(args.dtype)
  tokens = args.batch * args.seq
  print(f"softmax CE: T={tokens} D={args.dim} L={args.targets} {args.dtype} fwd+bwd, "
        f"jax {jax.__version__}, {os.cpu_count()} cores", flush=True)
  print(f"{'V':>10} {'dense CE s':>10} {'dense MiB':>10} {'cut CE s':>9} {'cut CE MiB':>10} "
        f"{'cut BCE s':>9} {'BCE MiB':>8} {'CE/dense':>8} {'CE/BCE':>7}")
  grad = lambda f: jax.value_and_grad(f, argnums=(0, 1))  # noqa: E731
  rows = []
  for vocab in args.softmax_vocab:
    operands = make_inputs(args.batch, args.seq, args.dim, vocab, args.targets, dtype)
    plan = xla_kernels.default_plan("forward", tokens, vocab, args.dim, dtype)
    ops = {
        "cut_ce": lambda h, e, t: cutbce.cut_softmax_ce(h, e, t, backend="xla", plan=plan),
        "cut_bce": lambda h, e, t: cutbce.cut_bce(h, e, t, backend="xla", plan=plan),
        "dense_ce": lambda h, e, t: cutbce.dense_softmax_ce(h, e, t),
    }
    contenders, row = {}, dict(vocab=vocab, block_v=plan.block_v)
    for name, op in ops.items():
      compiled, row[f"{name}_temp_bytes"] = compile_with_temp(grad(op), operands)
      if name != "dense_ce" or row[f"{name}_temp_bytes"] <= args.dense_limit_gib * 2**30:
        contenders[name] = compiled
    for name, seconds in interleaved_min_times(contenders, operands, args.repeats).items():
      row[f"{name}_seconds"] = seconds
    rows.append(row)
    fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
    dense_s = row.get("dense_ce_seconds")
    print(f"{vocab:>10} {fmt(dense_s, '10.3f')} {row['dense_ce_temp_bytes'] / 2**20:10.1f} "
          f"{row['cut_ce_seconds']:9.3f} {row['cut_ce_temp_bytes'] / 2**20:10.1f} "
          f"{row['cut_bce_seconds']:9.3f} {row['cut_bce_temp_bytes'] / 2**20:8.1f} "
          f"{fmt(None if dense_s is None else row['cut_ce_seconds'] / dense_s, '8.3f')} "
          f"{row['cut_ce_seconds'] / row['cut_bce_seconds']:7.3f}", flush=True)
  os.makedirs(args.out, exist_ok=True)
  path = os.path.join(args.out, f"softmax_bench_{args.dtype}.json")
  with open(path, "w") as f:
    json.dump(dict(config=dict(vars(args), tokens=tokens), jax=jax.__version__,
                   machine=dict(platform=platform.platform(), cores=os.cpu_count()),
                   rows=rows), f, indent=2)
  print(f"wrote {path}")


def plot(rows, path):
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    print("matplotlib missing (pip install '.[bench]'): no plot")
    return
  fig, (ax_mem, ax_time) = plt.subplots(1, 2, figsize=(11, 4))
  for key, label in (("dense", "dense"), ("cut", "cut_bce (xla)")):
    pts = [(r["vocab"], r.get(f"{key}_temp_bytes")) for r in rows if r.get(f"{key}_temp_bytes")]
    if pts:
      ax_mem.plot(*zip(*pts), "o-", label=label)
  for key, label in (("dense", "dense"), ("cut", "cut_bce (xla)"), ("floor", "matmul floor")):
    pts = [(r["vocab"], r.get(f"{key}_seconds")) for r in rows if r.get(f"{key}_seconds")]
    if pts:
      ax_time.plot(*zip(*pts), "o-", label=label)
  for ax, title in ((ax_mem, "compiled temp bytes"), (ax_time, "fwd+bwd seconds")):
    ax.set_xscale("log"); ax.set_yscale("log"); ax.set_xlabel("V"); ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3); ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  print(f"wrote {path}")


if __name__ == "__main__":
  main()
