"""LoRA deltas on the GPU in Triton, each row with its own adapter (BGMV, as Punica and S-LoRA do).

A step's adapters are stacked per projection shard (LoRABatch): A [n, r, in] and B (scaled)
[n, r, out], r the step's largest rank (smaller ones zero-padded). Two kernels, one program per
row (and per output tile):
- shrink: h[t] = A[adapter(t)] x[t], r values;
- expand: y[t] += h[t] B[adapter(t)], in place on the projection's output columns.
A row of the base model (adapter -1) reads no adapter weights and adds nothing. Unlike the dense
form (x times every adapter's A, masked), the work is one adapter's per row, whatever their number.
Both are matrix-vector products (rank is small): bandwidth-bound, so plain loads and sums in
float32, no tensor cores. On the CPU they run under TRITON_INTERPRET=1 (tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_K = 64  # input features per shrink iteration
BLOCK_N = 128  # output features per expand program


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, rows_ptr, h_ptr, in_features, rank,
                   stride_x, stride_a_adapter, stride_a_rank, stride_h,
                   BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    t = tl.program_id(0)
    adapter = tl.load(rows_ptr + t)
    r = tl.arange(0, BLOCK_R)
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    if adapter >= 0:
        for k0 in range(0, in_features, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + t * stride_x + k, mask=k < in_features, other=0.0).to(tl.float32)
            a = tl.load(a_ptr + adapter * stride_a_adapter + r[:, None] * stride_a_rank + k[None, :],
                        mask=(r[:, None] < rank) & (k[None, :] < in_features), other=0.0).to(tl.float32)
            acc += tl.sum(a * x[None, :], axis=1)
    tl.store(h_ptr + t * stride_h + r, acc, mask=r < rank)


@triton.jit
def _expand_kernel(h_ptr, b_ptr, rows_ptr, y_ptr, out_features, rank,
                   stride_h, stride_b_adapter, stride_b_rank, stride_y,
                   BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    t = tl.program_id(0)
    adapter = tl.load(rows_ptr + t)
    if adapter >= 0:
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        r = tl.arange(0, BLOCK_R)
        h = tl.load(h_ptr + t * stride_h + r, mask=r < rank, other=0.0)
        b = tl.load(b_ptr + adapter * stride_b_adapter + r[:, None] * stride_b_rank + n[None, :],
                    mask=(r[:, None] < rank) & (n[None, :] < out_features), other=0.0).to(tl.float32)
        delta = tl.sum(b * h[:, None], axis=0)
        y = tl.load(y_ptr + t * stride_y + n, mask=n < out_features, other=0.0)
        tl.store(y_ptr + t * stride_y + n, (y.to(tl.float32) + delta).to(y.dtype), mask=n < out_features)


def lora_shrink(x: torch.Tensor, a: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """h [T, r] float32: row t's x [T, in] times A [n, r, in] of its adapter rows[t] (-1: zeros)."""
    num_rows, in_features = x.shape
    rank = a.shape[1]
    assert a.stride(2) == 1 and x.stride(1) == 1 and a.shape[2] == in_features
    h = torch.empty(num_rows, rank, dtype=torch.float32, device=x.device)
    if num_rows:
        _shrink_kernel[(num_rows,)](x, a, rows, h, in_features, rank, x.stride(0), a.stride(0), a.stride(1),
                                    h.stride(0), BLOCK_R=max(16, triton.next_power_of_2(rank)), BLOCK_K=BLOCK_K)
    return h


def lora_expand(h: torch.Tensor, b: torch.Tensor, rows: torch.Tensor, y: torch.Tensor) -> None:
    """y [T, out] (a column slice of a projection's output is fine) += h [T, r] times B [n, r, out]
    of each row's adapter, in place."""
    num_rows, out_features = y.shape
    rank = b.shape[1]
    assert b.stride(2) == 1 and y.stride(1) == 1 and b.shape[2] == out_features
    if num_rows:
        grid = (num_rows, triton.cdiv(out_features, BLOCK_N))
        _expand_kernel[grid](h, b, rows, y, out_features, rank, h.stride(0), b.stride(0), b.stride(1), y.stride(0),
                             BLOCK_R=max(16, triton.next_power_of_2(rank)), BLOCK_N=BLOCK_N)
