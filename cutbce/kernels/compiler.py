"""The TPU compiler with no TPU attached: named slices, and what the compiler reports.

libtpu (the `tpu` extra: `pip install 'cutbce[tpu]'`) compiles for a TPU
topology described by name, on any host (deviceless ahead-of-time
compilation): `topology_devices("v6e-8")` gives the 8 devices of a v6e-8
slice, on which `jax.jit(f).lower(*args).compile()` runs XLA:TPU and Mosaic
exactly as on the slice; `compiled.memory_analysis()` is then the compiler's
per-chip figure. Nothing runs: numerics still come from interpret mode.

What the compiler says when something does not fit is parsed here, so that
callers can report it as a number rather than a traceback:
`scoped_vmem_bytes` (a Mosaic kernel over its `vmem_limit_bytes`: the error
names the kernel's whole scoped allocation, so compiling once with a tiny
limit tells what the kernel really needs) and `hbm_shortfall` (a program
whose temporaries do not fit the chip's HBM).

Under `planning_for(devices)` the tile planner sizes the Pallas kernels for
the chip being compiled for (`tiling.target_chip`), not for the host.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re

from cutbce.kernels import tiling

GIB = 1024**3


@dataclasses.dataclass(frozen=True, kw_only=True)
class Topology:
  """A TPU slice the compiler can target by name.

  Attributes:
    name: the slice's usual name ("v6e-8"): chip generation, then chips (v5e,
      v6e) or TensorCores (v4, v5p: two per chip) as Cloud TPU counts them.
    topology_name: libtpu's topology string ("v6e:2x4").
    chips_per_host_bounds: chips per host along each axis (one VM's chips).
    chip: the `tiling.chip_spec` name of one chip ("v6e").
    chip_config_name: libtpu's chip configuration: "megacore" for v4, whose
      two TensorCores Cloud TPU drives as one device (as v5p's always are);
      "default" for the others.
  """

  name: str
  topology_name: str
  chips_per_host_bounds: tuple[int, int, int]
  chip: str
  chip_config_name: str = "default"

  @property
  def chips(self) -> int:
    size = 1
    for part in self.topology_name.split(":")[1].split("x"):
      size *= int(part)
    return size

  @property
  def hosts(self) -> int:
    per_host = 1
    for part in self.chips_per_host_bounds:
      per_host *= part
    return max(1, self.chips // per_host)


def _topology(name, topology_name, bounds, chip, chip_config_name="default"):
  return name, Topology(name=name, topology_name=topology_name, chips_per_host_bounds=bounds,
                        chip=chip, chip_config_name=chip_config_name)


# Single-host v5e / v6e slices hold up to 8 chips on one VM; 16 chips are four
# VMs of 4. v4 and v5p count TensorCores (2 per chip) and put 4 chips per VM,
# one device per chip (megacore): libtpu's "default" v4 configuration would
# instead show each TensorCore as a device, which Cloud TPU v4 VMs do not.
TOPOLOGIES: dict[str, Topology] = dict([
    _topology("v5e-1", "v5e:1x1", (1, 1, 1), "v5e"),
    _topology("v5e-4", "v5e:2x2", (2, 2, 1), "v5e"),
    _topology("v5e-8", "v5e:2x4", (2, 4, 1), "v5e"),
    _topology("v5e-16", "v5e:4x4", (2, 2, 1), "v5e"),
    _topology("v5e-32", "v5e:4x8", (2, 2, 1), "v5e"),
    _topology("v6e-1", "v6e:1x1", (1, 1, 1), "v6e"),
    _topology("v6e-4", "v6e:2x2", (2, 2, 1), "v6e"),
    _topology("v6e-8", "v6e:2x4", (2, 4, 1), "v6e"),
    _topology("v6e-16", "v6e:4x4", (2, 2, 1), "v6e"),
    _topology("v6e-32", "v6e:4x8", (2, 2, 1), "v6e"),
    _topology("v4-8", "v4:2x2x1", (2, 2, 1), "v4", "megacore"),
    _topology("v4-16", "v4:2x2x2", (2, 2, 1), "v4", "megacore"),
    _topology("v5p-8", "v5p:2x2x1", (2, 2, 1), "v5p"),
    _topology("v5p-16", "v5p:2x2x2", (2, 2, 1), "v5p"),
    # TPU7x (Ironwood): 4 chips per VM, two TensorCores per chip, each its own
    # device (not megacore): "tpu7x:2x2x1" has 8 devices. Named, as v4 and
    # v5p, by TensorCores. Needs a libtpu that knows the chip (see
    # `topology_devices`).
    _topology("tpu7x-8", "tpu7x:2x2x1", (2, 2, 1), "7x"),
    _topology("tpu7x-16", "tpu7x:2x2x2", (2, 2, 1), "7x"),
])

# `device_kind` of a TPU device -> `tiling.chip_spec` name.
_CHIP_OF_KIND = {"TPU v4": "v4", "TPU v5 lite": "v5e", "TPU v5e": "v5e", "TPU v5": "v5p",
                 "TPU v5p": "v5p", "TPU v6 lite": "v6e", "TPU v6e": "v6e", "TPU7x": "7x"}


def topology(name: str) -> Topology:
  """The `Topology` called `name`.

  Raises:
    ValueError: an unknown name; the one-line message lists the known ones.
  """
  if name not in TOPOLOGIES:
    raise ValueError(f"unknown TPU topology {name!r}; known: {', '.join(TOPOLOGIES)}")
  return TOPOLOGIES[name]


def libtpu_missing_reason() -> str | None:
  """Why this host cannot compile for TPU (libtpu not installed), or None when it can."""
  try:
    import libtpu  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
  except ImportError:
    return ("the TPU compiler (libtpu) is not installed: pip install 'cutbce[tpu]' "
            "(jax[tpu] at the installed jax's version)")
  return None


def topology_devices(name: str, num_slices: int = 1) -> list:
  """The TPU devices of `num_slices` slices of topology `name`, for compiling only.

  Raises:
    ValueError: an unknown topology, or `num_slices` < 1.
    RuntimeError: libtpu is missing (the message says how to install it).
  """
  spec = topology(name)
  if isinstance(num_slices, bool) or not isinstance(num_slices, int) or num_slices < 1:
    raise ValueError(f"num_slices must be a positive int, got {num_slices!r}")
  reason = libtpu_missing_reason()
  if reason is not None:
    raise RuntimeError(reason)
  # Several processes may compile at once (tests, a benchmark beside a
  # command): libtpu otherwise takes a host-wide lock for its (absent) chips.
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  from jax.experimental import topologies  # pylint: disable=import-outside-toplevel
  try:
    desc = topologies.get_topology_desc(
        platform="tpu", topology_name=spec.topology_name, chip_config_name=spec.chip_config_name,
        chips_per_host_bounds=spec.chips_per_host_bounds, num_slices=num_slices,
        wrap=(False, False, False))
  except Exception as error:  # pylint: disable=broad-exception-caught
    raise RuntimeError(
        f"the installed TPU compiler cannot describe {name} ({spec.topology_name}): "
        f"{_versions()}; {_NEWER_CHIPS_NEED}. It said: {str(error).splitlines()[0]}"
    ) from error
  return list(desc.devices)


# What compiling for the newest named chips was tested with.
_NEWER_CHIPS_NEED = ("TPU7x slices compile with jax 0.10.2 (libtpu 0.0.42.1) and jax 0.12.0.1 "
                     "(libtpu 0.0.50.1); an older libtpu may not know the chip: "
                     "pip install -U 'cutbce[tpu]'")


def _versions() -> str:
  from importlib import metadata  # pylint: disable=import-outside-toplevel
  found = []
  for package in ("jax", "libtpu"):
    try:
      found.append(f"{package} {metadata.version(package)}")
    except metadata.PackageNotFoundError:
      found.append(f"{package} not installed")
  return ", ".join(found)


def chip_device(chip: str):
  """One TPU device of `chip` ("v5e", "v6e", "v4", "v5p", "7x"): of its smallest named slice."""
  for spec in TOPOLOGIES.values():
    if spec.chip == chip:
      return topology_devices(spec.name)[0]
  raise ValueError(f"no known TPU topology of chip {chip!r}; known chips: "
                   f"{sorted({spec.chip for spec in TOPOLOGIES.values()})}")


def chip_of(device) -> str:
  """`tiling.chip_spec` name of a TPU device ("TPU v6 lite" -> "v6e").

  Raises:
    ValueError: not a TPU device this module knows.
  """
  kind = getattr(device, "device_kind", "")
  if kind not in _CHIP_OF_KIND:
    raise ValueError(f"not a known TPU device kind: {kind!r} (known: {sorted(_CHIP_OF_KIND)})")
  return _CHIP_OF_KIND[kind]


@contextlib.contextmanager
def planning_for(devices):
  """Plans the Pallas kernels for the chip of `devices` while tracing (see `tiling.target_chip`)."""
  with tiling.target_chip(chip_of(devices[0])):
    yield


_UNITS = {"": 1, "B": 1, "K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4}
_SCOPED_VMEM = re.compile(r"Scoped allocation with size ([\d.]+)([KMGT]?)")
_HBM_OOM = re.compile(r"required for [^(]*\(([\d.]+)([KMGT]?)\)\s*exceeds available HBM "
                      r"\(([\d.]+)([KMGT]?)\)")
_HBM_OOM_BYTES = re.compile(r"Ran out of memory in memory space hbm\. Used ([\d.]+)([KMGT]?) "
                            r"of ([\d.]+)([KMGT]?) hbm")


def _bytes(number: str, unit: str) -> int:
  return int(round(float(number) * _UNITS[unit]))


def scoped_vmem_bytes(message: str) -> int | None:
  """The scoped VMEM a Mosaic kernel asked for, from the compiler's out-of-VMEM error.

  The message reads "... Scoped allocation with size 11.52M and limit 8.00M
  exceeded scoped vmem limit ..." (sizes in MiB, two decimals). Returns the
  size in bytes rounded up to the message's precision (0.01 of its unit), or
  None for any other message.
  """
  match = _SCOPED_VMEM.search(message)
  if match is None:
    return None
  number, unit = match.groups()
  step = _UNITS[unit] // 100 if unit else 1
  return _bytes(number, unit) + step


def hbm_shortfall(message: str) -> tuple[int, int] | None:
  """(required, available) HBM bytes per chip from an out-of-HBM compile error, or None.

  XLA:TPU says "RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory
  required for HLO temporaries (67.40G) exceeds available HBM (15.75G)" (GiB)
  or "Ran out of memory in memory space hbm. Used 20.1G of 15.75G hbm".
  """
  for pattern in (_HBM_OOM, _HBM_OOM_BYTES):
    match = pattern.search(message)
    if match is not None:
      need, need_unit, have, have_unit = match.groups()
      return _bytes(need, need_unit), _bytes(have, have_unit)
  return None


def mosaic_kernels(compiled) -> list[str]:
  """Names of the Mosaic kernels (`tpu_custom_call`s) in a compiled TPU program's HLO."""
  names = []
  for line in compiled.as_text().splitlines():
    if 'custom_call_target="tpu_custom_call"' in line:
      match = re.search(r"%(\S+?) = ", line)
      names.append(match.group(1) if match else line.strip()[:80])
  return names


def peak_bytes(memory) -> int:
  """A compiled program's live bytes per device: arguments + outputs - aliased + temporaries."""
  return int(memory.argument_size_in_bytes + memory.output_size_in_bytes
             - memory.alias_size_in_bytes + memory.temp_size_in_bytes)


def tiling_chip(name: str) -> tiling.ChipSpec:
  """`tiling.chip_spec` of a topology's chip (HBM, VMEM, MXU width)."""
  return tiling.chip_spec(topology(name).chip)


# --------------------------------------------------------------------------- #
# One Pallas kernel, compiled alone.                                           #
# --------------------------------------------------------------------------- #

KERNEL_CALLS = ("forward", "backward", "one_pass", "ranks")


def kernel_call(kernel: str, *, num_tokens: int, vocab: int, dim: int, dtype, plan, device,
                bias: bool = False, num_targets: int = 8, num_items: int | None = None,
                options=None):
  """`(fn, args)`: one TPU kernel of `cutbce.kernels.tpu` jitted alone, on abstract inputs.

  `kernel` is "forward" (sum of phi and counts), "backward" (dh, dE, db),
  "one_pass" (the backward kernel that also sums the loss and counts) or
  "ranks"; the backward ones set `num_targets` fixed columns. `args` are
  `jax.ShapeDtypeStruct`s placed on `device`, so `jax.jit(fn).lower(*args).compile()`
  compiles for that device's chip.
  """
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from cutbce import variants  # pylint: disable=import-outside-toplevel
  from cutbce.kernels import tpu  # pylint: disable=import-outside-toplevel
  if kernel not in KERNEL_CALLS:
    raise ValueError(f"kernel must be one of {list(KERNEL_CALLS)}, got {kernel!r}")
  options = variants.PLAIN if options is None else options
  sharding = jax.sharding.SingleDeviceSharding(device)
  spec = lambda shape, dt=dtype: jax.ShapeDtypeStruct(shape, dt, sharding=sharding)  # noqa: E731
  static = dict(plan=plan, num_items=num_items)
  hidden, table = spec((num_tokens, dim)), spec((vocab, dim))
  bias_arg = spec((vocab,), jnp.float32) if bias else None
  if kernel == "forward":
    fn = lambda h, e, b: tpu.forward(h, e, b, with_counts=True, options=options, **static)  # noqa: E731
    return fn, (hidden, table, bias_arg)
  if kernel == "ranks":
    def fn(h, e, b, logits, ids):
      return tpu.rank_counts(h, e, b, logits, ids, options=options, **static)
    return fn, (hidden, table, bias_arg, spec((num_tokens, num_targets), jnp.float32),
                spec((num_tokens, num_targets), jnp.int32))
  scale = spec((num_tokens,), jnp.float32)
  table_grad = spec((vocab, dim), jnp.float32)
  bias_grad = spec((vocab,), jnp.float32) if bias else None
  # The targets' exact logit gradients, set in the tiles as `cut_bce` does.
  fixed_ids = spec((num_tokens, num_targets), jnp.int32)
  fixed_values = spec((num_tokens, num_targets), jnp.float32)
  if kernel == "backward":
    def fn(h, e, b, g, de, db, ids, values):
      return tpu.backward(h, e, b, g, de, db, ids, values, options=options, **static)
  else:
    def fn(h, e, b, g, de, db, ids, values):
      return tpu.forward_backward(h, e, b, g, de, db, ids, values, with_counts=True,
                                  options=options, **static)
  return fn, (hidden, table, bias_arg, scale, table_grad, bias_grad, fixed_ids, fixed_values)


def compile_kernel(kernel: str, **kwargs):
  """`kernel_call(kernel, **kwargs)` lowered and compiled: the `Compiled` program.

  Traced for the chip of `kwargs["device"]` (`planning_for`): its plan where
  none is given, and its TensorCores (the backward's core split on v4, v5p).
  """
  import jax  # pylint: disable=import-outside-toplevel
  fn, args = kernel_call(kernel, **kwargs)
  with planning_for([kwargs["device"]]):
    return jax.jit(fn).lower(*args).compile()


def measured_vmem_bytes(kernel: str, *, plan, max_tries: int = 12, **kwargs) -> int:
  """The smallest scoped VMEM limit Mosaic compiles `kernel` with under `plan`'s tiles.

  Found by the compiler itself, not modelled: compile with a limit of 64 KiB
  (the planner's estimate is not checked, `tpu.unchecked_vmem_limit`); an
  out-of-VMEM error names the scoped allocation that failed; compile again
  with that as the limit, until it compiles (3 or 4 compiles). The result is
  a limit the kernel compiles under, within 0.01 MiB of the last allocation
  the compiler asked for.

  Raises:
    RuntimeError: the compiler failed for another reason, or did not settle.
  """
  import dataclasses as dc  # pylint: disable=import-outside-toplevel
  from cutbce.kernels import tpu  # pylint: disable=import-outside-toplevel
  limit = 64 * 1024
  for _ in range(max_tries):
    try:
      with tpu.unchecked_vmem_limit():
        compile_kernel(kernel, plan=dc.replace(plan, vmem_limit_bytes=limit), **kwargs)
    except Exception as error:  # pylint: disable=broad-exception-caught
      size = scoped_vmem_bytes(str(error))
      if size is None or size <= limit:
        raise RuntimeError(f"compiling the {kernel} kernel failed: {error}") from error
      limit = size
      continue
    return limit
  raise RuntimeError(f"the {kernel} kernel's VMEM did not settle in {max_tries} compiles")


# --------------------------------------------------------------------------- #
# The compiled kernel's loop: how many grid steps one TensorCore runs.         #
# --------------------------------------------------------------------------- #

# libtpu flags that write each compiled kernel's LLO (the TensorCore program
# XLA:TPU emits around the Mosaic body: the grid's pipeline loop, DMAs, the
# VMEM windows) as text, first pass only.
_LLO_DUMP_FLAGS = "--xla_jf_dump_to={path} --xla_jf_dump_llo_pass_label_regex=^original$"
_LLO_LOOP = re.compile(r"^\s*loop: start=0, step=1, limit=(\d+)", re.MULTILINE)


def kernel_loops(dump_dir: str) -> dict[str, int]:
  """`{kernel name: trip count of its outermost loop}` from an LLO dump directory.

  The outermost loop of a Mosaic kernel's LLO is its grid pipeline: one trip
  per grid step the TensorCore runs, plus two (the first block's fetch and
  the last block's write-back). On a megacore chip a grid whose "parallel"
  axis is split between the two TensorCores runs half its steps on each:
  steps / 2 + 2 trips instead of steps + 2. Names are the kernels' own
  (`cutbce_backward_bt256_bv4096_chunk2048_cores2`), without XLA's suffix.
  """
  loops = {}
  for name in sorted(os.listdir(dump_dir)):
    match = re.match(r"\d+-(cutbce_\w+?)(?:\.\d+)?-\d+-original\.txt$", name)
    if match is None:
      continue
    with open(os.path.join(dump_dir, name), encoding="utf-8", errors="replace") as text:
      found = _LLO_LOOP.search(text.read())
    if found is not None:
      loops[match.group(1)] = int(found.group(1))
  return loops


# libtpu flags that turn off XLA:TPU's placement of whole arrays in VMEM
# (memory-space assignment, per chip family: "gf" v5e, "vf" v5p). With it on,
# XLA may hold a kernel's operand in VMEM outside the kernel's scoped limit,
# and the kernel's need then depends on the rest of the program; off, every
# operand goes through its window: the kernel's own worst case.
WINDOWS_ONLY_FLAGS = ("--xla_gf_vmem_memory_space_assignment=false "
                      "--xla_vf_vmem_memory_space_assignment=false")

_CHILD = """
import json, sys
import jax.numpy as jnp
from cutbce.kernels import compiler, tiling
spec = json.loads(sys.argv[1])
what = spec.pop("what")
plan = spec.pop("plan")
plan = None if plan is None else tiling.TilePlan(**plan)
device = compiler.topology_devices(spec.pop("topology"))[0]
kwargs = dict(plan=plan, device=device, dtype=jnp.dtype(spec.pop("dtype")), **spec)
kernel = kwargs.pop("kernel")
if what == "compile":
  compiler.compile_kernel(kernel, **kwargs)
else:
  print(json.dumps(compiler.measured_vmem_bytes(kernel, **kwargs)))
"""


def _in_child(what: str, flags: str, kernel: str, *, topology: str, dtype, plan, timeout: float,
              **kwargs) -> str:
  """Runs `_CHILD` for one kernel with extra libtpu flags (read when libtpu loads); its stdout."""
  import json  # pylint: disable=import-outside-toplevel
  import subprocess  # pylint: disable=import-outside-toplevel
  import sys  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  spec = dict(what=what, kernel=kernel, topology=topology, dtype=jnp.dtype(dtype).name,
              plan=None if plan is None else dataclasses.asdict(plan), **kwargs)
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  env = dict(os.environ, JAX_PLATFORMS="cpu", ALLOW_MULTIPLE_LIBTPU_LOAD="1",
             PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]),
             LIBTPU_INIT_ARGS=" ".join([os.environ.get("LIBTPU_INIT_ARGS", ""), flags]).strip())
  result = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(spec)], env=env,
                          capture_output=True, text=True, timeout=timeout, check=False)
  if result.returncode != 0:
    raise RuntimeError(f"compiling the {kernel} kernel for {topology} failed: "
                       + " | ".join(result.stderr.strip().splitlines()[-3:]))
  return result.stdout


