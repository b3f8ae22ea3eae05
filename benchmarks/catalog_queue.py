"""Issue 39's catalog-scale runs, one after another: exact against sampled at 10^5 items.

Each entry is one training run of `configs/synthetic_100k.py` (the
`synthetic_topics` data: 100,000 items, statistics measured on ML-1M; its
Bayes ceiling and popularity baseline in docs/results/synthetic_ceiling.json)
that differs from the others in its loss alone, at equal steps. Runs go one at
a time (the machine's two cores), each in its own process through
`benchmarks/ml1m_quality.py train`, into `runs/catalog_100k/NAME`, and write
`docs/results/catalog/synthetic_100k/NAME.json`. A run whose JSON exists is
skipped; one cut off resumes from its last checkpoint when the queue is
started again, so the queue can span sessions.

    python benchmarks/catalog_queue.py --list             # the queue and what is done
    python benchmarks/catalog_queue.py                    # run what is left, in order
    python benchmarks/catalog_queue.py --only exact_bce   # one entry
    python benchmarks/catalog_queue.py --cost             # each loss's step: memory, time
    python benchmarks/catalog_queue.py --table            # the results side by side
    python benchmarks/catalog_queue.py --catalog 1m --list   # the same at 10^6 items

`--catalog 1m` is the same queue on `configs/synthetic_1m_catalog.py` (the
same model on 10^6 items, 60,000 users) into `runs/catalog_1m/` and
`docs/results/catalog/synthetic_1m/`: a GPU's job, which
`benchmarks/gpu_run.py device --runs catalog_1m_NAME ...` runs there (its
`CATALOG_1M_RUNS`); copy each `quality/catalog_1m_NAME.json` it writes to
`docs/results/catalog/synthetic_1m/NAME.json`. `--catalog ciao` runs it on
real data, `configs/ciao.py` (Ciao's 105,114 products, the file a user
downloads: docs/data.md), into `runs/catalog_ciao/` and
`docs/results/catalog/ciao/`.

`--cost` compiles each entry's train step as its run does (the trainer's
step on the host's 8 simulated devices, random ids of the config's shapes)
and records the compiled program's per-device memory (`memory_analysis()`:
temporaries, and the peak: arguments + outputs - donated + temporaries),
then times the steps interleaved on one shared train state (a warm-up
round, then --repeats rounds of one step each) so every loss sees the same
machine load; the runs' own wall times do not (other jobs shared the cores
with some of them). The popularity sampler's entry needs the item-count
table the trainer builds from the data and is left out of `--cost` (its
step is the uniform one's plus a gather from a [V] table). Writes
`docs/results/catalog/synthetic_100k/cost.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shlex
import statistics
import subprocess
import sys
from typing import NamedTuple

ROOT = pathlib.Path(__file__).resolve().parents[1]


class Catalog(NamedTuple):
  """Where one catalog's runs come from and go."""
  config: str
  runs: str  # run folders (checkpoints), ignored by git
  results: str  # one JSON per finished run
  num_items: int  # the catalog of the config's data


# --catalog: 10^5 items on this machine's CPU; 10^6 a GPU's (benchmarks/gpu_run.py
# runs these entries as catalog_1m_NAME, mesh data=1); Ciao's 105,114 real items
# (the user's download, trainer/data/ciao.py) on the CPU with the 10^5 model.
CATALOGS = {
    "100k": Catalog("configs/synthetic_100k.py", "runs/catalog_100k",
                    "docs/results/catalog/synthetic_100k", 100_000),
    "1m": Catalog("configs/synthetic_1m_catalog.py", "runs/catalog_1m",
                  "docs/results/catalog/synthetic_1m", 1_000_000),
    "ciao": Catalog("configs/ciao.py", "runs/catalog_ciao", "docs/results/catalog/ciao",
                    105_114),
}

