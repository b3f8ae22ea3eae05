"""Config validation and the device mesh.

`check_config` runs when the config is read, before any data is prepared and
before anything is traced, so a bad config fails with one `ConfigError` that
names the key, the value seen and what is allowed (`trainer/config_schema.py`
describes every key and rule), never with a traceback from inside jax.
"""

from __future__ import annotations

import math

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from trainer import config_schema
from trainer.schema import ConfigError

__all__ = ["ConfigError", "check_config", "describe_mesh", "make_mesh", "token_shard_count",
           "vocab_shard_count"]


def check_config(config, device_count: int | None = None, *, workdir: str | None = None) -> None:
  """Checks a trainer config against its schema, itself and the devices present.

  Args:
    config: the ConfigDict of a `configs/*.py` file.
    device_count: devices the mesh must cover; default `jax.device_count()`.
    workdir: the run's directory; when given, the raw data that will have to
      be read is checked to exist (process 0).

  Raises:
    ConfigError: the first problem found, explained in one line.
  """
  context = config_schema.Context(
      device_count=jax.device_count() if device_count is None else device_count,
      process_count=jax.process_count(), process_index=jax.process_index(), workdir=workdir)
  config_schema.check(config, context)


def token_shard_count(config) -> int:
  """Product of the token axes' sizes: the shards the batch is split into."""
  sizes = dict(zip(config.mesh.axis_names, config.mesh.shape))
  return math.prod(sizes[axis] for axis in config.mesh.token_axes)


def vocab_shard_count(config) -> int:
  """Size of the vocab axis (1 when the item table is replicated)."""
  if config.mesh.vocab_axis is None:
    return 1
  return dict(zip(config.mesh.axis_names, config.mesh.shape))[config.mesh.vocab_axis]


def make_mesh(config) -> Mesh:
  """The global device mesh of `config.mesh` (axis types Auto)."""
  shape, names = tuple(config.mesh.shape), tuple(config.mesh.axis_names)
  return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(names))


def describe_mesh(mesh: Mesh) -> str:
  """One progress line: axis sizes, device count and platform, processes."""
  devices = np.asarray(mesh.devices)
  return (f"mesh {dict(mesh.shape)} over {devices.size} {devices.flat[0].platform} devices "
          f"in {jax.process_count()} process(es)")
