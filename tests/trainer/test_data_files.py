"""The `files` source: formats, paths, ids, times, filter, errors, Yambda, config, manifest.

No training: every test reads a few tiny files.
"""

import gzip
import json
import os
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from ml_collections import config_dict

from configs import ml1m, smoke
from trainer.config import keys as config_keys, schema
from trainer.data import __main__ as cli
from trainer.data import files, prepare, preprocess, sources, storage, yambda

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EIGHT = config_keys.Context(device_count=8)

# Two users, string ids, ISO times; user "bob" listened to "b" too briefly.
ROWS = [
    {"uid": "bob", "item": "b", "ts": "2024-01-01T00:00:10Z", "ratio": 20},
    {"uid": "ann", "item": "a", "ts": "2024-01-01T00:00:00Z", "ratio": 90},
    {"uid": "bob", "item": "c", "ts": "2024-01-01T00:00:05Z", "ratio": 100},
    {"uid": "ann", "item": "c", "ts": "2024-01-01T00:00:30Z", "ratio": 50},
    {"uid": "bob", "item": "a", "ts": "2024-01-01T00:00:20Z", "ratio": 70},
]
T0 = 1_704_067_200  # 2024-01-01T00:00:00Z in seconds
COLUMNS = dict(user_col="uid", item_col="item", time_col="ts")


def _write(path, rows, kind=None):
  """Writes `rows` (dicts) as the format of `path`'s name; returns the path."""
  kind = kind or files.file_format(path)
  names = list(rows[0])
  if kind == "parquet":
    pq.write_table(pa.table({n: [r[n] for r in rows] for n in names}), path)
    return path
  if kind == "json":
    text = "".join(json.dumps(r) + "\n" for r in rows)
  else:
    sep = "," if kind == "csv" else "\t"
    text = "".join(sep.join(str(r[n]) for n in names) + "\n" for r in [dict(zip(names, names))]
                   + rows)
  opener = gzip.open if str(path).endswith(".gz") else open
  with opener(path, "wt", encoding="utf-8") as file:
    file.write(text)
  return path


def _raw_sequences(data: sources.Interactions) -> dict:
  """{raw user: [raw items in time order]}: what any reading must agree on."""
  seqs = preprocess.prepare_sequences(data)
  return {seqs.user_ids[u].item(): [seqs.item_ids[i].item() for i in seqs.user(u)]
          for u in range(seqs.num_users)}


# --------------------------------------------------------------------------- #
# Formats and paths                                                            #
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("name", ["d.csv", "d.tsv", "d.jsonl", "d.parquet", "d.csv.gz",
                                  "d.ndjson"])
def test_every_format_reads_the_same_table(name, tmp_path):
  data = files.load_files(_write(tmp_path / name, ROWS), **COLUMNS)
  assert _raw_sequences(data) == {"ann": ["a", "c"], "bob": ["c", "b", "a"]}
  assert data.user_vocab.dtype.kind == "U" and data.user_vocab.tolist() == ["ann", "bob"]
  np.testing.assert_array_equal(data.timestamp, [T0 + 10, T0, T0 + 5, T0 + 30, T0 + 20])


def test_folder_and_glob_are_one_table_in_path_order(tmp_path):
  folder = tmp_path / "logs"
  (folder / "day2").mkdir(parents=True)
  _write(folder / "part-1.parquet", ROWS[:2])
  _write(folder / "day2" / "part-0.parquet", ROWS[2:])
  (folder / "_SUCCESS").write_text("")
  (folder / ".hidden.csv").write_text("garbage")
  (folder / "notes.txt").write_text("not data")
  by_folder = files.load_files(folder, **COLUMNS)
  # Sorted paths: day2/part-0 first.
  assert [by_folder.user_vocab[u] for u in by_folder.user] == [
      r["uid"] for r in ROWS[2:] + ROWS[:2]]
  by_glob = files.load_files(str(folder / "**" / "*.parquet"), **COLUMNS)
  np.testing.assert_array_equal(by_glob.timestamp, by_folder.timestamp)
  assert files.resolve_files(str(folder / "*.parquet")) == [folder / "part-1.parquet"]


def test_mixed_formats_in_one_folder(tmp_path):
  _write(tmp_path / "a.csv", ROWS[:3])
  _write(tmp_path / "b.jsonl", ROWS[3:])
  data = files.load_files(tmp_path, **COLUMNS)
  assert _raw_sequences(data) == {"ann": ["a", "c"], "bob": ["c", "b", "a"]}


# --------------------------------------------------------------------------- #
# Ids                                                                          #
# --------------------------------------------------------------------------- #


def test_integer_ids_stay_integers_and_the_id_maps_are_saved(tmp_path):
  rows = [{"u": 30, "i": 700, "t": 3}, {"u": 10, "i": 500, "t": 1},
          {"u": 30, "i": 500, "t": 2}, {"u": 10, "i": 900, "t": 5}]
  _write(tmp_path / "d.parquet", rows)
  options = dict(path=str(tmp_path / "d.parquet"), user_col="u", item_col="i", time_col="t")
  data = files.load_files(**options)
  assert data.user_vocab is None and data.user.dtype == np.int64
  prepare.prepare_dataset("files", tmp_path / "out", source_options=options, seq_lens=(2,))
  prepared = storage.load_prepared(tmp_path / "out")
  assert prepared.item_ids.dtype == np.int64
  np.testing.assert_array_equal(np.load(tmp_path / "out" / "user_ids.npy", allow_pickle=False),
                                [10, 30])
  np.testing.assert_array_equal(prepared.item_ids, [500, 700, 900])


def test_string_ids_round_trip_through_the_prepared_folder(tmp_path):
  path = _write(tmp_path / "d.csv", ROWS)
  options = dict(path=str(path), **COLUMNS)
  prepare.prepare_dataset("files", tmp_path / "out", source_options=options, seq_lens=(2,))
  data = storage.load_prepared(tmp_path / "out")
  for name in ("user_ids", "item_ids"):
    # Stored unpadded: one UTF-8 blob and offsets, each readable without pickle.
    utf8 = np.load(tmp_path / "out" / f"{name}.utf8.npy", allow_pickle=False)
    offsets = np.load(tmp_path / "out" / f"{name}.offsets.npy", allow_pickle=False)
    assert getattr(data, name).dtype.kind == "T"
    assert storage.decode_strings(utf8, offsets).tolist() == getattr(data, name).tolist()
  # The downstream contract: item_ids[dense] is the raw id.
  raw = {}
  for u in range(data.num_users):
    items = data.items[data.offsets[u]:data.offsets[u + 1]]
    raw[data.user_ids[u:u + 1].item()] = data.item_ids[np.asarray(items)].tolist()
  assert raw == {"ann": ["a", "c"], "bob": ["c", "b", "a"]}
  assert isinstance(data.item_ids[0], str) and isinstance(data.item_ids.tolist()[0], str)


def test_csv_ids_are_integers_only_when_every_value_is_a_plain_integer(tmp_path):
  rows = [{"u": "7", "i": "007", "t": 1}, {"u": "12", "i": "7", "t": 2}]
  data = files.load_files(_write(tmp_path / "d.csv", rows), user_col="u", item_col="i",
                          time_col="t")
  assert data.user_vocab is None and sorted(data.user.tolist()) == [7, 12]
  assert data.item_vocab.tolist() == ["007", "7"]  # leading zero: text ids


def test_integers_in_one_file_and_strings_in_another_are_all_text(tmp_path):
  _write(tmp_path / "a.parquet", [{"u": 5, "i": 1, "t": 1}, {"u": 6, "i": 2, "t": 2}])
  _write(tmp_path / "b.parquet", [{"u": "x", "i": 1, "t": 3}])
  data = files.load_files(tmp_path, user_col="u", item_col="i", time_col="t")
  assert data.user_vocab.tolist() == ["5", "6", "x"]
  assert data.item_vocab is None


