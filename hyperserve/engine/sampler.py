"""The sampler: a pure function of logits and batched sampling parameters.

Order of operations, per row:
  1. log-probabilities of the raw logits (reported logprobs, as vLLM and OpenAI report them)
  2. logit_bias (OpenAI's: added to the logits), then penalties: repetition (prompt and output
     tokens), frequency and presence (output tokens), then the structured-output bitmask
     (tokens the row's grammar disallows go to -inf)
  3. greedy rows (temperature 0) take the argmax here
  4. temperature
  5. min_p, then top_k, then top_p filtering
  6. sample by the exponential race argmax(p / E), E ~ Exp(1) drawn from the row's own generator
     when the request has a seed, so its tokens do not depend on what else is in the batch
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(slots=True)
class SamplingBatch:
    """Sampling parameters of the rows of a logits tensor, all [B] unless noted."""

    # the next four are None when every row is greedy (all_greedy): only the argmax is taken
    temperature: torch.Tensor | None  # float; 0 = greedy
    top_k: torch.Tensor | None  # int; >= vocab size when disabled
    top_p: torch.Tensor | None  # float; 1 when disabled
    min_p: torch.Tensor | None  # float; 0 when disabled
    presence_penalty: torch.Tensor | None  # None when no row has penalties
    frequency_penalty: torch.Tensor | None
    repetition_penalty: torch.Tensor | None
    output_token_counts: torch.Tensor | None  # [B, V] int
    prompt_token_mask: torch.Tensor | None  # [B, V] bool
    logit_bias: torch.Tensor | None  # [B, V] float; None when no row has a bias
    token_bitmask: torch.Tensor | None  # [B, ceil(V / 32)] int32, bit set = allowed; None: no grammar
    generators: list[torch.Generator | None]  # per row; None: the engine's shared generator
    num_logprobs: int | None  # top-N to return (0: the sampled token's only); None: no logprobs
    all_greedy: bool
    needs_top_k_top_p: bool
    needs_min_p: bool


@dataclass(slots=True)
class SamplerOutput:
    token_ids: torch.Tensor  # [B] long
    sampled_logprobs: torch.Tensor | None  # [B] logprob of the sampled token
    sampled_ranks: torch.Tensor | None  # [B] 1 = the most likely token
    top_logprobs: torch.Tensor | None  # [B, N]
    top_token_ids: torch.Tensor | None  # [B, N]


def sample(logits: torch.Tensor, batch: SamplingBatch, shared: torch.Generator | None = None) -> SamplerOutput:
    logits = logits.float()  # [B, V]
    raw_logprobs = torch.log_softmax(logits, dim=-1) if batch.num_logprobs is not None else None
    greedy, probs = sampling_probs(logits, batch)
    if probs is None:
        token_ids = greedy
    else:
        token_ids = torch.where(batch.temperature == 0, greedy, _exponential_race(probs, batch.generators, shared))
    return gather_logprobs(token_ids, raw_logprobs, batch.num_logprobs)


def sampling_probs(logits: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Steps 2-5: the greedy token of each row [B] and the distribution sampled from [B, V]
    (None when every row is greedy; rows with temperature 0 hold garbage)."""
    logits = logits.float()
    if batch.logit_bias is not None:
        logits = logits + batch.logit_bias
    if batch.repetition_penalty is not None:
        logits = apply_penalties(logits, batch)
    if batch.token_bitmask is not None:
        logits = apply_token_bitmask(logits, batch.token_bitmask)
    greedy = row_argmax(logits)
    if batch.all_greedy:
        return greedy, None
    temperature = torch.where(batch.temperature == 0, 1.0, batch.temperature).unsqueeze(1)
    logits = logits / temperature
    if batch.needs_min_p:
        logits = _apply_min_p(logits, batch.min_p)
    if batch.needs_top_k_top_p:
        logits = _apply_top_k_top_p(logits, batch.top_k, batch.top_p)
    return greedy, torch.softmax(logits, dim=-1)


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    counts = batch.output_token_counts  # [B, V]
    seen = counts > 0
    if batch.prompt_token_mask is not None:
        seen = seen | batch.prompt_token_mask
    rep = batch.repetition_penalty.unsqueeze(1)
    penalised = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalised, logits)
    logits = logits - batch.frequency_penalty.unsqueeze(1) * counts
    return logits - batch.presence_penalty.unsqueeze(1) * (counts > 0)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Logits [B, V] with the tokens a bitmask [B, ceil(V / 32)] disallows at -inf."""
    bits = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> bits) & 1).bool().flatten(1)[:, : logits.shape[-1]]
    return logits.masked_fill(~allowed.to(logits.device), float("-inf"))


def row_argmax(values: torch.Tensor) -> torch.Tensor:
    """argmax over the last dimension (the first of equal maxima, as torch's). On the CPU through
    NumPy: torch's takes 61 µs for one row of SmolLM2's 49k logits, NumPy's 4 (1% of a decode step)."""
    if values.device.type == "cpu" and values.dtype == torch.float32:
        return torch.from_numpy(np.argmax(values.numpy(), axis=-1))
    return values.argmax(dim=-1)


def _apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    probs = torch.softmax(logits, dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill(probs < threshold, float("-inf"))


def _apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(logits.shape[-1], device=logits.device).unsqueeze(0)
    remove = ranks >= top_k.unsqueeze(1)
    sorted_probs = torch.softmax(sorted_logits.masked_fill(remove, float("-inf")), dim=-1)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # exclusive prefix sum
    remove |= mass_before >= top_p.unsqueeze(1)  # the top token always stays (mass_before = 0)
    remove = remove.scatter(-1, order, remove)  # back to vocabulary order
    return logits.masked_fill(remove, float("-inf"))


def _exponential_race(
    probs: torch.Tensor, generators: list[torch.Generator | None], shared: torch.Generator | None
) -> torch.Tensor:
    noise = torch.empty_like(probs)
    noise.exponential_(generator=shared)
    for row, generator in enumerate(generators):
        if generator is not None:
            noise[row].exponential_(generator=generator)
    return row_argmax(probs / noise)


def gather_logprobs(
    token_ids: torch.Tensor, raw_logprobs: torch.Tensor | None, num_logprobs: int | None
) -> SamplerOutput:
    if raw_logprobs is None or num_logprobs is None:
        return SamplerOutput(token_ids, None, None, None, None)
    sampled = raw_logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)
    ranks = (raw_logprobs > sampled.unsqueeze(1)).sum(dim=-1) + 1
    top_logprobs, top_ids = raw_logprobs.topk(num_logprobs, dim=-1)
    return SamplerOutput(token_ids, sampled, ranks, top_logprobs, top_ids)
