"""Weight quantization at load time.

`int8` (CPU): int8 weights with one scale per output channel, run by PyTorch's x86 quantized
engine (fbgemm) as dynamic linears: each call quantizes its input to 8 bits with one scale for the
whole call, multiplies in int8 with int32 accumulation and rescales. It reads a quarter of
float32's bytes, which is what bounds decoding.

Measured here on SmolLM2-135M (benchmarks/quality.py):
- `down_proj` and the LM head stay in float32. Their inputs (the SwiGLU products, the final
  norm's output) carry outlier channels that one 8-bit scale cannot hold: quantizing `down_proj`
  made perplexity 70% worse, and the head alone added 2.5 points.
- Activations use the full 8 bits (reduce_range off). The 7-bit range that avoids AVX2's int16
  saturation made perplexity 3x worse, and saturation did not show in the perplexity.
- The activation scale is per call, so a request's numerics depend on the rows batched with it, as
  with vLLM's dynamic per-tensor FP8. Greedy output can differ between batched and single runs.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

logger = logging.getLogger("hyperserve.quantization")

METHODS = ("int8",)
KEEP_FLOAT = frozenset({"down_proj", "lm_head"})  # layers whose inputs have outlier channels (see above)


class Int8Linear(nn.Module):
    """y = x W^T + b with W in int8, per-output-channel scales (symmetric)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        weight = weight.detach().float()
        scales = (weight.abs().amax(dim=1).clamp(min=1e-8) / 127).double()  # [out]
        zero_points = torch.zeros(weight.shape[0], dtype=torch.long)
        qweight = torch.quantize_per_channel(weight, scales, zero_points, axis=0, dtype=torch.qint8)
        self._packed = torch.ops.quantized.linear_prepack(qweight, None if bias is None else bias.detach().float())
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.num_bytes = weight.numel() + 8 * weight.shape[0] + (0 if bias is None else 4 * bias.numel())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.quantized.linear_dynamic(x, self._packed, False)  # False: full 8-bit activations


def quantize_model(model: nn.Module, method: str) -> tuple[int, int]:
    """Replace the projections but KEEP_FLOAT in place; returns weight bytes before and after."""
    if method not in METHODS:
        raise ValueError(f"quantization must be one of {METHODS}, got {method!r}")
    before = sum(p.numel() * p.element_size() for p in model.parameters())
    replaced: list[tuple[nn.Module, str, nn.Linear]] = [
        (parent, name, child) for parent in model.modules() for name, child in parent.named_children()
        if isinstance(child, nn.Linear) and name not in KEEP_FLOAT]
    for parent, name, linear in replaced:
        setattr(parent, name, Int8Linear(linear.weight, linear.bias))
    after = (sum(p.numel() * p.element_size() for p in model.parameters())
             + sum(m.num_bytes for m in model.modules() if isinstance(m, Int8Linear)))
    logger.info("quantized %d linear layers to %s: weights %.0f MB -> %.0f MB", len(replaced), method,
                before / 2**20, after / 2**20)
    return before, after
