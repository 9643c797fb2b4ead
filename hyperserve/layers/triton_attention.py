"""Paged decode attention in Triton: one new query token per sequence against its cached K/V.

Decode attention reads every cached K/V byte of the batch once per step and does little math on
it, so the kernel is shaped for bandwidth:
- one program per (sequence, KV head, context split): the G query heads that share a KV head are
  one [G, D] tile, so GQA reads each K/V block once, not G times;
- each iteration reads TILE_TOKENS tokens (several blocks, their table entries loaded together),
  so more loads are in flight than one 16-token block at a time keeps;
- split-K: a long context is cut into NUM_SPLITS ranges of whole blocks, each with its own
  program, so one long sequence still occupies every SM; a second kernel merges the splits'
  partial outputs by their log-sum-exp;
- the split count depends only on the batch shape, never on context lengths, so a CUDA graph
  captured for a batch size stays valid while contexts grow (splits past the end exit at once).

K/V are read through the block table straight from the cache ([slots, Hkv, D], the layout
KVCache keeps). A 16-bit cache goes into the tensor cores as it is, accumulating in float32. A
quantized cache (int8/fp8 codes with a scale per token and head) is widened to float32 in
registers and scaled there, and its dots run in tf32: on an H100 that took a 512-sequence step
10% less time than feeding its codes as bfloat16 with the scales on the scores. Float32 models,
and Triton's interpreter (whose 16-bit dots are wrong), take float32 dots in full precision. A
sequence with context length 0 (a padding row of a CUDA graph) gets zeros.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# Programs wanted per step, per SM, when choosing the split count; and the most splits.
PROGRAMS_PER_SM = 2
MAX_SPLITS = 32
TILE_TOKENS = 64  # context tokens read per loop iteration: a power of two (whole blocks; at least one)


@triton.jit
def _decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, block_tables_ptr, context_lens_ptr,
    partial_out_ptr, partial_lse_ptr,
    scale, sliding_window,
    stride_q_seq, stride_q_head,
    stride_cache_slot, stride_cache_head,
    stride_scale_slot,
    stride_table_seq,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCKS_PER_TILE: tl.constexpr, NUM_SPLITS: tl.constexpr, QUANTIZED: tl.constexpr,
    WINDOWED: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    context_len = tl.load(context_lens_ptr + seq)
    first = 0
    if WINDOWED:
        first = tl.maximum(context_len - sliding_window, 0)
    first_block = first // BLOCK_SIZE
    end_block = tl.cdiv(context_len, BLOCK_SIZE)
    blocks_per_split = tl.cdiv(end_block - first_block, NUM_SPLITS)
    split_start = first_block + split * blocks_per_split
    split_end = tl.minimum(split_start + blocks_per_split, end_block)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_t = tl.arange(0, BLOCKS_PER_TILE * BLOCK_SIZE)
    heads = kv_head * GROUP + offs_g
    g_ok = offs_g < GROUP
    d_ok = offs_d < HEAD_DIM
    q = tl.load(q_ptr + seq * stride_q_seq + heads[:, None] * stride_q_head + offs_d[None, :],
                mask=g_ok[:, None] & d_ok[None, :], other=0.0).to(DOT_DTYPE)  # [BLOCK_G, BLOCK_D]

    m = tl.full([BLOCK_G], float("-inf"), tl.float32)  # running max of the scores
    denom = tl.zeros([BLOCK_G], tl.float32)  # running sum of exp(score - m)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for tile_start in range(split_start, split_end, BLOCKS_PER_TILE):  # a tile's first block holds context
        block_index = tile_start + offs_t // BLOCK_SIZE  # [TILE]
        in_split = block_index < split_end
        block = tl.load(block_tables_ptr + seq * stride_table_seq + block_index, mask=in_split, other=0).to(tl.int64)
        slots = block * BLOCK_SIZE + offs_t % BLOCK_SIZE
        positions = block_index * BLOCK_SIZE + offs_t % BLOCK_SIZE
        visible = in_split & (positions < context_len) & (positions >= first)
        kv_offsets = slots[:, None] * stride_cache_slot + kv_head * stride_cache_head + offs_d[None, :]
        kv_ok = visible[:, None] & d_ok[None, :]
        k = tl.load(k_cache_ptr + kv_offsets, mask=kv_ok, other=0.0).to(DOT_DTYPE)  # [TILE, BLOCK_D]
        v = tl.load(v_cache_ptr + kv_offsets, mask=kv_ok, other=0.0).to(DOT_DTYPE)
        if QUANTIZED:  # codes times their token's scale; DOT_DTYPE is float32 here
            k = k * tl.load(k_scale_ptr + slots * stride_scale_slot + kv_head, mask=visible, other=0.0)[:, None]
            v = v * tl.load(v_scale_ptr + slots * stride_scale_slot + kv_head, mask=visible, other=0.0)[:, None]
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        scores = tl.where(visible[None, :], scores * scale, float("-inf"))  # [BLOCK_G, TILE]
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(scores - m_new[:, None])
        denom = denom * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v, input_precision=PRECISION)
        m = m_new

    empty = denom == 0.0  # this split holds none of the context
    out = acc / tl.where(empty, 1.0, denom)[:, None]
    lse = tl.where(empty, float("-inf"), m + tl.log(tl.where(empty, 1.0, denom)))
    rows = (seq * GROUP * tl.num_programs(1) + heads) * NUM_SPLITS + split  # [B, H, NUM_SPLITS] flat
    tl.store(partial_out_ptr + rows[:, None] * HEAD_DIM + offs_d[None, :], out, mask=g_ok[:, None] & d_ok[None, :])
    tl.store(partial_lse_ptr + rows, lse, mask=g_ok)


@triton.jit
def _merge_splits_kernel(
    partial_out_ptr, partial_lse_ptr, out_ptr,
    stride_out_seq, stride_out_head,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_ok = offs_s < NUM_SPLITS
    d_ok = offs_d < HEAD_DIM
    rows = (seq * NUM_HEADS + head) * NUM_SPLITS + offs_s
    lse = tl.load(partial_lse_ptr + rows, mask=s_ok, other=float("-inf"))  # [BLOCK_S]
    top = tl.max(lse, axis=0)
    weights = tl.where(s_ok & (lse > float("-inf")), tl.exp(lse - tl.where(top > float("-inf"), top, 0.0)), 0.0)
    partial = tl.load(partial_out_ptr + rows[:, None] * HEAD_DIM + offs_d[None, :],
                      mask=s_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_S, BLOCK_D]
    total = tl.sum(weights, axis=0)
    out = tl.sum(partial * weights[:, None], axis=0) / tl.where(total > 0.0, total, 1.0)
    tl.store(out_ptr + seq * stride_out_seq + head * stride_out_head + offs_d, out.to(out_ptr.dtype.element_ty),
             mask=d_ok)


def dot_dtype(dtype: torch.dtype, quantized: bool) -> tl.dtype:
    """The dots' input dtype: a 16-bit cache's own on a GPU, float32 otherwise."""
    if quantized or dtype == torch.float32 or os.environ.get("TRITON_INTERPRET") == "1":
        return tl.float32
    return tl.bfloat16 if dtype == torch.bfloat16 else tl.float16


def num_splits_for(batch: int, num_kv_heads: int, max_blocks: int, device: torch.device,
                   programs_per_sm: int = PROGRAMS_PER_SM) -> int:
    """Enough context splits that batch * kv_heads * splits programs fill the GPU
    programs_per_sm times over."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
    wanted = triton.cdiv(programs_per_sm * sms, batch * num_kv_heads)
    return max(1, min(wanted, MAX_SPLITS, max_blocks))


