"""The decoder layer's small elementwise steps as single Triton kernels, for CUDA.

At decode batch sizes each PyTorch op is one kernel launch of a few microseconds over a few KB:
a layer's residual adds, RMSNorms and SiLU-and-multiply were eight launches of the roughly twenty
a Llama layer takes (CUDA graphs remove the host's launch cost, not the GPU's per-kernel cost).
At prefill sizes they are passes over tens of MB each, and fusing them saves passes:
- add_rms_norm: residual + x and the RMSNorm of the sum, in one pass (vLLM's fused_add_rms_norm);
- rms_norm_add: residual + the RMSNorm of x (Gemma 3 norms a block's output before adding it);
- silu_and_mul, gelu_tanh_and_mul: the activation of gate times up from the fused gate/up
  projection's output, in one pass;
- rotary_and_cache: q and k rotated (after the RMSNorm of each head that Qwen3 and Gemma 3 have:
  about five more PyTorch ops) and the new K/V written into the paged cache, straight from
  the QKV projection's output (five PyTorch ops, and at prefill three passes, before); into an
  int8 or fp8 cache as codes and a scale per token and head, as KVCache.write quantizes (that
  path took five ops more per layer, so an fp8 cache, half the K/V bytes, decoded slower). One
  program a token and head, one warp each, took 476 us a layer at a 16,384-token prefill on an
  H200 and 21 us at 448 decodes, 4-8x their bytes' time; from ALL_HEADS_FROM_TOKENS tokens a
  program takes all of a token's heads (not yet timed on a GPU: benchmarks/gpu_kernels.py --rotary).
Rounding follows PyTorch's ops: the sum is rounded to the activations' dtype before it is
normalised, the norm computes in float32, and the rotation rounds x * cos before adding the rest,
as RotaryEmbedding's mul and addcmul do.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hyperserve.layers.attention import KVCache, quantized_bound


@triton.jit
def _add_rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, new_residual_ptr, stride_x, stride_r, eps,
                         N: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    ok = offs < N
    x = tl.load(x_ptr + row * stride_x + offs, mask=ok, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * stride_r + offs, mask=ok, other=0.0)
        x = x.to(tl.float32) + residual.to(tl.float32)
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
            N=n, BLOCK=triton.next_power_of_2(n), HAS_RESIDUAL=residual is not None,
            num_warps=4 if n <= 4096 else 8)
    return out, summed


@triton.jit
def _rms_norm_add_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, stride_x, stride_r, eps,
                         N: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    ok = offs < N
    x = tl.load(x_ptr + row * stride_x + offs, mask=ok, other=0.0).to(tl.float32)
    residual = tl.load(residual_ptr + row * stride_r + offs, mask=ok, other=0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / N + eps)
    weight = tl.load(weight_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    normed = (x * rstd * weight).to(residual.dtype).to(tl.float32)  # rounded, as the norm's output is
    tl.store(out_ptr + row * N + offs, (residual.to(tl.float32) + normed).to(residual.dtype), mask=ok)


def rms_norm_add(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """residual + rms_norm(x) * weight for x and residual [T, N]: Gemma 3's norm of a block's output
    before its residual add (add_rms_norm's order the other way round)."""
    rows, n = x.shape
    out = torch.empty_like(residual)
    if rows:
        _rms_norm_add_kernel[(rows,)](x, residual, weight, out, x.stride(0), residual.stride(0), eps,
                                      N=n, BLOCK=triton.next_power_of_2(n), num_warps=4 if n <= 4096 else 8)
    return out


@triton.jit
def silu(x):
    """x * sigmoid(x) of float32 x, as F.silu computes it before rounding."""
    return x / (1.0 + tl.exp(-x))


@triton.jit
def _gated_kernel(gate_up_ptr, out_ptr, stride_in, N: tl.constexpr, BLOCK: tl.constexpr, GELU: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N
    gate = tl.load(gate_up_ptr + row * stride_in + offs, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * stride_in + N + offs, mask=ok, other=0.0)
    if GELU:  # the tanh approximation: 0.5 x (1 + tanh(y)) = x sigmoid(2 y)
        inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        act = gate / (1.0 + tl.exp(-2.0 * inner))
    else:
        act = silu(gate)
    act = act.to(up.dtype).to(tl.float32)  # rounded, as F.silu's or F.gelu's output is
    tl.store(out_ptr + row * N + offs, (act * up.to(tl.float32)).to(up.dtype), mask=ok)


def _gated(gate_up: torch.Tensor, gelu: bool) -> torch.Tensor:
    rows, width = gate_up.shape
    n = width // 2
    out = torch.empty(rows, n, dtype=gate_up.dtype, device=gate_up.device)
    if rows:
        block = 1024
        _gated_kernel[(rows, triton.cdiv(n, block))](gate_up, out, gate_up.stride(0), N=n, BLOCK=block,
                                                     GELU=gelu)
    return out


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2N] (gate then up) -> silu(gate) * up, [T, N]."""
    return _gated(gate_up, gelu=False)


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2N] (gate then up) -> gelu(gate, approximate="tanh") * up, [T, N] (Gemma's MLP)."""
    return _gated(gate_up, gelu=True)


@triton.jit
def _cache_rows(cache_ptr, scale_ptr, rows, x, offs, ok, BOUND: tl.constexpr, ROUND: tl.constexpr):
    """Write heads' rows x [BLOCK_H, D] into the cache at rows [BLOCK_H] where ok: as they are where
    BOUND is 0; else as codes with one symmetric scale a row, stored at scale_ptr, rounded half to
    even to integers when ROUND (int8), or cast to the cache's float8 type."""
    at = cache_ptr + rows[:, None] * x.shape[1] + offs[None, :]
    if BOUND == 0:
        tl.store(at, x, mask=ok[:, None])
    else:
        x = x.to(tl.float32)
        # the scale as attention._quantize_rows makes it (times 1 / BOUND, in float32); the codes by
        # IEEE division, as PyTorch's: Triton's "/" is approximate on CUDA, which moves a code that
        # should sit on a half (common with bfloat16 inputs) to the other side of it
        scale = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-8) * (1.0 / BOUND)
        scaled = tl.math.div_rn(x, scale[:, None])
        if ROUND:
            rounded = tl.floor(scaled + 0.5)
            odd = rounded - 2.0 * tl.floor(rounded * 0.5) != 0.0
            rounded = tl.where((rounded - scaled == 0.5) & odd, rounded - 1.0, rounded)
            scaled = tl.minimum(tl.maximum(rounded, -BOUND), BOUND)
        tl.store(at, scaled.to(cache_ptr.dtype.element_ty), mask=ok[:, None])
        tl.store(scale_ptr + rows, scale, mask=ok)


@triton.jit
def _rotary_and_cache_kernel(qkv_ptr, cos_ptr, sin_ptr, slots_ptr, q_ptr, k_ptr, key_cache_ptr,
                             value_cache_ptr, key_scale_ptr, value_scale_ptr, q_norm_ptr, k_norm_ptr, eps,
                             stride_qkv, stride_cos,
                             NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, D: tl.constexpr,
                             HEADS: tl.constexpr, BLOCK_H: tl.constexpr, BOUND: tl.constexpr,
                             ROUND: tl.constexpr, QK_NORM: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * HEADS + tl.arange(0, BLOCK_H)  # q heads, then k heads, then v heads
    ok = (tl.arange(0, BLOCK_H) < HEADS) & (heads < NUM_HEADS + 2 * NUM_KV_HEADS)
    is_q = ok & (heads < NUM_HEADS)
    rotates = ok & (heads < NUM_HEADS + NUM_KV_HEADS)
    is_k = rotates & ~is_q
    is_v = ok & ~rotates
    offs = tl.arange(0, D)
    row = qkv_ptr + token * stride_qkv + heads[:, None] * D
    slot = tl.load(slots_ptr + token).to(tl.int64)
    x = tl.load(row + offs[None, :], mask=ok[:, None], other=0.0)  # [BLOCK_H, D]
    # rotate_half's source, its sign in sin
    partner_offs = (offs + D // 2) % D
    partner = tl.load(row + partner_offs[None, :], mask=rotates[:, None], other=0.0).to(tl.float32)
    if QK_NORM:  # Qwen3's and Gemma 3's RMSNorm of each q and k head before the rotation, rounded once
        wide = x.to(tl.float32)
        rstd = (1.0 / tl.sqrt(tl.sum(wide * wide, axis=1) / D + eps))[:, None]
        norm = tl.where(is_q, q_norm_ptr, k_norm_ptr)[:, None]  # each head's weight [D]
        weight = tl.load(norm + offs[None, :], mask=rotates[:, None], other=0.0).to(tl.float32)
        partner_weight = tl.load(norm + partner_offs[None, :], mask=rotates[:, None], other=0.0)
        partner_weight = partner_weight.to(tl.float32)
        x = tl.where(rotates[:, None], (wide * rstd * weight).to(x.dtype), x)  # v heads as they are
        partner = (partner * rstd * partner_weight).to(x.dtype).to(tl.float32)
    cos = tl.load(cos_ptr + token * stride_cos + offs)[None, :]
    sin = tl.load(sin_ptr + token * stride_cos + offs).to(tl.float32)[None, :]
    scaled = (x.to(tl.float32) * cos.to(tl.float32)).to(x.dtype).to(tl.float32)
    rotated = (scaled + partner * sin).to(x.dtype)
    tl.store(q_ptr + (token * NUM_HEADS + heads[:, None]) * D + offs[None, :], rotated, mask=is_q[:, None])
    k_head = heads - NUM_HEADS
    tl.store(k_ptr + (token * NUM_KV_HEADS + k_head[:, None]) * D + offs[None, :], rotated,
             mask=is_k[:, None])
    _cache_rows(key_cache_ptr, key_scale_ptr, slot * NUM_KV_HEADS + k_head, rotated, offs, is_k, BOUND, ROUND)
    _cache_rows(value_cache_ptr, value_scale_ptr, slot * NUM_KV_HEADS + k_head - NUM_KV_HEADS, x, offs, is_v,
                BOUND, ROUND)


# From this many tokens a program rotates and writes all of a token's heads; below it, one head
# each, so that a single token's few kilobytes still spread over many SMs.
ALL_HEADS_FROM_TOKENS = 32


def rotary_and_cache(qkv: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], slots: torch.Tensor,
                     kv_cache: KVCache, num_heads: int, num_kv_heads: int,
                     qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qkv [T, (H + 2 Hkv) * D] (q, k, v heads in a row) -> (q [T, H, D] and k [T, Hkv, D], rotated
    by RotaryEmbedding's (cos, signed sin) [T, 1, D]; v [T, Hkv, D], a view of qkv), with k and v
    also written at their cache slots [T] of kv_cache, quantized as KVCache.write does where the
    cache is int8 or fp8. `qk_norm` (q's weight [D], k's weight [D], eps): each q and k head is
    RMS-normalised first (Qwen3, Gemma 3)."""
    tokens = qkv.shape[0]
    head_dim = kv_cache.key.shape[-1]
    q = torch.empty(tokens, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    k = torch.empty(tokens, num_kv_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    cos, sin = (t.reshape(tokens, head_dim) for t in cos_sin)
    bound = quantized_bound(kv_cache.key.dtype) if kv_cache.quantized else 0.0
    all_heads = num_heads + 2 * num_kv_heads
    heads = all_heads if tokens >= ALL_HEADS_FROM_TOKENS else 1
    if heads > 1 and qk_norm is not None and kv_cache.quantized:
        # a token's heads with their norms and scales spill at 8 warps (Llama-3-8B's 48 heads into an
        # fp8 cache, sm_90: scripts/cuda_compile_check.py); half of them a program do not
        heads = triton.cdiv(all_heads, 2)
    if tokens:
        _rotary_and_cache_kernel[(tokens, triton.cdiv(all_heads, heads))](
            qkv, cos, sin, slots, q, k, kv_cache.key, kv_cache.value,
            kv_cache.key_scale if kv_cache.quantized else q,
            kv_cache.value_scale if kv_cache.quantized else q,
            *(qk_norm or (q, q, 0.0)),
            qkv.stride(0), cos.stride(0), NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, D=head_dim,
            HEADS=heads, BLOCK_H=triton.next_power_of_2(heads), BOUND=bound,
            ROUND=kv_cache.key.dtype == torch.int8, QK_NORM=qk_norm is not None,
            num_warps=1 if heads == 1 else 8)
    v = qkv[:, (num_heads + num_kv_heads) * head_dim :].unflatten(-1, (num_kv_heads, head_dim))
    return q, k, v
