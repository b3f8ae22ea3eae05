"""Paths of a run: one type, `etils.epath.Path`, for local folders and `gs://` alike.

The workdir, checkpoints, prepared data, `metrics.jsonl`, TensorBoard events,
profiler traces and `config.json` are all reached through `epath.Path`, which
reads and writes `gs://bucket/...` through fsspec (`gcsfs` must be installed;
`launch/tpu_vm.sh` installs it when a flag names a `gs://` path) and local
paths through `os`. A local path is made absolute once, here (orbax needs
absolute paths); a URI is kept exactly as given: `os.path.abspath` would make
`gs://bucket/run` into `$PWD/gs:/bucket/run`.
"""

from __future__ import annotations

import json
import os

from etils import epath


class WorkdirError(Exception):
  """The workdir (or a file of the run in it) cannot be used: one line, the path and why."""


# Filesystem packages a URI scheme needs (fsspec finds them by name).
REMOTE_PACKAGES = {"gs": "gcsfs", "gcs": "gcsfs", "s3": "s3fs"}


def is_remote(path: str | os.PathLike) -> bool:
  """Whether `path` is a URI (`gs://bucket/x`, `s3://...`) rather than a local path.

  >>> is_remote("gs://bucket/run"), is_remote("/tmp/run"), is_remote("runs/x")
  (True, False, False)
  """
  return "://" in os.fspath(path)


def as_path(path: str | os.PathLike) -> epath.Path:
  """`path` as an `epath.Path`: a URI kept as given, a local path made absolute.

  >>> str(as_path("gs://bucket/run") / "checkpoints")
  'gs://bucket/run/checkpoints'
  >>> as_path("runs/x").is_absolute()
  True
  """
  if is_remote(path):
    return epath.Path(os.fspath(path))
  return epath.Path(os.path.abspath(os.fspath(path)))


def check_remote(path: str | os.PathLike) -> None:
  """Raises `WorkdirError` (one line) when the filesystem package of URI `path` is missing.

  Without it, fsspec fails at the first read or write with an ImportError
  traceback, after the work that came before. The commands call it on every
  path flag before any work (a local path passes).
  """
  if not is_remote(path):
    return
  import fsspec  # pylint: disable=import-outside-toplevel
  scheme = os.fspath(path).split("://", 1)[0]
  try:
    fsspec.get_filesystem_class(scheme)
  except ImportError:
    package = REMOTE_PACKAGES.get(scheme, f"the fsspec implementation of {scheme}://")
    raise WorkdirError(f"{os.fspath(path)}: {scheme}:// paths need the {package} package, "
                       f"which is not installed (pip install {package})") from None
  except ValueError:
    raise WorkdirError(f"{os.fspath(path)}: {scheme}:// is not a filesystem fsspec knows; "
                       "expected a local path or gs://bucket/...") from None


def read_json(path: epath.Path, what: str) -> dict:
  """A JSON object file of the run (`what` names it), or one line saying what is wrong.

  Raises:
    WorkdirError: a folder at `path`, or text that is not a JSON object
      (truncated, or another program's).
  """
  if path.is_dir():
    raise WorkdirError(f"{path} is a folder; the run keeps its {what} there as a file: move "
                       "it away, or use another workdir")
  text = path.read_text()
  try:
    record = json.loads(text)
  except ValueError as error:
    raise WorkdirError(f"{path} is not JSON ({error}; {len(text)} bytes): the run's {what} "
                       "is damaged (truncated, or written by something else)") from None
  if not isinstance(record, dict):
    raise WorkdirError(f"{path} holds JSON {type(record).__name__}, not the run's {what}")
  return record


def check_run_files(workdir: str | os.PathLike, files: tuple[str, ...],
                    folders: tuple[str, ...]) -> None:
  """Raises `WorkdirError` when a file of a local run is a folder, or a folder a file.

  A `metrics.jsonl` or `trainer.lock` that is a folder would otherwise fail
  deep inside a write, after data preparation and state creation.
  """
  if is_remote(workdir):
    return
  for name in files:
    target = os.path.join(os.fspath(workdir), name)
    if os.path.isdir(target):
      raise WorkdirError(f"{target} is a folder; the run keeps a file of that name there: "
                         "move it away, or use another --workdir")
  for name in folders:
    target = os.path.join(os.fspath(workdir), name)
    if os.path.lexists(target) and not os.path.isdir(target):
      raise WorkdirError(f"{target} is a file; the run keeps a folder of that name there: "
                         "move it away, or use another --workdir")


def write_error(folder: str | os.PathLike) -> str | None:
  """Why a file cannot be written in local `folder` (one short reason), or None.

  Writes and removes a probe file: permission bits alone do not tell (root,
  read-only mounts, full disks).
  """
  probe = os.path.join(os.fspath(folder), f".write-test-{os.getpid()}")
  try:
    with open(probe, "w", encoding="utf-8") as file:
      file.write("ok")
    os.unlink(probe)
  except OSError as error:
    return str(error.strerror or error)
  return None
