"""Nothing that existed before a command is changed unless named as its output (issue 41).

Bad causes 3 and 4 and the workdir's ugly cases, each with variants:
`recommend --out` at a device, a FIFO, a symlink or a file of the run;
`export --out` and `trainer.data --out` at a folder of someone else's files
(a prepared-data folder, a user's `items.npy` and notes, another tool's or
a damaged manifest); a workdir whose files are folders or damaged; `gs://`
without gcsfs. Every refusal is one line and leaves everything as it was.
No training: the checks run before any checkpoint is opened.
"""

import json
import os
import re
import stat

import numpy as np
import pytest

from trainer.commands import export, recommend
from trainer.config import saved as saved_config
from trainer.data import __main__ as data_cli
from trainer.data import prepare, storage
from trainer.workdir import fingerprint, lock as workdir_lock, outputs, paths

SYNTHETIC = ["--dataset", "synthetic", "--num-users", "20", "--num-items", "40",
             "--interactions-per-user", "8", "--seq-len", "4"]


@pytest.fixture
def workdir(tmp_path):
  folder = tmp_path / "run"
  (folder / "checkpoints").mkdir(parents=True)
  (folder / "config.json").write_text('{"kept": true}\n')
  return folder


def _recommend(workdir, out, capsys):
  status = recommend.main(["recommend", f"--workdir={workdir}", "--top_k=3", f"--out={out}"])
  return status, capsys.readouterr().err.splitlines()


def _export(workdir, out, capsys):
  status = export.main(["export", f"--workdir={workdir}", f"--out={out}"])
  return status, capsys.readouterr().err.splitlines()


def _one_line(status, lines, *parts):
  assert status == 2 and len(lines) == 1, lines
  assert lines[0].startswith("bad config: --out="), lines
  for part in parts:
    assert part in lines[0], lines


# --------------------------------------------------------------------------- #
# recommend --out: only a new path or a regular file                           #
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("device", ["/dev/null", "/dev/full", "/dev/zero"])
def test_recommend_never_replaces_a_device(workdir, capsys, device):
  if not os.path.exists(device):
    pytest.skip(f"no {device} here")
  _one_line(*_recommend(workdir, device, capsys), "a device file")
  assert stat.S_ISCHR(os.stat(device).st_mode)


def test_recommend_never_replaces_a_fifo_or_a_socket(workdir, tmp_path, capsys):
  fifo = tmp_path / "pipe"
  os.mkfifo(fifo)
  _one_line(*_recommend(workdir, fifo, capsys), "a FIFO")
  assert stat.S_ISFIFO(os.lstat(fifo).st_mode)


@pytest.mark.parametrize("target_exists", [True, False])
def test_recommend_never_writes_through_a_symlink(workdir, tmp_path, capsys, target_exists):
  target, link = tmp_path / "real.jsonl", tmp_path / "link.jsonl"
  if target_exists:
    target.write_text("old\n")
  os.symlink(target, link)
  _one_line(*_recommend(workdir, link, capsys), "a symlink", "name the target itself")
  assert os.path.islink(link)
  assert (target.read_text() == "old\n") if target_exists else not target.exists()


@pytest.mark.parametrize("name", ["config.json", "metrics.jsonl", "data_fingerprint.json",
                                  "trainer.lock", "checkpoints/recs.jsonl", "data/items.npy"])
def test_recommend_never_writes_a_file_of_the_run(workdir, capsys, name):
  out = workdir / name
  before = out.read_text() if out.exists() else None
  _one_line(*_recommend(workdir, out, capsys), "a file of the run")
  assert (out.read_text() if out.exists() else None) == before
  # the same file named another way (a relative path through a symlinked folder)
  alias = workdir.parent / "alias"
  os.symlink(workdir, alias)
  _one_line(*_recommend(workdir, alias / name, capsys), "a file of the run")


def test_a_new_path_or_a_regular_file_passes(tmp_path):
  (tmp_path / "old.jsonl").write_text("x")
  outputs.check_file(tmp_path / "old.jsonl", protected=outputs.run_paths(tmp_path / "run"))
  outputs.check_file(tmp_path / "new" / "recs.jsonl")


# --------------------------------------------------------------------------- #
# export --out and trainer.data --out: a folder of someone else is refused     #
# --------------------------------------------------------------------------- #


def _prepared(folder):
  assert data_cli.main(SYNTHETIC + ["--out", str(folder)]) == 0
  return folder


def test_export_into_the_runs_prepared_data_is_refused(workdir, capsys):
  data = _prepared(workdir / "data")
  capsys.readouterr()
  before = sorted(os.listdir(data))
  _one_line(*_export(workdir, data, capsys), "a folder of the run")
  assert sorted(os.listdir(data)) == before and storage.load_prepared(data).num_items > 0


@pytest.mark.parametrize("files,why", [
    ({"manifest.json": '{"mine": 1}'}, "not a cutbce-export manifest"),
    ({"manifest.json": "not json at all"}, "not a cutbce-export manifest"),
    ({"manifest.json": '{"format": "cutbce-prepared"}', "items.npy": "x"},
     "of format 'cutbce-prepared'"),
    ({"notes.txt": "mine"}, "files with no cutbce-export manifest"),
])
def test_export_into_a_folder_of_foreign_files_is_refused(workdir, tmp_path, capsys, files,
                                                          why):
  out = tmp_path / "elsewhere"
  out.mkdir()
  for name, text in files.items():
    (out / name).write_text(text)
  _one_line(*_export(workdir, out, capsys), why, "nothing was changed")
  assert {name: (out / name).read_text() for name in os.listdir(out)} == files


def test_an_earlier_export_or_an_empty_folder_passes(tmp_path):
  (tmp_path / "empty").mkdir()
  outputs.check_folder(tmp_path / "empty", format_tag=export.FORMAT)
  (tmp_path / "old").mkdir()
  (tmp_path / "old" / "item_embeddings.npy").write_text("x")
  (tmp_path / "old" / outputs.RETIRED).write_text(json.dumps({"format": export.FORMAT}))
  outputs.check_folder(tmp_path / "old", format_tag=export.FORMAT)  # a stopped export's


@pytest.mark.parametrize("files", [
    {"items.npy": "the user's own", "notes.txt": "mine"},
    {"items.npy": "the user's own"},
    {"manifest.json": "{truncated"},
])
def test_prepare_never_writes_into_a_folder_of_foreign_files(tmp_path, capsys, files):
  out = tmp_path / "mine"
  out.mkdir()
  for name, text in files.items():
    (out / name).write_text(text)
  assert data_cli.main(SYNTHETIC + ["--out", str(out)]) == 2
  lines = capsys.readouterr().err.splitlines()
  assert len(lines) == 1 and lines[0].startswith(f"bad config: --out={out}: "), lines
  assert {name: (out / name).read_text() for name in os.listdir(out)} == files


def test_prepare_follows_a_symlinked_folder_and_reprepares_a_stopped_one(tmp_path, capsys):
  real = tmp_path / "other_disk" / "data"
  real.mkdir(parents=True)
  link = tmp_path / "data"
  os.symlink(real, link)
  _prepared(link)  # an empty folder behind a link: filled, the link kept
  assert os.path.islink(link) and (real / storage.MANIFEST).is_file()
  first = storage.load_prepared(link).num_items
  # A preparation killed after it set the manifest aside: still its own folder.
  storage.remove_manifest(link)
  assert not (real / storage.MANIFEST).exists() and (real / outputs.RETIRED).exists()
  _prepared(link)
  assert storage.load_prepared(link).num_items == first
  assert not (real / outputs.RETIRED).exists()
  capsys.readouterr()


def test_a_damaged_manifest_in_a_prepared_folder_is_one_line(tmp_path):
  folder = _prepared(tmp_path / "data")
  (folder / storage.MANIFEST).write_text('{"format": "cutbce-prepared", "vers')
  with pytest.raises(ValueError, match=r"manifest\.json is not JSON .*move it away"):
    storage.load_prepared(folder)
  with pytest.raises(ValueError, match=r"is not JSON"):
    prepare.needs_preparation(folder, explicit=True, dataset="synthetic")


# --------------------------------------------------------------------------- #
# The workdir's own files                                                      #
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("name", ["metrics.jsonl", "trainer.lock", "config.json",
                                  "data_fingerprint.json"])
def test_a_run_file_that_is_a_folder_is_one_line(tmp_path, name):
  (tmp_path / name).mkdir()
  with pytest.raises(workdir_lock.WorkdirError, match=rf"{name} is a folder; the run keeps a "
                     "file of that name there"):
    workdir_lock.acquire(tmp_path)


