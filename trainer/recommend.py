"""`python -m trainer.recommend`: top-K recommendations per user from a trained run.

The command lives in :mod:`trainer.commands.recommend`; this module keeps its
old command line and import path (`from trainer.recommend import ...`) working.
"""

if __name__ == "__main__":  # run exactly as `python -m trainer.commands.recommend`
  import runpy
  runpy.run_module("trainer.commands.recommend", run_name="__main__", alter_sys=True)
else:
  from trainer.commands.recommend import (  # noqa: F401  (re-exported)
      main, recommend, run, top_k_step)
