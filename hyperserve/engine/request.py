"""Request: one sequence's scheduling state.

There are no prefill and decode phases: a request has `num_tokens` (prompt + generated) and
`num_computed_tokens` (those whose KV is in the cache). The scheduler closes the gap a chunk at a
time; a token is sampled whenever a step brings the two counts level. Preemption sets
`num_computed_tokens` back to 0 and the prompt plus everything generated so far is recomputed.
"""

from __future__ import annotations

import array
import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from hyperserve.outputs import RequestMetrics, TokenLogprobs
from hyperserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch

    from hyperserve.engine.detokenizer import IncrementalDetokenizer
    from hyperserve.engine.structured_output import Grammar
    from hyperserve.layers.lora import LoRARequest


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"  # the engine failed while running it; its client gets an error

    @property
    def is_finished(self) -> bool:
        return self not in (RequestStatus.WAITING, RequestStatus.RUNNING)


@dataclass(slots=True)
class Acceptance:
    """A request's acceptance rate per proposed token, with old steps decaying (prior: 0.7)."""

    accepted: float = 1.4
    trials: float = 2.0
    steps_without: int = 0  # decode steps since it last speculated

    def observe(self, num_drafts: int, num_accepted: int) -> None:
        # Tokens after the first rejection were never tried: a rejection is one trial.
        trials = num_accepted + (num_accepted < num_drafts)
        self.accepted = 0.9 * self.accepted + num_accepted
        self.trials = 0.9 * self.trials + trials

    @property
    def rate(self) -> float:
        return min(self.accepted / self.trials, 0.99)


@dataclass(slots=True)
class Prediction:
    """The answer a request expects, as OpenAI's Predicted Outputs take it (a file being edited, a
    document being corrected): where the answer follows it, its next tokens are drafted and verified
    in one step (engine/speculative.py). `cursor`: where in it the answer stood at the last lookup."""

    token_ids: list[int]
    cursor: int = 0
    data: bytes = field(init=False)  # the ids as 4-byte integers, searched with bytes.find

    def __post_init__(self) -> None:
        self.data = array.array("i", self.token_ids).tobytes()


@dataclass
class SpecDecodeStats:
    num_drafts: int = 0  # verification steps of a request with at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # where drafts came from (Proposal.source) -> [draft tokens, accepted tokens]
    by_source: dict[str, list[int]] = field(default_factory=dict)

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verification step: accepted drafts plus the one the target adds."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0



@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    eos_token_ids: frozenset[int] = frozenset()  # every token that ends generation (Llama 3 has several)
    priority: int = 0  # lower runs first
    parent_id: str | None = None  # set for the samples of an n > 1 request
    index: int = 0  # which of the parent's n samples
    seed: int | None = None
    wait_for: Request | None = None  # start after this request has computed its prompt (n > 1)
    pin_until: float | None = None  # on finishing, keep the prompt's KV cached until then
    lora_request: LoRARequest | None = None  # the adapter it runs with (None: the base model)
    cache_salt: bytes = b""  # starts its prefix-cache hash chain: KV differs per adapter, and per tenant
    scope: str = ""  # the tenant (cache_salt as given): whose earlier answers n-gram drafts may come from

    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(init=False)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # per prompt token; the first has none
    detokenizer: IncrementalDetokenizer | None = None
    grammar: Grammar | None = None  # structured output: where the output stands in its grammar
    metrics: RequestMetrics = field(init=False)
    # Speculative decoding: draft tokens to verify next step (positions num_tokens, num_tokens + 1, ...),
    # their draft distributions (None: deterministic proposals), how many leading tokens have KV in a
    # separate draft model's cache, the request's acceptance rate, and the rate the drafts' outcome
    # updates (the request's own, or the n-gram proposer's for the length of the match they continue).
    spec_token_ids: list[int] = field(default_factory=list)
    spec_probs: torch.Tensor | None = None
    draft_num_computed: int = 0
    acceptance: Acceptance = field(default_factory=Acceptance)
    spec_acceptance: Acceptance | None = None
    spec_source: str = ""  # where the pending drafts came from (Proposal.source)
    prediction: Prediction | None = None  # the answer it expects (drafted where the answer follows it)

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)
        self.metrics = RequestMetrics(arrival_time=self.arrival_time)
        if self.sampling_params.logprobs is not None:
            self.logprobs = []
        if self.sampling_params.prompt_logprobs is not None and self.index == 0:
            self.prompt_logprobs = [None]

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Whether prompt tokens' log-probabilities are still to come: the prompt is then computed,
        not read from the prefix cache."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.is_finished else None

    def is_stop_token(self, token_id: int) -> bool:
        """EOS (unless ignored) or one of the request's stop_token_ids: ends it, never shown as text."""
        params = self.sampling_params
        return token_id in params.stop_token_ids or (token_id in self.eos_token_ids and not params.ignore_eos)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def discard_output_after(self, num_output_tokens: int) -> None:
        """Drop output tokens past the first `num_output_tokens` (received beyond a stop string)."""
        del self.output_token_ids[num_output_tokens:]
        del self.all_token_ids[self.num_prompt_tokens + num_output_tokens :]