def test_checkpoints_that_is_a_file_is_one_line(tmp_path):
  (tmp_path / "checkpoints").write_text("x")
  with pytest.raises(workdir_lock.WorkdirError, match="checkpoints is a file"):
    workdir_lock.acquire(tmp_path)


@pytest.mark.parametrize("text", ['{"format": "cutbce-config", "vers', "", "[1, 2]"])
def test_a_damaged_config_json_is_one_line(workdir, tmp_path, capsys, text):
  (workdir / "config.json").write_text(text)
  with pytest.raises(paths.WorkdirError, match="config.json (is not JSON|holds JSON list)"):
    saved_config.read(workdir)
  status = export.main(["export", f"--workdir={workdir}", f"--out={tmp_path / 'out'}"])
  lines = capsys.readouterr().err.splitlines()
  assert status == 2 and len(lines) == 1 and lines[0].startswith("bad workdir: "), lines


@pytest.mark.parametrize("text", ["garbage", '{"num_items": 3', "null"])
def test_a_damaged_fingerprint_is_one_line(tmp_path, text):
  (tmp_path / fingerprint.FILE).write_text(text)
  with pytest.raises(paths.WorkdirError, match=r"data_fingerprint\.json (is not JSON|holds)"):
    fingerprint.check(tmp_path, np.arange(3))


def test_the_fingerprint_advice_names_the_preparation_to_delete(tmp_path):
  fingerprint.record(tmp_path, fingerprint.of(np.arange(3)))
  with pytest.raises(Exception, match=rf"delete {tmp_path / 'data'} \(it holds the "
                     "preparation of the changed data"):
    fingerprint.check(tmp_path, np.arange(1, 4), tmp_path / "data")


def test_gs_without_gcsfs_is_one_line(tmp_path, capsys, monkeypatch):
  import fsspec  # pylint: disable=import-outside-toplevel
  real = fsspec.get_filesystem_class

  def without_gcsfs(protocol):
    if protocol == "gs":
      raise ImportError("Install gcsfs to access Google Storage")
    return real(protocol)

  monkeypatch.setattr(fsspec, "get_filesystem_class", without_gcsfs)
  with pytest.raises(paths.WorkdirError, match=r"gs:// paths need the gcsfs package"):
    paths.check_remote("gs://bucket/run")
  with pytest.raises(paths.WorkdirError, match=r"gs:// paths need the gcsfs package"):
    workdir_lock.acquire("gs://bucket/run")
  status = export.main(["export", "--workdir=gs://bucket/run", f"--out={tmp_path / 'x'}"])
  assert status == 2
  assert capsys.readouterr().err.splitlines() == [
      "bad config: --workdir='gs://bucket/run': an existing run directory (gs:// paths need "
      "the gcsfs package, which is not installed (pip install gcsfs))"]
  assert data_cli.main(SYNTHETIC + ["--out", "gs://bucket/prepared"]) == 2
  lines = capsys.readouterr().err.splitlines()
  assert lines == ["bad config: gs://bucket/prepared: gs:// paths need the gcsfs package, "
                   "which is not installed (pip install gcsfs)"]


# --------------------------------------------------------------------------- #
# recommend --users: ids exactly as written (bad cause 2)                      #
# --------------------------------------------------------------------------- #


def test_user_ids_are_read_exactly_as_written(tmp_path):
  users = tmp_path / "users.txt"
  users.write_bytes(b"x \n\nx\r\n\tx\n y z \n")
  assert recommend.read_user_ids(str(users)) == ["x ", "x", "\tx", " y z "]
  strings = np.array(["x", "x ", "\tx", " y z "], dtype=np.dtypes.StringDType())
  assert recommend.dense_users(strings, ["x "], "f").tolist() == [1]  # not user "x"
  assert recommend.dense_users(strings, recommend.read_user_ids(str(users)), "f").tolist() == [
      1, 0, 2, 3]
  integers = np.array([7, 3, -2], np.int64)
  assert recommend.dense_users(integers, ["3", "-2"], "f").tolist() == [1, 2]
  for text in (" 7", "7 ", "+7", "7.0", "0x7"):
    with pytest.raises(Exception, match=re.escape(f"1 are not: {text!r}")):
      recommend.dense_users(integers, [text], "f")
