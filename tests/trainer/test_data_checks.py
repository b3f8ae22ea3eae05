"""Prepared data with nothing to train on or nothing to evaluate is refused up front.

trainer/data/checks.py; the trainer's one line through `python -m trainer.main`.
"""

import os
import subprocess
import sys

import pytest

from trainer.data import checks, prepare, storage

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
COLUMNS = {"user_col": "user", "item_col": "item", "time_col": "ts"}


def _csv(path, events_per_user: int, users: int = 12):
  rows = [f"u{user},i{(user + event) % 7},{100 * user + event}"
          for user in range(users) for event in range(events_per_user)]
  path.write_text("user,item,ts\n" + "\n".join(rows) + "\n")
  return path


def _prepared(tmp_path, events_per_user: int, **options):
  raw = _csv(tmp_path / f"plays{events_per_user}.csv", events_per_user)
  out = tmp_path / f"prepared{events_per_user}"
  prepare.prepare_dataset("files", out, min_item_count=1, seq_lens=(4,),
                          source_options={"path": str(raw), **COLUMNS}, **options)
  return storage.load_prepared(out)


def test_loo_users_with_two_events_have_no_evaluation_user(tmp_path):
  data = _prepared(tmp_path, 2)  # trains on both events, evaluated on none
  with pytest.raises(checks.DataError, match=r"has no validation user \(12 users\): every user "
                     r"has fewer than 3 interactions \(the most is 2\)"):
    checks.check_trainable(data, seq_len=4)
  with pytest.raises(checks.DataError, match="has no test user"):
    checks.check_trainable(data, seq_len=4, eval_splits=("test",))


@pytest.mark.parametrize("policy", ["all", "last"])
def test_loo_users_with_three_events_have_no_training_window(tmp_path, policy):
  data = _prepared(tmp_path, 3)  # 1 training event each: no input with a next item
  with pytest.raises(checks.DataError, match=r"has no training window \(12 users\): every user "
                     r"has fewer than 4 interactions \(the most is 3\)"):
    checks.check_trainable(data, seq_len=4, train_windows=policy)


def test_enough_events_pass(tmp_path):
  checks.check_trainable(_prepared(tmp_path, 4), seq_len=4)


def test_gts_without_a_validation_window_names_the_window(tmp_path):
  data = _prepared(tmp_path, 6, split="gts",
                   split_options={"test_window": 2, "validation_window": 0, "gap": 0})
  checks.check_trainable(data, seq_len=4, eval_splits=("test",))
  with pytest.raises(checks.DataError, match=r"has no validation user .*validation window "
                     r".*validation_window=0"):
    checks.check_trainable(data, seq_len=4, eval_splits=("validation", "test"))


def test_the_trainer_refuses_in_one_line_before_training(tmp_path):
  raw = _csv(tmp_path / "plays.csv", 2)
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  flags = {"data.source_options.path": raw, "data.source_options.user_col": "user",
           "data.source_options.item_col": "item", "data.source_options.time_col": "ts",
           "data.min_item_count": 1, "train_steps": 4, "batch_size": 8, "eval_batch_size": 8,
           "seq_len": 4, "num_targets": 1, "model.dim": 8, "model.num_layers": 1}
  result = subprocess.run(
      [sys.executable, "-m", "trainer.main", "--config=configs/own_data.py",
       f"--workdir={tmp_path / 'work'}"] + [f"--config.{k}={v}" for k, v in flags.items()],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
  assert result.returncode == 2, result.stderr[-2000:]
  assert result.stderr.splitlines() == [
      f"bad data: {tmp_path / 'work' / 'data'} has no validation user (12 users): every user "
      "has fewer than 3 interactions (the most is 2): leave-one-out evaluates users with 3 or "
      "more (the last for test, the one before for validation); nothing to evaluate"]
  assert not os.path.exists(tmp_path / "work" / "checkpoints" / "0")
  assert "step " not in result.stdout
