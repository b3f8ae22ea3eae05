"""The command lines besides training: evaluate, recommend, export, compile.

- `cli`: what every command shares (its flags described once in
  `trainer.config.keys`, parsing, one-line errors, notices, progress);
  `trainer.main` uses it too.
- `workdir`: a trained run opened from its workdir (config, mesh, data,
  restored params) for the commands after training.
- `evaluate`, `recommend`, `export`: the commands after training;
  `compile`: the trainer's steps compiled for a TPU slice with no TPU.

Each runs as `python -m trainer.<command>` (the old module names keep
working) or as a console script (`cutbce-<command>`). Imports: anything of
`trainer` and `cutbce`; nothing outside this folder imports it but
`trainer.main` and the old-name modules (`trainer.recommend`, ...).
"""
