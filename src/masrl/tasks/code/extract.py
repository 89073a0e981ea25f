"""Deprecated: ``extract_code`` moved to ``masrl.codecheck.extract`` (``masrl.tasks.code.extract_code`` stays). This
path re-exports it for one release and warns on import."""
import warnings

from masrl.codecheck.extract import extract_code

__all__ = ["extract_code"]

warnings.warn("masrl.tasks.code.extract is deprecated: import from masrl.codecheck (this path goes away in the next "
              "release)", DeprecationWarning, stacklevel=2)
