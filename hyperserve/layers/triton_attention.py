"""Paged attention in Triton: decodes (one new query token per sequence) and prefill chunks (many),
both reading K/V through the block tables straight from the cache.

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

Prefill attention is bound by arithmetic, not bytes, so it is shaped as FlashAttention-2's forward:
one program per (BLOCK_M query rows of one span, query head), streaming the span's keys in tiles
of BLOCK_N with an online softmax. Every span of a step (new prompts, chunks after a cached
prefix or an earlier chunk) runs in one launch per layer, where the portable backend made one
SDPA call per span, and a span with context gathered its K/V and built a mask first. Where every
span is short (a prefix-cache hit's last tokens, a speculative verify span, a small chunk), a
tile's rows are its span's rows times the query heads of one KV group, as the decode kernel's
are: one program per group reads the keys once, where one per head left most of each tile empty
and read them once a head.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl
import triton.runtime.errors

# Programs wanted per step, per SM, when choosing the split count; and the most splits.
PROGRAMS_PER_SM = 2
MAX_SPLITS = 32
TILE_TOKENS = 64  # context tokens read per loop iteration: a power of two (whole blocks; at least one)


@triton.jit
def _soft_cap(x, cap):
    """cap * tanh(x / cap) (Gemma 2's scores), tanh as 2 sigmoid(2 y) - 1."""
    return cap * (2.0 * tl.sigmoid(2.0 * x / cap) - 1.0)


@triton.jit
def _decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, block_tables_ptr, context_lens_ptr,
    partial_out_ptr, partial_lse_ptr,
    scale, sliding_window, softcap,
    stride_q_seq, stride_q_head,
    stride_cache_slot, stride_cache_head,
    stride_scale_slot,
    stride_table_seq,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCKS_PER_TILE: tl.constexpr, NUM_SPLITS: tl.constexpr,
    QUANTIZED: tl.constexpr,
    WINDOWED: tl.constexpr, SOFTCAPPED: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
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
        block = tl.load(block_tables_ptr + seq * stride_table_seq + block_index, mask=in_split,
                        other=0).to(tl.int64)
        slots = block * BLOCK_SIZE + offs_t % BLOCK_SIZE
        positions = block_index * BLOCK_SIZE + offs_t % BLOCK_SIZE
        visible = in_split & (positions < context_len) & (positions >= first)
        kv_offsets = slots[:, None] * stride_cache_slot + kv_head * stride_cache_head + offs_d[None, :]
        kv_ok = visible[:, None] & d_ok[None, :]
        k = tl.load(k_cache_ptr + kv_offsets, mask=kv_ok, other=0.0).to(DOT_DTYPE)  # [TILE, BLOCK_D]
        v = tl.load(v_cache_ptr + kv_offsets, mask=kv_ok, other=0.0).to(DOT_DTYPE)
        if QUANTIZED:  # codes times their token's scale; DOT_DTYPE is float32 here
            scale_offsets = slots * stride_scale_slot + kv_head
            k = k * tl.load(k_scale_ptr + scale_offsets, mask=visible, other=0.0)[:, None]
            v = v * tl.load(v_scale_ptr + scale_offsets, mask=visible, other=0.0)[:, None]
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        if SOFTCAPPED:
            scores = _soft_cap(scores, softcap)
        scores = tl.where(visible[None, :], scores, float("-inf"))  # [BLOCK_G, TILE]
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
    tl.store(partial_out_ptr + rows[:, None] * HEAD_DIM + offs_d[None, :], out,
             mask=g_ok[:, None] & d_ok[None, :])
    tl.store(partial_lse_ptr + rows, lse, mask=g_ok)


@triton.jit
def _merge_splits_kernel(
    partial_out_ptr, partial_lse_ptr, out_ptr, sinks_ptr,
    stride_out_seq, stride_out_head,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, SINKS: tl.constexpr,
):
    # with SINKS, the head's sink logit joins the softmax's denominator here, once, not in every split
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_ok = offs_s < NUM_SPLITS
    d_ok = offs_d < HEAD_DIM
    rows = (seq * NUM_HEADS + head) * NUM_SPLITS + offs_s
    lse = tl.load(partial_lse_ptr + rows, mask=s_ok, other=float("-inf"))  # [BLOCK_S]
    top = tl.max(lse, axis=0)
    if SINKS:
        sink = tl.load(sinks_ptr + head).to(tl.float32)
        top = tl.maximum(top, sink)
    shift = tl.where(top > float("-inf"), top, 0.0)
    weights = tl.where(s_ok & (lse > float("-inf")), tl.exp(lse - shift), 0.0)
    partial = tl.load(partial_out_ptr + rows[:, None] * HEAD_DIM + offs_d[None, :],
                      mask=s_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_S, BLOCK_D]
    total = tl.sum(weights, axis=0)
    if SINKS:
        total += tl.exp(sink - shift)
    out = tl.sum(partial * weights[:, None], axis=0) / tl.where(total > 0.0, total, 1.0)
    tl.store(out_ptr + seq * stride_out_seq + head * stride_out_head + offs_d,
             out.to(out_ptr.dtype.element_ty),
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
    softcap: float | None = None,  # scores capped to softcap * tanh(score / softcap) (Gemma 2)
    sinks: torch.Tensor | None = None,  # [H]: each head's sink logit (GPT-OSS)
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
        q, key_cache, value_cache, key_scale if quantized else key_cache,
        value_scale if quantized else value_cache, block_tables, context_lens, partial_out, partial_lse,
        scale, sliding_window or 0, softcap or 1.0,
        q.stride(0), q.stride(1), key_cache.stride(0), key_cache.stride(1),
        key_scale.stride(0) if quantized else 0, block_tables.stride(0),
        GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_SIZE=block_size, BLOCKS_PER_TILE=max(1, (tile_tokens or TILE_TOKENS) // block_size),
        NUM_SPLITS=num_splits, QUANTIZED=quantized, WINDOWED=sliding_window is not None,
        SOFTCAPPED=softcap is not None, DOT_DTYPE=dot,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", num_warps=num_warps,
    )
    _merge_splits_kernel[(batch, num_heads)](
        partial_out, partial_lse, out, partial_lse if sinks is None else sinks, out.stride(0), out.stride(1),
        NUM_HEADS=num_heads, HEAD_DIM=head_dim, BLOCK_D=block_d,
        NUM_SPLITS=num_splits, BLOCK_S=triton.next_power_of_2(num_splits), SINKS=sinks is not None,
    )
    return out


@triton.jit
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, out_ptr, sinks_ptr,
    block_tables_ptr, query_starts_ptr, query_lens_ptr, context_starts_ptr,
    scale, sliding_window, softcap,
    stride_q_row, stride_q_head, stride_out_row, stride_out_head,
    stride_cache_slot, stride_cache_head, stride_scale_slot, stride_table_span,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, QUANTIZED: tl.constexpr, WINDOWED: tl.constexpr,
    SOFTCAPPED: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr, PACK: tl.constexpr,
    QUERY_ROWS: tl.constexpr, SINKS: tl.constexpr,
):
    # a tile's BLOCK_M rows are QUERY_ROWS query rows times PACK heads of one KV group (PACK is 1,
    # or the group when every span fits one tile: then K/V are read once for the group's heads)
    tile = tl.num_programs(0) - 1 - tl.program_id(0)  # a span's last rows see the most keys: start them first
    span = tl.program_id(1)
    first_head = tl.program_id(2) * PACK
    query_len = tl.load(query_lens_ptr + span)
    if tile * QUERY_ROWS >= query_len:  # the grid is sized for the longest span
        return
    query_start = tl.load(query_starts_ptr + span)  # the span's first row in the flat batch
    context_start = tl.load(context_starts_ptr + span)  # position of its first new token
    kv_head = first_head // GROUP

    offs_p = tl.arange(0, BLOCK_M)
    offs_m = tile * QUERY_ROWS + offs_p // PACK  # each tile row's query row within the span
    heads = first_head + offs_p % PACK  # and its query head
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    m_ok = (offs_p < QUERY_ROWS * PACK) & (offs_m < query_len)
    d_ok = offs_d < HEAD_DIM
    query_pos = context_start + offs_m  # [BLOCK_M]
    rows = query_start + offs_m
    q = tl.load(q_ptr + rows[:, None] * stride_q_row + heads[:, None] * stride_q_head + offs_d[None, :],
                mask=m_ok[:, None] & d_ok[None, :], other=0.0).to(DOT_DTYPE)  # [BLOCK_M, BLOCK_D]

    last_pos = context_start + tl.minimum(tile * QUERY_ROWS + QUERY_ROWS, query_len) - 1  # its last query
    key_end = last_pos + 1  # causal: no row of the tile sees past its last query
    key_start = 0
    if WINDOWED:  # the tile's first query sees back to its window's start
        key_start = tl.maximum(context_start + tile * QUERY_ROWS - sliding_window + 1, 0)
        key_start = key_start // BLOCK_SIZE * BLOCK_SIZE

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max of the scores
    denom = tl.zeros([BLOCK_M], tl.float32)  # running sum of exp(score - m)
    if SINKS:  # each head's sink logit is the first score of every row: a key with no value
        m = tl.load(sinks_ptr + heads).to(tl.float32)
        denom += 1.0
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for tile_start in range(key_start, key_end, BLOCK_N):
        key_pos = tile_start + offs_n  # [BLOCK_N]
        in_range = key_pos < key_end
        block = tl.load(block_tables_ptr + span * stride_table_span + key_pos // BLOCK_SIZE, mask=in_range,
                        other=0).to(tl.int64)
        slots = block * BLOCK_SIZE + key_pos % BLOCK_SIZE
        kv_offsets = slots[:, None] * stride_cache_slot + kv_head * stride_cache_head + offs_d[None, :]
        kv_ok = in_range[:, None] & d_ok[None, :]
        k = tl.load(k_cache_ptr + kv_offsets, mask=kv_ok, other=0.0)  # [BLOCK_N, BLOCK_D]
        v = tl.load(v_cache_ptr + kv_offsets, mask=kv_ok, other=0.0)
        if QUANTIZED:  # codes times their token's scale, then the dots' dtype
            k_scale = tl.load(k_scale_ptr + slots * stride_scale_slot + kv_head, mask=in_range, other=0.0)
            v_scale = tl.load(v_scale_ptr + slots * stride_scale_slot + kv_head, mask=in_range, other=0.0)
            k = k.to(tl.float32) * k_scale[:, None]
            v = v.to(tl.float32) * v_scale[:, None]
        scores = tl.dot(q, tl.trans(k.to(DOT_DTYPE)), input_precision=PRECISION) * scale  # [BLOCK_M, BLOCK_N]
        if SOFTCAPPED:
            scores = _soft_cap(scores, softcap)
        visible = in_range[None, :] & (key_pos[None, :] <= query_pos[:, None])
        if WINDOWED:
            visible &= query_pos[:, None] - key_pos[None, :] < sliding_window
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that sees nothing yet stays at zero
        alpha = tl.exp(m - m_safe)
        p = tl.exp(scores - m_safe[:, None])
        denom = denom * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision=PRECISION)
        m = m_new

    out = acc / tl.where(denom == 0.0, 1.0, denom)[:, None]
    tl.store(out_ptr + rows[:, None] * stride_out_row + heads[:, None] * stride_out_head + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])


@dataclass(frozen=True)
class PrefillTiles:
    """The prefill kernel's tiles: query rows and keys per iteration, warps, pipeline stages."""

    block_m: int = 128
    block_n: int = 128
    num_warps: int = 8
    num_stages: int = 2

    def halved(self) -> PrefillTiles | None:
        """Smaller tiles for a GPU whose shared memory the launch overran; None below 16 x 16."""
        if self.block_m == self.block_n == 16:
            return None
        return replace(self, block_m=max(16, self.block_m // 2), block_n=max(16, self.block_n // 2),
                       num_warps=4)


def prefill_tiles(itemsize: int, block_d: int) -> PrefillTiles:
    """128 query rows by 128 keys, 8 warps, 2 stages for 16-bit heads up to 128 wide: the best
    all-round on an H200 (benchmarks/gpu_kernels.py --prefill) of 16 swept, bf16 and fp8 caches.
    Halved for each doubling of a row's bytes, so the Q tile and the pipelined K/V tiles stay within
    shared memory and the [BLOCK_M, BLOCK_D] accumulator within registers."""
    tiles, row_bytes = PrefillTiles(), block_d * itemsize
    while row_bytes > 256 and (smaller := tiles.halved()) is not None:
        tiles, row_bytes = smaller, row_bytes // 2
    return tiles


# tiles that launched, per (device, row bytes, cache dtype): the first launch on a GPU with less
# shared memory than Hopper's halves its tiles until one fits, and later launches start there
_FITTED: dict[tuple, PrefillTiles] = {}


def paged_prefill_attention(
    q: torch.Tensor,  # [T, H, D], the step's flat batch
    key_cache: torch.Tensor,  # [num_slots, Hkv, D]; every span's new K/V already written
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [S, max_blocks] int, one row per span
    query_starts: torch.Tensor,  # [S] int: each span's first row of q
    query_lens: torch.Tensor,  # [S] int: its rows
    context_starts: torch.Tensor,  # [S] int: position of its first row (tokens before it in the cache)
    max_query_len: int,
    block_size: int,
    scale: float,
    out: torch.Tensor,  # [T, H, D]: the spans' rows are written, the others left as they are
    sliding_window: int | None = None,
    key_scale: torch.Tensor | None = None,  # [num_slots, Hkv] float32 for quantized caches
    value_scale: torch.Tensor | None = None,
    tiles: PrefillTiles | None = None,  # None: prefill_tiles', or what fitted this GPU
    pack_heads: bool = True,  # False: one query head per tile even for short spans (to compare)
    softcap: float | None = None,  # scores capped to softcap * tanh(score / softcap) (Gemma 2)
    sinks: torch.Tensor | None = None,  # [H]: each head's sink logit (GPT-OSS)
) -> torch.Tensor:
    """Row r of span s (position context_starts[s] + r) attends to the span's positions 0..that one
    (within the window): its cached context and its own earlier rows."""
    num_spans = query_lens.shape[0]
    if num_spans == 0 or max_query_len == 0:
        return out
    num_heads, head_dim = q.shape[1], q.shape[2]
    block_d = max(16, triton.next_power_of_2(head_dim))
    quantized = key_scale is not None
    dot = dot_dtype(q.dtype, False)  # quantized K/V are scaled in float32, then cast to this
    group = num_heads // key_cache.shape[1]
    key = (q.device, q.dtype, block_d, key_cache.dtype)
    chosen = tiles or _FITTED.get(key) or prefill_tiles(q.element_size(), block_d)
    while True:
        pack = group if pack_heads and max_query_len * group <= chosen.block_m else 1  # a group a tile
        query_rows = chosen.block_m // pack
        try:
            _prefill_kernel[(triton.cdiv(max_query_len, query_rows), num_spans, num_heads // pack)](
                q, key_cache, value_cache, key_scale if quantized else key_cache,
                value_scale if quantized else value_cache, out, out if sinks is None else sinks, block_tables,
                query_starts, query_lens,
                context_starts, scale, sliding_window or 0, softcap or 1.0,
                q.stride(0), q.stride(1), out.stride(0), out.stride(1),
                key_cache.stride(0), key_cache.stride(1),
                key_scale.stride(0) if quantized else 0, block_tables.stride(0),
                GROUP=group, HEAD_DIM=head_dim, BLOCK_D=block_d,
                BLOCK_SIZE=block_size, BLOCK_M=chosen.block_m, BLOCK_N=chosen.block_n, QUANTIZED=quantized,
                WINDOWED=sliding_window is not None, SOFTCAPPED=softcap is not None, DOT_DTYPE=dot,
                PRECISION="ieee" if dot == tl.float32 else "tf32", PACK=pack, QUERY_ROWS=query_rows,
                SINKS=sinks is not None, num_warps=chosen.num_warps, num_stages=chosen.num_stages,
            )
        except triton.runtime.errors.OutOfResources:
            smaller = None if tiles else chosen.halved()  # tiles asked for are not changed
            if smaller is None:
                raise
            chosen = smaller
            continue
        if tiles is None:
            _FITTED[key] = chosen
        return out
