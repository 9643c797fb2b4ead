"""/v1/embeddings: sentence embeddings from a small encoder served beside the generative models
(`hyperserve serve --embedding-model all-MiniLM-L6-v2`), as OpenAI's endpoint answers them; and
from the same embeddings, vLLM's /v1/score (text pairs) and /v1/rerank (documents by relevance to a
query, as Jina's and Cohere's rerank APIs answer), each score the cosine similarity of the two
texts' embeddings, as vLLM scores with an embedding model.

The encoder runs on its own thread (common/embedder.py), so an embedding batch never waits for the
engine's step loop, nor the loop for it; on a small CPU they share the cores. An input longer than
the model's window is a 400 unless the request sets `truncate` (as Hugging Face's
text-embeddings-inference does), rather than an embedding of only its start.
"""

from __future__ import annotations

import base64
import time
import uuid
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator

from hyperserve.common.embedder import WINDOWS, Embedder
from hyperserve.common.errors import APIError
from hyperserve.server.metrics import ServerMetrics

MAX_INPUTS = 2048  # OpenAI's limit on the texts of one request


def _texts(value: str | list[str], name: str) -> list[str]:
    texts = [value] if isinstance(value, str) else value
    if not texts:
        raise ValueError(f"{name}: give at least one text")
    if len(texts) > MAX_INPUTS:
        raise ValueError(f"{name}: at most {MAX_INPUTS} texts a request, got {len(texts)}")
    if any(not text for text in texts):
        raise ValueError(f"{name}: texts must not be empty strings")
    return texts


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = Field(default=None, max_length=256)
    input: str | list[str]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = Field(default=None, max_length=1024)
    truncate: bool = False  # cut inputs longer than the window instead of refusing them

    @field_validator("input")
    @classmethod
    def _check_input(cls, value: str | list[str]) -> str | list[str]:
        _texts(value, "input")
        return value

    def texts(self) -> list[str]:
        return [self.input] if isinstance(self.input, str) else self.input


class ScoreRequest(BaseModel):
    """vLLM's /v1/score: text_1 against each of text_2 (one to many), or pair by pair (as many each)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = Field(default=None, max_length=256)
    text_1: str | list[str]
    text_2: str | list[str]
    truncate: bool = False

    def pairs(self) -> list[tuple[str, str]]:
        first, second = _texts(self.text_1, "text_1"), _texts(self.text_2, "text_2")
        if len(first) == 1:
            return [(first[0], text) for text in second]
        if len(first) != len(second):
            raise ValueError(f"text_1 and text_2 must hold as many texts, or text_1 one; got {len(first)} "
                             f"and {len(second)}")
        return list(zip(first, second))


class RerankDocument(BaseModel):
    text: str


class RerankRequest(BaseModel):
    """Jina's and Cohere's /rerank, as vLLM serves it: the documents in order of relevance to the query."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = Field(default=None, max_length=256)
    query: str = Field(min_length=1)
    documents: list[str | RerankDocument] = Field(min_length=1, max_length=MAX_INPUTS)
    top_n: int | None = Field(default=None, ge=1)
    return_documents: bool = True
    truncate: bool = False

    def texts(self) -> list[str]:
        return _texts([d if isinstance(d, str) else d.text for d in self.documents], "documents")


