"""OpenAI request and response shapes (the subset we serve), as pydantic models.

Every field a client controls is typed and bounded here, so the engine only sees values it can
run: numbers within their ranges (no NaN or infinity), seeds in [0, 2**63), at most 20 logprobs,
logit_bias within [-100, 100], content parts of type text, known roles. What needs the model
(token ids within its vocabulary, lengths against its context) is checked by OpenAIServing.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from hyperserve.common.messages import message_text
from hyperserve.sampling_params import SamplingParams


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class StreamOptions(BaseModel):
    include_usage: bool = False


_INT32 = 2**31


class _SamplingRequest(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions, with vLLM's extras."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str | None = Field(default=None, max_length=256)
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    n: int = Field(default=1, ge=1, le=128)
    best_of: int | None = Field(default=None, ge=1, le=128)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = Field(default=None, max_length=16)
    seed: int | None = Field(default=None, ge=0, lt=SamplingParams.MAX_SEED)
    presence_penalty: float = Field(default=0.0, ge=-2, le=2)
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2)
    logit_bias: dict[str, float] | None = Field(default=None, max_length=1024)
    user: str | None = Field(default=None, max_length=1024)
    # vLLM extras
    top_k: int | None = Field(default=None, ge=-1, lt=_INT32)
    min_p: float | None = Field(default=None, ge=0, le=1)
    repetition_penalty: float | None = Field(default=None, ge=0.01, le=10)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = Field(default=None, max_length=64)
    priority: int = Field(default=0, ge=-_INT32, lt=_INT32)
    skip_special_tokens: bool = True

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        """Keys must parse as token ids; SamplingParams bounds the values, the engine the ids."""
        for token in bias or {}:
            if not token.strip().isdigit():
                raise ValueError(f"keys are token ids (as strings of digits), got {token!r}")
        return bias

    @model_validator(mode="after")
    def _check_best_of(self) -> _SamplingRequest:
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of other than n is not supported: ask for n samples and pick among them")
        return self

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        return SamplingParams(
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            min_p=self.min_p or 0.0,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty or 1.0,
            seed=self.seed,
            max_tokens=max_tokens,
            stop=self.stop or [],
            stop_token_ids=self.stop_token_ids or [],
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
            logit_bias={int(token): value for token, value in (self.logit_bias or {}).items()},
        )


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=SamplingParams.MAX_LOGPROBS)
    echo: bool = False

    @model_validator(mode="after")
    def _check(self) -> CompletionRequest:
        if isinstance(self.prompt, list) and not self.prompt:
            raise ValueError("prompt must not be empty")
        if self.echo:
            raise ValueError("echo is not supported")
        return self

    def prompts(self) -> list[str | list[int]]:
        if isinstance(self.prompt, str):
            return [self.prompt]
        if all(isinstance(p, int) for p in self.prompt):
            return [list(self.prompt)]
        return list(self.prompt)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None

    @field_validator("content")
    @classmethod
    def _text_only(cls, content: str | list[dict[str, Any]] | None) -> str | list[dict[str, Any]] | None:
        message_text(content)  # only text parts are served: anything else is a ValueError that names it
        return content

    def for_template(self) -> dict[str, str]:
        """As a chat template takes it; `developer` is OpenAI's newer name for `system`."""
        return {"role": "system" if self.role == "developer" else self.role, "content": message_text(self.content)}


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=SamplingParams.MAX_LOGPROBS)

    @model_validator(mode="after")
    def _check_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs set to true")
        return self


class CacheRequest(BaseModel):
    """POST /v1/cache: pin the KV of a prompt (or of messages rendered without a generation
    prompt, e.g. a system message) for `ttl` seconds."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str | None = None
    prompt: str | list[int] | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    ttl: float = Field(default=300, gt=0)  # at most the server's --max-pin-ttl-s

    @model_validator(mode="after")
    def _check(self) -> CacheRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        return self


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())
