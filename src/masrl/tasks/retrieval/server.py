"""Deprecated: moved to ``masrl.retrieval.server``. This path is the same module for one release and warns on
import; import from ``masrl.retrieval.server`` instead."""
import sys
import warnings

import masrl.retrieval.server as _moved

warnings.warn("masrl.tasks.retrieval.server is deprecated: import from masrl.retrieval.server (this path goes away in the next release)",
              DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved
