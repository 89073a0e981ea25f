"""A small puzzle in the shape of TRL's `environment_factory` / OpenEnv: guess the hidden number with a tool.

One `GuessNumber` per episode: `reset(target=...)` takes the row, the public method `guess` is the agent's tool
(its docstring's `Args:` is the schema), `reward` is 1.0 once the number is found and 0 before, `done` ends the
episode. The agent has `max_turns` calls; each guess is answered "higher", "lower" or "correct".

    masrl train examples/tool_env_guess.yaml
"""


class GuessNumber:
    def __init__(self):
        self.target, self.guesses, self.done = None, 0, False

    def reset(self, target: int, low: int = 1, high: int = 9, **row) -> str:
        self.target, self.low, self.high = int(target), low, high
        self.guesses, self.done = 0, False
        return f"The number is between {low} and {high}."

    def guess(self, n: int) -> str:
        """Guess the hidden number.

        Args:
            n: the number guessed
        """
        if self.done:
            raise ValueError("the number was already found")
        self.guesses += 1
        if n == self.target:
            self.done = True
            return "correct"
        return "higher" if n < self.target else "lower"

    @property
    def reward(self) -> float:
        return 1.0 if self.done else 0.0


def train_rows() -> list[dict]:
    return [{"prompt": "Find the hidden number. Call guess(n).", "target": t} for t in range(1, 10)] * 8


def test_rows() -> list[dict]:
    return [{"prompt": "Find the hidden number. Call guess(n).", "target": t, "id": t} for t in range(1, 10)]
