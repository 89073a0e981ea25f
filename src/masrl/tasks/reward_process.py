"""Deprecated: moved to ``masrl.usercode.process``. This path is the same module for one release and warns on
import; import from ``masrl.usercode.process`` (or ``masrl.usercode``) instead."""
import sys
import warnings

import masrl.usercode.process as _moved

warnings.warn("masrl.tasks.reward_process is deprecated: import from masrl.usercode.process "
              "(this path goes away in the next release)", DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved
