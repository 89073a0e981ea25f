"""A judge behind an OpenAI-compatible ``POST {base_url}/chat/completions`` endpoint (httpx).

Each call has a deadline on the whole call (``timeout_s``: connect, send, and the whole reply, however slowly it
comes; run through ``masrl.usercode.calls.call_in_thread``, kind ``judge``) and is retried with exponential
backoff on a timeout, a connection error, HTTP 429 or 5xx; other HTTP errors and replies without ``choices[0].message.content``
are errors at once. With verdict ``yes_prob`` each call asks for one token with ``logprobs`` and
``top_logprobs: 20`` and reads the probabilities of yes and no among them (a reply without logprobs is an
error: the endpoint must support them, as vLLM and the OpenAI API do). ``max_calls_per_step`` caps the calls of one step (the rest are errors). The key is
read from the environment variable ``api_key_env`` when the judge is built and kept only in the request
headers: it is never logged, never in an error message, never in the run folder.
"""
from __future__ import annotations

import json
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

from masrl.errors import ConfigError, missing_extra
from masrl.judges.backends import NO_REPLY, Reply
from masrl.judges.config import RemoteOptions
from masrl.judges.verdicts import top_logprob_masses
from masrl.usercode.calls import UserCodeTimeout, call_in_thread

MAX_REPLY_BYTES = 16 << 20  # a judge's reply larger than this is an error (a reply is a few kB)

_RETRY_STATUS = {408, 409, 429, 500, 502, 503, 504}


class RemoteJudge:
    def __init__(self, opts: RemoteOptions, *, system_prompt: str | None, max_new_tokens: int):
        try:
            import httpx
        except ImportError:
            raise missing_extra("a remote judge (task.params.reward.judge.remote) needs httpx", "judge") from None
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
        """``(reply, error, worth retrying)``: one request, with a deadline on the whole of it."""
        deadline = time.monotonic() + self.opts.timeout_s
        try:
            status, raw = call_in_thread(self._post, (body, deadline), self.opts.timeout_s, kind="judge",
                                         what=f"judge {self.url}")
        except (UserCodeTimeout, _Late):
            return None, f"{NO_REPLY} {self.opts.timeout_s:g} s", True
        except self._httpx.TimeoutException:
            return None, f"{NO_REPLY} {self.opts.timeout_s:g} s", True
        except self._httpx.HTTPError as e:
            return None, f"{type(e).__name__}: {str(e)[:200]}", True
        except _TooLarge:
            return None, f"a reply of more than {MAX_REPLY_BYTES} bytes", False
        text = raw.decode("utf-8", "replace")
        if status != 200:
            return None, f"HTTP {status}: {text[:200]!r}", status in _RETRY_STATUS
        try:
            data = json.loads(raw)
            content = data["choices"][0]["message"]["content"]
        except (ValueError, KeyError, IndexError, TypeError):
            return None, f"not a chat completion: {text[:200]!r}", False
        if not isinstance(content, str):
            return None, f"not a chat completion: {text[:200]!r}", False
        if not probabilities:
            return Reply(content), "", False
        try:
            top = data["choices"][0]["logprobs"]["content"][0]["top_logprobs"]
        except (KeyError, IndexError, TypeError):
            return None, ("no logprobs in the reply (verdict yes_prob needs an endpoint that returns "
                          f"top_logprobs): {text[:200]!r}"), False
        try:
            p_yes, p_no = top_logprob_masses(top)
        except (AttributeError, KeyError, TypeError, ValueError) as e:
            return None, f"unusable top_logprobs in the reply ({e}): {text[:200]!r}", False
        return Reply(content, p_yes=p_yes, p_no=p_no), "", False

    def _post(self, body: dict, deadline: float) -> tuple[int, bytes]:
        """``(status, body bytes)`` of one POST; ``_Late`` once ``deadline`` passes while the reply still
        comes (so that a call given up by its caller ends soon, however slowly the server sends)."""
        chunks, size = [], 0
        with self._client.stream("POST", self.url, json=body) as response:
            for chunk in response.iter_bytes():
                chunks.append(chunk)
                size += len(chunk)
                if size > MAX_REPLY_BYTES:
                    raise _TooLarge()
                if time.monotonic() > deadline:
                    raise _Late()
            return response.status_code, b"".join(chunks)

    def close(self) -> None:
        self._client.close()


class _Late(Exception):
    """The reply was still coming at the call's deadline."""


class _TooLarge(Exception):
    """The reply is larger than ``MAX_REPLY_BYTES``."""
