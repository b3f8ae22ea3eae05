"""After training: config.json and resumes, the best checkpoint, evaluate, recommend, export.

One smoke run of 20 steps (module fixture) with a periodic evaluation at step
10 whose ranked metric is forced to the top, so the best checkpoint (10)
differs from the latest (20) and `max_checkpoints=1` must keep both. The
commands run in-process through their `main(argv)`.
"""

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tomllib

import grain
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from trainer import evaluate, loop
from trainer.workdir import checkpoint, fingerprint
from trainer.config import keys as config_keys, mesh as config_mesh, saved as saved_config, schema
from trainer.commands import evaluate as evaluate_command, export, recommend, workdir as workdir_lib

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOP_K = 10


def _config(smoke_data_dir):
  from configs import smoke  # pylint: disable=import-outside-toplevel
  config = smoke.get_config()
  config.data.prepared_dir = smoke_data_dir
  config.train_steps, config.eval_every, config.checkpoint_every = 20, 10, 10
  config.max_checkpoints, config.eval.max_batches = 1, 1
  config.profile.num_steps = 0
  return config


@pytest.fixture(scope="module")
def trained(tmp_path_factory, smoke_data_dir):
  """`(workdir, config, result)` of 20 smoke steps; step 10 ranks best."""
  config = _config(smoke_data_dir)
  workdir = str(tmp_path_factory.mktemp("trained"))
  real_eval = loop.Trainer.run_eval

  def run_eval(self, step, split, *, periodic=True, best_step=None):
    metrics = real_eval(self, step, split, periodic=periodic, best_step=best_step)
    return dict(metrics, **{"ndcg@10": 1.0}) if periodic and step == 10 else metrics

  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(loop.Trainer, "run_eval", run_eval)
    result = loop.train_and_evaluate(config, workdir)
  return workdir, config, result


@pytest.fixture(scope="module")
def exported(trained, tmp_path_factory):
  workdir, _, _ = trained
  out = str(tmp_path_factory.mktemp("export"))
  assert export.main(["export", f"--workdir={workdir}", f"--out={out}"]) == 0
  return out


def _run(module, capsys, *flags):
  status = module.main([module.__name__, *flags])
  captured = capsys.readouterr()
  return status, captured.out, captured.err


# --------------------------------------------------------------------------- #
# The run: config.json, the best checkpoint, the final evaluation.             #
# --------------------------------------------------------------------------- #


def test_run_writes_its_config(trained):
  workdir, config, _ = trained
  assert saved_config.flat_values(saved_config.read(workdir)) == saved_config.flat_values(config)
  assert saved_config.read_record(workdir)["process_count"] == 1


def test_best_checkpoint_kept_beside_the_latest_and_reported(trained):
  workdir, config, result = trained
  assert sorted(int(s) for s in os.listdir(os.path.join(workdir, "checkpoints"))) == [10, 20]
  assert result["best"]["step"] == 10 and result["step"] == 20
  manager = checkpoint.make_manager(os.path.join(workdir, "checkpoints"), 1, "ndcg@10")
  assert checkpoint.best_step(manager) == 10 and manager.metrics(10)["ndcg@10"] == 1.0
  manager.close()
  # The final evaluation is over every user, whatever eval.max_batches says.
  assert config.eval.max_batches == 1 and config.eval_batch_size < 200
  for which in (result["eval"], result["best"]["eval"]):
    assert {split: m["num_users"] for split, m in which.items()} == {
        "validation": 200, "test": 200}
  assert result["best"]["eval"]["test"] != result["eval"]["test"]
  assert "best validation" in result["table"] and "last test" in result["table"]


def test_orbax_policy_keeps_latest_n_and_the_best(tmp_path):
  manager = checkpoint.make_manager(tmp_path, 2, "mrr")
  state, metrics = {"x": jnp.zeros(3)}, {1: 0.2, 3: 0.5, 4: None, 5: 0.1, 6: None}
  iterator = iter(grain.MapDataset.range(4).to_iter_dataset())
  for step, value in metrics.items():
    checkpoint.save(manager, step, state, iterator,
                    None if value is None else {"mrr": value, "ndcg@10": 0.0})
  assert manager.all_steps() == [3, 5, 6] and checkpoint.best_step(manager) == 3
  manager.close()
  latest_only = checkpoint.make_manager(tmp_path, 2)
  assert checkpoint.best_step(latest_only) is None
  latest_only.close()


# --------------------------------------------------------------------------- #
# Resuming with another config.                                                #
# --------------------------------------------------------------------------- #


def test_config_change_on_resume_is_refused_then_allowed(trained, tmp_path):
  workdir, config, _ = trained
  config = config.copy_and_resolve_references()
  copy = str(tmp_path / "run")
  shutil.copytree(workdir, copy)
  config.optimizer.learning_rate, config.log_every = 1e-2, 4
  with pytest.raises(schema.ConfigError) as excinfo:
    loop.train_and_evaluate(config, copy)
  message = str(excinfo.value)
  assert message.startswith("config.optimizer.learning_rate=0.01 (was 0.003): resuming")
  assert "log_every" not in message and "--allow_config_change" in message
  assert saved_config.read(copy).optimizer.learning_rate == 0.003
  result = loop.train_and_evaluate(config, copy, allow_config_change=True)
  assert result["step"] == 20 and saved_config.read(copy).optimizer.learning_rate == 0.01


def test_an_allowed_change_the_checkpoint_cannot_take_leaves_the_config(trained, tmp_path):
  """`--allow_config_change` with another model.dim fails on the restore, config.json untouched."""
  workdir, config, _ = trained
  config = config.copy_and_resolve_references()
  copy = str(tmp_path / "run")
  shutil.copytree(workdir, copy)
  before = (tmp_path / "run" / saved_config.CONFIG_FILE).read_bytes()
  config.model.dim = 2 * config.model.dim
  with pytest.raises(Exception):  # the checkpoint's shapes: orbax's error
    loop.train_and_evaluate(config, copy, allow_config_change=True)
  assert (tmp_path / "run" / saved_config.CONFIG_FILE).read_bytes() == before
  # The original config still resumes without a change.
  _, original, _ = trained
  assert saved_config.check_resume(copy, original, process_count=jax.process_count()) == []


def test_changed_item_ids_are_refused_by_resume_and_commands(trained, tmp_path):
  """Re-prepared data whose items moved rows (same count) is named, not used."""
  workdir, config, _ = trained
  copy = tmp_path / "run"
  shutil.copytree(workdir, copy)
  data = workdir_lib.open_run(str(copy), say=lambda line: None).data  # recorded: accepted
  record = json.loads((copy / fingerprint.FILE).read_text())
  assert record == fingerprint.of(data.item_ids)
  renamed = np.asarray(data.item_ids).copy()
  renamed[[0, 1]] = renamed[[1, 0]]  # two items swap rows: same shapes
  (copy / fingerprint.FILE).write_text(json.dumps(fingerprint.of(renamed)))
  for attempt in (lambda: workdir_lib.open_run(str(copy), say=lambda line: None),
                  lambda: loop.train_and_evaluate(config.copy_and_resolve_references(),
                                                  str(copy))):
    with pytest.raises(schema.ConfigError, match="item-id map differs .* same .* items"):
      attempt()
  assert fingerprint.of(np.array(["a", "bc"])) != fingerprint.of(np.array(["ab", "c"]))


def test_another_item_count_is_named_by_resume_and_commands(trained, tmp_path, monkeypatch):
  """Raw data with more items, prepared again: one line naming both counts, nothing moved.

  By the recorded fingerprint, and without one (a run from before it was
  recorded) by the checkpoint's item table, before orbax's shape error.
  """
  workdir, config, _ = trained
  copy = tmp_path / "run"
  shutil.copytree(workdir, copy)
  data = workdir_lib.open_run(str(copy), say=lambda line: None).data
  old = data.num_items
  added = config_mesh.vocab_shard_count(config)  # enough to change the table's padded rows
  ids = np.asarray(data.item_ids)
  grown = dataclasses.replace(data, item_ids=np.concatenate(
      [ids, ids.max() + 1 + np.arange(added, dtype=ids.dtype)]))
  new = old + added
  monkeypatch.setattr(loop, "prepare_data", lambda config, workdir: grown)
  monkeypatch.setattr(workdir_lib.data_lib, "load_prepared", lambda folder: grown)
  attempts = (lambda: workdir_lib.open_run(str(copy), say=lambda line: None),
              lambda: loop.train_and_evaluate(config.copy_and_resolve_references(), str(copy)))
  for attempt in attempts:
    with pytest.raises(schema.ConfigError, match=f"has {new:,} items and this run was trained "
                       f"on {old:,} .the item count changed from {old:,} to {new:,};"):
      attempt()
  (copy / fingerprint.FILE).unlink()
  steps = sorted(os.listdir(copy / "checkpoints"))
  for attempt in attempts:
    with pytest.raises(schema.ConfigError, match=f"item table of {old:,} rows and this run's "
                       f"prepared data has {new:,} .item count changed from {old:,}"):
      attempt()
  assert sorted(os.listdir(copy / "checkpoints")) == steps  # not taken for corruption
  assert not (copy / checkpoint.CORRUPTED_DIR).exists()


def test_a_run_saved_before_a_key_existed_resumes_with_its_old_value(trained, tmp_path):
  workdir, config, _ = trained
  copy = tmp_path / "run"
  shutil.copytree(workdir, copy)
  record = json.loads((copy / saved_config.CONFIG_FILE).read_text())
  del record["config"]["loss"]["target_reduction"]  # As written before the key was added.
  (copy / saved_config.CONFIG_FILE).write_text(json.dumps(record))
  assert saved_config.read(copy).loss.target_reduction == "sum"
  config = config.copy_and_resolve_references()
  assert saved_config.check_resume(copy, config, process_count=1) == []
  config.loss.update(kind="softmax_ce", target_reduction="mean")
  with pytest.raises(schema.ConfigError,
                     match=r"config.loss.target_reduction='mean' \(was 'sum'\)"):
    saved_config.check_resume(copy, config, process_count=1)


def test_which_changes_are_harmless(trained):
  workdir, config, _ = trained
  config = config.copy_and_resolve_references()
  flat = saved_config.flat_values(config)
  assert saved_config.is_harmless("eval.max_batches", flat, flat)
  assert saved_config.is_harmless("train_steps", flat, flat)  # constant schedule
  cosine = dict(flat, **{"optimizer.schedule": "cosine"})
  assert not saved_config.is_harmless("train_steps", cosine, cosine)
  for key in ("batch_size", "seq_len", "model.dim", "data.source_options.num_items",
              "process_count"):
    assert not saved_config.is_harmless(key, flat, flat), key
  config.train_steps, config.eval.ks = 30, (10, 20)
  notices = saved_config.check_resume(workdir, config, process_count=1)
  assert notices == ["config changed since the run started (harmless): config.eval.ks "
                     "[10, 50, 100] -> [10, 20], config.train_steps 20 -> 30"]
  with pytest.raises(schema.ConfigError, match=r"^process_count=2 \(was 1\)"):
    saved_config.check_resume(workdir, config, process_count=2)


# --------------------------------------------------------------------------- #
# python -m trainer.evaluate                                                   #
# --------------------------------------------------------------------------- #


def test_evaluate_prints_table_and_json_matching_the_loop(trained, capsys):
  workdir, _, result = trained
  for flags, want, step in ((["--checkpoint=best"], result["best"]["eval"], 10),
                            (["--checkpoint=latest"], result["eval"], 20)):
    status, out, err = _run(evaluate_command, capsys, f"--workdir={workdir}", *flags)
    assert status == 0, err
    lines = out.splitlines()
    assert lines[0].startswith("split") and lines[1].startswith("validation")
    assert lines[2].startswith("test") and len(lines) == 4
    record = json.loads(lines[-1])
    assert (record["step"], record["checkpoint"]) == (step, flags[0].split("=")[1])
    for split in ("validation", "test"):
      for name, value in record["metrics"][split].items():
        np.testing.assert_allclose(value, want[split][name], rtol=1e-6, err_msg=name)
    assert "evaluating test: 4/4 batches" in err


def test_evaluate_one_split_of_one_step_and_bad_flags(trained, capsys, tmp_path):
  workdir, _, _ = trained
  status, out, _ = _run(evaluate_command, capsys, f"--workdir={workdir}", "--split=test", "--step=20")
  assert status == 0 and list(json.loads(out.splitlines()[-1])["metrics"]) == ["test"]
  for flags, line in (
      ([f"--workdir={tmp_path}"], f"bad config: --workdir='{tmp_path}': an existing run "
       "directory holding config.json (written by python -m trainer.main)"),
      ([f"--workdir={workdir}", "--step=7"], "bad config: --step=7: a step with a "
       f"checkpoint in {workdir}/checkpoints: 10, 20"),
      ([], "bad config: --workdir is missing: it is required; a string")):
    status, out, err = _run(evaluate_command, capsys, *flags)
    assert status == 2 and out == "" and len(err.splitlines()) == 1, err
    assert err.startswith(line), err


# --------------------------------------------------------------------------- #
# python -m trainer.export and trainer.recommend                               #
# --------------------------------------------------------------------------- #


def test_export_round_trips_through_load_export(trained, exported):
  workdir, _, _ = trained
  run = workdir_lib.open_run(workdir, say=lambda line: None)
  loaded = export.load_export(exported)
  assert loaded.manifest["step"] == run.step == 10 and loaded.item_bias is None
  num_items = run.data.num_items
  params = export._flatten(jax.tree.map(np.asarray, run.params))
  assert set(loaded.params) == set(params)
  for name, value in params.items():
    want = np.asarray(value)[:num_items] if name == export.ITEM_TABLE_PATH else np.asarray(value)
    np.testing.assert_array_equal(loaded.params[name], want, err_msg=name)
  np.testing.assert_array_equal(loaded.item_embeddings, loaded.params[export.ITEM_TABLE_PATH])
  np.testing.assert_array_equal(loaded.item_ids, run.data.item_ids)
  # A serving system needs NumPy only.
  code = (f"import sys; sys.path.insert(0, {ROOT!r}); from trainer.export import load_export; "
          f"e = load_export({exported!r}); assert 'jax' not in sys.modules; "
          "print(e.item_embeddings.shape)")
  done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                        timeout=60, check=False)
  assert done.returncode == 0 and done.stdout.strip() == f"({num_items}, 16)", done.stderr


def test_an_export_stopped_over_an_older_one_is_refused_not_mixed(trained, exported, tmp_path,
                                                                     monkeypatch):
  workdir, _, _ = trained
  out = tmp_path / "export"
  shutil.copytree(exported, out)
  run = workdir_lib.open_run(workdir, which="latest", say=lambda line: None)
  real_save = np.save
  calls = []

  def dying_save(handle, array, **kwargs):
    calls.append(1)
    if len(calls) == 3:  # after the item table, before the manifest
      raise KeyboardInterrupt
    real_save(handle, array, **kwargs)

  monkeypatch.setattr(export.np, "save", dying_save)
  with pytest.raises(KeyboardInterrupt):
    export.export_run(run, out)
  monkeypatch.setattr(export.np, "save", real_save)
  with pytest.raises(ValueError, match="incomplete export"):
    export.load_export(out)
  export.export_run(run, out)  # a complete one loads, all of one step
  assert export.load_export(out).manifest["step"] == run.step == 20
  assert [p.name for p in out.iterdir() if p.name.startswith(".")] == []


def test_recommend_stopped_midway_leaves_the_previous_file_whole(trained, tmp_path, capsys,
                                                                 monkeypatch):
  workdir, _, _ = trained
  out = tmp_path / "recs.jsonl"
  out.write_text("previous\n")
  real = recommend.recommend

  def stopped(run, users, *, write, **kwargs):
    real(run, users[:2], write=write, **kwargs)
    raise KeyboardInterrupt

  monkeypatch.setattr(recommend, "recommend", stopped)
  with pytest.raises(KeyboardInterrupt):
    recommend.main(["recommend", f"--workdir={workdir}", "--top_k=3", f"--out={out}"])
  capsys.readouterr()
  assert out.read_text() == "previous\n" and sorted(os.listdir(tmp_path)) == ["recs.jsonl"]


def test_recommend_lists_nan_scored_items_last_and_says_so(trained, tmp_path, capsys,
                                                          monkeypatch):
  """Three items whose score is NaN (a +NaN bias: above +inf in lax.top_k's own order):
  never ahead of a finite score, written as null, and a warning line."""
  from trainer import model as model_lib  # pylint: disable=import-outside-toplevel
  workdir, _, _ = trained
  nan_rows = np.array([0, 5, 7])

  def nan_bias(self):
    rows = jnp.arange(self.item_table.shape[0])
    return jnp.where(jnp.isin(rows, nan_rows), jnp.float32(np.nan), jnp.float32(0.0))

  monkeypatch.setattr(model_lib.SASRec, "output_bias", property(nan_bias))
  out = tmp_path / "recs.jsonl"
  data = workdir_lib.open_run(workdir, say=lambda line: None).data
  status, _, err = _run(recommend, capsys, f"--workdir={workdir}", "--top_k=10",
                        "--include_seen", f"--out={out}")
  assert status == 0 and "warning" not in err, err
  for line in out.read_text().splitlines():  # a NaN never takes a finite item's place
    record = json.loads(line)
    assert not set(record["items"]) & set(data.item_ids[nan_rows].tolist()), record
    assert all(isinstance(score, float) for score in record["scores"])
  k = data.num_items  # every item: the three NaN ones come last
  status, _, err = _run(recommend, capsys, f"--workdir={workdir}", f"--top_k={k}",
                        "--include_seen", f"--out={out}")
  assert status == 0, err
  records = [json.loads(line) for line in out.read_text().splitlines()]
  assert len(records) == data.num_users
  for record in records:
    assert record["items"][-3:] == data.item_ids[nan_rows].tolist()
    assert record["scores"][-3:] == [None] * 3
    assert all(isinstance(score, float) for score in record["scores"][:-3])
  assert (f"warning: the model's scores are not finite for {data.num_users:,} of "
          f"{data.num_users:,} users") in err


def _histories(data):
  return [np.asarray(data.items[data.offsets[u]:data.offsets[u + 1]])
          for u in range(data.num_users)]


def test_recommend_equals_numpy_top_k_of_the_export(trained, exported, tmp_path, capsys):
  workdir, config, _ = trained
  out = tmp_path / "top.jsonl"
  status, _, err = _run(recommend, capsys, f"--workdir={workdir}", f"--top-k={TOP_K}",
                        f"--out={out}")
  assert status == 0 and "recommending: 200/200 users" in err, err
  records = [json.loads(line) for line in out.read_text().splitlines()]
  run = workdir_lib.open_run(workdir, say=lambda line: None)
  data, loaded = run.data, export.load_export(exported)
  histories = _histories(data)
  inputs = np.full((data.num_users, config.seq_len), data.num_items, np.int32)
  for user, history in enumerate(histories):
    last = history[-config.seq_len:]
    inputs[user, config.seq_len - last.shape[0]:] = last
  forward = jax.jit(lambda params, ids: nnx.merge(run.graphdef, params)(ids)[:, -1])
  hidden = np.asarray(forward(run.params, jnp.asarray(inputs)), np.float64)  # [U, D]
  scores = hidden @ np.asarray(loaded.item_embeddings, np.float64).T  # [U, V]
  assert [r["user"] for r in records] == data.user_ids.tolist()
  raw_to_dense = {raw: dense for dense, raw in enumerate(loaded.item_ids.tolist())}
  for user, record in enumerate(records):
    seen = np.unique(histories[user])
    row = scores[user].copy()
    row[seen] = -np.inf
    want = np.argsort(-row, kind="stable")[:TOP_K]
    got = np.array([raw_to_dense[raw] for raw in record["items"]])
    np.testing.assert_allclose(record["scores"], row[want], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(record["scores"], row[got], rtol=1e-4, atol=1e-5)
    assert not np.isin(got, seen).any() and len(set(got.tolist())) == TOP_K
    assert ((got == want) | np.isclose(row[got], row[want], rtol=0, atol=1e-5)).all()


def test_recommend_listed_users_with_seen_items_and_unknown_ids(trained, tmp_path, capsys):
  workdir, _, _ = trained
  users = tmp_path / "users.txt"
  users.write_text("7\n\n3\n")
  out = tmp_path / "top.jsonl"
  status, _, err = _run(recommend, capsys, f"--workdir={workdir}", "--top_k=300",
                        f"--users={users}", f"--out={out}", "--include_seen")
  assert status == 0, err
  records = [json.loads(line) for line in out.read_text().splitlines()]
  assert [r["user"] for r in records] == [7, 3]
  assert all(sorted(r["items"]) == list(range(300)) for r in records)  # every item once
  users.write_text("3\nnobody\n123456\n")
  status, _, err = _run(recommend, capsys, f"--workdir={workdir}", "--top_k=5",
                        f"--users={users}", f"--out={out}")
  assert status == 2 and err.splitlines()[-1] == (
      f"bad config: --users='{users}': ids of users of the run's data; 2 are not: "
      "'nobody', '123456'")


def test_console_scripts_point_at_the_commands():
  with open(os.path.join(ROOT, "pyproject.toml"), "rb") as file:
    scripts = tomllib.load(file)["project"]["scripts"]
  assert set(scripts) == {"cutbce-train", "cutbce-data", "cutbce-evaluate", "cutbce-recommend",
                          "cutbce-export", "cutbce-compile"}
  import importlib  # pylint: disable=import-outside-toplevel
  for target in scripts.values():
    module, function = target.split(":")
    assert callable(getattr(importlib.import_module(module), function)), target
  assert set(config_keys.COMMAND_FLAGS) == {"evaluate", "recommend", "export"}


def test_a_separate_output_table_is_what_export_and_recommend_score_with(
    smoke_data_dir, tmp_path, capsys):
  # gSASRec's model (model.output_table="separate", PyTorch's initializers,
  # no sqrt(D) scale): export writes the output table as item_embeddings.npy
  # and the input embedding as a parameter of its own; recommend's top items
  # are those of the output table's scores.
  config = _config(smoke_data_dir)
  config.train_steps, config.eval_every, config.checkpoint_every = 4, 4, 4
  config.model.output_table, config.model.init = "separate", "pytorch"
  config.model.scale_embeddings, config.model.block = False, "sasrec"
  workdir = str(tmp_path / "run")
  loop.train_and_evaluate(config, workdir)
  out = str(tmp_path / "export")
  assert export.main(["export", f"--workdir={workdir}", f"--out={out}"]) == 0
  run = workdir_lib.open_run(workdir, say=lambda line: None)
  loaded = export.load_export(out)
  params = export._flatten(jax.tree.map(np.asarray, run.params))
  num_items = run.data.num_items
  np.testing.assert_array_equal(loaded.item_embeddings,
                                params[export.OUTPUT_TABLE_PATH][:num_items])
  np.testing.assert_array_equal(loaded.params[export.ITEM_TABLE_PATH],
                                params[export.ITEM_TABLE_PATH])
  assert not np.allclose(params[export.ITEM_TABLE_PATH], params[export.OUTPUT_TABLE_PATH])
  recommendations = tmp_path / "recs.jsonl"
  status, _, err = _run(recommend, capsys, f"--workdir={workdir}", f"--out={recommendations}",
                        f"--top_k={TOP_K}")
  assert status == 0, err
  record = json.loads(recommendations.read_text().splitlines()[0])
  data = run.data
  history = _histories(data)[0]
  inputs = np.full((1, config.seq_len), data.num_items, np.int32)
  last = history[-config.seq_len:]
  inputs[0, config.seq_len - last.shape[0]:] = last
  hidden = np.asarray(nnx.merge(run.graphdef, run.params)(jnp.asarray(inputs))[0, -1],
                      np.float64)
  row = np.asarray(loaded.item_embeddings, np.float64) @ hidden
  row[np.unique(history)] = -np.inf
  want = np.argsort(-row, kind="stable")[:TOP_K]
  raw_to_dense = {raw: dense for dense, raw in enumerate(loaded.item_ids.tolist())}
  got = np.array([raw_to_dense[raw] for raw in record["items"]])
  np.testing.assert_allclose(row[got], row[want], rtol=1e-4, atol=1e-5)
