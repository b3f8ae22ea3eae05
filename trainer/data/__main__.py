"""Prepares a dataset: ``python -m trainer.data --dataset NAME --out DIR``.

Prints one JSON line: ``num_users``, ``num_items``, ``num_interactions``,
``train_interactions``, ``train_examples`` (training windows of
``--seq-len`` inputs), ``validation_examples``, ``test_examples``, and the
dataset and split names. Every flag is checked first against ``FLAG_KEYS``
(a :mod:`trainer.config.schema` description) and ``FLAG_RULES``: a bad one exits
with code 2 and one line ``bad config: --<flag>=<value>: <what is allowed>``;
bad data (a missing column, an unreadable time, ...) exits 2 with one line
``bad data: ...`` naming the file and the column; an ``--out`` folder that
holds files no preparation wrote (a user's own ``items.npy``, notes, another
tool's manifest) is refused with ``bad config: --out=...`` and nothing in it
is changed (a new or empty folder, or an earlier preparation, is written; a
symlink to a folder is followed). Other failures: ``error: ...``.

Examples::

  python -m trainer.data --dataset ml-1m --out /data/ml-1m
  python -m trainer.data --dataset yambda --yambda-path /data/yambda/flat/50m \
      --yambda-event listens --split gts --out /data/yambda-50m
  python -m trainer.data --dataset ciao --path ~/data/ciao/rating_with_timestamp.mat \
      --out /data/ciao
  python -m trainer.data --dataset synthetic --num-users 100000 \
      --num-items 1000000 --interactions-per-user 100 --out /data/syn
  python -m trainer.data --dataset synthetic_topics --num-users 20000 \
      --num-items 100000 --num-topics 1000 --out /data/topics-100k
  python -m trainer.data --dataset files --path 'logs/*.parquet' \
      --user-col uid --item-col item_id --time-col timestamp \
      --filter 'played_ratio_pct>=50' --out /data/mine
  python -m trainer.data --dataset files --path 'gs://bucket/logs/*.parquet' \
      --user-col uid --item-col item_id --time-col timestamp \
      --memory-limit 4GB --num-shards 16 --out gs://bucket/prepared
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys

from trainer.config import schema
from trainer.workdir import paths
from trainer.data import ciao, engine, files, prepare, sources, splits, yambda
from trainer.config.schema import FLOAT, INT, STR, above, at_least, key, one_of, unit

_IDS = schema.Range(1, 2**31 - 1)

# Every flag, by its argparse name: type, allowed values, meaning.
FLAG_KEYS: tuple[schema.Key, ...] = (
    key("dataset", STR, one_of(*sources.SOURCE_NAMES), "source to prepare"),
    key("out", STR, None, "output folder"),
    key("min_item_count", INT, at_least(0), "keep items with >= k interactions", none_ok=True),
    key("min_user_count", INT, at_least(1), "then keep users with >= k interactions"),
    key("split", STR, one_of(*splits.SPLITS), "leave-one-out or global temporal split"),
    key("seq_len", INT, at_least(1), "N, inputs per training window (for the count)"),
    key("test_window", INT, at_least(1), "gts test window (timestamp units)"),
    key("validation_window", INT, at_least(0), "gts validation window"),
    key("gap", INT, at_least(0), "gts gap before each window"),
    key("cache_dir", STR, None, "MovieLens wheel cache", none_ok=True),
    key("yambda_path", STR, None, "folder holding the Yambda parquet files", none_ok=True),
    key("yambda_event", STR, one_of(*yambda.EVENTS), "Yambda event file"),
    key("min_played_ratio", INT, schema.Range(0, 100), "keep listens with played ratio >= %"),
    key("path", STR, None, "files: a file, folder or glob of parquet/CSV/TSV/JSON lines; "
        "ciao: rating_with_timestamp.mat or its folder", none_ok=True),
    key("user_col", STR, None, "files: column of user ids", none_ok=True),
    key("item_col", STR, None, "files: column of item ids", none_ok=True),
    key("time_col", STR, None, "files: column of event times", none_ok=True),
    key("filter", STR, None, "files: keep rows where '<column> <op> <value>' holds",
        none_ok=True),
    key("time_unit", STR, one_of(*files.TIME_UNITS), "files: unit of numeric times"),
    key("num_users", INT, _IDS, "synthetic users"),
    key("num_items", INT, _IDS, "synthetic catalog size"),
    key("interactions_per_user", INT, at_least(1), "synthetic mean sequence length"),
    key("zipf_exponent", FLOAT, above(0), "synthetic Zipf exponent (None: the source's, 1.0 "
        "for synthetic, 0.697 for synthetic_topics)", none_ok=True),
    key("transition_prob", FLOAT, unit(), "synthetic planted-transition probability (None: "
        "the source's, 0.5 for synthetic, 0 for synthetic_topics)", none_ok=True),
    key("seed", INT, at_least(0), "synthetic seed"),
    key("num_topics", INT, at_least(1), "synthetic_topics: latent topics K (<= items)"),
    key("topics_per_user", INT, at_least(1), "synthetic_topics: interest slots per user"),
    key("topic_stay_prob", FLOAT, unit(), "synthetic_topics: probability an event keeps "
        "the previous slot"),
    key("repeat_prob", FLOAT, unit(), "synthetic_topics: probability an event repeats a "
        "recent item (None: the source's, 0 as measured on ML-1M)", none_ok=True),
    key("memory_limit", STR, None, "out-of-core engine's memory limit, e.g. 4GB (None: half "
        "the RAM)", none_ok=True),
    key("num_shards", INT, at_least(1), "event arrays cut by user into this many shard files"),
    key("engine", STR, one_of(*prepare.ENGINES), "auto (duckdb for files and yambda), "
        "memory or duckdb"),
    key("temp_dir", STR, None, "local folder for the engine's spill files (None: the "
        "system's temporary folder)", none_ok=True),
)


def flag_name(path: str) -> str:
  """``min_item_count`` -> ``--min-item-count``."""
  return "--" + path.replace("_", "-")


def _yambda_folder_exists(values, context):
  del context
  if values["dataset"] != "yambda":
    return None
  path = values["yambda_path"]
  if path is None or not os.path.isdir(os.path.expanduser(path)):
    return ("an existing folder holding likes/listens/multi_event.parquet "
            "(required with --dataset yambda)")
  return None


def _files_path_matches(values, context):
  del context
  if values["dataset"] != "files":
    return None
  if values["path"] is None:
    return "a file, folder or glob of data files (required with --dataset files)"
  try:
    files.resolve_files(values["path"])
  except (FileNotFoundError, ValueError) as error:
    return f"a file, folder or glob of data files ({error})"
  return None


def _ciao_file_exists(values, context):
  del context
  if values["dataset"] != "ciao":
    return None
  if values["path"] is None:
    return f"Ciao's {ciao.FILE_NAME} or its folder (required with --dataset ciao)"
  try:
    ciao.resolve_ciao(values["path"])
  except FileNotFoundError as error:
    return f"Ciao's {ciao.FILE_NAME} or its folder ({error})"
  return None


def _files_column_given(flag: str):
  def check_rule(values, context):
    del context
    if values["dataset"] == "files" and not values[flag]:
      return "a column name (required with --dataset files)"
    return None
  return check_rule


def _files_columns_differ(flag: str, others: tuple[str, ...]):
  """`flag` names another column than each of `others` (one column cannot be two fields)."""
  def check_rule(values, context):
    del context
    if values["dataset"] != "files" or not values[flag]:
      return None
    same = [other for other in others if values[other] == values[flag]]
    if same:
      return (f"another column than {flag_name(same[0])} (both name {values[flag]!r}): users, "
              "items and times are three columns")
    return None
  return check_rule


def _files_filter_parses(values, context):
  del context
  if values["dataset"] != "files" or values["filter"] is None:
    return None
  try:
    files.parse_filter(values["filter"])
  except ValueError as error:
    return str(error).removeprefix(f"filter {values['filter']!r}: ")
  return None


def _memory_limit_parses(values, context):
  del context
  if values["memory_limit"] is None:
    return None
  try:
    engine.parse_memory_limit(values["memory_limit"])
  except ValueError as error:
    return str(error).split("; ", 1)[-1] if "below" not in str(error) else "at least 64MiB"
  return None


FLAG_RULES: tuple[schema.Rule, ...] = (
    schema.Rule(name="memory_limit_parses", keys=("memory_limit",),
                check=_memory_limit_parses,
                doc="--memory-limit is a size such as 4GB or 512MiB"),
    schema.Rule(name="yambda_folder_exists", keys=("yambda_path", "dataset"),
                check=_yambda_folder_exists,
                doc="with --dataset yambda, --yambda-path is an existing folder"),
    schema.Rule(name="ciao_file_exists", keys=("path", "dataset"),
                check=_ciao_file_exists,
                doc="with --dataset ciao, --path is its .mat file or a folder holding it"),
    schema.Rule(name="files_path_matches", keys=("path", "dataset"),
                check=_files_path_matches,
                doc="with --dataset files, --path names at least one data file"),
    *(schema.Rule(name=f"files_{flag}_given", keys=(flag, "dataset"),
                  check=_files_column_given(flag),
                  doc=f"with --dataset files, {flag_name(flag)} is given")
      for flag in ("user_col", "item_col", "time_col")),
    schema.Rule(name="files_item_col_differs", keys=("item_col", "user_col", "dataset"),
                check=_files_columns_differ("item_col", ("user_col",)),
                doc="with --dataset files, --item-col is not --user-col"),
    schema.Rule(name="files_time_col_differs", keys=("time_col", "user_col", "item_col", "dataset"),
                check=_files_columns_differ("time_col", ("user_col", "item_col")),
                doc="with --dataset files, --time-col is neither --user-col nor --item-col"),
    schema.Rule(name="files_filter_parses", keys=("filter", "dataset"),
                check=_files_filter_parses,
                doc="with --dataset files, --filter is '<column> <op> <value>'"),
)


class _Parser(argparse.ArgumentParser):
  """Raises ``ConfigError`` (one line, the flags named) instead of printing usage."""

  def error(self, message: str):
    known = ", ".join(flag_name(k.path) for k in FLAG_KEYS)
    prefix = "unrecognized arguments: "
    if message.startswith(prefix):
      raise schema.ConfigError(
          f"{message[len(prefix):]}: unknown flag; the flags are {known}")
    raise schema.ConfigError(f"{message}; see python -m trainer.data --help")


def _parser() -> argparse.ArgumentParser:
  # No `type=`: values arrive as text and `parse_args` types and checks them
  # with FLAG_KEYS, so a bad one is named with what is allowed.
  parser = _Parser(
      allow_abbrev=False,
      prog="python -m trainer.data", description=__doc__.split("\n")[0],
      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  parser.add_argument("--dataset", required=True,
                      help=f"one of {', '.join(sources.SOURCE_NAMES)}")
  parser.add_argument("--out", required=True, help="output folder")
  parser.add_argument("--min-item-count", default=None,
                      help="keep items with >= K interactions (default: 5 for "
                      "MovieLens, 1 for Yambda and files, 0 = whole catalog "
                      "for synthetic)")
  parser.add_argument("--min-user-count", default=1)
  parser.add_argument("--split", default="loo",
                      help=f"one of {', '.join(splits.SPLITS)}")
  parser.add_argument("--seq-len", default=200,
                      help="N, inputs per training window (for the count)")
  group = parser.add_argument_group("out-of-core preparation and shards")
  group.add_argument("--memory-limit", "--memory_limit", dest="memory_limit", default=None,
                     help="the engine's memory limit (4GB, 512MiB); past it it spills to "
                     "--temp-dir (default: half of this machine's RAM)")
  group.add_argument("--num-shards", "--num_shards", dest="num_shards", default=1,
                     help="cut the event arrays by user into this many shard files (a "
                     "multiple of the number of training processes)")
  group.add_argument("--engine", default="auto",
                     help=f"one of {', '.join(prepare.ENGINES)}: auto = duckdb (out of "
                     "core) for files and yambda, memory for the others")
  group.add_argument("--temp-dir", "--temp_dir", dest="temp_dir", default=None,
                     help="local folder for spill files (default: the system's)")
  group = parser.add_argument_group("global temporal split (timestamp units)")
  group.add_argument("--test-window", default=86_400)
  group.add_argument("--validation-window", default=86_400)
  group.add_argument("--gap", default=1_800)
  group = parser.add_argument_group("MovieLens")
  group.add_argument("--cache-dir", default=None,
                     help="wheel cache (default $CUTBCE_DATA or "
                     "~/.cache/cutbce)")
  group = parser.add_argument_group("Yambda")
  group.add_argument("--yambda-path", default=None,
                     help="folder holding the parquet files")
  group.add_argument("--yambda-event", default="listens")
  group.add_argument("--min-played-ratio", default=50)
  group = parser.add_argument_group("your own files (--dataset files) and Ciao")
  group.add_argument("--path", default=None,
                     help="a file, a folder or a glob of parquet, CSV, TSV or "
                     "JSON lines files (quote globs); for --dataset ciao, "
                     f"{ciao.FILE_NAME} or its folder")
  group.add_argument("--user-col", default=None, help="column of user ids")
  group.add_argument("--item-col", default=None, help="column of item ids")
  group.add_argument("--time-col", default=None, help="column of event times")
  group.add_argument("--filter", default=None,
                     help="keep rows where '<column> <op> <value>' holds, op "
                     "one of >= <= > < == !=, e.g. 'played_ratio_pct>=50'")
  group.add_argument("--time-unit", default="s",
                     help=f"one of {', '.join(files.TIME_UNITS)}: what one "
                     "unit of a numeric time is; timestamps (and --test-window "
                     "etc.) are counts of it")
  group = parser.add_argument_group("synthetic")
  group.add_argument("--num-users", default=1_000)
  group.add_argument("--num-items", default=10_000)
  group.add_argument("--interactions-per-user", default=50)
  group.add_argument("--zipf-exponent", default=None,
                      help="None: 1.0 for synthetic, 0.697 (ML-1M's) for synthetic_topics")
  group.add_argument("--transition-prob", default=None,
                      help="None: 0.5 for synthetic, 0 for synthetic_topics")
  group.add_argument("--seed", default=0)
  group = parser.add_argument_group(
      "synthetic_topics (also --num-users, --num-items, --zipf-exponent, --transition-prob, "
      "--seed; history lengths as measured on ML-1M, docs/data.md)")
  group.add_argument("--num-topics", default=1_000)
  group.add_argument("--topics-per-user", default=8)
  group.add_argument("--topic-stay-prob", default=0.8)
  group.add_argument("--repeat-prob", default=None, help="None: 0, as measured on ML-1M")
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
  if args.dataset == "ciao":
    return {"path": args.path}
  if args.dataset == "files":
    return {"path": args.path, "user_col": args.user_col, "item_col": args.item_col,
            "time_col": args.time_col, "filter": args.filter,
            "time_unit": args.time_unit}
  if args.dataset == "synthetic":
    return {"num_users": args.num_users, "num_items": args.num_items,
            "interactions_per_user": args.interactions_per_user,
            "zipf_exponent": 1.0 if args.zipf_exponent is None else args.zipf_exponent,
            "transition_prob": 0.5 if args.transition_prob is None else args.transition_prob,
            "seed": args.seed}
  if args.dataset == "synthetic_topics":
    options = {"num_users": args.num_users, "num_items": args.num_items,
               "num_topics": args.num_topics, "topics_per_user": args.topics_per_user,
               "topic_stay_prob": args.topic_stay_prob, "seed": args.seed,
               "zipf_exponent": args.zipf_exponent, "transition_prob": args.transition_prob,
               "repeat_prob": args.repeat_prob}
    return {name: value for name, value in options.items() if value is not None}
  sources.get_source(args.dataset)  # raises for unknown names
  return {}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
  """Parses and checks the flags.

  Raises:
    schema.ConfigError: a flag's value (or a missing or unknown flag),
      named with what is allowed.
  """
  namespace = _parser().parse_args(argv)
  values = {k.path: schema.from_text(k, getattr(namespace, k.path)) for k in FLAG_KEYS}
  schema.check(values, FLAG_KEYS, FLAG_RULES, name=flag_name)
  return argparse.Namespace(**values)


@contextlib.contextmanager
def _progress_on_stderr():
  """The preparation's progress lines (logger ``trainer.data``, INFO) on stderr, meanwhile."""
  logger = logging.getLogger("trainer.data")
  handler = logging.StreamHandler(sys.stderr)
  handler.setFormatter(logging.Formatter("%(message)s"))
  level, propagate = logger.level, logger.propagate
  logger.addHandler(handler)
  logger.setLevel(logging.INFO)
  logger.propagate = False  # once, whatever handlers the root logger has
  try:
    yield
  finally:
    logger.removeHandler(handler)
    logger.setLevel(level)
    logger.propagate = propagate


