"""Backends: the registry of kernel sets, and how "auto" picks one.

`BACKENDS` names each tiled backend's kernel set (a module honouring the
contract written in `cutbce/kernels/xla.py`); `resolve_backend` maps "auto" to
the backend that runs, `check_backend_supports` refuses inputs a named backend
cannot take, and `kernel_module` loads a kernel set. The ops (`cutbce.api`,
`cutbce.tiled`, `cutbce.softmax`, `cutbce.sharding`) all import this module;
it imports none of them.
"""

from __future__ import annotations

import functools
import importlib
import logging
import types

import jax
import jax.numpy as jnp

from cutbce import inputs
from cutbce.kernels.tiling import TilePlan

_LOG = logging.getLogger("cutbce")

# Backend name -> module path of a kernel set honouring the contract written in
# `cutbce/kernels/xla.py` (forward, backward, rank_counts, default_plan).
# "dense" is the materializing reference and takes no kernel set. "auto"
# resolves (`resolve_backend`) to "pallas_tpu" on a TPU host, to the "auto"
# kernel set (Pallas when lowered for TPU, XLA otherwise) where the Pallas
# kernels take the inputs, and to "xla" where they do not. "auto" never picks
# "pallas_gpu" (Mosaic GPU kernels, compiled on a GPU, interpreted on a CPU)
# or "pallas_triton" (the Pallas Triton kernels they replace): on a GPU it
# stays on the XLA path until a run on a GPU shows the fused kernels faster
# (docs/kernels.md, "Mosaic GPU kernels").
BACKENDS: types.MappingProxyType = types.MappingProxyType({
    "auto": "cutbce.kernels.auto",
    "xla": "cutbce.kernels.xla",
    "pallas_tpu": "cutbce.kernels.tpu",
    "pallas_gpu": "cutbce.kernels.gpu.mosaic",
    "pallas_triton": "cutbce.kernels.gpu.triton",
    "dense": None,
})
BACKEND_CHOICES = tuple(BACKENDS)


def resolve_backend(backend: str, flat: inputs.Flat | None = None, plan=None) -> str:
  """Maps "auto" to the backend that runs: Pallas on TPU, XLA elsewhere.

  On a TPU host "auto" is "pallas_tpu". Elsewhere it is the "auto" kernel set,
  which chooses when the program is lowered, so the same function runs the XLA
  path on CPU/GPU and exports to the Pallas kernels for TPU. Either way, with
  `flat` inputs Pallas is used only where its kernels take them (dtype,
  shapes, a tile plan that fits VMEM, the given `plan`'s layout), so "auto"
  never picks a path that would fail (it logs why, once, on a TPU); an
  explicitly named backend that cannot take them raises `NotImplementedError`
  (see `check_backend_supports`).
  """
  inputs.check_choice("backend", backend, BACKEND_CHOICES)
  if backend != "auto":
    return backend
  if not _kernel_module_available("pallas_tpu"):
    return "xla"
  reason = None
  if flat is not None:
    reason = _unsupported_reason("pallas_tpu", flat, plan) or _plan_problem(flat, plan)
  on_tpu = jax.default_backend() == "tpu"
  if reason is None:
    return "pallas_tpu" if on_tpu else "auto"
  if on_tpu:
    _log_fallback(reason)
  return "xla"


def _plan_problem(flat: inputs.Flat, plan) -> str | None:
  """Why a user's `plan` cannot tile these inputs on the TPU kernels, or None."""
  if plan is None:
    return None
  return kernel_module("pallas_tpu").plan_problem(
      flat.hidden.shape[0], flat.table.shape[0], flat.table.shape[1],
      jnp.result_type(flat.hidden.dtype, flat.table.dtype), plan,
  )


@functools.lru_cache(maxsize=64)
def _log_fallback(reason: str) -> None:
  """Says once per distinct reason why "auto" did not pick Pallas on a TPU."""
  _LOG.warning("cutbce: backend 'auto' uses the XLA path on this TPU: %s", reason)


def _unsupported_reason(backend: str, flat: inputs.Flat, plan: TilePlan | None = None) -> str | None:
  """Why `backend`'s kernels cannot take `flat`, or None (kernel sets without a check take all)."""
  if BACKENDS[backend] is None:
    return None
  check = getattr(kernel_module(backend), "unsupported_reason", None)
  if check is None:
    return None
  hidden, table = flat.hidden, flat.table
  return check(
      hidden.shape[0], table.shape[0], table.shape[1], hidden.dtype, table.dtype, plan
  )


def check_backend_supports(backend: str, flat: inputs.Flat, plan: TilePlan | None = None) -> None:
  """Raises `NotImplementedError` naming the reason when `backend` cannot take `flat`.

  With a `plan` given, only the inputs are checked, not whether a plan fits.
  """
  reason = _unsupported_reason(backend, flat, plan)
  if reason is not None:
    raise NotImplementedError(f"backend {backend!r} cannot run these inputs: {reason}")


def _kernel_module_available(name: str) -> bool:
  try:
    kernel_module(name)
  except ImportError:
    return False
  return True


def kernel_module(name: str):
  """The kernel set (module) of a tiled backend name, e.g. `cutbce.kernels.xla`."""
  return importlib.import_module(BACKENDS[name])


def default_plan(backend: str, kernel: str, num_tokens: int, vocab: int, dim: int, dtype,
                 num_targets: int = 1) -> TilePlan:
  """The tiled backend's own plan of one kernel ("forward", "backward", "ranks")."""
  return kernel_module(backend).default_plan(
      kernel, num_tokens, vocab, dim, dtype, num_targets=num_targets
  )
