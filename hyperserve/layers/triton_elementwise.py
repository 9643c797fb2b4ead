"""The decoder layer's small elementwise steps as single Triton kernels, for CUDA.

At decode batch sizes each PyTorch op is one kernel launch of a few microseconds over a few KB:
a layer's residual adds, RMSNorms and SiLU-and-multiply were eight launches of the roughly twenty
a Llama layer takes (CUDA graphs remove the host's launch cost, not the GPU's per-kernel cost).
At prefill sizes they are passes over tens of MB each, and fusing them saves passes:
- add_rms_norm: residual + x and the RMSNorm of the sum, in one pass (vLLM's fused_add_rms_norm);
- silu_and_mul: silu(gate) * up from the fused gate/up projection's output, in one pass.
Rounding follows PyTorch's ops: the sum is rounded to the activations' dtype before it is
normalised, and the norm computes in float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _add_rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, new_residual_ptr, stride_x, stride_r, eps,
                         N: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    ok = offs < N
    x = tl.load(x_ptr + row * stride_x + offs, mask=ok, other=0.0)
    if HAS_RESIDUAL:
        x = (x.to(tl.float32) + tl.load(residual_ptr + row * stride_r + offs, mask=ok, other=0.0).to(tl.float32))
        x = x.to(new_residual_ptr.dtype.element_ty)
        tl.store(new_residual_ptr + row * N + offs, x, mask=ok)
    x = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / N + eps)
    weight = tl.load(weight_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * N + offs, (x * rstd * weight).to(out_ptr.dtype.element_ty), mask=ok)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual) * weight, x + residual) for x and residual [T, N]; without a
    residual, (rms_norm(x) * weight, x)."""
    rows, n = x.shape
    out = torch.empty_like(x)
    summed = torch.empty_like(x) if residual is not None else x
    if rows:
        _add_rms_norm_kernel[(rows,)](
            x, residual if residual is not None else x, weight, out, summed, x.stride(0),
            residual.stride(0) if residual is not None else 0, eps,
            N=n, BLOCK=triton.next_power_of_2(n), HAS_RESIDUAL=residual is not None, num_warps=4 if n <= 4096 else 8)
    return out, summed


@triton.jit
def _silu_and_mul_kernel(gate_up_ptr, out_ptr, stride_in, N: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N
    gate = tl.load(gate_up_ptr + row * stride_in + offs, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * stride_in + N + offs, mask=ok, other=0.0)
    silu = (gate / (1.0 + tl.exp(-gate))).to(up.dtype).to(tl.float32)  # rounded, as F.silu's output is
    tl.store(out_ptr + row * N + offs, (silu * up.to(tl.float32)).to(up.dtype), mask=ok)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2N] (gate then up) -> silu(gate) * up, [T, N]."""
    rows, width = gate_up.shape
    n = width // 2
    out = torch.empty(rows, n, dtype=gate_up.dtype, device=gate_up.device)
    if rows:
        block = 1024
        _silu_and_mul_kernel[(rows, triton.cdiv(n, block))](gate_up, out, gate_up.stride(0), N=n, BLOCK=block)
    return out
