"""A mixture-of-experts MLP (Mixtral, Qwen3-MoE): each token runs only the few experts its router
picks, so a model holds many MLPs' weights but reads only top_k of them per token.

The router scores every expert (softmax in float32), keeps each token's top_k and, where the
model says so, renormalises their weights to sum to one. The step's (token, expert) pairs are
then grouped by expert: each chosen expert runs once over all of its tokens (a step of T tokens
runs at most min(E, T * top_k) experts, each a few-row matmul), and its weighted outputs are added
into their tokens' rows. Experts are ordinary MLPs of Linear projections, so weight quantization
(layers/quantization.py) applies to them as to a dense MLP; the router stays in float, since a
rounded score can change which experts a token runs.

Qwen2-MoE adds a shared expert that every token runs, its output scaled by a gate of its own
(sigmoid of one score per token) and added to the routed experts'.

Under tensor parallelism every rank holds every expert's run of the MLP's width and the whole
router: the ranks route alike (their inputs are the same all-reduced rows), each expert's output
is a partial sum, and one all-reduce of the mixture's output adds them up.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from hyperserve.distributed.group import TensorParallel


class Router(nn.Module):
    """The gate: one score per expert for each token. Not an nn.Linear, so that quantization
    leaves it alone."""

    def __init__(self, hidden_size: int, num_experts: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)  # [T, E]


class SparseMoE(nn.Module):
    def __init__(self, hidden_size: int, num_experts: int, top_k: int, renormalize: bool,
                 make_expert: Callable[[], nn.Module], tp: TensorParallel | None = None,
                 shared_expert: nn.Module | None = None) -> None:
        """make_expert: an MLP whose output is this rank's part of the sum (with `tp`), as is
        shared_expert's (Qwen2-MoE's, which every token runs)."""
        super().__init__()
        self.tp = tp or TensorParallel()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok must be in 1..{num_experts}, got {top_k}")
        self.top_k, self.renormalize = top_k, renormalize
        self.gate = Router(hidden_size, num_experts)
        self.experts = nn.ModuleList(make_expert() for _ in range(num_experts))
        self.shared_expert = shared_expert
        self.shared_expert_gate = Router(hidden_size, 1) if shared_expert is not None else None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, top_k] float32, expert ids [T, top_k]) of each token's chosen experts."""
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
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return self.tp.all_reduce(out)
