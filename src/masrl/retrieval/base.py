"""Passages, the ``Retriever`` protocol and how passages are shown to agents."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence, runtime_checkable


class RetrieverError(RuntimeError):
    """A retriever could not answer (server unreachable, bad response, ...)."""


@dataclass(slots=True)
class Passage:
    """One retrievable unit of text. ``score`` is set on search results (higher is better)."""

    id: str
    title: str
    text: str
    score: float | None = None

    @property
    def contents(self) -> str:
        """Search-R1 / FlashRAG layout: ``"Title"\\ntext`` (just ``text`` when untitled)."""
        return f'"{self.title}"\n{self.text}' if self.title else self.text

    def to_document(self) -> dict:
        """The JSON document of the Search-R1 retrieval API: ``{"id", "contents"}``."""
        return {"id": self.id, "contents": self.contents}

    def with_score(self, score: float) -> "Passage":
        return Passage(self.id, self.title, self.text, float(score))

    @classmethod
    def from_contents(cls, id: str, contents: str, score: float | None = None) -> "Passage":
        """Parse ``"Title"\\ntext`` (see ``split_contents``)."""
        title, text = split_contents(contents)
        return cls(str(id), title, text, score)


def split_contents(contents: str) -> tuple[str, str]:
    """``(title, text)`` of a Search-R1 ``contents`` string: the first line is the title (quotes
    removed) when there is more than one line; a single line is untitled text."""
    head, sep, rest = contents.strip().partition("\n")
    if not sep:
        return "", head.strip()
    head = head.strip()
    if len(head) >= 2 and head.startswith('"') and head.endswith('"'):
        head = head[1:-1]
    return head.strip(), rest.strip()


@runtime_checkable
class Retriever(Protocol):
    """Anything that returns the top-k passages of each query, best first.

    ``search(["q1", "q2"], topk=3)`` -> ``[[Passage, ...], [Passage, ...]]`` (one list per query,
    at most ``topk`` passages each, ``Passage.score`` set). Implementations: ``BM25Retriever``,
    ``DenseRetriever``, ``HybridRetriever``, ``HttpRetriever``.
    """

    def search(self, queries: list[str], topk: int) -> list[list[Passage]]: ...


class PassageIndex:
    """The shared front of a retriever over an in-memory list of ``passages`` (BM25, dense): no
    queries give no results, ``topk`` is capped to the corpus (a ``topk`` of 0 gives empty lists),
    and queries reach ``top`` as text. Subclasses implement ``top(queries, k)`` with ``1 <= k <=
    len(passages)``: the best ``k`` (or fewer) passages of each query, scores set."""

    passages: list[Passage]

    def __len__(self) -> int:
        return len(self.passages)

    def search(self, queries: Sequence[str], topk: int) -> list[list[Passage]]:
        if not queries:
            return []
        k = max(0, min(int(topk), len(self.passages)))
        if k == 0:
            return [[] for _ in queries]
        return self.top([str(q) for q in queries], k)

    def top(self, queries: list[str], k: int) -> list[list[Passage]]:
        raise NotImplementedError


def format_passages(passages: Sequence[Passage], template: str = "Doc {rank}: {contents}",
                    separator: str = "\n") -> str:
    """Render retrieved passages for a prompt, one line per passage (``{rank}`` starts at 1).

    Fields: ``{rank}``, ``{id}``, ``{title}``, ``{text}``, ``{contents}``. The default is the
    layout of the Dr. MAS / SkyRL search tool (``Doc 1: "Title"\\ntext``).
    """
    lines = []
    for rank, p in enumerate(passages, start=1):
        fields = {"rank": rank, "id": p.id, "title": p.title, "text": p.text, "contents": p.contents}
        lines.append(_fill(template, fields))
    return separator.join(lines)


def _fill(template: str, fields: dict) -> str:
    """Replace ``{name}`` for the given names in one pass (inserted text is never re-scanned)."""
    import re

    pattern = re.compile(r"\{(" + "|".join(map(re.escape, fields)) + r")\}")
    return pattern.sub(lambda m: str(fields[m.group(1)]), template)
