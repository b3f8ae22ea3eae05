"""Sizes a step can hold: an up-front bound on batch and sequence length.

Two limits, both checked before anything is traced, so an absurd
`config.seq_len` or `--batch_size` is one line, not an OOM kill or an abort
inside XLA:

* int32 indices: jax and the `cutbce` op flatten a step's positions and
  index them (targets, gathers, tile grids) with int32, so the targets of a
  step, `B x N x L` ids, must number at most `2^31 - 1` (past it jax fails
  with an `OverflowError`, XLA with SIGABRT).
* memory: a lower bound on the bytes of the arrays the step must hold at
  once, compared with the memory of this process's devices (their
  `memory_stats()["bytes_limit"]`, or the host's RAM for CPU devices, which
  share it). The training step keeps each block's activations for the
  backward pass,

      B x N x (layers x (heads x N + mlp_dim + 4 D) + 2 D) x bytes,

  the attention weights `[B, heads, N, N]`, the feed-forward's
  `[B, N, mlp_dim]` and four `[B, N, D]` (the norms' and attention's inputs
  and outputs) per block, plus the embeddings and the output; the forward-only
  steps (evaluation, `trainer.recommend`) hold one block's at a time.
* the state: the parameters, and for training their gradients and AdamW's
  two moments, all float32, 16 bytes per parameter (4 forward only):

      params = V_padded x D / vocab_shards + N x D
               + layers x (4 D^2 + 2 D x mlp_dim)   (weights; biases and norms
                                                    are too small to count)

  The item table is split over the vocab axis; the rest is replicated on
  every device, so CPU devices (which share the host's RAM) each hold a copy.
  Before the data is prepared the catalog is unknown (V = 0); the trainer
  checks again with V once it is (`check_state`), before anything is
  allocated: a state that cannot fit would otherwise be asked of XLA, which
  on some machines fails on a worker thread and leaves the main thread
  waiting forever (issue 41).

Both bounds are lower bounds, so they only refuse what cannot fit. The
memory is the devices' own (`bytes_limit`), or for CPU devices the host's
RAM, capped by a stated limit: the cgroup's `memory.max` (a container) and
the process's `RLIMIT_AS` / `RLIMIT_DATA` (`ulimit -v`).

`limit` gives the largest value of one size that passes both, the figure
the one-line message names.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import NamedTuple

INT32_MAX = 2**31 - 1
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


class Model(NamedTuple):
  """The model sizes a step's activations depend on."""

  dim: int
  num_layers: int
  num_heads: int
  mlp_dim: int
  dtype_bytes: int
  tables: int = 1  # item tables: 2 with `model.output_table="separate"`

  @classmethod
  def of(cls, values) -> "Model":
    """From flat config values (`"model.dim"`, ...)."""
    return cls(values["model.dim"], values["model.num_layers"], values["model.num_heads"],
               values["model.mlp_dim"], _DTYPE_BYTES.get(values["model.dtype"], 4),
               2 if values.get("model.output_table") == "separate" else 1)

  @classmethod
  def of_config(cls, model_config) -> "Model":
    """From the `config.model` ConfigDict of a run."""
    return cls(model_config.dim, model_config.num_layers, model_config.num_heads,
               model_config.mlp_dim, _DTYPE_BYTES.get(model_config.dtype, 4),
               2 if model_config.get("output_table") == "separate" else 1)


def step_bytes(model: Model, batch: int, seq_len: int, *, training: bool) -> int:
  """A lower bound on the bytes of activations a step over `[batch, seq_len]` holds."""
  dim, layers, heads, mlp_dim, dtype_bytes, _ = model
  block = heads * seq_len + mlp_dim + 4 * dim  # per position, one block
  kept = layers * block if training else min(layers, 1) * block
  return batch * seq_len * (kept + 2 * dim) * dtype_bytes


def memory_bytes() -> int | None:
  """Memory of this process's devices together (bytes), or None when unknown.

  Accelerators report their own (`memory_stats()["bytes_limit"]`); CPU devices
  share the host's RAM, counted once.
  """
  import jax  # pylint: disable=import-outside-toplevel
  devices = jax.local_devices()
  limits = []
  for device in devices:
    try:
      stats = device.memory_stats()
    except Exception:  # pylint: disable=broad-except  (not every backend has stats)
      stats = None
    if not stats or "bytes_limit" not in stats:
      limits = None
      break
    limits.append(int(stats["bytes_limit"]))
  if limits:
    return sum(limits)
  return host_memory_bytes()


_CGROUP_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")


def host_memory_bytes() -> int | None:
  """The host's RAM this process may use (bytes), or None where the OS does not say.

  The physical RAM, capped by the cgroup's limit and `ulimit -v` / `-d`.
  """
  limits = []
  try:
    limits.append(int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES")))
  except (AttributeError, ValueError, OSError):
    pass
  for path in _CGROUP_LIMITS:
    try:
      with open(path, encoding="ascii") as file:
        text = file.read().strip()
    except OSError:
      continue
    if text.isdigit():
      limits.append(int(text))
  try:
    import resource  # pylint: disable=import-outside-toplevel  (POSIX only)
    for which in (resource.RLIMIT_AS, resource.RLIMIT_DATA):
      soft = resource.getrlimit(which)[0]
      if soft != resource.RLIM_INFINITY and soft > 0:
        limits.append(int(soft))
  except (ImportError, ValueError, OSError):
    pass
  return min(limits) if limits else None


def fits(model: Model, *, batch: int, seq_len: int, targets: int, shards: int,
         local_devices: int, memory: int | None, training: bool) -> bool:
  """Whether a step over a global `[batch, seq_len]` passes both limits.

  Args:
    model: the model's sizes.
    batch: global batch B.
    seq_len: N.
    targets: ids per position L (the int32 limit counts `B x N x L`).
    shards: the token shards the batch is split over (devices per batch row).
    local_devices: devices of this process (each holds `B / shards` rows).
    memory: bytes of this process's devices together, or None: not checked.
    training: the training step (activations kept for the backward pass).
  """
  if batch * seq_len * max(targets, 1) > INT32_MAX:
    return False
  if memory is None:
    return True
  per_device = -(-batch // max(shards, 1))
  return step_bytes(model, per_device, seq_len, training=training) * local_devices <= memory


def limit(passes: Callable[[int], bool], value: int) -> int:
  """The largest `x <= value` with `passes(x)` (0 when none), `passes` monotone."""
  low, high = 0, value
  while low < high:
    middle = (low + high + 1) // 2
    if passes(middle):
      low = middle
    else:
      high = middle - 1
  return low


def gib(value: int) -> str:
  """Bytes as GiB, for messages."""
  return f"{value / 2**30:,.1f} GiB"


def why(model: Model, *, batch: int, seq_len: int, targets: int, shards: int,
        local_devices: int, memory: int | None, training: bool) -> str:
  """Which limit a step over `[batch, seq_len]` (one that does not fit) is past, in words."""
  if batch * seq_len * max(targets, 1) > INT32_MAX:
    return (f"past it the step's batch x seq_len x {max(targets, 1)} target ids "
            f"overflow int32 indices (2^31 - 1)")
  del model, local_devices  # the caller found the memory bound to be the one past
  step = "training" if training else "forward"
  return (f"past it the {step} step's activations outgrow the {gib(memory or 0)} this "
          f"host's devices hold")


def check_sizes(model: Model, *, sizes: dict[str, int], blame: Sequence[str], targets: int,
                shards: int, local_devices: int, memory: int | None,
                training: bool) -> tuple[str, str] | None:
  """`(key, message tail)` when `sizes` ("batch", "seq_len") do not fit, else None.

  The key blamed is the one of `blame` furthest above its own limit (the
  others held; a key no value of which fits is blamed last), and the tail
  names that limit and the bound just past it.
  """
  def passes(batch: int, seq_len: int) -> bool:
    return fits(model, batch=batch, seq_len=seq_len, targets=targets, shards=shards,
                local_devices=local_devices, memory=memory, training=training)

  if passes(sizes["batch"], sizes["seq_len"]):
    return None
  limits = {name: limit(lambda value, name=name: passes(**{**sizes, name: value}), sizes[name])
            for name in blame}
  key = max(blame, key=lambda name: sizes[name] / limits[name] if limits[name] else 0.0)
  past = {**sizes, key: limits[key] + 1}
  reason = why(model, batch=past["batch"], seq_len=past["seq_len"], targets=targets,
               shards=shards, local_devices=local_devices, memory=memory, training=training)
  if limits[key] == 0:
    return key, f"no value fits here with the other sizes ({reason.replace('past it ', '')})"
  return key, f"at most {limits[key]:,} here ({reason})"


# Bytes per parameter: float32 params, gradients and AdamW's two moments (training),
# or the params alone (the forward-only commands).
STATE_BYTES = {True: 16, False: 4}


def param_count(model: Model, *, num_items: int, seq_len: int, vocab_shards: int = 1) -> int:
  """A lower bound on the parameters one device holds (the table's rows split by `vocab_shards`)."""
  dim, layers, _, mlp_dim, _, tables = model
  table_rows = -(-num_items // max(vocab_shards, 1)) if num_items else 0
  return tables * table_rows * dim + seq_len * dim + layers * (4 * dim * dim + 2 * dim * mlp_dim)


def state_bytes(model: Model, *, num_items: int, seq_len: int, vocab_shards: int = 1,
                training: bool = True) -> int:
  """A lower bound on the bytes of the state one device holds."""
  return STATE_BYTES[training] * param_count(model, num_items=num_items, seq_len=seq_len,
                                             vocab_shards=vocab_shards)


def check_state(model: Model, *, num_items: int, seq_len: int, vocab_shards: int,
                local_devices: int, memory: int | None, training: bool = True,
                activations: int = 0) -> str | None:
  """Why the state (plus `activations` bytes per device) cannot fit, or None.

  Args:
    model: the model's sizes.
    num_items: V (0 before the data is prepared: the table is not counted).
    seq_len: N (the position table).
    vocab_shards: devices the item table's rows are split over.
    local_devices: devices of this process (CPU devices share the host's RAM).
    memory: bytes of this process's devices together, or None: not checked.
    training: count gradients and AdamW's moments too.
    activations: bytes per device of the step's activations (`step_bytes`).
  """
  if memory is None:
    return None
  state = state_bytes(model, num_items=num_items, seq_len=seq_len, vocab_shards=vocab_shards,
                      training=training)
  if (state + activations) * local_devices <= memory:
    return None
  what = ("parameters, gradients and AdamW moments (float32, 16 bytes per parameter)"
          if training else "parameters (float32)")
  table = (f"{num_items:,} items x {model.dim:,}" + (f" over {vocab_shards} table shards"
                                                     if vocab_shards > 1 else "")
           if num_items else "the item table not counted yet")
  per_device = f"{gib(state)} per device" + (f" x {local_devices} devices" if local_devices > 1
                                             else "")
  return (f"the model's {what} need at least {per_device} ({table}; dim {model.dim:,}, "
          f"{model.num_layers} layers, mlp_dim {model.mlp_dim:,})"
          + (f" plus {gib(activations)} of activations" if activations >= 2**26 else "")
          + f", and this host's devices hold {gib(memory)}")


def negatives_bytes(model: Model, *, tokens: int, num_negatives: int, per_position: bool) -> int:
  """A lower bound on the bytes a sampled loss's negatives take on one device.

  `tokens` positions of this device score `num_negatives` (k) sampled items
  each: float32 logits and their gradients `[T, k]`, and the gathered rows,
  `[T, k, D]` when each position draws its own (`per_position`), else one
  shared `[k, D]`.
  """
  rows = tokens * num_negatives if per_position else num_negatives
  return 4 * (2 * tokens * num_negatives + rows * model.dim)


def check_negatives(model: Model, *, tokens: int, global_tokens: int, num_negatives: int,
                    per_position: bool, local_devices: int, memory: int | None) -> str | None:
  """Why k sampled negatives per set cannot fit a step, with the largest k that does; or None.

  Two limits, as for the step's activations: the step's `T x k` sampled
  logits are indexed with int32 (at most 2^31 - 1), and their bytes
  (`negatives_bytes`) must fit this host's devices.
  """
  def passes(k: int) -> bool:
    if global_tokens * k > INT32_MAX:
      return False
    return memory is None or negatives_bytes(
        model, tokens=tokens, num_negatives=k, per_position=per_position) * local_devices <= memory

  if passes(num_negatives):
    return None
  most = limit(passes, num_negatives)
  if global_tokens * (most + 1) > INT32_MAX:
    reason = (f"past it the step's {global_tokens:,} positions x k sampled logits overflow "
              "int32 indices (2^31 - 1)")
  else:
    reason = (f"past it the sampled logits{' and gathered rows' if per_position else ''} "
              f"outgrow the {gib(memory or 0)} this host's devices hold")
  return f"at most {most:,} here ({reason})"
