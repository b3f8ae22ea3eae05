"""Out-of-core preparation (DuckDB) against the in-memory one, shards, and gs:// files."""

import hashlib
import os
import threading

import jax
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from trainer.config import keys as config_keys
from trainer.data import __main__ as cli
from trainer.data import engine, pipeline, prepare, storage
from tests.trainer.test_paths import BUCKET, fake_gcs  # pylint: disable=unused-import

COLUMNS = dict(user_col="uid", item_col="item", time_col="ts")


def _hashes(folder) -> dict[str, str]:
  return {path.name: hashlib.sha256(path.read_bytes()).hexdigest()
          for path in sorted(folder.iterdir())}


def _events(rng, n, *, users=40, items=90, strings=False, iso=False, offset=0):
  user = rng.integers(0, users, n)
  item = (rng.zipf(1.3, n) % items) + offset
  ts = 1_700_000_000 + rng.integers(0, 50, n) * 3_600  # many ties: file order decides
  table = {"uid": user, "item": item, "ts": ts, "ratio": rng.integers(0, 100, n)}
  if strings:
    table["uid"] = np.array([f"u-{u}é" if u % 3 else f"{u}" for u in user])
    table["item"] = np.array([f"song {i}" if i % 2 else f"{i:03d}" for i in item])
  if iso:
    zones = ["Z", "+02:00", "", "-05:30"]
    table["ts"] = np.array([
        np.datetime_as_string(np.datetime64(int(t), "s")) + zones[k % 4]
        for k, t in enumerate(ts)])
  return table


def _write(path, table):
  path.parent.mkdir(parents=True, exist_ok=True)
  if str(path).endswith(".parquet"):
    pq.write_table(pa.table(table), path, row_group_size=37)
  elif str(path).endswith(".jsonl"):
    keys = list(table)
    with open(path, "w", encoding="utf-8") as file:
      for row in zip(*table.values()):
        file.write("{" + ", ".join(
            f'"{k}": ' + (f'"{v}"' if isinstance(v, str) else str(int(v)))
            for k, v in zip(keys, row)) + "}\n")
  else:
    sep = "\t" if str(path).endswith(".tsv") else ","
    lines = [sep.join(table)] + [sep.join(str(v) for v in row) for row in zip(*table.values())]
    path.write_text("\n".join(lines) + "\n")


def _case(name, root):
  """Raw files and options of one fixture: string ids, ISO times, mixed types, filters."""
  rng = np.random.default_rng(CASES.index(name))
  options = dict(split="loo", min_item_count=None, min_user_count=1, split_options=None,
                 extra={})
  if name == "parquet_ints":
    _write(root / "a.parquet", _events(rng, 400))
    _write(root / "b.parquet", _events(rng, 300, offset=50))
  elif name == "csv_strings_iso_gts":
    _write(root / "a.csv", _events(rng, 500, strings=True, iso=True))
    options.update(split="gts", split_options=dict(test_window=6 * 3600,
                                                   validation_window=6 * 3600, gap=1800))
  elif name == "mixed_int_and_string_ids":
    _write(root / "a.parquet", _events(rng, 300))
    _write(root / "b.csv", _events(rng, 300, strings=True))
    _write(root / "c.jsonl", _events(rng, 200))
  elif name == "filter_and_min_counts":
    _write(root / "a.parquet", _events(rng, 700))
    options.update(min_item_count=3, min_user_count=4, extra={"filter": "ratio>=30"})
  elif name == "parquet_strings_gts":
    _write(root / "p.parquet", _events(rng, 600, strings=True))
    options.update(split="gts", min_user_count=2,
                   split_options=dict(test_window=5 * 3600, validation_window=0))
  return options


CASES = ["parquet_ints", "csv_strings_iso_gts", "mixed_int_and_string_ids",
         "filter_and_min_counts", "parquet_strings_gts"]


@pytest.mark.parametrize("name", CASES)
def test_engine_writes_the_bytes_of_the_in_memory_preparation(name, tmp_path, monkeypatch):
  """Same files (arrays and manifest), byte for byte; reads in several batches and
  streams the sort in several batches, so batch edges are crossed."""
  monkeypatch.setattr(engine, "BATCH_ROWS", 53)
  monkeypatch.setattr(engine, "OUTPUT_ROWS", 41)
  options = _case(name, tmp_path / "raw")
  source = dict(path=str(tmp_path / "raw"), **COLUMNS, **options.pop("extra"))
  folders = {}
  for kind in ("memory", "duckdb"):
    folders[kind] = tmp_path / kind
    prepare.prepare_dataset("files", folders[kind], source_options=source, engine=kind,
                            memory_limit="256MB", seq_lens=(5,), **options)
  memory, duck = (_hashes(folders[k]) for k in ("memory", "duckdb"))
  data = storage.load_prepared(folders["duckdb"])
  strings = {a for a in storage.RAW_ID_ARRAYS if storage.is_string_ids(getattr(data, a).dtype)}
  expected = {f"{a}.npy" for a in set(storage.ARRAYS) - strings}
  expected |= {f"{a}.{part}.npy" for a in strings for part in ("utf8", "offsets")}
  assert set(memory) == {storage.MANIFEST} | expected
  assert duck == memory
  if "string" in name:
    assert strings == set(storage.RAW_ID_ARRAYS)


def test_the_equality_test_can_fail(tmp_path):
  """A change the engine must see (one event more) changes the bytes."""
  rng = np.random.default_rng(0)
  table = _events(rng, 200)
  _write(tmp_path / "a" / "e.parquet", table)
  table = {k: np.concatenate([v, v[:1]]) for k, v in table.items()}
  _write(tmp_path / "b" / "e.parquet", table)
  for name, kind in (("a", "memory"), ("b", "duckdb")):
    prepare.prepare_dataset("files", tmp_path / f"out-{name}", engine=kind,
                            source_options=dict(path=str(tmp_path / name), **COLUMNS))
  assert _hashes(tmp_path / "out-a") != _hashes(tmp_path / "out-b")


def _sharded_pair(tmp_path, num_shards):
  rng = np.random.default_rng(1)
  _write(tmp_path / "raw" / "e.parquet", _events(rng, 900, users=30))
  source = dict(path=str(tmp_path / "raw"), **COLUMNS)
  one = tmp_path / "one"
  prepare.prepare_dataset("files", one, source_options=source, engine="memory", seq_lens=(4,))
  sharded = {}
  for kind in ("memory", "duckdb"):
    sharded[kind] = tmp_path / f"{kind}-{num_shards}"
    prepare.prepare_dataset("files", sharded[kind], source_options=source, engine=kind,
                            num_shards=num_shards, seq_lens=(4,))
  return one, sharded


def test_shards_hold_the_same_events_cut_by_user(tmp_path):
  one, sharded = _sharded_pair(tmp_path, 4)
  assert _hashes(sharded["memory"]) == _hashes(sharded["duckdb"])
  whole = storage.load_prepared(one)
  data = storage.load_prepared(sharded["duckdb"])
  assert data.num_shards == 4 and whole.num_shards == 1
  assert sorted(p.name for p in sharded["duckdb"].glob("items-*")) == [
      f"items-{s:05d}-of-00004.npy" for s in range(4)]
  index = data.manifest["shards"]
  np.testing.assert_array_equal(index["rows"], whole.offsets[index["users"]])
  assert np.diff(index["rows"]).max() - np.diff(index["rows"]).min() < 150  # balanced
  for name in ("items", "timestamps"):
    np.testing.assert_array_equal(np.asarray(getattr(data, name)), getattr(whole, name))
  for name in ("offsets", "train_lengths", "validation", "test", "user_ids", "item_ids"):
    np.testing.assert_array_equal(getattr(data, name), getattr(whole, name))
  manifest = {k: v for k, v in data.manifest.items() if k not in ("shards", "arrays")}
  assert manifest == {k: v for k, v in whole.manifest.items() if k != "arrays"}
  # Global row indexing, opening only the shards asked for.
  rows = np.asarray(index["rows"])
  fresh = storage.load_prepared(sharded["duckdb"])
  assert fresh.items.opened == []
  assert fresh.items[rows[2]:rows[3]].tolist() == whole.items[rows[2]:rows[3]].tolist()
  assert fresh.items.opened == [2]
  picks = np.array([[rows[1], rows[1] + 1], [rows[3] - 1, rows[1] + 2]])
  np.testing.assert_array_equal(fresh.items[picks], whole.items[picks])
  assert fresh.items.opened == [1, 2]
  assert prepare.prepared_mismatch(sharded["duckdb"], dataset="files",
                                   source_options=data.manifest["source_options"],
                                   num_shards=2) == ["num_shards: prepared 4, asked 2"]


@pytest.mark.parametrize("process_count,train_windows", [(2, "all"), (4, "all"), (2, "last")])
def test_each_process_reads_only_its_shards_and_batches_equal_one_process(tmp_path,
                                                                          process_count,
                                                                          train_windows):
  _, sharded = _sharded_pair(tmp_path, 4)
  options = dict(seq_len=4, num_targets=2, batch_size=3, seed=5, train_windows=train_windows)
  single = storage.load_prepared(sharded["duckdb"])
  whole = list(pipeline.train_dataset(single, process_index=0, process_count=1,
                                      **{**options, "batch_size": 3 * process_count})[:6])
  for p in range(process_count):
    data = storage.load_prepared(sharded["duckdb"])
    mine = list(pipeline.train_dataset(data, process_index=p, process_count=process_count,
                                       **options)[:6])
    for global_batch, batch in zip(whole, mine):
      for key in batch:
        np.testing.assert_array_equal(batch[key], global_batch[key][p::process_count])
    assert data.items.opened == list(range(p, 4, process_count))
  # Every shard's windows come round: shard k % 4 gives element k.
  users = single.shard_users
  window_users = np.concatenate([b["inputs"][:, -1] for b in whole])
  assert window_users.size == 6 * 3 * process_count and users.size == 5


@pytest.mark.parametrize("process_count,batch_size", [(2, 3), (4, 2)])
def test_evaluation_reads_only_its_shards_and_covers_every_user_once(tmp_path, process_count,
                                                                     batch_size):
  one, sharded = _sharded_pair(tmp_path, 4)
  whole = storage.load_prepared(one)
  single = list(pipeline.eval_dataset(whole, "test", seq_len=4, batch_size=batch_size,
                                      process_index=0, process_count=1))
  expected = {}
  for batch in single:
    for row, user in enumerate(batch["users"]):
      if user >= 0:
        expected[int(user)] = {k: batch[k][row] for k in ("inputs", "targets", "exclude")}
  lengths, seen = set(), {}
  for p in range(process_count):
    data = storage.load_prepared(sharded["duckdb"])
    batches = list(pipeline.eval_dataset(data, "test", seq_len=4, batch_size=batch_size,
                                         process_index=p, process_count=process_count))
    lengths.add(len(batches))
    assert data.items.opened == list(range(p, 4, process_count))
    owned = set()
    for shard in range(p, 4, process_count):
      owned.update(range(data.shard_users[shard], data.shard_users[shard + 1]))
    for batch in batches:
      assert (batch["weights"] > 0).tolist() == (batch["users"] >= 0).tolist()
      assert (batch["targets"][batch["users"] < 0] == -1).all()
      for row, user in enumerate(batch["users"]):
        if user >= 0:
          assert int(user) in owned and int(user) not in seen
          seen[int(user)] = {k: batch[k][row] for k in ("inputs", "targets", "exclude")}
  assert len(lengths) == 1  # every process runs as many batches
  assert seen.keys() == expected.keys()  # every user once, whatever process had it
  for user, example in expected.items():
    for key, value in example.items():
      np.testing.assert_array_equal(seen[user][key], value)


def test_memory_limit_sizes_and_errors(tmp_path, capsys):
  assert engine.parse_memory_limit("4GB") == 4 * 10**9
  assert engine.parse_memory_limit("512 MiB") == 512 * 2**20
  assert engine.parse_memory_limit(2**30) == 2**30
  for bad in ("lots", "4XB", "1MB", "-3GB"):
    with pytest.raises(ValueError, match="memory limit"):
      engine.parse_memory_limit(bad)
  assert engine.default_memory_limit() > 2**28
  code = cli.main(["--dataset", "synthetic", "--out", str(tmp_path / "x"),
                   "--memory_limit=lots"])
  assert code == 2
  assert capsys.readouterr().err.startswith("bad config: --memory-limit='lots'")
  with pytest.raises(ValueError, match="engine 'duckdb' prepares the files and yambda"):
    prepare.prepare_dataset("synthetic", tmp_path / "y", engine="duckdb")
  _write(tmp_path / "raw" / "e.parquet", _events(np.random.default_rng(2), 50, users=3))
  with pytest.raises(ValueError, match=r"num_shards=5: expected an integer in \[1, 3\]"):
    prepare.prepare_dataset("files", tmp_path / "z", num_shards=5,
                            source_options=dict(path=str(tmp_path / "raw"), **COLUMNS))
  assert not (tmp_path / "z" / storage.MANIFEST).exists()


def test_config_keys_of_the_preparation():
  from configs import smoke  # pylint: disable=import-outside-toplevel
  context = config_keys.Context(device_count=jax.device_count())
  config = smoke.get_config()
  config.data.prepare_memory_limit = "4GB"
  config.data.prepare_shards = 2
  config_keys.check(config, context)
  config.data.prepare_memory_limit = "many"
  with pytest.raises(ValueError, match="prepare_memory_limit"):
    config_keys.check(config, context)
  config.data.prepare_memory_limit = None
  config.data.prepare_shards = 0
  with pytest.raises(ValueError, match="prepare_shards"):
    config_keys.check(config, context)


def test_gs_raw_files_and_prepared_shards(fake_gcs, tmp_path, capsys):
  """`--path gs://...` and `--out gs://...` through fsspec: the same data as local files."""
  rng = np.random.default_rng(3)
  local = tmp_path / "local"
  for name in ("part-0.parquet", "part-1.parquet", "_SUCCESS"):
    table = _events(rng, 200, users=20)
    if name == "_SUCCESS":
      (local / name).write_text("")
      continue
    _write(local / name, table)
    target = fake_gcs.local(f"{BUCKET}/raw/{name}")
    os.makedirs(os.path.dirname(target), exist_ok=True)
    with open(local / name, "rb") as src, open(target, "wb") as dst:
      dst.write(src.read())
  (tmp_path / "gcs" / "bucket" / "raw" / "_SUCCESS").write_text("")
  code = cli.main(["--dataset", "files", "--path", f"{BUCKET}/raw/*.parquet", "--user-col",
                   "uid", "--item-col", "item", "--time-col", "ts", "--memory_limit=4GB",
                   "--num-shards", "2", "--out", f"{BUCKET}/prepared"])
  assert code == 0, capsys.readouterr().err
  assert any(path.startswith("bucket/raw/part-1") for path in fake_gcs.opened)
  remote = storage.load_prepared(f"{BUCKET}/prepared")
  prepare.prepare_dataset("files", tmp_path / "ref", engine="memory",
                          source_options=dict(path=str(local), **COLUMNS))
  ref = storage.load_prepared(tmp_path / "ref")
  np.testing.assert_array_equal(np.asarray(remote.items), ref.items)
  np.testing.assert_array_equal(remote.item_ids, ref.item_ids)
  assert sorted(os.listdir(fake_gcs.local(f"{BUCKET}/prepared"))) == sorted(
      [storage.MANIFEST, "items-00000-of-00002.npy", "items-00001-of-00002.npy",
       "timestamps-00000-of-00002.npy", "timestamps-00001-of-00002.npy"]
      + [f"{a}.npy" for a in storage.ARRAYS if a not in storage.EVENT_ARRAYS])
  # A folder URL too (the _SUCCESS marker is skipped).
  folder = prepare.prepare_dataset("files", f"{BUCKET}/again",
                                   source_options=dict(path=f"{BUCKET}/raw", **COLUMNS))
  assert folder["num_interactions"] == ref.manifest["num_interactions"]


def test_yambda5b_preset_checks_on_its_slice():
  from configs import yambda5b_v6e16  # pylint: disable=import-outside-toplevel
  config = yambda5b_v6e16.get_config()
  config_keys.check(config, config_keys.Context(device_count=16, process_count=4))
  assert config.data.prepare_shards % 4 == 0
  assert engine.parse_memory_limit(config.data.prepare_memory_limit) == 64 * 10**9
  assert config.mesh.shape[0] * config.mesh.shape[1] == 16


def test_prefetched_reads_ahead_in_order_and_raises_where_the_reader_failed():
  def reader(fail_at=None):
    for index in range(50):
      if index == fail_at:
        raise ValueError(f"bad batch {index}")
      yield index

  assert list(engine._prefetched(reader())) == list(range(50))  # pylint: disable=protected-access
  seen = []
  with pytest.raises(ValueError, match="bad batch 7"):
    for item in engine._prefetched(reader(fail_at=7)):  # pylint: disable=protected-access
      seen.append(item)
  assert seen == list(range(7))
  stream = engine._prefetched(reader())  # pylint: disable=protected-access
  assert [next(stream) for _ in range(3)] == [0, 1, 2]
  stream.close()  # the consumer stops early: the reader thread ends too
  assert not any(t.name == "prepare-read" and t.is_alive() for t in threading.enumerate())


def test_a_long_preparation_says_how_far_it_is(caplog):
  progress = engine._Progress(every=100, quiet_s=0)  # pylint: disable=protected-access
  with caplog.at_level("INFO", logger="trainer.data.engine"):
    progress.rows(50, "below the step")
    progress.rows(250, "past two steps")
    progress.rows(290, "same step")
    progress.rows(300, "the next one")
  assert [r.getMessage().split(" (")[0] for r in caplog.records] == [
      "prepare: past two steps", "prepare: the next one"]


@pytest.mark.parametrize("folder", ["it's a dir", "x'; COPY (SELECT 42) TO 'INJECTED'; SELECT '",
                                    "semi;colon\nnew line\"double"])
def test_no_path_reaches_duckdb_as_sql(folder, tmp_path, monkeypatch):
  """A temp folder (from --temp-dir or TMPDIR) is a value, never SQL: quotes, `;`, newlines."""
  monkeypatch.chdir(tmp_path)
  raw = tmp_path / "raw" / "events.csv"
  _write(raw, _events(np.random.default_rng(0), 200))
  temp = tmp_path / folder
  code = cli.main(["--dataset", "files", "--path", str(raw), "--user-col", "uid", "--item-col",
                   "item", "--time-col", "ts", "--engine", "duckdb", "--temp-dir", str(temp),
                   "--out", str(tmp_path / "out")])
  assert code == 0
  assert not list(tmp_path.rglob("INJECTED*"))  # the COPY never ran
  assert temp.is_dir() and not os.listdir(temp)  # its work folder was used and removed
  settings = engine.duckdb_settings(str(temp), 2**30, 2)
  assert settings["temp_directory"] == os.path.join(str(temp), "spill")
  ref = tmp_path / "ref"
  prepare.prepare_dataset("files", ref, engine="memory", source_options=dict(path=str(raw),
                                                                           **COLUMNS))
  assert _hashes(tmp_path / "out") == _hashes(ref)
