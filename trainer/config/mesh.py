"""Config validation and the device mesh.

`check_config` runs when the config is read, before any data is prepared and
before anything is traced, so a bad config fails with one `ConfigError` that
names the key, the value seen and what is allowed (`trainer/config/keys.py`
describes every key and rule), never with a traceback from inside jax.
"""

from __future__ import annotations

import math

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from trainer.config import budget, keys as config_keys
from trainer.config.schema import ConfigError

__all__ = ["ConfigError", "check_config", "describe_mesh", "make_mesh", "token_shard_count",
           "vocab_shard_count"]


def check_config(config, device_count: int | None = None, *, workdir: str | None = None,
                 devices=None) -> None:
  """Checks a trainer config against its schema, itself and the devices present.

  Args:
    config: the ConfigDict of a `configs/*.py` file.
    device_count: devices the mesh must cover; default `jax.device_count()`.
    workdir: the run's directory; when given, the raw data that will have to
      be read is checked to exist (process 0).
    devices: the run's devices when they are not this process's
      (`trainer.compile`: a TPU slice described, not attached); their count,
      slices and hosts are then checked against, as process 0 of the slice.

  A -1 in `config.mesh.shape` is replaced, in place, by the devices the
  other axes leave (`fill_mesh_shape`).

  Raises:
    ConfigError: the first problem found, explained in one line.
  """
  if devices is not None:
    fill_mesh_shape(config, len(devices))
    context = config_keys.Context(
        device_count=len(devices), slice_count=slice_count(devices),
        process_count=len({device.process_index for device in devices}), process_index=0,
        workdir=workdir)
    config_keys.check(config, context)
    return
  device_count = jax.device_count() if device_count is None else device_count
  fill_mesh_shape(config, device_count)
  context = config_keys.Context(
      device_count=device_count, slice_count=slice_count(),
      process_count=jax.process_count(), process_index=jax.process_index(), workdir=workdir,
      memory_bytes=budget.memory_bytes())
  config_keys.check(config, context)


def check_state_fits(config, num_items: int) -> None:
  """Refuses, in one line, a state that cannot fit this host's devices (`budget.check_state`).

  Run once the catalog is known (after data preparation), before anything of
  its size is allocated. Asked of XLA instead, an allocation past the memory
  can fail on a worker thread while the main thread waits for the state
  forever (issue 41). The table has `num_items` rounded up to the vocab
  axis's size (`model.padded_vocab_size`).

  Raises:
    ConfigError: names `model.dim`, the bytes needed and the memory.
  """
  model = budget.Model.of_config(config.model)
  vocab_shards = vocab_shard_count(config)
  sizes = dict(zip(config.mesh.axis_names, config.mesh.shape))
  shards = math.prod(sizes[axis] for axis in config.mesh.token_axes)
  activations = budget.step_bytes(model, -(-config.batch_size // shards), config.seq_len,
                                  training=True)
  why = budget.check_state(
      model, num_items=-(-num_items // vocab_shards) * vocab_shards, seq_len=config.seq_len,
      vocab_shards=vocab_shards, local_devices=jax.local_device_count(),
      memory=budget.memory_bytes(), activations=activations)
  if why is not None:
    raise ConfigError(
        f"config.model.dim={config.model.dim}: a model whose state fits this host: {why}; "
        "use a smaller model.dim or model.mlp_dim, or split the item table over a vocab "
        "axis (config.mesh.vocab_axis)")


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


def _slices_are_processes(devices) -> bool:
  """Whether the run's slices are its processes: devices other than TPUs (a CPU in
  a multi-process run reports `slice_index` 0 for every device)."""
  return devices[0].platform != "tpu" or not hasattr(devices[0], "slice_index")


def slice_count(devices=None) -> int:
  """Slices of the run: distinct `slice_index` of TPU devices, else processes."""
  devices = jax.devices() if devices is None else devices
  if devices[0].platform == "tpu" and not hasattr(devices[0], "slice_index"):
    return 1  # a single slice (libtpu gives devices of one slice no slice_index)
  if _slices_are_processes(devices):
    return len({device.process_index for device in devices})
  return len({device.slice_index for device in devices})


def mesh_devices(config, devices=None) -> np.ndarray:
  """The devices of `config.mesh` as an array of shape `mesh.shape`.

  One slice: `mesh_utils.create_device_mesh` (the ICI topology's order, what
  `jax.make_mesh` uses). With `mesh.dcn_shape`: jax's hybrid mesh, each
  slice (each process, off TPU) a block of
  `mesh.shape / mesh.dcn_shape` devices, so that only the axes spanning
  slices cross the slower data-center network.
  """
  from jax.experimental import mesh_utils  # pylint: disable=import-outside-toplevel
  devices = jax.devices() if devices is None else devices
  shape = tuple(config.mesh.shape)
  dcn = config.mesh.get("dcn_shape")
  if dcn is None:
    return mesh_utils.create_device_mesh(shape, devices)
  ici = tuple(size // count for size, count in zip(shape, dcn))
  return mesh_utils.create_hybrid_device_mesh(
      ici, tuple(dcn), devices, process_is_granule=_slices_are_processes(devices))


def make_mesh(config, devices=None) -> Mesh:
  """The global device mesh of `config.mesh` (axis types Auto; see `mesh_devices`).

  `devices` default to `jax.devices()`; `trainer.compile` passes a described
  TPU slice's.
  """
  names = tuple(config.mesh.axis_names)
  if devices is not None:
    return Mesh(mesh_devices(config, devices), names, axis_types=(AxisType.Auto,) * len(names))
  if config.mesh.get("dcn_shape") is None:
    return jax.make_mesh(tuple(config.mesh.shape), names,
                         axis_types=(AxisType.Auto,) * len(names))
  return Mesh(mesh_devices(config), names, axis_types=(AxisType.Auto,) * len(names))


def describe_mesh(mesh: Mesh) -> str:
  """One progress line: axis sizes, device count and platform, processes."""
  devices = np.asarray(mesh.devices)
  return (f"mesh {dict(mesh.shape)} over {devices.size} {devices.flat[0].platform} devices "
          f"in {jax.process_count()} process(es)")
