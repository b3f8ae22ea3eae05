"""The device scripts' plumbing: quality runs at once (a GPU) or one at a time
(a TPU, which one process at a time can hold), and the TPU run's bundle."""

from __future__ import annotations

import json
import pathlib
import sys
import tarfile

import numpy as np
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks"))

import gpu_run  # noqa: E402  pylint: disable=wrong-import-position
import tpu_run  # noqa: E402  pylint: disable=wrong-import-position


class _FakeProcess:
  """Records when it was started and waited for; writes the run's report."""

  def __init__(self, events, command, **_):
    self.name = pathlib.Path(command[command.index("--out") + 1]).stem
    self.report = pathlib.Path(command[command.index("--out") + 1])
    self.events = events
    events.append(("start", self.name))

  def wait(self, timeout=None):
    del timeout
    self.events.append(("end", self.name))
    self.report.write_text(json.dumps({"ndcg@10": 0.5, "hr@10": 0.6, "mrr": 0.4, "step": 10,
                                       "wall_s": 1.0}))
    return 0


@pytest.mark.parametrize("at_once", [True, False])
def test_quality_runs_at_once_or_one_after_the_other(tmp_path, monkeypatch, at_once):
  events = []
  monkeypatch.setattr(gpu_run.subprocess, "Popen",
                      lambda command, **kw: _FakeProcess(events, command, **kw))
  monkeypatch.setattr(gpu_run, "_environment", dict)
  names = ["replica_seed2", "replica_seed0"]  # run in this order, not the grid's
  result = gpu_run.part_quality(tmp_path, 60, names, at_once=at_once)
  if at_once:
    assert events == [("start", "replica_seed2"), ("start", "replica_seed0"),
                      ("end", "replica_seed2"), ("end", "replica_seed0")]
  else:
    assert events == [("start", "replica_seed2"), ("end", "replica_seed2"),
                      ("start", "replica_seed0"), ("end", "replica_seed0")]
  assert set(result["runs"]) == set(names)
  assert result["runs"]["replica_seed0"]["ndcg@10"] == 0.5
  command = result["runs"]["replica_seed0"]["command"]
  assert "--set mesh.shape=(1,) --set seed=0" in command  # one device, then the run's own
  assert json.loads((tmp_path / "quality.json").read_text())["at_once"] is at_once


def test_bundle_keeps_reports_and_logs_not_checkpoints(tmp_path):
  out = tmp_path / "out"
  (out / "quality" / "run" / "checkpoints" / "10").mkdir(parents=True)
  (out / "quality" / "run" / "checkpoints" / "10" / "state").write_text("x")
  (out / "quality" / "run" / "metrics.jsonl").write_text("{}\n")
  (out / "quality" / "run.json").write_text("{}")
  (out / "quality" / "run.log").write_text("log")
  (out / "loss.json").write_text("{}")
  tpu_run._bundle(out, tmp_path / "b.tar.gz")  # pylint: disable=protected-access
  with tarfile.open(tmp_path / "b.tar.gz") as tar:
    names = sorted(tar.getnames())
  assert names == ["loss.json", "quality/run.json", "quality/run.log",
                   "quality/run/metrics.jsonl"]


def test_device_tests_part_runs_the_files_named(tmp_path, monkeypatch):
  seen = {}
  monkeypatch.setattr(gpu_run, "part_tests",
                      lambda out, limit_s, tests, stop_first: seen.update(
                          limit_s=limit_s, tests=list(tests), stop_first=stop_first))
  monkeypatch.setattr(gpu_run, "run_parts",
                      lambda out, parts, names, after_each: [parts[n]() for n in names[1:]])
  monkeypatch.setattr(sys, "argv", ["tpu_run.py", "device", "--out", str(tmp_path), "--parts",
                                    "tests", "--tests", "tests/cutbce/test_precision.py",
                                    "--tests-s", "200"])
  tpu_run.main()
  assert seen == {"limit_s": 200, "tests": ["tests/cutbce/test_precision.py"],
                  "stop_first": False}


def test_device_script_parts_run_their_benchmarks_writing_under_out(tmp_path, monkeypatch):
  seen = []
  monkeypatch.setattr(tpu_run.subprocess, "run", lambda command, **_: seen.append(command[1:]))
  monkeypatch.setattr(gpu_run, "run_parts",
                      lambda out, parts, names, after_each: [parts[n]() for n in names[1:]])
  monkeypatch.setattr(sys, "argv", ["tpu_run.py", "device", "--out", str(tmp_path), "--parts",
                                    "functions", "exclude", "sampled"])
  tpu_run.main()
  assert seen == [["benchmarks/float32_functions.py"],
                  ["benchmarks/exclude_bench.py", "--out", str(tmp_path / "exclude_bench.json")],
                  ["benchmarks/sampled_logits.py", "--out", str(tmp_path / "sampled_logits.json")]]
  assert sorted(p.name for p in tmp_path.glob("*.log")) == [
      "exclude_bench.log", "float32_functions.log", "sampled_logits.log"]


def test_device_parts_are_checked_by_name():
  with pytest.raises(SystemExit):
    sys.argv = ["tpu_run.py", "device", "--out", "x", "--parts", "speed"]
    tpu_run.main()


