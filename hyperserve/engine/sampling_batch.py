"""SamplingBatchBuilder: the sampling parameters of a step's logits rows as batched tensors
(sampler.SamplingBatch), built once per step from the rows' requests, so the sampler stays a pure
function of logits and tensors. It holds the one piece of per-request sampling state: a seeded
request's generator, which draws on from step to step until the request is released."""

from __future__ import annotations

import torch

from hyperserve.engine.request import Request
from hyperserve.engine.sampler import SamplingBatch


class SamplingBatchBuilder:
    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.generators: dict[str, torch.Generator] = {}  # by request id: the seeded requests'

    def release(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.generators.pop(request_id, None)

    def build(self, rows: list[tuple[Request, list[int]]], token_bitmask: torch.Tensor | None = None
              ) -> SamplingBatch:
        """Sampling parameters of logits rows, each a request and the draft tokens before the row
        (they count as output tokens for the penalties at that row), and the rows' grammar masks."""
        requests = [r for r, _ in rows]
        params = [r.sampling_params for r in requests]
        to, vocab = self.device, self.vocab_size
        floats = lambda values: torch.tensor(values, dtype=torch.float32, device=to)
        any_penalties = any(p.has_penalties for p in params)
        counts = prompt_mask = None
        if any_penalties:
            counts = torch.zeros(len(requests), self.vocab_size, dtype=torch.long)
            prompt_mask = torch.zeros(len(requests), self.vocab_size, dtype=torch.bool)
            for i, (r, drafts) in enumerate(rows):
                if r.output_token_ids or drafts:
                    output = torch.tensor(r.output_token_ids + drafts)
                    counts[i] = torch.bincount(output, minlength=self.vocab_size)
                prompt_mask[i, r.prompt_token_ids] = True
            counts, prompt_mask = counts.to(to), prompt_mask.to(to)
        logit_bias = None
        banned = [self._banned(r, len(drafts)) for r, drafts in rows]
        if any(p.logit_bias or p.allowed_token_ids is not None for p in params) or any(banned):
            logit_bias = torch.zeros(len(requests), self.vocab_size)
            for i, p in enumerate(params):
                if p.allowed_token_ids is not None:
                    logit_bias[i] = float("-inf")
                    logit_bias[i, p.allowed_token_ids] = 0.0
                if p.logit_bias:
                    logit_bias[i, list(p.logit_bias)] += torch.tensor(list(p.logit_bias.values()))
                if banned[i]:
                    logit_bias[i, banned[i]] = float("-inf")
            logit_bias = logit_bias.to(to)
        requested_logprobs = [p.logprobs for p in params if p.logprobs is not None]
        all_greedy = all(p.is_greedy for p in params)
        return SamplingBatch(
            temperature=None if all_greedy else floats([p.temperature for p in params]),
            top_k=None if all_greedy else torch.tensor(
                [min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params], device=to),
            top_p=None if all_greedy else floats([p.top_p for p in params]),
            min_p=None if all_greedy else floats([p.min_p for p in params]),
            presence_penalty=floats([p.presence_penalty for p in params]) if any_penalties else None,
            frequency_penalty=floats([p.frequency_penalty for p in params]) if any_penalties else None,
            repetition_penalty=floats([p.repetition_penalty for p in params]) if any_penalties else None,
            output_token_counts=counts,
            prompt_token_mask=prompt_mask,
            logit_bias=logit_bias,
            token_bitmask=None if token_bitmask is None else token_bitmask.to(to),
            generators=[self.generator(r) for r in requests],
            num_logprobs=max(requested_logprobs) if requested_logprobs else None,
            all_greedy=all_greedy,
            needs_top_k_top_p=any(0 < p.top_k < self.vocab_size or p.top_p < 1 for p in params),
            needs_min_p=any(p.min_p > 0 for p in params),
        )

    @staticmethod
    def _banned(request: Request, num_drafts: int) -> list[int]:
        """The tokens that would end a row's answer before its min_tokens: EOS (unless ignored) and
        stop_token_ids."""
        params = request.sampling_params
        if request.num_output_tokens + num_drafts >= params.min_tokens:
            return []
        return list(params.stop_token_ids) + ([] if params.ignore_eos else sorted(request.eos_token_ids))

    def generator(self, request: Request) -> torch.Generator | None:
        """A seeded request's own generator, made at its first row; None: it draws from the shared one."""
        if request.seed is None:
            return None
        if request.request_id not in self.generators:
            generator = torch.Generator(device=self.device).manual_seed(request.seed)
            self.generators[request.request_id] = generator
        return self.generators[request.request_id]
