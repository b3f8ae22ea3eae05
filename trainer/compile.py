"""`python -m trainer.compile`: does my job fit this TPU slice? (compiled with no TPU).

The command lives in :mod:`trainer.commands.compile`; this module keeps its
old command line and import path (`from trainer.compile import ...`) working.
"""

if __name__ == "__main__":  # run exactly as `python -m trainer.commands.compile`
  import runpy
  runpy.run_module("trainer.commands.compile", run_name="__main__", alter_sys=True)
else:
  from trainer.commands.compile import (  # noqa: F401  (re-exported)
      compile_config, compile_step, main, run, step_programs)
