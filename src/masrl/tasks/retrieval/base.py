"""Deprecated: moved to ``masrl.retrieval.base``. This path is the same module for one release and warns on
import; import from ``masrl.retrieval.base`` instead."""
import sys
import warnings

import masrl.retrieval.base as _moved

warnings.warn("masrl.tasks.retrieval.base is deprecated: import from masrl.retrieval.base (this path goes away in the next release)",
              DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved
