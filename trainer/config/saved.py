"""The run's config in its workdir: `WORKDIR/config.json`, and what a resume may change.

`trainer.main` writes the config it runs with to `WORKDIR/config.json` at start
(process 0), as

    {"format": "cutbce-run-config", "version": 1, "process_count": P,
     "config": {<the ConfigDict as nested JSON, tuples as lists>}}

The commands after training (`trainer.evaluate`, `trainer.recommend`,
`trainer.export`) rebuild the model, mesh and data from it (`read`).

A run that resumes from a checkpoint compares its config with the saved one
(`check_resume`). Keys that only change how the run is watched, logged,
evaluated or read (`is_harmless`) may change freely: a notice lists them.
Every other difference would silently make the resumed run a different run
(batch size, process count, data options, `seq_len`, model shape, optimizer,
seed, `train_steps` under the cosine schedule, ...), so it is refused with
one line that lists the differing keys, unless `allow_change` (the
`--allow_config_change` flag of `trainer.main`) is given. After a resume the
file holds the config now in force.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

import ml_collections
from etils import epath

from trainer.workdir import paths
from trainer.config import keys as config_keys, schema

CONFIG_FILE = "config.json"
FORMAT = "cutbce-run-config"
VERSION = 1
PROCESS_COUNT = "process_count"  # the pseudo key of the process count in a diff

# Keys that may change between a run and its resume without changing what it
# trains: logging, evaluation, checkpoint cadence, profiling, read threads,
# where the prepared data lives and who prepares it (the data options are
# checked against the folder's manifest and preparation is deterministic, so
# any folder holds the same data) and the loss backend (the same numbers
# within float rounding).
HARMLESS_KEYS = frozenset({
    "log_every", "eval_every", "eval_batch_size", "checkpoint_every", "max_checkpoints",
    "data.num_threads", "data.prefetch_buffer_size", "data.prepared_dir",
    "data.prepare_per_host", "loss.backend"})
HARMLESS_SECTIONS = ("eval.", "checkpoint.", "profile.", "compile.")
# Keys added after runs could already be saved, with the value that a run saved
# without them trained with: `read` and `check_resume` fill them in, so such a
# run resumes (and is read by the commands) as it was.
ADDED_KEYS = {"loss.target_reduction": "sum", "loss.num_negatives": 128,
              "loss.sampler": "uniform", "loss.negatives_per": "batch", "loss.logq": False,
              "loss.gbce_t": 0.75, "model.block": "pre_ln", "model.positions": "window",
              "model.init": "flax", "model.embedding_std": None,
              "model.scale_embeddings": True,
              "model.output_table": "tied"}
_ABSENT = "(absent)"
_SECTIONS = schema.sections_of(config_keys.KEYS)


def path(workdir: str | os.PathLike) -> epath.Path:
  """`WORKDIR/config.json` (local, or `gs://...`: written and read through `etils.epath`)."""
  return paths.as_path(workdir) / CONFIG_FILE


def flat_values(config) -> dict[str, Any]:
  """`{dotted key: JSON value}` of a ConfigDict (or nested mapping); tuples become lists."""
  tree = config.to_dict() if hasattr(config, "to_dict") else dict(config)
  tree = json.loads(json.dumps(tree))
  return schema.flatten(tree, _SECTIONS)


def write(workdir: str | os.PathLike, config, *, process_count: int) -> None:
  """Writes `config` (and the process count) to `WORKDIR/config.json`, atomically."""
  target = path(workdir)
  target.parent.mkdir(parents=True, exist_ok=True)
  tree = config.to_dict() if hasattr(config, "to_dict") else dict(config)
  record = {"format": FORMAT, "version": VERSION, PROCESS_COUNT: int(process_count),
            "config": tree}
  temporary = target.parent / f".{CONFIG_FILE}.tmp-{os.getpid()}"
  temporary.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
  temporary.replace(target)


def read_record(workdir: str | os.PathLike) -> dict:
  """The parsed `WORKDIR/config.json`.

  Raises:
    FileNotFoundError: the workdir holds no config.json.
    schema.ConfigError: a file of another format or version.
    paths.WorkdirError: a config.json that is a folder or not JSON.
  """
  paths.check_remote(workdir)
  target = path(workdir)
  if not target.exists():
    raise FileNotFoundError(f"{target} not found: not the workdir of a training run "
                            "(python -m trainer.main writes it at start)")
  record = paths.read_json(target, "config")  # a folder, truncated, not JSON: one line
  if record.get("format") != FORMAT or record.get("version") != VERSION:
    raise schema.ConfigError(
        f"{target}: a config of format {FORMAT!r} version {VERSION} (written by python -m "
        f"trainer.main); it has format {record.get('format')!r} version "
        f"{record.get('version')!r}")
  return record


def _tuples(tree):
  if isinstance(tree, Mapping):
    return {name: _tuples(value) for name, value in tree.items()}
  if isinstance(tree, list):
    return tuple(_tuples(value) for value in tree)
  return tree


def read(workdir: str | os.PathLike) -> ml_collections.ConfigDict:
  """The config saved in `WORKDIR/config.json` as a ConfigDict (lists back to tuples)."""
  tree = read_record(workdir)["config"]
  for key, value in ADDED_KEYS.items():
    *sections, name = key.split(".")
    parent = tree
    for section in sections:
      parent = parent.setdefault(section, {})
    parent.setdefault(name, value)
  return ml_collections.ConfigDict(_tuples(tree))


def _vocab_shards(values: Mapping[str, Any]) -> int:
  axis = values.get("mesh.vocab_axis")
  if axis is None:
    return 1
  return dict(zip(values["mesh.axis_names"], values["mesh.shape"])).get(axis, 1)


def is_harmless(key: str, old: Mapping[str, Any], new: Mapping[str, Any]) -> bool:
  """Whether a change of `key` from config `old` to `new` leaves the trained run the same.

  `train_steps` is harmless under the constant schedule (training runs
  longer or shorter) but not under cosine (the decay is stretched). Mesh
  keys are harmless while the vocab axis size stays (the state is restored
  onto any mesh; the item table's padded row count depends on that size).
  """
  if key in HARMLESS_KEYS or key.startswith(HARMLESS_SECTIONS):
    return True
  if key == "train_steps":
    return "cosine" not in (old.get("optimizer.schedule"), new.get("optimizer.schedule"))
  if key.startswith("mesh."):
    return _vocab_shards(old) == _vocab_shards(new)
  return False


def differences(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
  """Keys whose values differ between two `flat_values` (sorted; absent counts)."""
  return sorted(key for key in set(old) | set(new) if old.get(key, _ABSENT) != new.get(
      key, _ABSENT))


def _show(values: Mapping[str, Any], key: str) -> str:
  value = values.get(key, _ABSENT)
  return value if value == _ABSENT else repr(value)


def _name(key: str) -> str:
  return key if key == PROCESS_COUNT else config_keys.name(key)


def check_resume(workdir: str | os.PathLike, config, *, process_count: int,
                 allow_change: bool = False) -> list[str]:
  """Compares `config` with the run's saved config before resuming.

  Args:
    workdir: the run's directory (holding checkpoints and config.json).
    config: the config of this start.
    process_count: processes of this start (`jax.process_count()`).
    allow_change: resume even when keys that change the run differ.

  Returns:
    Notice lines (empty when nothing changed).

  Raises:
    schema.ConfigError: keys that change the run differ and `allow_change`
      is False; one line, `config.<key>=<new> (was <old>), ...: ...`.
  """
  if not path(workdir).exists():
    return [f"no {CONFIG_FILE} in {workdir} (a run started before it was written): "
            "writing the current config"]
  record = read_record(workdir)
  old = {**ADDED_KEYS, **schema.flatten(record["config"], _SECTIONS)}
  new = flat_values(config)
  old[PROCESS_COUNT], new[PROCESS_COUNT] = record.get(PROCESS_COUNT), int(process_count)
  changed = differences(old, new)
  refused = [key for key in changed if not is_harmless(key, old, new)]
  harmless = [key for key in changed if key not in refused]
  notices = []
  if harmless:
    notices.append("config changed since the run started (harmless): " + ", ".join(
        f"{_name(key)} {_show(old, key)} -> {_show(new, key)}" for key in harmless))
  if refused:
    listed = ", ".join(f"{_name(key)}={_show(new, key)} (was {_show(old, key)})"
                       for key in refused)
    if not allow_change:
      raise schema.ConfigError(
          f"{listed}: resuming the run in {workdir} with these changes would silently make "
          f"it another run ({path(workdir)} holds the config it started with); set them "
          "back, use a new workdir, or pass --allow_config_change")
    notices.append(f"config changed with --allow_config_change: {listed}")
  return notices
