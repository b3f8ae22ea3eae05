"""Argument checks and the reductions every entry point shares.

Checks run at trace time on shapes and dtypes only, and raise `ValueError` or
`TypeError` naming the argument and the shapes seen.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from cutbce.kernels.tiling import TilePlan
from cutbce.stats import Stats

REDUCTIONS = ("mean", "sum", "none")
VOCAB_REDUCTIONS = ("mean", "sum")


class Flat(NamedTuple):
  """Inputs flattened to T = prod(leading shape) tokens.

  Attributes:
    hidden: [T, D]; table: [V, D]; bias: [V] or None;
    targets: [T, L] int; weights: [T] float32; exclude: [T, E] int or None;
    leading_shape: the caller's leading shape (`[B, N]` usually);
    exclude_rows: [G, E] int, the caller's rows when each is shared by T / G
      consecutive tokens (an exclude of `[B, 1, E]` for hidden `[B, N, D]`:
      G = B; `exclude` repeats them), else None.
  """

  hidden: jax.Array
  table: jax.Array
  bias: jax.Array | None
  targets: jax.Array
  weights: jax.Array
  exclude: jax.Array | None
  leading_shape: tuple[int, ...]
  exclude_rows: jax.Array | None = None


def _shape(x) -> tuple[int, ...]:
  return tuple(np.shape(x))


def _dtype(x):
  return jnp.asarray(x).dtype if not hasattr(x, "dtype") else x.dtype


def _check_float(name, x):
  if not jnp.issubdtype(_dtype(x), jnp.floating):
    raise TypeError(f"{name} must be a floating dtype (float32 or bfloat16), got {_dtype(x)}")


def _check_int(name, x):
  if not jnp.issubdtype(_dtype(x), jnp.integer):
    raise TypeError(
        f"{name} must hold integer item ids (use -1 for padding), got dtype {_dtype(x)}"
    )


def check_choice(name, value, choices):
  if value not in choices:
    raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")


def check_plan(plan):
  if plan is not None and not isinstance(plan, TilePlan):
    raise TypeError(f"plan must be a cutbce.TilePlan or None, got {type(plan).__name__}")


def check_num_items(num_items, vocab: int) -> int:
  """`num_items` as a static int in [1, V] (None means V).

  Raises:
    TypeError: not an int (a traced value cannot size the catalog).
    ValueError: outside [1, V].
  """
  if num_items is None:
    return vocab
  if isinstance(num_items, bool) or not isinstance(num_items, (int, np.integer)):
    raise TypeError(
        f"num_items must be a Python int (the catalog size, static), got "
        f"{type(num_items).__name__} ({num_items!r})"
    )
  if not 1 <= num_items <= vocab:
    raise ValueError(f"num_items must be in [1, V={vocab}] (the table's rows), got {num_items}")
  return int(num_items)


def check_hidden_and_table(hidden, table) -> None:
  """hidden `[..., D]` and table `[V, D]`: floating, ranks, V >= 1, matching D."""
  hidden_shape, table_shape = _shape(hidden), _shape(table)
  _check_float("hidden", hidden)
  _check_float("table", table)
  if len(hidden_shape) < 2:
    raise ValueError(f"hidden must have shape [..., D] with rank >= 2, got shape {hidden_shape}")
  if len(table_shape) != 2:
    raise ValueError(f"table must have shape [V, D], got shape {table_shape}")
  if table_shape[0] < 1:
    raise ValueError(f"table must hold at least one item, got shape {table_shape}")
  if hidden_shape[-1] != table_shape[-1]:
    raise ValueError(
        f"hidden D={hidden_shape[-1]} (shape {hidden_shape}) != table D={table_shape[-1]} "
        f"(shape {table_shape})"
    )


def check_exclude(exclude, hidden_shape) -> None:
  """Integer ids `[..., E]` whose leading axes broadcast to hidden's (each equal, or 1)."""
  _check_int("exclude", exclude)
  exclude_shape, leading = _shape(exclude), tuple(hidden_shape[:-1])
  if (len(exclude_shape) != len(hidden_shape)
      or any(e not in (1, h) for e, h in zip(exclude_shape[:-1], leading))):
    raise ValueError(
        f"exclude leading shape {exclude_shape[:-1]} (shape {exclude_shape}) does not "
        f"broadcast to hidden leading shape {leading} (each axis equal, or 1 to share "
        f"a row of ids among those positions)"
    )


