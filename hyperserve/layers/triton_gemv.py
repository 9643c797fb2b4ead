"""Skinny matrix products in Triton: y = x W^T (* per-row scale) (+ bias) for a few rows of x.

A decode step multiplies a handful of token rows by every weight matrix: the time is the weight
bytes read, and the arithmetic is nothing. Two things keep PyTorch's paths from that floor there:
- float8 weights through torch._scaled_mm first quantize the activations (about six small
  kernels per linear, so a single-stream step launched as many extra kernels as layers times six
  and ran no faster than bfloat16);
- the GEMM libraries pick tiles for large M.
This kernel reads each weight byte once, widens it in registers (float8 is exact in bfloat16 and
float32) and applies the per-output-channel scale after the dot: weight-only float8, with the
activations left in their own precision.

One program per BLOCK_N output channels streams its rows of W along K; x rows (at most BLOCK_M,
padded to tl.dot's 16) are reloaded per K tile from L2. Since every program reads all of x, what a
decoder layer does to x before the product (RMSNorm, SwiGLU) and to y after it (the residual add)
can run inside it, with no kernel of its own (layers/gemv_decode.py). A single row is a reduction
on the CUDA cores; more rows a tensor-core dot in the activations' half type (float32
accumulation), or in float32 under Triton's interpreter, whose half-precision dot is wrong.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from hyperserve.layers.triton_elementwise import silu

MAX_ROWS = 16  # the rows one program holds: decode batches and speculative verification up to this
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # whose bfloat16 dot is wrong: float32 there


@dataclass(frozen=True)
class GemvTiles:
    """One launch's tiling: output channels per program, inputs per loop step, warps, stages."""

    block_n: int = 16
    block_k: int = 1024
    num_warps: int = 8
    num_stages: int = 3


# Tiles by weight bytes per element, and by (out features, in features, weight bytes per element)
# where a sweep on an H100 found better ones (benchmarks/gpu_kernels.py --tiles-json, each call
# timed from CUDA-graph replays as the decode step runs it): at every Llama-3-8B projection, 8
# channels per program, and for float8 weights mostly 2,048 inputs per loop step. Single-stream
# decode went from 83.9% to 85.0% of the bandwidth limit in bfloat16, 69.2% to 73.5% in fp8.
DEFAULT_TILES = {2: GemvTiles(), 1: GemvTiles(num_warps=4)}
TILES: dict[tuple[int, int, int], GemvTiles] = {
    (6144, 4096, 2): GemvTiles(block_n=8), (6144, 4096, 1): GemvTiles(block_n=8, num_warps=4),
    (4096, 4096, 2): GemvTiles(block_n=8), (4096, 4096, 1): GemvTiles(block_n=8, block_k=2048),
    (28672, 4096, 2): GemvTiles(block_n=8), (28672, 4096, 1): GemvTiles(block_n=8, block_k=2048, num_warps=4),
    (4096, 14336, 2): GemvTiles(block_n=8), (4096, 14336, 1): GemvTiles(block_n=8, block_k=2048),
}


# The sweeps ran one row. A call of more holds a [16, block_k] input tile for the tensor-core dot:
# at 2,048 inputs and 4 warps that spilled (fp8 gate/up's sm_90 build: 67 local loads and stores
# with Triton 3.6, 3,145 with 3.9; scripts/cuda_compile_check.py), so those calls take at most this
# many inputs a step.
MULTI_ROW_BLOCK_K = 1024


