"""A mixture-of-experts MLP (Mixtral, Qwen3-MoE): each token runs only the few experts its router
picks, so a model holds many MLPs' weights but reads only top_k of them per token.

The router scores every expert (softmax in float32), keeps each token's top_k and, where the
model says so, renormalises their weights to sum to one. The step's (token, expert) pairs are
then grouped by expert: each chosen expert runs once over all of its tokens (a step of T tokens
runs at most min(E, T * top_k) experts, each a few-row matmul), and its weighted outputs are added
into their tokens' rows. Experts are ordinary MLPs of Linear projections, so weight quantization
(layers/quantization.py) applies to them as to a dense MLP; the router stays in float, since a
rounded score can change which experts a token runs.

GPT-OSS's router adds a bias to its logits, and its experts (biased projections, a clamped SwiGLU:
models/gpt_oss.py) are ordinary MLPs otherwise. Qwen2-MoE adds a shared expert that every token
runs, its output scaled by a gate of its own (sigmoid of one score per token) and added to the
routed experts'. DeepSeek's shared experts are added as they are, and its router
(`GroupedRouting`) differs: V3 scores experts by a sigmoid and chooses by those scores plus a
learned bias, both pick among the experts of a token's best few groups only, and the chosen
weights are scaled by routed_scaling_factor.

Under tensor parallelism every rank holds every expert's run of the MLP's width and the whole
router: the ranks route alike (their inputs are the same all-reduced rows), each expert's output
is a partial sum, and one all-reduce of the mixture's output adds them up.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from hyperserve.distributed.group import TensorParallel


class Router(nn.Module):
    """The gate: one score per expert for each token. Not an nn.Linear, so that quantization
    leaves it alone. choice_bias: DeepSeek-V3's e_score_correction_bias, which only chooses;
    logit_bias: GPT-OSS's, added to the logits."""

    def __init__(self, hidden_size: int, num_experts: int, choice_bias: bool = False,
                 logit_bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts)) if choice_bias else None
        self.bias = nn.Parameter(torch.zeros(num_experts)) if logit_bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)  # [T, E]


@dataclass(frozen=True)
class GroupedRouting:
    """DeepSeek's choice of experts: scores by softmax (V2) or sigmoid (V3, which chooses by the
    scores plus the router's bias); the experts in num_groups groups, a token choosing among those
    of its topk_groups best (a group's score: its best expert's, or with top2_groups its best two's
    sum); the chosen scores, renormalised or not, times `scale`."""

    sigmoid: bool
    num_groups: int = 1
    topk_groups: int = 1
    top2_groups: bool = False
    scale: float = 1.0

    def choose(self, logits: torch.Tensor, bias: torch.Tensor | None, top_k: int, renormalize: bool
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """logits [T, E] float32 -> (weights [T, top_k], expert ids [T, top_k])."""
        scores = logits.sigmoid() if self.sigmoid else logits.softmax(dim=-1)
        choice = scores if bias is None else scores + bias.float()
        if self.num_groups > 1:
            grouped = choice.unflatten(-1, (self.num_groups, -1))  # [T, groups, E / groups]
            group_scores = grouped.topk(2, dim=-1)[0].sum(-1) if self.top2_groups else grouped.amax(-1)
            kept = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(
                1, group_scores.topk(self.topk_groups, dim=-1)[1], True)
            choice = grouped.masked_fill(~kept.unsqueeze(-1), float("-inf")).flatten(1)
        expert_ids = choice.topk(top_k, dim=-1)[1]
        weights = scores.gather(1, expert_ids)
        if renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scale, expert_ids


class SparseMoE(nn.Module):
    def __init__(self, hidden_size: int, num_experts: int, top_k: int, renormalize: bool,
                 make_expert: Callable[[], nn.Module], tp: TensorParallel | None = None,
                 shared_expert: nn.Module | None = None, gated_shared_expert: bool = True,
                 grouped: GroupedRouting | None = None, router_bias: bool = False) -> None:
        """make_expert: an MLP whose output is this rank's part of the sum (with `tp`), as is
        shared_expert's (which every token runs: Qwen2-MoE's gated, DeepSeek's not). grouped:
        DeepSeek's routing; None: a softmax's top_k. router_bias: the router's logits have a bias
        (GPT-OSS's)."""
        super().__init__()
        self.tp = tp or TensorParallel()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok must be in 1..{num_experts}, got {top_k}")
        self.top_k, self.renormalize, self.grouped = top_k, renormalize, grouped
        self.gate = Router(hidden_size, num_experts, choice_bias=grouped is not None and grouped.sigmoid,
                           logit_bias=router_bias)
        self.experts = nn.ModuleList(make_expert() for _ in range(num_experts))
        self.shared_expert = shared_expert
        gated = shared_expert is not None and gated_shared_expert
        self.shared_expert_gate = Router(hidden_size, 1) if gated else None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, top_k] float32, expert ids [T, top_k]) of each token's chosen experts."""
        if self.grouped is not None:
            return self.grouped.choose(F.linear(x.float(), self.gate.weight.float()),
                                       self.gate.e_score_correction_bias, self.top_k, self.renormalize)
        probs = self.gate(x).float().softmax(dim=-1)
        weights, expert_ids = probs.topk(self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, expert_ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [T, hidden]
        weights, expert_ids = self.route(x)
        pairs = expert_ids.flatten()  # [T * top_k]: pair i is token i // top_k's choice
        by_expert = pairs.argsort(stable=True)
        counts = torch.bincount(pairs, minlength=len(self.experts)).tolist()  # the step's one host sync
        out = torch.zeros_like(x)
        for expert, chosen in zip(self.experts, by_expert.split(counts)):
            if len(chosen):
                tokens = chosen // self.top_k
                weighted = expert(x[tokens]) * weights.view(-1)[chosen, None]  # [n, hidden] float32
                out.index_add_(0, tokens, weighted.to(x.dtype))
        if self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        elif self.shared_expert is not None:
            out = out + self.shared_expert(x)
        return self.tp.all_reduce(out)
