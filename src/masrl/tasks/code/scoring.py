"""Deprecated: the code reward's harness moved to ``masrl.codecheck.scoring``. This path re-exports it for one
release and warns on import; import from ``masrl.codecheck`` instead."""
import warnings

from masrl.codecheck.scoring import (DEFAULT_CACHE_ENTRIES, MODES, CandidateError, RemoteRef, SandboxFailure,
                                     ScoreCache, cache_entries_param, make_code_score, score_code, score_many)

__all__ = ["score_code", "score_many", "make_code_score", "ScoreCache", "RemoteRef", "CandidateError", "SandboxFailure",
           "DEFAULT_CACHE_ENTRIES", "MODES", "cache_entries_param"]

warnings.warn("masrl.tasks.code.scoring is deprecated: import from masrl.codecheck (this path goes away in the next "
              "release)", DeprecationWarning, stacklevel=2)
