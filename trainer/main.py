"""Command line: `python -m trainer.main --config=configs/X.py --workdir=DIR`.

Override any config field with `--config.key=value` (for example
`--config.train_steps=100 --config.mesh.shape='(2,4)'`). On several hosts (or
several local processes) pass the coordinator flags, or nothing on Cloud TPU
where `jax.distributed.initialize()` finds the slice by itself.

Every config value is checked (`trainer/config/keys.py`) before data is
prepared or anything traced; a bad one stops the run with exit status 2 and
one line `bad config: config.<key>=<value>: <what is allowed>`.

The config is written to `WORKDIR/config.json` at start. A restart in a
workdir with checkpoints resumes; when its config differs from that file in
keys that would change the run (batch size, process count, data options,
`seq_len`, model shape, ...) it stops with one `bad config:` line listing
them (exit 2), unless `--allow_config_change` is given; logging and
evaluation keys may change freely (`trainer/config/saved.py`).
"""

from __future__ import annotations

import errno
import sys

from absl import app, flags, logging
from ml_collections import config_flags

from trainer import libtpu_env
from trainer.commands import cli

_CONFIG = config_flags.DEFINE_config_file("config", None, "Trainer config file.",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints and logs.")
_COORDINATOR = flags.DEFINE_string(
    "coordinator_address", None, "host:port of process 0, for multi-process runs.")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Processes in the run.")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's index.")
_DISTRIBUTED = flags.DEFINE_bool(
    "distributed", False,
    "Call jax.distributed.initialize() with no arguments (Cloud TPU slices).")
_ALLOW_CONFIG_CHANGE = flags.DEFINE_bool(
    "allow_config_change", False,
    "Resume even when the config differs from WORKDIR/config.json in keys that change "
    "the run (batch size, data, model shape, ...).")
flags.mark_flags_as_required(["config", "workdir"])


_bad_config = cli.bad_config
parse_flags = cli.parse_config_flags


def check_or_exit(config, workdir: str | None) -> None:
  """`config_mesh.check_config`; a problem exits with status 2 and one `bad config:` line."""
  from trainer.config import mesh as config_mesh, schema  # pylint: disable=import-outside-toplevel
  try:
    config_mesh.check_config(config, workdir=workdir)
  except schema.ConfigError as error:
    _bad_config(error)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if not flags.FLAGS["verbosity"].present:
    # Progress goes to stdout; keep the libraries' INFO lines off stderr.
    logging.set_verbosity(logging.WARNING)
  cli.end_on_thread_failure()  # a worker thread's failure ends the run, never a hang
  import jax  # pylint: disable=import-outside-toplevel
  if _COORDINATOR.value is not None:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=_COORDINATOR.value,
                               num_processes=_NUM_PROCESSES.value,
                               process_id=_PROCESS_ID.value)
  elif _DISTRIBUTED.value:
    jax.distributed.initialize()
  from trainer import loop  # pylint: disable=import-outside-toplevel
  from trainer.workdir import checkpoint, lock as workdir_lock  # pylint: disable=import-outside-toplevel
  from trainer.config import mesh as config_mesh, schema  # pylint: disable=import-outside-toplevel
  from trainer.data import movielens, sources  # pylint: disable=import-outside-toplevel
  # Every value, before data preparation and before any trace.
  check_or_exit(_CONFIG.value, _WORKDIR.value)
  try:
    loop.train_and_evaluate(_CONFIG.value, _WORKDIR.value,
                            allow_config_change=_ALLOW_CONFIG_CHANGE.value)
  except schema.ConfigError as error:
    _bad_config(error)
  except checkpoint.DiskFullError as error:
    print(f"disk full: {error}", file=sys.stderr)
    sys.exit(1)
  except checkpoint.CheckpointError as error:
    print(f"checkpoint unreadable: {error}", file=sys.stderr)
    sys.exit(2)
  except workdir_lock.WorkdirError as error:
    # A workdir that is a file, not writable, held by a live trainer, or one of
    # whose files (config.json, metrics.jsonl, ...) is a folder or damaged.
    print(f"bad workdir: {error}", file=sys.stderr)
    sys.exit(2)
  except (movielens.RegistryUnavailableError, FileNotFoundError) as error:
    # The dataset cannot be had (no registry and no cache, or missing files):
    # one line naming what is missing, not a traceback.
    print(f"data unavailable: {error}", file=sys.stderr)
    sys.exit(2)
  except sources.DataError as error:
    # Raw data that cannot be read (a missing column, an empty table, a bad
    # time) or prepared data with no training window or no evaluation user
    # (trainer/data/checks.py): one line naming the file and what is missing.
    print(f"bad data: {error}", file=sys.stderr)
    sys.exit(2)
  except loop.NonFiniteLossError as error:
    logging.error("%s", error)
    print(str(error), file=sys.stderr)
    sys.exit(3)
  except OSError as error:
    if error.errno != errno.ENOSPC:
      raise
    # Another file than a checkpoint (metrics, config, prepared data): the cause, in one line.
    print(f"disk full: {error}", file=sys.stderr)
    sys.exit(1)


def run() -> None:
  """The console script `cutbce-train`."""
  libtpu_env.quiet_probe_without_tpu()  # before jax starts a backend
  app.run(main, flags_parser=parse_flags)


if __name__ == "__main__":
  run()
