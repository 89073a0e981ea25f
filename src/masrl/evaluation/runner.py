"""Deprecated: moved to ``masrl.evaluation.summary``. This path is the same module for one release and
warns on import; import from ``masrl.evaluation.summary`` instead."""
import sys
import warnings

import masrl.evaluation.summary as _moved

warnings.warn("masrl.evaluation.runner is deprecated: import from masrl.evaluation.summary (this path goes away "
              "in the next release)", DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved
