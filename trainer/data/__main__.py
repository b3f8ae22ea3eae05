"""Prepares a dataset: ``python -m trainer.data --dataset NAME --out DIR``.

Prints one JSON line: ``num_users``, ``num_items``, ``num_interactions``,
``train_interactions``, ``train_examples`` (training windows of
``--seq-len`` inputs), ``validation_examples``, ``test_examples``, and the
dataset and split names. Exit code 2 with a message on stderr for bad input.

Examples::

  python -m trainer.data --dataset ml-1m --out /data/ml-1m
  python -m trainer.data --dataset yambda --yambda-path /data/yambda/flat/50m \
      --yambda-event listens --split gts --out /data/yambda-50m
  python -m trainer.data --dataset synthetic --num-users 100000 \
      --num-items 1000000 --interactions-per-user 100 --out /data/syn
"""

from __future__ import annotations

import argparse
import json
import sys

from trainer.data import prepare, sources, splits


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
      prog="python -m trainer.data", description=__doc__.split("\n")[0],
      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  parser.add_argument("--dataset", required=True,
                      help=f"one of {', '.join(sources.SOURCE_NAMES)}")
  parser.add_argument("--out", required=True, help="output folder")
  parser.add_argument("--min-item-count", type=int, default=None,
                      help="keep items with >= K interactions (default: 5 for "
                      "MovieLens, 1 for Yambda, 0 = whole catalog for "
                      "synthetic)")
  parser.add_argument("--min-user-count", type=int, default=1)
  parser.add_argument("--split", default="loo",
                      help=f"one of {', '.join(splits.SPLITS)}")
  parser.add_argument("--seq-len", type=int, default=200,
                      help="N, inputs per training window (for the count)")
  group = parser.add_argument_group("global temporal split (timestamp units)")
  group.add_argument("--test-window", type=int, default=86_400)
  group.add_argument("--validation-window", type=int, default=86_400)
  group.add_argument("--gap", type=int, default=1_800)
  group = parser.add_argument_group("MovieLens")
  group.add_argument("--cache-dir", default=None,
                     help="wheel cache (default $CUTBCE_DATA or "
                     "~/.cache/cutbce)")
  group = parser.add_argument_group("Yambda")
  group.add_argument("--yambda-path", default=None,
                     help="folder holding the parquet files")
  group.add_argument("--yambda-event", default="listens")
  group.add_argument("--min-played-ratio", type=int, default=50)
  group = parser.add_argument_group("synthetic")
  group.add_argument("--num-users", type=int, default=1_000)
  group.add_argument("--num-items", type=int, default=10_000)
  group.add_argument("--interactions-per-user", type=int, default=50)
  group.add_argument("--zipf-exponent", type=float, default=1.0)
  group.add_argument("--transition-prob", type=float, default=0.5)
  group.add_argument("--seed", type=int, default=0)
  return parser


def source_options(args: argparse.Namespace) -> dict:
  """The loader options of ``args.dataset`` from the parsed flags."""
  if args.dataset in ("ml-1m", "ml-100k"):
    return {"cache_dir": args.cache_dir}
  if args.dataset == "yambda":
    if args.yambda_path is None:
      raise ValueError("--dataset yambda needs --yambda-path, the folder "
                       "holding likes/listens/multi_event.parquet")
    return {"path": args.yambda_path, "event": args.yambda_event,
            "min_played_ratio": args.min_played_ratio}
  if args.dataset == "synthetic":
    return {"num_users": args.num_users, "num_items": args.num_items,
            "interactions_per_user": args.interactions_per_user,
            "zipf_exponent": args.zipf_exponent,
            "transition_prob": args.transition_prob, "seed": args.seed}
  sources.get_source(args.dataset)  # raises for unknown names
  return {}


def main(argv: list[str] | None = None) -> int:
  args = _parser().parse_args(argv)
  try:
    split_options = {}
    if args.split == "gts":
      split_options = {"test_window": args.test_window,
                       "validation_window": args.validation_window,
                       "gap": args.gap}
    manifest = prepare.prepare_dataset(
        args.dataset, args.out, min_item_count=args.min_item_count,
        min_user_count=args.min_user_count, split=args.split,
        split_options=split_options, source_options=source_options(args),
        seq_lens=(args.seq_len,))
  except (ValueError, TypeError, FileNotFoundError, RuntimeError) as error:
    print(f"error: {error}", file=sys.stderr)
    return 2
  print(json.dumps(prepare.summarize(manifest, args.seq_len)), flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
