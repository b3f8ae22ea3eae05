"""NVIDIA targets the GPU kernels are planned and compiled for, with no GPU attached.

Each target is XLA's GPU target config (a `stream_executor.GpuTargetConfigProto`
in text form: the device description the compiler would read from a driver).
The numbers are NVIDIA's published figures as XLA reports them for these
parts (SM count, shared memory and registers per block, HBM size and
bandwidth, compute capability 9.0). Only the fields the jax 0.10.2 CUDA
plugin's proto knows are kept.

Two uses:

- `spec(name)`: the planner's view of a part (`GpuSpec`), parsed from the same
  text, so tile sizes are chosen from the device description.
- `compile_devices(name)`: devices of a one-GPU topology of that part
  (`jax.experimental.topologies.get_topology_desc(platform="cuda",
  target_config=..., topology="1x1x1")`). A `jax.jit(f).lower(...)` whose
  inputs are placed on them compiles with XLA:GPU and Triton for sm_90 on a
  CPU host; `.memory_analysis()` then gives the compiled memory. Needs the
  CUDA plugin (the `gpu` extra) and `JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1` in the
  environment before jax initializes its backends (the plugin's driver check
  fails where no driver is installed).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re

_COMMON_TAIL = """\
  cuda_compute_capability {
    major: 9
    minor: 0
  }
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
  thread_dim_limit_x: 1024
  thread_dim_limit_y: 1024
  thread_dim_limit_z: 64
  device_vendor: "NVIDIA Corporation"
  platform_version: "Compute Capability 9.0"
"""


def _target_config(name: str, memory_bandwidth: int, device_memory_size: int) -> str:
  """The text proto of one Hopper part (H100 SXM and H200 share all but memory)."""
  return f"""\
gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {memory_bandwidth}
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: {device_memory_size}
  shared_memory_per_block_optin: 232448
{_COMMON_TAIL}}}
platform_name: "CUDA"
dnn_version_info {{
  major: 9
  minor: 8
  patch: 0
}}
device_description_str: "{name}"
"""


# Name -> text proto. Keys are what `cutbce` functions take as `target`.
TARGET_CONFIGS = {
    "h100": _target_config("NVIDIA H100 80GB HBM3", 3_352_320_000_000, 84_942_979_072),
    "h200": _target_config("NVIDIA H200", 4_800_000_000_000, 151_397_597_184),
}
DEFAULT_TARGET = "h100"


@dataclasses.dataclass(frozen=True, kw_only=True)
class GpuSpec:
  """What the GPU planner needs from one device (all per streaming multiprocessor / block)."""

  name: str  # the device description (`device_kind` on a real GPU)
  core_count: int  # streaming multiprocessors
  shared_memory_per_block_optin: int  # bytes one Triton program may use
  registers_per_block_limit: int  # 32-bit registers one program may use
  memory_bandwidth: int  # bytes per second
  device_memory_size: int  # bytes of HBM


def _field(text: str, name: str) -> str:
  match = re.search(rf"^\s*{name}:\s*(\S+)\s*$", text, re.MULTILINE)
  if match is None:
    raise ValueError(f"target config has no field {name!r}")
  return match.group(1).strip('"')


def parse_spec(text: str) -> GpuSpec:
  """The `GpuSpec` of a GPU target config text proto."""
  return GpuSpec(
      name=re.search(r'device_description_str:\s*"([^"]*)"', text).group(1),
      core_count=int(_field(text, "core_count")),
      shared_memory_per_block_optin=int(_field(text, "shared_memory_per_block_optin")),
      registers_per_block_limit=int(_field(text, "registers_per_block_limit")),
      memory_bandwidth=int(_field(text, "memory_bandwidth")),
      device_memory_size=int(_field(text, "device_memory_size")),
  )


def check_target(name: str) -> str:
  if name not in TARGET_CONFIGS:
    raise ValueError(f"unknown GPU target {name!r}; known: {sorted(TARGET_CONFIGS)}")
  return name


@functools.lru_cache(maxsize=None)
def spec(name: str) -> GpuSpec:
  """The planner's `GpuSpec` of a named target ("h100", "h200")."""
  return parse_spec(TARGET_CONFIGS[check_target(name)])


# Prefix of a real device's `device_kind` -> the target it is planned as.
_KIND_PREFIXES = (("NVIDIA H100", "h100"), ("NVIDIA H200", "h200"), ("NVIDIA GH200", "h200"))


def spec_for_device_kind(kind: str) -> GpuSpec | None:
  """The known target a real device's `device_kind` is planned as, or None."""
  for prefix, name in _KIND_PREFIXES:
    if kind.startswith(prefix):
      return spec(name)
  return None


def cuda_plugin_available() -> bool:
  """Whether jax's CUDA plugin is installed (the `gpu` extra)."""
  try:
    import jax_plugins.xla_cuda12  # noqa: F401  pylint: disable=g-import-not-at-top,unused-import
  except ImportError:
    return False
  return True


@functools.lru_cache(maxsize=None)
def compile_devices(name: str):
  """The one device of a `1x1x1` CUDA topology of target `name` (no GPU needed).

  Raises:
    RuntimeError: the CUDA plugin is missing, or jax cannot describe the topology.
  """
  if not cuda_plugin_available():
    raise RuntimeError("jax's CUDA plugin is not installed (pip install 'cutbce[gpu]')")
  os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
  topology = topologies.get_topology_desc(
      platform="cuda", target_config=TARGET_CONFIGS[check_target(name)], topology="1x1x1",
  )
  return tuple(topology.devices)


def triton_kernels(compiled) -> list[str]:
  """Names of the Pallas Triton kernels in a compiled program (`cutbce_gpu_..._bt.._bv..`)."""
  names = []
  for line in compiled.as_text().splitlines():
    if "__gpu$xla.gpu.triton" in line:
      match = re.search(r"(cutbce_gpu_\w+)/pallas_call", line)
      names.append(match.group(1) if match else "?")
  return names


def mosaic_kernels(compiled) -> list[str]:
  """Names of the Mosaic GPU kernels in a compiled program (`cutbce_mosaic_...`)."""
  names = []
  for line in compiled.as_text().splitlines():
    if 'custom_call_target="mosaic_gpu' in line:
      match = re.search(r"(cutbce_mosaic_\w+?)(?:/|\")", line)
      names.append(match.group(1) if match else "?")
  return names

