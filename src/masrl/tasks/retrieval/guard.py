"""Deprecated: moved to ``masrl.http.guard``. This path is the same module for one release and warns on
import; import from ``masrl.http.guard`` instead."""
import sys
import warnings

import masrl.http.guard as _moved

warnings.warn("masrl.tasks.retrieval.guard is deprecated: import from masrl.http.guard (this path goes away in the next release)",
              DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved
