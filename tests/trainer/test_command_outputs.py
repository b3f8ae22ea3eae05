"""`--out` that is a folder, a file or cannot be written: one line before any work (issue 32).

The checks run before the run's checkpoint is opened, so a workdir holding
only a `config.json` (what the flag rules ask for) is enough here.
"""

import os

import pytest

from trainer.workdir import paths
from trainer.commands import cli, export, recommend


@pytest.fixture
def workdir(tmp_path):
  folder = tmp_path / "run"
  folder.mkdir()
  (folder / "config.json").write_text("{}")
  return folder


def _recommend(workdir, out, capsys):
  status = recommend.main(["recommend", f"--workdir={workdir}", "--top_k=3", f"--out={out}"])
  return status, capsys.readouterr().err.splitlines()


def _export(workdir, out, capsys):
  status = export.main(["export", f"--workdir={workdir}", f"--out={out}"])
  return status, capsys.readouterr().err.splitlines()


def test_recommend_out_that_is_a_folder(workdir, tmp_path, capsys):
  assert _recommend(workdir, tmp_path, capsys) == (
      2, [f"bad config: --out={tmp_path}: a file to write (this path is a folder)"])


def test_recommend_out_below_a_file(workdir, tmp_path, capsys):
  (tmp_path / "plain").write_text("x")
  out = tmp_path / "plain" / "recs.jsonl"
  assert _recommend(workdir, out, capsys) == (
      2, [f"bad config: --out={out}: {tmp_path / 'plain'} is a file, not a folder"])


def test_export_out_that_is_a_file(workdir, tmp_path, capsys):
  (tmp_path / "plain").write_text("x")
  assert _export(workdir, tmp_path / "plain", capsys) == (
      2, [f"bad config: --out={tmp_path / 'plain'}: a folder (this path is a file)"])


def test_unwritable_out_is_one_line(workdir, tmp_path, capsys, monkeypatch):
  def refuse(*args, **kwargs):
    raise PermissionError(13, "Permission denied")
  monkeypatch.setattr(paths, "open", refuse, raising=False)
  out = tmp_path / "recs.jsonl"
  assert _recommend(workdir, out, capsys) == (
      2, [f"bad config: --out={out}: cannot write in {tmp_path} (Permission denied)"])
  assert _export(workdir, tmp_path / "export", capsys) == (
      2, [f"bad config: --out={tmp_path / 'export'}: cannot write in {tmp_path / 'export'} "
          "(Permission denied)"])


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_read_only_out_folder(workdir, tmp_path, capsys):
  locked = tmp_path / "locked"
  locked.mkdir(mode=0o555)
  status, lines = _recommend(workdir, locked / "recs.jsonl", capsys)
  assert status == 2 and len(lines) == 1 and "Permission denied" in lines[0]


def test_a_writable_out_passes(tmp_path):
  cli.check_out_file(str(tmp_path / "new" / "recs.jsonl"))
  cli.check_out_folder(str(tmp_path / "export"))
  assert sorted(os.listdir(tmp_path)) == ["export", "new"]
  assert os.listdir(tmp_path / "new") == [] and os.listdir(tmp_path / "export") == []
