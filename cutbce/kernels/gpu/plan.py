"""Tile sizes of the Pallas GPU (Triton) kernels, from the device's description.

A Triton program holds its tiles in registers and stages the matmul operands
through shared memory. The planner picks `block_t` x `block_v` (token rows x
vocab rows of one float32 logit tile) so that, per program,

- registers: the live float32 values (the logit tile and the elementwise
  temporaries of the loss, the resident operand, the accumulator) stay
  within `REGISTER_FRACTION` of the device's 32-bit registers per block;
- shared memory: `NUM_STAGES` pipelined copies of the streamed operand plus
  the resident operand and the logit-gradient operand of the second matmul
  stay within `SHARED_MEMORY_FRACTION` of the opt-in shared memory per block;

and then splits the vocabulary sweep of the token-tiled kernels into
`vocab_splits` parts so that at least `PROGRAMS_PER_CORE` programs per
streaming multiprocessor run (small T would leave SMs idle otherwise). Those
splits write `[splits, T]` (and `[splits, T, D]` for dh) float32 partials,
summed outside; the product splits x T is bounded by ~2 x SMs x block_t, so
no buffer grows with V.

Triton needs power-of-two tensor sizes: `block_t`, `block_v` and the padded
hidden size `dim_padded` (D rounded up, columns past D masked) are powers of
two, at least `MIN_DOT` (the tensor-core instruction's smallest side).

None of these constants has been tuned on a GPU yet (no GPU was attached when
they were written); `benchmarks/gpu_run.py` times the planned tiles.
"""

from __future__ import annotations

import contextlib
import threading
from typing import NamedTuple

import jax
import jax.numpy as jnp

from cutbce.kernels.gpu import targets
from cutbce.kernels.tiling import TilePlan

MIN_DOT = 16  # smallest side of a Triton dot (tensor-core tile)
NUM_STAGES = 2  # software pipeline depth of the streamed operand's loads
REGISTER_FRACTION = 0.5  # of registers_per_block_limit for live f32 tile values
SHARED_MEMORY_FRACTION = 0.9  # of shared_memory_per_block_optin
PROGRAMS_PER_CORE = 2  # programs per SM the vocabulary splits aim for
MAX_VOCAB_SPLITS = 64
# Candidate (block_t, block_v), most preferred first: big logit tiles amortize
# the operand loads; block_v >= block_t because the table is the streamed side.
TILE_CHOICES = ((64, 128), (64, 64), (32, 64), (32, 32), (16, 32), (16, 16))
# Live float32 [block_t, block_v] tiles per kernel: the logits and the
# elementwise temporaries of the loss (value, derivative).
LOGIT_TILES = {"forward": 2, "backward": 3, "table_grad": 3, "ranks": 2}
KERNELS = tuple(LOGIT_TILES)


def next_power_of_two(n: int) -> int:
  return 1 << max(0, (int(n) - 1).bit_length())


def is_power_of_two(n: int) -> bool:
  return n > 0 and n & (n - 1) == 0


_TARGET = threading.local()


@contextlib.contextmanager
def target_gpu(name: str | None):
  """Plans for a named target ("h100", "h200") inside the context (compiling without a GPU)."""
  if name is not None:
    targets.check_target(name)
  previous = getattr(_TARGET, "name", None)
  _TARGET.name = name
  try:
    yield
  finally:
    _TARGET.name = previous


def current_target_name() -> str | None:
  """The target named by an enclosing `target_gpu`, or None."""
  return getattr(_TARGET, "name", None)


def current_spec() -> targets.GpuSpec:
  """The device planned for: the named target, else the attached GPU, else the default."""
  name = getattr(_TARGET, "name", None)
  if name is not None:
    return targets.spec(name)
  if jax.default_backend() == "gpu":
    device = jax.devices()[0]
    known = targets.spec_for_device_kind(device.device_kind)
    if known is not None:
      return known
    cores = getattr(device, "core_count", None)
    default = targets.spec(targets.DEFAULT_TARGET)
    if cores:
      # An unknown part: Hopper's per-block limits, its own SM count.
      return targets.GpuSpec(**{**default.__dict__, "name": device.device_kind,
                                "core_count": int(cores)})
    return default
  return targets.spec(targets.DEFAULT_TARGET)


class Geometry(NamedTuple):
  """Static tiling of one kernel call."""

  num_tokens: int  # T
  vocab: int  # num_items: rows walked (rows past it are never read)
  dim: int  # D
  dim_padded: int  # D rounded up to a power of two (columns past D masked)
  block_t: int
  block_v: int
  num_token_tiles: int
  num_vocab_tiles: int
  vocab_splits: int  # parts the vocab sweep of a token-tiled kernel is cut into
  tiles_per_split: int
  num_warps: int


def live_floats(kernel: str, block_t: int, block_v: int, dim_padded: int) -> int:
  """float32-equivalent values one program keeps live in registers (estimate)."""
  logits = LOGIT_TILES[kernel] * block_t * block_v  # [block_t, block_v] f32 each
  if kernel == "table_grad":
    # Resident [block_v, D] table tile and its f32 dE accumulator.
    return logits + 2 * block_v * dim_padded
  resident = block_t * dim_padded  # the [block_t, D] hidden tile
  if kernel == "backward":
    resident += block_t * dim_padded  # the f32 dh accumulator
  return logits + resident


