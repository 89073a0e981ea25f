"""Client for a Search-R1-compatible retrieval server (ours: ``masrl serve-retriever``)."""
from __future__ import annotations

import logging
import time
from typing import Any

from masrl.errors import missing_extra
from masrl.retrieval.base import Passage, RetrieverError, split_contents

log = logging.getLogger(__name__)


class HttpRetriever:
    """``POST {url}`` with ``{"queries", "topk", "return_scores": true}``; parses ``{"result": [...]}``.

    ``url`` may be the server root (``http://127.0.0.1:8000``) or the endpoint
    (``.../retrieve``). Connection errors, timeouts and 5xx answers are retried ``retries``
    times with a growing delay; then ``RetrieverError`` says which URL failed and why.
    A 4xx answer is not retried (the request itself is wrong). Long query lists are sent in
    chunks of ``max_batch``.
    """

    name = "http"

    def __init__(self, url: str = "http://127.0.0.1:8000/retrieve", *, timeout: float = 30.0,
                 retries: int = 3, backoff: float = 0.5, max_batch: int = 64):
        url = url.rstrip("/")
        self.url = url if url.endswith("/retrieve") else url + "/retrieve"
        self.timeout, self.retries, self.backoff, self.max_batch = timeout, max(0, retries), backoff, max(1, max_batch)
        try:
            import httpx
        except ImportError:
            raise missing_extra("the retrieval server client needs httpx", "server") from None
        self._httpx = httpx
        self._client = httpx.Client(timeout=timeout)

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> "HttpRetriever":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def search(self, queries: list[str], topk: int) -> list[list[Passage]]:
        out: list[list[Passage]] = []
        for start in range(0, len(queries), self.max_batch):
            chunk = [str(q) for q in queries[start:start + self.max_batch]]
            result = self._post({"queries": chunk, "topk": int(topk), "return_scores": True})
            if not isinstance(result, list) or len(result) != len(chunk):
                raise RetrieverError(f"retriever at {self.url} returned {type(result).__name__} "
                                     f"for {len(chunk)} queries; expected one result list per query")
            out.extend(_parse_results(row, self.url) for row in result)
        return out

    def _post(self, payload: dict) -> Any:
        last_error = ""
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff * attempt)
            try:
                response = self._client.post(self.url, json=payload)
            except self._httpx.TimeoutException:
                last_error = f"timed out after {self.timeout:g} s"
                continue
            except self._httpx.TransportError as e:
                last_error = f"{type(e).__name__}: {e}"
                continue
            if response.status_code >= 500:
                last_error = f"HTTP {response.status_code}: {response.text[:200]}"
                continue
            if response.status_code >= 400:
                raise RetrieverError(f"retriever at {self.url} rejected the request: "
                                     f"HTTP {response.status_code}: {response.text[:500]}")
            try:
                return response.json()["result"]
            except (ValueError, KeyError, TypeError):
                raise RetrieverError(f"retriever at {self.url} answered without a JSON 'result' field: "
                                     f"{response.text[:200]!r}") from None
        raise RetrieverError(f"retriever at {self.url} unreachable after {self.retries + 1} attempt(s): "
                             f"{last_error}. Is the server running (masrl serve-retriever --corpus ...)?")


def _parse_results(row: Any, url: str) -> list[Passage]:
    """Accept ``[{"document": {...}, "score": s}, ...]`` and bare ``[{...document...}, ...]``."""
    if not isinstance(row, list):
        raise RetrieverError(f"retriever at {url}: a result must be a list of documents, got {type(row).__name__}")
    passages = []
    for i, item in enumerate(row):
        score = None
        doc = item
        if isinstance(item, dict) and isinstance(item.get("document"), dict):
            doc, score = item["document"], item.get("score")
        if not isinstance(doc, dict):
            raise RetrieverError(f"retriever at {url}: document {i} is {type(doc).__name__}, not an object")
        pid = str(doc.get("id", doc.get("doc_id", i)))
        if isinstance(doc.get("contents"), str):
            title, text = split_contents(doc["contents"])
        else:
            title, text = str(doc.get("title", "")), str(doc.get("text", doc.get("content", "")))
        passages.append(Passage(pid, title, text, float(score) if isinstance(score, (int, float)) else None))
    return passages
