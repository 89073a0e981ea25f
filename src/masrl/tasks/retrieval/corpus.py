"""Deprecated: moved to ``masrl.retrieval.corpus``. This path is the same module for one release and warns on
import; import from ``masrl.retrieval.corpus`` instead."""
import sys
import warnings

import masrl.retrieval.corpus as _moved

warnings.warn("masrl.tasks.retrieval.corpus is deprecated: import from masrl.retrieval.corpus (this path goes away in the next release)",
              DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved
