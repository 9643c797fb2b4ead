"""Linear: nn.Linear whose calls of a few rows on CUDA run the Triton GEMV.

A decode step multiplies a few token rows by every weight matrix, so its time is the weight read.
At one row the Triton GEMV (layers/triton_gemv.py) reads bfloat16 weights 5 to 11% faster than
cuBLAS on an H100 at each Llama-3-8B projection shape (benchmarks/gpu_kernels.py, best tiles);
larger calls, and every call on the CPU, run F.linear.
"""

from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F
from torch import nn

_TRITON = importlib.util.find_spec("triton") is not None


class Linear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _TRITON and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16):
            from hyperserve.layers import triton_gemv

            rows = x.reshape(-1, self.in_features)
            if rows.shape[0] <= triton_gemv.MAX_ROWS:
                return triton_gemv.gemv(rows, self.weight, None, self.bias).view(*x.shape[:-1], self.out_features)
        return F.linear(x, self.weight, self.bias)
