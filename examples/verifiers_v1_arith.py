"""A verifiers v1 Env with two roles over the quickstart's arithmetic rows, written as for the Environments Hub (no
masrl in it), and the teacher that writes its cold-start demonstrations.

`SolveCheck` declares two roles as `vf.AgentConfig` fields: `solver` answers the row (an expression such as `7-3+2`
evaluated left to right: steps, then the boxed result; the task's `correct_answer` reward compares the last
\\boxed{} with the answer, `boxed_format` is a metric), and `checker` reads the solver's answer and says yes or no.
`setup` marks the checker `trainable = False`: it stands for a fixed judge model, and its verdict is only a metric
(`checker_agrees`, recorded on the solver's trace by `finalize`). The rows and the teacher's steps are those of the
v0 example beside this file (examples/verifiers_arith.py). masrl trains the solver with
examples/verifiers_v1_arith.yaml (the checker is served by a policy that is never trained).
"""
import importlib.util
from pathlib import Path

import verifiers.v1 as vf

_spec = importlib.util.spec_from_file_location("verifiers_arith_rows", Path(__file__).with_name("verifiers_arith.py"))
v0 = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(v0)


class ArithData(vf.TaskData):
    answer: str = ""


class ArithTask(vf.Task[ArithData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def correct_answer(self, task, trace) -> float:
        return float(vf.extract_boxed_answer(trace.last_reply, strict=True).strip() == task.answer)

    @vf.metric
    async def boxed_format(self, task, trace) -> float:
        return float("\\boxed{" in trace.last_reply)


class ArithTasksetConfig(vf.TasksetConfig):
    split: str = "train"
    num_train: int = 400
    num_eval: int = 100
    seed: int = 1234


class ArithTaskset(vf.Taskset[ArithTask, ArithTasksetConfig]):
    def load(self):
        c = self.config
        test = v0.arithmetic_rows(c.num_eval, c.seed)
        rows = test if c.split == "test" else v0.arithmetic_rows(c.num_train, c.seed + 1,
                                                                 skip={r["question"] for r in test})
        for i, row in enumerate(rows):
            yield ArithTask(ArithData(idx=i, prompt=row["question"], answer=row["answer"]), self.config.task)


class SolveCheckConfig(vf.EnvConfig):
    solver: vf.AgentConfig = vf.AgentConfig()
    checker: vf.AgentConfig = vf.AgentConfig()


class SolveCheck(vf.Env[SolveCheckConfig]):
    async def setup(self, agents):
        agents.checker.trainable = False  # a fixed judge: served, never trained

    async def run(self, task, agents):
        solution = await agents.solver.run(task)
        if not solution.ok:  # a failed run is data on its trace; this Env cannot review it
            raise RuntimeError(f"the solver's run failed: {solution.last_error}")
        review = vf.TaskData(prompt=f"{task.data.prompt}\n{solution.last_reply}\nright?")
        await agents.checker.run(vf.Task(review))

    async def finalize(self, task, episode):
        by_agent = {t.agent.name: t for t in episode.traces}
        solver, checker = by_agent["solver"], by_agent["checker"]
        said_yes = checker.last_reply.strip().lower().startswith("y")
        correct = solver.rewards.get("correct_answer")
        solver.record_metric("checker_agrees", float(said_yes == (correct is not None and correct.score == 1.0)))


__all__ = ["ArithTaskset", "SolveCheck"]


def load_environment(split: str = "train", num_train: int = 400, num_eval: int = 100) -> SolveCheck:
    taskset = {"id": __name__, "split": split, "num_train": num_train, "num_eval": num_eval}
    return SolveCheck(SolveCheckConfig(taskset=taskset))


def teacher(agent, messages, row, rng, slip_rate: float = 0.0):
    """The solver's demonstration is the v0 example's (steps, then the boxed result; a slip boxes a near miss);
    the checker is never trained, so its demonstration is only what the episode needs to go on."""
    if agent == "Checker":
        return "yes"
    return v0.teacher(agent, messages, {"question": row["prompt"]}, rng, slip_rate)
