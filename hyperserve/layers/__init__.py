"""Model layers. Their CUDA fast paths are Triton kernels, taken only where triton is installed."""

from __future__ import annotations

import importlib.util

import torch

HAS_TRITON = importlib.util.find_spec("triton") is not None


def on_triton(x: torch.Tensor) -> bool:
    """Whether a Triton kernel can take x: triton is installed and x is on a CUDA device."""
    return HAS_TRITON and x.is_cuda
