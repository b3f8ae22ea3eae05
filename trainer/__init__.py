"""SASRec multi-label training with CutBCE: data, model, loop, eval, checkpoints.

This folder is the training path: `model` (SASRec in Flax NNX), `train`
(state, optimizer, the sharded step), `loop` (the only module that sees the
whole config), `evaluate` (full-catalog metrics), `checkpoint` (orbax),
`logs`, `paths` (local and `gs://`), `main` (`python -m trainer.main`).
Beside it: `data/` (sources, preparation, grain pipelines), `config/` (the
settings, their rules, the mesh) and `commands/` (evaluate, recommend,
export, compile). Imports: `cutbce`, `data/` and `config/`; only `main` and
the commands' old-name modules (`recommend`, `export`, `compile`) import
`commands/`.
"""
