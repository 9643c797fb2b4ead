"""Beam search over the engine, as vLLM runs it: above the scheduler, one token a round.

Each round, every live beam of a prompt is a one-token request whose prompt is the beam so far
(the prefix cache holds its KV but for the last partial block); its top 2 x width log-probabilities
are the beam's candidates. The rest is transformers' beam search (`generate(num_beams=...)`, its
default `early_stopping=False`), so that the two give the same answers:
- of all the beams' candidates, the 2 x width likeliest (by cumulative log-probability) are kept;
- those among the first width that end in an EOS token, or reach max_tokens, are hypotheses,
  scored by their cumulative log-probability over (their length, the EOS included) **
  length_penalty; the best width hypotheses are kept;
- the first width of the others are the next round's beams;
- the search ends after max_tokens rounds, or once width hypotheses are kept and the best live
  beam, scored at its length, is no better than the worst of them.
The answers are the hypotheses, best first.

BeamSearch is the state of one prompt's search, plain Python over token ids; the offline API
(LLM.beam_search) and the server (`use_beam_search`) drive it, each round a batch of requests.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hyperserve.outputs import CompletionOutput, RequestOutput
from hyperserve.sampling_params import SamplingParams

MAX_BEAM_WIDTH = SamplingParams.MAX_LOGPROBS // 2  # each beam's 2 x width candidates are its top logprobs
# length ** length_penalty stays a finite, non-zero float for any context length (transformers'
# users pick within [-2, 2])
MAX_LENGTH_PENALTY = 10.0


@dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's: beam_width beams, and as many answers; at most max_tokens tokens each."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False  # EOS tokens are candidates like any other; no hypothesis finishes early
    length_penalty: float = 1.0  # > 0 favours longer answers, < 0 shorter ones

    def __post_init__(self) -> None:
        if not 1 <= self.beam_width <= MAX_BEAM_WIDTH:
            raise ValueError(f"beam_width (n) must be in 1..{MAX_BEAM_WIDTH}, got {self.beam_width}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not -MAX_LENGTH_PENALTY <= self.length_penalty <= MAX_LENGTH_PENALTY:
            raise ValueError(f"length_penalty must be in [{-MAX_LENGTH_PENALTY}, {MAX_LENGTH_PENALTY}], "
                             f"got {self.length_penalty}")

    def step_params(self) -> SamplingParams:
        """A round's request: one token, and the beam's 2 x width most likely as its logprobs."""
        return SamplingParams(temperature=0.0, max_tokens=1, logprobs=2 * self.beam_width, ignore_eos=True)


@dataclass
class Beam:
    token_ids: list[int] = field(default_factory=list)  # generated so far
    cumulative_logprob: float = 0.0
    ends: bool = False  # its last token is an EOS token

    def score(self, length_penalty: float) -> float:
        return self.cumulative_logprob / len(self.token_ids) ** length_penalty


class BeamSearch:
    """One prompt's search (see the module's docstring)."""

    def __init__(self, prompt_ids: list[int], params: BeamSearchParams,
                 eos_token_ids: frozenset[int]) -> None:
        self.prompt_ids, self.params = prompt_ids, params
        self.eos_token_ids = frozenset() if params.ignore_eos else eos_token_ids
        self.live: list[Beam] = [Beam()]
        self.hypotheses: list[Beam] = []  # the best beam_width finished ones, best first
        self.num_rounds = 0
        self.can_improve = True  # whether a live beam may still beat the worst hypothesis

    @property
    def done(self) -> bool:
        return not (self.live and self.can_improve and self.num_rounds < self.params.max_tokens)

    def round_prompts(self) -> list[list[int]]:
        """This round's requests: each live beam's prompt."""
        return [self.prompt_ids + beam.token_ids for beam in self.live]

    def advance(self, candidates: list[dict[int, float]]) -> None:
        """candidates[i]: live beam i's likeliest next tokens and their log-probabilities."""
        if len(candidates) != len(self.live):
            raise ValueError(f"{len(self.live)} live beams but candidates for {len(candidates)}")
        width, penalty = self.params.beam_width, self.params.length_penalty
        grown = [Beam(beam.token_ids + [token], beam.cumulative_logprob + logprob,
                      token in self.eos_token_ids)
                 for beam, tokens in zip(self.live, candidates) for token, logprob in tokens.items()]
        # stable: among equal log-probabilities, the earlier beam's and its likelier token first
        kept = sorted(grown, key=lambda b: -b.cumulative_logprob)[: 2 * width]
        self.num_rounds += 1
        last = self.num_rounds == self.params.max_tokens
        finishing = [b for b in kept[:width] if b.ends or last]
        self.hypotheses = sorted(self.hypotheses + finishing, key=lambda b: -b.score(penalty))[:width]
        self.live = [b for b in kept if not (b.ends or last)][:width]
        if len(self.hypotheses) == width and self.live:
            best_live = self.live[0].cumulative_logprob / self.num_rounds**penalty
            self.can_improve = best_live > self.hypotheses[-1].score(penalty)

    def output(self, request_id: str, tokenizer, skip_special_tokens: bool = True) -> RequestOutput:
        """The hypotheses as a finished RequestOutput, best first: finish_reason "stop" where an
        EOS token ended one (its last token id, left out of the text), else "length"."""
        outputs = []
        for index, beam in enumerate(self.hypotheses):
            text_ids = beam.token_ids[:-1] if beam.ends else beam.token_ids
            text = tokenizer.decode(text_ids, skip_special_tokens=skip_special_tokens) if tokenizer else ""
            outputs.append(CompletionOutput(
                index, text, list(beam.token_ids), "stop" if beam.ends else "length",
                beam.token_ids[-1] if beam.ends else None, cumulative_logprob=beam.cumulative_logprob))
        return RequestOutput(request_id, None, list(self.prompt_ids), outputs, finished=True)


def candidates_of(output: RequestOutput) -> dict[int, float]:
    """A round's request's top next tokens with their log-probabilities; its error raised."""
    if output.error is not None:
        raise RuntimeError(output.error)
    return {token: entry.logprob for token, entry in output.outputs[0].logprobs[0].items()}