def paged_decode_attention(
    q: torch.Tensor,  # [B, H, D]
    key_cache: torch.Tensor,  # [num_slots, Hkv, D]
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int
    context_lens: torch.Tensor,  # [B] int: tokens each query attends to (itself included)
    block_size: int,
    scale: float,
    sliding_window: int | None = None,
    key_scale: torch.Tensor | None = None,  # [num_slots, Hkv] float32 for quantized caches
    value_scale: torch.Tensor | None = None,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,  # [B, H, D]; may be a strided view (rows of a larger batch)
    tile_tokens: int | None = None,  # None: TILE_TOKENS
    num_warps: int = 4,
) -> torch.Tensor:
    batch, num_heads, head_dim = q.shape
    num_kv_heads = key_cache.shape[1]
    group = num_heads // num_kv_heads
    if num_splits is None:
        num_splits = num_splits_for(batch, num_kv_heads, block_tables.shape[1], q.device)
    out = torch.empty_like(q) if out is None else out
    if batch == 0:
        return out
    partial_out = torch.empty(batch, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
    partial_lse = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=q.device)
    quantized = key_scale is not None
    dot = dot_dtype(q.dtype, quantized)
    block_d = max(16, triton.next_power_of_2(head_dim))
    _decode_split_kernel[(batch, num_kv_heads, num_splits)](
        q, key_cache, value_cache, key_scale if quantized else key_cache, value_scale if quantized else value_cache,
        block_tables, context_lens, partial_out, partial_lse,
        scale, sliding_window or 0,
        q.stride(0), q.stride(1), key_cache.stride(0), key_cache.stride(1),
        key_scale.stride(0) if quantized else 0, block_tables.stride(0),
        GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_SIZE=block_size, BLOCKS_PER_TILE=max(1, (tile_tokens or TILE_TOKENS) // block_size),
        NUM_SPLITS=num_splits, QUANTIZED=quantized, WINDOWED=sliding_window is not None,
        DOT_DTYPE=dot, PRECISION="ieee" if q.dtype == torch.float32 else "tf32", num_warps=num_warps,
    )
    _merge_splits_kernel[(batch, num_heads)](
        partial_out, partial_lse, out, out.stride(0), out.stride(1),
        NUM_HEADS=num_heads, HEAD_DIM=head_dim, BLOCK_D=block_d,
        NUM_SPLITS=num_splits, BLOCK_S=triton.next_power_of_2(num_splits),
    )
    return out