# name -> the config overrides of its loss (everything else as the catalog's config says).
QUEUE = {
    "exact_bce": ["loss.kind=bce"],
    "exact_softmax_ce": ["loss.kind=softmax_ce"],
    "sampled_softmax_k128": ["loss.kind=sampled_softmax", "loss.num_negatives=128"],
    "sampled_softmax_k1024": ["loss.kind=sampled_softmax", "loss.num_negatives=1024"],
    "sampled_softmax_k128_pop_logq": ["loss.kind=sampled_softmax", "loss.num_negatives=128",
                                      "loss.sampler=popularity", "loss.logq=True"],
    "gbce_k256": ["loss.kind=gbce", "loss.num_negatives=256", "loss.gbce_t=0.75"],
}
# The sampled entries again at about the exact losses' wall time: `--cost`
# measured their steps 4.8-5.0x faster than exact BCE's on this machine
# (0.21-0.22 s against 1.06 s, interleaved), so 2,500 steps to exact's 500.
EQUAL_WALL_STEPS = 2500
QUEUE.update({
    f"{name}_wall": [*QUEUE[name], f"train_steps={EQUAL_WALL_STEPS}"]
    for name in ("sampled_softmax_k128", "gbce_k256", "sampled_softmax_k1024",
                 "sampled_softmax_k128_pop_logq")
})
# And the exact losses at as many steps as those: equal steps again, 5x the
# wall time (500 steps are half an epoch; the sampled twins show how far from
# trained).
QUEUE["exact_bce_2500"] = [*QUEUE["exact_bce"], f"train_steps={EQUAL_WALL_STEPS}"]
QUEUE["exact_softmax_ce_2500"] = [*QUEUE["exact_softmax_ce"], f"train_steps={EQUAL_WALL_STEPS}"]
# More seeds of every entry above (the model's init, dropout, the batches'
# order and the negatives; the data stays the one of source seed 0): the
# synthetic 10^5 verdict rests on the 2,500-step rows, Ciao's on the 500-step
# ones (its exact curves peak by step 200-450).
SEEDS = (1, 2)
SEEDED = tuple(QUEUE)
QUEUE.update({f"{name}_seed{seed}": [*QUEUE[name], f"seed={seed}"]
              for seed in SEEDS for name in SEEDED})


def command(name: str, catalog: str = "100k") -> list[str]:
  """The `ml1m_quality.py train` command line of one queue entry."""
  where = CATALOGS[catalog]
  sets = [arg for override in QUEUE[name] for arg in ("--set", override)]
  return [sys.executable, "benchmarks/ml1m_quality.py", "train", "--config", where.config,
          *sets, "--workdir", f"{where.runs}/{name}", "--out", f"{where.results}/{name}.json"]

GIB = 2**30


def cost(names: list[str], repeats: int, catalog: str = "100k") -> dict:
  """Each entry's compiled per-device memory and step time, timed interleaved."""
  device_flag = "--xla_force_host_platform_device_count=8"
  if device_flag not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {device_flag}".strip()
  sys.path.insert(0, str(ROOT))
  import numpy as np  # pylint: disable=import-outside-toplevel
  from benchmarks import ml1m_quality, train_bench  # pylint: disable=import-outside-toplevel
  from trainer import train as train_lib  # pylint: disable=import-outside-toplevel
  from trainer.config import mesh as config_mesh  # pylint: disable=import-outside-toplevel

  where = CATALOGS[catalog]
  steps, out = {}, {"config": where.config, "num_items": where.num_items, "losses": {}}
  for name in names:
    config = ml1m_quality.load_config(where.config, QUEUE[name])
    settings = train_lib.step_settings(config, mesh=config_mesh.make_mesh(config),
                                       num_items=where.num_items)
    if train_lib.needs_item_counts(settings):
      out["losses"][name] = {"not_measured": "needs the data's item-count table"}
      continue
    step = train_bench.Step(config, where.num_items)
    memory = step.compile()
    out["losses"][name] = {"overrides": QUEUE[name], "memory": memory}
    steps[name] = step
    print(f"{name:<32} temp {memory['temp_bytes_per_device'] / GIB:7.3f} GiB/device, peak "
          f"{memory['peak_bytes_per_device'] / GIB:7.3f} GiB/device", flush=True)
  times, _ = train_bench.interleaved_times(steps, repeats)
  for name, t in times.items():
    out["losses"][name].update(step_s=[round(x, 4) for x in t],
                               median_step_s=round(float(np.median(t)), 4))
    print(f"{name:<32} median step {np.median(t):.3f} s over {len(t)} interleaved rounds",
          flush=True)
  return out


