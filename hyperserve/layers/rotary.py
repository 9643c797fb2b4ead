"""Rotary position embeddings, with the rope scaling variants of Hugging Face configs."""

from __future__ import annotations

import torch
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS


def rotary_dim(config: PretrainedConfig, head_dim: int) -> int:
    """How many of each head's dimensions rotate: all, or partial_rotary_factor of them (Phi-4-mini's
    0.75), the first ones."""
    params = getattr(config, "rope_parameters", None) or {}
    partial = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)) or 1.0
    return int(head_dim * partial)


def rope_inverse_frequencies(config: PretrainedConfig, head_dim: int) -> tuple[torch.Tensor, float]:
    """(inv_freq [rotary_dim / 2], attention scaling) for any rope type transformers knows."""
    params = getattr(config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        dim = rotary_dim(config, head_dim)
        exponents = torch.arange(0, dim, 2, dtype=torch.float32) / dim
        return 1.0 / (theta**exponents), 1.0
    return ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")


def rope_position_limit(config: PretrainedConfig) -> int | None:
    """The positions its rope table is right for, where that is fewer than the config's: LongRoPE
    (Phi-3) rotates by its short factors up to original_max_position_embeddings and by its long
    ones, for every position, once a sequence is longer, which a cache of rotated keys cannot follow."""
    params = getattr(config, "rope_parameters", None) or {}
    if params.get("rope_type") == "longrope":
        return params["original_max_position_embeddings"]
    return None


class RotaryEmbedding(torch.nn.Module):
    """Rotates q and k by their absolute positions (the rotate-half layout of HF Llama), over their
    first rotary_dim dimensions (all of them but for a partial_rotary_factor)."""

    def __init__(self, config: PretrainedConfig, head_dim: int, max_position: int) -> None:
        super().__init__()
        self.config, self.head_dim, self.max_position = config, head_dim, max_position
        self.rotary_dim = rotary_dim(config, head_dim)
        self.register_buffer("cos_sin", torch.empty(max_position, self.rotary_dim), persistent=False)

    def reset_cache(self) -> None:
        """Fill the cos/sin table; the model is built on the meta device, so this runs after."""
        inv_freq, scaling = rope_inverse_frequencies(self.config, self.head_dim)
        positions = torch.arange(self.max_position, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)  # [max_position, head_dim / 2]
        table = torch.cat([freqs.cos(), freqs.sin()], dim=-1) * scaling
        self.cos_sin = table.to(self.cos_sin.device)

    def cos_sin_for(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> (cos, signed sin), each [T, 1, rotary_dim] in `dtype` (as transformers
        rotates, in the model's dtype): cos = [c, c] and signed sin = [-s, s] over the two halves."""
        cos, sin = self.cos_sin[positions].chunk(2, dim=-1)  # [T, D/2] each
        return (torch.cat([cos, cos], dim=-1).unsqueeze(1).to(dtype),
                torch.cat([-sin, sin], dim=-1).unsqueeze(1).to(dtype))

    def forward(self, cos_sin: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """x [T, heads, D] (q and k heads together: one rotation per layer) -> x rotated.

        x * cos + rotate_half(x) * sin, where rotate_half(x) * sin = roll(x, D/2) * [-s, s]:
        three ops instead of the eight of the textbook form, which at one token per step cost
        more than their arithmetic. With a partial rotary_dim, the rest passes as it is."""
        if self.rotary_dim == self.head_dim:
            return _rotated(x, *cos_sin)
        turned, kept = x.split([self.rotary_dim, self.head_dim - self.rotary_dim], dim=-1)
        return torch.cat([_rotated(turned, *cos_sin), kept], dim=-1)


def _rotated(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), signed_sin)
