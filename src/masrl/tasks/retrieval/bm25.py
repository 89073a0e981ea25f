"""Deprecated: moved to ``masrl.retrieval.bm25``. This path is the same module for one release and warns on
import; import from ``masrl.retrieval.bm25`` instead."""
import sys
import warnings

import masrl.retrieval.bm25 as _moved

warnings.warn("masrl.tasks.retrieval.bm25 is deprecated: import from masrl.retrieval.bm25 (this path goes away in the next release)",
              DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved
