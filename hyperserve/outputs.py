"""What the engine hands back: RequestOutput with one CompletionOutput per sample (n)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class Logprob:
    logprob: float
    rank: int  # 1 = most likely
    decoded_token: str


# Per generated token: {token_id: Logprob} holding the top-N and the sampled token.
TokenLogprobs = dict[int, Logprob]


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    num_disk_cached_tokens: int = 0  # of which the disk tier supplied
    num_draft_tokens: int = 0  # speculative decoding: tokens proposed for this request
    num_accepted_tokens: int = 0  # of which the target accepted
    num_prediction_tokens: int = 0  # of the proposed tokens, those from the request's prediction
    num_accepted_prediction_tokens: int = 0  # of which the target accepted


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: str | int | None = None  # the stop string or token id that ended it
    logprobs: list[TokenLogprobs] | None = None
    cumulative_logprob: float | None = None  # beam search: the answer's summed log-probability

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """Cumulative state of one request; streamed once per step in which it made progress."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(arrival_time=0.0))
    error: str | None = None  # set when the engine failed while running the request
    # SamplingParams.prompt_logprobs: one per prompt token
    prompt_logprobs: list[TokenLogprobs | None] | None = None
