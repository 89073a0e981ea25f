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


def teacher(agent, messages, row, rng, slip_rate: float = 0.0):
    """A demonstration: bisect the range the answers so far leave (a slip guesses anywhere in it)."""
    low, high = int(row.get("low", 1)), int(row.get("high", 9))
    guesses = [m for m in messages if m.get("role") == "assistant" and m.get("tool_calls")]
    replies = [m.get("content") for m in messages if m.get("role") == "tool"]
    for call, reply in zip(guesses, replies):
        n = _guessed(call["tool_calls"][0])
        if reply == "higher":
            low = max(low, n + 1)
        elif reply == "lower":
            high = min(high, n - 1)
    if high < low:
        low, high = int(row.get("low", 1)), int(row.get("high", 9))
    n = rng.randint(low, high) if rng.random() < slip_rate else (low + high) // 2
    return {"name": "guess", "arguments": {"n": n}}


def _guessed(call: dict) -> int:
    import json

    arguments = call.get("function", call).get("arguments")
    arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
    return int(arguments["n"])
