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


def few_rows_gemv(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None = None,
                  bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """x [..., K] times weight [N, K] (per-channel scale [N], bias [N]) through the Triton GEMV
    when x is a few half-precision rows on CUDA; None where another path should run."""
    if not (on_triton(x) and x.dtype in (torch.bfloat16, torch.float16)):
        return None
    from hyperserve.layers import triton_gemv

    rows = x.reshape(-1, x.shape[-1])
    if rows.shape[0] > triton_gemv.MAX_ROWS:
        return None
    return triton_gemv.gemv(rows, weight, scale, bias).view(*x.shape[:-1], weight.shape[0])


class Linear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = few_rows_gemv(x, self.weight, bias=self.bias)
        return y if y is not None else F.linear(x, self.weight, self.bias)
