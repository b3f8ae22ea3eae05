"""The SASRec train step with dense BCE vs CutBCE, on 8 simulated CPU devices.

The step is the trainer's own (`trainer.train.jit_train_step`: SASRec forward,
`sharded_cut_bce` with `return_stats`, clipping, AdamW, donated state), built
from `configs/yambda50m_v6e8.py` (mesh data=2 x model=4, tokens split over
both axes, table rows over "model", D = 128, 2 blocks, N = 256, next 8 items
as labels) with only `loss.backend` changed: "dense" (materialized logits
under XLA's partitioner) or "xla" (CutBCE's tiled path inside shard_map), the
latter both in one pass (loss and gradients in the forward sweep, the
default: "cutbce") and in two passes (`config.loss.one_pass=False`:
"two_pass"). The one-pass residual (an f32 `[V/shards, D]` table gradient per
device) lives from the loss's forward to the model's backward, so its cost
shows in the peak, not only in the temporaries.
Batches are random ids (speed and memory do not depend on the values).

Part 1, V = 131,072, global batch 8 x 256 (one sequence per device; 16 would
need ~15 GiB of host memory for dense's buffers): both variants compiled once,
per-device memory from `compiled.memory_analysis()`; then, after a warm-up
step each, the two compiled steps run interleaved (dense, cutbce, dense, ...)
so both see the same machine load; min and median step time of each.

Part 2, V = 876,939 (the paper's catalog), N = 256, L = 8, bfloat16 compute
(as the v6e config): per-device compiled memory of both at the paper's
per-chip share (`--paper-batch` = 128 global sequences, 16 x 256 tokens per
device: one float32 [tokens, V] array is then 13.4 GiB per device, the
paper's figure), compile only; then a few real CutBCE steps at a reduced
global batch (`--big-run-batch`) that 2 CPU cores can run, and dense at that
batch only when its compiled footprint over all devices is under
`--max-run-gib` (otherwise compile only).

"Peak" below is the compiled program's own estimate of a device's live bytes:
arguments + outputs - donated aliases + temporaries.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python benchmarks/train_bench.py
    python benchmarks/train_bench.py --quick        # small shapes, a smoke check
    python benchmarks/train_bench.py --parts speed --softmax --out ...  # + softmax CE steps

Prints tables and writes JSON to docs/results/train_bench.json.
"""

from __future__ import annotations

import os

_DEVICE_FLAG = "--xla_force_host_platform_device_count=8"
if _DEVICE_FLAG not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _DEVICE_FLAG).strip()

import argparse  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import platform  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # configs/, trainer/

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from configs import yambda50m_v6e8  # noqa: E402
from trainer import model as model_lib  # noqa: E402
from trainer.config import mesh as config_mesh  # noqa: E402
from trainer import train as train_lib  # noqa: E402

GIB = 2**30
PAPER = {"peak_hbm_gib": {"dense": 22.37, "cutbce": 7.67}, "peak_reduction": 0.657,
         "steps_per_s": {"dense": 6.14, "cutbce": 20.01}, "speedup": 3.26,
         "chip": "TPU v6e x 8", "batch": 64, "seq_len": 256, "num_targets": 8,
         "vocab": 876_939}
# name -> (loss.backend, loss.one_pass)
VARIANTS = {"dense": ("dense", None), "cutbce": ("xla", None), "two_pass": ("xla", False)}
# With --softmax, part 1 also times loss.kind="softmax_ce": the dense-logits
# reference and `cut_softmax_ce` (its forward and backward sweeps).
SOFTMAX_VARIANTS = {"dense_ce": ("dense", None), "cut_ce": ("xla", None)}


def make_config(args, *, batch: int, backend: str, one_pass: bool | None = None,
                kind: str = "bce"):
  config = yambda50m_v6e8.get_config()
  config.batch_size = batch
  config.seq_len = args.seq
  config.num_targets = args.num_targets
  config.model.dim = args.dim
  config.model.dtype = args.dtype
  config.model.dropout_rate = 0.1
  config.loss.kind = kind
  config.loss.backend = backend
  config.loss.one_pass = None if kind == "softmax_ce" else one_pass
  config.train_steps = 1_000
  return config


class Step:
  """One variant's jitted trainer step, its shardings and (optionally) its state."""

  def __init__(self, config, num_items: int):
    self.config = config
    self.num_items = num_items
    self.mesh = config_mesh.make_mesh(config)
    vocab_shards = config_mesh.vocab_shard_count(config)
    self.tx = train_lib.make_optimizer(config.optimizer, config.train_steps)
    self.schedule = train_lib.learning_rate_schedule(config.optimizer, config.train_steps)

    def build():
      return train_lib.make_model(config.model, num_items=num_items, seq_len=config.seq_len,
                                  vocab_shards=vocab_shards, seed=config.seed)

    self._init = lambda: train_lib.init_state(build(), self.tx)[1]
    self.graphdef = nnx.graphdef(nnx.eval_shape(build))
    self.abstract = jax.eval_shape(self._init)
    self.shardings = train_lib.state_shardings(self.abstract, self.mesh, config.mesh.vocab_axis)
    settings = train_lib.step_settings(config, mesh=self.mesh, num_items=num_items)
    self.jitted = train_lib.jit_train_step(self.graphdef, self.tx, self.schedule, settings,
                                           self.shardings)
    self.batch_sharding = train_lib.batch_sharding(self.mesh, config.mesh.token_axes)
    self.compiled = None
    self.state = None

  def abstract_args(self):
    state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                         self.abstract, self.shardings)
    b, n, l = self.config.batch_size, self.config.seq_len, self.config.num_targets
    batch = {
        "inputs": jax.ShapeDtypeStruct((b, n), np.int32, sharding=self.batch_sharding),
        "targets": jax.ShapeDtypeStruct((b, n, l), np.int32, sharding=self.batch_sharding),
        "weights": jax.ShapeDtypeStruct((b, n), np.float32, sharding=self.batch_sharding),
    }
    return state, batch

  def compile(self) -> dict:
    start = time.perf_counter()
    self.compiled = self.jitted.lower(*self.abstract_args()).compile()
    seconds = time.perf_counter() - start
    m = self.compiled.memory_analysis()
    peak = (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
            + m.temp_size_in_bytes)
    return {"temp_bytes_per_device": int(m.temp_size_in_bytes),
            "argument_bytes_per_device": int(m.argument_size_in_bytes),
            "output_bytes_per_device": int(m.output_size_in_bytes),
            "alias_bytes_per_device": int(m.alias_size_in_bytes),
            "peak_bytes_per_device": int(peak), "compile_s": round(seconds, 1)}

  def init(self) -> None:
    self.state = jax.jit(self._init, out_shardings=self.shardings)()

  def run(self, batch) -> float:
    start = time.perf_counter()
    self.state, metrics = self.compiled(self.state, batch)
    loss = float(jax.device_get(metrics["loss"]))
    if not np.isfinite(loss):
      raise RuntimeError(f"non-finite loss {loss}")
    return time.perf_counter() - start


def random_batch(step: Step, seed: int):
  rng = np.random.default_rng(seed)
  c = step.config
  b, n, l = c.batch_size, c.seq_len, c.num_targets
  host = {"inputs": rng.integers(0, step.num_items, (b, n), dtype=np.int32),
          "targets": rng.integers(0, step.num_items, (b, n, l), dtype=np.int32),
          "weights": np.ones((b, n), np.float32)}
  return {k: jax.device_put(v, step.batch_sharding) for k, v in host.items()}


def same_state(steps) -> None:
  """Raises unless every step takes (and donates) the same state: one state serves them all."""
  def spec(step):
    return [(x.shape, x.dtype, s) for x, s in zip(jax.tree.leaves(step.abstract),
                                                  jax.tree.leaves(step.shardings))]
  first, *rest = steps
  for step in rest:
    if spec(step) != spec(first) or (jax.tree.structure(step.abstract)
                                     != jax.tree.structure(first.abstract)):
      raise RuntimeError("the losses' train states differ; they cannot share one")


def interleaved_times(steps: dict, repeats: int) -> tuple[dict, dict]:
  """({name: [step seconds] x repeats}, {name: warm-up seconds}) of compiled steps.

  The steps run in turn, round after round, on one state passed from each to
  the next and one batch, so drift in the machine's speed touches them alike;
  round 0 warms up and is not timed. Each step must take the same state
  (`same_state`); the first one's `init` makes it.
  """
  steps = dict(steps)
  same_state(list(steps.values()))
  first = next(iter(steps.values()))
  first.init()
  state, first.state = first.state, None
  batch = random_batch(first, 0)
  times, warmups = {name: [] for name in steps}, {}
  for round_index in range(repeats + 1):
    for name, step in steps.items():
      step.state = state
      seconds = step.run(batch)
      state, step.state = step.state, None
      if round_index:
        times[name].append(seconds)
      else:
        warmups[name] = seconds
  return times, warmups


def _gib(x):
  return None if x is None else round(x / GIB, 3)


def _mem_row(name, vocab, batch, mem):
  return (f"{vocab:>9,} {batch:>5} {name:>7} {_gib(mem['temp_bytes_per_device']):>12.3f} "
          f"{_gib(mem['peak_bytes_per_device']):>12.3f} {mem['compile_s']:>9.1f}")


def part_speed(args, out):
  """Both variants at args.vocab: memory, then interleaved timed steps."""
  print(f"\n== V = {args.vocab:,}, global batch {args.batch} x N {args.seq}, L = "
        f"{args.num_targets}, D = {args.dim}, {args.dtype}: interleaved steps ==", flush=True)
  variants = {name: (*v, "bce") for name, v in VARIANTS.items()}
  if args.softmax:
    variants.update({name: (*v, "softmax_ce") for name, v in SOFTMAX_VARIANTS.items()})
  steps = {name: Step(make_config(args, batch=args.batch, backend=backend, one_pass=one_pass,
                                  kind=kind), args.vocab)
           for name, (backend, one_pass, kind) in variants.items()}
  print(f"{'V':>9} {'batch':>5} {'variant':>7} {'temp GiB/dev':>12} {'peak GiB/dev':>12} "
        f"{'compile s':>9}")
  section = {"vocab": args.vocab, "batch": args.batch, "seq_len": args.seq,
             "num_targets": args.num_targets, "dim": args.dim, "dtype": args.dtype,
             "variants": {}}
  for name, step in steps.items():
    mem = step.compile()
    section["variants"][name] = {"memory": mem}
    print(_mem_row(name, args.vocab, args.batch, mem), flush=True)
  footprint = max(v["memory"]["peak_bytes_per_device"] for v in section["variants"].values())
  if footprint * len(jax.devices()) > args.max_run_gib * GIB:
    raise SystemExit(f"the steps need {footprint * len(jax.devices()) / GIB:.1f} GiB over all "
                     f"devices > --max-run-gib={args.max_run_gib}: lower --batch")
  batch = random_batch(steps["cutbce"], 0)
  for name, step in steps.items():
    step.init()
    section["variants"][name]["warmup_s"] = round(step.run(batch), 3)
  times = {name: [] for name in steps}
  for _ in range(args.repeats):
    for name, step in steps.items():
      times[name].append(step.run(batch))
  print(f"{'variant':>7} {'min s':>8} {'median s':>9} {'steps/s (median)':>17}")
  for name in steps:
    t = np.asarray(times[name])
    section["variants"][name].update(
        step_s=[round(x, 4) for x in t], min_s=round(float(t.min()), 4),
        median_s=round(float(np.median(t)), 4),
        steps_per_s=round(float(1 / np.median(t)), 4))
    print(f"{name:>7} {t.min():>8.3f} {np.median(t):>9.3f} {1 / np.median(t):>17.3f}")
  v = section["variants"]
  section["speedup_median"] = round(v["dense"]["median_s"] / v["cutbce"]["median_s"], 3)
  section["speedup_min"] = round(v["dense"]["min_s"] / v["cutbce"]["min_s"], 3)
  section["temp_reduction"] = round(
      1 - v["cutbce"]["memory"]["temp_bytes_per_device"]
      / v["dense"]["memory"]["temp_bytes_per_device"], 4)
  section["peak_reduction"] = round(
      1 - v["cutbce"]["memory"]["peak_bytes_per_device"]
      / v["dense"]["memory"]["peak_bytes_per_device"], 4)
  section["one_pass_time_ratio_median"] = round(
      v["cutbce"]["median_s"] / v["two_pass"]["median_s"], 3)
  section["one_pass_peak_extra_bytes"] = (v["cutbce"]["memory"]["peak_bytes_per_device"]
                                          - v["two_pass"]["memory"]["peak_bytes_per_device"])
  print(f"cutbce vs dense: {section['speedup_median']:.2f}x steps/s (median), "
        f"{section['speedup_min']:.2f}x (min); temp -{100 * section['temp_reduction']:.1f}%, "
        f"peak -{100 * section['peak_reduction']:.1f}%")
  print(f"one pass vs two passes: {section['one_pass_time_ratio_median']:.2f}x step time "
        f"(median), peak {section['one_pass_peak_extra_bytes'] / 2**20:+.1f} MiB/device")
  if args.softmax:
    section["cut_ce_vs_dense_ce_time_median"] = round(
        v["cut_ce"]["median_s"] / v["dense_ce"]["median_s"], 3)
    section["cut_ce_vs_cutbce_time_median"] = round(
        v["cut_ce"]["median_s"] / v["cutbce"]["median_s"], 3)
    section["cut_ce_vs_two_pass_time_median"] = round(
        v["cut_ce"]["median_s"] / v["two_pass"]["median_s"], 3)
    print(f"softmax CE: cut / dense {section['cut_ce_vs_dense_ce_time_median']:.2f}x step time, "
          f"cut CE / one-pass cut BCE {section['cut_ce_vs_cutbce_time_median']:.2f}x, "
          f"/ two-pass {section['cut_ce_vs_two_pass_time_median']:.2f}x (medians)")
  out["speed"] = section


def part_paper(args, out):
  """V = 876,939: compiled memory at the paper's per-chip share; real CutBCE steps."""
  vocab = args.big_vocab
  print(f"\n== V = {vocab:,}, N {args.seq}, L = {args.num_targets}, D = {args.dim}, "
        f"{args.big_dtype}: compiled memory per device ==", flush=True)
  print(f"{'V':>9} {'batch':>5} {'variant':>7} {'temp GiB/dev':>12} {'peak GiB/dev':>12} "
        f"{'compile s':>9}")
  big = argparse.Namespace(**{**vars(args), "dtype": args.big_dtype})
  section = {"vocab": vocab, "seq_len": args.seq, "num_targets": args.num_targets,
             "dim": args.dim, "dtype": args.big_dtype, "memory": {}}
  for batch in sorted({args.paper_batch, args.big_run_batch}, reverse=True):
    rows = section["memory"][str(batch)] = {}
    for name, (backend, one_pass) in VARIANTS.items():
      step = Step(make_config(big, batch=batch, backend=backend, one_pass=one_pass), vocab)
      rows[name] = step.compile()
      print(_mem_row(name, vocab, batch, rows[name]), flush=True)
      if batch == args.big_run_batch:
        footprint = rows[name]["peak_bytes_per_device"] * len(jax.devices())
        if name == "dense" and footprint > args.max_run_gib * GIB:
          rows[name]["run"] = (f"compile only: {footprint / GIB:.1f} GiB over all devices "
                               f"> --max-run-gib={args.max_run_gib}")
          continue
        if name == "dense" and not args.run_big_dense:
          rows[name]["run"] = "compile only (pass --run-big-dense to time it)"
          continue
        step.init()
        batch_arrays = random_batch(step, 1)
        warm = step.run(batch_arrays)
        times = [step.run(batch_arrays) for _ in range(args.big_steps)]
        rows[name].update(warmup_s=round(warm, 2), step_s=[round(t, 3) for t in times],
                          median_s=round(float(np.median(times)), 3))
        print(f"    {name}: {args.big_steps} steps after warm-up, median "
              f"{np.median(times):.2f} s/step ({1 / np.median(times):.3f} steps/s)", flush=True)
      del step
    dense, cut = rows["dense"], rows["cutbce"]
    rows["peak_reduction"] = round(
        1 - cut["peak_bytes_per_device"] / dense["peak_bytes_per_device"], 4)
    rows["temp_reduction"] = round(
        1 - cut["temp_bytes_per_device"] / dense["temp_bytes_per_device"], 4)
    rows["peak_saved_gib"] = _gib(dense["peak_bytes_per_device"] - cut["peak_bytes_per_device"])
    rows["one_pass_peak_extra_gib"] = _gib(
        cut["peak_bytes_per_device"] - rows["two_pass"]["peak_bytes_per_device"])
    print(f"    batch {batch}: peak -{100 * rows['peak_reduction']:.1f}% "
          f"({rows['peak_saved_gib']:.2f} GiB/dev saved), temp "
          f"-{100 * rows['temp_reduction']:.1f}%; one pass vs two passes: peak "
          f"{rows['one_pass_peak_extra_gib']:+.3f} GiB/dev", flush=True)
  out["paper_vocab"] = section


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--vocab", type=int, default=131_072)
  parser.add_argument("--batch", type=int, default=8,
                      help="global batch of part 1 (1 sequence per device)")
  parser.add_argument("--seq", type=int, default=256)
  parser.add_argument("--num-targets", type=int, default=8)
  parser.add_argument("--dim", type=int, default=128)
  parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
  parser.add_argument("--repeats", type=int, default=5, help="timed steps per variant")
  parser.add_argument("--big-vocab", type=int, default=876_939)
  parser.add_argument("--big-dtype", default="bfloat16", choices=("float32", "bfloat16"))
  parser.add_argument("--paper-batch", type=int, default=128,
                      help="global batch of the compile-only comparison (16 per device)")
  parser.add_argument("--big-run-batch", type=int, default=8,
                      help="reduced global batch of the real steps at the big V")
  parser.add_argument("--big-steps", type=int, default=3)
  parser.add_argument("--max-run-gib", type=float, default=10.0,
                      help="host memory (all devices) a timed program may use")
  parser.add_argument("--run-big-dense", action="store_true")
  parser.add_argument("--parts", default="speed,paper")
  parser.add_argument("--softmax", action="store_true",
                      help="part 1 also times loss.kind=softmax_ce, dense and cut")
  parser.add_argument("--quick", action="store_true", help="tiny shapes, seconds")
  parser.add_argument("--out", default="docs/results/train_bench.json")
  args = parser.parse_args()
  if args.quick:
    args.vocab, args.batch, args.seq, args.repeats = 4_096, 8, 32, 2
    args.big_vocab, args.paper_batch, args.big_run_batch, args.big_steps = 20_003, 16, 8, 1
  if len(jax.devices()) != 8:
    raise SystemExit(f"needs 8 devices, found {len(jax.devices())}")
  out = {"config": {k: v for k, v in vars(args).items() if k != "out"},
         "machine": {"platform": jax.default_backend(), "devices": len(jax.devices()),
                     "cpu_count": os.cpu_count(), "processor": platform.processor()
                     or platform.machine(), "jax": jax.__version__},
         "model": "SASRec from configs/yambda50m_v6e8.py (mesh data=2 x model=4, 2 blocks, "
                  "2 heads, mlp 512), dropout 0.1, AdamW",
         "paper": PAPER}
  path = pathlib.Path(args.out)
  path.parent.mkdir(parents=True, exist_ok=True)
  start = time.perf_counter()
  for part in args.parts.split(","):
    {"speed": part_speed, "paper": part_paper}[part](args, out)
    out["wall_s"] = round(time.perf_counter() - start, 1)
    path.write_text(json.dumps(out, indent=2) + "\n")
  print(f"\nwrote {path} ({out['wall_s']:.0f} s)")


if __name__ == "__main__":
  main()