def test_categorical_and_large_string_columns(tmp_path):
  table = pa.table({
      "u": pa.array(["b", "a"]).dictionary_encode(),  # a pandas categorical
      "i": pa.array(["x", "y"], pa.large_string()),
      "t": pa.array(["2024-01-01T00:00:00Z", "2024-01-01 00:00:01"], pa.large_string())})
  pq.write_table(table, tmp_path / "d.parquet")
  data = files.load_files(tmp_path / "d.parquet", user_col="u", item_col="i", time_col="t",
                          filter="u==b")
  assert data.user_vocab.tolist() == ["b"] and data.timestamp.tolist() == [T0]


def test_interactions_check_their_vocabularies():
  ids = np.array([0, 1], np.int64)
  with pytest.raises(ValueError, match="strictly increasing, found 'b' then 'a'"):
    sources.Interactions(user=ids, item=ids, timestamp=ids, user_vocab=np.array(["b", "a"]))
  with pytest.raises(ValueError, match="item code 1 >= item_vocab size 1"):
    sources.Interactions(user=ids, item=ids, timestamp=ids, item_vocab=np.array(["a"]))
  with pytest.raises(TypeError, match="unicode"):
    sources.Interactions(user=ids, item=ids, timestamp=ids,
                         user_vocab=np.array(["a", "b"], object))


def test_storage_takes_unicode_id_maps_but_not_objects(tmp_path):
  arrays = {n: np.zeros((1,) * rank, dtype) for n, (dtype, rank) in storage.ARRAYS.items()}
  arrays["item_ids"] = np.array(["x"])
  storage.write_prepared(tmp_path, arrays, {})
  assert storage.load_prepared(tmp_path).item_ids.tolist() == ["x"]
  arrays["item_ids"] = np.array(["x"], object)
  with pytest.raises(ValueError, match=r"'item_ids' is object.*expected int64 \(or strings\)"):
    storage.write_prepared(tmp_path, arrays, {})


# --------------------------------------------------------------------------- #
# Times                                                                        #
# --------------------------------------------------------------------------- #


def test_iso_strings_with_and_without_zones(tmp_path):
  times = ["2024-01-01T00:00:00Z", "2024-01-01T01:00:00+01:00", "2024-01-01 00:00:01.750",
           "2024-01-02", "2024-01-01T00:00:03-0000"]
  rows = [{"u": 1, "i": k, "t": t} for k, t in enumerate(times)]
  path = _write(tmp_path / "d.jsonl", rows)
  seconds = files.load_files(path, user_col="u", item_col="i", time_col="t")
  np.testing.assert_array_equal(seconds.timestamp, [T0, T0, T0 + 1, T0 + 86_400, T0 + 3])
  millis = files.load_files(path, user_col="u", item_col="i", time_col="t", time_unit="ms")
  assert millis.timestamp[2] == (T0 + 1) * 1000 + 750


def test_numeric_times_are_counts_of_time_unit(tmp_path):
  rows = [{"u": 1, "i": 1, "t": 1_700_000_000_123}, {"u": 1, "i": 2, "t": 5}]
  path = _write(tmp_path / "d.csv", rows)
  for unit in files.TIME_UNITS:  # the unit says what a number is: kept as it is
    data = files.load_files(path, user_col="u", item_col="i", time_col="t", time_unit=unit)
    np.testing.assert_array_equal(data.timestamp, [1_700_000_000_123, 5])
  floats = _write(tmp_path / "f.parquet", [{"u": 1, "i": 1, "t": 2.9}, {"u": 1, "i": 2, "t": -0.5}])
  np.testing.assert_array_equal(
      files.load_files(floats, user_col="u", item_col="i", time_col="t").timestamp, [2, -1])


def test_typed_date_times_convert_to_the_unit(tmp_path):
  table = pa.table({
      "u": [1, 1], "i": [1, 2],
      "t": pa.array([1_500, 2_999], pa.timestamp("ms", "UTC")),
      "d": pa.array([0, 2], pa.date32()),
  })
  pq.write_table(table, tmp_path / "d.parquet")
  read = lambda col, unit: files.load_files(tmp_path / "d.parquet", user_col="u", item_col="i",
                                            time_col=col, time_unit=unit).timestamp.tolist()
  assert read("t", "s") == [1, 2]
  assert read("t", "us") == [1_500_000, 2_999_000]
  assert read("d", "s") == [0, 2 * 86_400]


# --------------------------------------------------------------------------- #
# Filter                                                                       #
# --------------------------------------------------------------------------- #


def test_parse_filter():
  assert files.parse_filter("played_ratio_pct>=50") == ("played_ratio_pct", ">=", 50,
                                                        "played_ratio_pct>=50", False)
  assert files.parse_filter(" x != 2.5 ")[1:3] == ("!=", 2.5)
  assert files.parse_filter("event==listen").value == "listen"
  assert files.parse_filter('event == "50"').value == "50"  # quoted: text
  for bad in ("x=5", "x>=", ">=5", "x >> 5", "x => 5", ""):
    with pytest.raises(ValueError, match="expected '<column> <op> <value>'"):
      files.parse_filter(bad)


@pytest.mark.parametrize("name", ["d.csv", "d.parquet"])
def test_filters_keep_rows_where_the_condition_holds(name, tmp_path):
  path = _write(tmp_path / name, ROWS)
  def items(condition):
    data = files.load_files(path, **COLUMNS, filter=condition)
    return [data.item_vocab[i] for i in data.item]
  assert items("ratio>=50") == ["a", "c", "c", "a"]
  assert items("ratio < 50") == ["b"]
  assert items("uid==bob") == ["b", "c", "a"]
  assert items("item != 'c'") == ["b", "a", "a"]


def test_filter_drops_nulls_and_checks_types(tmp_path):
  table = pa.table({"u": [1, 1, 2], "i": [1, 2, 3], "t": [1, 2, 3], "r": [None, 80, 10],
                    "liked": [True, False, True], "tag": ["x", "y", "z"]})
  pq.write_table(table, tmp_path / "d.parquet")
  read = lambda condition: files.load_files(tmp_path / "d.parquet", user_col="u",
                                            item_col="i", time_col="t",
                                            filter=condition).item.tolist()
  assert read("r>=0") == [2, 3]  # null: dropped
  assert read("liked==true") == [1, 3]
  with pytest.raises(ValueError, match=r"filter 'tag>=5': column 'tag' of .*d\.parquet holds "
                     "text that is not a number"):
    read("tag>=5")
  with pytest.raises(TypeError, match=r"column 'liked' .* has type bool; expected numbers"):
    read("liked>0")
  with pytest.raises(TypeError, match="column 'r' .* has type int64; expected text"):
    read("r==abc")
  with pytest.raises(ValueError, match=r"lacks columns \['nope'\]"):
    read("nope>1")


# --------------------------------------------------------------------------- #
# Bad input: one clear error naming the file and the column                    #
# --------------------------------------------------------------------------- #


def test_bad_input_errors(tmp_path):
  good = _write(tmp_path / "d.csv", ROWS)
  with pytest.raises(ValueError, match=rf"{tmp_path}/d\.csv lacks columns \['user'\]; found "
                     r"\['uid', 'item', 'ts', 'ratio'\]"):
    files.load_files(good, user_col="user", item_col="item", time_col="ts")
  (tmp_path / "empty").mkdir()
  header_only = tmp_path / "empty" / "h.csv"
  header_only.write_text("uid,item,ts\n")
  with pytest.raises(ValueError, match=r"h\.csv has no rows"):
    files.load_files(header_only, **COLUMNS)
  with pytest.raises(ValueError, match=r"d\.csv has no interactions left after filter "
                     r"'ratio>1000' \(5 rows read\)"):
    files.load_files(good, **COLUMNS, filter="ratio>1000")
  bad_time = _write(tmp_path / "t.csv", [{"uid": 1, "item": 1, "ts": "2024-01-01"},
                                         {"uid": 1, "item": 2, "ts": "yesterday"}])
  with pytest.raises(ValueError, match=r"column 'ts' of .*t\.csv holds a value that is not a "
                     r"time .*'yesterday'"):
    files.load_files(bad_time, **COLUMNS)
  with pytest.raises(FileNotFoundError, match=r"matches no files"):
    files.load_files(str(tmp_path / "*.parquet"), **COLUMNS)
  with pytest.raises(FileNotFoundError, match="does not exist"):
    files.load_files(tmp_path / "missing.csv", **COLUMNS)
  (tmp_path / "text").mkdir()
  (tmp_path / "text" / "a.txt").write_text("x")
  with pytest.raises(FileNotFoundError, match="holds no data files"):
    files.load_files(tmp_path / "text", **COLUMNS)
  with pytest.raises(ValueError, match=r"a\.txt: unknown file format"):
    files.load_files(tmp_path / "text" / "a.txt", **COLUMNS)
  with pytest.raises(ValueError, match="time_unit 'h' is unknown"):
    files.load_files(good, **COLUMNS, time_unit="h")


@pytest.mark.parametrize("engine", ["memory", "duckdb"])
def test_a_repeated_column_name_is_refused_not_read_first(engine, tmp_path):
  """A CSV header naming a used column twice: both readers refuse, naming it."""
  (tmp_path / "in").mkdir()
  (tmp_path / "in" / "d.csv").write_text(
      "uid,item,ts,item,note,note\nann,a,1,b,x,y\nann,c,2,d,x,y\nbob,a,3,e,x,y\n")
  options = {"path": str(tmp_path / "in" / "d.csv"), **COLUMNS}
  with pytest.raises(sources.DataError, match=r"d\.csv has duplicate column names \('item' 2 "
                     r"times; found \['uid', 'item', 'ts', 'item', 'note', 'note'\]\)"):
    prepare.prepare_dataset("files", tmp_path / "out", min_item_count=1, engine=engine,
                            source_options=options)
  assert not (tmp_path / "out" / storage.MANIFEST).exists()
  # A repeated column the source does not read is no ambiguity.
  (tmp_path / "in" / "d.csv").write_text("uid,item,ts,note,note\nann,a,1,x,y\nann,c,2,x,y\n")
  prepare.prepare_dataset("files", tmp_path / "out", min_item_count=1, engine=engine,
                          source_options=options)


def test_one_column_for_two_fields_is_refused(tmp_path):
  good = _write(tmp_path / "d.csv", ROWS)
  with pytest.raises(sources.DataError, match="item_col='uid' is also user_col"):
    files.load_files(good, user_col="uid", item_col="uid", time_col="ts")
  with pytest.raises(sources.DataError, match="time_col='item' is also item_col"):
    files.load_files(good, user_col="uid", item_col="item", time_col="item")


def test_bad_id_columns(tmp_path):
  nulls = _write(tmp_path / "n.jsonl", [{"u": 1, "i": None, "t": 1}, {"u": 1, "i": 2, "t": 2}])
  with pytest.raises(ValueError, match=r"column 'i' of .*n\.jsonl has 1 empty values"):
    files.load_files(nulls, user_col="u", item_col="i", time_col="t")
  negative = _write(tmp_path / "m.parquet", [{"u": -4, "i": 1, "t": 1}])
  with pytest.raises(ValueError, match=r"user ids must be >= 0, found -4 in column 'u'"):
    files.load_files(negative, user_col="u", item_col="i", time_col="t")
  floats = _write(tmp_path / "f.parquet", [{"u": 1, "i": 1.5, "t": 1}])
  with pytest.raises(TypeError, match=r"column 'i' of .*f\.parquet has type double; expected "
                     "integer or string item ids"):
    files.load_files(floats, user_col="u", item_col="i", time_col="t")


# --------------------------------------------------------------------------- #
# Yambda is a preset                                                           #
# --------------------------------------------------------------------------- #


def test_yambda_is_the_files_reader_with_its_columns_and_filter(tmp_path):
  table = pa.table({
      "uid": pa.array([5, 5, 9, 9], pa.uint32()),
      "item_id": pa.array([10, 11, 10, 12], pa.uint32()),
      "timestamp": pa.array([100, 50, 70, 60], pa.uint32()),
      "played_ratio_pct": pa.array([100, 20, 50, 49], pa.uint16())})
  pq.write_table(table, tmp_path / "listens.parquet")
  preset = yambda.load_yambda(tmp_path, "listens", min_played_ratio=50)
  general = files.load_files(tmp_path / "listens.parquet", user_col="uid", item_col="item_id",
                             time_col="timestamp", filter="played_ratio_pct>=50")
  for field in ("user", "item", "timestamp"):
    np.testing.assert_array_equal(getattr(preset, field), getattr(general, field))
  assert preset.name == "yambda/listens"


# --------------------------------------------------------------------------- #
# Command line                                                                 #
# --------------------------------------------------------------------------- #


def test_cli_prepares_files(tmp_path, capsys):
  folder = tmp_path / "in"
  folder.mkdir()
  _write(folder / "a.parquet", ROWS)
  argv = ["--dataset", "files", "--path", str(folder / "*.parquet"), "--user-col", "uid",
          "--item-col", "item", "--time-col", "ts", "--filter", "ratio>=50", "--seq-len", "2",
          "--out", str(tmp_path / "out")]
  assert cli.main(argv) == 0
  summary = json.loads(capsys.readouterr().out)
  assert summary["dataset"] == "files" and summary["num_users"] == 2
  assert summary["num_interactions"] == 4
  manifest = storage.load_prepared(tmp_path / "out").manifest
  assert manifest["source_options"] == {
      "path": str(folder / "*.parquet"), "user_col": "uid", "item_col": "item",
      "time_col": "ts", "filter": "ratio>=50", "time_unit": "s"}


@pytest.mark.parametrize("change,start", [
    ({"--user-col": "user"}, "bad data: "),
    ({"--time-col": "uid"}, "bad config: --time-col='uid': another column than --user-col "
     "(both name 'uid')"),
    ({"--item-col": "uid"}, "bad config: --item-col='uid': another column than --user-col "
     "(both name 'uid'): users, items and times are three columns"),
    ({"--time-col": "time", "--path": "DUP"}, "bad data: "),
    ({"--path": "NOWHERE/*.csv"}, "bad config: --path="),
    ({"--filter": "ratio=5"}, "bad config: --filter='ratio=5': '=' is not part of a condition; "
     "expected '<column> <op> <value>'"),
    ({"--time-unit": "days"}, "bad config: --time-unit='days': one of 's', 'ms', 'us', 'ns'"),
    ({"--item-col": None}, "bad config: --item-col=None: a column name (required with "
     "--dataset files)"),
])
def test_cli_bad_files_exit_2_with_one_line(change, start, tmp_path, capsys):
  _write(tmp_path / "d.csv", ROWS)
  (tmp_path / "dup.csv").write_text("uid,item,time,time\nann,a,1,2\n")
  flags = {"--dataset": "files", "--path": str(tmp_path / "d.csv"), "--user-col": "uid",
           "--item-col": "item", "--time-col": "ts", "--out": str(tmp_path / "out")}
  flags.update({k: v.replace("NOWHERE", str(tmp_path / "no"))
                .replace("DUP", str(tmp_path / "dup.csv")) if v else v
                for k, v in change.items()})
  argv = [part for flag, value in flags.items() if value is not None for part in (flag, value)]
  assert cli.main(argv) == 2
  err = capsys.readouterr().err
  assert err.startswith(start) and err.count("\n") == 1, err
  if start == "bad data: " and "--user-col" in change:
    assert "lacks columns ['user']" in err and str(tmp_path / "d.csv") in err
  elif start == "bad data: ":
    assert f"{tmp_path / 'dup.csv'} has duplicate column names ('time' 2 times" in err, err
  assert not (tmp_path / "out" / "manifest.json").exists()


# --------------------------------------------------------------------------- #
# Config: source options of every source                                      #
# --------------------------------------------------------------------------- #


def _files_config(tmp_path, **options):
  config = smoke.get_config().to_dict()
  config["data"].update(dataset="files", source_options={
      "path": str(tmp_path / "d.csv"), **COLUMNS, **options})
  return config


def test_config_accepts_files_and_names_the_source_keys(tmp_path):
  config_keys.check(_files_config(tmp_path, filter="ratio>=50", time_unit="ms"), EIGHT)
  config = _files_config(tmp_path, user_column="uid")
  with pytest.raises(schema.ConfigError, match=(
      r"^config\.data\.source_options\.user_column='uid': unknown key; config\.data\."
      r"source_options holds path, user_col, item_col, time_col, filter, time_unit when "
      r"config\.data\.dataset='files'$")):
    config_keys.check(config, EIGHT)
  with pytest.raises(schema.ConfigError, match=r"^config\.data\.source_options\.filter='r=5': "
                     "None or a filter: '=' is not part of a condition"):
    config_keys.check(_files_config(tmp_path, filter="r=5"), EIGHT)
  with pytest.raises(schema.ConfigError, match=r"^config\.data\.source_options\.path=.*: a file, "
                     r"folder or glob of data files \(nothing is prepared in .* yet"):
    config_keys.check(_files_config(tmp_path), config_keys.Context(
        device_count=8, workdir=str(tmp_path / "work")))
  assert prepare.default_min_item_count("files") == 1
  assert prepare.default_min_item_count("a-source-without-entry") == 1
  assert prepare.DEFAULT_MIN_ITEM_COUNT["a-source-without-entry"] == 1


def test_unknown_override_lists_each_datasets_options():
  argv = ["main", "--config=configs/ml1m.py", "--config.data.source_options.cachedir=/x"]
  with pytest.raises(schema.ConfigError, match=(
      r"config\.data\.source_options\.cachedir='/x': unknown key; config\.data\.source_options "
      r"holds, by config\.data\.dataset: 'ml-1m': cache_dir; .*'files': path, user_col")):
    config_keys.check_overrides(argv)


def test_overrides_may_add_described_option_keys_to_a_locked_config():
  config = ml1m.get_config()
  config.lock()
  added = config_keys.add_option_keys(config, [
      "data.source_options.cache_dir", "data.source_options.nope", "model.dim"])
  assert added == ["data.source_options.cache_dir"]
  assert config.is_locked and config.data.source_options.cache_dir is None
  assert config.data.source_options.get_type("cache_dir") is str
  config.data.source_options.cache_dir = "/tmp/cache"  # what the override does
  config_keys.check(config, EIGHT)
  with pytest.raises(AttributeError):
    config.data.source_options.other = 1  # still locked
  assert isinstance(config.data.source_options, config_dict.ConfigDict)
  assert config_keys.add_option_keys(config, ["data.split_options.gap"]) == [
      "data.split_options.gap"]
  assert config.data.split_options.get_type("gap") is int


def test_trainer_main_takes_a_source_option_the_config_file_lacks(tmp_path):
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8",
             JAX_PLATFORMS="cpu")
  result = subprocess.run(
      [sys.executable, "-m", "trainer.main", "--config=configs/ml1m.py",
       f"--workdir={tmp_path}", f"--config.data.source_options.cache_dir={tmp_path}",
       "--config.seq_len=0"],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
  # The cache_dir override is taken; the check stops on seq_len, before any work.
  assert result.returncode == 2, result.stderr[-2000:]
  assert result.stderr.splitlines() == ["bad config: config.seq_len=0: an integer >= 1"]


# --------------------------------------------------------------------------- #
# The manifest records the options; a folder is reused only when they match   #
# --------------------------------------------------------------------------- #


def test_manifest_mismatch_lists_the_differing_options(tmp_path):
  path = _write(tmp_path / "d.csv", ROWS)
  options = dict(path=str(path), **COLUMNS)
  out = tmp_path / "out"
  assert prepare.prepared_mismatch(out, dataset="files") == [f"nothing prepared in {out}"]
  assert prepare.needs_preparation(out, explicit=True, dataset="files", source_options=options)
  prepare.prepare_dataset("files", out, source_options=options, seq_lens=(2,))
  manifest = storage.load_prepared(out).manifest
  assert manifest["source_options"]["time_unit"] == "s"  # defaults recorded
  assert manifest["min_item_count"] == 1 and manifest["min_user_count"] == 1
  same = dict(source_options={**options, "time_unit": "s", "filter": None},
              min_item_count=None, split="loo", split_options={})
  assert prepare.prepared_mismatch(out, dataset="files", **same) == []
  assert not prepare.needs_preparation(out, explicit=True, dataset="files", **same)
  assert prepare.is_prepared(out, dataset="files", seq_len=2, **same)
  assert prepare.is_prepared(out, dataset="files", seq_len=2)  # the old call
  other = dict(same, source_options={**options, "filter": "ratio>=50"}, min_item_count=2,
               split="gts", split_options={"test_window": 10, "validation_window": 5})
  assert prepare.prepared_mismatch(out, dataset="files", **other) == [
      "source_options.filter: prepared None, asked 'ratio>=50'",
      "min_item_count: prepared 1, asked 2",
      "split: prepared 'loo', asked 'gts'"]
  assert not prepare.is_prepared(out, dataset="files", seq_len=2, **other)
  # WORKDIR/data: prepare again; an explicit folder: stop.
  assert prepare.needs_preparation(out, explicit=False, dataset="files", **other)
  with pytest.raises(ValueError, match=r"holds data prepared with other options \(source_options"
                     r"\.filter: prepared None, asked 'ratio>=50'; min_item_count"):
    prepare.needs_preparation(out, explicit=True, dataset="files", **other)
  assert prepare.prepared_mismatch(out, dataset="yambda") == [
      "dataset: prepared 'files', asked 'yambda'"]


def test_gts_options_and_cache_dir_in_the_comparison(tmp_path, make_interactions):
  raw = make_interactions([(0, 1, 1), (0, 2, 2), (0, 3, 30), (1, 1, 5), (1, 3, 31)])
  prepare.prepare_interactions(raw, tmp_path, dataset="ml-1m", min_item_count=1,
                               split="gts", split_options={"test_window": 10,
                                                           "validation_window": 0},
                               source_options={"cache_dir": "/a"})
  asked = dict(dataset="ml-1m", split="gts", min_item_count=1,
               split_options={"test_window": 10, "validation_window": 0, "gap": 0})
  assert prepare.prepared_mismatch(tmp_path, **asked, source_options={"cache_dir": "/b"}) == []
  asked["split_options"]["gap"] = 3
  assert prepare.prepared_mismatch(tmp_path, **asked) == [
      "split_options.gap: prepared 0, asked 3"]


def test_config_stops_on_an_explicit_prepared_dir_of_other_options(tmp_path):
  path = _write(tmp_path / "d.csv", ROWS)
  prepare.prepare_dataset("files", tmp_path / "prepared",
                          source_options=dict(path=str(path), **COLUMNS))
  config = _files_config(tmp_path, filter="ratio>=50")
  config["data"]["prepared_dir"] = str(tmp_path / "prepared")
  context = config_keys.Context(device_count=8, workdir=str(tmp_path / "work"))
  with pytest.raises(schema.ConfigError, match=(
      r"^config\.data\.prepared_dir='.*prepared': a folder holding nothing yet or this data "
      r"prepared with these options; it was prepared with other options \(source_options\."
      r"filter: prepared None, asked 'ratio>=50'\)")):
    config_keys.check(config, context)
  config["data"]["source_options"].pop("filter")
  config_keys.check(config, context)
