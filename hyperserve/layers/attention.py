"""Attention over the paged KV cache, behind a small backend interface.

The KV cache of one layer is a tensor [2, num_slots, num_kv_heads, head_dim]; block b holds slots
[b * block_size, (b + 1) * block_size). The model runner builds one AttentionMetadata per step
(slot indices, masks) and every layer reuses it, so no layer does index arithmetic.
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
    context_slots: torch.Tensor | None  # [L] slots of all its context; None: no earlier context
    mask: torch.Tensor | None  # [n, L] bool, True = attend; None: plain causal over new tokens


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] cache slot of each new token
    # Sequences with exactly one new token (decodes), attended as one batch.
    decode_rows: torch.Tensor  # [Bd] their rows in the flat batch
    decode_context_slots: torch.Tensor  # [Bd, Lmax] slots of their context, padded
    decode_mask: torch.Tensor  # [Bd, 1, 1, Lmax] bool, True = attend
    prefills: list[PrefillSpan]

    @property
    def num_decodes(self) -> int:
        return int(self.decode_rows.numel())


class AttentionBackend(Protocol):
    def __call__(
        self,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        kv_cache: torch.Tensor,  # [2, num_slots, Hkv, D]
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
    """Portable backend: gathers context KV by slot index and calls scaled_dot_product_attention.

    Decodes run as one batched call (the G query heads sharing a KV head stand in for the query
    length, so GQA needs no KV copy); each prefill chunk runs as its own call.
    """

    def __call__(self, q, k, v, kv_cache, meta, scale):
        kv_cache[0].index_copy_(0, meta.slot_mapping, k)
        kv_cache[1].index_copy_(0, meta.slot_mapping, v)
        out = torch.empty_like(q)
        num_heads, num_kv_heads = q.shape[1], k.shape[1]
        if meta.num_decodes:
            rows = meta.decode_rows
            qd = q[rows].unflatten(1, (num_kv_heads, num_heads // num_kv_heads))  # [Bd, Hkv, G, D]
            kd = kv_cache[0][meta.decode_context_slots].transpose(1, 2)  # [Bd, Hkv, L, D]
            vd = kv_cache[1][meta.decode_context_slots].transpose(1, 2)
            od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=meta.decode_mask, scale=scale)
            out[rows] = od.flatten(1, 2)
        for span in meta.prefills:
            qp = q[span.start : span.end].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
            if span.context_slots is None:
                kp, vp = k[span.start : span.end], v[span.start : span.end]
            else:
                kp, vp = kv_cache[0][span.context_slots], kv_cache[1][span.context_slots]
            kp = kp.transpose(0, 1).unsqueeze(0)  # [1, Hkv, L, D]
            vp = vp.transpose(0, 1).unsqueeze(0)
            op = F.scaled_dot_product_attention(
                qp, kp, vp, attn_mask=span.mask, is_causal=span.mask is None, scale=scale,
                enable_gqa=True,
            )
            out[span.start : span.end] = op[0].transpose(0, 1)
        return out
