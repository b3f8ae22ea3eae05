"""Host peak memory of a resume: initialise-then-restore against restore into abstract arrays.

A train state of about 200 MB (the smoke model with 2^20 items, D = 16: the
table and its two AdamW moments, float32) is saved once; then two fresh
processes on one CPU device restore it and report their peak resident set
(`resource.getrusage(RUSAGE_SELF).ru_maxrss`):

  init_then_restore: what the trainer did before: `create_sharded_state`
                     (a fresh state) and then `checkpoint.restore` into
                     shapes taken from it; both are alive during the restore.
  abstract_restore:  what it does now: `plan_sharded_state` (shapes, dtypes
                     and shardings only) and `checkpoint.restore` into
                     `plan.abstract`; nothing is initialised.

A third process (`plan_only`) builds the plan and restores nothing: the
baseline of the runtime and the compiled code. On CPU the device memory is
host memory, so the difference is the state's copies.

  python benchmarks/restore_memory.py --out benchmarks/results/restore_memory.json
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import resource
import subprocess
import sys
import tempfile

PHASES = ("plan_only", "init_then_restore", "abstract_restore")


def _config(num_items: int):
  from configs import smoke  # pylint: disable=import-outside-toplevel
  config = smoke.get_config()
  config.mesh.shape = (1,)
  config.data.source_options.num_items = num_items
  return config


def _run_phase(phase: str, directory: str, num_items: int) -> dict:
  import grain  # pylint: disable=import-outside-toplevel
  import jax  # pylint: disable=import-outside-toplevel
  from trainer import checkpoint  # pylint: disable=import-outside-toplevel
  from trainer.config import mesh as config_mesh  # pylint: disable=import-outside-toplevel
  from trainer import train as train_lib  # pylint: disable=import-outside-toplevel
  config = _config(num_items)
  mesh = config_mesh.make_mesh(config)
  plan = train_lib.plan_sharded_state(config, num_items=num_items, mesh=mesh, vocab_shards=1)
  state_bytes = sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(plan.abstract))
  iterator = iter(grain.MapDataset.range(8).to_iter_dataset())
  manager = checkpoint.make_manager(directory, None)
  if phase == "save":
    checkpoint.save(manager, 1, plan.init(), iterator)
  elif phase == "init_then_restore":
    state = train_lib.create_sharded_state(config, num_items=num_items, mesh=mesh,
                                           vocab_shards=1)[3]
    abstract = train_lib.abstract_state(state, plan.shardings)
    restored = checkpoint.restore(manager, 1, abstract, iterator)
    jax.block_until_ready(restored)
    state = restored  # As `self.state = checkpoint.restore(...)` did: the fresh one goes.
  elif phase == "abstract_restore":
    state = checkpoint.restore(manager, 1, plan.abstract, iterator)
    jax.block_until_ready(state)
  manager.close()
  peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
  return {"phase": phase, "peak_rss_mb": peak_kib * 1024 / 1e6, "state_mb": state_bytes / 1e6}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--num_items", type=int, default=1 << 20)
  parser.add_argument("--out", type=pathlib.Path, default=None)
  parser.add_argument("--phase", choices=("save",) + PHASES, default=None,
                      help="(internal) run one phase in this process")
  parser.add_argument("--dir", default=None, help="(internal) the checkpoints folder")
  args = parser.parse_args()
  if args.phase is not None:
    print(json.dumps(_run_phase(args.phase, args.dir, args.num_items)))
    return
  root = pathlib.Path(__file__).resolve().parents[1]
  env = {key: value for key, value in os.environ.items() if key != "XLA_FLAGS"}  # One device.
  env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
  rows = []
  with tempfile.TemporaryDirectory() as directory:
    for phase in ("save",) + PHASES:
      done = subprocess.run([sys.executable, __file__, f"--phase={phase}", f"--dir={directory}",
                             f"--num_items={args.num_items}"], cwd=root, env=env,
                            capture_output=True, text=True, check=True)
      if phase != "save":
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
  base = rows[0]["peak_rss_mb"]
  print(f"train state {rows[0]['state_mb']:.1f} MB ({args.num_items} items, D = 16, AdamW)")
  print(f"{'phase':<20} {'peak RSS MB':>12} {'over plan_only':>15}")
  for row in rows:
    row["over_plan_only_mb"] = row["peak_rss_mb"] - base
    print(f"{row['phase']:<20} {row['peak_rss_mb']:>12.1f} {row['over_plan_only_mb']:>15.1f}")
  if args.out is not None:
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"num_items": args.num_items, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
  main()
