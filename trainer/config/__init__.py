"""The trainer's settings: what each config key means, the rules between keys, the mesh.

- `schema`: the generic description of settings (a `Key`: path, type,
  allowed values, meaning; a `Rule` between keys; `ConfigError`), with no
  knowledge of the trainer.
- `keys`: the trainer's keys (every key of `configs/base.py`), their rules,
  the flags of the commands after training, and the generated tables of
  docs/trainer.md (`python -m trainer.config.keys --update docs/trainer.md`).
- `mesh`: `check_config` (the rules, then whether the mesh fits the
  devices) and the device mesh built from a config.
- `saved`: the run's config in its workdir (`WORKDIR/config.json`) and what
  a resume may change.

Imports: `cutbce` (backend names), `trainer.workdir.paths` and `trainer.data` (the
sources' options and choices); never the training path (model, train, loop)
or `trainer.commands`.
"""
