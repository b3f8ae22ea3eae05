"""Top-K recommendations per user from a trained run: `python -m trainer.recommend`.

    python -m trainer.recommend --workdir=W --top_k=K --out=F [--users=FILE]
        [--include_seen] [--checkpoint=best|latest] [--step=N] [--batch_size=B]

For each user (every user of the run's data, or the raw ids listed in FILE,
one per line, in that order, each exactly as written: nothing is stripped,
so an id with spaces is written with them on its line; empty lines are
skipped) the model reads the last `seq_len` items of the
user's whole history (every split: what is known now) and the hidden state
of the last position is scored against the whole item table with
`cutbce.sharding.sharded_top_k` over the run's mesh, as training shards it
(no `[B, V]` scores, table rows split over the vocab axis, padded rows never
returned: `num_items` is passed). Items of the user's history are excluded
unless `--include_seen`. The output file holds one JSON line per user,

    {"user": <raw user id>, "items": [<raw item id>, ...], "scores": [...]}

items by descending score (ties to the smaller dense id), ids as in the raw
data (integers, or strings for string-id sources). A score that is not a
finite number (a diverged model's NaN, ranked as -inf by `cutbce.top_k`) is
written as null, its item after every item with a finite score, and the
command ends with a warning line counting the users concerned. Users go in batches of
`--batch_size` (default the run's `eval_batch_size`; never more than the
users, rounded up to the token shards; a batch whose forward step is over
the int32 or memory bound of `trainer/config/budget.py` is refused in one
line), with progress lines on stderr. `--out` is a new path or a regular
file, replaced whole (`trainer/workdir/outputs.py`): a device, FIFO,
socket, symlink or a file of the run (its config.json, checkpoints, data,
...) is refused in one line before any work. A user id of FILE that is not in the data stops the command (exit 2,
one line naming the unknown ids) before anything is computed or written.

The exclude list of a batch is as wide as the longest distinct history in it
(rounded up to a power of two, so few widths are compiled); the running top-k
keeps k + that many candidates per user.
"""

from __future__ import annotations

import functools
import json
import os
import re
import sys
from collections.abc import Sequence

import jax
import numpy as np
from etils import epath
from flax import nnx

from cutbce import sharding as cutbce_sharding
from trainer import data as data_lib
from trainer.commands import cli
from trainer import train as train_lib
from trainer.config import budget
from trainer.data import ids as data_ids
from trainer.config.schema import ConfigError
from trainer.workdir import outputs

_MIN_EXCLUDE = 8
_DECIMAL = re.compile(r"-?[0-9]+")


def read_user_ids(path: str) -> list[str]:
  """The ids of `path`, one per line, exactly as written.

  Lines end at "\n" (a "\r\n" ending counts as one); nothing else is
  removed, so an id with leading, trailing or inner spaces (or tabs) is
  written as is on its line, and "x " names another user than "x". Empty
  lines are skipped. (An id holding a newline cannot be listed.)
  """
  text = epath.Path(path).read_bytes().decode("utf-8", errors="surrogateescape")
  lines = [line[:-1] if line.endswith("\r") else line for line in text.split("\n")]
  return [line for line in lines if line]


def dense_users(user_ids: np.ndarray, raw: Sequence[str], source: str) -> np.ndarray:
  """Dense user indices of raw ids given as text.

  Args:
    user_ids: the data's raw id of each dense user (int64, or a `<U` string array).
    raw: raw ids as text (one per line of the users file).
    source: the file, named in the error.

  Returns:
    int64 `[len(raw)]`.

  Raises:
    ConfigError: ids not in the data, named (the first 10).
  """
  lookup = {value: index for index, value in enumerate(user_ids.tolist())}
  integer = np.issubdtype(user_ids.dtype, np.integer)
  dense, unknown = [], []
  for text in raw:
    # An integer id only in its plain decimal form: int(" 7") would strip.
    value = (int(text) if _DECIMAL.fullmatch(text) else None) if integer else text
    if value not in lookup:
      unknown.append(text)
    else:
      dense.append(lookup[value])
  if unknown:
    shown = ", ".join(repr(text) for text in unknown[:10])
    more = f" and {len(unknown) - 10} more" if len(unknown) > 10 else ""
    raise ConfigError(f"--users={source!r}: ids of users of the run's data; {len(unknown)} "
                      f"are not: {shown}{more}")
  return np.asarray(dense, np.int64)


def history_batch(data: data_lib.PreparedDataset, users: np.ndarray, *, seq_len: int,
                  exclude_width: int | None) -> dict[str, np.ndarray]:
  """Inputs (and the seen items) of a batch of users, from their whole history.

  Returns:
    "inputs" int32 `[B, N]`: the last N items, left-padded with V; and, when
    `exclude_width` is given, "exclude" int32 `[B, E]`: each user's distinct
    items, padded with -1.
  """
  num_items = data.num_items
  inputs = np.full((users.shape[0], seq_len), num_items, np.int32)
  exclude = None if exclude_width is None else np.full((users.shape[0], exclude_width), -1,
                                                       np.int32)
  for row, user in enumerate(users):
    history = np.asarray(data.items[data.offsets[user]:data.offsets[user + 1]])
    last = history[-seq_len:]
    inputs[row, seq_len - last.shape[0]:] = last
    if exclude is not None:
      seen = np.unique(history)
      exclude[row, :seen.shape[0]] = seen
  return {"inputs": inputs, "exclude": exclude} if exclude is not None else {"inputs": inputs}


def exclude_width(data: data_lib.PreparedDataset, users: np.ndarray, k: int) -> int:
  """E of a batch: its longest distinct history, rounded up to a power of two.

  Raises:
    ConfigError: a user has seen more than `num_items - k` items (fewer than
      k unseen items remain).
  """
  longest = max(np.unique(data.items[data.offsets[u]:data.offsets[u + 1]]).shape[0]
                for u in users)
  if longest > data.num_items - k:
    raise ConfigError(f"--top_k={k}: at most {data.num_items - longest}, the unseen items of "
                      "a user of this batch (or pass --include_seen)")
  width = max(_MIN_EXCLUDE, 1 << (longest - 1).bit_length())
  return min(width, data.num_items - k)


def top_k_step(params, batch, *, graphdef, settings: train_lib.StepSettings, k: int):
  """Scores `[B, k]` and dense ids `[B, k]` of the best unseen items of a batch."""
  model = nnx.merge(graphdef, params)
  hidden = model(batch["inputs"], deterministic=True)[:, -1, :]  # [B, D]
  return cutbce_sharding.sharded_top_k(
      hidden, model.item_table, k, mesh=settings.mesh, token_axes=settings.token_axes,
      vocab_axis=settings.vocab_axis, bias=model.output_bias, exclude=batch.get("exclude"),
      num_items=settings.num_items, backend=settings.backend)


def recommend(run, users: np.ndarray, *, k: int, include_seen: bool, batch_size: int,
              write, progress=None) -> int:
  """Writes `write(record)` for each user in order (see the module docstring).

  A score that is not finite (a diverged model's NaN, which `cutbce.top_k`
  counts as -inf, or an infinite bias) is written as null; such items come
  after every item with a finite score.

  Args:
    run: a `trainer.commands.workdir.TrainedRun`.
    users: dense user indices.
    k: items per user.
    include_seen: keep the user's history among the candidates.
    batch_size: users per step, a multiple of the token shards.
    write: called with each user's dict.
    progress: called with the number of users done after each batch.

  Returns:
    The number of users with a score that is not finite.
  """
  data, settings = run.data, run.settings
  non_finite = 0
  sharding = train_lib.batch_sharding(settings.mesh, settings.token_axes)
  step = jax.jit(functools.partial(top_k_step, graphdef=run.graphdef, settings=settings, k=k),
                 in_shardings=(run.param_shardings, sharding), out_shardings=(sharding, sharding))
  for start in range(0, users.shape[0], batch_size):
    chunk = users[start:start + batch_size]
    # Fill the last batch with copies of its first user; their rows are dropped.
    padded = np.concatenate([chunk, np.full(batch_size - chunk.shape[0], chunk[0])])
    width = None if include_seen else exclude_width(data, chunk, k)
    batch = history_batch(data, padded, seq_len=run.config.seq_len, exclude_width=width)
    data_ids.check_int32(batch)  # jit would wrap wider ids (trainer/data/ids.py)
    scores, ids = jax.device_get(step(run.params, data_lib.to_global_arrays(batch, sharding)))
    raw_users = data.user_ids[chunk].tolist()
    raw_items = data.item_ids[ids[:chunk.shape[0]]].tolist()
    finite = np.isfinite(scores[:chunk.shape[0]])  # [b, k]
    non_finite += int(np.sum(~finite.all(axis=1)))
    for row, user in enumerate(raw_users):
      write({"user": user, "items": raw_items[row],
             "scores": [float(score) if ok else None
                        for score, ok in zip(scores[row], finite[row])]})
    if progress is not None:
      progress(start + chunk.shape[0])
  return non_finite


def _batch_size(run, requested: int | None, *, num_users: int) -> int:
  """Users per step: `requested` (None: the run's), rounded up to the token shards,
  no more than the users (rounded up the same way), and within what fits.

  Raises:
    ConfigError: `--batch_size` (or the run's evaluation batch) is over the
      int32 or memory bound of the forward step (`trainer/config/budget.py`).
  """
  unit = _token_shards(run.settings)
  batch_size = run.batch_size if requested is None else -(-requested // unit) * unit
  batch_size = min(batch_size, max(unit, -(-num_users // unit) * unit))
  found = budget.check_sizes(
      budget.Model.of_config(run.config.model),
      sizes={"batch": batch_size, "seq_len": run.config.seq_len}, blame=("batch",), targets=1,
      shards=unit, local_devices=jax.local_device_count(), memory=budget.memory_bytes(),
      training=False)
  if found is not None:
    shown = run.batch_size if requested is None else requested
    raise ConfigError(f"--batch_size={shown}: {found[1]}")
  return batch_size


def _command(values) -> int:
  from trainer.commands import workdir as workdir_lib  # pylint: disable=import-outside-toplevel
  # A folder, device, FIFO, symlink, a file of the run or an unwritable place: one line, no work.
  cli.check_out_file(values["out"], protected=outputs.run_paths(values["workdir"]))
  run = workdir_lib.open_run(values["workdir"], which=values["checkpoint"],
                             step=values.get("step"), say=cli.notice)
  cli.check_out_file(values["out"], protected=outputs.run_paths(run.workdir, run.data_dir))
  data, k = run.data, values["top_k"]
  if k > data.num_items:
    raise ConfigError(f"--top_k={k}: at most the {data.num_items} items of the run's data")
  if values.get("users") is None:
    users = np.arange(data.num_users, dtype=np.int64)
  else:
    users = dense_users(data.user_ids, read_user_ids(values["users"]), values["users"])
  batch_size = _batch_size(run, values.get("batch_size"), num_users=int(users.shape[0]))
  out = epath.Path(values["out"])
  out.parent.mkdir(parents=True, exist_ok=True)
  progress = cli.Progress("recommending", int(users.shape[0]), "users")
  # Written beside `out`, then renamed onto it: a stopped command leaves the
  # previous file (or none) whole, never a partial one.
  temporary = out.parent / f".{out.name}.tmp-{os.getpid()}"
  try:
    with temporary.open("w") as file:
      non_finite = recommend(
          run, users, k=k, include_seen=values["include_seen"], batch_size=batch_size,
          write=lambda record: file.write(json.dumps(record, allow_nan=False) + "\n"),
          progress=progress)
    temporary.replace(out)
  finally:
    if temporary.exists():
      temporary.unlink()
  cli.notice(f"wrote {users.shape[0]:,} users' top {k} to {out}")
  if non_finite:
    cli.notice(f"warning: the model's scores are not finite for {non_finite:,} of "
               f"{users.shape[0]:,} users (NaN: a diverged model or NaN table rows; or an "
               "infinite bias): those items are listed last with score null; check the "
               f"checkpoint of step {run.step}")
  return 0


def _token_shards(settings: train_lib.StepSettings) -> int:
  sizes = dict(settings.mesh.shape)
  return int(np.prod([sizes[axis] for axis in settings.token_axes]))


def main(argv: list[str] | None = None) -> int:
  """`python -m trainer.recommend` in-process; returns the exit status."""
  return cli.run_command("recommend", _command, sys.argv if argv is None else argv)


def run() -> None:
  """The console script `cutbce-recommend`."""
  cli.app_main(main)


if __name__ == "__main__":
  run()
