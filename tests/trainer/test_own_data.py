"""A new user's whole path: a CSV of their own -> train -> evaluate -> recommend -> export.

The CSV is written here: string user and item ids, ISO-8601 times, rows in
shuffled order, and a planted pattern (each user walks a cycle of songs, one
step at a time). Training goes through the command line exactly as README
shows it (`python -m trainer.main --config=configs/own_data.py` plus the
`files` source's options); the commands after it run in-process through
their `main(argv)`.
"""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from trainer import evaluate
from trainer.commands import evaluate as evaluate_command, export, recommend, workdir as workdir_lib

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NUM_USERS, NUM_SONGS, WALK = 160, 40, 12
TOP_K = 5


def _song(index: int) -> str:
  return f"song-{index % NUM_SONGS:02d}"


def _write_csv(path) -> dict[str, list[str]]:
  """Each user plays WALK consecutive songs of the cycle from a random start."""
  rng = np.random.default_rng(0)
  rows, walks = [], {}
  for user in range(NUM_USERS):
    name = f"user-{user:03d}"
    start = int(rng.integers(NUM_SONGS))
    walks[name] = [_song(start + step) for step in range(WALK)]
    for step, song in enumerate(walks[name]):
      minute = 7 * user + step
      rows.append(f"{name},{song},2024-03-{1 + minute // 1440:02d}T"
                  f"{minute // 60 % 24:02d}:{minute % 60:02d}:00Z,{100 - step}")
  rng.shuffle(rows)
  path.write_text("listener,track,played_at,score\n" + "\n".join(rows) + "\n")
  return walks


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  """`(workdir, walks)` after `python -m trainer.main` on the CSV."""
  folder = tmp_path_factory.mktemp("own")
  walks = _write_csv(folder / "plays.csv")
  workdir = str(folder / "run")
  flags = {
      "data.source_options.path": str(folder / "*.csv"),
      "data.source_options.user_col": "listener",
      "data.source_options.item_col": "track",
      "data.source_options.time_col": "played_at",
      "data.min_item_count": 1, "train_steps": 150, "batch_size": 32,
      "eval_batch_size": 64, "seq_len": 12, "num_targets": 2, "model.dim": 32,
      "model.num_layers": 1, "model.dropout_rate": 0.0, "optimizer.learning_rate": 5e-3,
      "optimizer.warmup_steps": 10, "eval_every": 75, "checkpoint_every": 75,
      "log_every": 50, "eval.max_batches": 1,
  }
  command = [sys.executable, "-m", "trainer.main", "--config=configs/own_data.py",
             f"--workdir={workdir}"] + [f"--config.{key}={value}" for key, value in flags.items()]
  done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600,
                        check=False)
  assert done.returncode == 0, done.stderr[-3000:]
  assert "preparing files into" in done.stdout and "best test" in done.stdout, done.stdout
  return workdir, walks


def _run(module, capsys, *flags):
  status = module.main([module.__name__, *flags])
  captured = capsys.readouterr()
  return status, captured.out, captured.err


def test_prepared_data_keeps_the_raw_string_ids(run):
  workdir, walks = run
  data = workdir_lib.open_run(workdir, say=lambda line: None).data
  assert data.user_ids.dtype.kind == "T" and data.item_ids.dtype.kind == "T"
  assert sorted(data.user_ids.tolist()) == sorted(walks)
  assert sorted(data.item_ids.tolist()) == sorted({_song(i) for i in range(NUM_SONGS)})
  # Time order restored from the shuffled file: each history is its walk.
  for user, raw in enumerate(data.user_ids.tolist()):
    history = data.items[data.offsets[user]:data.offsets[user + 1]]
    assert data.item_ids[history].tolist() == walks[raw]


def test_evaluate_learns_the_planted_walk(run, capsys):
  workdir, _ = run
  status, out, err = _run(evaluate_command, capsys, f"--workdir={workdir}", "--split=test")
  assert status == 0, err
  record = json.loads(out.splitlines()[-1])
  assert record["metrics"]["test"]["num_users"] == NUM_USERS
  # The next song is fully determined by the last one; a most-popular guess
  # would hit about 10 of 40 songs.
  assert record["metrics"]["test"]["hit@10"] > 0.9, record


def test_recommend_export_and_reload(run, capsys, tmp_path):
  workdir, walks = run
  out = tmp_path / "recs.jsonl"
  status, _, err = _run(recommend, capsys, f"--workdir={workdir}", f"--top_k={TOP_K}",
                        f"--out={out}")
  assert status == 0, err
  records = {r["user"]: r for r in map(json.loads, out.read_text().splitlines())}
  assert sorted(records) == sorted(walks)
  # Raw ids out, seen songs never recommended, the walk's next song first.
  nexts = 0
  for user, walk in walks.items():
    assert not set(records[user]["items"]) & set(walk)
    nexts += records[user]["items"][0] == _song(int(walk[-1][-2:]) + 1)
  assert nexts >= 0.9 * NUM_USERS, nexts

  exported = tmp_path / "export"
  status, _, err = _run(export, capsys, f"--workdir={workdir}", f"--out={exported}")
  assert status == 0, err
  loaded = export.load_export(exported)
  trained = workdir_lib.open_run(workdir, say=lambda line: None)
  data, seq_len = trained.data, loaded.manifest["seq_len"]
  assert loaded.item_ids.tolist() == data.item_ids.tolist()
  # The same top-k from the exported table and NumPy alone.
  inputs = np.full((data.num_users, seq_len), data.num_items, np.int32)
  for user in range(data.num_users):
    history = np.asarray(data.items[data.offsets[user]:data.offsets[user + 1]])[-seq_len:]
    inputs[user, seq_len - history.shape[0]:] = history
  forward = jax.jit(lambda params, ids: nnx.merge(trained.graphdef, params)(ids)[:, -1])
  hidden = np.asarray(forward(trained.params, jnp.asarray(inputs)))
  scores = hidden.astype(np.float64) @ loaded.item_embeddings.astype(np.float64).T
  for user, raw in enumerate(data.user_ids.tolist()):
    row = scores[user].copy()
    row[data.items[data.offsets[user]:data.offsets[user + 1]]] = -np.inf
    best = np.argsort(-row, kind="stable")[:TOP_K]
    got = records[raw]
    np.testing.assert_allclose(got["scores"], row[best], rtol=1e-4, atol=1e-5)
    assert got["items"][0] == loaded.item_ids[best[0]]
