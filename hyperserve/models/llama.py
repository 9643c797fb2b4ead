"""The Llama family decoder: Llama 2/3, Mistral (sliding window), Qwen2 (QKV bias), SmolLM2.

Inputs are flat: every scheduled token of every sequence in one [T] tensor with its position, no
padding. Q/K/V and gate/up projections are fused into one matmul each; `load_weight` takes
Hugging Face tensor names and writes each shard in place.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from hyperserve.layers.attention import AttentionBackend, AttentionMetadata, KVCache
from hyperserve.layers.rotary import RotaryEmbedding

# HF projection name -> (our fused parameter, shard index)
_FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """One fused op; in half precision it normalises in float32, as transformers does (which
        rounds once more before the weight: the difference is within one half-precision step)."""
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


class LlamaAttention(nn.Module):
    def __init__(self, config: PretrainedConfig, rotary: RotaryEmbedding, backend: AttentionBackend):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = head_dim_of(config)
        self.scale = self.head_dim**-0.5
        self.shard_sizes = [
            self.num_heads * self.head_dim,
            self.num_kv_heads * self.head_dim,
            self.num_kv_heads * self.head_dim,
        ]
        bias = config.model_type == "qwen2" or getattr(config, "attention_bias", False)
        self.qkv_proj = nn.Linear(config.hidden_size, sum(self.shard_sizes), bias=bias)
        self.o_proj = nn.Linear(
            self.num_heads * self.head_dim, config.hidden_size,
            bias=getattr(config, "attention_bias", False),
        )
        self.qk_v_sizes = [self.shard_sizes[0] + self.shard_sizes[1], self.shard_sizes[2]]  # q and k rotate together
        self.rotary = rotary
        self.backend = backend

    def forward(self, cos_sin, x, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        qk, v = self.qkv_proj(x).split(self.qk_v_sizes, dim=-1)  # x [T, hidden]
        qk = self.rotary(cos_sin, qk.unflatten(-1, (-1, self.head_dim)))  # [T, H + Hkv, D]
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)  # [T, H, D], [T, Hkv, D]
        out = self.backend(q, k, v.unflatten(-1, (-1, self.head_dim)), kv_cache, meta, self.scale)  # [T, H, D]
        return self.o_proj(out.flatten(1))


class LlamaMLP(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.shard_sizes = [config.intermediate_size, config.intermediate_size]
        bias = getattr(config, "mlp_bias", False)
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, rotary, backend) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, rotary, backend)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, cos_sin, hidden, kv_cache, meta) -> torch.Tensor:
        hidden = hidden + self.self_attn(cos_sin, self.input_layernorm(hidden), kv_cache, meta)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class LlamaModel(nn.Module):
    def __init__(self, config: PretrainedConfig, backend: AttentionBackend, max_position: int):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.rotary = RotaryEmbedding(config, head_dim_of(config), max_position)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, self.rotary, backend) for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: PretrainedConfig, backend: AttentionBackend, max_position: int):
        super().__init__()
        self.config = config
        self.attention_backend = backend
        self.model = LlamaModel(config, backend, max_position)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = (
            None if self.tie_word_embeddings
            else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )

    @property
    def sliding_window(self) -> int | None:
        if self.config.model_type == "qwen2" and not getattr(self.config, "use_sliding_window", False):
            return None
        return getattr(self.config, "sliding_window", None)

    interleaves_full_attention = False  # every layer attends alike (Gemma 3's alternate)

    @property
    def window_layers(self) -> list[bool]:
        """Which layers attend through the sliding window."""
        return [self.sliding_window is not None] * self.config.num_hidden_layers

    def reset_rotary(self) -> None:
        """Fill the rotary tables (the model is built on the meta device, so this runs after)."""
        self.model.rotary.reset_cache()

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[KVCache],  # one per layer
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden], before the final norm
        hidden = self.model.embed_tokens(input_ids)
        cos_sin = self.model.rotary.cos_sin_for(positions, hidden.dtype)  # once per step, for every layer
        for layer, kv_cache in zip(self.model.layers, kv_caches):
            hidden = layer(cos_sin, hidden, kv_cache, meta)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [S, hidden] of the positions to sample -> float32 logits [S, vocab]."""
        hidden = self.model.norm(hidden)
        if self.lm_head is None:  # tied, unquantized
            return F.linear(hidden, self.model.embed_tokens.weight).float()
        return self.lm_head(hidden).float()

    def load_weight(self, name: str, tensor: torch.Tensor) -> str:
        """Copy one checkpoint tensor (Hugging Face name) into place; returns the parameter name."""
        if name == "lm_head.weight" and self.lm_head is None:
            return "model.embed_tokens.weight"  # tied: the embedding already holds it
        module_name, _, leaf = name.rpartition(".")
        parent, _, proj = module_name.rpartition(".")
        if proj in _FUSED:
            fused, shard = _FUSED[proj]
            target = self.get_parameter(f"{parent}.{fused}.{leaf}")
            sizes = self.get_submodule(parent).shard_sizes
            offset = sum(sizes[:shard])
            target.data[offset : offset + sizes[shard]].copy_(tensor)
            return f"{parent}.{fused}.{leaf}"
        self.get_parameter(name).data.copy_(tensor)
        return name


def head_dim_of(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
