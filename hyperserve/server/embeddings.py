"""/v1/embeddings: sentence embeddings from a small encoder served beside the generative models
(`hyperserve serve --embedding-model all-MiniLM-L6-v2`), as OpenAI's endpoint answers them.

The encoder runs on its own thread (common/embedder.py), so an embedding batch never waits for the
engine's step loop, nor the loop for it; on a small CPU they share the cores. An input longer than
the model's window is a 400 unless the request sets `truncate` (as Hugging Face's
text-embeddings-inference does), rather than an embedding of only its start.
"""

from __future__ import annotations

import base64
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from hyperserve.common.embedder import WINDOWS, Embedder
from hyperserve.common.errors import APIError
from hyperserve.server.metrics import ServerMetrics

MAX_INPUTS = 2048  # OpenAI's limit on the texts of one request


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
        texts = [value] if isinstance(value, str) else value
        if not texts:
            raise ValueError("give at least one text to embed")
        if len(texts) > MAX_INPUTS:
            raise ValueError(f"at most {MAX_INPUTS} inputs a request, got {len(texts)}")
        if any(not text for text in texts):
            raise ValueError("inputs must not be empty strings")
        return value

    def texts(self) -> list[str]:
        return [self.input] if isinstance(self.input, str) else self.input


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
        if request.model not in (None, self.name):
            raise APIError(404, f"the model {request.model!r} does not exist; embeddings come from {self.name!r}",
                           param="model", code="model_not_found")
        if request.dimensions is not None and request.dimensions != self.embedder.dim:
            raise APIError(400, f"{self.name} makes {self.embedder.dim}-dimensional embeddings; dimensions must be "
                                f"{self.embedder.dim} or unset", param="dimensions")
        if self.pending >= self.max_queue:
            raise APIError(429, f"the embedding model is overloaded ({self.pending} requests waiting); retry later",
                           type_="rate_limit_error", headers={"Retry-After": "1"})
        started = time.perf_counter()
        texts = request.texts()
        self.pending += 1
        try:
            counts = await self.embedder.token_counts_async(texts)
            too_long = [i for i, count in enumerate(counts) if count > self.window]
            if too_long and not request.truncate:
                i = too_long[0]
                raise APIError(400, f"input {i} has {counts[i]} tokens, over {self.name}'s window of {self.window}; "
                                    "shorten it or set truncate: true to embed its first tokens", param="input",
                               code="context_length_exceeded")
            vectors = await self.embedder.embed_async(texts)
        finally:
            self.pending -= 1
        tokens = sum(min(count, self.window) for count in counts)
        if self.metrics is not None:
            self.metrics.prompt_tokens.labels(self.name).inc(tokens)
            self.metrics.e2e.labels(self.name).observe(time.perf_counter() - started)
        data = [{"object": "embedding", "index": i,
                 "embedding": base64.b64encode(vector.astype("<f4").tobytes()).decode()
                 if request.encoding_format == "base64" else vector.tolist()}
                for i, vector in enumerate(vectors)]
        return {"object": "list", "data": data, "model": self.name,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
