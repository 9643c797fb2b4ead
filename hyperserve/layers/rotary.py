"""Rotary position embeddings, with the rope scaling variants of Hugging Face configs."""

from __future__ import annotations

import torch
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS


def rope_inverse_frequencies(config: PretrainedConfig, head_dim: int) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim / 2], attention scaling) for any rope type transformers knows."""
    params = getattr(config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        exponents = torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim
        return 1.0 / (theta**exponents), 1.0
    return ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")


class RotaryEmbedding(torch.nn.Module):
    """Rotates q and k by their absolute positions (the rotate-half layout of HF Llama)."""

    def __init__(self, config: PretrainedConfig, head_dim: int, max_position: int) -> None:
        super().__init__()
        self.config, self.head_dim, self.max_position = config, head_dim, max_position
        self.register_buffer("cos_sin", torch.empty(max_position, head_dim), persistent=False)

    def reset_cache(self) -> None:
        """Fill the cos/sin table; the model is built on the meta device, so this runs after."""
        inv_freq, scaling = rope_inverse_frequencies(self.config, self.head_dim)
        positions = torch.arange(self.max_position, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)  # [max_position, head_dim / 2]
        table = torch.cat([freqs.cos(), freqs.sin()], dim=-1) * scaling
        self.cos_sin = table.to(self.cos_sin.device)

    def cos_sin_for(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> (cos, sin), each [T, 1, D] in the rotate-half layout."""
        cos, sin = self.cos_sin[positions].chunk(2, dim=-1)  # [T, D/2] each
        return torch.cat([cos, cos], dim=-1).unsqueeze(1), torch.cat([sin, sin], dim=-1).unsqueeze(1)

    def forward(
        self, cos_sin: tuple[torch.Tensor, torch.Tensor], q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # q [T, H, D]; k [T, Hkv, D]; cos_sin from cos_sin_for(positions)
        cos, sin = cos_sin
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    if x.dtype == torch.float32:
        return x * cos + rotated * sin
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)
