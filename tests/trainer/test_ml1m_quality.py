"""benchmarks/ml1m_quality.py: which evaluation is the run's result, which runs are done."""

import importlib.util
import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _script():
  spec = importlib.util.spec_from_file_location(
      "ml1m_quality", os.path.join(ROOT, "benchmarks", "ml1m_quality.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_the_best_checkpoint_is_the_result_when_the_run_kept_one():
  script = _script()
  last = [{"kind": "train", "step": 10, "loss": 1.0},
          {"kind": "eval/validation", "step": 20, "ndcg@10": 0.2},
          {"kind": "eval/test", "step": 20, "ndcg@10": 0.1}]
  assert script.final_evals(last) == (20, {"validation": last[1], "test": last[2]})
  best = [{"kind": "best/validation", "step": 20, "ndcg@10": 0.3, "checkpoint_step": 10.0},
          {"kind": "best/test", "step": 20, "ndcg@10": 0.25, "checkpoint_step": 10.0}]
  assert script.final_evals(last + best) == (10, {"validation": best[0], "test": best[1]})


def test_a_finished_run_is_collected_once_and_its_curve_has_each_step_once(tmp_path):
  script = _script()
  records = [{"kind": "eval/validation", "step": 10, "ndcg@10": 0.1, "hit@10": 0.2},
             {"kind": "eval/validation", "step": 20, "ndcg@10": 0.3, "hit@10": 0.4}]
  assert not script.finished(str(tmp_path), 20)  # no metrics yet
  (tmp_path / "metrics.jsonl").write_text("\n".join(map(json.dumps, records)) + "\n")
  assert not script.finished(str(tmp_path), 20)  # no test evaluation yet
  # A finished run evaluated again (resumed at its last step) logs step 20 twice.
  records += [{"kind": "eval/test", "step": 20, "ndcg@10": 0.25, "hit@10": 0.3},
              {"kind": "eval/validation", "step": 20, "ndcg@10": 0.3, "hit@10": 0.4}]
  (tmp_path / "metrics.jsonl").write_text("\n".join(map(json.dumps, records)) + "\n")
  assert script.finished(str(tmp_path), 20) and not script.finished(str(tmp_path), 30)
  assert script.validation_curve(script.read_metrics(str(tmp_path))) == [
      {"step": 10, "ndcg@10": 0.1, "hit@10": 0.2}, {"step": 20, "ndcg@10": 0.3, "hit@10": 0.4}]


def test_the_popularity_baseline_counts_ties_against_the_target(monkeypatch):
  """Items 0 and 1 have the same training count: the held-out item 1 ranks 2nd, not 1st."""
  import numpy as np  # pylint: disable=import-outside-toplevel
  from trainer import data as data_lib  # pylint: disable=import-outside-toplevel
  script = _script()

  class Prepared:  # two users; user 0: train [0, 1, 0, 1], then 1 (val) and 1 (test)
    items = np.array([0, 1, 0, 1, 1, 1, 2, 3, 3, 3], np.int32)
    offsets = np.array([0, 6, 10])
    train_lengths = np.array([4, 2])
    num_items = 5

    @staticmethod
    def examples(split):
      start = 4 if split == "validation" else 5
      return np.array([[0, 0, start, 0]])  # user 0, nothing seen excluded, the held-out item

  monkeypatch.setattr(data_lib, "load_prepared", lambda _: Prepared)
  # Counts: items 0 and 1 twice each, 2 and 3 once each (user 1's two training rows).
  metrics = script.popularity_baseline("unused", ks=(1, 10))
  assert metrics["test"]["hit@1"] == 0.0 and metrics["test"]["hit@10"] == 1.0
  assert abs(metrics["test"]["mrr"] - 0.5) < 1e-6


def _queue():
  spec = importlib.util.spec_from_file_location(
      "catalog_queue", os.path.join(ROOT, "benchmarks", "catalog_queue.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_the_catalog_queue_differs_in_the_loss_and_the_steps_alone(tmp_path, monkeypatch):
  """Every entry is configs/synthetic_100k.py with loss overrides (and, for the
  equal-wall-time twins, train_steps); the table reads the runs and the cost file."""
  queue = _queue()
  for name, overrides in queue.QUEUE.items():
    base, _, seed = name.partition("_seed")
    if seed:  # another seed of an entry: that entry's overrides and the seed alone
      assert overrides == [*queue.QUEUE[base], f"seed={seed}"], (name, overrides)
      continue
    assert all(o.startswith("loss.") or (name.endswith(("_wall", "_2500"))
                                         and o == "train_steps=2500")
               for o in overrides), (name, overrides)
    for catalog, where in queue.CATALOGS.items():
      line = queue.command(name, catalog)
      assert line[line.index("--config") + 1] == where.config, (catalog, line)
      assert line[-1] == f"{where.results}/{name}.json", (catalog, line)
  assert queue.QUEUE["gbce_k256_wall"][:-1] == queue.QUEUE["gbce_k256"]
  results = tmp_path / "results"
  results.mkdir()
  (results / "exact_bce.json").write_text(json.dumps({"ndcg@10": 0.12345, "hr@10": 0.2, "step": 500}))
  (results / "cost.json").write_text(json.dumps({"losses": {"exact_bce": {
      "median_step_s": 1.5, "memory": {"temp_bytes_per_device": 2**30,
                                       "peak_bytes_per_device": 2**31}}}}))
  monkeypatch.setattr(queue, "ROOT", tmp_path)
  monkeypatch.setitem(queue.CATALOGS, "100k", queue.CATALOGS["100k"]._replace(results="results"))
  rows = queue.table().splitlines()
  assert rows[2] == "| exact_bce | 0.1235 | 0.2000 | 1 | 500 | 1.500 | 1.000 | 2.000 |"
  assert len(rows) == 3
  # Seeds share their entry's row: mean +- sample standard deviation.
  for name, ndcg in (("exact_bce_2500", 0.30), ("exact_bce_2500_seed1", 0.32),
                     ("exact_bce_2500_seed2", 0.34)):
    (results / f"{name}.json").write_text(json.dumps({"ndcg@10": ndcg, "hr@10": 0.4,
                                                      "step": 2500}))
  rows = queue.table().splitlines()
  assert rows[3] == "| exact_bce_2500 | 0.3200 +- 0.0200 | 0.4000 +- 0.0000 | 3 | 2500 | - | - | - |"
  assert len(rows) == 4
  # Seeds whose checkpoints differ show each seed's step.
  (results / "exact_bce_seed2.json").write_text(json.dumps({"ndcg@10": 0.12345, "hr@10": 0.2,
                                                            "step": 250}))
  assert queue.table().splitlines()[2].startswith("| exact_bce | 0.1235 +- 0.0000 | 0.2000 +- 0.0000 | 2 | 500 / 250 |")


def _report(config: dict, ndcg: float, machine: str) -> dict:
  return {"config": config, "step": 100, "wall_s": 1.0, "train_s_from_log": 1.0,
          "ndcg@10": ndcg, "hr@10": 2 * ndcg, "mrr": ndcg / 2, "test": {}, "validation_curve": [],
          "popularity_baseline": {}, "machine": {"platform": machine}}


def test_seeds_summarize_across_config_versions_and_machines():
  """A report older than a config key ran with its default; any other value differs."""
  import pytest  # pylint: disable=import-outside-toplevel
  script = _script()
  new = json.loads(json.dumps(script.load_config("configs/ml1m_sasrec_plus.py", []).to_dict()))
  old = json.loads(json.dumps(new))
  del old["model"]["init"], old["loss"]["negatives_per"]  # keys added after it ran
  old["mesh"]["shape"] = [8]  # ran on 8 simulated devices: the same recipe
  seeds = [dict(old, seed=0), dict(new, seed=1), dict(new, seed=2)]
  reports = [_report(config, ndcg, machine)
             for config, ndcg, machine in zip(seeds, (0.1, 0.2, 0.3), ("gpu", "tpu", "tpu"))]
  summary = script.summarize(reports)
  assert summary["seeds"] == [0, 1, 2] and abs(summary["ndcg@10"] - 0.2) < 1e-12
  assert abs(summary["ndcg@10_std"] - 0.1) < 1e-12  # the sample std
  assert [machine["platform"] for machine in summary["machine"]] == ["gpu", "tpu", "tpu"]
  assert [run["machine"]["platform"] for run in summary["per_seed"]] == ["gpu", "tpu", "tpu"]
  assert summary["per_seed"][0]["mesh"]["shape"] == [8]
  changed = json.loads(json.dumps(new))
  changed["model"]["init"] = "sasrec_plus"
  with pytest.raises(SystemExit, match=r"model\.init of seed 2"):
    script.summarize(reports[:2] + [_report(dict(changed, seed=2), 0.3, "tpu")])
