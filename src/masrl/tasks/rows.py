"""Deprecated: moved to ``masrl.io.rows``. This path is the same module for one release and warns on
import; import from ``masrl.io.rows`` instead."""
import sys
import warnings

import masrl.io.rows as _moved

warnings.warn("masrl.tasks.rows is deprecated: import from masrl.io.rows (this path goes away in the next release)",
              DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved
