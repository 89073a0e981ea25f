"""A service: run a model-written program in ``masrl.sandbox`` and check it against hidden tests, evaluated
outside the untrusted process (docs/sandbox.md). The code tasks (``masrl.tasks.code``: MBPP, HumanEval, the
synthetic code task) score their answers with it; it imports no task.

    from masrl.codecheck import score_code, score_many, make_code_score, extract_code
"""
from masrl.codecheck.extract import extract_code
from masrl.codecheck.scoring import ScoreCache, free_names, make_code_score, score_code, score_many

__all__ = ["ScoreCache", "extract_code", "free_names", "make_code_score", "score_code", "score_many"]
