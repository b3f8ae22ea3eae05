"""What the compiler made of the Mosaic GPU kernels: PTX and ptxas reports, read without a GPU.

Mosaic GPU writes each kernel's PTX and ptxas report where
`MOSAIC_GPU_DUMP_PTX`, `MOSAIC_GPU_DUMP_PTXAS` and `MOSAIC_GPU_DUMP_TO` say
(read by the CUDA plugin at every compilation). `compile_with_reports` sets
them around one compilation into a fresh folder and parses, per kernel:
registers and spill bytes (ptxas), the tensor-core instructions (`wgmma`
shapes and counts) and the special-function unit (MUFU) instructions of its
PTX: `ex2`, `lg2`, `rcp`, `tanh`, `sin`, `cos`, `rsqrt`, `sqrt.approx`.
The kernels' loop bodies are not unrolled, so these counts are per tile:
MUFU per logit is the count over the logits one thread holds in a tile.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
import pathlib
import re
import tempfile

_DUMP_VARIABLES = ("MOSAIC_GPU_DUMP_PTX", "MOSAIC_GPU_DUMP_PTXAS", "MOSAIC_GPU_DUMP_TO")
MUFU_OPS = ("ex2", "lg2", "rcp", "tanh", "sin", "cos", "rsqrt", "sqrt.approx")
_WGMMA = re.compile(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)\.(\w+)\.(\w+)\.(\w+)")
_MUFU = re.compile(r"^\s*(?:@%p\d+\s+)?(" + "|".join(re.escape(op) for op in MUFU_OPS)
                   + r")\.[\w.]+", re.MULTILINE)


@dataclasses.dataclass(frozen=True)
class KernelReport:
  """One kernel as compiled for sm_90a."""

  name: str
  registers: int
  spill_bytes: int  # spill stores + spill loads
  wgmma: dict  # "m64n128k16.f32.bf16.bf16" -> instructions in the PTX
  mufu: dict  # "ex2" -> instructions in the PTX

  def wgmma_count(self, shape: str | None = None) -> int:
    return sum(n for key, n in self.wgmma.items() if shape is None or key.startswith(shape))

  @property
  def mufu_count(self) -> int:
    return sum(self.mufu.values())


# One line per compiled function of a ptxas `-v` report. The spill figures are
# also repeated by a "Registers are spilled" warning wherever they are not 0:
# read from this line only, they are counted once.
_FUNCTION_PROPERTIES = re.compile(
    r"^\s*\d+ bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", re.MULTILINE)


def parse_ptxas(text: str) -> tuple[int, int]:
  """(registers, spill store + load bytes) of a ptxas `-v` report."""
  registers = int(re.search(r"Used (\d+) registers", text).group(1))
  spills = sum(int(stores) + int(loads) for stores, loads in _FUNCTION_PROPERTIES.findall(text))
  return registers, spills


def parse_ptx(text: str) -> tuple[dict, dict]:
  """(wgmma shape.types -> count, MUFU op -> count) of one PTX module."""
  wgmma = collections.Counter(".".join(m) for m in _WGMMA.findall(text))
  mufu = collections.Counter(_MUFU.findall(text))
  return dict(wgmma), dict(mufu)


@contextlib.contextmanager
def _dumping_to(folder: pathlib.Path):
  previous = {name: os.environ.get(name) for name in _DUMP_VARIABLES}
  os.environ.update(MOSAIC_GPU_DUMP_PTX="1", MOSAIC_GPU_DUMP_PTXAS="1",
                    MOSAIC_GPU_DUMP_TO=str(folder))
  try:
    yield
  finally:
    for name, value in previous.items():
      if value is None:
        os.environ.pop(name, None)
      else:
        os.environ[name] = value


def compile_with_reports(compile_fn):
  """(compile_fn()'s result, {kernel name: KernelReport}) of the Mosaic GPU kernels it compiles.

  Names drop Mosaic's trailing `_<n>` counter. Raises `RuntimeError` when the
  compilation wrote no report (not compiled by Mosaic GPU, or a cached
  executable: compile a fresh function).
  """
  with tempfile.TemporaryDirectory(prefix="cutbce-ptx-") as folder:
    folder = pathlib.Path(folder)
    with _dumping_to(folder):
      result = compile_fn()
    reports = {}
    for ptxas_file in sorted(folder.glob("*.ptxas")):
      ptx_file = ptxas_file.with_suffix(".ptx")
      name = re.sub(r"_\d+$", "", ptxas_file.stem)
      registers, spills = parse_ptxas(ptxas_file.read_text())
      wgmma, mufu = parse_ptx(ptx_file.read_text()) if ptx_file.exists() else ({}, {})
      reports[name] = KernelReport(name, registers, spills, wgmma, mufu)
  if not reports:
    raise RuntimeError("no Mosaic GPU kernel report was written by this compilation")
  return result, reports
