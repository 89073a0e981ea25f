"""A judge behind an OpenAI-compatible ``POST {base_url}/chat/completions`` endpoint (httpx).

Each call has a deadline (``timeout_s``) and is retried with exponential backoff on a timeout, a
connection error, HTTP 429 or 5xx; other HTTP errors and replies without ``choices[0].message.content``
are errors at once. With verdict ``yes_prob`` each call asks for one token with ``logprobs`` and
``top_logprobs: 20`` and reads the probabilities of yes and no among them (a reply without logprobs is an
error: the endpoint must support them, as vLLM and the OpenAI API do). ``max_calls_per_step`` caps the calls of one step (the rest are errors). The key is
read from the environment variable ``api_key_env`` when the judge is built and kept only in the request
headers: it is never logged, never in an error message, never in the run folder.
"""
from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

from masrl.errors import ConfigError
from masrl.judges.backends import Reply
from masrl.judges.config import RemoteOptions
from masrl.judges.verdicts import top_logprob_masses

_RETRY_STATUS = {408, 409, 429, 500, 502, 503, 504}


class RemoteJudge:
    def __init__(self, opts: RemoteOptions, *, system_prompt: str | None, max_new_tokens: int):
        try:
            import httpx
        except ImportError:
            raise ImportError("a remote judge (task.params.reward.judge.remote) needs httpx: pip install masrl[judge]") from None
        self.opts, self.system_prompt, self.max_new_tokens = opts, system_prompt, max_new_tokens
        self.url = opts.base_url.rstrip("/") + "/chat/completions"
        self.endpoint = self.url
        headers = {"Content-Type": "application/json"}
        if opts.api_key_env:
            key = os.environ.get(opts.api_key_env)
            if not key:
                raise ConfigError(f"task.params.reward.judge.remote: environment variable {opts.api_key_env} is "
                                  "not set (the API key); set it, or api_key_env: null for an endpoint without a key")
            headers["Authorization"] = f"Bearer {key}"
        self._httpx = httpx
        self._client = httpx.Client(headers=headers, timeout=httpx.Timeout(opts.timeout_s))
        self._lock = threading.Lock()
        self.calls_this_step = 0

    def new_step(self) -> None:
        self.calls_this_step = 0

    def _take_budget(self) -> bool:
        with self._lock:
            if self.opts.max_calls_per_step is not None and self.calls_this_step >= self.opts.max_calls_per_step:
                return False
            self.calls_this_step += 1
            return True

    def complete(self, prompts: Sequence[str]) -> list[Reply]:
        return self._map(prompts, probabilities=False)

    def yes_probabilities(self, prompts: Sequence[str]) -> list[Reply]:
        return self._map(prompts, probabilities=True)

    def _map(self, prompts: Sequence[str], probabilities: bool) -> list[Reply]:
        if not prompts:
            return []
        with ThreadPoolExecutor(max_workers=min(self.opts.concurrency, len(prompts))) as pool:
            return list(pool.map(lambda p: self._one(p, probabilities), prompts))

    def _one(self, prompt: str, probabilities: bool = False) -> Reply:
        if not self._take_budget():
            return Reply(None, f"call budget of {self.opts.max_calls_per_step} per step exhausted")
        messages = ([{"role": "system", "content": self.system_prompt}] if self.system_prompt else []) + \
            [{"role": "user", "content": prompt}]
        body = {"model": self.opts.model, "messages": messages, "temperature": 0.0,
                "max_tokens": self.max_new_tokens}
        if probabilities:
            body.update(max_tokens=1, logprobs=True, top_logprobs=20)
        delay, error = self.opts.backoff_s, "no attempt"
        for attempt in range(self.opts.retries + 1):
            if attempt:
                time.sleep(delay)
                delay *= 2
            reply, error, retry = self._attempt(body, probabilities)
            if reply is not None:
                return reply
            if not retry:
                break
        return Reply(None, error)

    def _attempt(self, body: dict, probabilities: bool = False) -> tuple[Reply | None, str, bool]:
        """``(reply, error, worth retrying)``."""
        httpx = self._httpx
        try:
            response = self._client.post(self.url, json=body)
        except httpx.TimeoutException:
            return None, f"no reply within {self.opts.timeout_s:g} s", True
        except httpx.HTTPError as e:
            return None, f"{type(e).__name__}: {str(e)[:200]}", True
        if response.status_code != 200:
            return None, f"HTTP {response.status_code}: {response.text[:200]!r}", \
                response.status_code in _RETRY_STATUS
        try:
            content = response.json()["choices"][0]["message"]["content"]
        except (ValueError, KeyError, IndexError, TypeError):
            return None, f"not a chat completion: {response.text[:200]!r}", False
        if not isinstance(content, str):
            return None, f"not a chat completion: {response.text[:200]!r}", False
        if not probabilities:
            return Reply(content), "", False
        try:
            top = response.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"]
            p_yes, p_no = top_logprob_masses(top)
        except (KeyError, IndexError, TypeError, ValueError):
            return None, ("no logprobs in the reply (verdict yes_prob needs an endpoint that returns "
                          f"top_logprobs): {response.text[:200]!r}"), False
        return Reply(content, p_yes=p_yes, p_no=p_no), "", False

    def close(self) -> None:
        self._client.close()
