"""Deprecated: moved to ``masrl.io.lines``. This path is the same module for one release and warns on
import; import from ``masrl.io.lines`` instead."""
import sys
import warnings

import masrl.io.lines as _moved

warnings.warn("masrl.tasks.lines is deprecated: import from masrl.io.lines (this path goes away in the next release)",
              DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved
