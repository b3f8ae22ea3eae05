"""Interaction sources: what every dataset loader returns, and the registry.

A source yields raw interactions ``(user, item, timestamp)`` in file order, as
three integer arrays of one length. Ids are raw (not yet dense); preprocessing
(:mod:`trainer.data.preprocess`) remaps them to ``[0, U)`` and ``[0, V)``.
String ids travel as integer codes plus a vocabulary (``user_vocab``,
``item_vocab``: the raw id of code c is ``vocab[c]``); :func:`factorize` makes
both.

Sources:

* ``ml-1m``, ``ml-100k``: MovieLens read out of registry wheels
  (:mod:`trainer.data.movielens`).
* ``files``: your own parquet, CSV, TSV or JSON lines files, with the
  column names given (:mod:`trainer.data.files`).
* ``yambda``: the Yambda parquet files from a local folder, a preset of
  ``files`` (:mod:`trainer.data.yambda`).
* ``ciao``: Ciao's ratings with times (105,114 items), from the MATLAB file
  users download (:mod:`trainer.data.ciao`).
* ``synthetic``: Zipf popularity with planted transitions
  (:mod:`trainer.data.synthetic`).
* ``synthetic_topics``: latent topics with drifting user interest, popularity,
  history lengths and repeats measured on ML-1M
  (:mod:`trainer.data.synthetic_topics`).
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Mapping
from types import MappingProxyType

import numpy as np


class DataError(ValueError):
  """Raw data that cannot be read as interactions: a missing column, an empty
  table, a null or bad id, a value that is no time. The message is one line
  naming the file and the column; commands print it and exit with status 2."""


class DataTypeError(DataError, TypeError):
  """A column of a type that cannot hold what it should (float ids, ...)."""


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Interactions:
  """Raw interactions in file order.

  Attributes:
    user: int ``[n]`` raw user ids, >= 0, or codes into ``user_vocab``.
    item: int ``[n]`` raw item ids, >= 0, or codes into ``item_vocab``.
    timestamp: int64 ``[n]`` event times (any integer unit; only order matters,
      except for the temporal split whose windows are in the same unit).
    num_items: catalog size when the raw item ids are already dense in
      ``[0, num_items)`` (the synthetic source), else None. Lets preprocessing
      keep items that never occur (``min_item_count=0``).
    name: short description of where the data came from.
    user_vocab: None (``user`` holds the raw ids), or ``[K]`` distinct raw
      ids in increasing order (a numpy unicode ``<U`` array for string ids,
      or int64): ``user`` then holds codes in ``[0, K)`` and the raw id of
      code c is ``user_vocab[c]``.
    item_vocab: the same for ``item``.
  """

  user: np.ndarray
  item: np.ndarray
  timestamp: np.ndarray
  num_items: int | None = None
  name: str = ""
  user_vocab: np.ndarray | None = None
  item_vocab: np.ndarray | None = None

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
    for field in ("user", "item"):
      vocab = getattr(self, f"{field}_vocab")
      if vocab is not None:
        check_vocab(vocab, f"{field}_vocab")
        codes = getattr(self, field)
        if n and int(codes.max()) >= vocab.shape[0]:
          raise ValueError(
              f"{field} code {int(codes.max())} >= {field}_vocab size "
              f"{vocab.shape[0]}; expected codes into the vocabulary")
    if self.num_items is not None and n and int(self.item.max()) >= self.num_items:
      raise ValueError(
          f"item id {int(self.item.max())} >= declared num_items {self.num_items}")

  def __len__(self) -> int:
    return int(self.user.shape[0])


def check_vocab(vocab: np.ndarray, name: str) -> None:
  """Raises unless ``vocab`` is 1-D unicode or int64, strictly increasing.

  Raises:
    TypeError: not a numpy array of a unicode (``<U``) or int64 dtype.
    ValueError: not 1-D, or a repeated or unsorted entry.
  """
  if not isinstance(vocab, np.ndarray) or vocab.dtype.kind not in "Ui" or (
      vocab.dtype.kind == "i" and vocab.dtype != np.int64):
    raise TypeError(
        f"{name} must be a numpy unicode (<U) or int64 array, got "
        f"{getattr(vocab, 'dtype', type(vocab).__name__)}")
  if vocab.ndim != 1:
    raise ValueError(f"{name} must be 1-D, got shape {vocab.shape}")
  if vocab.shape[0] > 1:
    bad = ~(vocab[1:] > vocab[:-1])
    if bad.any():
      index = int(np.argmax(bad))
      raise ValueError(
          f"{name} must be strictly increasing, found {vocab[index].item()!r} then "
          f"{vocab[index + 1].item()!r} at {index}")


def factorize(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """Codes and sorted vocabulary of raw ids: ``vocab[codes] == values``.

  Args:
    values: ``[n]`` raw ids (strings or integers).

  Returns:
    ``(codes, vocab)``: int64 ``[n]`` and ``[K]`` distinct values in
    increasing order (``<U`` for strings, int64 for integers).

  Example:
    >>> codes, vocab = factorize(np.array(["b", "a", "b"]))
    >>> codes.tolist(), vocab.tolist()
    ([1, 0, 1], ['a', 'b'])
  """
  vocab, codes = np.unique(np.asarray(values), return_inverse=True)
  if vocab.dtype.kind in "iu":
    vocab = vocab.astype(np.int64)
  elif vocab.dtype.kind != "U":
    vocab = vocab.astype(str)
  return codes.reshape(-1).astype(np.int64), vocab


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
    "files": "trainer.data.files:load_files",
    "synthetic_topics": "trainer.data.synthetic_topics:generate_topics",
    "ciao": "trainer.data.ciao:load_ciao",
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
      ``event`` for Yambda, ``path`` for Ciao, ``path`` and the column names for
      files, sizes
      and ``seed`` for synthetic).

  Returns:
    :class:`Interactions` in file order.

  Example:
    >>> data = load_interactions("synthetic", num_users=10, num_items=50,
    ...                          interactions_per_user=8, seed=0)
    >>> data.num_items, bool(data.item.max() < 50)
    (50, True)
  """
  return get_source(name)(**options)
