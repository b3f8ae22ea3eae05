"""Keeps libtpu's start-up probe quiet on machines without a TPU.

With the `tpu` extra installed (`make install` installs it), jax loads libtpu
at its first backend initialisation on every machine, and so does the
deviceless compile path (`jax.experimental.topologies`, `trainer.compile`).
On a machine with no TPU chip, libtpu looks for the slice it belongs to: jax
sets `TPU_SKIP_MDS_QUERY` (no metadata server to ask), so libtpu parses its
placeholder text "WARNING: could not determine TPU worker hostnames ..." as a
hostname and prints, before any command output,

    Failed to find host bounds for accelerator type: WARNING: could not ...
    WARNING: Logging before InitGoogle() is written to STDERR
    E0000 ... common_lib.cc:554] INVALID_ARGUMENT: Error: unexpected worker hostname ...

then gives up on the TPU and jax goes on with CPU (or GPU). The lines are
printed before libtpu's logging is set up, so `TPU_STDERR_LOG_LEVEL` and
`TPU_MIN_LOG_LEVEL` do not reach them. What does is to tell libtpu what is
true of such a machine: it is one host (`TPU_WORKER_HOSTNAMES=localhost`) of
a one-host slice (`TPU_HOST_BOUNDS=1,1,1`). Neither changes what the
deviceless compiler builds: a named topology brings its own bounds (the
devices of every `cutbce.kernels.compiler.TOPOLOGIES` entry, ids, processes,
coordinates and cores, are the same with and without them).

`quiet_probe_without_tpu()` sets both, only on a machine with no TPU chip on
its PCI bus, and only when none of libtpu's slice variables is set already
(a user's own setting, or a TPU VM's, is never touched). The command entry
points call it before jax initialises a backend; importing `trainer` as a
library changes no environment.
"""

from __future__ import annotations

import glob
import os
from collections.abc import MutableMapping

# The PCI vendor of Google's devices; TPU chips are the only ones jax looks for.
GOOGLE_PCI_VENDOR = "0x1ae0"

# The values that describe a machine without a TPU to libtpu's probe.
QUIET = {"TPU_WORKER_HOSTNAMES": "localhost", "TPU_HOST_BOUNDS": "1,1,1"}

# Any of these set means someone describes a slice on purpose: leave all alone.
SLICE_VARIABLES = ("TPU_WORKER_HOSTNAMES", "TPU_HOST_BOUNDS", "TPU_ACCELERATOR_TYPE",
                   "TPU_CHIPS_PER_HOST_BOUNDS", "TPU_PROCESS_BOUNDS",
                   "TPU_CHIPS_PER_PROCESS_BOUNDS", "TPU_WORKER_ID", "JAX_FORCE_TPU_INIT")


def has_tpu_chip(pci_devices: str = "/sys/bus/pci/devices") -> bool:
  """Whether a Google PCI device (a TPU chip) is attached: the test jax's own probe makes."""
  for vendor in glob.glob(os.path.join(pci_devices, "*", "vendor")):
    try:
      with open(vendor, encoding="ascii") as file:
        if file.read().strip() == GOOGLE_PCI_VENDOR:
          return True
    except OSError:
      continue
  return False


def quiet_probe_without_tpu(environ: MutableMapping[str, str] | None = None, *,
                            pci_devices: str = "/sys/bus/pci/devices") -> bool:
  """Sets `QUIET` in `environ` (default `os.environ`) on a machine without a TPU.

  Must run before jax initialises its first backend (jax itself may already
  be imported: libtpu reads these when it is loaded). Returns whether it set them.
  """
  environ = os.environ if environ is None else environ
  if any(name in environ for name in SLICE_VARIABLES) or has_tpu_chip(pci_devices):
    return False
  environ.update(QUIET)
  return True
