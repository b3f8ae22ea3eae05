"""`python -m trainer.export`: export a trained run for serving.

The command lives in :mod:`trainer.commands.export`; this module keeps its
old command line and import path (`from trainer.export import ...`) working.
"""

if __name__ == "__main__":  # run exactly as `python -m trainer.commands.export`
  import runpy
  runpy.run_module("trainer.commands.export", run_name="__main__", alter_sys=True)
else:
  from trainer.commands.export import (  # noqa: F401  (re-exported)
      Export, export_run, load_export, main, run)
