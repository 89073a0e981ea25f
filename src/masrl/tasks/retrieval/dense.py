"""Deprecated: moved to ``masrl.retrieval.dense``. This path is the same module for one release and warns on
import; import from ``masrl.retrieval.dense`` instead."""
import sys
import warnings

import masrl.retrieval.dense as _moved

warnings.warn("masrl.tasks.retrieval.dense is deprecated: import from masrl.retrieval.dense (this path goes away in the next release)",
              DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved
