"""Prepared data and metrics.jsonl appear whole or not at all.

Prepared data is computed in a staging folder beside `out` and moved in
once complete (trainer/data/prepare.py, `staged`); metrics.jsonl records are
appended whole, a torn last line is cut on restart and skipped by the
reader (trainer/workdir/logs.py). The crash cases run in a subprocess killed with
SIGKILL at a chosen point.
"""

import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from trainer.workdir import logs, outputs
from trainer.data import prepare, storage

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
COLUMNS = {"user_col": "user", "item_col": "item", "time_col": "ts"}


def _csv(path, num_items: int):
  rows = [f"u{user},i{(user + event) % num_items},{100 * user + event}"
          for user in range(10) for event in range(5)]
  path.write_text("user,item,ts\n" + "\n".join(rows) + "\n")
  return path


def _prepare(raw, out, **kwargs):
  return prepare.prepare_dataset("files", out, min_item_count=1, seq_lens=(4,),
                                 source_options={"path": str(raw), **COLUMNS}, **kwargs)


def _files(folder):
  return {name: (folder / name).read_bytes() for name in sorted(os.listdir(folder))}


def test_a_new_folder_appears_whole(tmp_path, monkeypatch):
  raw = _csv(tmp_path / "plays.csv", 7)
  out = tmp_path / "prepared"
  seen = []
  real_write = storage.write_prepared

  def write_then_look(folder, *args, **kwargs):
    written = real_write(folder, *args, **kwargs)
    seen.append(os.path.exists(out))  # every file written, still nothing at `out`
    return written

  monkeypatch.setattr(storage, "write_prepared", write_then_look)
  _prepare(raw, out, engine="memory")
  assert seen == [False]
  assert storage.load_prepared(out).num_items == 7
  assert sorted(os.listdir(tmp_path)) == ["plays.csv", "prepared"]  # no staging left


def test_a_failed_preparation_leaves_no_partial_array(tmp_path, monkeypatch):
  raw = _csv(tmp_path / "plays.csv", 7)
  out = tmp_path / "prepared"
  _prepare(raw, out, engine="memory")
  old = _files(out)
  real_save = np.save
  saved = []

  def dying_save(file, array, **kwargs):
    saved.append(1)
    if len(saved) == 3:
      raise OSError("disk gone")
    real_save(file, array, **kwargs)

  monkeypatch.setattr(storage.np, "save", dying_save)
  with pytest.raises(OSError, match="disk gone"):
    _prepare(_csv(tmp_path / "plays.csv", 9), out, engine="memory")
  # The old arrays untouched (only the manifest is set aside: the folder is
  # marked incomplete, yet still known as a preparation's, issue 41), nothing
  # of the new preparation in or beside it.
  old[outputs.RETIRED] = old.pop(storage.MANIFEST)
  assert _files(out) == old
  assert sorted(os.listdir(tmp_path)) == ["plays.csv", "prepared"]


@pytest.mark.parametrize("engine", ["memory", "duckdb"])
def test_preparing_again_swaps_in_the_new_data_beside_other_files(engine, tmp_path):
  out = tmp_path / "prepared"
  _prepare(_csv(tmp_path / "plays.csv", 7), out, engine=engine)
  (out / ".lock").write_text("")  # prepare.host_lock's file stays
  manifest = _prepare(_csv(tmp_path / "plays.csv", 9), out, engine=engine)
  assert manifest["num_items"] == 9 and storage.load_prepared(out).num_items == 9
  assert (out / ".lock").exists()
  assert sorted(os.listdir(tmp_path)) == ["plays.csv", "prepared"]


def test_a_killed_preparation_leaves_its_staging_to_the_next(tmp_path):
  """SIGKILL while the data is computed: `out` never appears; the next run cleans up."""
  raw = _csv(tmp_path / "plays.csv", 7)
  out = tmp_path / "prepared"
  script = (
      "import os, signal, sys\n"
      "from trainer.data import prepare, storage\n"
      "def die(*args, **kwargs): os.kill(os.getpid(), signal.SIGKILL)\n"
      "storage.write_prepared = die\n"
      f"prepare.prepare_dataset('files', {str(out)!r}, min_item_count=1, engine='memory',\n"
      f"    source_options=dict(path={str(raw)!r}, **{COLUMNS!r}))\n")
  done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                        timeout=120, check=False)
  assert done.returncode == -signal.SIGKILL, done.stderr[-2000:]
  left = sorted(os.listdir(tmp_path))
  assert "prepared" not in left and any(name.startswith(".prepared.preparing-") for name in left)
  _prepare(raw, out, engine="memory")
  assert sorted(os.listdir(tmp_path)) == ["plays.csv", "prepared"]


# --------------------------------------------------------------------------- #
# metrics.jsonl                                                                #
# --------------------------------------------------------------------------- #


def test_a_torn_last_line_is_skipped_by_the_reader_and_cut_on_restart(tmp_path, caplog):
  writer = logs.MetricWriter(tmp_path)
  writer.write(1, "train", {"loss": 2.0})
  writer.write(2, "train", {"loss": 1.5})
  writer.close()
  path = tmp_path / "metrics.jsonl"
  with open(path, "ab") as file:
    file.write(b'{"step": 3, "kind": "tra')  # a crash mid-record
  assert [r["step"] for r in logs.read_metrics(tmp_path)] == [1, 2]
  assert "skipped line 3" in caplog.text
  writer = logs.MetricWriter(tmp_path)  # the restart cuts the torn line off
  assert "dropped a torn last line of 24 bytes" in caplog.text
  writer.write(3, "train", {"loss": 1.0})
  writer.close()
  lines = path.read_text().splitlines()
  assert [json.loads(line)["step"] for line in lines] == [1, 2, 3]
  assert [r["loss"] for r in logs.read_metrics(tmp_path, "train")] == [2.0, 1.5, 1.0]


def test_each_record_is_one_write_of_a_whole_line(tmp_path, monkeypatch):
  """The file is unbuffered and each record goes out in one write call, newline included."""
  writes = []
  writer = logs.MetricWriter(tmp_path)
  real = writer._jsonl.write  # pylint: disable=protected-access

  class Recording:
    def write(self, data):
      writes.append(bytes(data))
      return real(data)

    def close(self):
      writer._jsonl_file.close()  # pylint: disable=protected-access

  writer._jsonl_file = writer._jsonl  # pylint: disable=protected-access
  writer._jsonl = Recording()  # pylint: disable=protected-access
  big = {f"metric_{index}": float(index) for index in range(400)}  # a ~9 KB record
  writer.write(7, "eval/test", big)
  writer.write(8, "train", {"loss": 0.5})
  assert len(writes) == 2 and all(w.endswith(b"\n") and w.count(b"\n") == 1 for w in writes)
  assert len(writes[0]) > 8192
  # Nothing waits in a buffer: the file holds both records before close.
  assert [r["step"] for r in logs.read_metrics(tmp_path)] == [7, 8]
  writer.close()
