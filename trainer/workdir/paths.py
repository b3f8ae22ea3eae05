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

import os

from etils import epath


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
