"""Deprecated: moved to ``masrl.tasks.synthetic_kb``. This path is the same module for one release and warns on
import; import from ``masrl.tasks.synthetic_kb`` instead."""
import sys
import warnings

import masrl.tasks.synthetic_kb as _moved

warnings.warn("masrl.tasks.retrieval.synthetic_kb is deprecated: import from masrl.tasks.synthetic_kb (this path goes away in the next release)",
              DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved
