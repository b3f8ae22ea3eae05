"""Throughput of the training input pipeline (examples per second).

Prepares ML-1M (leave-one-out, SASRec filter) and a synthetic set with a 10^6
item catalog, then times the grain training iterator: examples (windows of N
inputs with [N, L] targets) per second and positions per second, after a
warm-up. Also reports the preparation time. Prints a table and writes JSON.

  python benchmarks/data_bench.py --out benchmarks/results/data_bench.json
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import tempfile
import time

import numpy as np

from trainer.data import pipeline, prepare, storage


def time_pipeline(data: storage.PreparedDataset, *, seq_len: int,
                  num_targets: int, batch_size: int, steps: int,
                  warmup: int, num_threads: int) -> dict:
  """Times ``steps`` batches of the training iterator after ``warmup``."""
  iterator = pipeline.train_iterator(
      data, seq_len=seq_len, num_targets=num_targets, batch_size=batch_size,
      seed=0, process_index=0, process_count=1, num_threads=num_threads)
  for _ in range(warmup):
    next(iterator)
  start = time.perf_counter()
  positions = 0
  for _ in range(steps):
    batch = next(iterator)
    positions += int(np.count_nonzero(batch["weights"]))
  seconds = time.perf_counter() - start
  return {"examples_per_s": steps * batch_size / seconds,
          "positions_per_s": positions / seconds,
          "batches_per_s": steps / seconds, "seconds": seconds}


def run(name: str, dataset: str, workdir: pathlib.Path, args,
        source_options: dict | None = None) -> dict:
  """Prepares one dataset and times its pipeline."""
  out = workdir / name
  start = time.perf_counter()
  manifest = prepare.prepare_dataset(dataset, out, source_options=source_options,
                                     seq_lens=(args.seq_len,))
  prepare_seconds = time.perf_counter() - start
  data = storage.load_prepared(out)
  result = time_pipeline(data, seq_len=args.seq_len,
                         num_targets=args.num_targets,
                         batch_size=args.batch_size, steps=args.steps,
                         warmup=args.warmup, num_threads=args.num_threads)
  return {"name": name, "num_users": manifest["num_users"],
          "num_items": manifest["num_items"],
          "num_interactions": manifest["num_interactions"],
          "train_windows": manifest["train_windows"][str(args.seq_len)],
          "prepare_seconds": prepare_seconds, **result}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--out", default="benchmarks/results/data_bench.json")
  parser.add_argument("--workdir", default=None,
                      help="where to prepare the data (default: a temp dir)")
  parser.add_argument("--seq-len", type=int, default=200)
  parser.add_argument("--num-targets", type=int, default=8)
  parser.add_argument("--batch-size", type=int, default=128)
  parser.add_argument("--steps", type=int, default=100)
  parser.add_argument("--warmup", type=int, default=10)
  parser.add_argument("--num-threads", type=int, default=2)
  parser.add_argument("--synthetic-users", type=int, default=50_000)
  parser.add_argument("--synthetic-items", type=int, default=1_000_000)
  parser.add_argument("--synthetic-length", type=int, default=100)
  args = parser.parse_args()

  with tempfile.TemporaryDirectory() as tmp:
    workdir = pathlib.Path(args.workdir or tmp)
    rows = [
        run("ml-1m", "ml-1m", workdir, args),
        run(f"synthetic-{args.synthetic_items:.0e}-items", "synthetic",
            workdir, args, source_options=dict(
                num_users=args.synthetic_users,
                num_items=args.synthetic_items,
                interactions_per_user=args.synthetic_length, seed=0)),
    ]

  header = (f"{'dataset':<24}{'users':>9}{'items':>10}{'events':>11}"
            f"{'prep s':>8}{'examples/s':>12}{'positions/s':>13}")
  print(f"N={args.seq_len} L={args.num_targets} batch={args.batch_size} "
        f"threads={args.num_threads}")
  print(header)
  for row in rows:
    print(f"{row['name']:<24}{row['num_users']:>9,}{row['num_items']:>10,}"
          f"{row['num_interactions']:>11,}{row['prepare_seconds']:>8.1f}"
          f"{row['examples_per_s']:>12,.0f}{row['positions_per_s']:>13,.0f}")
  out = pathlib.Path(args.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps({
      "config": vars(args), "machine": platform.platform(),
      "processor": platform.processor(), "results": rows}, indent=2))
  print(f"wrote {out}")


if __name__ == "__main__":
  main()
