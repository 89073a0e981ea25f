"""Probe a local judge on answers whose verdict is known: three answers equal to the reference, three naming
another entity of the synthetic knowledge base, with the judge example's template and the default yes/no and
score templates. Prints each reply and the parsed verdicts.

    python benchmarks/study/judge_probe.py [--model smollm2-135m-instruct]
"""
from __future__ import annotations

import argparse

import torch

from masrl.judges.backends import LocalJudge
from masrl.judges.config import DEFAULT_TEMPLATES, JudgeOptions
from masrl.judges.verdicts import parse_score, parse_yes_no

EXAMPLE = ("Question: {question}\nReference answer: {reference}\nAnswer: {answer}\nDoes the answer name the same "
           "thing as the reference? Reply yes or no.")  # examples/judge_kb_team.yaml
CASES = [("Bulzi lives in?", "Kovaro", "Kovaro"), ("Tamek works for?", "Zuvel", "Zuvel"),
         ("Rinso lives in?", "Mapla", "Mapla"), ("Bulzi lives in?", "Kovaro", "Zuvel"),
         ("Tamek works for?", "Zuvel", "Mapla"), ("Rinso lives in?", "Mapla", "Kovaro")]  # 3 right, 3 wrong


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    args = parser.parse_args()
    torch.set_num_threads(1)
    for name, verdict, template, tokens in (("example yes/no", "yes_no", EXAMPLE, 4),
                                            ("default yes/no", "yes_no", DEFAULT_TEMPLATES["yes_no"], 6),
                                            ("default score 1-10", "score", DEFAULT_TEMPLATES["score"], 6)):
        judge = LocalJudge(JudgeOptions(model=args.model, verdict=verdict, max_new_tokens=tokens))
        replies = [r.text for r in judge.complete([template.format(question=q, reference=ref, answer=a, lo=1, hi=10)
                                                  for q, ref, a in CASES])]
        parsed = [parse_yes_no(t) if verdict == "yes_no" else parse_score(t, 1.0, 10.0) for t in replies]
        print(f"{name}: right answers {parsed[:3]}, wrong answers {parsed[3:]}; replies {replies}", flush=True)


if __name__ == "__main__":
    main()
