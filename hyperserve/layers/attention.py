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

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

# kv_cache_dtype -> (storage dtype, largest stored magnitude): quantized K/V keep one scale per
# token and head, so an outlier token costs precision only in its own row
KV_QUANTIZED = {"int8": (torch.int8, 127.0), "fp8": (torch.float8_e4m3fn, 448.0)}


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
                 kv_cache_dtype: str, device: torch.device | str) -> KVCache:
        shape = (num_blocks * block_size, num_kv_heads, head_dim)
        if kv_cache_dtype == "auto":
            return cls(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device),
                       block_size)
        stored = KV_QUANTIZED[kv_cache_dtype][0]
        return cls(*(torch.zeros(shape, dtype=stored, device=device) for _ in range(2)), block_size,
                   *(torch.zeros(shape[:2], dtype=torch.float32, device=device) for _ in range(2)))

    @property
    def quantized(self) -> bool:
        return self.key_scale is not None

    def write(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store new tokens' K and V [T, Hkv, D] at their slots [T]."""
        if not self.quantized:
            self.key.index_put_((slots,), k)
            self.value.index_put_((slots,), v)
            return
        for cache, scales, x in ((self.key, self.key_scale, k), (self.value, self.value_scale, v)):
            codes, scale = _quantize_rows(x, cache.dtype)
            cache.index_put_((slots,), codes)
            scales.index_put_((slots,), scale)

    def gather(self, blocks: torch.Tensor, dtype: torch.dtype,
               workspace: dict[str, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of whole blocks [N] -> [N * block_size, Hkv, D] each, in `dtype`. In eager mode the
        raw gathers land in reused workspace buffers: a fresh tens-of-MB tensor per layer would be
        page-faulted in every time, which costs more than the copy itself."""
        k = _gather_blocks(self.key, blocks, self.block_size, workspace, "k")
        v = _gather_blocks(self.value, blocks, self.block_size, workspace, "v")
        if not self.quantized:
            return k, v
        k_scale = _gather_blocks(self.key_scale, blocks, self.block_size, None, "")
        v_scale = _gather_blocks(self.value_scale, blocks, self.block_size, None, "")
        return (k.to(dtype) * k_scale.unsqueeze(-1).to(dtype)), (v.to(dtype) * v_scale.unsqueeze(-1).to(dtype))

    def read_block(self, block: int) -> dict[str, torch.Tensor]:
        rows = slice(block * self.block_size, (block + 1) * self.block_size)
        return {name: tensor[rows] for name, tensor in self._tensors().items()}

    def write_block(self, block: int, tensors: dict[str, torch.Tensor]) -> None:
        rows = slice(block * self.block_size, (block + 1) * self.block_size)
        for name, tensor in self._tensors().items():
            tensor[rows].copy_(tensors[name])

    def _tensors(self) -> dict[str, torch.Tensor]:
        names = ("key", "value", "key_scale", "value_scale") if self.quantized else ("key", "value")
        return {name: getattr(self, name) for name in names}


def _quantize_rows(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, Hkv, D] -> (codes in dtype, scales [T, Hkv] float32), one symmetric scale per row."""
    bound = KV_QUANTIZED["int8" if dtype == torch.int8 else "fp8"][1]
    scale = x.float().abs().amax(-1).clamp(min=1e-8) / bound
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
    if buffer is None or buffer.shape[0] < num or buffer.shape[1:] != by_block.shape[1:] or buffer.dtype != cache.dtype:
        buffer = torch.empty((max(num, 64),) + tuple(by_block.shape[1:]), dtype=cache.dtype, device=cache.device)
        workspace[name] = buffer
    return torch.index_select(by_block, 0, blocks, out=buffer[:num]).flatten(0, 1)


@dataclass(slots=True)
class PrefillSpan:
    """A sequence with several new tokens: rows [start, end) of the flat batch."""

    start: int
    end: int
    context_blocks: torch.Tensor | None  # [num_blocks] its block table; None: no earlier context
    mask: torch.Tensor | None  # [n, L] bool, True = attend; None: plain causal over new tokens


@dataclass(slots=True)
class DecodeGroup:
    """Sequences with exactly one new token and similar context lengths, attended as one batch."""

    rows: torch.Tensor  # [Bd] their rows in the flat batch
    block_tables: torch.Tensor  # [Bd, max_blocks] block tables, padded with block 0
    mask: torch.Tensor  # [Bd, 1, 1, max_blocks * block_size] bool, True = attend


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] cache slot of each new token
    decodes: list[DecodeGroup]
    prefills: list[PrefillSpan]


class AttentionBackend(Protocol):
    def __call__(
        self,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        kv_cache: KVCache,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [T, H, D]
        ...


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

    Decodes run as one batched call (the G query heads sharing a KV head stand in for the query
    length, so GQA needs no KV copy); each prefill chunk runs as its own call.
    """

    def __init__(self) -> None:
        self._workspace: dict[str, torch.Tensor] = {}

    def __call__(self, q, k, v, kv_cache: KVCache, meta, scale):
        kv_cache.write(meta.slot_mapping, k, v)
        out = torch.empty_like(q)
        num_heads, num_kv_heads = q.shape[1], k.shape[1]
        for group in meta.decodes:
            batch = group.block_tables.shape[0]
            qd = q[group.rows].unflatten(1, (num_kv_heads, num_heads // num_kv_heads))  # [Bd, Hkv, G, D]
            kd, vd = kv_cache.gather(group.block_tables.flatten(), q.dtype, self._workspace)
            kd = kd.view(batch, -1, *kd.shape[1:]).transpose(1, 2)  # [Bd, Hkv, L, D]
            vd = vd.view(batch, -1, *vd.shape[1:]).transpose(1, 2)
            od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=group.mask, scale=scale)
            out[group.rows] = od.flatten(1, 2)
        for span in meta.prefills:
            qp = q[span.start : span.end].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
            if span.context_blocks is None:
                kp, vp = k[span.start : span.end], v[span.start : span.end]  # [n, Hkv, D]
            else:
                length = span.mask.shape[1]
                kp, vp = kv_cache.gather(span.context_blocks, q.dtype, self._workspace)
                kp, vp = kp[:length], vp[:length]  # [L, Hkv, D]
            op = F.scaled_dot_product_attention(
                qp, kp.transpose(0, 1)[None], vp.transpose(0, 1)[None],
                attn_mask=span.mask, is_causal=span.mask is None, scale=scale, enable_gqa=True,
            )
            out[span.start : span.end] = op[0].transpose(0, 1)
        return out


def attention_backend(device: str) -> AttentionBackend:
    """The attention backend for a device. The portable one serves CPU and CUDA alike for now;
    device-specific kernels (Triton paged decode on CUDA) plug in here."""
    return TorchPagedAttention()
