"""A verifiers (v0) environment over GSM8K rows, written as for the Environments Hub: no masrl in the environment.

`load_environment(...)` returns a `vf.SingleTurnEnv` whose rubric has two functions: `correct_answer` (weight 1:
the number in the last \\boxed{} equals the gold answer after GSM8K's `####`) and `boxed_format` (weight 0: logged,
not rewarded). masrl trains a team on it with `task: {name: verifiers, params: {env:
"examples/verifiers_gsm8k.py:load_environment"}}` (examples/verifiers_gsm8k.yaml); each rubric function's score is
logged as `env/<function>`.

The rows are the shared data's GSM8K files (`MASRL_DATA_DIR`, in a checkout `../shared/data`).
"""
import json
import os
from pathlib import Path

import verifiers as vf
from datasets import Dataset


def _data_dir() -> Path:
    here = Path(__file__).resolve().parents[2] / "shared" / "data"
    return Path(os.environ.get("MASRL_DATA_DIR", here))


def gsm8k_rows(file: str, limit: int, max_chars: int | None = None) -> list[dict]:
    """``{"question", "answer"}`` rows of a GSM8K JSON Lines file; the answer is the number after ``####``."""
    rows = []
    with open(_data_dir() / file, encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            if max_chars is not None and len(row["question"]) > max_chars:
                continue
            rows.append({"question": row["question"],
                         "answer": row["answer"].rsplit("####", 1)[1].strip().replace(",", "")})
            if len(rows) == limit:
                break
    return rows


def _number(text: str | None) -> str | None:
    if text is None:
        return None
    text = text.strip().replace(",", "").rstrip(".")
    try:
        value = float(text)
    except ValueError:
        return text
    return str(int(value)) if value.is_integer() else str(value)


def load_environment(num_train: int = 200, num_eval: int = 50, max_chars: int | None = None,
                     system_prompt: str | None = None) -> vf.Environment:
    parser = vf.Parser(extract_fn=vf.extract_boxed_answer)

    def correct_answer(completion, answer, **kwargs) -> float:
        return 1.0 if _number(parser.parse_answer(completion)) == _number(answer) else 0.0

    def boxed_format(completion, **kwargs) -> float:
        text = completion[-1]["content"] if isinstance(completion, list) and completion else str(completion)
        return 1.0 if "\\boxed{" in (text or "") else 0.0

    rubric = vf.Rubric(funcs=[correct_answer, boxed_format], weights=[1.0, 0.0], parser=parser)
    return vf.SingleTurnEnv(
        dataset=Dataset.from_list(gsm8k_rows("math/gsm8k_train.jsonl", num_train, max_chars)),
        eval_dataset=Dataset.from_list(gsm8k_rows("math/gsm8k_test.jsonl", num_eval, max_chars)),
        system_prompt=system_prompt, parser=parser, rubric=rubric)
