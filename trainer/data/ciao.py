"""Ciao (Tang et al., 2012): product ratings with times, 105,114 items.

A public dataset of more than 10^5 items with real event times, small enough
to train on two CPU cores: 7,375 users rated 105,114 products 284,086 times
between May 2000 and April 2011 (the catalog-scale benchmark's real data,
docs/data.md and docs/results.md). Users download it themselves (the
distributor asks that it be cited; it is not shipped with this project): the
MATLAB file ``rating_with_timestamp.mat`` of Jiliang Tang's "trust" datasets
(the Ciao release with timestamps). Its one variable, ``rating``, is an
integer matrix with one row per rating and six columns:

    user id, product id, category id, rating (1-5), helpfulness, time (Unix s)

Every rating counts as an interaction (implicit feedback, as for
MovieLens): user id, product id and time are kept, the rest is not read.
The times are whole days (many of a user's ratings share one); the file is in
time order and preprocessing sorts stably, so ratings of one day keep file
order.

Epinions, released beside it in the same format, stores 11 time slots in the
last column instead of times; it has no order within a slot and is refused
here (``DataError``) rather than read as a sequence.
"""

from __future__ import annotations

import hashlib
import os
import pathlib

from absl import logging
import numpy as np

from trainer.data import movielens, sources

FILE_NAME = "rating_with_timestamp.mat"
VARIABLE = "rating"
USER, ITEM, TIME = 0, 1, 5
COLUMNS = 6
# The file this project measured (docs/data.md): sha256 of its bytes.
SHA256 = "488e9aa5f60e6a52a972795b6402f922fc0d9d273152f4d124a5c5bdefb86a71"
# Any Unix time after 1980-01-01; Epinions' slots are 1..11.
_MIN_UNIX_TIME = 315_532_800


def default_path() -> str:
  """``$CUTBCE_DATA/ciao``, else ``~/.cache/cutbce/ciao`` (``~`` kept: a config
  holding it names no one's home): where configs look."""
  return os.path.join(os.environ.get(movielens.CACHE_ENV) or "~/.cache/cutbce", "ciao")


def resolve_ciao(path: str | os.PathLike) -> pathlib.Path:
  """The ``.mat`` file: ``path`` itself, or ``path/rating_with_timestamp.mat``.

  Raises:
    FileNotFoundError: neither exists; the message says where to get it.
  """
  path = pathlib.Path(path).expanduser()
  file = path / FILE_NAME if path.is_dir() else path
  if not file.is_file():
    raise FileNotFoundError(
        f"{file} not found; expected Ciao's {FILE_NAME} (Tang et al. 2012, the "
        "Ciao release with timestamps; docs/data.md says where to get it), or a "
        "folder holding it")
  return file


def load_ciao(path: str | os.PathLike) -> sources.Interactions:
  """Loads Ciao's ratings as interactions.

  Args:
    path: ``rating_with_timestamp.mat``, or a folder holding it.

  Returns:
    Interactions in file order: Ciao's user and product ids, times in Unix
    seconds.

  A file whose bytes differ from the one this project measured (``SHA256``)
  is read all the same, with a warning: its results are not comparable with
  docs/results.md's Ciao rows.

  Raises:
    FileNotFoundError: no such file.
    DataError: not a MATLAB file with an integral ``rating`` matrix of six
      columns, a negative id, or a last column that holds no Unix times
      (Epinions' 11 time slots).
  """
  from scipy import io as scipy_io  # pylint: disable=import-outside-toplevel
  file = resolve_ciao(path)
  try:
    found = sorted(name for name, _, _ in scipy_io.whosmat(file))
    if VARIABLE not in found:
      raise sources.DataError(
          f"{file}: no variable {VARIABLE!r}; found {found}, expected Ciao's ratings")
    rating = scipy_io.loadmat(file, variable_names=[VARIABLE])[VARIABLE]
  except sources.DataError:
    raise
  except Exception as error:  # pylint: disable=broad-except
    # scipy's reader fails on a file of other bytes in many ways (ValueError,
    # IndexError on a short one, ...): each means the same to a user.
    raise sources.DataError(f"{file}: not a readable MATLAB file "
                            f"({type(error).__name__}: {error})") from error
  if rating.ndim != 2 or rating.shape[1] != COLUMNS or rating.shape[0] == 0:
    raise sources.DataError(
        f"{file}: {VARIABLE!r} has shape {rating.shape}; expected [ratings, {COLUMNS}] "
        "(user, product, category, rating, helpfulness, time)")
  if rating.dtype.kind == "f":  # MATLAB's default type: whole numbers only
    try:
      rating = np.stack([sources.float_to_int_ids(rating[:, column], f"column {column}")
                         for column in range(COLUMNS)], axis=1)
    except ValueError as error:
      raise sources.DataError(f"{file}: {VARIABLE!r} {error}") from error
  elif rating.dtype.kind not in "iu":
    raise sources.DataTypeError(
        f"{file}: {VARIABLE!r} holds {rating.dtype}; expected integers")
  rating = rating.astype(np.int64)
  for column, name in ((USER, "user"), (ITEM, "product")):
    if int(rating[:, column].min()) < 0:
      raise sources.DataError(f"{file}: a negative {name} id in column {column}")
  times = rating[:, TIME]
  if int(times.min()) < _MIN_UNIX_TIME:
    raise sources.DataError(
        f"{file}: column {TIME} holds {int(times.min())}..{int(times.max())}, not Unix "
        "times (Epinions' file stores 11 time slots there: no order within a slot)")
  digest = hashlib.sha256(file.read_bytes()).hexdigest()
  if digest != SHA256:
    logging.warning("%s: sha256 %s, not the file docs/data.md measured (%s...): its "
                    "results are not comparable with docs/results.md's Ciao rows",
                    file, digest, SHA256[:12])
  return sources.Interactions(
      user=rating[:, USER], item=rating[:, ITEM], timestamp=times, name="ciao")
