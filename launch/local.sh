#!/usr/bin/env bash
# Runs the trainer as P processes x K simulated CPU devices on this machine.
#
#   launch/local.sh [-p PROCESSES] [-k DEVICES_PER_PROCESS] [--port PORT] [--logs DIR] \
#       -- --config=configs/smoke.py --workdir=/tmp/run [--config.key=value ...]
#
# The processes meet over loopback (coordinator 127.0.0.1:PORT, CPU collectives
# over gloo). Process i writes its output to LOGS/process_i.log (default
# WORKDIR/logs; ./logs for a gs:// workdir), process 0 also to this terminal.
# When one process fails, the others are stopped, and the script exits with
# the failing process's status.
set -u -o pipefail

processes=2
devices=4
port=$((20000 + RANDOM % 20000))
python=${PYTHON:-python}
logs=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    -p|--processes) processes=$2; shift 2 ;;
    -k|--devices) devices=$2; shift 2 ;;
    --port) port=$2; shift 2 ;;
    --logs) logs=$2; shift 2 ;;
    --) shift; break ;;
    -h|--help) sed -n '2,11p' "$0"; exit 0 ;;
    *) echo "local.sh: unknown option $1 (trainer flags go after --)" >&2; exit 2 ;;
  esac
done

workdir=""
for arg in "$@"; do
  case "$arg" in --workdir=*) workdir=${arg#--workdir=} ;; esac
done
if [[ -z "$workdir" ]]; then
  echo "local.sh: pass --workdir=DIR after --" >&2
  exit 2
fi
# The logs are local files: a gs:// workdir is the trainer's (epath), not a folder here.
if [[ -z "$logs" ]]; then
  if [[ "$workdir" == *://* ]]; then logs=logs; else logs="$workdir/logs"; fi
fi
mkdir -p "$logs"

export XLA_FLAGS="--xla_force_host_platform_device_count=${devices}${XLA_FLAGS:+ $XLA_FLAGS}"
export JAX_PLATFORMS=cpu

pids=()
stop_all() {
  for pid in "${pids[@]}"; do
    kill -TERM "$pid" 2>/dev/null || true
  done
}
trap 'stop_all; exit 143' TERM INT

for ((i = 0; i < processes; i++)); do
  log="$logs/process_$i.log"
  if [[ $i -eq 0 ]]; then
    "$python" -m trainer.main --coordinator_address="127.0.0.1:$port" \
      --num_processes="$processes" --process_id="$i" "$@" > >(tee "$log") 2>&1 &
  else
    "$python" -m trainer.main --coordinator_address="127.0.0.1:$port" \
      --num_processes="$processes" --process_id="$i" "$@" >"$log" 2>&1 &
  fi
  pids+=($!)
done

# Poll: the first process to fail stops the others; its status is ours.
status=0
running=("${pids[@]}")
while [[ ${#running[@]} -gt 0 ]]; do
  still=()
  for pid in "${running[@]}"; do
    if kill -0 "$pid" 2>/dev/null; then
      still+=("$pid")
      continue
    fi
    wait "$pid"
    code=$?
    if [[ $code -ne 0 && $status -eq 0 ]]; then
      status=$code
      echo "local.sh: process $pid exited with status $code; stopping the others" >&2
      stop_all
    fi
  done
  running=("${still[@]+"${still[@]}"}")
  [[ ${#running[@]} -gt 0 ]] && sleep 0.5
done
wait
exit "$status"
