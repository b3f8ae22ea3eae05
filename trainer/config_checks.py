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

  A -1 in `config.mesh.shape` is replaced, in place, by the devices the
  other axes leave (`fill_mesh_shape`).

  Raises:
    ConfigError: the first problem found, explained in one line.
  """
  device_count = jax.device_count() if device_count is None else device_count
  fill_mesh_shape(config, device_count)
  context = config_schema.Context(
      device_count=device_count,
      process_count=jax.process_count(), process_index=jax.process_index(), workdir=workdir)
  config_schema.check(config, context)


def fill_mesh_shape(config, device_count: int) -> None:
  """Replaces a -1 in `config.mesh.shape` by `device_count` / (product of the others).

  `mesh.shape = (-1,)` is all devices on one axis; `(-1, 4)` puts 4 on the
  second axis and the rest on the first, whatever the slice size.

  Raises:
    ConfigError: more than one -1, or the other sizes do not divide the
      device count.
  """
  mesh = config.get("mesh") if hasattr(config, "get") else None
  shape = mesh.get("shape") if hasattr(mesh, "get") else None
  if not isinstance(shape, (tuple, list)) or -1 not in shape:
    return  # nothing to fill, or not a mesh: the schema explains
  shape = tuple(shape)
  if shape.count(-1) > 1:
    raise ConfigError(f"config.mesh.shape={shape}: at most one size may be -1 (filled from "
                      "the device count)")
  known = [size for size in shape if size != -1]
  if not all(isinstance(size, int) and size >= 1 for size in known):
    return  # the schema names the bad size
  rest = math.prod(known)
  if device_count % rest:
    raise ConfigError(f"config.mesh.shape={shape}: the sizes besides -1 multiply to {rest}, "
                      f"which does not divide the {device_count} devices present")
  mesh["shape"] = tuple(device_count // rest if size == -1 else size for size in shape)


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
