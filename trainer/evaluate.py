"""Full-catalog evaluation: ranks of held-out items among all V items.

For each evaluation user the model reads the last N history items; the hidden
state at the last position `[B, D]` is scored against the whole item table by
`cutbce.sharding.sharded_target_ranks` (one tiled pass, no `[B, V]` logits, no
top-k). With `filter_seen` the user's history is passed as `exclude`, so seen
items are neither ranked nor counted above a target (the filter-seen protocol
of SASRec-style evaluations); targets that are also in the history stay
targets. `cutbce.rank_metrics` turns ranks into recall/ndcg/hit@k and mrr.

Batch results are combined exactly: every metric is an average over users
with a target, so the per-batch averages are weighted by their user counts.

The command line (`python -m trainer.evaluate`) is
:mod:`trainer.commands.evaluate`.
"""

from __future__ import annotations

import collections
import functools
from typing import Callable, Iterable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

import cutbce
from cutbce import sharding as cutbce_sharding
from trainer import data as data_lib
from trainer import train as train_lib


def eval_step(params, batch, *, graphdef, settings: train_lib.StepSettings, filter_seen: bool,
              ks: tuple[int, ...]):
  """Metrics of one global batch: `rank_metrics` of the last-position ranks."""
  model = nnx.merge(graphdef, params)
  hidden = model(batch["inputs"], deterministic=True)[:, -1, :]  # [B, D]
  table = model.item_table  # [V_padded, D]: rows past num_items are never ranked
  targets = jnp.where(batch["weights"][:, None] > 0, batch["targets"], -1)  # [B, L]
  exclude = batch["exclude"] if filter_seen else None  # [B, E]
  ranks = cutbce_sharding.sharded_target_ranks(
      hidden, table, targets, mesh=settings.mesh, token_axes=settings.token_axes,
      vocab_axis=settings.vocab_axis, bias=model.output_bias, exclude=exclude,
      backend=settings.backend, num_items=settings.num_items,
  )
  return cutbce.rank_metrics(ranks, ks=ks)


def jit_eval_step(graphdef, settings: train_lib.StepSettings, param_shardings, *,
                  filter_seen: bool, ks: tuple[int, ...]) -> Callable:
  step = functools.partial(eval_step, graphdef=graphdef, settings=settings,
                           filter_seen=filter_seen, ks=tuple(ks))
  return jax.jit(
      step,
      in_shardings=(param_shardings, train_lib.batch_sharding(settings.mesh, settings.token_axes)),
      out_shardings=NamedSharding(settings.mesh, P()),
  )


class _Totals:
  """Running sums of per-batch `rank_metrics`, each weighted by its `num_rows`."""

  def __init__(self):
    self.sums: dict[str, float] = {}
    self.rows = 0.0

  def add(self, metrics: dict) -> None:
    """Adds one batch's metrics (waits for them if still on the device)."""
    metrics = jax.device_get(metrics)
    count = float(metrics["num_rows"])
    self.rows += count
    for name, value in metrics.items():
      if name != "num_rows":
        self.sums[name] = self.sums.get(name, 0.0) + float(value) * count

  def result(self) -> dict[str, float]:
    result = {name: (total / self.rows if self.rows else 0.0)
              for name, total in self.sums.items()}
    result["num_users"] = self.rows
    return result


def combine(batch_metrics: Iterable[dict]) -> dict[str, float]:
  """Averages per-batch `rank_metrics` weighted by their `num_rows`."""
  totals = _Totals()
  for metrics in batch_metrics:
    totals.add(metrics)
  return totals.result()


# Evaluation steps queued on the devices at most. Each step of a sharded run
# holds collectives (the psum of the ranks over the vocab axis); hundreds of
# them queued at once on a loaded machine let XLA's CPU rendezvous time out
# ("only 6 of 8 arrived") and abort the process (issue 41). Two keep the
# devices busy while the host prepares the next batch.
MAX_IN_FLIGHT = 2


def evaluate(step_fn: Callable, params, batches: Iterable[dict], to_global: Callable,
             max_batches: int | None = None,
             progress: Callable[[int], None] | None = None,
             in_flight: int = MAX_IN_FLIGHT) -> dict[str, float]:
  """Runs `step_fn` over the (per-process) batches and combines the metrics.

  At most `in_flight` steps are queued on the devices: before queuing
  another, the host waits for the oldest and adds its metrics, so a run of
  many small batches never piles up collectives (`MAX_IN_FLIGHT`).

  Args:
    step_fn: from `jit_eval_step`.
    params: the train state's params.
    batches: per-process numpy batches of `trainer.data.eval_dataset`.
    to_global: per-process batch -> dict of global arrays.
    max_batches: stop after this many batches (None = all).
    progress: called with the number of batches done after each one.
    in_flight: steps queued on the devices at most (>= 1).

  Returns:
    dict: "recall@k", "ndcg@k", "hit@k" per k, "mrr", and "num_users".
  """
  totals, pending = _Totals(), collections.deque()
  for index, batch in enumerate(batches):
    if max_batches is not None and index >= max_batches:
      break
    batch = {key: batch[key] for key in ("inputs", "targets", "exclude", "weights")}
    batch = to_global(batch)  # made while the queued steps run
    while len(pending) >= max(in_flight, 1):  # wait for the oldest before queuing another
      totals.add(pending.popleft())
    pending.append(step_fn(params, batch))
    if progress is not None:
      progress(index + 1)
  while pending:
    totals.add(pending.popleft())
  return totals.result()


def eval_batches(data, split: str, *, seq_len: int, global_batch_size: int,
                 filter_seen: bool):
  """This process's batches of `split` (a finite `grain.MapDataset`, `len` batches).

  With `filter_seen` the whole history is the exclude list; without, a
  1-wide placeholder (the step then passes no exclude).
  """
  return data_lib.eval_dataset(
      data, split, seq_len=seq_len, batch_size=global_batch_size // jax.process_count(),
      max_exclude=None if filter_seen else 1)


def format_table(metrics_by_split: dict[str, dict[str, float]], ks=(10, 50, 100)) -> str:
  """A fixed-width table: one row per split, recall/ndcg/hit@k and mrr columns."""
  names = [f"{m}@{k}" for m in ("recall", "ndcg", "hit") for k in ks] + ["mrr"]
  width = max(len(n) for n in names) + 1
  first = max([11] + [len(split) + 1 for split in metrics_by_split])
  lines = ["split".ljust(first) + "users".rjust(7) + "".join(n.rjust(width) for n in names)]
  for split, metrics in metrics_by_split.items():
    row = split.ljust(first) + f"{int(metrics.get('num_users', 0)):7d}"
    row += "".join(f"{metrics.get(n, float('nan')):{width}.4f}" for n in names)
    lines.append(row)
  return "\n".join(lines)


if __name__ == "__main__":  # python -m trainer.evaluate: the command, under its old name
  import runpy  # pylint: disable=g-import-not-at-top
  runpy.run_module("trainer.commands.evaluate", run_name="__main__", alter_sys=True)