def tiles_for(n: int, k: int, itemsize: int, rows: int = 1) -> GemvTiles:
    tiles = TILES.get((n, k, itemsize)) or DEFAULT_TILES.get(itemsize, GemvTiles())
    if rows > 1 and tiles.block_k > MULTI_ROW_BLOCK_K:
        return replace(tiles, block_k=MULTI_ROW_BLOCK_K)
    return tiles


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, scale_ptr, bias_ptr, norm_ptr, residual_ptr, out_ptr,
    M, N, K, eps,
    stride_xm, stride_wn, stride_rm, stride_om,
    HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr, NORM: tl.constexpr, GATED: tl.constexpr,
    RESIDUAL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NATIVE_DOT: tl.constexpr,
):
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    half = x_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    squares = tl.zeros([BLOCK_M], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        k_ok = k < K
        x_at = x_ptr + offs_m[:, None] * stride_xm + k[None, :]
        x_ok = m_ok[:, None] & k_ok[None, :]
        x = tl.load(x_at, mask=x_ok, other=0.0)
        if GATED:  # silu(gate) * up, rounded as silu_and_mul rounds it; up sits K columns on
            gate = x.to(tl.float32)
            up = tl.load(x_at + K, mask=x_ok, other=0.0).to(tl.float32)
            x = (silu(gate).to(half).to(tl.float32) * up).to(half)
        if NORM:  # x times the norm's weight now, times 1 / RMS(x) once the row's squares are summed
            squares += tl.sum(x.to(tl.float32) * x.to(tl.float32), axis=1)
            norm = tl.load(norm_ptr + k, mask=k_ok, other=0.0).to(tl.float32)
            x = (x.to(tl.float32) * norm[None, :]).to(half)
        w_at = w_ptr + offs_n[:, None] * stride_wn + k[None, :]
        w = tl.load(w_at, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        if BLOCK_M == 1:  # one row: a reduction on the CUDA cores, no padded tensor-core tile
            acc += tl.sum(w.to(tl.float32) * x.to(tl.float32), axis=1)[None, :]
        elif NATIVE_DOT:  # the activations' half type on the tensor cores (float8 widens exactly)
            acc += tl.dot(x, tl.trans(w.to(half)))
        else:
            acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")  # not TF32
    if NORM:
        acc = acc * (1.0 / tl.sqrt(squares / K + eps))[:, None]
    if HAS_SCALE:
        acc = acc * tl.load(scale_ptr + offs_n, mask=n_ok, other=0.0)[None, :]
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out_ok = m_ok[:, None] & n_ok[None, :]
    if RESIDUAL:  # the product rounded, then added, as a separate add of the two would
        residual_at = residual_ptr + offs_m[:, None] * stride_rm + offs_n[None, :]
        residual = tl.load(residual_at, mask=out_ok, other=0.0)
        acc = acc.to(out_ptr.dtype.element_ty).to(tl.float32) + residual.to(tl.float32)
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=out_ok)


def gemv(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None = None,
         bias: torch.Tensor | None = None, tiles: GemvTiles | None = None, *,
         norm: tuple[torch.Tensor, float] | None = None, gated: bool = False,
         residual: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (M <= MAX_ROWS) times weight [N, K] (any float type, float8 included), scaled per
    output channel by scale [N] (float32) and offset by bias [N] -> [M, N] in x's dtype, tiled
    as `tiles` (default: tiles_for the shape). What the layers around a projection would do first
    or after, folded in: `norm` (weight [K], eps) takes the RMSNorm of x as the input; `gated`
    takes x [M, 2K] as a fused gate/up output and silu(gate) * up as the input; `residual` [M, N]
    is added to the result."""
    rows, k = x.shape
    k //= 2 if gated else 1
    n = weight.shape[0]
    if rows > MAX_ROWS:
        raise ValueError(f"gemv takes at most {MAX_ROWS} rows, got {rows}")
    x = x.contiguous()
    residual = residual.contiguous() if residual is not None else None
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    tiles = tiles or tiles_for(n, k, weight.element_size(), rows)
    norm_weight, eps = norm or (weight, 0.0)
    _gemv_kernel[(triton.cdiv(n, tiles.block_n),)](
        x, weight, scale if scale is not None else weight, bias if bias is not None else weight, norm_weight,
        residual if residual is not None else out, out,
        rows, n, k, eps, x.stride(0), weight.stride(0), residual.stride(0) if residual is not None else 0,
        out.stride(0),
        HAS_SCALE=scale is not None, HAS_BIAS=bias is not None, NORM=norm is not None, GATED=gated,
        RESIDUAL=residual is not None,
        BLOCK_M=1 if rows == 1 else MAX_ROWS, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
        NATIVE_DOT=x.dtype in (torch.bfloat16, torch.float16) and not INTERPRETED,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )
    return out
