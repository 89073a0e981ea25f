"""Deprecated: moved to ``masrl.retrieval.guard``. This path is the same module for one release and warns on
import; import from ``masrl.retrieval.guard`` instead."""
import sys
import warnings

import masrl.retrieval.guard as _moved

warnings.warn("masrl.tasks.retrieval.guard is deprecated: import from masrl.retrieval.guard (this path goes away in the next release)",
              DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved
