"""SamplingParams: what a request asks of the sampler and the stop checker."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Thinking:
    """A reasoning model's thinking, which a constraint lets through before it applies: free text up
    to the token `end_id` (</think>). `open`: the prompt opened it, so the output starts inside it;
    otherwise the first token may open it (`start_id`, <think>) or begin the constrained answer."""

    start_id: int
    end_id: int
    open: bool = False


@dataclass(frozen=True)
class StructuredOutputs:
    """A constraint on the output, enforced token by token (engine/structured_output.py).

    Exactly one of: `json` (a JSON schema, as a dict or its text), `json_object` (any JSON
    object), `regex`, `choice` (one of these strings), `grammar` (GBNF, as llama.cpp writes it, or
    Lark as llguidance reads it). The names are vLLM's `guided_*` without the prefix. `thinking`:
    where a reasoning model thinks first, the constraint applies from after its thinking.
    """

    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    thinking: Thinking | None = None

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError(f"give exactly one structured output constraint, got {given or 'none'}")
        if self.choice is not None:
            if not self.choice or not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError("choice must be a non-empty list of non-empty strings")
            object.__setattr__(self, "choice", tuple(self.choice))

    @property
    def key(self) -> tuple[str, str]:
        """(kind, canonical text): equal constraints compile once."""
        if self.json is not None:
            schema = json.loads(self.json) if isinstance(self.json, str) else self.json
            return "json", json.dumps(schema)  # key order kept: properties are generated in it
        if self.json_object:
            return "json", '{"type": "object"}'
        if self.regex is not None:
            return "regex", self.regex
        if self.choice is not None:
            return "choice", json.dumps(list(self.choice))
        return "grammar", self.grammar


@dataclass
class SamplingParams:
    """Per-request sampling parameters, named and defaulted as in vLLM and the OpenAI API.

    temperature=0 is greedy. top_k <= 0 and top_p=1 disable those filters. `seed` makes the
    request's samples reproducible whatever else shares its batch.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: until the context is full
    min_tokens: int = 0  # before this many output tokens, no EOS, stop token or stop string ends the answer
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N log-probabilities per generated token (the sampled one too)
    # top-N log-probabilities per prompt token after the first (the prompt's own token too): its prompt is
    # computed whole, not read from the prefix cache, and only the first of n samples reports them
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit, as OpenAI's
    allowed_token_ids: list[int] | None = None  # the only tokens that may be sampled (None: all)
    structured_outputs: StructuredOutputs | None = None  # JSON schema, regex, choice or grammar
    # the answer expected, as text or token ids (OpenAI's Predicted Outputs: the file being edited):
    # where the answer follows it, its next tokens are verified in one step. The answer is the same.
    prediction: str | list[int] | None = None

    MAX_LOGPROBS = 20  # OpenAI's bound on top_logprobs
    MAX_SEED = 2**63  # seeds are in [0, MAX_SEED): a torch generator takes them (plus the sample index)
    MAX_LOGIT_BIAS = 100.0  # OpenAI's range, [-100, 100]

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or []) if s]
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not -2 <= self.presence_penalty <= 2:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2 <= self.frequency_penalty <= 2:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be positive, got {self.repetition_penalty}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not 0 <= self.min_tokens <= (self.max_tokens if self.max_tokens is not None else self.min_tokens):
            raise ValueError(f"min_tokens must be in [0, max_tokens], got {self.min_tokens}")
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise ValueError("allowed_token_ids must not be empty")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= self.MAX_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {self.MAX_LOGPROBS}], got {value}")
        if self.seed is not None and not 0 <= self.seed < self.MAX_SEED:
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 or 0 (disabled) or positive, got {self.top_k}")
        for token_id, bias in self.logit_bias.items():
            if not -self.MAX_LOGIT_BIAS <= bias <= self.MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias} for token {token_id}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0
            or self.frequency_penalty != 0
            or self.repetition_penalty != 1
        )
