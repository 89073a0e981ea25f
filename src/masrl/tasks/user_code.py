"""Deprecated: moved to ``masrl.usercode.imports``. This path is the same module for one release and warns on
import; import from ``masrl.usercode.imports`` (or ``masrl.usercode``) instead."""
import sys
import warnings

import masrl.usercode.imports as _moved

warnings.warn("masrl.tasks.user_code is deprecated: import from masrl.usercode.imports "
              "(this path goes away in the next release)", DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved
