"""Deprecated: moved to ``masrl.retrieval.http``. This path is the same module for one release and warns on
import; import from ``masrl.retrieval.http`` instead."""
import sys
import warnings

import masrl.retrieval.http as _moved

warnings.warn("masrl.tasks.retrieval.http is deprecated: import from masrl.retrieval.http (this path goes away in the next release)",
              DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved
