"""Attention over the paged KV cache, behind a small backend interface.

Each layer's cache is a KVCache: K and V as [num_slots, num_kv_heads, head_dim], token position p
of a sequence living in block table[p // block_size] at offset p % block_size, its "slot" being
block * block_size + offset. Context is gathered a whole block at a time (index_select over
contiguous blocks runs several times faster than per-slot indexing). The model runner builds one
AttentionMetadata per step and every layer reuses it, so no layer does index arithmetic.

K and V are written in place into the cache tensors themselves, never into views made inside the
forward: torch.compile turns writes into a view of an input into a copy of the whole cache.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F

from hyperserve.layers import HAS_TRITON, huge_pages

# A new prompt this long attends through SDPA on its own K/V (FlashAttention or cuDNN's) even where
# the backend takes a PrefillBatch: on an H200, one prompt of 8,192 tokens took 0.95 ms a layer
# that way against 2.2 ms in the Triton kernel, while 32 prompts of 512 took 2.0 ms against 0.45
# (benchmarks/gpu_kernels.py --prefill, 2026-11-29)
FLASH_PREFILL_TOKENS = 2048

# kv_cache_dtype -> (storage dtype, largest stored magnitude): quantized K/V keep one scale per
# token and head, so an outlier token costs precision only in its own row
KV_QUANTIZED = {"int8": (torch.int8, 127.0), "fp8": (torch.float8_e4m3fn, 448.0)}


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """Zeros that take no memory until written, on the CPU: pages the OS backs only when first
    touched (torch.zeros writes every page at once). 2 MiB pages where the kernel offers them: a
    step reads every block of a long context, scattered over the pool, and in 4 KiB pages each
    block cost TLB misses (SmolLM2 after 4,000 tokens: 71 -> 85 tokens/s, BENCHMARKS.md)."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    if huge_pages.available():
        return huge_pages.huge_page_memory(nbytes).view(dtype).view(shape)
    return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).view(shape)


@dataclass
class KVCache:
    """One layer's K and V, [num_slots, Hkv, D] each; with a quantized kv_cache_dtype also their
    scales, [num_slots, Hkv] in float32."""

    key: torch.Tensor
    value: torch.Tensor
    block_size: int
    key_scale: torch.Tensor | None = None
    value_scale: torch.Tensor | None = None

    @classmethod
    def allocate(cls, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 kv_cache_dtype: str, device: torch.device | str, shared: bool = False) -> KVCache:
        """shared: K and V are one tensor (DeepSeek's latent vectors, each token's key and value)."""
        shape = (num_blocks * block_size, num_kv_heads, head_dim)
        stored = dtype if kv_cache_dtype == "auto" else KV_QUANTIZED[kv_cache_dtype][0]
        key = _zeros(shape, stored, device)
        value = key if shared else _zeros(shape, stored, device)
        if kv_cache_dtype == "auto":
            return cls(key, value, block_size)
        key_scale = _zeros(shape[:2], torch.float32, device)
        value_scale = key_scale if shared else _zeros(shape[:2], torch.float32, device)
        return cls(key, value, block_size, key_scale, value_scale)

    @property
    def quantized(self) -> bool:
        return self.key_scale is not None

    @property
    def shared(self) -> bool:
        """K and V are one tensor: written, gathered, read and moved once."""
        return self.value is self.key

    def write(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store new tokens' K and V [T, Hkv, D] at their slots [T] (K alone where they are shared)."""
        stored = [(self.key, self.key_scale, k)]
        if not self.shared:
            stored.append((self.value, self.value_scale, v))
        for cache, scales, x in stored:
            if not self.quantized:
                cache.index_put_((slots,), x)
                continue
            codes, scale = _quantize_rows(x, cache.dtype)
            cache.index_put_((slots,), codes)
            scales.index_put_((slots,), scale)

    def gather(self, blocks: torch.Tensor, dtype: torch.dtype,
               workspace: dict[str, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of whole blocks [N] -> [N * block_size, Hkv, D] each, in `dtype`. In eager mode the
        raw gathers land in reused workspace buffers: a fresh tens-of-MB tensor per layer would be
        page-faulted in every time, which costs more than the copy itself."""
        k = self._gathered(self.key, self.key_scale, blocks, dtype, workspace, "k")
        if self.shared:
            return k, k
        return k, self._gathered(self.value, self.value_scale, blocks, dtype, workspace, "v")

    def _gathered(self, cache: torch.Tensor, scales: torch.Tensor | None, blocks: torch.Tensor,
                  dtype: torch.dtype, workspace: dict[str, torch.Tensor] | None, name: str) -> torch.Tensor:
        rows = _gather_blocks(cache, blocks, self.block_size, workspace, name)
        if scales is None:
            return rows
        scales = _gather_blocks(scales, blocks, self.block_size, None, "")
        return rows.to(dtype) * scales.unsqueeze(-1).to(dtype)

    def read_blocks(self, blocks: torch.Tensor) -> dict[str, torch.Tensor]:
        """Whole blocks [N] -> each stored tensor's rows of them, [N, block_size, ...] (copies)."""
        return {name: tensor.view(-1, self.block_size, *tensor.shape[1:]).index_select(0, blocks)
                for name, tensor in self._tensors().items()}

    def write_blocks(self, blocks: torch.Tensor, tensors: dict[str, torch.Tensor]) -> None:
        """Fill whole blocks [N] from tensors as read_blocks gives them: one copy per stored tensor."""
        for name, tensor in self._tensors().items():
            by_block = tensor.view(-1, self.block_size, *tensor.shape[1:])
            source = tensors[name].to(tensor.device, tensor.dtype)
            if tensor.element_size() == 1:  # index_copy_ has no float8 kernel; the bytes are the same
                by_block, source = by_block.view(torch.uint8), source.view(torch.uint8)
            by_block.index_copy_(0, blocks, source)

    def _tensors(self) -> dict[str, torch.Tensor]:
        names = ("key",) if self.shared else ("key", "value")
        if self.quantized:
            names += tuple(f"{name}_scale" for name in names)
        return {name: getattr(self, name) for name in names}


def quantized_bound(dtype: torch.dtype) -> float:
    """The largest magnitude a quantized cache of this storage dtype holds."""
    return KV_QUANTIZED["int8" if dtype == torch.int8 else "fp8"][1]


def _quantize_rows(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, Hkv, D] -> (codes in dtype, scales [T, Hkv] float32), one symmetric scale per row. The
    scale is the row's largest magnitude times 1 / bound, not over bound: PyTorch's CUDA kernels
    divide by a scalar as that product, its CPU kernels divide, and the fused Triton write
    (triton_elementwise) must give the same bits as this function on either device."""
    bound = quantized_bound(dtype)
    scale = x.float().abs().amax(-1).clamp(min=1e-8) * (1.0 / bound)
    scaled = x.float() / scale.unsqueeze(-1)
    codes = scaled.round().clamp(-bound, bound).to(dtype) if dtype == torch.int8 else scaled.to(dtype)
    return codes, scale


def _gather_blocks(cache: torch.Tensor, blocks: torch.Tensor, block_size: int,
                   workspace: dict[str, torch.Tensor] | None, name: str) -> torch.Tensor:
    by_block = cache.view(-1, block_size, *cache.shape[1:])
    if workspace is None or torch.compiler.is_compiling():
        return by_block.index_select(0, blocks).flatten(0, 1)
    num = blocks.numel()
    buffer = workspace.get(name)
    if (buffer is None or buffer.shape[0] < num or buffer.shape[1:] != by_block.shape[1:]
            or buffer.dtype != cache.dtype):
        buffer = torch.empty((max(num, 64),) + tuple(by_block.shape[1:]), dtype=cache.dtype,
                             device=cache.device)
        workspace[name] = buffer
    return torch.index_select(by_block, 0, blocks, out=buffer[:num]).flatten(0, 1)


def padded_block_tables(tables: list[list[int]], width: int, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """Block tables of different lengths as one [len(tables), width] tensor padded with block 0,
    filled row by row in numpy: three times faster than torch.tensor over padded lists, which at
    a few hundred decoding sequences took half a millisecond of every step."""
    array = np.zeros((len(tables), width), dtype=np.int64 if dtype == torch.long else np.int32)
    for row, table in zip(array, tables):
        row[: len(table)] = table
    return torch.from_numpy(array)


@dataclass(slots=True)
class PrefillSpan:
    """A sequence with several new tokens: rows [start, end) of the flat batch."""

    start: int
    end: int
    context_blocks: torch.Tensor | None  # [num_blocks] its block table; None: no earlier context
    mask: torch.Tensor | None  # [n, L] bool, True = attend; None: plain causal over new tokens


@dataclass(slots=True)
class PrefillBatch:
    """Every prefill span of a step together, for a backend that attends them in one call
    (paged_prefill): the spans' K/V are read from the cache through their block tables."""

    block_tables: torch.Tensor  # [S, max_blocks] int32, one row per span
    query_starts: torch.Tensor  # [S] int32: each span's first row in the flat batch
    query_lens: torch.Tensor  # [S] int32: its rows
    context_starts: torch.Tensor  # [S] int32: the position of its first row (tokens cached before it)
    max_query_len: int

    @classmethod
    def of(cls, query_starts: list[int], query_lens: list[int], context_starts: list[int],
           tables: list[list[int]], device: torch.device | str) -> PrefillBatch:
        columns = torch.tensor([query_starts, query_lens, context_starts], dtype=torch.int32).to(device)
        padded = padded_block_tables(tables, max(len(t) for t in tables), torch.int32).to(device)
        return cls(padded, columns[0], columns[1], columns[2], max(query_lens))


@dataclass(slots=True)
class DecodeGroup:
    """Sequences with exactly one new token, attended as one batch."""

    rows: torch.Tensor | None  # [Bd] their rows in the flat batch; None: every row, in order
    block_tables: torch.Tensor  # [Bd, max_blocks] block tables, padded with block 0
    context_lens: torch.Tensor  # [Bd] tokens each new token attends to, itself included
    mask: torch.Tensor | None  # [Bd, 1, 1, max_blocks * block_size] bool, True = attend (backends that pad)


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] cache slot of each new token
    decodes: list[DecodeGroup]
    prefills: list[PrefillSpan]
    sliding_window: int | None = None
    prefill_batch: PrefillBatch | None = None  # the spans instead of `prefills`, for paged_prefill backends
    # the same step without the window, for the full-attention layers of a model that interleaves
    # both (Gemma 3); None: every layer uses this metadata
    full_attention: AttentionMetadata | None = None


class AttentionBackend(Protocol):
    # True: decodes of any context lengths attend in one call without a mask (DecodeGroup.mask
    # stays None); False: the runner groups decodes by length and builds padded masks
    ragged_decode: bool
    # True: the step's prefill spans come as one PrefillBatch, except new prompts (nothing cached
    # before them) of FLASH_PREFILL_TOKENS or more; False: every span as a PrefillSpan, masks built
    paged_prefill: bool

    def __call__(
        self,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        kv_cache: KVCache,
        meta: AttentionMetadata,
        scale: float,
        kv_written: bool = False,  # k and v are in the cache already (written with the rotation)
        softcap: float | None = None,  # scores capped to cap * tanh(score / cap) (Gemma 2); None: not
        sinks: torch.Tensor | None = None,  # [H]: each head's sink logit (GPT-OSS); None: none
    ) -> torch.Tensor:  # [T, H, D]
        ...


def soft_cap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """cap * tanh(x / cap), Gemma 2's bound on attention scores and logits; x itself where cap is None."""
    return x if cap is None else torch.tanh(x / cap) * cap


# queries scored at a time where SDPA cannot take the scores as they are (their scores: [H, rows, L]
# float32)
PLAIN_QUERY_ROWS = 256


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, is_causal: bool,
         scale: float, softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """scaled_dot_product_attention of q [B, H, n, D] over k, v [B, Hkv, L, D] (H a multiple of Hkv),
    mask broadcast to [B, H, n, L] (True = attend), sinks to [B, H, n].

    SDPA can neither cap scores (Gemma 2's softcap) nor take attention sinks (GPT-OSS's: a learned
    logit per head in every row's softmax, a key with no value, so a head may attend to nothing).
    With either, the same in plain ops as transformers' eager attention (the cap and softmax in
    float32), PLAIN_QUERY_ROWS queries at a time so that a long prompt's scores stay small. Its
    products are in float32 on the CPU too: bfloat16 ones took 836 ms for 2,048 queries of Gemma 2
    2B's heads where float32 took 453 (this Intel Xeon, no AVX512-BF16), though they save decodes
    the widening of K/V (1.5 against 3.6 ms at 4,096 tokens of context)."""
    if softcap is None and sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale,
                                              enable_gqa=q.shape[1] != k.shape[1])
    num_kv_heads, num_queries, length = k.shape[1], q.shape[2], k.shape[2]
    dtype = q.dtype if q.is_cuda else torch.float32  # the products'
    grouped = q.to(dtype).unflatten(1, (num_kv_heads, -1))  # [B, Hkv, G, n, D]
    keys, values = k.to(dtype).unsqueeze(2), v.to(dtype).unsqueeze(2)  # [B, Hkv, 1, L, D]
    if is_causal:  # top-left aligned, as SDPA's
        mask = torch.ones(num_queries, length, dtype=torch.bool, device=q.device).tril()
    elif mask is not None and mask.dim() == 4:
        mask = mask.unsqueeze(2)  # [B, 1, 1, n or 1, L]: the same for each head of a group
    sink_column = None  # [1, Hkv, G, n or 1, 1]
    if sinks is not None:
        sink_column = sinks.float().expand(1, q.shape[1], -1).unflatten(1, (num_kv_heads, -1)).unsqueeze(-1)
    out = torch.empty(grouped.shape[:-1] + (v.shape[-1],), dtype=dtype, device=q.device)
    for start in range(0, num_queries, PLAIN_QUERY_ROWS):
        rows = slice(start, start + PLAIN_QUERY_ROWS)
        scores = soft_cap((grouped[..., rows, :] @ keys.transpose(-1, -2)).float() * scale, softcap)
        if mask is not None:
            scores = scores.masked_fill(~(mask[..., rows, :] if mask.shape[-2] > 1 else mask), float("-inf"))
        if sink_column is None:
            weights = scores.softmax(-1)
        else:  # the sink's share of each row is dropped with its column
            sink = sink_column[..., rows, :] if sink_column.shape[-2] > 1 else sink_column
            weights = torch.cat([scores, sink.expand(*scores.shape[:-1], 1)], dim=-1).softmax(-1)[..., :-1]
        out[..., rows, :] = weights.to(dtype) @ values
    return out.flatten(1, 2).to(q.dtype)


def allowed_keys(
    query_positions: torch.Tensor, key_positions: torch.Tensor, sliding_window: int | None
) -> torch.Tensor:
    """Mask [..., Q, K]: key k is visible to query q if k <= q and, with a window, q - k < window."""
    diff = query_positions.unsqueeze(-1) - key_positions.unsqueeze(-2)
    mask = diff >= 0
    if sliding_window is not None:
        mask &= diff < sliding_window
    return mask


class TorchPagedAttention:
    """Portable backend: gathers context KV by block and calls scaled_dot_product_attention.

    Decodes run as one batched call per group (the G query heads sharing a KV head stand in for
    the query length, so GQA needs no KV copy); each prefill chunk runs as its own call, which on
    CUDA dispatches to the flash or memory-efficient SDPA kernels.
    """

    ragged_decode = False
    paged_prefill = False

    def __init__(self) -> None:
        self._workspace: dict[str, torch.Tensor] = {}

    def __call__(self, q, k, v, kv_cache: KVCache, meta, scale, kv_written=False, softcap=None, sinks=None):
        if not kv_written:
            kv_cache.write(meta.slot_mapping, k, v)
        out = torch.empty_like(q)
        for group in meta.decodes:
            if group.rows is None:
                out = self.decode(q, kv_cache, group, meta.sliding_window, scale, softcap, sinks)
            else:
                out[group.rows] = self.decode(q[group.rows], kv_cache, group, meta.sliding_window, scale,
                                              softcap, sinks)
        for span in meta.prefills:
            out[span.start : span.end] = self.prefill(q, k, v, kv_cache, span, scale, softcap, sinks)
        return out

    def decode(self, q: torch.Tensor, kv_cache: KVCache, group: DecodeGroup, sliding_window: int | None,
               scale: float, softcap: float | None, sinks: torch.Tensor | None) -> torch.Tensor:
        """q [Bd, H, D] of the group's sequences -> their attention output [Bd, H, D]."""
        batch, num_heads = group.block_tables.shape[0], q.shape[1]
        kd, vd = kv_cache.gather(group.block_tables.flatten(), q.dtype, self._workspace)
        qd = q.unflatten(1, (kd.shape[1], num_heads // kd.shape[1]))  # [Bd, Hkv, G, D]
        kd = kd.view(batch, -1, *kd.shape[1:]).transpose(1, 2)  # [Bd, Hkv, L, D]
        vd = vd.view(batch, -1, *vd.shape[1:]).transpose(1, 2)
        sinks = None if sinks is None else sinks.view(qd.shape[1:3])  # a sink per head, the rows here
        return sdpa(qd, kd, vd, group.mask, False, scale, softcap, sinks).flatten(1, 2)

    def prefill(self, q, k, v, kv_cache: KVCache, span: PrefillSpan, scale: float,
                softcap: float | None, sinks: torch.Tensor | None) -> torch.Tensor:
        """The span's rows of q attend to its context (or, with none, causally to each other)."""
        qp = q[span.start : span.end].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        if span.context_blocks is None:
            kp, vp = k[span.start : span.end], v[span.start : span.end]  # [n, Hkv, D]
        else:
            length = span.mask.shape[1]
            kp, vp = kv_cache.gather(span.context_blocks, q.dtype, self._workspace)
            kp, vp = kp[:length], vp[:length]  # [L, Hkv, D]
        sinks = None if sinks is None else sinks[:, None]  # [H, 1]: every row's
        op = sdpa(qp, kp.transpose(0, 1)[None], vp.transpose(0, 1)[None], span.mask, span.mask is None, scale,
                  softcap, sinks)
        return op[0].transpose(0, 1)


class TritonPagedAttention(TorchPagedAttention):
    """CUDA backend: the Triton paged kernels read K/V through the block tables in place (no gather,
    no padding, no mask): the step's decodes in one launch, its prefill spans in another."""

    ragged_decode = True
    paged_prefill = True

    def __call__(self, q, k, v, kv_cache, meta, scale, kv_written=False, softcap=None, sinks=None):
        # the base class writes the new K/V first
        out = super().__call__(q, k, v, kv_cache, meta, scale, kv_written, softcap, sinks)
        batch = meta.prefill_batch
        if batch is None:
            return out
        from hyperserve.layers.triton_attention import paged_prefill_attention

        return paged_prefill_attention(q, kv_cache.key, kv_cache.value, batch.block_tables,
                                       batch.query_starts, batch.query_lens, batch.context_starts,
                                       batch.max_query_len, kv_cache.block_size, scale, out,
                                       meta.sliding_window, kv_cache.key_scale, kv_cache.value_scale,
                                       softcap=softcap, sinks=sinks)

    def decode(self, q, kv_cache, group, sliding_window, scale, softcap, sinks):
        from hyperserve.layers.triton_attention import paged_decode_attention

        return paged_decode_attention(q, kv_cache.key, kv_cache.value, group.block_tables, group.context_lens,
                                      kv_cache.block_size, scale, sliding_window, kv_cache.key_scale,
                                      kv_cache.value_scale, softcap=softcap, sinks=sinks)


ATTENTION_BACKENDS = ("auto", "torch", "triton")


def attention_backend(device: str, name: str = "auto", block_size: int = 16, head_dim: int = 64,
                      latent: bool = False) -> AttentionBackend:
    """The attention backend for a device: auto picks Triton's paged decode on CUDA when triton is
    installed and the block and head sizes fit its tiles, the portable backend otherwise. "triton"
    on the CPU runs the kernels in Triton's interpreter (TRITON_INTERPRET=1): for tests, not speed.
    latent: DeepSeek's latent attention (every query head over one 576-wide K/V head), which the
    Triton kernels are not tiled for: the portable backend."""
    if latent and name == "triton":
        raise ValueError("attention_backend='triton' does not run DeepSeek's latent attention yet: "
                         "use 'auto' or 'torch'")
    if name == "torch" or latent:
        return TorchPagedAttention()
    # the kernel's tiles: blocks of at least 16 tokens (tl.dot's smallest side), a power of two
    usable = (HAS_TRITON and block_size >= 16
              and block_size & (block_size - 1) == 0 and head_dim >= 16)
    if name == "triton":
        if not usable:
            raise ValueError("attention_backend='triton' needs the triton package, a power-of-two block_size "
                             "of at least 16 and head_dim >= 16 "
                             f"(got block_size={block_size}, head_dim={head_dim})")
        return TritonPagedAttention()
    return TritonPagedAttention() if device == "cuda" and usable else TorchPagedAttention()
