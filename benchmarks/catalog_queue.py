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
"""

from __future__ import annotations

import argparse
import pathlib
import shlex
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIG = "configs/synthetic_100k.py"
RUNS = "runs/catalog_100k"
RESULTS = "docs/results/catalog/synthetic_100k"

# name -> the config overrides of its loss (everything else as CONFIG says).
QUEUE = {
    "exact_bce": ["loss.kind=bce"],
    "exact_softmax_ce": ["loss.kind=softmax_ce"],
    "sampled_softmax_k128": ["loss.kind=sampled_softmax", "loss.num_negatives=128"],
    "sampled_softmax_k1024": ["loss.kind=sampled_softmax", "loss.num_negatives=1024"],
    "sampled_softmax_k128_pop_logq": ["loss.kind=sampled_softmax", "loss.num_negatives=128",
                                      "loss.sampler=popularity", "loss.logq=True"],
    "gbce_k256": ["loss.kind=gbce", "loss.num_negatives=256", "loss.gbce_t=0.75"],
}


def command(name: str) -> list[str]:
  """The `ml1m_quality.py train` command line of one queue entry."""
  sets = [arg for override in QUEUE[name] for arg in ("--set", override)]
  return [sys.executable, "benchmarks/ml1m_quality.py", "train", "--config", CONFIG, *sets,
          "--workdir", f"{RUNS}/{name}", "--out", f"{RESULTS}/{name}.json"]


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--list", action="store_true", help="print the queue and stop")
  parser.add_argument("--only", choices=sorted(QUEUE), action="append",
                      help="run only these entries (repeatable)")
  args = parser.parse_args(argv)
  names = args.only or list(QUEUE)
  for name in names:
    done = (ROOT / RESULTS / f"{name}.json").exists()
    if args.list:
      print(f"{'done' if done else 'todo':>4}  {name:<32} {shlex.join(command(name)[1:])}")
      continue
    if done:
      print(f"== {name}: done ({RESULTS}/{name}.json)", flush=True)
      continue
    print(f"== {name}: {shlex.join(command(name)[1:])}", flush=True)
    status = subprocess.run(command(name), cwd=ROOT, check=False).returncode
    if status:
      print(f"== {name}: exit status {status}; the queue stops here", flush=True)
      return status
  return 0


if __name__ == "__main__":
  sys.exit(main())
