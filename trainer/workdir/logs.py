"""Training logs: progress lines, `WORKDIR/metrics.jsonl` and TensorBoard events.

Only process 0 writes files; every process may print. Each JSONL line is one
object with `step`, a `kind` ("train" or "eval/<split>") and the metric names.

The workdir may be local or `gs://...`; both files are written through
`etils.epath`. An object in a bucket cannot be appended to, so on object
storage each file is kept in memory and rewritten whole, at most every
`REMOTE_FLUSH_SECONDS` and when the writer closes (a crash loses at most that
much); locally every record is appended whole, one `write` of the encoded
line to a file opened unbuffered for appending, so a crash can tear at most
the last line, never interleave two. A restart reads back the
`metrics.jsonl` it continues; a torn last line (no newline: a crash while it
was written) is cut off first, with a warning, so the next record starts on
a line of its own. `read_metrics` is the reader: it skips a line that is not
a whole record, with a warning. TensorBoard event files of a remote
workdir go through the same path (`_ObjectEventFile`, registered as
tensorboardX's writer for the scheme) rather than tensorboardX's own GCS
client.
"""

from __future__ import annotations

import io
import json
import os
import threading
import time

import jax
from absl import logging
from etils import epath

from trainer.workdir import paths

# Seconds between two uploads of the log files to object storage.
REMOTE_FLUSH_SECONDS = 30.0


def format_duration(seconds: float) -> str:
  seconds = int(max(seconds, 0))
  hours, rest = divmod(seconds, 3600)
  minutes, seconds = divmod(rest, 60)
  return f"{hours}:{minutes:02d}:{seconds:02d}"


class _ObjectEventFile:
  """A TensorBoard event file on object storage: bytes kept here, rewritten whole on flush.

  What tensorboardX's `RecordWriter` needs of a file (`write`, `flush`,
  `close`), through `epath`; tensorboardX calls it from its writer thread too.
  """

  def __init__(self, path: str):
    self._path = epath.Path(path)
    self._buffer = io.BytesIO()
    self._uploaded = 0
    self._lock = threading.Lock()

  def write(self, data: bytes) -> None:
    with self._lock:
      self._buffer.write(data)

  def flush(self) -> None:
    with self._lock:
      if self._buffer.tell() != self._uploaded:
        self._path.write_bytes(self._buffer.getvalue())
        self._uploaded = self._buffer.tell()

  def close(self) -> None:
    self.flush()


class _ObjectEventFiles:
  """tensorboardX writer factory (`record_writer.register_writer_factory`) over `epath`."""

  def open(self, path: str) -> _ObjectEventFile:
    return _ObjectEventFile(path)

  def directory_check(self, path: str) -> None:
    epath.Path(path).mkdir(parents=True, exist_ok=True)


def _append(file, data: bytes) -> None:
  """Appends `data` with as few writes as the OS allows (one, for a line of a few KB)."""
  view = memoryview(data)
  while view:
    view = view[file.write(view):]


def drop_torn_tail(path: str | os.PathLike) -> int:
  """Cuts a local JSONL file after its last newline; returns the bytes dropped.

  A last line without its newline was being written when the writer died:
  it is not a record. Logged as a warning when there is one.
  """
  path = os.fspath(path)
  if not os.path.isfile(path) or os.path.getsize(path) == 0:
    return 0
  with open(path, "rb+") as file:
    size = file.seek(0, os.SEEK_END)
    keep, block = size, 4096
    while keep > 0:  # the end of the last whole line, read backwards
      start = max(0, keep - block)
      file.seek(start)
      newline = file.read(keep - start).rfind(b"\n")
      if newline >= 0:
        keep = start + newline + 1
        break
      keep = start
    if keep == size:
      return 0
    file.truncate(keep)
  logging.warning("%s: dropped a torn last line of %d bytes (a crash while it was written)",
                  path, size - keep)
  return size - keep


def read_metrics(workdir: str | os.PathLike, kind: str | None = None) -> list[dict]:
  """The records of `WORKDIR/metrics.jsonl` (of one `kind` if given), in file order.

  A line that is not a whole JSON object is skipped with a warning naming
  it: a torn last line (a crash while it was written), or, in a file an
  older writer continued after such a crash, the torn line joined to the
  next record.
  """
  path = paths.as_path(workdir) / "metrics.jsonl"
  if not path.exists():
    return []
  records = []
  for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
    try:
      record = json.loads(line)
    except json.JSONDecodeError:
      record = None
    if not isinstance(record, dict):
      logging.warning("%s: skipped line %d, not a whole record (a crash while it was "
                      "written?): %r", path, number, line[:80])
      continue
    if kind is None or record.get("kind") == kind:
      records.append(record)
  return records


