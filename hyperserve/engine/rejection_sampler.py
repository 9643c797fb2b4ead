"""Verification of proposed tokens by the rejection rule of speculative sampling.

For draft tokens d_1..d_k proposed with probabilities q_i and the target's probabilities p_i at the
same positions (p_i computed with every sampling parameter applied: penalties over the tokens
before it, temperature, top-k/top-p/min-p), d_i is accepted with probability min(1, p_i(d_i) /
q_i(d_i)). At the first rejection a token is drawn from the residual max(0, p_i - q_i)
(renormalised) and the rest are dropped; if all k are accepted a bonus token is drawn from p_{k+1}.
The emitted tokens then follow the target's distribution exactly (Leviathan et al., 2023; Chen et
al., 2023). Prompt-lookup proposals are deterministic: q_i is a point mass on d_i.

Greedy rows need no randomness: a draft is accepted while it equals the target's argmax, and the
first mismatch is replaced by the argmax, so the output is the non-speculative greedy output.
"""

from __future__ import annotations

import torch


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from `probs` [V] by the exponential race the sampler uses (argmax p / E)."""
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return int((probs / noise).argmax())


def verify_greedy(target_argmax: list[int], draft_token_ids: list[int]) -> list[int]:
    """target_argmax has len(draft_token_ids) + 1 entries; returns the tokens to emit."""
    emitted = []
    for draft, best in zip(draft_token_ids, target_argmax):
        emitted.append(best)
        if draft != best:
            return emitted
    emitted.append(target_argmax[len(draft_token_ids)])
    return emitted


def verify_sampled(
    target_probs: torch.Tensor,  # [k + 1, V]
    draft_token_ids: list[int],  # [k]
    draft_probs: torch.Tensor | None,  # [k, V]; None: deterministic proposals (point masses)
    generator: torch.Generator | None,
) -> list[int]:
    """The tokens to emit: the accepted drafts, then one token from the residual or the bonus."""
    emitted = []
    for i, draft in enumerate(draft_token_ids):
        p = target_probs[i]
        q_draft = 1.0 if draft_probs is None else float(draft_probs[i, draft])
        u = float(torch.rand((), generator=generator, device=target_probs.device))
        if u * q_draft < float(p[draft]):
            emitted.append(draft)
            continue
        if draft_probs is None:
            residual = p.clone()
            residual[draft] = 0
        else:
            residual = (p - draft_probs[i]).clamp_(min=0)
        if float(residual.sum()) <= 0:  # p == q up to rounding: the residual is undefined, p is exact
            residual = p
        emitted.append(draw(residual, generator))
        return emitted
    emitted.append(draw(target_probs[len(draft_token_ids)], generator))
    return emitted