def compiled_kernel_loops(kernel: str, *, topology: str, num_tokens: int, vocab: int, dim: int,
                          dtype, plan=None, timeout: float = 600, **kwargs) -> dict[str, int]:
  """`kernel_loops` of one kernel (`compile_kernel`) compiled for a chip of `topology`.

  The LLO dump is a libtpu flag read when libtpu loads, so the kernel is
  compiled in a child process (a few seconds); nothing runs.

  Raises:
    RuntimeError: the child failed (its last lines of stderr are in the message).
  """
  import tempfile  # pylint: disable=import-outside-toplevel
  with tempfile.TemporaryDirectory() as dump:
    _in_child("compile", _LLO_DUMP_FLAGS.format(path=dump), kernel, topology=topology,
              num_tokens=num_tokens, vocab=vocab, dim=dim, dtype=dtype, plan=plan,
              timeout=timeout, **kwargs)
    return kernel_loops(dump)


def windows_only_vmem_bytes(kernel: str, *, topology: str, num_tokens: int, vocab: int,
                            dim: int, dtype, plan, timeout: float = 600, **kwargs) -> int:
  """`measured_vmem_bytes` with XLA's VMEM placement off (`WINDOWS_ONLY_FLAGS`), in a child.

  The kernel's need when every operand goes through its window: what
  `tiling.vmem_estimate` models. With the placement on (the default) the
  need is this or less.
  """
  out = _in_child("measure", WINDOWS_ONLY_FLAGS, kernel, topology=topology,
                  num_tokens=num_tokens, vocab=vocab, dim=dim, dtype=dtype, plan=plan,
                  timeout=timeout, **kwargs)
  return int(out.strip().splitlines()[-1])