class MetricWriter:
  """Writes scalars to `WORKDIR/metrics.jsonl` and TensorBoard (process 0 only).

  Args:
    workdir: the run's directory, local or `gs://...`.
  """

  def __init__(self, workdir: str | os.PathLike):
    self._enabled = jax.process_index() == 0
    self._jsonl = None
    self._tensorboard = None
    if not self._enabled:
      return
    workdir = paths.as_path(workdir)
    self._remote = paths.is_remote(workdir)
    self._jsonl_path = workdir / "metrics.jsonl"
    self._last_flush = time.monotonic()
    workdir.mkdir(parents=True, exist_ok=True)
    if self._remote:  # Rewritten whole: start from what a previous start wrote.
      self._lines = self._jsonl_path.read_text() if self._jsonl_path.exists() else ""
      self._unflushed = False
    else:
      drop_torn_tail(self._jsonl_path)
      # Unbuffered: each record is one write() of the whole line (see `_append`).
      self._jsonl = open(self._jsonl_path, "ab", buffering=0)  # pylint: disable=consider-using-with
    try:
      import tensorboardX  # pylint: disable=import-outside-toplevel
      from tensorboardX import record_writer  # pylint: disable=import-outside-toplevel
      if self._remote:
        scheme = os.fspath(workdir).split("://", 1)[0]
        record_writer.register_writer_factory(scheme, _ObjectEventFiles())
      self._tensorboard = tensorboardX.SummaryWriter(
          os.fspath(workdir / "tensorboard"),
          flush_secs=int(REMOTE_FLUSH_SECONDS) if self._remote else 120)
    except ImportError:  # pragma: no cover
      logging.warning("tensorboardX is not installed: no TensorBoard event files")

  def write(self, step: int, kind: str, metrics: dict[str, float]) -> None:
    if not self._enabled:
      return
    record = {"step": int(step), "kind": kind}
    record.update({name: float(value) for name, value in metrics.items()})
    line = json.dumps(record) + "\n"
    if self._remote:
      self._lines += line
      self._unflushed = True
    else:
      _append(self._jsonl, line.encode("utf-8"))
    if self._tensorboard is not None:
      for name, value in metrics.items():
        self._tensorboard.add_scalar(f"{kind}/{name}", float(value), int(step))
    if not self._remote or time.monotonic() - self._last_flush >= REMOTE_FLUSH_SECONDS:
      self.flush()

  def flush(self) -> None:
    """Writes out what is buffered (a local file: flushed; a remote one: uploaded)."""
    if not self._enabled:
      return
    if self._remote:
      if self._unflushed:
        self._jsonl_path.write_text(self._lines)
        self._unflushed = False
    if self._tensorboard is not None:
      self._tensorboard.flush()
    self._last_flush = time.monotonic()

  def close(self) -> None:
    if not self._enabled:
      return
    self.flush()
    if self._jsonl is not None:
      self._jsonl.close()
    if self._tensorboard is not None:
      self._tensorboard.close()
    self._enabled = False


class Progress:
  """Rates and ETA between progress lines."""

  def __init__(self, start_step: int, total_steps: int, global_batch: int):
    self._total = total_steps
    self._batch = global_batch
    self._last_step = start_step
    self._last_time = time.perf_counter()

  def line(self, step: int, loss: float, extra: str = "") -> tuple[str, dict[str, float]]:
    now = time.perf_counter()
    elapsed = max(now - self._last_time, 1e-9)
    steps_per_second = (step - self._last_step) / elapsed
    self._last_step, self._last_time = step, now
    eta = (self._total - step) / steps_per_second if steps_per_second > 0 else 0.0
    rates = {"steps_per_second": steps_per_second,
             "examples_per_second": steps_per_second * self._batch}
    text = (f"step {step}/{self._total}  loss {loss:.4f}  {steps_per_second:.2f} steps/s  "
            f"{rates['examples_per_second']:.1f} examples/s  ETA {format_duration(eta)}{extra}")
    return text, rates


def say(message: str) -> None:
  """Logs on every process (absl) and prints on process 0 (stdout)."""
  logging.info("%s", message)
  if jax.process_index() == 0:
    print(message, flush=True)
