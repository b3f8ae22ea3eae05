"""Launchers: tpu_vm.sh against a stand-in gcloud, local.sh processes and failures.

The stand-in gcloud records every call (one JSON list of arguments a line). With
FAKE_TPU_SIMULATE=1 it also plays a slice of FAKE_TPU_WORKERS VMs on this
machine: worker i is the folder FAKE_TPU_ROOT/worker-i, used as HOME; `scp`
copies there and `ssh --command` runs the script with bash in it, workers in
parallel, the way gcloud does over --worker=all. On those "VMs" `curl` answers
the metadata server's worker number, `sudo` only records what it was asked,
and `uv` makes a virtual environment whose `python` is a fake trainer that
logs its arguments and, on SIGTERM, "saves a checkpoint" and exits 0.
"""

import hashlib
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys

import jax
import numpy as np
import pytest

from tests.trainer import test_train

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

def _stand_in(tmp_path, name, body):
  folder = tmp_path / "bin"
  folder.mkdir(exist_ok=True)
  path = folder / name
  path.write_text("#!/usr/bin/env bash\n" + body)
  path.chmod(0o755)
  return folder


_GCLOUD = r"""
import json, os, shutil, subprocess, sys
from concurrent.futures import ThreadPoolExecutor

args = sys.argv[1:]
root = os.environ["FAKE_TPU_ROOT"]
with open(os.path.join(root, "calls.jsonl"), "a") as calls:
  calls.write(json.dumps(args) + "\n")
if args[3] == "describe":
  print(os.environ.get("FAKE_ACCELERATOR", "v5litepod-8"))
  sys.exit(0)
if os.environ.get("FAKE_TPU_SIMULATE") != "1":
  sys.exit(0)
on = next(arg.split("=", 1)[1] for arg in args if arg.startswith("--worker="))
workers = range(int(os.environ["FAKE_TPU_WORKERS"])) if on == "all" else [int(on)]
home = lambda i: os.path.join(root, f"worker-{i}")
if args[3] == "scp":
  for i in workers:
    shutil.copy(args[4], os.path.join(home(i), args[5].split(":", 1)[1]))
  sys.exit(0)
script = next(arg.split("=", 1)[1] for arg in args if arg.startswith("--command="))
def ssh(i):
  env = dict(os.environ, HOME=home(i), FAKE_WORKER=str(i))
  # Output through a pipe, read to its end: a trainer left holding the ssh
  # channel would keep this (and the test) waiting, as it would keep ssh.
  return subprocess.run(["bash", "-c", script], cwd=home(i), env=env, stdin=subprocess.DEVNULL,
                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
with ThreadPoolExecutor(len(workers)) as pool:
  results = list(pool.map(ssh, workers))
for result in results:
  sys.stdout.write(result.stdout)
sys.exit(max(result.returncode for result in results))
"""

# A fake trainer: logs its arguments and cache, "saves a checkpoint" on SIGTERM.
# It ends by itself after two minutes, so that no failed test leaves it behind.
_FAKE_TRAINER = """#!/usr/bin/env bash
if [[ ${1:-} == -c ]]; then exit 0; fi
echo "fake trainer: $*"
echo "JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-unset} cwd=$PWD"
trap 'echo "fake trainer: SIGTERM, checkpoint saved"; exit 0' TERM
for _ in $(seq 600); do sleep 0.2; done
"""

_UV = f"""
echo "uv $*" >> "$FAKE_TPU_ROOT/uv-worker-$FAKE_WORKER.txt"
if [[ $1 == venv ]]; then
  venv=${{@: -1}}
  mkdir -p "$venv/bin"
  cat > "$venv/bin/python" <<'TRAINER'
{_FAKE_TRAINER}TRAINER
  chmod +x "$venv/bin/python"
elif [[ $1 == pip && $2 == freeze ]]; then
  printf 'flax==0.12.8\\njax==0.10.2\\njaxlib==0.10.2\\nlibtpu==0.0.42.1\\n'
fi
"""


class FakeSlice:
  """The stand-in gcloud and a temporary git repository holding launch/tpu_vm.sh."""

  def __init__(self, tmp_path, workers=2, simulate=True):
    self.root = tmp_path / "slice"
    self.root.mkdir()
    for i in range(workers):
      (self.root / f"worker-{i}").mkdir()
    tools = tmp_path / "tools"
    tools.mkdir()
    for name, body in (("gcloud", f"#!{sys.executable}\n{_GCLOUD}"),
                       ("curl", '#!/usr/bin/env bash\necho "$FAKE_WORKER"\n'),
                       ("sudo", '#!/usr/bin/env bash\necho "sudo $*" >> "$FAKE_TPU_ROOT/sudo.txt"\n'),
                       ("uv", "#!/usr/bin/env bash\n" + _UV)):
      (tools / name).write_text(body)
      (tools / name).chmod(0o755)
    self.env = dict(os.environ, PATH=f"{tools}:{os.environ['PATH']}",
                    FAKE_TPU_ROOT=str(self.root), FAKE_TPU_WORKERS=str(workers),
                    FAKE_TPU_SIMULATE="1" if simulate else "0",
                    # A narrow terminal: ps must not cut the trainer's command line.
                    COLUMNS="40")
    self.repo = tmp_path / "repo"
    for path, text in (("configs/c.py", "size = 1\n"), ("trainer/main.py", "# trainer\n"),
                       ("old.py", "# removed later\n"), (".gitignore", "ignored/\n")):
      (self.repo / path).parent.mkdir(parents=True, exist_ok=True)
      (self.repo / path).write_text(text)
    (self.repo / "launch").mkdir()
    shutil.copy(os.path.join(ROOT, "launch", "tpu_vm.sh"), self.repo / "launch")
    self.git("init", "-q")
    self.git("add", "-A")
    self.git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "first")

  def git(self, *args):
    subprocess.run(["git", *args], cwd=self.repo, check=True, capture_output=True)

  def launch(self, *args, timeout=60):
    return subprocess.run(["launch/tpu_vm.sh", *args], cwd=self.repo, env=self.env,
                          capture_output=True, text=True, timeout=timeout)

  def calls(self):
    path = self.root / "calls.jsonl"
    if not path.exists():
      return []
    return [json.loads(line) for line in path.read_text().splitlines()]

  def home(self, i):
    return self.root / f"worker-{i}"

  def pid(self, i):
    return int((self.home(i) / "cutbce" / "logs" / f"worker-{i}.pid").read_text())

  def kill_all(self):
    for pid_file in self.root.glob("worker-*/cutbce/logs/*.pid"):
      try:
        os.kill(int(pid_file.read_text()), signal.SIGKILL)
      except (ProcessLookupError, ValueError):
        pass


def _alive(pid):
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  with open(f"/proc/{pid}/stat") as stat:  # a zombie has exited
    return stat.read().rsplit(")", 1)[1].split()[0] != "Z"


@pytest.fixture
def fake_slice(tmp_path):
  fake = FakeSlice(tmp_path)
  yield fake
  fake.kill_all()


TRAINER_FLAGS = ["--", "--config=configs/yambda50m_v6e8.py", "--workdir=gs://b/run",
                 "--config.seed=3"]
TARGET = ["--tpu=my-v6e", "--zone=us-east5-b", "--project=p"]


def test_tpu_vm_start_runs_gcloud_on_every_worker(tmp_path):
  fake = FakeSlice(tmp_path, simulate=False)
  result = fake.launch(*TARGET, *TRAINER_FLAGS)
  assert result.returncode == 0, result.stderr
  calls = fake.calls()
  assert [call[:4] for call in calls] == [["compute", "tpus", "tpu-vm", "scp"]] + [
      ["compute", "tpus", "tpu-vm", "ssh"]] * 3
  assert all("--worker=all" in call and "--zone=us-east5-b" in call and "--project=p" in call
             for call in calls)
  assert calls[0][5] == "my-v6e:cutbce-code.tar.gz"
  assert all(call[4] == "my-v6e" for call in calls[1:])
  stop, install, start = (call[-1].removeprefix("--command=") for call in calls[1:])
  assert "kill -TERM" in stop and "libtpu_lockfile" in stop
  assert "uv venv --quiet --clear --python 3.11" in install
  assert "uv pip install" in install and "'jax[tpu]==0.10.2' gcsfs" in install
  assert ('"$dir/.venv/bin/python" -m trainer.main --distributed '
          "--config=configs/yambda50m_v6e8.py --workdir=gs://b/run --config.seed=3") in start
  # Detached: own session, no hang-up, every stream off the ssh channel.
  assert "setsid nohup bash -c" in start and '>> "$log" 2>&1 < /dev/null &' in start
  assert "JAX_COMPILATION_CACHE_DIR=gs://b/run/jax_cache setsid" in start


def test_tpu_vm_install_copies_and_installs_without_starting(fake_slice):
  fake = fake_slice
  result = fake.launch("install", *TARGET)
  assert result.returncode == 0, (result.stdout, result.stderr)
  assert [call[3] for call in fake.calls()] == ["scp", "ssh", "ssh"]
  for i in (0, 1):
    assert (fake.home(i) / "cutbce" / "configs" / "c.py").exists()
    assert (fake.home(i) / "cutbce" / ".venv" / "bin" / "python").exists()
    assert not (fake.home(i) / "cutbce" / "logs" / f"worker-{i}.pid").exists()
    assert "gcsfs" not in (fake.root / f"uv-worker-{i}.txt").read_text()
  assert "worker 1: installed jax==0.10.2" in result.stdout and "started" not in result.stdout


def test_tpu_vm_dry_run_prints_every_command_and_runs_nothing(tmp_path):
  fake = FakeSlice(tmp_path, simulate=False)
  result = fake.launch("--tpu=t", "--zone=z", "--dry-run", "--jax=jax[tpu]>=0.10.2,<0.11", "--",
                       "--config=c.py", "--workdir=/data/run")
  assert result.returncode == 0, result.stderr
  assert not fake.calls()
  commands = [line for line in result.stdout.splitlines() if line.startswith("gcloud ")]
  assert len(commands) == 4
  assert commands[0].startswith("gcloud compute tpus tpu-vm scp /tmp/tpu_vm.XXXXXX/")
  assert all(line.startswith("gcloud compute tpus tpu-vm ssh t --zone=z --worker=all "
                             "--command=\"$(cat <<'REMOTE'") for line in commands[1:])
  assert result.stdout.count("\nREMOTE\n)\"\n") == 3
  assert "'jax[tpu]>=0.10.2,<0.11'" in result.stdout and "gcsfs" not in result.stdout
  assert "JAX_COMPILATION_CACHE_DIR=/data/run/jax_cache" in result.stdout
  # What it prints is a shell script.
  assert subprocess.run(["bash", "-n"], input=result.stdout, text=True).returncode == 0


@pytest.mark.parametrize("subcommand, extra, worker, remote", [
    ("status", [], "all", "never started here"),
    ("logs", [], "0", 'tail -n 100 "$log"'),
    ("logs", ["--worker=3", "--lines=7", "--follow"], "3", 'tail -n 7 -F "$log"'),
    ("stop", [], "all", "GRACE=300 FORCE=0\nstop_trainer"),
    ("stop", ["--force", "--grace=5"], "all", "GRACE=5 FORCE=1\nstop_trainer || status=$?\nsudo rm -f /tmp/libtpu_lockfile"),
])
def test_tpu_vm_subcommands_run_one_ssh(tmp_path, subcommand, extra, worker, remote):
  fake = FakeSlice(tmp_path, simulate=False)
  result = fake.launch(subcommand, *TARGET, *extra)
  assert result.returncode == 0, result.stderr
  [call] = fake.calls()
  assert call[:5] == ["compute", "tpus", "tpu-vm", "ssh", "my-v6e"]
  assert call[5:8] == ["--zone=us-east5-b", "--project=p", f"--worker={worker}"]
  assert remote in call[8] and call[8].startswith("--command=")
  # The same command, printed by --dry-run and pasted into a shell.
  printed = fake.launch(subcommand, *TARGET, *extra, "--dry-run")
  assert printed.returncode == 0 and len(fake.calls()) == 1
  subprocess.run(["bash", "-c", printed.stdout], env=fake.env, check=True)
  assert fake.calls()[1] == call


