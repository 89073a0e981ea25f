"""Deprecated: moved to ``masrl.usercode.guard``. This path is the same module for one release and warns on
import; import from ``masrl.usercode.guard`` (or ``masrl.usercode``) instead."""
import sys
import warnings

import masrl.usercode.guard as _moved

warnings.warn("masrl.tasks.reward_guard is deprecated: import from masrl.usercode.guard "
              "(this path goes away in the next release)", DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved
