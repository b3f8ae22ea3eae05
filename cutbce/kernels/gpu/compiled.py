"""The loss compiled for an NVIDIA target with no GPU attached.

`compile_loss` builds `jit(value_and_grad(cut_bce))` (or of `cut_softmax_ce`,
or `target_ranks`) on
the one device of a target's topology (`targets.compile_devices`), with the
GPU kernels planned for that target, and compiles it with XLA:GPU and Triton.
Used by the compile tests and `benchmarks/gpu_run.py compile`. It imports
the ops (`cutbce`), so it lives apart from `targets`, which the planner
imports.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import cutbce
from cutbce.kernels.gpu import plan as gpu_plan
from cutbce.kernels.gpu import targets


def compile_loss(target: str, backend: str, *, tokens: int, vocab: int, dim: int, dtype,
                 num_targets: int = 1, bias: bool = False, num_exclude: int = 0,
                 num_items: int | None = None, reduction: str = "mean", ranks: bool = False,
                 plan=None, kind: str = "bce", **options):
  """`jit(value_and_grad(cut_bce))` (or `target_ranks`) compiled for one GPU of `target`.

  `kind="softmax_ce"` compiles `cut_softmax_ce` instead of `cut_bce` (its
  `options`: label_smoothing, target_reduction).

  Nothing runs: inputs are `ShapeDtypeStruct`s on the topology's device, the
  GPU kernels are planned for `target` (the XLA path plans for the host
  unless `plan` is given). Returns the compiled program
  (`.memory_analysis()`, `.as_text()`).
  """
  devices = targets.compile_devices(target)
  sharding = jax.sharding.SingleDeviceSharding(devices[0])
  spec = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=sharding)  # noqa: E731
  args = [spec((tokens, dim), dtype), spec((vocab, dim), dtype),
          spec((tokens, num_targets), jnp.int32),
          spec((vocab,), jnp.float32) if bias else None,
          spec((tokens, num_exclude), jnp.int32) if num_exclude else None]
  common = dict(num_items=num_items, backend=backend, plan=plan)
  op = {"bce": cutbce.cut_bce, "softmax_ce": cutbce.cut_softmax_ce}[kind]

  def loss(hidden, table, targets_, bias_, exclude):
    def scalar(h, e, b):
      return jnp.sum(op(h, e, targets_, bias=b, exclude=exclude, reduction=reduction,
                        **common, **options))
    return jax.value_and_grad(scalar, argnums=(0, 1, 2) if bias_ is not None else (0, 1))(
        hidden, table, bias_)

  def rank(hidden, table, targets_, bias_, exclude):
    return cutbce.target_ranks(hidden, table, targets_, bias=bias_, exclude=exclude, **common)

  # The mesh of the topology's devices tells the Triton lowering which GPU it
  # compiles for: jax >= 0.11 reads the part from the ambient mesh (with no
  # mesh it asks the local GPU, and there is none); 0.10.2 ignores it.
  mesh = jax.sharding.Mesh(np.asarray(devices), ("gpu",))
  with gpu_plan.target_gpu(target), jax.set_mesh(mesh):
    return jax.jit(rank if ranks else loss).lower(*args).compile()