def shared_bytes(kernel: str, block_t: int, block_v: int, dim_padded: int, itemsize: int) -> int:
  """Shared memory of one program: pipelined streamed tiles + resident + grad operand."""
  streamed_rows, resident_rows = (block_t, block_v) if kernel == "table_grad" else (block_v, block_t)
  total = NUM_STAGES * streamed_rows * dim_padded * itemsize  # streamed operand buffers
  total += resident_rows * dim_padded * itemsize  # resident operand
  if kernel in ("backward", "table_grad"):
    total += block_t * block_v * itemsize  # logit gradient as the 2nd dot's operand
  return total


def plan_tiles(kernel: str, num_tokens: int, vocab: int, dim: int, dtype,
               spec: targets.GpuSpec | None = None) -> TilePlan:
  """The largest `TILE_CHOICES` entry within the register and shared memory budgets.

  Raises:
    ValueError: no candidate fits (D too large for one program's registers).
  """
  del num_tokens, vocab
  spec = spec or current_spec()
  dim_padded = max(MIN_DOT, next_power_of_two(dim))
  # A float32 operand is staged as three bfloat16 pieces (`pieces.py`): 6 bytes.
  itemsize = 6 if jnp.dtype(dtype) == jnp.float32 else jnp.dtype(dtype).itemsize
  register_budget = REGISTER_FRACTION * spec.registers_per_block_limit
  shared_budget = SHARED_MEMORY_FRACTION * spec.shared_memory_per_block_optin
  for block_t, block_v in TILE_CHOICES:
    if (live_floats(kernel, block_t, block_v, dim_padded) <= register_budget
        and shared_bytes(kernel, block_t, block_v, dim_padded, itemsize) <= shared_budget):
      return TilePlan(block_v=block_v, block_t=block_t)
  raise ValueError(
      f"no GPU tile fits the {kernel} kernel at D={dim} ({jnp.dtype(dtype)}) on {spec.name}: "
      f"the smallest needs {live_floats(kernel, 16, 16, dim_padded)} live float32 values "
      f"(budget {register_budget:.0f}) and "
      f"{shared_bytes(kernel, 16, 16, dim_padded, itemsize)} B of shared memory "
      f"(budget {shared_budget:.0f})"
  )


SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


def input_problem(num_tokens, hidden_dtype, table_dtype) -> str | None:
  """Why inputs cannot run on either GPU kernel set (platform, dtype, no tokens), or None."""
  if jax.default_backend() == "tpu":
    return ("the Pallas GPU kernels run compiled on a GPU or in Pallas' interpreter on a CPU, "
            "not on a TPU host (use backend 'pallas_tpu', 'xla' or 'auto')")
  dtype = jnp.result_type(jnp.dtype(hidden_dtype), jnp.dtype(table_dtype))
  if dtype not in SUPPORTED_DTYPES:
    return (
        "the Pallas GPU kernels compute in float32 or bfloat16; got hidden "
        f"{jnp.dtype(hidden_dtype)} and table {jnp.dtype(table_dtype)} (common type {dtype})"
    )
  if num_tokens < 1:
    return f"the Pallas GPU kernels need at least one token, got T={num_tokens}"
  return None


def plan_problem(plan: TilePlan) -> str | None:
  """Why a user's `plan` cannot tile the GPU kernels (Triton's power-of-two rule), or None."""
  problems = []
  for name in ("block_t", "block_v"):
    value = getattr(plan, name)
    if value is not None and (not is_power_of_two(value) or value < MIN_DOT):
      problems.append(f"{name}={value} is not a power of two >= {MIN_DOT}")
  return "; ".join(problems) or None


def geometry(kernel: str, plan: TilePlan | None, num_tokens: int, vocab: int, dim: int,
             dtype) -> Geometry:
  """Clamps `plan` (or the planner's) to the shapes and picks the vocab splits.

  Raises:
    ValueError: the plan breaks Triton's power-of-two rule, or nothing fits.
  """
  spec = current_spec()
  planned = None
  if plan is None or plan.block_t is None:
    planned = plan_tiles(kernel, num_tokens, vocab, dim, dtype, spec)
  if plan is not None:
    problem = plan_problem(plan)
    if problem:
      raise ValueError(f"TilePlan {plan} cannot tile the Pallas GPU kernels: {problem}")
  block_t = plan.block_t if plan is not None and plan.block_t else planned.block_t
  block_v = plan.block_v if plan is not None else planned.block_v
  # Never bigger than the (power-of-two rounded) extent it walks.
  block_t = max(MIN_DOT, min(block_t, next_power_of_two(num_tokens)))
  block_v = max(MIN_DOT, min(block_v, next_power_of_two(vocab)))
  dim_padded = max(MIN_DOT, next_power_of_two(dim))
  num_token_tiles = -(-num_tokens // block_t)
  num_vocab_tiles = -(-vocab // block_v)
  wanted = -(-PROGRAMS_PER_CORE * spec.core_count // num_token_tiles)
  splits = max(1, min(MAX_VOCAB_SPLITS, wanted, num_vocab_tiles))
  tiles_per_split = -(-num_vocab_tiles // splits)
  splits = -(-num_vocab_tiles // tiles_per_split)  # no empty split
  # More warps when a program's tiles are large (a tensor-core tile per warp).
  num_warps = 8 if live_floats(kernel, block_t, block_v, dim_padded) > 16384 else 4
  return Geometry(
      num_tokens=num_tokens, vocab=vocab, dim=dim, dim_padded=dim_padded, block_t=block_t,
      block_v=block_v, num_token_tiles=num_token_tiles, num_vocab_tiles=num_vocab_tiles,
      vocab_splits=splits, tiles_per_split=tiles_per_split, num_warps=num_warps,
  )
