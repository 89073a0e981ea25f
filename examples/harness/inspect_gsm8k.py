"""Inspect AI task over local GSM8K rows, to score `masrl serve RUN --team` (the team as one OpenAI-API model):

    masrl serve runs/my-team-seed0 --team --port 8000 &
    OPENAI_API_KEY=unused inspect eval examples/harness/inspect_gsm8k.py --model openai/RUN_NAME \
        --model-base-url http://127.0.0.1:8000/v1 --limit 50 --temperature 0

Any other JSONL of `question` / `answer` rows (the answer a number, or a worked answer ending `#### N` as in
GSM8K), e.g. the held-out rows `benchmarks/harness_agreement.py` writes: add `-T data_file=PATH`.

The score: the number in the reply's last \\boxed{} equals the gold answer (after GSM8K's `####`).
"""
import json
import os
import re
from pathlib import Path

from inspect_ai import Task, task
from inspect_ai.dataset import MemoryDataset, Sample
from inspect_ai.scorer import CORRECT, INCORRECT, Score, Target, accuracy, scorer
from inspect_ai.solver import TaskState, generate

BOXED = re.compile(r"\\boxed\{\s*(-?[0-9][0-9,]*(?:\.[0-9]+)?)\s*\}")


def _data_file() -> Path:
    root = Path(os.environ.get("MASRL_DATA_DIR", Path(__file__).resolve().parents[3] / "shared" / "data"))
    return root / "math" / "gsm8k_test.jsonl"


def gsm8k_samples(path: Path | str | None = None, limit: int | None = None) -> list[Sample]:
    samples = []
    with open(path or _data_file(), encoding="utf-8") as f:
        for i, line in enumerate(f):
            if limit is not None and i >= limit:
                break
            row = json.loads(line)
            samples.append(Sample(input=row["question"], id=i,
                                  target=str(row["answer"]).rsplit("####", 1)[-1].strip().replace(",", "")))
    return samples


@scorer(metrics=[accuracy()])
def boxed_number():
    async def score(state: TaskState, target: Target) -> Score:
        found = BOXED.findall(state.output.completion or "")
        answer = found[-1].replace(",", "") if found else None
        return Score(value=CORRECT if answer == target.text else INCORRECT, answer=answer)

    return score


@task
def masrl_gsm8k(limit: int | None = None, data_file: str | None = None) -> Task:
    """GSM8K's test rows from the shared data, or the rows of ``data_file``."""
    return Task(dataset=MemoryDataset(gsm8k_samples(data_file, limit=limit)), solver=generate(),
                scorer=boxed_number())
