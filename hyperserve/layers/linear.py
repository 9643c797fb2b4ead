"""Linear: nn.Linear whose calls of a few rows on CUDA run the Triton GEMV.

A decode step multiplies a few token rows by every weight matrix, so its time is the weight read.
At one row the Triton GEMV (layers/triton_gemv.py) reads bfloat16 weights 6 to 18% faster than
cuBLAS on an H100 at each Llama-3-8B projection shape (benchmarks/gpu_kernels.py, CUDA-graph replays);
larger calls, and every call on the CPU, run F.linear.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hyperserve.layers import on_triton


def gemv_takes(x: torch.Tensor) -> bool:
    """Whether the Triton GEMV takes x [..., K]: a few half-precision rows on CUDA."""
    if not (on_triton(x) and x.dtype in (torch.bfloat16, torch.float16)):
        return False
    from hyperserve.layers.triton_gemv import MAX_ROWS

    return x.numel() <= MAX_ROWS * x.shape[-1]


def few_rows_gemv(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None = None,
                  bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """x [..., K] times weight [N, K] (per-channel scale [N], bias [N]) through the Triton GEMV
    where it takes x; None where another path should run."""
    if not gemv_takes(x):
        return None
    from hyperserve.layers import triton_gemv

    y = triton_gemv.gemv(x.reshape(-1, x.shape[-1]), weight, scale, bias)
    return y.view(*x.shape[:-1], weight.shape[0])


class Linear(nn.Linear):
    @property
    def gemv_operands(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """(weight [N, K], per-channel scale or None, bias or None) as triton_gemv.gemv takes them."""
        return self.weight, None, self.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = few_rows_gemv(x, *self.gemv_operands)
        return y if y is not None else F.linear(x, self.weight, self.bias)
