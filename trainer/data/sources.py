"""Interaction sources: what every dataset loader returns, and the registry.

A source yields raw interactions ``(user, item, timestamp)`` in file order, as
three integer arrays of one length. Ids are raw (not yet dense); preprocessing
(:mod:`trainer.data.preprocess`) remaps them to ``[0, U)`` and ``[0, V)``.

Sources:

* ``ml-1m``, ``ml-100k``: MovieLens read out of registry wheels
  (:mod:`trainer.data.movielens`).
* ``yambda``: the Yambda parquet files from a local folder
  (:mod:`trainer.data.yambda`).
* ``synthetic``: Zipf popularity with planted transitions
  (:mod:`trainer.data.synthetic`).
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Mapping
from types import MappingProxyType

import numpy as np


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Interactions:
  """Raw interactions in file order.

  Attributes:
    user: int ``[n]`` raw user ids, >= 0.
    item: int ``[n]`` raw item ids, >= 0.
    timestamp: int64 ``[n]`` event times (any integer unit; only order matters,
      except for the temporal split whose windows are in the same unit).
    num_items: catalog size when the raw item ids are already dense in
      ``[0, num_items)`` (the synthetic source), else None. Lets preprocessing
      keep items that never occur (``min_item_count=0``).
    name: short description of where the data came from.
  """

  user: np.ndarray
  item: np.ndarray
  timestamp: np.ndarray
  num_items: int | None = None
  name: str = ""

  def __post_init__(self):
    n = None
    for field in ("user", "item", "timestamp"):
      array = getattr(self, field)
      check_integer_ids(array, field, allow_negative=(field == "timestamp"))
      if array.ndim != 1:
        raise ValueError(f"{field} must be 1-D, got shape {array.shape}")
      if n is None:
        n = array.shape[0]
      elif array.shape[0] != n:
        raise ValueError(
            f"{field} has {array.shape[0]} entries, expected {n} (as user)")
    if self.num_items is not None and n and int(self.item.max()) >= self.num_items:
      raise ValueError(
          f"item id {int(self.item.max())} >= declared num_items {self.num_items}")

  def __len__(self) -> int:
    return int(self.user.shape[0])


def check_integer_ids(array: np.ndarray, name: str, *,
                      allow_negative: bool = False) -> None:
  """Raises unless ``array`` is an integer numpy array (non-negative for ids).

  Args:
    array: the array to check.
    name: what it is, for the error message (``"item"``).
    allow_negative: accept negative values (timestamps).

  Raises:
    TypeError: not a numpy array of an integer dtype.
    ValueError: a negative id.
  """
  if not isinstance(array, np.ndarray):
    raise TypeError(f"{name} must be a numpy array, got {type(array).__name__}")
  if not np.issubdtype(array.dtype, np.integer):
    raise TypeError(
        f"{name} must have an integer dtype, got {array.dtype}; expected "
        "int32, int64, uint32, ...")
  if not allow_negative and array.size and int(array.min()) < 0:
    raise ValueError(
        f"{name} ids must be >= 0, found {int(array.min())} at index "
        f"{int(np.argmin(array))}")


def float_to_int_ids(values: np.ndarray, name: str) -> np.ndarray:
  """Converts float-typed ids or timestamps to int64, rejecting fractions.

  Args:
    values: float ``[n]``.
    name: what they are, for the error message.

  Returns:
    int64 ``[n]``.

  Raises:
    ValueError: a NaN or a non-integral value.
  """
  bad = ~np.isfinite(values) | (values != np.floor(values))
  if bad.any():
    index = int(np.argmax(bad))
    raise ValueError(
        f"{name} must hold integral values, found {values[index]!r} at row "
        f"{index}")
  return values.astype(np.int64)


# name -> "module:function". Loaders take keyword options and return
# Interactions. Imported lazily so that one source's dependencies never load
# another's.
_SOURCES: Mapping[str, str] = MappingProxyType({
    "ml-1m": "trainer.data.movielens:load_ml_1m",
    "ml-100k": "trainer.data.movielens:load_ml_100k",
    "yambda": "trainer.data.yambda:load_yambda",
    "synthetic": "trainer.data.synthetic:generate_synthetic",
})

SOURCE_NAMES: tuple[str, ...] = tuple(_SOURCES)


def get_source(name: str) -> Callable[..., Interactions]:
  """Returns the loader registered under ``name``.

  Raises:
    ValueError: unknown name; the message lists the known ones.
  """
  if name not in _SOURCES:
    raise ValueError(
        f"unknown dataset {name!r}; expected one of {', '.join(SOURCE_NAMES)}")
  module_name, function_name = _SOURCES[name].split(":")
  return getattr(importlib.import_module(module_name), function_name)


def load_interactions(name: str, **options) -> Interactions:
  """Loads the raw interactions of dataset ``name``.

  Args:
    name: one of :data:`SOURCE_NAMES`.
    **options: passed to the loader (``cache_dir`` for MovieLens, ``path`` and
      ``event`` for Yambda, sizes and ``seed`` for synthetic).

  Returns:
    :class:`Interactions` in file order.

  Example:
    >>> data = load_interactions("synthetic", num_users=10, num_items=50,
    ...                          interactions_per_user=8, seed=0)
    >>> data.num_items, bool(data.item.max() < 50)
    (50, True)
  """
  return get_source(name)(**options)
