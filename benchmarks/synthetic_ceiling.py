"""Generation speed and Bayes ceiling of the topic generator at V = 10^5 and 10^6.

For each config (the `data.source_options` of configs/synthetic_100k.py and
configs/synthetic_1m_topics.py): generates the data (timed, one process),
then on the first `--users` users prints the expected test NDCG@10 of
ranking by the true next-item law given the latent state (the ceiling no
model beats in expectation) and of popularity by training counts, both under
the trainer's protocol (leave-one-out, history excluded, ties against the
target); see `trainer/data/synthetic_ceiling.py`. Writes
docs/results/synthetic_ceiling.json.

  .venv/bin/python benchmarks/synthetic_ceiling.py
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # configs/, trainer/

from trainer.data import synthetic_ceiling, synthetic_topics  # pylint: disable=wrong-import-position

CONFIGS = ("configs.synthetic_100k", "configs.synthetic_1m_topics")


def measure(config_module: str, num_users: int) -> dict:
  """Generation time and ceiling of one config's source options."""
  options = dict(importlib.import_module(config_module).get_config().data.source_options)
  start = time.perf_counter()
  data = synthetic_topics.generate_topics(**options)
  seconds = time.perf_counter() - start
  start = time.perf_counter()
  ceiling = synthetic_ceiling.bayes_ceiling(options, num_users=num_users, data=data)
  return {"config": config_module.replace(".", "/") + ".py", "source_options": options,
          "interactions": len(data), "generate_seconds": round(seconds, 2),
          "ceiling_seconds": round(time.perf_counter() - start, 2),
          **{k: (round(v, 4) if isinstance(v, float) else v) for k, v in ceiling.items()}}


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--users", type=int, default=2_000, help="users the ceiling averages")
  parser.add_argument("--out", default=os.path.join("docs", "results", "synthetic_ceiling.json"))
  args = parser.parse_args(argv)
  rows = [measure(config, args.users) for config in CONFIGS]
  print(f"{'config':34s} {'V':>10s} {'events':>11s} {'gen s':>6s} {'users':>6s} "
        f"{'ceiling':>8s} {'realized':>8s} {'popular':>8s} {'realized':>8s}  (NDCG@10)")
  for row in rows:
    print(f"{row['config']:34s} {row['source_options']['num_items']:>10,} "
          f"{row['interactions']:>11,} {row['generate_seconds']:>6.2f} {row['users']:>6} "
          f"{row['ceiling_ndcg@10']:>8.4f} {row['ceiling_ndcg@10_realized']:>8.4f} "
          f"{row['popularity_ndcg@10']:>8.4f} {row['popularity_ndcg@10_realized']:>8.4f}")
  with open(args.out, "w", encoding="utf-8") as file:
    json.dump({"command": "python benchmarks/synthetic_ceiling.py", "rows": rows}, file, indent=2)
    file.write("\n")
  print(f"wrote {args.out}")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
