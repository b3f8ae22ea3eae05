"""Old import path of :mod:`trainer.workdir.checkpoint` (scripts under benchmarks/ use it).

`import trainer.checkpoint` gives the very module `trainer.workdir.checkpoint`, so
attributes set on one are seen through the other.
"""

import sys

from trainer.workdir import checkpoint as _moved

sys.modules[__name__] = _moved
