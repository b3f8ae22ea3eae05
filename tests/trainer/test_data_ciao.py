"""The Ciao source (trainer/data/ciao.py) on small MATLAB files made here."""

import hashlib
import json
import os

import numpy as np
import pytest
from scipy import io as scipy_io

from configs import ciao as ciao_config
from trainer.data import __main__ as data_cli
from trainer.data import ciao, prepare, sources

DAY = 86_400
START = 959_670_000  # 2000-05-30, Ciao's first day


def _ratings(rng, n=60, users=6, items=40):
  """[n, 6] rows of Ciao's layout in time order: user, product, category,
  rating, helpfulness, time (whole days, many shared)."""
  rows = np.stack([
      rng.integers(1, users + 1, n), rng.integers(1, items + 1, n), rng.integers(1, 29, n),
      rng.integers(1, 6, n), rng.integers(0, 6, n),
      np.sort(START + DAY * rng.integers(0, 20, n))], axis=1)
  return rows.astype(np.int32)


def _write(folder, rating, name=ciao.FILE_NAME, variable="rating"):
  folder.mkdir(parents=True, exist_ok=True)
  scipy_io.savemat(folder / name, {variable: rating})
  return folder / name


def test_reads_users_products_and_times_in_file_order(tmp_path):
  rating = _ratings(np.random.default_rng(0))
  file = _write(tmp_path / "ciao", rating)
  for path in (file, tmp_path / "ciao"):  # the file, or its folder
    data = sources.load_interactions("ciao", path=str(path))
    np.testing.assert_array_equal(data.user, rating[:, 0])
    np.testing.assert_array_equal(data.item, rating[:, 1])
    np.testing.assert_array_equal(data.timestamp, rating[:, 5])
    assert data.name == "ciao" and data.num_items is None


def test_a_file_other_than_the_measured_one_is_read_with_a_warning(tmp_path, monkeypatch,
                                                                    caplog):
  file = _write(tmp_path, _ratings(np.random.default_rng(2)))
  with caplog.at_level("WARNING"):
    ciao.load_ciao(file)
  assert "not the file docs/data.md measured" in caplog.text and str(file) in caplog.text
  caplog.clear()
  monkeypatch.setattr(ciao, "SHA256", hashlib.sha256(file.read_bytes()).hexdigest())
  with caplog.at_level("WARNING"):
    ciao.load_ciao(file)
  assert "sha256" not in caplog.text


def test_matlab_doubles_are_read_when_whole(tmp_path):
  rating = _ratings(np.random.default_rng(1))
  data = ciao.load_ciao(_write(tmp_path, rating.astype(np.float64)))
  np.testing.assert_array_equal(data.item, rating[:, 1])
  half = rating.astype(np.float64)
  half[3, 1] += 0.5
  with pytest.raises(sources.DataError, match="integral"):
    ciao.load_ciao(_write(tmp_path, half))


@pytest.mark.parametrize("change,match", [
    (lambda r: r[:, :5], r"shape \(60, 5\); expected \[ratings, 6\]"),
    (lambda r: r[:0], r"shape \(0, 6\)"),
    # Epinions' file: the same layout, 11 time slots instead of times.
    (lambda r: np.concatenate([r[:, :5], (np.arange(60) % 11 + 1)[:, None]], 1).astype(np.int32),
     r"column 5 holds 1\.\.11, not Unix times \(Epinions'"),
    (lambda r: np.where(np.arange(6) == 1, -1, r).astype(np.int32), "negative product id"),
])
def test_bad_contents_are_refused_naming_the_file(tmp_path, change, match):
  file = _write(tmp_path, change(_ratings(np.random.default_rng(2))))
  with pytest.raises(sources.DataError, match=match) as excinfo:
    ciao.load_ciao(file)
  assert str(file) in str(excinfo.value)


def test_missing_or_unreadable_files(tmp_path):
  with pytest.raises(FileNotFoundError, match="rating_with_timestamp.mat.*docs/data.md"):
    ciao.load_ciao(tmp_path)  # a folder without the file
  with pytest.raises(sources.DataError, match=r"no variable 'rating'; found \['ratings'\]"):
    ciao.load_ciao(_write(tmp_path, _ratings(np.random.default_rng(3)), variable="ratings"))
  (tmp_path / "text.mat").write_text("user,item,time\n1,2,3\n")
  with pytest.raises(sources.DataError, match="not a readable MATLAB file"):
    ciao.load_ciao(tmp_path / "text.mat")


def test_prepared_with_every_product_kept(tmp_path):
  """Ciao's default keeps products rated once (its catalog's size is the point)."""
  rating = _ratings(np.random.default_rng(4), n=200, users=8, items=150)
  _write(tmp_path / "raw", rating)
  manifest = prepare.prepare_dataset("ciao", tmp_path / "out",
                                     source_options={"path": str(tmp_path / "raw")},
                                     seq_lens=(50,))
  assert manifest["num_items"] == len(np.unique(rating[:, 1]))
  assert manifest["num_users"] == len(np.unique(rating[:, 0]))
  assert prepare.default_min_item_count("ciao") == 1


def test_command_line(tmp_path, capsys):
  _write(tmp_path / "raw", _ratings(np.random.default_rng(5)))
  out = tmp_path / "out"
  assert data_cli.main(["--dataset", "ciao", "--path", str(tmp_path / "raw"),
                        "--out", str(out)]) == 0
  printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  assert printed["dataset"] == "ciao" and printed["num_interactions"] == 60
  for flags, message in (([], "--path=None: Ciao's rating_with_timestamp.mat or its folder "
                              "(required"),
                         (["--path", str(tmp_path / "none")], "rating_with_timestamp.mat")):
    assert data_cli.main(["--dataset", "ciao", "--out", str(tmp_path / "x"), *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("bad config: --path=") and message in err, err
    assert not os.path.exists(tmp_path / "x")


def test_the_config_names_no_home_folder(monkeypatch):
  monkeypatch.delenv("CUTBCE_DATA", raising=False)
  assert ciao_config.get_config().data.source_options.path == "~/.cache/cutbce/ciao"
  monkeypatch.setenv("CUTBCE_DATA", "/data/cache")
  assert ciao_config.get_config().data.source_options.path == "/data/cache/ciao"
