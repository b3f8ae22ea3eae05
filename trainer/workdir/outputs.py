"""What a command may write, and where: nothing that existed is changed unless named as output.

Files (`recommend --out`, and any other single-file output):

* a new path, or an existing regular file (replaced whole: written beside it,
  then renamed onto it). A device (`/dev/null`, `/dev/full`), a FIFO, a
  socket or a folder is refused: renaming a file over it would replace the
  device node or leave a FIFO's reader waiting forever.
* a symlink is refused: the rename would replace the link and leave its
  target as it was. Name the target itself (`realpath LINK`) to write it.
* never a file of a run: `config.json`, `data_fingerprint.json`,
  `trainer.lock`, `metrics.jsonl` of the run the command reads, or anything
  under its `checkpoints/` or prepared-data folder (`protected`).

Folders (`export --out`, `trainer.data --out`, `WORKDIR/data`):

* a new path, an empty folder, or one this kind of command wrote before:
  its manifest (`manifest.json`, or the one a stopped run left retired as
  `.manifest.json.previous`) parses as JSON and carries the command's format
  tag (`cutbce-export`, `cutbce-prepared`). A folder holding anything else
  (a user's files, another tool's manifest, a manifest that is not JSON) is
  refused with the names of a few of its files; nothing in it is deleted.
* a symlink to a folder is followed (a run's data on another disk): the
  files go into the folder it points to.
* a manifest is never deleted before new files are written: it is retired
  (renamed to `.manifest.json.previous`, keeping its tag), so a folder whose
  writer was killed is still known as that writer's.

Local paths only; a `gs://` path is not checked (object storage has no
devices, FIFOs or links). Every refusal is a `ConfigError`: one line naming
the flag, the path and what to do.
"""

from __future__ import annotations

import json
import os
import re
import stat
from collections.abc import Iterable

from trainer.config.schema import ConfigError
from trainer.workdir import lock, paths

# What a run keeps in its workdir: a command never writes over these.
RUN_FILES = lock.RUN_FILES
RUN_FOLDERS = lock.RUN_FOLDERS + ("data",)
MANIFEST = "manifest.json"
RETIRED = ".manifest.json.previous"  # a manifest set aside while its folder is rewritten
# A writer's temporary file (`.<name>.tmp-<pid>`), left by one that was killed.
_TEMPORARY = re.compile(r"^\..+\.tmp-\d+$")


def run_paths(workdir: str | os.PathLike, prepared_dir: str | os.PathLike | None = None
              ) -> tuple[str, ...]:
  """The files and folders of the run in `workdir` that no command output may be."""
  if paths.is_remote(workdir):
    return ()
  root = os.fspath(workdir)
  found = [os.path.join(root, name) for name in RUN_FILES + RUN_FOLDERS]
  if prepared_dir is not None and not paths.is_remote(prepared_dir):
    found.append(os.fspath(prepared_dir))
  return tuple(os.path.realpath(path) for path in found)


def _inside(path: str, protected: Iterable[str]) -> str | None:
  """The protected path that `path` is or lies under (real paths), or None."""
  real = os.path.realpath(path)
  for other in protected:
    if real == other or real.startswith(other.rstrip(os.sep) + os.sep):
      return other
  return None


def _kind(mode: int) -> str:
  if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
    return "a device file"
  if stat.S_ISFIFO(mode):
    return "a FIFO"
  if stat.S_ISSOCK(mode):
    return "a socket"
  if stat.S_ISDIR(mode):
    return "a folder"
  return "not a regular file"


def check_file(path: str | os.PathLike, flag: str = "--out", *,
               protected: Iterable[str] = ()) -> None:
  """Refuses a file output that would change something not named as the output.

  Raises:
    ConfigError: `path` is a symlink, a device, a FIFO, a socket or a folder,
      or one of `protected` (see `run_paths`) or under one of them.
  """
  if paths.is_remote(path):
    return
  text = os.fspath(path)
  try:
    mode = os.lstat(text).st_mode
  except (FileNotFoundError, NotADirectoryError):  # a new path (its folder is checked next)
    mode = None
  if mode is not None and stat.S_ISLNK(mode):
    raise ConfigError(f"{flag}={text}: a symlink (to {os.path.realpath(text)}): writing would "
                      "replace the link, not its target; name the target itself, or a new path")
  if mode is not None and not stat.S_ISREG(mode):
    what = _kind(mode)
    if what == "a folder":
      raise ConfigError(f"{flag}={text}: a file to write (this path is a folder)")
    raise ConfigError(f"{flag}={text}: {what}; the output is written to a new path or a "
                      "regular file (replaced whole), never a device, FIFO or socket")
  owner = _inside(text, protected)
  if owner is not None:
    raise ConfigError(f"{flag}={text}: a file of the run ({owner}); name a path outside "
                      "the run's own files")


def _manifest_format(folder: str) -> str | None:
  """The format tag of `folder`'s manifest (or retired one); None when none parses."""
  for name in (MANIFEST, RETIRED):
    try:
      with open(os.path.join(folder, name), encoding="utf-8") as file:
        manifest = json.load(file)
    except (OSError, ValueError):
      continue
    if isinstance(manifest, dict) and isinstance(manifest.get("format"), str):
      return manifest["format"]
  return None


def check_folder(path: str | os.PathLike, flag: str = "--out", *, format_tag: str,
                 protected: Iterable[str] = (), ignore: Iterable[str] = ()) -> None:
  """Refuses a folder output that holds files its writer did not write.

  Args:
    path: the output folder (a symlink to a folder is followed).
    flag: named in the message.
    format_tag: the `format` of the writer's manifest.
    protected: real paths the output may not be or lie under (`run_paths`).
    ignore: names in the folder that do not count (a lock file, staging).

  Raises:
    ConfigError: a file at `path`, a protected path, or a folder holding
      other files than an earlier output of `format_tag`.
  """
  if paths.is_remote(path):
    return
  text = os.fspath(path)
  if os.path.exists(text) and not os.path.isdir(text):
    raise ConfigError(f"{flag}={text}: a folder (this path is a file)")
  owner = _inside(text, protected)
  if owner is not None:
    raise ConfigError(f"{flag}={text}: a folder of the run ({owner}); name a new or empty "
                      "folder outside the run's own files")
  if not os.path.isdir(text):
    return
  skipped = set(ignore)
  entries = sorted(name for name in os.listdir(text)
                   if name not in skipped and not _TEMPORARY.match(name))
  if not entries:
    return
  found = _manifest_format(text)
  if found == format_tag:
    return
  shown = ", ".join(entries[:5]) + (f" and {len(entries) - 5} more" if len(entries) > 5 else "")
  if found is None and MANIFEST in entries:
    why = f"its {MANIFEST} is not a {format_tag} manifest (not JSON, or no format tag)"
  elif found is not None:
    why = f"its {MANIFEST} is of format {found!r}, not {format_tag!r}"
  else:
    why = f"it holds files with no {format_tag} manifest"
  raise ConfigError(f"{flag}={text}: {why} ({shown}); nothing was changed: name a new or "
                    "empty folder, or one this command wrote")


def retire_manifest(folder: str | os.PathLike) -> None:
  """Sets `folder`'s manifest aside (as `RETIRED`) before its files are rewritten.

  The folder then reads as incomplete (no `manifest.json`) yet is still
  known as its writer's (`check_folder` reads the retired one).
  """
  target = paths.as_path(folder)
  manifest = target / MANIFEST
  if manifest.exists():
    manifest.replace(target / RETIRED)


def drop_retired(folder: str | os.PathLike) -> None:
  """Deletes the retired manifest once a new one is written."""
  (paths.as_path(folder) / RETIRED).unlink(missing_ok=True)
