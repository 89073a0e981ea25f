"""The arithmetic teacher's Orch-Workers demonstrations: the Orchestrator's subtasks are independent
expressions whose values add up to the answer, Workers solve their own subtask, the Synthesizer adds."""
from hypothesis import given, settings, strategies as st

from masrl.tasks.arithmetic import ArithmeticConfig, ArithmeticTeacher, make_arithmetic_tasks, solve_steps
from masrl.tasks.parsing import extract_boxed
from masrl.types import Task
from masrl.workflows.common import parse_subtasks


def value(expr: str) -> int:
    steps = solve_steps(expr)
    return steps[-1][3] if steps else int(expr)


@settings(max_examples=200, deadline=None)
@given(terms=st.lists(st.integers(0, 999), min_size=1, max_size=7), data=st.data())
def test_subtasks_add_up_to_the_answer(terms, data):
    ops = [data.draw(st.sampled_from("+-")) for _ in terms[1:]]
    question = str(terms[0]) + "".join(o + str(t) for o, t in zip(ops, terms[1:]))
    lines = ArithmeticTeacher().subtasks(question, max_subtasks=2)
    subtasks = parse_subtasks(lines, 2)
    assert subtasks, lines
    assert sum(value(s) for s in subtasks) == value(question)
    assert len(subtasks) == (2 if len(terms) >= 3 else 1)


def test_split_by_hand():
    t = ArithmeticTeacher()
    assert t.subtasks("23+45-17") == "SUBTASK 1: 23+45\nSUBTASK 2: 0-17"
    assert t.subtasks("5-6+7-8+9") == "SUBTASK 1: 5-6\nSUBTASK 2: 7-8+9"
    assert t.subtasks("3*4+5") == "SUBTASK 1: 3*4+5"      # left to right with a product: not separable
    assert t.subtasks("4+2") == "SUBTASK 1: 4+2"


def test_worker_and_synthesizer_replies():
    t = ArithmeticTeacher()
    task = Task(id="t", question="23+45-17", answer="51")
    worker = t.reply("Worker", "T 0-17\nS ", task)          # the worker solves its subtask, not the question
    assert worker == "0-17=-17\n\\boxed{-17}"
    assert t.reply("Worker", "T 9\nS ", task) == "\\boxed{9}"
    synth = t.reply("Synthesizer", "Q 23+45-17\nR1 23+45=68\n\\boxed{68}\nR2 " + worker + "\nA ", task)
    assert synth == "68-17=51\n\\boxed{51}"
    assert t.reply("Synthesizer", "Q 4+2\nR1 4+2=6\n\\boxed{6}\nA ", task) == "\\boxed{6}"


def test_noisy_teacher_is_right_about_one_minus_slip_rate_per_stage():
    tasks, _ = make_arithmetic_tasks(ArithmeticConfig(train_size=400, test_size=0, min_terms=3, max_terms=3,
                                                      max_operand=9))
    t = ArithmeticTeacher(slip_rate=0.4, seed=0)
    right = 0
    for task in tasks:
        subtasks = parse_subtasks(t.reply("Orchestrator", "", task), 2)
        workers = "".join(f"R{i} {t.reply('Worker', f'T {s}', task)}\n" for i, s in enumerate(subtasks, 1))
        right += extract_boxed(t.reply("Synthesizer", workers + "A ", task)) == task.answer
    # every stage slips with probability 0.4 (2 workers + synthesizer: 0.6^3 = 0.216 when no slips cancel)
    assert 0.15 < right / len(tasks) < 0.30


@settings(max_examples=300, deadline=None)
@given(terms=st.lists(st.integers(0, 99), min_size=1, max_size=6), data=st.data())
def test_the_calculator_call_gives_the_tasks_left_to_right_value(terms, data):
    from masrl.tasks.arithmetic import left_to_right
    from masrl.tools.builtin import evaluate_arithmetic

    ops = [data.draw(st.sampled_from("+-*")) for _ in terms[1:]]
    question = str(terms[0]) + "".join(o + str(t) for o, t in zip(ops, terms[1:]))
    expr = left_to_right(question)
    assert evaluate_arithmetic(expr) == value(question), (question, expr)
    if "*" not in ops or len(terms) <= 2:
        assert expr == question                      # parentheses only where precedence would differ
    assert left_to_right("3+4*5") == "(3+4)*5" and left_to_right("2*3+4") == "2*3+4"
