"""What exactness costs at catalog scale: the trainer's step for each loss (issue 33 part 3).

The step is the trainer's own, built from `configs/yambda50m_v6e8.py` (SASRec,
mesh data=2 x model=4, tokens over both axes, table rows over "model",
D = 128, 2 blocks, L = 8 next items as labels, bfloat16 compute, AdamW,
donated state) with only `config.loss` changed (LOSSES):

  dense_bce  loss.backend="dense": [T, V] logits under XLA's partitioner
  cut_bce    loss.kind="bce", backend "auto" (Pallas on TPU, XLA on CPU)
  cut_ce     loss.kind="softmax_ce", backend "auto"
  ssm_128    sampled softmax, k = 128 uniform negatives per position (HSTU)
  ssm_128_b  the same, one set of 128 shared by the batch
  gbce_256   gBCE, k = 256 uniform negatives per position, t = 0.75 (gSASRec)
  in_batch   every target slot of the batch as negatives, logQ-corrected

Part `cpu`, on 8 simulated CPU devices, one process: for each V (--vocabs)
every loss's step is compiled (per-device `memory_analysis()`), then the
steps that fit in --max-run-gib of host memory run interleaved (ssm_128,
gbce_256, ..., then again), all on one shared train state (every loss has
the same state, shardings and donation), so each sees the same machine load
and no loss holds its own copy of the table and moments. A warm-up round,
then --repeats timed rounds; min and median per loss. The batch is
reduced (--batch x --seq: the default 8 x 32, T = 256 positions, where the
v6e config has 64 x 256 = 16,384) so that dense BCE fits on the host; the
sampled losses' cost is mostly what does not scale with T (the optimizer and
the embedding gradient over the [V, D] table). V = 10^7 does not run on a
host with less than ~40 GiB (the f32 state alone, table + two AdamW moments
replicated over "data", is 28.6 GiB): it is then reported, not timed.

Part `tpu`: the same losses compiled for a v6e-8 slice without a TPU
(`benchmarks/tpu_compile_bench.train_step`, libtpu's deviceless compiler) at
the v6e config's batch (64 x 256): per-chip peak (arguments + outputs -
donated + temporaries) or the compiler's out-of-HBM refusal, and the
compiler's `optimal_seconds` (its cost model's step time: an estimate, not
a timing; None where it gives none).

    XLA_FLAGS=--xla_force_host_platform_device_count=8 \\
      python benchmarks/loss_cost.py [--parts cpu tpu] [--vocabs 876939 10000000]
    python benchmarks/loss_cost.py --quick    # V = 10^4, tiny batch: a smoke check

Prints tables and writes JSON to docs/results/loss_cost.json (TPU cases kept
between runs unless --fresh, as tpu_compile_bench's).
"""

from __future__ import annotations

import os

_DEVICE_FLAG = "--xla_force_host_platform_device_count=8"
if _DEVICE_FLAG not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _DEVICE_FLAG).strip()

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import pathlib  # noqa: E402
import platform  # noqa: E402
import shlex  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # configs/, trainer/

import jax  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks import train_bench  # noqa: E402
from configs import yambda50m_v6e8  # noqa: E402
from trainer import libtpu_env  # noqa: E402
from trainer.config import mesh as config_mesh  # noqa: E402

GIB = 2**30
# name -> the config.loss fields it sets (the rest as configs/yambda50m_v6e8.py).
LOSSES = {
    "dense_bce": {"kind": "bce", "backend": "dense"},
    "cut_bce": {"kind": "bce", "backend": "auto"},
    "cut_ce": {"kind": "softmax_ce", "backend": "auto"},
    "ssm_128": {"kind": "sampled_softmax", "num_negatives": 128, "negatives_per": "position"},
    "ssm_128_b": {"kind": "sampled_softmax", "num_negatives": 128, "negatives_per": "batch"},
    "gbce_256": {"kind": "gbce", "num_negatives": 256, "gbce_t": 0.75,
                 "negatives_per": "position"},
    "in_batch": {"kind": "in_batch", "num_negatives": None, "logq": True},
}
VOCABS = (876_939, 10_000_000)


def loss_config(name: str, *, batch: int, seq: int):
  """configs/yambda50m_v6e8.py with LOSSES[name], the global batch and N."""
  config = yambda50m_v6e8.get_config()
  config.batch_size = batch
  config.seq_len = seq
  config.loss.update(LOSSES[name])
  return config


def state_bytes(step: train_bench.Step) -> int:
  """The train state's bytes summed over the devices (each holds its shard)."""
  total = 0
  for leaf, sharding in zip(jax.tree.leaves(step.abstract), jax.tree.leaves(step.shardings)):
    total += math.prod(sharding.shard_shape(leaf.shape)) * leaf.dtype.itemsize
  return total * len(jax.devices())


def _gib(value) -> str:
  return "-" if value is None else f"{value / GIB:.3f}"


def cpu_vocab(args, vocab: int) -> dict:
  """One V on the CPU mesh: every loss compiled, the ones that fit timed interleaved."""
  steps = {}
  for name in args.losses:
    config = loss_config(name, batch=args.batch, seq=args.seq)
    config_mesh.check_config(config)
    steps[name] = train_bench.Step(config, vocab)
  train_bench.same_state(list(steps.values()))
  section = {"vocab": vocab, "batch": args.batch, "seq_len": args.seq,
             "tokens": args.batch * args.seq, "losses": {}}
  state_all = state_bytes(next(iter(steps.values())))
  section["state_bytes_all_devices"] = state_all
  print(f"\n== CPU, 8 devices, V = {vocab:,}, global batch {args.batch} x N {args.seq} "
        f"(T = {args.batch * args.seq:,}): train state {state_all / GIB:.2f} GiB over the "
        f"devices ==", flush=True)
  if state_all > args.max_run_gib * GIB:
    section["not_run"] = (f"the train state alone is {state_all / GIB:.1f} GiB over the 8 "
                          f"devices > --max-run-gib={args.max_run_gib}: not compiled or timed")
    print(section["not_run"], flush=True)
    return section
  print(f"{'loss':>10} {'temp GiB/dev':>12} {'peak GiB/dev':>12} {'compile s':>9}")
  runnable = {}
  for name, step in steps.items():
    memory = step.compile()
    row = section["losses"][name] = {"config_loss": LOSSES[name], "memory": memory}
    print(f"{name:>10} {_gib(memory['temp_bytes_per_device']):>12} "
          f"{_gib(memory['peak_bytes_per_device']):>12} {memory['compile_s']:>9.1f}", flush=True)
    footprint = memory["peak_bytes_per_device"] * len(jax.devices())
    if footprint > args.max_run_gib * GIB:
      row["run"] = (f"compile only: {footprint / GIB:.1f} GiB over all devices > "
                    f"--max-run-gib={args.max_run_gib}")
      print(f"{'':>10} {row['run']}", flush=True)
    else:
      runnable[name] = step
  if not runnable:
    return section
  times, warmups = train_bench.interleaved_times(runnable, args.repeats)
  for name, seconds in warmups.items():
    section["losses"][name]["warmup_s"] = round(seconds, 3)
  print(f"{'loss':>10} {'min s':>8} {'median s':>9} {'vs cut_bce':>10} {'vs ssm_128':>10}")
  medians = {name: float(np.median(t)) for name, t in times.items()}
  for name, t in times.items():
    row = section["losses"][name]
    row.update(step_s=[round(x, 4) for x in t], min_s=round(min(t), 4),
               median_s=round(medians[name], 4))
    ratios = [medians[name] / medians[ref] if ref in medians else None
              for ref in ("cut_bce", "ssm_128")]
    print(f"{name:>10} {min(t):>8.3f} {medians[name]:>9.3f} "
          + " ".join("         -" if r is None else f"{r:>9.2f}x" for r in ratios), flush=True)
  return section


def part_cpu(args, out: dict, path: pathlib.Path) -> None:
  if len(jax.devices()) != 8:
    raise SystemExit(f"needs 8 devices, found {len(jax.devices())}")
  out["cpu"] = {"command": out["command"], "config": out["config"],
                "machine": {"platform": jax.default_backend(), "devices": len(jax.devices()),
                            "cpu_count": os.cpu_count(),
                            "processor": platform.processor() or platform.machine(),
                            "jax": jax.__version__},
                "vocabs": {}}
  for vocab in args.vocabs:
    out["cpu"]["vocabs"][str(vocab)] = cpu_vocab(args, vocab)
    _write(path, out)


def part_tpu(args, out: dict, path: pathlib.Path) -> None:
  from benchmarks import tpu_compile_bench  # pylint: disable=import-outside-toplevel
  from cutbce.kernels import compiler  # pylint: disable=import-outside-toplevel
  reason = compiler.libtpu_missing_reason()
  if reason:
    raise SystemExit(reason)
  header = {"tpu": {"command": out["command"], "config": out["config"],
                    "batch": args.tpu_batch, "seq_len": 256, "chips": args.chips}}
  out.update(header)
  _write(path, out)
  cache = tpu_compile_bench.Cache(path, args.fresh, section="tpu_cases", header=header,
                                  losses=LOSSES)
  print(f"\n== compiled for TPU (no device), global batch {args.tpu_batch} x N 256 ==")
  print(tpu_compile_bench.HEADER)
  for chip in args.chips:
    for vocab in args.vocabs:
      for name in args.losses:
        cache.get(chip, name, args.tpu_batch, vocab)
  out["tpu_cases"] = cache.results
  print(f"\n{'chip':>4} {'V':>11} " + " ".join(f"{n:>10}" for n in args.losses))
  for chip in args.chips:
    for vocab in args.vocabs:
      cases = [cache.results[f"{chip}/{n}/b{args.tpu_batch}/v{vocab}"] for n in args.losses]
      peaks = [_gib(c.get("peak_bytes", c.get("required_bytes"))) + ("" if c["fits"] else "!")
               for c in cases]
      est = ["-" if c.get("compiler_optimal_seconds") is None
             else f"{c['compiler_optimal_seconds'] * 1e3:.2f}ms" for c in cases]
      print(f"{chip:>4} {vocab:>11,} " + " ".join(f"{p:>10}" for p in peaks) + "  GiB/chip")
      print(f"{'':>16} " + " ".join(f"{e:>10}" for e in est) + "  est. step")
  print("(! = over the chip's HBM: the compiler's refusal, the bytes it asked for)")


def _write(path: pathlib.Path, out: dict) -> None:
  """Merges `out` (less the run's own command and config, kept per part) into the file."""
  saved = json.loads(path.read_text()) if path.exists() else {}
  saved.update({k: v for k, v in out.items() if k not in ("command", "config")})
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps(saved, indent=1) + "\n")


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--parts", nargs="+", default=["cpu", "tpu"], choices=("cpu", "tpu"))
  parser.add_argument("--losses", nargs="+", default=list(LOSSES), choices=list(LOSSES))
  parser.add_argument("--vocabs", nargs="+", type=int, default=list(VOCABS))
  parser.add_argument("--batch", type=int, default=8, help="CPU global batch (a multiple of 8)")
  parser.add_argument("--seq", type=int, default=32, help="CPU sequence length N")
  parser.add_argument("--repeats", type=int, default=3, help="timed rounds after the warm-up")
  parser.add_argument("--max-run-gib", type=float, default=12.0,
                      help="host memory (all devices) a timed step may use")
  parser.add_argument("--chips", nargs="+", default=["v6e"])
  parser.add_argument("--tpu-batch", type=int, default=64)
  parser.add_argument("--fresh", action="store_true", help="compile the TPU cases again")
  parser.add_argument("--quick", action="store_true", help="V = 10^4, tiny batch: seconds")
  parser.add_argument("--out", default="docs/results/loss_cost.json")
  args = parser.parse_args(argv)
  libtpu_env.quiet_probe_without_tpu()  # before jax starts a backend
  if args.quick:
    args.vocabs, args.batch, args.seq, args.repeats, args.tpu_batch = [10_000], 8, 16, 1, 8
    if args.out == parser.get_default("out"):
      args.out = "/tmp/loss_cost_quick.json"
  path = pathlib.Path(args.out)
  out = {"command": " ".join(["python", "benchmarks/loss_cost.py",
                              *map(shlex.quote, sys.argv[1:] if argv is None else argv)]),
         "config": {k: v for k, v in vars(args).items() if k not in ("out", "fresh")},
         "model": "SASRec from configs/yambda50m_v6e8.py (mesh data=2 x model=4, D = 128, "
                  "2 blocks, 2 heads, mlp 512, L = 8, bfloat16, dropout 0.1), AdamW",
         "losses": LOSSES}
  start = time.perf_counter()
  for part in args.parts:
    part_start = time.perf_counter()
    {"cpu": part_cpu, "tpu": part_tpu}[part](args, out, path)
    out[part]["wall_s"] = round(time.perf_counter() - part_start, 1)
    _write(path, out)
  print(f"\nwrote {path} ({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
  main()
