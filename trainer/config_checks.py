"""Config validation and the device mesh.

`check_config` runs when the config is read, before any array is made, so a
bad config fails with one `ConfigError` that names the field, the value seen
and what is expected, never with a traceback from inside jax.
"""

from __future__ import annotations

import math

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from trainer.data import SOURCE_NAMES

# Loss backends the trainer accepts (those of `cutbce.cut_bce`).
LOSS_BACKENDS = ("auto", "xla", "pallas_tpu", "dense")
DTYPES = ("float32", "bfloat16")
REQUIRED_FIELDS = (
    "seed", "train_steps", "batch_size", "seq_len", "num_targets", "mesh", "model",
    "optimizer", "data", "loss", "eval_every", "checkpoint_every", "log_every",
)


class ConfigError(ValueError):
  """A config field has a value the trainer cannot run with."""


def _positive_int(config, name):
  value = config[name]
  if not isinstance(value, int) or isinstance(value, bool) or value < 1:
    raise ConfigError(f"config.{name} must be an integer >= 1, got {value!r}")


def check_config(config, device_count: int | None = None) -> None:
  """Checks a trainer config against itself and the devices present.

  Args:
    config: the ConfigDict of a `configs/*.py` file.
    device_count: devices the mesh must cover; default `jax.device_count()`.

  Raises:
    ConfigError: the first problem found, explained.
  """
  missing = [name for name in REQUIRED_FIELDS if name not in config]
  if missing:
    raise ConfigError(f"config is missing fields {missing}; every config needs {REQUIRED_FIELDS}")
  for name in ("train_steps", "batch_size", "seq_len", "num_targets", "eval_every",
               "checkpoint_every", "log_every"):
    _positive_int(config, name)
  if config.data.dataset not in SOURCE_NAMES:
    raise ConfigError(
        f"unknown dataset config.data.dataset={config.data.dataset!r}; "
        f"expected one of {SOURCE_NAMES}")
  if config.loss.backend not in LOSS_BACKENDS:
    raise ConfigError(
        f"unknown loss backend config.loss.backend={config.loss.backend!r}; "
        f"expected one of {LOSS_BACKENDS}")
  if config.model.dtype not in DTYPES:
    raise ConfigError(f"config.model.dtype={config.model.dtype!r}; expected one of {DTYPES}")
  _check_mesh(config, jax.device_count() if device_count is None else device_count)


def _check_mesh(config, device_count: int) -> None:
  mesh = config.mesh
  names, shape = tuple(mesh.axis_names), tuple(mesh.shape)
  if len(names) != len(shape) or not names:
    raise ConfigError(
        f"config.mesh.axis_names {names} and config.mesh.shape {shape} must be "
        "non-empty and of one length")
  if len(set(names)) != len(names):
    raise ConfigError(f"config.mesh.axis_names {names} repeats a name")
  if any(not isinstance(size, int) or size < 1 for size in shape):
    raise ConfigError(f"config.mesh.shape {shape} must hold integers >= 1")
  if math.prod(shape) != device_count:
    raise ConfigError(
        f"config.mesh.shape {shape} covers {math.prod(shape)} devices, but "
        f"{device_count} are present (jax.device_count()); set --config.mesh.shape "
        f"to sizes whose product is {device_count}")
  token_axes = tuple(mesh.token_axes)
  unknown = [axis for axis in token_axes if axis not in names]
  if unknown or not token_axes:
    raise ConfigError(
        f"config.mesh.token_axes {token_axes} must be a non-empty subset of "
        f"config.mesh.axis_names {names}")
  if mesh.vocab_axis is not None and mesh.vocab_axis not in names:
    raise ConfigError(
        f"config.mesh.vocab_axis {mesh.vocab_axis!r} is not one of config.mesh.axis_names {names}")
  token_shards = token_shard_count(config)
  if config.batch_size % token_shards:
    raise ConfigError(
        f"config.batch_size={config.batch_size} is not divisible by the "
        f"{token_shards} shards of the token axes {token_axes} (mesh {dict(zip(names, shape))})")
  processes = jax.process_count()
  if config.batch_size % processes or config.eval_batch_size % processes:
    raise ConfigError(
        f"config.batch_size={config.batch_size} and config.eval_batch_size="
        f"{config.eval_batch_size} must be divisible by the {processes} processes")
  if config.eval_batch_size % token_shards:
    raise ConfigError(
        f"config.eval_batch_size={config.eval_batch_size} is not divisible by the "
        f"{token_shards} shards of the token axes {token_axes}")


def token_shard_count(config) -> int:
  sizes = dict(zip(config.mesh.axis_names, config.mesh.shape))
  return math.prod(sizes[axis] for axis in config.mesh.token_axes)


def vocab_shard_count(config) -> int:
  if config.mesh.vocab_axis is None:
    return 1
  return dict(zip(config.mesh.axis_names, config.mesh.shape))[config.mesh.vocab_axis]


def make_mesh(config) -> Mesh:
  """The global device mesh of `config.mesh` (axis types Auto)."""
  shape, names = tuple(config.mesh.shape), tuple(config.mesh.axis_names)
  return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(names))


def describe_mesh(mesh: Mesh) -> str:
  devices = np.asarray(mesh.devices)
  return (f"mesh {dict(mesh.shape)} over {devices.size} {devices.flat[0].platform} devices "
          f"in {jax.process_count()} process(es)")
