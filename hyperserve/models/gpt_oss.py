"""GPT-OSS (gpt-oss-20b, gpt-oss-120b): the Llama family's decoder (models/llama.py) with OpenAI's
differences, each a small switch there:

- Attention sinks: every head has a learned logit that joins each row's softmax as a key with no
  value, so a head can attend to almost nothing. The attention backends take them (`sinks`).
- Layers alternate a 128-token sliding window and full attention (`layer_types`), as Gemma's do:
  the windowed layers keep their own KV pool and release what the window has passed.
- Biases on q/k/v and o, on the router's logits and on every expert's projections.
- A mixture of experts (32 in 20b, 128 in 120b, 4 a token) whose weights are the softmax of the
  chosen experts' logits, and whose activation is a clamped SwiGLU (`ClampedSwiGLU`).
- YaRN rotary (transformers' tables) over the whole head.

Checkpoints store each layer's experts stacked: transformers' layout [E, in, out] (transposed
against a Linear's [out, in]) with gate and up interleaved column by column, OpenAI's MXFP4
(`*_blocks`: 4-bit codes, two a byte, 32 a block; `*_scales`: a power of two per block, E8M0),
in the Linear's [out, in] order, or llama.cpp's GGUF (MXFP4 blocks of its own byte order, read
by models/gguf_reader.py; gate and up apart, [E, out, in], split as other models' stacked
experts). `expert_tensors` turns the first two into every expert's gate, up and down
projections. With the mxfp4 quantization (the CPU's default for these checkpoints) MXFP4 experts
stay as they are stored, their bytes reordered (layers/quantization.py's pack_mxfp4 rows);
otherwise they are dequantized to float32 as they arrive (then int4/int8/fp8 as asked).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from hyperserve.layers.quantization import mxfp4_rows

GPT_OSS_TYPES = ("gpt_oss",)

# MXFP4's 16 codes (E2M1): sign, two exponent bits, one mantissa bit
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)

_STACKED = re.compile(r"(.*\.mlp\.experts)\.(gate_up_proj|down_proj)(_bias|_blocks|_scales)?")


@dataclass(frozen=True)
class ClampedSwiGLU:
    """GPT-OSS's activation of the fused gate/up output (gate rows first, then up, as our layers
    hold them): gate clamped above at `limit`, up to [-limit, limit], then
    (up + 1) * gate * sigmoid(alpha * gate)."""

    alpha: float
    limit: float

    def __call__(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        gate = gate.clamp(max=self.limit)
        up = up.clamp(-self.limit, self.limit)
        return (up + 1) * gate * torch.sigmoid(gate * self.alpha)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, interleaved: bool = True) -> torch.Tensor:
    """blocks uint8 [..., G, 16], scales uint8 [..., G] (2^(s - 127)) -> float32 [..., G * 32].
    interleaved: each byte holds two neighbours, the first in its low nibble (OpenAI's); else the
    low nibbles hold a block's first 16 values and the high ones its last 16 (llama.cpp's)."""
    table = torch.tensor(FP4_VALUES, dtype=torch.float32)
    low, high = blocks & 0x0F, blocks >> 4
    codes = (torch.stack([low, high], dim=-1).flatten(-2) if interleaved
             else torch.cat([low, high], dim=-1)).long()  # [..., G, 32]
    values = torch.ldexp(table[codes], scales.to(torch.int32).unsqueeze(-1) - 127)
    return values.flatten(-2)


def openai_mxfp4_rows(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """OpenAI's MXFP4 blocks uint8 [..., G, 16] (each byte two neighbours, the first in its low
    nibble) and scales [..., G] -> pack_mxfp4's rows [..., G * 17] (a group's first 16 codes in the
    low nibbles, then the scales): the same weights."""
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).flatten(-2)  # [..., G, 32]
    return mxfp4_rows(codes, scales)


def expert_tensors(tensors: Iterable[tuple[str, torch.Tensor]], keep_mxfp4: bool = False
                   ) -> Iterator[tuple[str, torch.Tensor]]:
    """A GPT-OSS checkpoint's tensors under the names the model loads: the router as the mixture's
    gate, stacked experts of OpenAI's and transformers' layouts as each expert's projections, with
    their biases (a GGUF's, gate and up apart, the loader splits as other models'). MXFP4 blocks
    wait for their scales (or the scales for their blocks), whichever comes first, and come as
    pack_mxfp4's rows with `keep_mxfp4`, else dequantized."""
    waiting: dict[str, torch.Tensor] = {}
    for name, tensor in tensors:
        name = name.replace(".mlp.router.", ".mlp.gate.")
        stacked = _STACKED.fullmatch(name)
        if stacked is None:
            yield name, tensor
            continue
        prefix, projection, suffix = stacked.groups()
        if suffix in ("_blocks", "_scales"):
            other = waiting.pop(f"{prefix}.{projection}{'_scales' if suffix == '_blocks' else '_blocks'}", None)
            if other is None:
                waiting[name] = tensor
                continue
            blocks, scales = (tensor, other) if suffix == "_blocks" else (other, tensor)
            # [E, out, in] floats or [E, out, in * 17 / 32] bytes: rows either way
            weights = openai_mxfp4_rows(blocks, scales) if keep_mxfp4 else dequantize_mxfp4(blocks, scales)
        elif suffix == "_bias":
            weights = tensor  # [E, out]
        else:
            weights = tensor.transpose(1, 2)  # transformers' [E, in, out]
        leaf = "bias" if suffix == "_bias" else "weight"
        for expert, weight in enumerate(weights):
            if projection == "down_proj":
                yield f"{prefix}.{expert}.down_proj.{leaf}", weight
            else:  # gate and up interleaved, row by row
                yield f"{prefix}.{expert}.gate_proj.{leaf}", weight[0::2]
                yield f"{prefix}.{expert}.up_proj.{leaf}", weight[1::2]
    if waiting:
        raise ValueError(f"MXFP4 tensors without their blocks or scales: {sorted(waiting)[:3]}")
