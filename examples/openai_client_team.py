"""The quickstart's Solver + Verifier team as an ordinary OpenAI-API program: the plain `openai` client, no masrl.

masrl trains it unchanged through its OpenAI-compatible gateway (docs/gateway.md, examples/openai_client_team.yaml):
every `chat.completions.create` is a recorded turn of the agent its `model` names. The Solver answers within
\\boxed{}; the Verifier replies <verify>approve</verify> or <verify>reject</verify>; on a rejection the Solver tries
again, up to MAX_LOOPS Solver turns. The prompts are the quickstart's (examples/quickstart.yaml), sent as one user
message, which the tiny model's chat template renders as the text itself: the prompt ids are the built-in
`math_solver_verifier` team's, token for token.

Result: the last solution, scored by the task's reward, and the ids of the completions that broke the format
(`invalid_calls`: a Solver reply without \\boxed{}, a Verifier reply without a verdict; masrl gives them the format
penalty, as the built-in team marks such turns invalid). A reply without a verdict counts as a rejection (the
quickstart's `untagged_verdict: reject`).

Against the built-in team (both cut to 100 SFT / 10 RL steps and 600 training tasks, seeds 0-2, on 2 shared cores):
the same cold start, held-out avg@4 after RL 6.9 +- 0.3 % against 5.5 +- 1.4 % (mean +- sd; both near the floor at
this budget); the gateway costs about 2.5 ms of CPU per call. How it was measured: "Example: the quickstart team as
an OpenAI-API program" in masrl's docs (docs/gateway.md in the source repository).

Needs the `openai` package: pip install 'masrl[openai]'.

Run by masrl as `entry: examples/openai_client_team.py:run` (in-process, async), or as a command, one process per
episode: `python examples/openai_client_team.py` reads the task as JSON on stdin, takes OPENAI_BASE_URL and
OPENAI_API_KEY from its environment and prints its result as JSON.
"""
import asyncio
import json
import re
import sys

import openai

MAX_LOOPS = 2
PROMPTS = {
    "Solver": "Q {question}\n{context}S ",
    "Verifier": "Q {question}\n{context}V ",
    "context": "{text}\n",
}
VERDICT = re.compile(r"<verify>(.*?)</verify>", re.DOTALL)


def fill(template: str, **fields: str) -> str:
    """``{name}`` placeholders filled in one pass (a ``\\boxed{}`` in a field is left as it is)."""
    return re.sub("{(" + "|".join(fields) + ")}", lambda m: fields[m.group(1)], template)


def boxed(text: str):
    """The content of the last ``\\boxed{...}`` with balanced braces, or None."""
    for start in reversed([m.end() for m in re.finditer(r"\\boxed", text)]):
        i = start
        while i < len(text) and text[i] == " ":
            i += 1
        if i < len(text) and text[i] == "{":
            depth = 0
            for j in range(i, len(text)):
                depth += {"{": 1, "}": -1}.get(text[j], 0)
                if depth == 0:
                    return text[i + 1:j].strip()
    return None


def verdict(text: str):
    """``approve`` / ``reject`` from the last ``<verify>...</verify>``, or None."""
    found = VERDICT.findall(text)
    choice = found[-1].strip().lower() if found else None
    return choice if choice in ("approve", "reject") else None


async def solve(client: openai.AsyncOpenAI, question: str) -> dict:
    context, answer, invalid = "", "", []

    async def ask(agent: str) -> str:
        prompt = fill(PROMPTS[agent], question=question, context=context)
        response = await client.chat.completions.create(model=agent, messages=[{"role": "user", "content": prompt}])
        text = response.choices[0].message.content or ""
        if (boxed(text) if agent == "Solver" else verdict(text)) is None:
            invalid.append(response.id)
        return text

    for loop in range(MAX_LOOPS):
        answer = await ask("Solver")
        context += fill(PROMPTS["context"], text=answer)
        if loop == MAX_LOOPS - 1:
            break
        review = await ask("Verifier")
        context += fill(PROMPTS["context"], text=review)
        if (verdict(review) or "reject") == "approve":
            break
    return {"answer": answer, "invalid_calls": invalid}


# one client (and connection pool) per event loop, shared by the episodes running in it; kept for the life of the
# process, as a pool can only be closed on its own loop
_CLIENTS: dict = {}


def client_for(client_kwargs: dict) -> openai.AsyncOpenAI:
    """The episode's client: the shared one with this episode's ``base_url`` / ``api_key``. Creating an
    ``AsyncOpenAI`` costs ~40 ms of CPU (its HTTP client); ``with_options`` reuses the pool."""
    loop = asyncio.get_running_loop()
    if loop not in _CLIENTS:
        # max_retries=0: a failed call fails the episode instead of being sent (and recorded) twice; timeout: masrl's
        # per-episode deadline bounds the episode (the client's own 5 s to connect fails episodes on a busy machine,
        # where the event loop that runs every episode gets to a connection late)
        _CLIENTS[loop] = openai.AsyncOpenAI(max_retries=0, timeout=300.0, **client_kwargs)
    return _CLIENTS[loop].with_options(**client_kwargs)


async def run(task: dict, client_kwargs: dict) -> dict:
    """One episode: ``task`` has ``question``; ``client_kwargs`` the episode's ``base_url`` and ``api_key``
    (empty: the OPENAI_* environment variables)."""
    return await solve(client_for(client_kwargs), task["question"])


if __name__ == "__main__":
    print(json.dumps(asyncio.run(run(json.loads(sys.stdin.readline()), {}))))
