"""SASRec multi-label training with CutBCE: data, model, loop, eval, checkpoints.

This folder is the training path, what a step computes: `model` (SASRec in
Flax NNX), `train` (state, optimizer, the sharded step), `sampled` (the
sampled losses), `evaluate` (full-catalog metrics), `loop` (the only module
that sees the whole config), `main` (`python -m trainer.main`). Beside it:
`workdir/` (what guards a workdir and every output: paths, lock, fingerprint,
checkpoints, preemption, logs, outputs), `data/` (sources, preparation,
grain pipelines), `config/` (the settings, their rules, the mesh) and
`commands/` (evaluate, recommend, export, compile). `checkpoint` and `logs`
here are old import paths of `workdir/`'s modules. Imports: `cutbce`,
`workdir/`, `data/` and `config/`; only `main` and the commands' old-name
modules (`recommend`, `export`, `compile`) import `commands/`.
"""
