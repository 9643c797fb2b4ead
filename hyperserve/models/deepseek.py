"""DeepSeek-V2 and V3: the Llama family's decoder with multi-head latent attention (MLA) and
DeepSeek's mixture of experts (layers/moe.py's GroupedRouting, shared experts every token runs).

MLA compresses each token's keys and values into one latent vector c (kv_lora_rank wide, 512)
beside a small key k_pe that carries the rotation (qk_rope_head_dim, 64, shared by every head).
Head h's key is [W_UK_h c, k_pe] and its value W_UV_h c, both expanded from c by kv_b_proj. The
cache keeps only [c, k_pe] per token (576 values, against 2 x 128 heads x 128 for V3 expanded),
and attention runs on it as it is, "absorbed" as DeepSeek's paper describes:
- q_h's non-rotating part goes into the latent space, q_nope_h W_UK_h (kv_lora_rank wide), so that
  q_h . k_h = [q_nope_h W_UK_h, q_pe_h] . [c, k_pe]: every head attends to the one latent "K/V
  head" (multi-query attention over 576-wide vectors, the cache's K and V one tensor);
- the output is the attention-weighted sum of the latents (the first kv_lora_rank values of the
  same vectors), taken out of the latent space by W_UV_h, then o_proj.

Checkpoints rotate q_pe and k_pe in interleaved pairs; `load_weight` reorders those rows into the
rotate-half layout our rotary takes (as llama.cpp's permutation of Llama's Q/K rows, undone by
our GGUF reader): dot products between rotated q and k are the same either way. Scores scale by
qk_head_dim^-0.5, times YaRN's mscale squared where the rope is scaled.

Not yet: tensor parallelism of MLA (refused), the Triton attention kernels (MLA runs through the
portable backend on CUDA too), the native CPU layers (the PyTorch ones run it), GGUFs.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import yarn_apply_mscale

from hyperserve.distributed.group import TensorParallel
from hyperserve.layers.attention import AttentionBackend, AttentionMetadata, KVCache
from hyperserve.layers.linear import Linear
from hyperserve.layers.moe import GroupedRouting
from hyperserve.layers.norm import RMSNorm
from hyperserve.layers.rotary import RotaryEmbedding

LATENT_TYPES = ("deepseek_v2", "deepseek_v3")


def latent_width(config: PretrainedConfig) -> int:
    """What the cache holds per token and layer: the latent and the rotating key."""
    return config.kv_lora_rank + config.qk_rope_head_dim


def grouped_routing(config: PretrainedConfig) -> GroupedRouting:
    if config.model_type == "deepseek_v3":  # sigmoid scores, groups by their best two
        return GroupedRouting(sigmoid=True, num_groups=config.n_group or 1,
                              topk_groups=config.topk_group or 1, top2_groups=True,
                              scale=config.routed_scaling_factor)
    grouped = config.topk_method == "group_limited_greedy"
    return GroupedRouting(sigmoid=False, num_groups=config.n_group if grouped else 1,
                          topk_groups=config.topk_group if grouped else 1, scale=config.routed_scaling_factor)


def interleaved_to_halves(rows: int) -> torch.Tensor:
    """The order that takes `rows` rotary rows from interleaved pairs (x0, x1), (x2, x3), ... to
    rotate-half's halves (x0, x2, ..., x1, x3, ...)."""
    return torch.cat([torch.arange(0, rows, 2), torch.arange(1, rows, 2)])


class LatentAttention(nn.Module):
    """MLA over the latent cache (see the module's docstring)."""

    softcap = sinks = None  # no cap on the attention scores, no attention sinks
    full_attention = False  # no window

    def __init__(self, config: PretrainedConfig, rotary: RotaryEmbedding, backend: AttentionBackend,
                 tp: TensorParallel) -> None:
        super().__init__()
        if tp.size > 1:
            raise ValueError("tensor parallelism of DeepSeek's latent attention is not supported yet")
        self.num_heads, self.num_kv_heads = config.num_attention_heads, 1  # the cache's one latent "head"
        self.nope, self.rope = config.qk_nope_head_dim, config.qk_rope_head_dim
        self.rank, self.v_head_dim = config.kv_lora_rank, config.v_head_dim
        self.interleaved = config.model_type == "deepseek_v2" or getattr(config, "rope_interleave", True)
        q_width = self.num_heads * (self.nope + self.rope)
        self.q_low_rank = config.q_lora_rank is not None  # V3's and V2's q; V2-Lite's is one projection
        if not self.q_low_rank:
            self.q_proj = Linear(config.hidden_size, q_width, bias=False)
        else:
            self.q_a_proj = Linear(config.hidden_size, config.q_lora_rank, bias=config.attention_bias)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, config.rms_norm_eps)
            self.q_b_proj = Linear(config.q_lora_rank, q_width, bias=False)
        self.kv_a_proj_with_mqa = Linear(config.hidden_size, self.rank + self.rope,
                                         bias=config.attention_bias)
        self.kv_a_layernorm = RMSNorm(self.rank, config.rms_norm_eps)
        # kv_b_proj's weight by head, [H, nope + v, rank]: W_UK_h its first nope rows, W_UV_h the rest.
        # Not a Linear: the absorbed products take it per head (and weight quantization leaves it)
        self.kv_b = nn.Parameter(torch.empty(self.num_heads, self.nope + self.v_head_dim, self.rank))
        self.o_proj = Linear(self.num_heads * self.v_head_dim, config.hidden_size, bias=config.attention_bias)
        self.scale = yarn_apply_mscale(config.rope_parameters, (self.nope + self.rope) ** -0.5)
        self.rotary, self.backend = rotary, backend

    def forward(self, cos_sin, x: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.q_low_rank else self.q_proj(x)
        q_nope, q_pe = q.unflatten(-1, (self.num_heads, -1)).split([self.nope, self.rope], dim=-1)
        # [T, rank], [T, rope]
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope], dim=-1)
        turned = self.rotary(cos_sin, torch.cat([q_pe, k_pe.unsqueeze(1)], dim=1))  # [T, H + 1, rope]
        w_uk, w_uv = self.kv_b.split([self.nope, self.v_head_dim], dim=1)  # [H, nope, rank], [H, v, rank]
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [T, H, rank]
        q = torch.cat([q_latent, turned[:, :-1]], dim=-1)  # [T, H, rank + rope]
        # [T, 1, rank + rope]
        kv = torch.cat([self.kv_a_layernorm(latent), turned[:, -1]], dim=-1).unsqueeze(1)
        out = self.backend(q, kv, kv, kv_cache, meta, self.scale)[..., : self.rank]  # [T, H, rank]
        out = torch.bmm(out.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)  # [T, H, v]
        return self.o_proj(out.flatten(1))

    def load_weight(self, leaf: str, tensor: torch.Tensor) -> str:
        """A checkpoint tensor of this module (its name inside it) into place; returns that name:
        kv_b_proj's by head, the rotary rows of q and k_pe in rotate-half order."""
        if leaf == "kv_b_proj.weight":
            self.kv_b.data.copy_(tensor.unflatten(0, (self.num_heads, -1)))
            return "kv_b"
        if self.interleaved and leaf in ("q_proj.weight", "q_b_proj.weight"):
            order = interleaved_to_halves(self.rope) + self.nope
            heads = tensor.unflatten(0, (self.num_heads, -1)).clone()  # [H, nope + rope, in]
            heads[:, self.nope :] = heads[:, order]
            tensor = heads.flatten(0, 1)
        elif self.interleaved and leaf.startswith("kv_a_proj_with_mqa."):
            tensor = tensor.clone()
            tensor[self.rank :] = tensor[interleaved_to_halves(self.rope) + self.rank]
        self.get_parameter(leaf).data.copy_(tensor)
        return leaf