# --------------------------------------------------------------------------- #
# The plans a compiled program's kernels carry, beside the compiler's VMEM.    #
# --------------------------------------------------------------------------- #

_KERNEL_NAME = re.compile(r"%(cutbce_(\w+?)_bt(\d+)_bv(\d+)_chunk(\d+)(?:_cores(\d+))?)(?:\.\d+)? = ")
_SCOPED_LIMIT = re.compile(r'"scoped_memory_configs":\[\{"memory_space":"1","offset":"0",'
                           r'"size":"(\d+)"')
_SCOPED_USED = re.compile(r'"used_scoped_memory_configs":\[\{"memory_space":"1","offset":"0",'
                          r'"size":"(\d+)"')
_FIRST_OPERAND = re.compile(r"operand_layout_constraints=\{(\w+)\[(\d+),(\d+)\]")


def kernel_plans(compiled) -> list[dict]:
  """The Pallas kernels of a compiled TPU program, each with its plan and VMEM figures.

  One entry per distinct kernel (its name carries the plan: `block_t`,
  `block_v`, `token_chunk`, and `cores` when the backward's sweep is split
  over a megacore chip's TensorCores), with `calls` (the backward runs one
  call per token chunk), `tokens` and `dim` (its first operand, the hidden
  `[T, D]` block's array), `limit_bytes` (the `vmem_limit_bytes` it was
  compiled with) and `used_bytes` (the scoped VMEM the compiler reports the
  kernel uses, or None).
  """
  found: dict[str, dict] = {}
  for line in compiled.as_text().splitlines():
    if 'custom_call_target="tpu_custom_call"' not in line:
      continue
    name = _KERNEL_NAME.search(line)
    if name is None:
      continue
    limit, used = _SCOPED_LIMIT.search(line), _SCOPED_USED.search(line)
    operand = _FIRST_OPERAND.search(line)
    entry = found.setdefault(name.group(1), {
        "name": name.group(1), "kernel": name.group(2), "block_t": int(name.group(3)),
        "block_v": int(name.group(4)), "token_chunk": int(name.group(5)),
        "cores": int(name.group(6) or 1), "calls": 0,
        "dtype": operand.group(1) if operand else None,
        "tokens": int(operand.group(2)) if operand else None,
        "dim": int(operand.group(3)) if operand else None,
        "limit_bytes": int(limit.group(1)) if limit else None, "used_bytes": None})
    entry["calls"] += 1
    if used is not None:
      entry["used_bytes"] = max(entry["used_bytes"] or 0, int(used.group(1)))
  return list(found.values())