def _seeds_of(name: str) -> list[str]:
  """The entry and its other-seed twins, in the queue's order."""
  return [name, *(f"{name}_seed{seed}" for seed in SEEDS if f"{name}_seed{seed}" in QUEUE)]


def _mean_spread(values: list[float]) -> str:
  """One seed's figure, or mean +- sample standard deviation over the seeds."""
  if len(values) == 1:
    return f"{values[0]:.4f}"
  return f"{statistics.mean(values):.4f} +- {statistics.stdev(values):.4f}"


def table(catalog: str = "100k") -> str:
  """The finished runs beside each other (markdown): quality at equal steps, cost.

  An entry's other-seed twins (`NAME_seedS`) share its row: NDCG@10 and HR@10
  as mean +- standard deviation over the seeds whose JSON exists, and the
  validation-selected checkpoint's step, each seed's where they differ."""
  results = ROOT / CATALOGS[catalog].results
  cost_path = results / "cost.json"
  costs = json.loads(cost_path.read_text())["losses"] if cost_path.exists() else {}
  lines = ["| loss | test NDCG@10 | HR@10 | seeds | checkpoint step | step s (interleaved) | "
           "temp GiB / device | peak GiB / device |", "|---|---|---|---|---|---|---|---|"]
  for name in QUEUE:
    if name.endswith(tuple(f"_seed{seed}" for seed in SEEDS)):
      continue  # in its entry's row
    runs = [json.loads(path.read_text()) for path in
            (results / f"{n}.json" for n in _seeds_of(name)) if path.exists()]
    if not runs:
      continue
    c = costs.get(name, {})
    memory = c.get("memory", {})
    gib = lambda key: (f"{memory[key] / GIB:.3f}" if key in memory else "-")  # noqa: E731
    step_s = f"{c['median_step_s']:.3f}" if "median_step_s" in c else "-"
    ndcg = _mean_spread([run["ndcg@10"] for run in runs])
    hr = _mean_spread([run["hr@10"] for run in runs])
    steps = [run["step"] for run in runs]
    step = " / ".join(map(str, steps)) if len(set(steps)) > 1 else str(steps[0])
    lines.append(f"| {name} | {ndcg} | {hr} | {len(runs)} | {step} | "
                 f"{step_s} | {gib('temp_bytes_per_device')} | {gib('peak_bytes_per_device')} |")
  return "\n".join(lines)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--list", action="store_true", help="print the queue and stop")
  parser.add_argument("--only", choices=sorted(QUEUE), action="append",
                      help="run only these entries (repeatable)")
  parser.add_argument("--cost", action="store_true",
                      help="compile and time each entry's step (no training)")
  parser.add_argument("--repeats", type=int, default=5, help="--cost: timed rounds")
  parser.add_argument("--table", action="store_true", help="print the results and stop")
  parser.add_argument("--catalog", choices=sorted(CATALOGS), default="100k",
                      help="the synthetic catalog of 10^5 items (CPU) or 10^6 (a GPU's), "
                      "or Ciao's 105,114 real items (CPU; docs/data.md)")
  args = parser.parse_args(argv)
  names = args.only or list(QUEUE)
  results = CATALOGS[args.catalog].results
  if args.table:
    print(table(args.catalog))
    return 0
  if args.cost:
    result = cost(names, args.repeats, args.catalog)
    path = ROOT / results / "cost.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {path.relative_to(ROOT)}")
    return 0
  for name in names:
    line = command(name, args.catalog)
    done = (ROOT / results / f"{name}.json").exists()
    if args.list:
      print(f"{'done' if done else 'todo':>4}  {name:<32} {shlex.join(line[1:])}")
      continue
    if done:
      print(f"== {name}: done ({results}/{name}.json)", flush=True)
      continue
    print(f"== {name}: {shlex.join(line[1:])}", flush=True)
    status = subprocess.run(line, cwd=ROOT, check=False).returncode
    if status:
      print(f"== {name}: exit status {status}; the queue stops here", flush=True)
      return status
  return 0


if __name__ == "__main__":
  sys.exit(main())
