"""The `files` source's filter is parsed whole, or refused in one line (issue 41, bad cause 6).

`--filter "item >= 30 AND item < 40"` once kept items 4..9 and 30..59: the
tail after `>=` was one bare word compared as text. Every token now belongs
to the tree; a value with spaces must be quoted.
"""

import csv
import os
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from trainer.data import engine, files, filters

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _csv(path, rows):
  with open(path, "w", newline="", encoding="utf-8") as file:
    writer = csv.DictWriter(file, fieldnames=list(rows[0]))
    writer.writeheader()
    writer.writerows(rows)
  return path


# Integer ids 0..59 of 6 users, one event each per (user, item): CSV reads them as text.
ROWS = [{"user": u, "item": i, "ts": 100 * u + i, "tag": "rock and roll" if i % 2 else "pop"}
        for u in range(6) for i in range(60) if (i + u) % 6 == 0]


def _items(path, condition, **options):
  data = files.load_files(path, user_col="user", item_col="item", time_col="ts",
                          filter=condition, **options)
  return sorted({int(data.item_vocab[i]) if data.item_vocab is not None else int(i)
                 for i in data.item})


def test_the_grammar():
  two = filters.parse_filter("item >= 30 AND item < 40")
  assert two == filters.Combined("AND", (
      filters.Filter("item", ">=", 30, two.text), filters.Filter("item", "<", 40, two.text)),
      two.text)
  either = filters.parse_filter("a == 1 or b == 'x y' and (c != 2 OR d > 3)")
  assert either.keyword == "OR" and either.parts[1].keyword == "AND"
  assert filters.columns(either) == ["a", "b", "c", "d"]
  assert filters.parse_filter("user==5").value == 5
  assert filters.parse_filter("tag == 'and'").value == "and"  # a keyword, quoted: a value


@pytest.mark.parametrize("text,where", [
    ("item >= 30 AND item < 40 junk", "'junk' after a whole condition"),
    ("item >= 30 and", "a column name expected, found the end"),
    ("tag == rock and roll", "an operator after 'roll' expected"),
    ("tag == rock roll", "'roll' after a whole condition"),
    ("(item > 3", "')' expected, found the end"),
    ("item > 3)", "')' after a whole condition"),
    ("item >= 30 AND AND item < 4", "a column name expected, found 'AND'"),
    ("item ! 3", "'!' is not part of a condition"),
])
def test_anything_else_is_refused_naming_where(text, where):
  with pytest.raises(ValueError, match="expected '<column> <op> <value>'") as error:
    filters.parse_filter(text)
  assert where in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize("kind", ["csv", "parquet"])
def test_and_or_keep_exactly_the_rows_they_say(tmp_path, kind):
  if kind == "csv":
    path = _csv(tmp_path / "d.csv", ROWS)
  else:
    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), path)
  assert _items(path, "item >= 30 AND item < 40") == list(range(30, 40))
  assert _items(path, "item >= 30 and user == 5") == [i for i in range(30, 60) if (i + 5) % 6 == 0]
  assert _items(path, "item < 3 OR item >= 57") == [0, 1, 2, 57, 58, 59]
  assert _items(path, "(item < 3 OR item >= 57) AND tag == 'rock and roll'") == [1, 57, 59]
  with pytest.raises(TypeError, match="column 'item'"):
    _items(path, "item >= 30 AND item < abc")  # a word against numbers: refused
  assert _items(path, "item >= 30 AND tag == pop AND item < 34") == [30, 32]


def test_the_out_of_core_engine_filters_the_same(tmp_path):
  path = _csv(tmp_path / "d.csv", ROWS)
  scan = files.FileScan([str(path)], "user", "item", "ts", "item >= 30 AND item < 40")
  kept = set()
  for _, table in engine._batches(scan, engine._IdStats(), engine._IdStats()):  # pylint: disable=protected-access
    kept.update(table.column("i_int").to_pylist())
  assert sorted(kept) == list(range(30, 40))


def test_the_command_refuses_a_filter_in_one_line(tmp_path):
  path = _csv(tmp_path / "d.csv", ROWS)
  done = subprocess.run(
      [sys.executable, "-m", "trainer.data", "--dataset=files", f"--path={path}",
       "--user-col=user", "--item-col=item", "--time-col=ts",
       "--filter=item >= 30 AND item < 40 junk", f"--out={tmp_path / 'out'}"],
      cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
  assert done.returncode == 2, done.stderr
  lines = done.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("bad config: --filter="), done.stderr
  assert "'junk' after a whole condition" in lines[0]
  assert not (tmp_path / "out").exists()
