"""On-disk format, atomic preparation and the command line."""

import hashlib
import json
import os
import subprocess
import sys
import threading

import numpy as np
import pytest

from trainer.workdir import fingerprint
from trainer.data import __main__ as cli
from trainer.data import prepare, preprocess, storage, windows


def test_round_trip_is_memory_mapped(tmp_path, make_interactions):
  raw = make_interactions([(4, 8, 3), (4, 9, 1), (6, 8, 2), (4, 7, 2),
                           (6, 9, 5), (6, 7, 9), (4, 9, 6), (4, 8, 7),
                           (6, 8, 10)])
  manifest = prepare.prepare_interactions(raw, tmp_path, dataset="hand",
                                          seq_lens=(1, 2))
  data = storage.load_prepared(tmp_path)
  assert isinstance(data.items, np.memmap)
  seqs = preprocess.prepare_sequences(raw)
  np.testing.assert_array_equal(data.items, seqs.items)
  np.testing.assert_array_equal(data.offsets, seqs.offsets)
  np.testing.assert_array_equal(data.timestamps, seqs.timestamps)
  np.testing.assert_array_equal(data.user_ids, [4, 6])
  np.testing.assert_array_equal(data.item_ids, [7, 8, 9])
  assert (manifest["num_users"], manifest["num_items"],
          manifest["num_interactions"]) == (2, 3, 9)
  # Leave-one-out keeps 5 - 2 and 4 - 2 training events.
  assert manifest["train_interactions"] == 5
  # Windows: 2 and 1 input positions -> N=1: 2 + 1, N=2: 1 + 1.
  assert manifest["train_windows"] == {"1": 3, "2": 2}
  assert json.loads((tmp_path / "manifest.json").read_text()) == data.manifest


def test_failed_preparation_leaves_no_manifest(tmp_path, make_interactions):
  raw = make_interactions([(0, 1, 1), (0, 2, 2), (0, 3, 3)])
  prepare.prepare_interactions(raw, tmp_path, dataset="hand")
  assert (tmp_path / "manifest.json").is_file()
  with pytest.raises(ValueError, match="empty after filtering"):
    prepare.prepare_interactions(raw, tmp_path, dataset="hand",
                                 min_item_count=2)
  assert not (tmp_path / "manifest.json").exists()
  with pytest.raises(FileNotFoundError, match="no manifest.json"):
    storage.load_prepared(tmp_path)
  assert not list(tmp_path.glob(".*tmp*"))


def test_unknown_dataset_also_removes_an_old_manifest(tmp_path,
                                                      make_interactions):
  prepare.prepare_interactions(make_interactions([(0, 1, 1), (0, 2, 2)]),
                               tmp_path, dataset="hand")
  with pytest.raises(ValueError, match="unknown dataset"):
    prepare.prepare_dataset("nope", tmp_path)
  assert not (tmp_path / "manifest.json").exists()


def test_load_rejects_inconsistent_arrays(tmp_path, make_interactions):
  prepare.prepare_interactions(make_interactions([(0, 1, 1), (0, 2, 2)]),
                               tmp_path, dataset="hand")
  np.save(tmp_path / "items.npy", np.zeros(5, np.int32))
  with pytest.raises(ValueError, match=r"items.npy.*int32 \[5\].*expects "
                     r"int32 \[2\]"):
    storage.load_prepared(tmp_path)


def test_write_rejects_wrong_dtype(tmp_path):
  arrays = {name: np.zeros((1,) * rank, dtype)
            for name, (dtype, rank) in storage.ARRAYS.items()}
  arrays["items"] = arrays["items"].astype(np.int64)
  with pytest.raises(ValueError, match="'items' is int64.*expected int32"):
    storage.write_prepared(tmp_path, arrays, {})


def test_cli_synthetic_prints_counts(tmp_path, capsys):
  out = tmp_path / "syn"
  rc = cli.main(["--dataset", "synthetic", "--num-users", "30",
                 "--num-items", "200", "--interactions-per-user", "12",
                 "--seq-len", "4", "--out", str(out)])
  assert rc == 0
  summary = json.loads(capsys.readouterr().out.strip())
  data = storage.load_prepared(out)
  assert summary["num_users"] == data.num_users == 30
  assert summary["num_items"] == data.num_items == 200  # whole catalog
  assert summary["num_interactions"] == data.items.shape[0]
  assert summary["train_examples"] == windows.num_train_windows(
      data.train_lengths, 4)
  assert summary["validation_examples"] == summary["test_examples"] == 30


def test_cli_ml100k_gts(tmp_path, capsys, ml100k_raw):
  # ML-100k spans about 7 months; hold out the last 30 days, 1 day gap.
  day = 86_400
  rc = cli.main(["--dataset", "ml-100k", "--split", "gts", "--test-window",
                 str(30 * day), "--validation-window", str(30 * day),
                 "--gap", str(day), "--out", str(tmp_path)])
  assert rc == 0
  summary = json.loads(capsys.readouterr().out.strip())
  assert summary["split"] == "gts" and summary["num_users"] <= 943
  data = storage.load_prepared(tmp_path)
  end = data.manifest["split"]["end"]
  assert end == int(ml100k_raw.timestamp.max()) + 1
  test = data.test
  # Every test target lies in the last 30 days, every history event before
  # the gap; every test user has training events.
  starts = data.offsets[test[:, 0]]
  assert (data.train_lengths[test[:, 0]] > 0).all()
  for user_start, (_, history, first, last) in zip(starts[:50], test[:50]):
    times = data.timestamps[user_start:user_start + last]
    assert (times[first:] >= end - 30 * day).all()
    assert (times[:history] < end - 31 * day).all()


def test_cli_errors_exit_2(tmp_path, capsys):
  assert cli.main(["--dataset", "imdb", "--out", str(tmp_path)]) == 2
  assert "bad config: --dataset='imdb': one of 'ml-1m'" in capsys.readouterr().err
  assert cli.main(["--dataset", "yambda", "--out", str(tmp_path)]) == 2
  assert "--yambda-path" in capsys.readouterr().err
  assert cli.main(["--dataset", "synthetic", "--seq-len", "0",
                   "--out", str(tmp_path)]) == 2
  assert "bad config: --seq-len=0: an integer >= 1" in capsys.readouterr().err
  assert not (tmp_path / "manifest.json").exists()


def test_cli_runs_as_module(tmp_path):
  result = subprocess.run(
      [sys.executable, "-m", "trainer.data", "--dataset", "synthetic",
       "--num-users", "5", "--num-items", "20", "--interactions-per-user",
       "6", "--out", str(tmp_path)], capture_output=True, text=True,
      check=False)
  assert result.returncode == 0, result.stderr
  lines = result.stdout.strip().splitlines()
  assert len(lines) == 1
  assert json.loads(lines[0])["num_users"] == 5


def _file_hashes(folder) -> dict[str, str]:
  return {path.name: hashlib.sha256(path.read_bytes()).hexdigest()
          for path in sorted(folder.iterdir())}


def test_preparation_is_deterministic(tmp_path):
  """Two preparations, each its own process with another hash seed (set and dict order of
  strings change with it), write byte-identical folders: what lets every host prepare its
  own copy (`data.prepare_per_host`). A synthetic set, and a CSV with string ids."""
  rng = np.random.default_rng(0)
  rows = ["user,item,time"] + [
      f"u{rng.integers(30)},song-{rng.integers(80)},2024-01-{1 + i % 28:02d}T00:00:{i % 60:02d}"
      for i in range(600)]
  (tmp_path / "events.csv").write_text("\n".join(rows) + "\n")
  sources = {
      "synthetic": ["--dataset", "synthetic", "--num-users", "50", "--num-items", "200",
                    "--interactions-per-user", "15", "--seed", "4"],
      "files": ["--dataset", "files", "--path", str(tmp_path / "events.csv"), "--user-col",
                "user", "--item-col", "item", "--time-col", "time", "--split", "gts",
                "--test-window", "200000", "--validation-window", "200000"],
  }
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  for name, flags in sources.items():
    folders = [tmp_path / f"{name}-{seed}" for seed in ("1", "2")]
    for seed, folder in zip(("1", "2"), folders):
      result = subprocess.run(
          [sys.executable, "-m", "trainer.data", *flags, "--out", str(folder)], cwd=root,
          env=dict(os.environ, PYTHONHASHSEED=seed), capture_output=True, text=True,
          check=False)
      assert result.returncode == 0, result.stderr
    first, second = (_file_hashes(folder) for folder in folders)
    # String ids (files' users and items) are a UTF-8 blob and offsets each.
    strings = set(storage.RAW_ID_ARRAYS) if name == "files" else set()
    expected = {f"{a}.npy" for a in set(storage.ARRAYS) - strings}
    expected |= {f"{a}.{part}.npy" for a in strings for part in ("utf8", "offsets")}
    assert set(first) == {storage.MANIFEST} | expected, name
    assert first == second, name


def test_host_lock_lets_one_process_of_a_machine_prepare_at_a_time(tmp_path):
  """Two holders of `prepare.host_lock` on one folder (separate opens: as two processes):
  the second waits until the first is done."""
  order = []

  def second():
    with prepare.host_lock(tmp_path / "prepared"):
      order.append("second")

  with prepare.host_lock(tmp_path / "prepared"):
    thread = threading.Thread(target=second)
    thread.start()
    thread.join(timeout=0.5)
    assert thread.is_alive()  # waiting for the lock
    order.append("first")
  thread.join(timeout=30)
  assert order == ["first", "second"]
  with pytest.raises(ValueError, match="a local folder"):
    with prepare.host_lock("gs://bucket/prepared"):
      pass


# --------------------------------------------------------------------------- #
# String ids stored unpadded (issue 32, bad #7)                                #
# --------------------------------------------------------------------------- #


def _arrays_with_item_ids(item_ids):
  arrays = {n: np.zeros((1,) * rank, dtype) for n, (dtype, rank) in storage.ARRAYS.items()}
  arrays["item_ids"] = item_ids
  return arrays


def test_one_long_string_id_costs_its_own_bytes(tmp_path):
  ids = np.array(["x" * 2**20] + [f"item-{i}" for i in range(60)])  # <U1048576: 244 MB
  storage.write_prepared(tmp_path, _arrays_with_item_ids(ids), {})
  on_disk = sum(path.stat().st_size for path in tmp_path.iterdir())
  assert on_disk < 2**20 + 64 * 1024
  loaded = storage.load_prepared(tmp_path).item_ids
  assert loaded.dtype.kind == "T" and loaded.tolist() == ids.tolist()


def test_string_ids_round_trip_any_text(tmp_path):
  ids = np.array(["", "é", "a\nb", "日本", "\x00z", "'; DROP"], dtype=np.dtypes.StringDType())
  storage.write_prepared(tmp_path, _arrays_with_item_ids(ids), {})
  entry = json.loads((tmp_path / storage.MANIFEST).read_text())["arrays"]["item_ids"]
  assert entry["dtype"] == "utf8" and entry["shape"] == [6]
  assert storage.load_prepared(tmp_path).item_ids.tolist() == ids.tolist()


def test_a_version_1_folder_with_fixed_width_ids_still_loads(tmp_path):
  ids = np.array(["b", "ccc", "a"])
  storage.write_prepared(tmp_path, _arrays_with_item_ids(ids), {})
  new = storage.load_prepared(tmp_path).item_ids
  # Rewrite it as version 1 wrote it: item_ids.npy, a <U array.
  manifest = json.loads((tmp_path / storage.MANIFEST).read_text())
  for part in ("utf8", "offsets"):
    (tmp_path / f"item_ids.{part}.npy").unlink()
  np.save(tmp_path / "item_ids.npy", ids)
  manifest["version"] = 1
  manifest["arrays"]["item_ids"] = {"dtype": str(ids.dtype), "file": "item_ids.npy",
                                     "shape": [3]}
  (tmp_path / storage.MANIFEST).write_text(json.dumps(manifest))
  old = storage.load_prepared(tmp_path).item_ids
  assert old.dtype == ids.dtype and old.tolist() == new.tolist()
  # The run's data fingerprint is the same either way (a workdir prepared
  # before can be re-prepared without being refused).
  assert fingerprint.of(old) == fingerprint.of(new)


def test_corrupted_string_offsets_are_one_line(tmp_path):
  storage.write_prepared(tmp_path, _arrays_with_item_ids(np.array(["a", "bb"])), {})
  np.save(tmp_path / "item_ids.offsets.npy", np.array([0, 5, 3], np.int64))
  with pytest.raises(ValueError, match=r"item_ids.utf8.npy and item_ids.offsets.npy in .*: "
                     r"expected a uint8 blob"):
    storage.load_prepared(tmp_path)
