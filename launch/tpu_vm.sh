#!/usr/bin/env bash
# Runs the trainer on every worker of a Cloud TPU VM slice, detached from ssh,
# and looks after it (walk-through: docs/tpu.md).
#
#   launch/tpu_vm.sh [start] --tpu=NAME --zone=ZONE [--project=P] [options] -- \
#       --config=configs/yambda50m_v6e8.py --workdir=gs://BUCKET/run [--config.key=value ...]
#   launch/tpu_vm.sh status --tpu=NAME --zone=ZONE   trainer alive on each worker? last log line
#   launch/tpu_vm.sh logs --tpu=NAME --zone=ZONE [--worker=N] [--lines=K] [--follow]
#   launch/tpu_vm.sh stop --tpu=NAME --zone=ZONE [--grace=SECONDS] [--force]
#   launch/tpu_vm.sh install --tpu=NAME --zone=ZONE [-- FLAGS]   steps 1-3 of start, no run
#   launch/tpu_vm.sh compile --tpu=NAME --zone=ZONE [--topology=T] [--num-slices=K] -- FLAGS
#       compiles the run's train, eval and top-k steps here, with no TPU, for
#       the slice (python -m trainer.compile; its topology from gcloud unless
#       --topology=v6e-8 etc. is given): per-chip memory against HBM; exit 1
#       when a step does not fit. `start --preflight` runs it first and starts
#       nothing when a step does not fit.
#
# start, each step one `gcloud compute tpus tpu-vm` command over --worker=all:
#   1. copy the working tree's git-tracked files, uncommitted changes included
#      (untracked files are listed and left out), to every worker;
#   2. stop a trainer still running there (SIGTERM: it saves a checkpoint), then
#      free the TPU (stray holders of /dev/accel*, the libtpu lock file);
#   3. unpack into REMOTE_DIR and install it (pip install -e) with jax[tpu] into
#      a Python 3.11 virtual environment REMOTE_DIR/.venv made with uv;
#   4. start `python -m trainer.main --distributed ...` under setsid + nohup, so
#      it outlives the ssh session: log REMOTE_DIR/logs/worker-N.log, PID in
#      worker-N.pid, exit status in worker-N.exit; JAX's persistent compilation
#      cache in WORKDIR/jax_cache. Rerunning start restarts, resuming from the
#      last checkpoint.
# stop sends SIGTERM on every worker (the trainer saves a checkpoint and exits,
# all processes at the same step) and waits up to --grace seconds (300);
# --force sends SIGKILL instead and frees the TPU.
#
# Options: --remote-dir=DIR (~/cutbce), --python=VERSION (3.11),
#   --jax=SPEC (jax[tpu]==0.10.2), --jax-cache=DIR|none (WORKDIR/jax_cache),
#   --worker=N|all, --dry-run (print every command, remote scripts included,
#   and run nothing), --preflight (start: compile first), --topology=NAME and
#   --num-slices=K (compile; the local interpreter is $PYTHON, default python3).
set -euo pipefail

die() { echo "tpu_vm.sh: $*" >&2; exit 2; }
squote() { local q="'"; printf "'%s'" "${1//$q/$q\\$q$q}"; }  # 'text', for the remote shell

# --- Flags -------------------------------------------------------------------
subcommand=""
tpu=""; zone=""; project=""; dry_run=0; worker=""; lines=100; follow=0
grace=300; force=0; jax_cache=""; preflight=0; topology=""; num_slices=1
remote_dir='~/cutbce'
# The interpreter and jax of CI: pyproject allows jax>=0.10.2 and Python >= 3.11;
# CI tests jax 0.10.2 on Python 3.11 (jax 0.x changes the Pallas TPU API between
# releases, so the launcher does not float to a jax that CI has not run).
python_version=3.11
jax_spec='jax[tpu]==0.10.2'
while [[ $# -gt 0 ]]; do
  case "$1" in
    --tpu=*) tpu=${1#*=} ;;
    --zone=*) zone=${1#*=} ;;
    --project=*) project=${1#*=} ;;
    --remote-dir=*) remote_dir=${1#*=} ;;
    --python=*) python_version=${1#*=} ;;
    --jax=*) jax_spec=${1#*=} ;;
    --jax-cache=*) jax_cache=${1#*=} ;;
    --worker=*) worker=${1#*=} ;;
    --lines=*) lines=${1#*=} ;;
    --follow|-f) follow=1 ;;
    --grace=*) grace=${1#*=} ;;
    --force) force=1 ;;
    --dry-run) dry_run=1 ;;
    --preflight) preflight=1 ;;
    --topology=*) topology=${1#*=} ;;
    --num-slices=*) num_slices=${1#*=} ;;
    --) shift; break ;;
    -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
    start|install|status|logs|stop|compile)
      [[ -z "$subcommand" ]] || die "one subcommand at a time (got $subcommand and $1)"
      subcommand=$1 ;;
    *) die "unknown option $1 (trainer flags go after --; see --help)" ;;
  esac
  shift
done
subcommand=${subcommand:-start}
[[ -n "$tpu" && -n "$zone" ]] || die "--tpu=NAME and --zone=ZONE are required"
[[ $lines =~ ^[0-9]+$ ]] || die "--lines=$lines: a number of lines"
[[ $grace =~ ^[0-9]+$ ]] || die "--grace=$grace: a number of seconds"
[[ $python_version =~ ^3\.[0-9]+$ ]] || die "--python=$python_version: a version such as 3.11"
[[ $num_slices =~ ^[1-9][0-9]*$ ]] || die "--num-slices=$num_slices: a number of slices >= 1"
if [[ $subcommand == logs ]]; then
  worker=${worker:-0}
else
  worker=${worker:-all}
fi
[[ $worker == all || $worker =~ ^[0-9]+$ ]] || die "--worker=$worker: a worker number or all"
if [[ $subcommand == start || $subcommand == install || $subcommand == compile ]]; then
  [[ $worker == all ]] || die "$subcommand runs on every worker (--worker=all)"
  [[ $subcommand == install || $# -gt 0 ]] \
    || die "pass the trainer flags after --, e.g. -- --config=configs/X.py --workdir=DIR"
elif [[ $# -gt 0 ]]; then
  die "$subcommand takes no trainer flags (got $*)"
fi

# --- Commands, printed or run ----------------------------------------------
gcloud_target=("$tpu" "--zone=$zone")
[[ -n "$project" ]] && gcloud_target+=("--project=$project")

step() {  # A step's title: a comment in --dry-run output, progress otherwise.
  if [[ $dry_run -eq 1 ]]; then echo "# $*"; else echo "tpu_vm.sh: $*" >&2; fi
}

run() {
  if [[ $dry_run -eq 1 ]]; then
    printf '%q ' "$@" | sed 's/ $//'; printf '\n'
  else
    "$@"
  fi
}

# ssh WORKER SCRIPT: runs SCRIPT with bash on one worker or all. --dry-run
# prints a command that can be pasted as is, the script verbatim in a heredoc.
ssh_workers() {
  local on=$1 script=$2
  if [[ $dry_run -eq 1 ]]; then
    printf '%q ' gcloud compute tpus tpu-vm ssh "${gcloud_target[@]}" "--worker=$on"
    printf -- "--command=\"\$(cat <<'REMOTE'\n%s\nREMOTE\n)\"\n" "$script"
  else
    gcloud compute tpus tpu-vm ssh "${gcloud_target[@]}" "--worker=$on" --command="$script"
  fi
}

# --- Remote scripts ------------------------------------------------------------
case "$remote_dir" in
  '~') remote_dir_expr='$HOME' ;;
  '~/'*) remote_dir_expr="\$HOME/$(printf '%q' "${remote_dir#\~/}")" ;;
  *) remote_dir_expr=$(printf '%q' "$remote_dir") ;;
esac

# Every remote script starts here: where things are on this VM, and which
# worker it is (the slice's worker number, what --worker=N names, read from the
# metadata server as jax.distributed reads it; else the host name's -w-N).
prelude="dir=$remote_dir_expr"'
worker=$(curl -sf --max-time 5 -H "Metadata-Flavor: Google" \
  http://metadata.google.internal/computeMetadata/v1/instance/attributes/agent-worker-number || true)
[[ $worker =~ ^[0-9]+$ ]] || worker=$(hostname | sed -n "s/.*-w-\([0-9]*\)$/\1/p")
worker=${worker:-0}
log=$dir/logs/worker-$worker.log pid_file=$dir/logs/worker-$worker.pid exit_file=$dir/logs/worker-$worker.exit
# The recorded trainer, if it is still running (and is still the trainer).
# -ww: the whole command line, whatever COLUMNS says (ps cuts it to COLUMNS otherwise).
alive() { [[ -s $pid_file ]] && ps -ww -o args= -p "$(cat "$pid_file")" 2>/dev/null | grep -q "trainer[.]main"; }'

# SIGTERM to the recorded trainer and a wait of up to GRACE seconds while it
# saves its checkpoint; SIGKILL with FORCE=1.
stop_function='stop_trainer() {
  if ! alive; then echo "worker $worker: no trainer running"; return 0; fi
  local pid; pid=$(cat "$pid_file")
  if [[ $FORCE == 1 ]]; then
    echo "worker $worker: SIGKILL to the trainer (pid $pid)"; kill -KILL "$pid" || true
  else
    echo "worker $worker: SIGTERM to the trainer (pid $pid); up to ${GRACE}s to save a checkpoint"
    kill -TERM "$pid" || true
  fi
  local deadline=$((SECONDS + GRACE))
  while alive && ((SECONDS < deadline)); do sleep 0.2; done
  if alive; then
    echo "worker $worker: still running after ${GRACE}s (pid $pid); tpu_vm.sh stop --force kills it"
    return 1
  fi
  for _ in 1 2 3 4 5 6 7 8 9 10; do [[ -s $exit_file ]] && break; sleep 0.2; done
  echo "worker $worker: stopped (exit status $(cat "$exit_file" 2>/dev/null || echo unknown))"
}'

# Whatever still holds the TPU (a killed run, another user's process) and the
# lock file a killed run leaves behind, which makes the next one fail to open it.
free_tpu='sudo rm -f /tmp/libtpu_lockfile
sudo lsof -t /dev/accel* /dev/vfio/* 2>/dev/null | xargs -r sudo kill -9 || true'

archive=cutbce-code.tar.gz  # in the remote home; scp puts it there.

status_script="set -uo pipefail
$prelude"'
if alive; then
  pid=$(cat "$pid_file")
  state="running (pid $pid, up $(ps -o etime= -p "$pid" | tr -d " "))"
elif [[ -s $exit_file ]]; then
  state="not running (exit status $(cat "$exit_file"))"
elif [[ -s $pid_file ]]; then
  state="not running (no exit status recorded: killed, or the VM restarted)"
else
  state="never started here"
fi
echo "worker $worker: $state | $(tail -n 1 "$log" 2>/dev/null || echo "no log at $log")"'

tail_args="-n $lines"
[[ $follow -eq 1 ]] && tail_args+=" -F"
prefix=""
[[ $worker == all ]] && prefix=' | sed -u "s/^/[worker $worker] /"'
logs_script="set -uo pipefail
$prelude"'
if [[ ! -f $log ]]; then echo "worker $worker: no log at $log" >&2; exit 1; fi
tail '"$tail_args"' "$log"'"$prefix"

stop_script="set -uo pipefail
$prelude
$stop_function
GRACE=$grace FORCE=$force
stop_trainer"

# compile (and start --preflight): trainer.compile here, for the slice's topology.
compile_steps() {
  local name=$topology args=() expect=0 arg
  if [[ -z "$name" ]]; then
    step "asking gcloud for the accelerator type of $tpu"
    if [[ $dry_run -eq 1 ]]; then
      run gcloud compute tpus tpu-vm describe "${gcloud_target[@]}" '--format=value(acceleratorType)'
      name=ACCELERATOR_TYPE
    else
      name=$(gcloud compute tpus tpu-vm describe "${gcloud_target[@]}" \
        '--format=value(acceleratorType)') || die "could not describe $tpu (pass --topology=...)"
    fi
    name=${name/v5litepod-/v5e-}  # Cloud TPU's name of v5e slices
  fi
  for arg in "$@"; do  # the trainer's flags, less those of a run (workdir, hosts)
    if [[ $expect -eq 1 ]]; then expect=0; continue; fi
    case "$arg" in
      --workdir|--coordinator_address|--num_processes|--process_id) expect=1 ;;
      --workdir=*|--coordinator_address=*|--num_processes=*|--process_id=*) ;;
      --distributed|--allow_config_change|--noallow_config_change) ;;
      *) args+=("$arg") ;;
    esac
  done
  step "compiling the run's steps for $num_slices x $name here (no TPU is used)"
  local root
  root=$(cd "$(dirname "$0")/.." && pwd)
  PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" run "${PYTHON:-python3}" -m trainer.compile \
    "--topology=$name" "--num_slices=$num_slices" "${args[@]}"
}

case "$subcommand" in
  compile) compile_steps "$@"; exit ;;
  status) ssh_workers "$worker" "$status_script"; exit ;;
  logs) ssh_workers "$worker" "$logs_script"; exit ;;
  stop)
    if [[ $force -eq 1 ]]; then
      ssh_workers "$worker" "$stop_script || status=\$?
$free_tpu
exit \${status:-0}"
    else
      ssh_workers "$worker" "$stop_script"
    fi
    exit ;;
esac

# --- start (install: its first three steps) -----------------------------------
if [[ $preflight -eq 1 && $subcommand == start ]]; then
  compile_steps "$@" || die "preflight: the run's steps do not fit the slice (or did not \
compile); nothing was started"
fi
workdir=""
expect_workdir=0
for arg in "$@"; do
  if [[ $expect_workdir -eq 1 ]]; then workdir=$arg; expect_workdir=0; fi
  case "$arg" in
    --workdir=*) workdir=${arg#--workdir=} ;;
    --workdir) expect_workdir=1 ;;
  esac
done
[[ -n "$workdir" || $subcommand == install ]] \
  || die "pass --workdir=DIR after -- (a gs:// path, or a path on each VM)"
case "$jax_cache" in
  none) jax_cache="" ;;
  "") [[ -n "$workdir" ]] && jax_cache="${workdir%/}/jax_cache" ;;
esac
# gs:// paths (workdir, data, cache) are read through etils.epath with fsspec,
# which needs gcsfs for Google Cloud Storage (install: when its flags name one).
extra_packages=""
[[ " $* $jax_cache" == *gs://* ]] && extra_packages=" gcsfs"

# 1. The working tree's tracked files (what `git ls-files` lists and still
# exists), read from disk: uncommitted changes go along, untracked files do not.
repo_root=$(cd "$(dirname "$0")/.." && pwd)
git -C "$repo_root" rev-parse --is-inside-work-tree >/dev/null 2>&1 \
  || die "$repo_root is not a git checkout: the copy is made of its tracked files"
tracked=()
while IFS= read -r -d '' path; do
  [[ -e "$repo_root/$path" || -L "$repo_root/$path" ]] && tracked+=("$path")
done < <(git -C "$repo_root" ls-files -z)
revision=$(git -C "$repo_root" rev-parse --short HEAD 2>/dev/null || echo "no-commit")
changed=()
while IFS= read -r -d '' path; do changed+=("$path"); done \
  < <(git -C "$repo_root" diff -z --name-only HEAD -- 2>/dev/null || true)
untracked=()
while IFS= read -r -d '' path; do untracked+=("$path"); done \
  < <(git -C "$repo_root" ls-files -z --others --exclude-standard)
if [[ ${#changed[@]} -gt 0 ]]; then
  revision+="+uncommitted"
  echo "tpu_vm.sh: copying ${#tracked[@]} tracked files at $revision, with the uncommitted changes to: ${changed[*]}" >&2
else
  echo "tpu_vm.sh: copying ${#tracked[@]} tracked files at $revision" >&2
fi
if [[ ${#untracked[@]} -gt 0 ]]; then
  echo "tpu_vm.sh: NOT copied: ${#untracked[@]} untracked file(s) (git add them to send them):" >&2
  printf '  %s\n' "${untracked[@]:0:20}" >&2
  [[ ${#untracked[@]} -gt 20 ]] && echo "  ... and $(( ${#untracked[@]} - 20 )) more" >&2
fi

if [[ $dry_run -eq 1 ]]; then
  tarball="/tmp/tpu_vm.XXXXXX/$archive"  # made by mktemp -d when run
else
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  tarball=$tmp/$archive
  printf '%s\0' "${tracked[@]}" \
    | tar -czf "$tarball" -C "$repo_root" --null --no-recursion --files-from=-
fi
steps=4
[[ $subcommand == install ]] && steps=3
step "1/$steps copy: tar of the ${#tracked[@]} tracked files of the working tree ($revision) -> $tarball"
run gcloud compute tpus tpu-vm scp "$tarball" "$tpu:$archive" "--zone=$zone" \
  ${project:+"--project=$project"} --worker=all

# 2. A trainer still running gets SIGTERM and saves its checkpoint; then
# anything else on the TPU is killed.
step "2/$steps stop a running trainer (SIGTERM, up to ${grace}s), free the TPU"
ssh_workers all "$stop_script
$free_tpu"

# 3. Python 3.11 from uv: the Cloud TPU VM images (tpu-ubuntu2204-base,
# v2-alpha-tpuv5-lite, v2-alpha-tpuv6e: Ubuntu 22.04) ship Python 3.10, and the
# project needs >= 3.11. uv comes from PyPI with the image's pip, needs no sudo
# or third-party apt repository (deadsnakes would need both), and fetches a
# standalone CPython of the exact minor version CI runs, the same on every image.
step "3/$steps unpack into $remote_dir, install into $remote_dir/.venv (Python $python_version, $jax_spec$extra_packages)"
ssh_workers all "set -euo pipefail
$prelude
mkdir -p \"\$dir/logs\"
# Unpack over the last copy; files that it had and this one lacks are removed.
tar -tzf ~/$archive | grep -v '/\$' | LC_ALL=C sort > \"\$dir/.copied_files.new\"
if [[ -f \$dir/.copied_files ]]; then
  LC_ALL=C comm -23 \"\$dir/.copied_files\" \"\$dir/.copied_files.new\" \\
    | (cd \"\$dir\" && xargs -r -d '\\n' rm -f --) || true
fi
tar -xzf ~/$archive -C \"\$dir\" && rm -f ~/$archive
mv \"\$dir/.copied_files.new\" \"\$dir/.copied_files\"
export PATH=\$HOME/.local/bin:\$PATH
command -v uv >/dev/null || python3 -m pip install --user --quiet uv \\
  || python3 -m pip install --user --quiet --break-system-packages uv
venv=\$dir/.venv
\"\$venv/bin/python\" -c 'import sys; sys.exit(sys.version[:len(\"$python_version.\")] != \"$python_version.\")' 2>/dev/null \\
  || uv venv --quiet --clear --python $python_version \"\$venv\"
uv pip install --quiet --python \"\$venv/bin/python\" -e \"\$dir\" $(squote "$jax_spec")$extra_packages
echo \"worker \$worker: installed \$(uv pip freeze --python \"\$venv/bin/python\" | grep -E '^(jax|jaxlib|libtpu)==' | paste -sd ' ' || true)\""

[[ $subcommand == install ]] && exit 0

# 4. Detached: setsid puts the trainer in a session of its own, so the end of
# the ssh session (SIGHUP to its session) does not reach it, and nohup ignores
# SIGHUP anyway; stdin, stdout and stderr leave the ssh channel, so ssh returns
# at once. A small bash parent records the trainer's PID and, when it ends,
# its exit status.
cache_env=""
[[ -n "$jax_cache" ]] && cache_env="JAX_COMPILATION_CACHE_DIR=$(printf '%q' "$jax_cache") "
trainer_flags=$(printf '%q ' "$@" | sed 's/ $//')
step "4/4 start the trainer on every worker, detached (log: $remote_dir/logs/worker-N.log)"
ssh_workers all "set -euo pipefail
$prelude
cd \"\$dir\"
rm -f \"\$pid_file\" \"\$exit_file\"
echo \"=== tpu_vm.sh start \$(date -u +%Y-%m-%dT%H:%M:%SZ) worker \$worker code $revision ===\" >> \"\$log\"
PID_FILE=\$pid_file EXIT_FILE=\$exit_file ${cache_env}setsid nohup bash -c '
  \"\$@\" &
  echo \$! > \"\$PID_FILE\"
  wait \$!
  code=\$?
  echo \$code > \"\$EXIT_FILE\"
  echo \"=== trainer exited with status \$code at \$(date -u +%Y-%m-%dT%H:%M:%SZ) ===\"
' trainer \"\$dir/.venv/bin/python\" -m trainer.main --distributed $trainer_flags \\
  >> \"\$log\" 2>&1 < /dev/null &
# A few seconds to catch a run that dies at once (a bad flag or config).
sleep 3
if alive; then
  echo \"worker \$worker: started (pid \$(cat \"\$pid_file\")), log \$log\"
else
  echo \"worker \$worker: the trainer exited at once; the end of \$log:\"
  tail -n 20 \"\$log\"
  exit 1
fi"