# A stand-in for ml1m_quality.py train: counts steps in its workdir, saves the
# count on SIGTERM (as the trainer saves its checkpoint), and writes its
# report once it has reached 3 steps, resuming from the saved count.
_FAKE_TRAIN = '''
import json, pathlib, signal, sys, time
args = sys.argv[1:]
workdir = pathlib.Path(args[args.index("--workdir") + 1])
workdir.mkdir(parents=True, exist_ok=True)
saved = workdir / "checkpoint.json"
step = json.loads(saved.read_text())["step"] if saved.exists() else 0
def stop(*_):
  saved.write_text(json.dumps({"step": step}))
  sys.exit(0)
signal.signal(signal.SIGTERM, stop)
if step < 3:
  step += 1
  while True:  # a long step: the call's limit comes first
    time.sleep(0.05)
pathlib.Path(args[args.index("--out") + 1]).write_text(json.dumps(
    {"ndcg@10": 0.5, "hr@10": 0.6, "mrr": 0.4, "step": step, "wall_s": 1.0}))
'''


def test_a_cut_run_is_kept_and_the_next_call_resumes_it(tmp_path, monkeypatch):
  script = tmp_path / "fake_train.py"
  script.write_text(_FAKE_TRAIN)
  monkeypatch.setattr(gpu_run, "QUALITY_SCRIPT", str(script))
  monkeypatch.setattr(gpu_run, "CUT_GRACE_S", 1.0)
  monkeypatch.setattr(gpu_run, "_environment", dict)
  carried = tmp_path / "carried"
  for call in range(3):  # each call cut: one more step saved, packed, carried back
    out, back = tmp_path / f"call{call}", tmp_path / f"back{call}"
    result = gpu_run.part_quality(out, 2, ["gsasrec_seed0"], at_once=False, resume=carried,
                                  keep=back)
    assert result["runs"]["gsasrec_seed0"]["returncode"] is None  # cut
    (part,) = back.glob("gsasrec_seed0.tar.gz.*")
    with tarfile.open(part) as tar:
      saved = json.loads(tar.extractfile("./checkpoint.json").read())
    assert saved == {"step": call + 1}
    carried.mkdir(exist_ok=True)
    part.replace(carried / part.name)
  result = gpu_run.part_quality(tmp_path / "call3", 20, ["gsasrec_seed0"], at_once=False,
                                resume=carried, keep=tmp_path / "back3")
  assert result["runs"]["gsasrec_seed0"]["returncode"] == 0
  assert result["runs"]["gsasrec_seed0"]["step"] == 3
  assert not (tmp_path / "back3").exists()  # a finished run's report is its result


def test_a_kept_workdir_holds_the_latest_and_best_checkpoints_in_parts(tmp_path, monkeypatch):
  # The trainer's layout: checkpoints/<step>/ with orbax's metrics item, the
  # best metric named in config.json; here the best (3250) is the oldest.
  workdir = tmp_path / "run"
  (workdir / "config.json").parent.mkdir(parents=True)
  (workdir / "config.json").write_text(json.dumps({"config": {"checkpoint": {
      "best_metric": "ndcg@10"}}}))
  (workdir / "metrics.jsonl").write_text('{"step": 4838}\n')
  rng = np.random.default_rng(0)
  states = {}
  for step, ndcg in ((3250, 0.21), (4750, 0.20), (4838, 0.19)):
    folder = workdir / "checkpoints" / str(step)
    (folder / "metrics").mkdir(parents=True)
    (folder / "metrics" / "metrics").write_text(json.dumps({"ndcg@10": ndcg}))
    states[step] = rng.bytes(3000)  # incompressible, like trained weights
    (folder / "state").write_bytes(states[step])
  monkeypatch.setattr(gpu_run, "PART_BYTES", 2500)
  parts = gpu_run._pack_parts(workdir, tmp_path / "back" / "run.tar.gz")  # pylint: disable=protected-access
  assert [part.name for part in parts] == [f"run.tar.gz.{i:03d}" for i in range(len(parts))]
  assert len(parts) >= 3 and all(part.stat().st_size <= 2500 for part in parts)
  assert not (tmp_path / "back" / "run.tar.gz.partial").exists()
  gpu_run._unpack_parts(parts, tmp_path / "again")  # pylint: disable=protected-access
  again = tmp_path / "again"
  assert sorted(d.name for d in (again / "checkpoints").iterdir()) == ["3250", "4838"]
  for step in (3250, 4838):
    assert (again / "checkpoints" / str(step) / "state").read_bytes() == states[step]
  assert (again / "metrics.jsonl").read_text() == '{"step": 4838}\n'


def test_a_workdir_too_large_to_carry_is_not_packed(tmp_path, monkeypatch):
  workdir = tmp_path / "run"
  (workdir / "checkpoints" / "10").mkdir(parents=True)
  (workdir / "checkpoints" / "10" / "state").write_bytes(bytes(3000))
  monkeypatch.setattr(gpu_run, "KEEP_BYTES", 2000)
  with pytest.raises(ValueError, match="has to finish within one call"):
    gpu_run._pack_parts(workdir, tmp_path / "back" / "run.tar.gz")  # pylint: disable=protected-access
  assert not (tmp_path / "back").exists()
