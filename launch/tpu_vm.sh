#!/usr/bin/env bash
# Runs the trainer on every worker of a Cloud TPU VM slice.
#
#   launch/tpu_vm.sh --tpu=NAME --zone=ZONE [--project=PROJECT] [--dry-run] -- \
#       --config=configs/yambda50m_v6e8.py --workdir=gs://bucket/run [--config.key=value ...]
#
# Steps, each one `gcloud compute tpus tpu-vm` command over --worker=all:
#   1. copy this repository (git-tracked files, as a tarball) to every worker;
#   2. install it there (pip install -e the copy, with its dependencies and jax[tpu]);
#   3. stop stale trainer processes and remove the libtpu lock file, which a
#      killed run leaves behind and which makes the next one fail to open the TPU;
#   4. start `python -m trainer.main --distributed ...` on all workers at once
#      (jax.distributed.initialize() finds the slice's coordinator by itself).
# --dry-run prints the commands instead of running them.
set -euo pipefail

tpu=""; zone=""; project=""; dry_run=0
remote_dir='~/cutbce'
while [[ $# -gt 0 ]]; do
  case "$1" in
    --tpu=*) tpu=${1#*=}; shift ;;
    --zone=*) zone=${1#*=}; shift ;;
    --project=*) project=${1#*=}; shift ;;
    --remote-dir=*) remote_dir=${1#*=}; shift ;;
    --dry-run) dry_run=1; shift ;;
    --) shift; break ;;
    -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
    *) echo "tpu_vm.sh: unknown option $1 (trainer flags go after --)" >&2; exit 2 ;;
  esac
done
if [[ -z "$tpu" || -z "$zone" ]]; then
  echo "tpu_vm.sh: --tpu=NAME and --zone=ZONE are required" >&2
  exit 2
fi
if [[ $# -eq 0 ]]; then
  echo "tpu_vm.sh: pass the trainer flags after --, e.g. -- --config=configs/X.py --workdir=DIR" >&2
  exit 2
fi

gcloud_target=("$tpu" "--zone=$zone")
[[ -n "$project" ]] && gcloud_target+=("--project=$project")

run() {
  if [[ $dry_run -eq 1 ]]; then
    printf '%q ' "$@"; printf '\n'
  else
    "$@"
  fi
}

repo_root=$(cd "$(dirname "$0")/.." && pwd)
tarball=$(mktemp -d)/cutbce.tar.gz
if [[ $dry_run -eq 0 ]]; then
  git -C "$repo_root" archive --format=tar.gz -o "$tarball" HEAD
fi
run gcloud compute tpus tpu-vm scp "$tarball" "$tpu:/tmp/cutbce.tar.gz" "--zone=$zone" \
  ${project:+"--project=$project"} --worker=all

install="mkdir -p $remote_dir && tar -xzf /tmp/cutbce.tar.gz -C $remote_dir && \
cd $remote_dir && python3 -m pip install -q -e . 'jax[tpu]'"
run gcloud compute tpus tpu-vm ssh "${gcloud_target[@]}" --worker=all --command="$install"

free_tpu="pkill -f '[p]ython3 -m trainer.main' || true; sudo rm -f /tmp/libtpu_lockfile; \
sudo lsof -t /dev/accel* /dev/vfio/* 2>/dev/null | xargs -r sudo kill -9 || true"
run gcloud compute tpus tpu-vm ssh "${gcloud_target[@]}" --worker=all --command="$free_tpu"

trainer_flags=$(printf '%q ' "$@")
start="cd $remote_dir && python3 -m trainer.main --distributed $trainer_flags"
run gcloud compute tpus tpu-vm ssh "${gcloud_target[@]}" --worker=all --command="$start"
