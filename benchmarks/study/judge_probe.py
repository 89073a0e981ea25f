"""Probe a local judge on answers whose verdict is known: three answers equal to the reference, three naming
another entity of the synthetic knowledge base, with the judge example's template and the default yes/no and
score templates. Prints each reply and the parsed verdicts. Then the probability verdict (``yes_prob``) on 48
training questions of the example's knowledge base (never its held-out ones), each with the right answer and
with another entity of the same relation: mean P(yes) / (P(yes) + P(no)) on right and on wrong answers, the
AUC between them (0.5: chance) and the mean probability on yes + no, per template.

With ``--fact-check N``: instead, each ``--model`` (the frozen SmolLM2, a trained judge's folder) judges the first
N held-out rows of the fact-check task (``kb_fact_check``: the knowledge base's held-out people, half the candidates
right, half wrong) with a template and system prompt (``--template``, ``--system-prompt``): greedy yes/no
verdicts give the approve rate, the agreement with the gold verdict overall, on right and on wrong answers, and
the unparsed replies; P(yes) / (P(yes) + P(no)) of the first reply token gives the AUC.

    python benchmarks/study/judge_probe.py [--model smollm2-135m-instruct]
    python benchmarks/study/judge_probe.py --fact-check 200 --model smollm2-135m-instruct \
        --model judges/kb-smollm2/judge --template trained
"""
from __future__ import annotations

import argparse
import random
import statistics

import torch

from masrl.evaluation.metrics import auc, judge_agreement
from masrl.judges.backends import LocalJudge
from masrl.judges.config import DEFAULT_TEMPLATES, JudgeOptions
from masrl.judges.verdicts import parse_score, parse_yes_no
from masrl.tasks.fact_check import DEFAULT_TEMPLATE, kb_fact_check
from masrl.tasks.synthetic_kb import synthetic_kb

EXAMPLE = DEFAULT_TEMPLATE  # the judge template of examples/judge_kb_team.yaml
PROBABILITY_TEMPLATES = {  # yes_prob templates probed on training questions
    "default": DEFAULT_TEMPLATES["yes_prob"], "example": EXAMPLE,
    "same word": "Reference: {reference}\nAnswer: {answer}\nAre the reference and the answer the same word? Reply yes or no.",
    "quoted": 'Is "{answer}" the same as "{reference}"? Reply yes or no.',
    "student": ("Question: {question}\nThe correct answer is {reference}.\nA student answered: {answer}\nIs the "
                "student's answer correct? Reply yes or no."),
    "match": 'Does "{answer}" match "{reference}" exactly? Answer yes or no.'}
TRAINED = "Q: {question}\nReference: {reference}\nAnswer: {answer}\nDoes the answer name the reference?"
TRAINED_SYSTEM = "Reply yes or no."  # examples/judge_train_smollm2.yaml and judge_kb_team_trained.yaml
KB = dict(n_people=500, n_companies=60, n_cities=40, name_length=5, relations=["lives_in", "works_for"],
          question_style="cloze", split_by="person")  # the knowledge base of the judge examples
CASES = [("Bulzi lives in?", "Kovaro", "Kovaro"), ("Tamek works for?", "Zuvel", "Zuvel"),
         ("Rinso lives in?", "Mapla", "Mapla"), ("Bulzi lives in?", "Kovaro", "Zuvel"),
         ("Tamek works for?", "Zuvel", "Mapla"), ("Rinso lives in?", "Mapla", "Kovaro")]  # 3 right, 3 wrong


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", action="append", help="a judge model (repeat for several; default SmolLM2)")
    parser.add_argument("--fact-check", type=int, default=0, metavar="N",
                        help="judge N held-out fact-check rows with each model instead of the template probe")
    parser.add_argument("--template", choices=("example", "trained"), default="trained",
                        help="--fact-check: the frozen example's judge template or the trained judge's")
    parser.add_argument("--system-prompt", default=None,
                        help="--fact-check: the judge's system prompt (default: the trained judge's with "
                             "--template trained, none with example)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    models = args.model or ["smollm2-135m-instruct"]
    if args.fact_check:
        template = TRAINED if args.template == "trained" else EXAMPLE
        system = args.system_prompt if args.system_prompt is not None else (
            TRAINED_SYSTEM if args.template == "trained" else None)
        for model in models:
            fact_check_probe(model, args.fact_check, template, system or None, args.template)
        return
    for model in models:
        template_probe(model)


def template_probe(model: str) -> None:
    for name, verdict, template, tokens in (("example yes/no", "yes_no", EXAMPLE, 4),
                                            ("default yes/no", "yes_no", DEFAULT_TEMPLATES["yes_no"], 6),
                                            ("default score 1-10", "score", DEFAULT_TEMPLATES["score"], 6)):
        judge = LocalJudge(JudgeOptions(model=model, verdict=verdict, max_new_tokens=tokens))
        replies = [r.text for r in judge.complete([template.format(question=q, reference=ref, answer=a, lo=1, hi=10)
                                                  for q, ref, a in CASES])]
        parsed = [parse_yes_no(t) if verdict == "yes_no" else parse_score(t, 1.0, 10.0) for t in replies]
        print(f"{name}: right answers {parsed[:3]}, wrong answers {parsed[3:]}; replies {replies}", flush=True)
    probability_probe(model)


def fact_check_probe(model: str, n: int, template: str, system_prompt: str | None, name: str) -> None:
    """Greedy yes/no and P(yes) verdicts of ``model`` on the first ``n`` held-out fact-check rows."""
    rows = kb_fact_check(0, "test", template=template, **KB)[:n]
    right = [r.answer == ["yes"] for r in rows]
    judge = LocalJudge(JudgeOptions(model=model, verdict="yes_no", max_new_tokens=2, system_prompt=system_prompt))
    said = [parse_yes_no(r.text) for r in judge.complete([r.question for r in rows])]
    agree = judge_agreement([s == 1.0 for s in said], right)
    judge = LocalJudge(JudgeOptions(model=model, verdict="yes_prob", system_prompt=system_prompt))
    replies = judge.yes_probabilities([r.question for r in rows])
    shares = [r.p_yes / (r.p_yes + r.p_no) if r.p_yes + r.p_no > 0 else 0.5 for r in replies]
    print(f"fact check, {name} template, {model}: {len(rows)} held-out rows ({sum(right)} right answers); yes/no "
          f"approve rate {agree['approve_rate']:.3f}, agreement {agree['agreement']:.3f} (on right answers "
          f"{agree['agreement_right']:.3f}, on wrong {agree['agreement_wrong']:.3f}), unparsed "
          f"{sum(s is None for s in said)}; yes_prob AUC {auc(shares, right):.3f}", flush=True)


def kb_cases(n: int = 48, seed: int = 0) -> list[tuple[str, str, str, bool]]:
    """``(question, reference, answer, right)``: ``n`` training questions of examples/judge_kb_team.yaml's knowledge
    base, each once with its gold answer and once with the gold answer of another question of the same relation."""
    tasks, _ = synthetic_kb(seed=0, split="train", n_people=500, n_companies=60, n_cities=40, name_length=5,
                            relations=["lives_in", "works_for"], question_style="cloze", split_by="person")
    rng = random.Random(seed)
    picked = rng.sample(tasks, n)
    cases = []
    for task in picked:
        others = sorted({t.answer[0] for t in tasks if t.meta["relation"] == task.meta["relation"]} - {task.answer[0]})
        cases += [(task.question, task.answer[0], task.answer[0], True),
                  (task.question, task.answer[0], rng.choice(others), False)]
    return cases


def probability_probe(model: str) -> None:
    cases = kb_cases()
    judge = LocalJudge(JudgeOptions(model=model, verdict="yes_prob"))
    for name, template in PROBABILITY_TEMPLATES.items():
        replies = judge.yes_probabilities([template.format(question=q, reference=ref, answer=a)
                                           for q, ref, a, _ in cases])
        shares = [r.p_yes / (r.p_yes + r.p_no) for r in replies]
        right = [v for v, c in zip(shares, cases) if c[3]]
        wrong = [v for v, c in zip(shares, cases) if not c[3]]
        mass = statistics.fmean(r.p_yes + r.p_no for r in replies)
        print(f"yes_prob, {name} template: {len(right)} right / {len(wrong)} wrong answers; mean P(yes) share right "
              f"{statistics.fmean(right):.3f}, wrong {statistics.fmean(wrong):.3f}; AUC "
              f"{auc(shares, [c[3] for c in cases]):.3f}; mean P(yes) + P(no) {mass:.3f}", flush=True)


if __name__ == "__main__":
    main()
