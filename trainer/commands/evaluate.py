"""`python -m trainer.evaluate`: full-catalog metrics of a trained run.

After training, every user, the whole catalog:

    python -m trainer.evaluate --workdir=W [--split=test|validation] [--step=N]
        [--checkpoint=best|latest]

reads `W/config.json`, rebuilds the model, mesh and data, restores the
params of the best checkpoint (default; the latest, with a notice, when the
run kept no best one), the latest one or step N, and prints the table of
`trainer.evaluate.format_table` and one JSON line `{"workdir", "checkpoint", "step", "metrics":
{split: {...}}}` on stdout (progress on stderr). It uses the run's evaluation
settings (`eval_batch_size`, `eval.filter_seen`, `eval.ks`, `eval.backend`),
so its numbers are the training loop's final ones for the same checkpoint.

The evaluation itself (the step, combining batches, the table) is
:mod:`trainer.evaluate`, which the training loop uses too.
"""

from __future__ import annotations

import functools
import json
import sys

from trainer import data as data_lib
from trainer.data import ids as data_ids
from trainer import evaluate as evaluate_lib
from trainer import train as train_lib
from trainer.commands import cli


def _to_global(batch, *, sharding):
  data_ids.check_int32(batch)  # jit would wrap wider ids (trainer/data/ids.py)
  return data_lib.to_global_arrays(batch, sharding)


def _command(values) -> int:
  from trainer.commands import workdir as workdir_lib  # pylint: disable=import-outside-toplevel
  run = workdir_lib.open_run(values["workdir"], which=values["checkpoint"],
                             step=values.get("step"), say=cli.notice)
  config = run.config
  ks = tuple(config.eval.ks)
  step_fn = evaluate_lib.jit_eval_step(run.graphdef, run.settings, run.param_shardings,
                                       filter_seen=config.eval.filter_seen, ks=ks)
  sharding = train_lib.batch_sharding(run.settings.mesh, run.settings.token_axes)
  results = {}
  for split in ((values["split"],) if values.get("split") else ("validation", "test")):
    batches = evaluate_lib.eval_batches(run.data, split, seq_len=config.seq_len,
                                        global_batch_size=run.batch_size,
                                        filter_seen=config.eval.filter_seen)
    progress = cli.Progress(f"evaluating {split}", len(batches), "batches")
    results[split] = evaluate_lib.evaluate(
        step_fn, run.params, iter(batches),
        functools.partial(_to_global, sharding=sharding), progress=progress)
  print(evaluate_lib.format_table(results, ks))
  print(json.dumps({"workdir": run.workdir, "checkpoint": run.which, "step": run.step,
                    "metrics": results}), flush=True)
  return 0


def main(argv: list[str] | None = None) -> int:
  """`python -m trainer.evaluate` in-process; returns the exit status."""
  return cli.run_command("evaluate", _command, sys.argv if argv is None else argv)


def run() -> None:
  """The console script `cutbce-evaluate`."""
  cli.app_main(main)


if __name__ == "__main__":
  run()