def test_tpu_vm_start_copies_the_working_tree_and_detaches(fake_slice):
  fake = fake_slice
  (fake.repo / "configs" / "c.py").write_text("size = 2  # uncommitted\n")
  (fake.repo / "notes.txt").write_text("untracked\n")
  (fake.repo / "ignored").mkdir()
  (fake.repo / "ignored" / "big.bin").write_text("ignored\n")
  result = fake.launch(*TARGET, *TRAINER_FLAGS)
  assert result.returncode == 0, (result.stdout, result.stderr)
  assert "uncommitted changes to: configs/c.py" in result.stderr
  assert "NOT copied: 1 untracked file(s)" in result.stderr and "  notes.txt" in result.stderr
  assert "ignored/big.bin" not in result.stderr
  for i in (0, 1):
    copy = fake.home(i) / "cutbce"
    assert (copy / "configs" / "c.py").read_text() == "size = 2  # uncommitted\n"
    assert (copy / "launch" / "tpu_vm.sh").exists()
    assert not (copy / "notes.txt").exists() and not (copy / "ignored").exists()
    assert not (fake.home(i) / "cutbce-code.tar.gz").exists()
    assert f"worker {i}: started (pid {fake.pid(i)})" in result.stdout
    assert f"worker {i}: installed jax==0.10.2 jaxlib==0.10.2 libtpu==0.0.42.1" in result.stdout
    uv = (fake.root / f"uv-worker-{i}.txt").read_text()
    assert f"uv venv --quiet --clear --python 3.11 {copy}/.venv" in uv
    assert f"-e {copy} jax[tpu]==0.10.2 gcsfs" in uv
    # The ssh session has ended; the trainer runs on, in a session of its own.
    pid = fake.pid(i)
    assert _alive(pid) and os.getsid(pid) not in (os.getsid(0), pid)
    log = (copy / "logs" / f"worker-{i}.log").read_text()
    assert (" -m trainer.main --distributed --config=configs/yambda50m_v6e8.py "
            "--workdir=gs://b/run --config.seed=3") in log
    assert f"JAX_COMPILATION_CACHE_DIR=gs://b/run/jax_cache cwd={copy}" in log
  assert "sudo rm -f /tmp/libtpu_lockfile" in (fake.root / "sudo.txt").read_text()


def test_tpu_vm_status_logs_stop_and_restart(fake_slice):
  fake = fake_slice
  assert fake.launch(*TARGET, *TRAINER_FLAGS).returncode == 0
  first = [fake.pid(0), fake.pid(1)]

  status = fake.launch("status", *TARGET)
  assert status.returncode == 0, status.stderr
  for i in (0, 1):
    assert f"worker {i}: running (pid {first[i]}, up " in status.stdout
  assert status.stdout.count("| JAX_COMPILATION_CACHE_DIR=") == 2

  logs = fake.launch("logs", *TARGET, "--worker=1", "--lines=3")
  assert logs.returncode == 0, logs.stderr
  lines = logs.stdout.splitlines()
  assert len(lines) == 3 and lines[0].startswith("=== tpu_vm.sh start ") and "worker 1" in lines[0]
  every = fake.launch("logs", *TARGET, "--worker=all", "--lines=1").stdout.splitlines()
  assert sorted(line[:11] for line in every) == ["[worker 0] ", "[worker 1] "]

  # start again: the running trainer gets SIGTERM first; a file deleted since
  # the last copy is deleted on the workers too.
  fake.git("rm", "-q", "old.py")
  assert (fake.home(0) / "cutbce" / "old.py").exists()
  again = fake.launch(*TARGET, *TRAINER_FLAGS)
  assert again.returncode == 0, (again.stdout, again.stderr)
  for i in (0, 1):
    assert f"worker {i}: SIGTERM to the trainer (pid {first[i]})" in again.stdout
    assert f"worker {i}: stopped (exit status 0)" in again.stdout
    assert not _alive(first[i]) and _alive(fake.pid(i)) and fake.pid(i) != first[i]
    assert not (fake.home(i) / "cutbce" / "old.py").exists()
    uv = (fake.root / f"uv-worker-{i}.txt").read_text()
    assert uv.count("uv venv") == 1  # the environment is kept
  second = [fake.pid(0), fake.pid(1)]

  stop = fake.launch("stop", *TARGET, "--grace=20")
  assert stop.returncode == 0, (stop.stdout, stop.stderr)
  for i in (0, 1):
    assert f"worker {i}: stopped (exit status 0)" in stop.stdout
    assert not _alive(second[i])
    log = (fake.home(i) / "cutbce" / "logs" / f"worker-{i}.log").read_text()
    assert log.count("fake trainer: SIGTERM, checkpoint saved") == 2
  status = fake.launch("status", *TARGET)
  assert status.stdout.count("not running (exit status 0) | === trainer exited with status 0") == 2
  assert "no trainer running" in fake.launch("stop", *TARGET).stdout


def test_tpu_vm_start_reports_a_trainer_that_dies_at_once(fake_slice):
  fake = fake_slice
  result = fake.launch(*TARGET, *TRAINER_FLAGS)
  assert result.returncode == 0
  fake.launch("stop", *TARGET)
  for i in (0, 1):  # A trainer that exits at once, as one with a bad flag does.
    (fake.home(i) / "cutbce" / ".venv" / "bin" / "python").write_text(
        "#!/usr/bin/env bash\n[[ $1 == -c ]] && exit 0\necho 'bad config: config.seed=-1'\nexit 2\n")
  result = fake.launch(*TARGET, *TRAINER_FLAGS)
  assert result.returncode != 0
  assert "worker 0: the trainer exited at once" in result.stdout
  assert "bad config: config.seed=-1" in result.stdout
  assert "not running (exit status 2)" in fake.launch("status", *TARGET).stdout


def test_tpu_vm_stop_waits_the_grace_then_force_kills(fake_slice):
  fake = fake_slice
  for i in (0, 1):  # A trainer that ignores SIGTERM (stuck in a save, say).
    venv = fake.home(i) / "cutbce" / ".venv" / "bin"
    venv.mkdir(parents=True)
    (venv / "python").write_text("#!/usr/bin/env bash\n[[ $1 == -c ]] && exit 0\n"
                                 "trap '' TERM\nfor _ in $(seq 600); do sleep 0.2; done\n")
    (venv / "python").chmod(0o755)
  assert fake.launch(*TARGET, *TRAINER_FLAGS).returncode == 0
  pids = [fake.pid(0), fake.pid(1)]
  stop = fake.launch("stop", *TARGET, "--grace=1")
  assert stop.returncode != 0
  assert stop.stdout.count("still running after 1s") == 2 and all(map(_alive, pids))
  stop = fake.launch("stop", *TARGET, "--force")
  assert stop.returncode == 0, stop.stdout
  assert stop.stdout.count("stopped (exit status 137)") == 2
  assert not any(map(_alive, pids))
  assert "sudo rm -f /tmp/libtpu_lockfile" in (fake.root / "sudo.txt").read_text()


def _fake_compile(tmp_path, fake, status):
  """$PYTHON stand-in: records `python -m trainer.compile` arguments, exits `status`."""
  record = tmp_path / "compile.txt"
  python = tmp_path / "python"
  python.write_text(f'#!/usr/bin/env bash\necho "$PYTHONPATH $*" >> {record}\nexit {status}\n')
  python.chmod(0o755)
  return dict(fake.env, PYTHON=str(python)), record


@pytest.mark.parametrize("extra, topology", [([], "v5e-8"), (["--topology=v6e-16"], "v6e-16")])
def test_tpu_vm_compile_runs_trainer_compile_here_for_the_slice(tmp_path, extra, topology):
  fake = FakeSlice(tmp_path, simulate=False)
  env, record = _fake_compile(tmp_path, fake, 0)
  result = subprocess.run(["launch/tpu_vm.sh", "compile", *TARGET, *extra, "--num-slices=2",
                           *TRAINER_FLAGS], cwd=fake.repo, env=env, capture_output=True,
                          text=True, timeout=60)
  assert result.returncode == 0, result.stderr
  # The slice's type from gcloud (v5litepod-8 is v5e-8), unless --topology names it.
  described = [call for call in fake.calls() if call[3] == "describe"]
  assert len(described) == (0 if extra else 1) and not any(
      call[3] in ("ssh", "scp") for call in fake.calls())
  path, *args = record.read_text().split()
  assert path == str(fake.repo)
  assert args == ["-m", "trainer.compile", f"--topology={topology}", "--num_slices=2",
                  "--config=configs/yambda50m_v6e8.py", "--config.seed=3"]  # no --workdir


def test_tpu_vm_start_preflight_starts_nothing_when_a_step_does_not_fit(tmp_path):
  fake = FakeSlice(tmp_path, simulate=False)
  env, record = _fake_compile(tmp_path, fake, 1)
  result = subprocess.run(["launch/tpu_vm.sh", "start", "--preflight", *TARGET, *TRAINER_FLAGS],
                          cwd=fake.repo, env=env, capture_output=True, text=True, timeout=60)
  assert result.returncode == 2 and "preflight: the run's steps do not fit" in result.stderr
  assert record.exists() and [call[3] for call in fake.calls()] == ["describe"]
  env, record = _fake_compile(tmp_path, fake, 0)
  result = subprocess.run(["launch/tpu_vm.sh", "start", "--preflight", *TARGET, *TRAINER_FLAGS],
                          cwd=fake.repo, env=env, capture_output=True, text=True, timeout=60)
  assert result.returncode == 0, result.stderr
  assert [call[3] for call in fake.calls()][1:] == ["describe", "scp", "ssh", "ssh", "ssh"]


def test_tpu_vm_needs_tpu_and_zone():
  result = subprocess.run(["launch/tpu_vm.sh", "--", "--config=c.py"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
  assert result.returncode == 2 and "--tpu=NAME and --zone=ZONE" in result.stderr


@pytest.mark.parametrize("args, message", [
    (["--", "--config=c.py"], "pass --workdir=DIR"),
    (["status", "--", "--config=c.py"], "status takes no trainer flags"),
    (["logs", "--worker=x"], "--worker=x: a worker number or all"),
    (["--worker=1", "--", "--workdir=w"], "start runs on every worker"),
    (["install", "--worker=0"], "install runs on every worker"),
    (["--bogus"], "unknown option --bogus"),
    (["stop", "logs"], "one subcommand at a time"),
    (["--python=3", "--", "--workdir=w"], "--python=3: a version such as 3.11"),
])
def test_tpu_vm_rejects_bad_flags(args, message):
  result = subprocess.run(["launch/tpu_vm.sh", "--tpu=t", "--zone=z", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
  assert result.returncode == 2 and message in result.stderr, result.stderr


def test_local_stops_everyone_when_one_process_fails(tmp_path):
  # A stand-in python: process 1 fails as soon as the others are ready (their
  # TERM trap set: on a loaded machine "at once" could beat it), the others
  # would run forever.
  marker = tmp_path / "stopped"
  fake = _stand_in(tmp_path, "fakepython", f"""
for arg in "$@"; do
  case "$arg" in --process_id=*) id=${{arg#*=}} ;; esac
done
if [[ $id == 1 ]]; then
  for _ in $(seq 100); do [[ -f {tmp_path}/ready-0 && -f {tmp_path}/ready-2 ]] && break; sleep 0.1; done
  echo "process 1 fails" >&2; exit 7
fi
trap 'echo $id >> {marker}; exit 143' TERM
touch {tmp_path}/ready-$id
while true; do sleep 0.1; done
""")
  env = dict(os.environ, PYTHON=str(fake / "fakepython"))
  result = subprocess.run(
      ["launch/local.sh", "-p", "3", "-k", "2", "--", "--config=configs/smoke.py",
       f"--workdir={tmp_path / 'run'}"], cwd=ROOT, env=env, capture_output=True, text=True,
      timeout=60)
  assert result.returncode == 7, (result.stdout, result.stderr)
  assert "stopping the others" in result.stderr
  assert sorted(marker.read_text().split()) == ["0", "2"]
  assert "process 1 fails" in (tmp_path / "run" / "logs" / "process_1.log").read_text()


def _two_processes_match_one(tmp_path, smoke_data_dir, data_flags):
  """Trains 10 smoke steps as 2 processes x 4 devices (`launch/local.sh`, with `data_flags`)
  and as 1 x 8 (reading `smoke_data_dir`); asserts the same parameters and losses.

  The two processes' rows make the same global batch in another row order
  (process 0's rows first), so dropout is off: with it, masks follow rows.
  """
  from trainer import loop  # pylint: disable=import-outside-toplevel
  from configs import smoke  # pylint: disable=import-outside-toplevel
  flags = ["--config=configs/smoke.py", "--config.train_steps=10",
           "--config.model.dropout_rate=0.0", "--config.eval.max_batches=1", *data_flags]
  multi = tmp_path / "multi"
  env = dict(os.environ, PYTHON=sys.executable)
  env.pop("XLA_FLAGS", None)
  result = subprocess.run(["launch/local.sh", "-p", "2", "-k", "4", "--", *flags,
                           f"--workdir={multi}"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  config = smoke.get_config()
  config.train_steps, config.eval.max_batches = 10, 1
  config.model.dropout_rate = 0.0
  config.data.prepared_dir = smoke_data_dir
  single = loop.train_and_evaluate(config, str(tmp_path / "single"))
  assert jax.device_count() == 8 and single["step"] == 10
  single_params = loop.final_params(str(tmp_path / "single"))
  multi_params = loop.final_params(str(multi))
  for block in single_params["blocks"]:
    # The attention key bias gets no gradient (softmax ignores a shift shared
    # by all keys): its only "gradient" is rounding noise, which Adam scales
    # up to full-size steps. It is the one parameter left out.
    del single_params["blocks"][block]["attention"]["key"]["bias"]
    del multi_params["blocks"][block]["attention"]["key"]["bias"]
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-4),
               single_params, multi_params)
  for one, two in zip(test_train.read_metrics(str(tmp_path / "single")),
                      test_train.read_metrics(str(multi))):
    assert one["step"] == two["step"]
    np.testing.assert_allclose(one["loss"], two["loss"], rtol=1e-5)


@pytest.mark.slow
def test_two_processes_of_four_devices_match_one_of_eight(tmp_path, smoke_data_dir):
  """2 x 4 devices over loopback, reading one prepared folder, trains as 1 x 8."""
  _two_processes_match_one(tmp_path, smoke_data_dir,
                           [f"--config.data.prepared_dir={smoke_data_dir}"])


@pytest.mark.slow
def test_two_processes_as_two_slices_match_one_of_eight(tmp_path, smoke_data_dir):
  """`mesh.dcn_shape=(2,)`: jax's hybrid mesh with each process as one slice (CPU
  devices carry no slice index) trains as 1 x 8."""
  _two_processes_match_one(tmp_path, smoke_data_dir, [
      f"--config.data.prepared_dir={smoke_data_dir}", "--config.mesh.dcn_shape=(2,)"])


def _prepared_hashes(folder) -> dict[str, str]:
  from trainer.data import storage  # pylint: disable=import-outside-toplevel
  names = [storage.MANIFEST] + [f"{name}.npy" for name in storage.ARRAYS]
  return {name: hashlib.sha256((folder / name).read_bytes()).hexdigest() for name in names}


@pytest.mark.slow
def test_two_processes_preparing_a_copy_each_match_one_of_eight(tmp_path, smoke_data_dir):
  """`data.prepare_per_host`: each process prepares its own copy (`{process}`: folders
  prepared-0 and prepared-1, as two hosts' local disks would be); the copies are
  byte-identical to the folder the 1 x 8 run reads, and training matches it."""
  _two_processes_match_one(tmp_path, smoke_data_dir, [
      "--config.data.prepare_per_host=True",
      f"--config.data.prepared_dir={tmp_path / 'prepared-{process}'}"])
  copies = [_prepared_hashes(tmp_path / f"prepared-{i}") for i in range(2)]
  assert copies[0] == copies[1] == _prepared_hashes(pathlib.Path(smoke_data_dir))