class EmbeddingServing:
    """One embedding model, served under its name. `max_queue`: requests waiting for the encoder
    beyond which new ones get 429."""

    def __init__(self, name: str, max_queue: int, metrics: ServerMetrics | None = None) -> None:
        self.name = name
        self.window = WINDOWS[name]
        self.embedder = Embedder(name, max_length=self.window, prefix="")  # e5 users send their own prefixes
        self.max_queue = max_queue
        self.metrics = metrics
        self.pending = 0

    def card(self) -> dict[str, Any]:
        return {"id": self.name, "object": "model", "created": int(time.time()), "owned_by": "hyperserve",
                "loaded": True, "on_demand": False, "task": "embed", "max_model_len": self.window,
                "dimensions": self.embedder.dim}

    async def embed(self, request: EmbeddingRequest) -> dict[str, Any]:
        self._check_model(request.model)
        if request.dimensions is not None and request.dimensions != self.embedder.dim:
            raise APIError(400, f"{self.name} makes {self.embedder.dim}-dimensional embeddings; dimensions "
                                f"must be {self.embedder.dim} or unset", param="dimensions")
        vectors, tokens = await self._vectors(request.texts(), request.truncate, "input")
        data = [{"object": "embedding", "index": i,
                 "embedding": base64.b64encode(vector.astype("<f4").tobytes()).decode()
                 if request.encoding_format == "base64" else vector.tolist()}
                for i, vector in enumerate(vectors)]
        return {"object": "list", "data": data, "model": self.name,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    async def score(self, request: ScoreRequest) -> dict[str, Any]:
        self._check_model(request.model)
        pairs = _checked(request.pairs, "text_2")
        firsts = list(dict.fromkeys(a for a, _ in pairs))  # a one-to-many request embeds its text_1 once
        vectors, tokens = await self._vectors(firsts + [b for _, b in pairs], request.truncate, "text_1")
        first = {text: vectors[i] for i, text in enumerate(firsts)}
        scores = [float(np.dot(first[a], vectors[len(firsts) + i])) for i, (a, _) in enumerate(pairs)]
        return {"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                "model": self.name,
                "data": [{"index": i, "object": "score", "score": score} for i, score in enumerate(scores)],
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    async def rerank(self, request: RerankRequest) -> dict[str, Any]:
        self._check_model(request.model)
        documents = _checked(request.texts, "documents")
        vectors, tokens = await self._vectors([request.query, *documents], request.truncate, "documents")
        scores = vectors[1:] @ vectors[0]
        order = sorted(range(len(documents)), key=lambda i: -scores[i])[: request.top_n]
        results = [{"index": i, "relevance_score": float(scores[i]),
                    **({"document": {"text": documents[i]}} if request.return_documents else {})}
                   for i in order]
        return {"id": f"rerank-{uuid.uuid4().hex}", "model": self.name, "results": results,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    def _check_model(self, model: str | None) -> None:
        if model not in (None, self.name):
            raise APIError(404, f"the model {model!r} does not exist; embeddings come from {self.name!r}",
                           param="model", code="model_not_found")

    async def _vectors(self, texts: list[str], truncate: bool, param: str) -> tuple[np.ndarray, int]:
        """Unit-length embeddings of the texts and the tokens they took; 400 for a text over the
        window unless `truncate`, 429 while the encoder's queue is full."""
        if self.pending >= self.max_queue:
            raise APIError(429, f"the embedding model is overloaded ({self.pending} requests waiting); "
                           "retry later", type_="rate_limit_error", headers={"Retry-After": "1"})
        started = time.perf_counter()
        self.pending += 1
        try:
            counts = await self.embedder.token_counts_async(texts)
            too_long = [i for i, count in enumerate(counts) if count > self.window]
            if too_long and not truncate:
                i, noun = too_long[0], "input" if param == "input" else "text"
                raise APIError(400, f"{noun} {i} has {counts[i]} tokens, over {self.name}'s window of "
                                    f"{self.window}; shorten it or set truncate: true to embed its first "
                                    "tokens", param=param, code="context_length_exceeded")
            vectors = await self.embedder.embed_async(texts)
        finally:
            self.pending -= 1
        tokens = sum(min(count, self.window) for count in counts)
        if self.metrics is not None:
            self.metrics.prompt_tokens.labels(self.name).inc(tokens)
            self.metrics.e2e.labels(self.name).observe(time.perf_counter() - started)
        return vectors, tokens


def _checked(texts, param: str):
    """texts() of a request, its ValueError a 400 naming `param`."""
    try:
        return texts()
    except ValueError as error:
        raise APIError(400, str(error), param=param) from error
