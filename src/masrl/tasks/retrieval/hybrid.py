"""Deprecated: moved to ``masrl.retrieval.hybrid``. This path is the same module for one release and warns on
import; import from ``masrl.retrieval.hybrid`` instead."""
import sys
import warnings

import masrl.retrieval.hybrid as _moved

warnings.warn("masrl.tasks.retrieval.hybrid is deprecated: import from masrl.retrieval.hybrid (this path goes away in the next release)",
              DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved
