"""Deprecated: moved to ``masrl.retrieval.cache``. This path is the same module for one release and warns on
import; import from ``masrl.retrieval.cache`` instead."""
import sys
import warnings

import masrl.retrieval.cache as _moved

warnings.warn("masrl.tasks.retrieval.cache is deprecated: import from masrl.retrieval.cache (this path goes away in the next release)",
              DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved
