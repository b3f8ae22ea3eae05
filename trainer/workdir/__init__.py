"""What guards a workdir: its paths, its lock, its records, its checkpoints, its logs.

The rules of a workdir (and of every file a command writes) live here, one
module per guard:

- `paths`: one path type (`etils.epath`) for local folders and `gs://`; a
  remote path without its filesystem package is one line.
- `lock`: WORKDIR/trainer.lock, one live trainer per workdir; the workdir
  must be a writable directory (`WorkdirError`).
- `fingerprint`: WORKDIR/data_fingerprint.json, the item-id map the run's
  table rows name; re-prepared data whose items moved is refused.
- `checkpoint`: WORKDIR/checkpoints (orbax), committed atomically, free
  space checked first.
- `preemption`: SIGTERM saves and stops at a step in the loop, stops at
  once elsewhere, and ends a process whose main thread is stuck in native
  code after a grace period: never ignored.
- `logs`: WORKDIR/metrics.jsonl and TensorBoard events, a torn last line
  dropped.
- `outputs`: what a command may write: regular files or new paths only
  (never a device, a FIFO or through a symlink), never a file of the run it
  reads, and a folder it fills only when empty or already its own (a
  manifest carrying its format tag).

Imports: `trainer.config.schema` (`ConfigError`) and nothing else of the
trainer; the training path and the commands import it.
"""
