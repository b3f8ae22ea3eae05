"""Old import path of :mod:`trainer.workdir.logs` (scripts under benchmarks/ use it).

`import trainer.logs` gives the very module `trainer.workdir.logs`, so
attributes set on one are seen through the other.
"""

import sys

from trainer.workdir import logs as _moved

sys.modules[__name__] = _moved
