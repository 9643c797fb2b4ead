"""RMSNorm, fused with the residual add where the model allows it (one Triton kernel on CUDA)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hyperserve.layers import on_triton


def _triton_rows(x: torch.Tensor) -> bool:
    """Whether the norms' Triton kernels take x: half-precision rows [T, N] on CUDA."""
    return on_triton(x) and x.dim() == 2 and x.dtype in (torch.bfloat16, torch.float16)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The norm of x; with a residual, (the norm of x + residual, x + residual), which on CUDA
        is one Triton kernel (layers/triton_elementwise.py). In half precision it normalises in float32,
        as transformers does."""
        if _triton_rows(x):
            from hyperserve.layers.triton_elementwise import add_rms_norm

            normed, summed = add_rms_norm(x, residual, self.weight, self.eps)
            return normed if residual is None else (normed, summed)
        if residual is None:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        summed = x + residual
        return F.rms_norm(summed, self.weight.shape, self.weight, self.eps), summed

    def added_to(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """residual + the norm of x (Gemma 3 norms a block's output before its residual add): one
        Triton kernel on CUDA."""
        if _triton_rows(x):
            from hyperserve.layers.triton_elementwise import rms_norm_add

            return rms_norm_add(x, residual, self.weight, self.eps)
        return residual + F.rms_norm(x, self.weight.shape, self.weight, self.eps)
