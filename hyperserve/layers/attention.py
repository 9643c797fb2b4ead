"""Attention over the paged KV cache, behind a small backend interface.

The KV cache of one layer is a tensor [2, num_blocks, block_size, num_kv_heads, head_dim]; token
position p of a sequence lives in block table[p // block_size] at offset p % block_size, its "slot"
being block * block_size + offset. Context is gathered a whole block at a time (index_select over
contiguous blocks runs several times faster than per-slot indexing). The model runner builds one
AttentionMetadata per step and every layer reuses it, so no layer does index arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F


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
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
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
    length, so GQA needs no KV copy); each prefill chunk runs as its own call. Gathers write into
    a reused workspace: a fresh tens-of-MB tensor per layer would be page-faulted in every time,
    which costs more than the copy itself.
    """

    def __init__(self) -> None:
        self._workspace: dict[str, torch.Tensor] = {}

    def _gather(self, name: str, cache: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
        """cache [num_blocks, bs, Hkv, D], tables [B, M] -> [B, M * bs, Hkv, D] (a workspace view)."""
        num = tables.numel()
        buffer = self._workspace.get(name)
        if buffer is None or buffer.shape[0] < num or buffer.shape[1:] != cache.shape[1:]:
            buffer = torch.empty((max(num, 64),) + tuple(cache.shape[1:]), dtype=cache.dtype, device=cache.device)
            self._workspace[name] = buffer
        blocks = torch.index_select(cache, 0, tables.flatten(), out=buffer[:num])
        return blocks.view(tables.shape[0], -1, *cache.shape[2:])

    def __call__(self, q, k, v, kv_cache, meta, scale):
        keys, values = kv_cache[0], kv_cache[1]  # [num_blocks, block_size, Hkv, D]
        keys.view(-1, *k.shape[1:]).index_copy_(0, meta.slot_mapping, k)
        values.view(-1, *v.shape[1:]).index_copy_(0, meta.slot_mapping, v)
        out = torch.empty_like(q)
        num_heads, num_kv_heads = q.shape[1], k.shape[1]
        for group in meta.decodes:
            qd = q[group.rows].unflatten(1, (num_kv_heads, num_heads // num_kv_heads))  # [Bd, Hkv, G, D]
            kd = self._gather("k", keys, group.block_tables).transpose(1, 2)  # [Bd, Hkv, L, D]
            vd = self._gather("v", values, group.block_tables).transpose(1, 2)
            od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=group.mask, scale=scale)
            out[group.rows] = od.flatten(1, 2)
        for span in meta.prefills:
            qp = q[span.start : span.end].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
            if span.context_blocks is None:
                kp, vp = k[span.start : span.end], v[span.start : span.end]  # [n, Hkv, D]
            else:
                length = span.mask.shape[1]
                kp = self._gather("k", keys, span.context_blocks[None])[0, :length]  # [L, Hkv, D]
                vp = self._gather("v", values, span.context_blocks[None])[0, :length]
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