def main(argv: list[str] | None = None) -> int:
  try:
    args = parse_args(argv)
  except schema.ConfigError as error:
    print(f"bad config: {error}", file=sys.stderr)
    return 2
  try:
    split_options = {}
    if args.split == "gts":
      split_options = {"test_window": args.test_window,
                       "validation_window": args.validation_window,
                       "gap": args.gap}
    with _progress_on_stderr():
      manifest = prepare.prepare_dataset(
          args.dataset, args.out, min_item_count=args.min_item_count,
          min_user_count=args.min_user_count, split=args.split,
          split_options=split_options, source_options=source_options(args),
          seq_lens=(args.seq_len,), num_shards=args.num_shards, engine=args.engine,
          memory_limit=args.memory_limit, temp_dir=args.temp_dir)
  except (schema.ConfigError, paths.WorkdirError) as error:
    # an --out folder holding files of another writer; a gs:// path without gcsfs
    print(f"bad config: {error}", file=sys.stderr)
    return 2
  except sources.DataError as error:  # the raw data: a missing column, an empty table, ...
    message = str(error).replace("\n", " ")  # one line, whatever pyarrow said
    print(f"bad data: {message}", file=sys.stderr)
    return 2
  except (ValueError, TypeError, OSError, RuntimeError) as error:
    message = str(error).replace("\n", " ")  # one line, whatever pyarrow said
    print(f"error: {message}", file=sys.stderr)
    return 2
  print(json.dumps(prepare.summarize(manifest, args.seq_len)), flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
