"""Deprecated: moved to ``masrl.retrieval.cli``. This path is the same module for one release and warns on
import; import from ``masrl.retrieval.cli`` instead."""
import sys
import warnings

import masrl.retrieval.cli as _moved

warnings.warn("masrl.tasks.retrieval.cli is deprecated: import from masrl.retrieval.cli (this path goes away in the next release)",
              DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved
