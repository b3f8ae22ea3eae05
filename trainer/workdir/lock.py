"""A usable workdir, held by one trainer at a time: WORKDIR/trainer.lock.

`acquire(workdir)` runs before anything is written to the workdir:

* the workdir must be (or become) a writable directory: a path that is a
  file, or a directory this user cannot write, is one line
  (`WorkdirError`), not an orbax traceback;
* a second trainer on a live workdir is refused, in one line naming the
  holder's pid and host. The lock is an advisory `flock` on
  WORKDIR/trainer.lock, which the kernel releases when the holding process
  ends in any way (kill -9 included), so a crashed run never leaves it stuck;
  the file keeps the last holder's pid and host for the message.

Local workdirs only: on object storage (gs://) there is no flock and no
write test (the multi-host launcher gives each run its own folder). Only
process 0 takes the lock (the processes of one run share the workdir).
"""

from __future__ import annotations

import errno
import json
import os
import socket
import time

from trainer.workdir import paths

FILE = "trainer.lock"


WorkdirError = paths.WorkdirError  # the workdir cannot be used: one line, the path and why

# The files and folders a run keeps in its workdir (checked before anything is written).
RUN_FILES = ("config.json", "data_fingerprint.json", FILE, "metrics.jsonl")
RUN_FOLDERS = ("checkpoints",)


class Lock:
  """A held lock; `release()` (or process exit) frees it."""

  def __init__(self, descriptor: int | None):
    self._descriptor = descriptor

  def release(self) -> None:
    if self._descriptor is not None:
      os.close(self._descriptor)  # closing drops the flock
      self._descriptor = None


def check_usable(workdir: str | os.PathLike) -> None:
  """Creates `workdir` if needed; raises unless it is a directory this user can write.

  Raises:
    WorkdirError: a file there, a parent that is a file, or no permission.
  """
  path = os.fspath(workdir)
  if os.path.exists(path) and not os.path.isdir(path):
    raise WorkdirError(f"--workdir={path}: a directory (this path is a file)")
  try:
    os.makedirs(path, exist_ok=True)
  except OSError as error:
    raise WorkdirError(f"--workdir={path}: cannot create it ({error.strerror or error})") from None
  reason = paths.write_error(path)
  if reason is not None:
    raise WorkdirError(f"--workdir={path}: not writable ({reason})")
  paths.check_run_files(path, RUN_FILES, RUN_FOLDERS)


def holder(workdir: str | os.PathLike) -> dict:
  """The pid, host and start time last written to the lock file (empty if none)."""
  try:
    with open(os.path.join(os.fspath(workdir), FILE), encoding="utf-8") as file:
      return json.loads(file.read() or "{}")
  except (OSError, ValueError):
    return {}


def acquire(workdir: str | os.PathLike, *, process_index: int = 0) -> Lock:
  """Checks the workdir and takes its lock (process 0 of a local workdir).

  Raises:
    WorkdirError: an unusable workdir, or one another live trainer holds.
  """
  paths.check_remote(workdir)  # gs:// without gcsfs: one line now, not at the first write
  if paths.is_remote(workdir) or process_index != 0:
    return Lock(None)
  import fcntl  # pylint: disable=import-outside-toplevel  (POSIX only)
  check_usable(workdir)
  target = os.path.join(os.fspath(workdir), FILE)
  descriptor = os.open(target, os.O_RDWR | os.O_CREAT, 0o644)
  try:
    fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
  except OSError as error:
    os.close(descriptor)
    if error.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
      raise WorkdirError(f"--workdir={workdir}: cannot lock {FILE} ({error.strerror})") from None
    who = holder(workdir)
    since = (time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(who["started"]))
             if isinstance(who.get("started"), (int, float)) else "an unknown time")
    raise WorkdirError(
        f"--workdir={workdir} is in use by another trainer (pid {who.get('pid', '?')} on "
        f"host {who.get('host', '?')}, since {since}; {FILE}): wait for it or stop it, or "
        "use another --workdir") from None
  record = json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                       "started": time.time()}).encode()
  os.ftruncate(descriptor, 0)
  os.pwrite(descriptor, record, 0)
  return Lock(descriptor)