def flatten_inputs(hidden, table, targets, weights=None, bias=None, exclude=None) -> Flat:
  """Checks shapes and dtypes, flattens leading dims to T tokens.

  Weights get no gradient, and when they are given, the hidden rows of
  weight-0 positions are replaced by zeros (a `where`, not a product), so a
  NaN or inf in a dropped position reaches neither the loss nor any gradient.
  """
  hidden_shape, table_shape, targets_shape = _shape(hidden), _shape(table), _shape(targets)
  check_hidden_and_table(hidden, table)
  _check_int("targets", targets)
  leading = hidden_shape[:-1]
  if len(targets_shape) != len(hidden_shape):
    raise ValueError(
        f"targets must have shape [..., L] with the leading shape of hidden {leading}, "
        f"got rank {len(targets_shape)} shape {targets_shape} for hidden shape {hidden_shape}"
    )
  if targets_shape[:-1] != leading:
    raise ValueError(
        f"targets leading shape {targets_shape[:-1]} != hidden leading shape {leading}"
    )
  if weights is not None:
    _check_float("weights", weights)
    if _shape(weights) != leading:
      raise ValueError(
          f"weights shape {_shape(weights)} != hidden leading shape {leading}"
      )
  if bias is not None:
    _check_float("bias", bias)
    if _shape(bias) != table_shape[:1]:
      raise ValueError(f"bias must have shape [V]=({table_shape[0]},), got {_shape(bias)}")
  if exclude is not None:
    check_exclude(exclude, hidden_shape)
  num_tokens = int(np.prod(leading))
  dim = hidden_shape[-1]
  hidden = jnp.reshape(hidden, (num_tokens, dim))
  targets = jnp.reshape(targets, (num_tokens, targets_shape[-1]))
  if weights is None:
    weights = jnp.ones((num_tokens,), jnp.float32)
  else:
    weights = jax.lax.stop_gradient(jnp.reshape(weights, (num_tokens,)).astype(jnp.float32))
    hidden = jnp.where((weights != 0)[:, None], hidden, jnp.zeros_like(hidden))
  exclude_rows = None
  if exclude is not None:
    exclude, exclude_rows = flat_exclude(exclude, leading)
  return Flat(hidden, table, bias, targets, weights, exclude, leading, exclude_rows)


def flat_exclude(exclude, leading):
  """(`[T, E]` ids per token, `[G, E]` rows each shared by T / G consecutive tokens or None).

  Rows are kept apart when `exclude` differs from the tokens' shape only in
  trailing axes of size 1 (`[B, 1, E]` for `[B, N]` tokens); any other
  broadcast is only expanded.
  """
  width = _shape(exclude)[-1]
  shape = _shape(exclude)[:-1]
  shared = 0  # trailing axes of size 1 where the tokens have more
  while shared < len(shape) and shape[len(shape) - 1 - shared] == 1:
    shared += 1
  kept = len(shape) - shared
  num_tokens = int(np.prod(leading))
  if shape[:kept] == tuple(leading[:kept]) and int(np.prod(leading[kept:])) > 1:
    rows = jnp.reshape(exclude, (int(np.prod(shape)), width))
    return jnp.repeat(rows, num_tokens // rows.shape[0], axis=0), rows
  return jnp.reshape(jnp.broadcast_to(exclude, (*leading, width)), (num_tokens, width)), None


def reduce_losses(per_token, flat: Flat, reduction: str, vocab_reduction: str,
                  num_items: int | None = None):
  """Applies weights, the vocab and the token reductions to `[T]` losses.

  "mean" is sum_t w_t l_t / sum_t w_t, and 0 when every weight is 0 (the
  gradient is then 0 as well, not NaN). "none" returns w_t * l_t with the
  caller's leading shape, so that its sum equals "sum". Weight-0 positions
  give exactly 0 (a `where`). The vocabulary mean divides by `num_items`
  (default V).
  """
  divisor = 1
  if vocab_reduction == "mean":
    divisor = flat.table.shape[0] if num_items is None else num_items
  return reduce_weighted(per_token, flat.weights, reduction, divisor, flat.leading_shape)


def reduce_weighted(per_token, weights, reduction: str, vocab_divisor: int, leading_shape=None):
  """`reduce_losses` on plain arrays: `[T]` l_t, `[T]` weights, l_t / vocab_divisor."""
  if vocab_divisor != 1:
    per_token = per_token / vocab_divisor
  weighted = jnp.where(weights != 0, weights * per_token, 0.0)
  if reduction == "none":
    return jnp.reshape(weighted, leading_shape)
  total = jnp.sum(weighted)
  if reduction == "sum":
    return total
  weight_sum = jnp.sum(weights)
  safe = jnp.where(weight_sum != 0, weight_sum, 1.0)
  return jnp.where(weight_sum != 0, total / safe, 0.0)


def weighted_stats(counts, weights) -> Stats:
  """Sums per-token counts (tp, fp, fn, tn, each `[T]`) times `[T]` weights."""
  return Stats(*(jnp.sum(weights * c.astype(jnp.float32)) for c in counts))
