"""Weight quantization at load time: int4, int8 and mxfp4 on the CPU, fp8 on any device.

Decoding is bound by the bytes of weights read per token, so each method stores fewer of them.

`int4`: 4-bit weights in groups of 32 along the input, each group with its own scale and minimum
(w = q * scale + min, q in 0..15). That is exactly GGUF's Q4_1 layout, so a Q4_1 checkpoint is
re-quantized without loss: our int4 weights equal the GGUF's. The LM head stays in 8 bits: in 4 it
cost 7% perplexity, in int8 1% (benchmarks/quality.py). With the native kernels the embedding and
head are GGUF's Q8_0 (int8 in groups of 32, a float16 scale each; again exact for a GGUF whose
embedding is Q8_0, as SmolLM2's is), one copy serving both when they are tied; without them the
head is a PyTorch int8 linear (`Int8Head`) and the embedding stays float.

Int4 projections run their packed kernel for small batches (decode and speculative verification,
up to `QUANTIZED_MAX_ROWS` rows in GGUF's row layout, `INTERLEAVED_MAX_ROWS` in the interleaved
one): bandwidth-bound, they gain from reading fewer bytes. Larger batches (long prefills) are
compute-bound and multiply the weights dequantized per call in the CPU's fastest dense type
(bfloat16 where the CPU multiplies it natively, see `dense_dtype`). Where that is float32
(AVX2-only CPUs) the fused decoder layers (layers/fused_decode.py) take every step instead: the
interleaved layout's 8-bit kernel prefills faster than float32 products there.
The Q8_0 head runs its kernel for any number of rows.

`int8` with the native kernels: every projection, the embedding and the head in GGUF's Q8_0
(`Q8Linear`, `Q8Embedding`, `Q8Head`), against 16-bit activations per group of 32. A GGUF in 5- to
8-bit types (Q5_0, Q6_K, Q8_0: Gemma 3 270M's) keeps its weights exactly or nearly, where int4 lost
27% perplexity on Gemma 3 270M; its 262k-token head, 63% of the model, is read in 8 bits rather
than float32 (decode 10 -> 45 tok/s on a 2-core AMD EPYC's AVX2 paths).

`mxfp4` (native kernels only): the MLPs' projections in OCP's MXFP4 (`Mxfp4Linear`: 4-bit E2M1
codes in groups of 32, a power-of-two scale each, 17 bytes per 32 weights), the others, the
embedding and the head in Q8_0, as int8's. It is the default for checkpoints whose experts are MXFP4
(GPT-OSS's own and llama.cpp's GGUFs of it), whose blocks are then kept as stored: exactly the
weights the model was trained with (int4's evenly spaced codes missed them by 8% of a weight on
average) and loaded without a float32 copy (a 4-layer gpt-oss-20b shape: 14 s -> 3.4 s).

`int8` without them (and int4's head there): int8 weights with one scale per output channel, run by
PyTorch's x86 quantized engine (fbgemm) as dynamic linears: each call quantizes its input to 8 bits
with one scale for the whole call. Measured on SmolLM2-135M (benchmarks/quality.py):
- `down_proj` and the LM head stay in float32 (KEEP_FLOAT_INT8). Their inputs carry outlier
  channels that one 8-bit scale cannot hold: quantizing `down_proj` made perplexity 70% worse,
  and the head alone added 2.5 points.
- Activations use the full 8 bits where the CPU has VNNI; the 7-bit range (reduce_range) made
  perplexity 3x worse there. Without VNNI fbgemm sums pairs of 8-bit products in 16 bits, which
  full-range activations overflow (SmolLM2's perplexity went from 26 to 5,556 on an AVX2-only
  EPYC), so those CPUs take the 7-bit range.
- The activation scale is per call, so a request's numerics depend on the rows batched with it, as
  with vLLM's dynamic per-tensor FP8. Greedy output can differ between batched and single runs.
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from hyperserve import kernels
from hyperserve.layers.linear import few_rows_gemv

logger = logging.getLogger("hyperserve.quantization")

METHODS = ("int4", "int8", "fp8", "mxfp4")
FP8_MAX = torch.finfo(torch.float8_e4m3fn).max
KEEP_FLOAT_INT8 = frozenset({"down_proj", "lm_head"})  # layers whose inputs have outlier channels (see above)
INT4_GROUP_SIZE = 32
PACK_ROWS = 4096  # rows pack_q80 quantizes at a time
# interleave_q41's group of a block: its 8 channels' codes, scales and minimums
Q41_BLOCK_GROUP_BYTES = 8 * (INT4_GROUP_SIZE // 2 + 4)
# Up to this many rows the packed kernel runs, beyond it the dense copy. SmolLM2 int4, output tok/s
# decoding 8 / 16 / 24 sequences on the 2-core AMX VM: threshold 4: 207 / 359 / 467; 16: 294 / 361
# / 472; 32: 283 / 362 / 416. It also covers a speculative verify step (k + 1 rows per request).
QUANTIZED_MAX_ROWS = 16
# The interleaved layout's 8-bit kernel stays ahead of dequantizing for a bfloat16 product much
# longer: on the 2-core AMX VM (AVX-512 VNNI), SmolLM2 int4 steps of 64 / 128 / 256 / 512 tokens took
# 61 / 125 / 268 / 641 ms in the kernel, 142 / 172 / 282 / 514 ms dense (dequantizing is 90 of them).
INTERLEAVED_MAX_ROWS = 256


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The instruction-set flags our code paths may use. HYPERSERVE_MAX_ISA=avx2 hides AVX-512 and
    AMX, so that an AVX-512 machine takes the AVX2-only class's paths (benchmarks/cpu_vs_llamacpp.py
    --isa avx2). So does a CPU whose CPUID (which PyTorch and the native kernels ask) denies AVX-512
    that /proc/cpuinfo lists: an emulator's (qemu-user shows its host's file), or
    ATEN_CPU_CAPABILITY set lower."""
    flags = hardware_cpu_flags()
    if os.environ.get("HYPERSERVE_MAX_ISA") == "avx2" or torch.backends.cpu.get_cpu_capability() != "AVX512":
        flags = frozenset(f for f in flags if not f.startswith(("avx512", "amx")))
    return flags


@functools.cache
def hardware_cpu_flags() -> frozenset[str]:
    """The CPU's flags, from /proc/cpuinfo (empty where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def dense_dtype() -> torch.dtype:
    """bfloat16 where the CPU multiplies it natively (AMX or AVX-512 BF16: 4-5x float32's speed
    at 16+ rows here), float32 elsewhere (on AVX2, bfloat16 matmuls were 4x slower than float32)."""
    native = {"amx_bf16", "avx512_bf16"} & cpu_flags()
    return torch.bfloat16 if native else torch.float32


class DenseForLargeBatches(nn.Module):
    """A quantized linear for small batches that multiplies a dense weight (`dense()`, in
    `dense_dtype`) for more than `max_rows` rows. Subclasses implement both."""

    max_rows = QUANTIZED_MAX_ROWS
    _bias: torch.Tensor | None = None  # added to the output, in its dtype

    @property
    def output_bias(self) -> torch.Tensor | None:
        return self._bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > self.max_rows:
            weight = self.dense()
            out = F.linear(x.to(weight.dtype), weight).to(x.dtype)
        else:
            out = self.small_batch(x).to(x.dtype)
        return out if self._bias is None else out + self._bias.to(out.dtype)

    def dense(self) -> torch.Tensor:
        raise NotImplementedError

    def small_batch(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class Int4Linear(DenseForLargeBatches):
    """y = x W^T + b with W in 4 bits, groups of 32 along the input with a scale and a minimum.

    With the native CPU kernels (hyperserve.kernels) the weight is kept once, in GGUF's Q4_1 layout
    (`q41`, see pack_q41), for `quantized_linear` and the fused decode layer; larger steps dequantize it
    per call (a few percent of a prefill's matmul time, and no dense copy held). Without them it
    is kept in PyTorch's int4 pack for `_weight_int4pack_mm_for_cpu` (bfloat16 activations) and
    as a dense copy for larger steps."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dense: torch.dtype) -> None:
        """`weight`: float [out, in], or with the native kernels a Q4_0 or Q4_1 checkpoint's blocks
        as pack_q41's rows (uint8 [out, in * 5 / 8], models/loader.py), kept as they are."""
        super().__init__()
        self.native = kernels.available()
        self.dense_dtype = dense
        packed = weight.dtype == torch.uint8
        if packed and not self.native:
            raise ValueError("pack_q41 rows need the native kernels")
        out_features, in_features = weight.shape[0], weight.shape[1] * 8 // 5 if packed else weight.shape[1]
        if in_features % INT4_GROUP_SIZE:
            raise ValueError(f"int4 needs in_features divisible by {INT4_GROUP_SIZE}, got {in_features}")
        if not packed:
            groups = weight.detach().float().reshape(out_features, -1, INT4_GROUP_SIZE)
            low, high = groups.amin(-1), groups.amax(-1)
            # scale and minimum rounded to float16 as GGUF stores them (a Q4_1 checkpoint's come back exactly)
            low = low.half().float()
            scale = ((high - low) / 15).clamp(min=2**-24).half().float()
            codes = ((groups - low[..., None]) / scale[..., None]).round_().clamp_(0, 15)
        if self.native:
            self.q41 = weight.detach() if packed else pack_q41(codes.to(torch.uint8), scale, low)
            if interleaves_q41() and out_features % 8 == 0:
                self.q41 = interleave_q41(self.q41)
                self.max_rows = INTERLEAVED_MAX_ROWS
            self.num_bytes = self.q41.numel()
        else:
            self._packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
                codes.reshape(out_features, in_features).to(torch.int32), 1)
            # the kernel computes (q - 8) * scale + zero, so zero = min + 8 * scale; [groups, out, 2]
            scale_zero = torch.stack([scale, low + 8 * scale], -1)
            self._scale_zero = scale_zero.transpose(0, 1).contiguous().bfloat16()
            dequantized = (codes * scale[..., None] + low[..., None]).reshape(out_features, in_features)
            self._dense = dequantized.to(dense)
            self.num_bytes = (self._packed.numel() + 2 * self._scale_zero.numel()
                              + self._dense.numel() * self._dense.element_size())
        self._bias = None if bias is None else bias.detach().float()
        self.in_features, self.out_features = in_features, out_features

    def dense(self) -> torch.Tensor:
        if self.native:
            return torch.ops.hyperserve.dequantize(self.q41, self.in_features, "q4_1").to(self.dense_dtype)
        return self._dense

    def small_batch(self, x: torch.Tensor) -> torch.Tensor:
        if self.native:
            return torch.ops.hyperserve.quantized_linear(x, self.q41, "q4_1")
        return torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.to(torch.bfloat16), self._packed, INT4_GROUP_SIZE, self._scale_zero)


def pack_q41(codes: torch.Tensor, scale: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    """codes [out, groups, 32] (0..15), scale and minimum [out, groups] -> the native kernels' rows
    [out, in / 2 + 4 * groups] of uint8: each channel's codes (byte j of a group: code j in the low
    nibble, code j + 16 in the high one), then its scales, then its minimums, in float16 as GGUF
    stores them."""
    nibbles = (codes[..., :16] | (codes[..., 16:] << 4)).flatten(1)
    halves = [t.to(torch.float16).contiguous().view(torch.uint8) for t in (scale, low)]
    return torch.cat([nibbles, *halves], dim=1).contiguous()


def interleaves_q41() -> bool:
    """Whether int4 weights are laid out for the interleaved kernel (interleave_q41): wherever the
    native kernels have a vector path (AVX2, AVX-512 VNNI). Its 8-bit activations (as llama.cpp's
    Q8_1) take half the instructions of the 16-bit row kernel on AVX2 (SmolLM2's 30 layers went
    from 13.7 to 8.4 ms a token on a 2-core AMD EPYC, AVX2 only) and a third with VNNI, whose
    `vpdpbusd` sums four products into 32 bits: a verified draft row cost a third as much there.
    Decode-path perplexity is +1.1-1.7% over float32 against +0.01% (benchmarks/quality.py)."""
    return kernels.isa() in ("avx2", "avx512_vnni")


def interleave_q41(rows: torch.Tensor) -> torch.Tensor:
    """pack_q41's rows [out, in / 2 + 4 * groups] -> the same bytes in blocks of 8 channels
    [out / 8, groups, 160]: for each group, the 8 channels' codes 4 bytes at a time (byte 32 k + 4 c +
    i is byte 4 k + i of channel c's group), then their 8 scales, then their 8 minimums. The native
    kernels multiply this layout 8 channels at once against 8-bit activations (kernels/cpu_ops.cpp)."""
    return _interleave_by_8(rows, field_bytes=(2, 2))


def _interleave_by_8(rows: torch.Tensor, field_bytes: tuple[int, ...]) -> torch.Tensor:
    """Rows [out, 16 * groups + sum(field_bytes) * groups] (each channel's 4-bit codes, then its
    per-group fields of field_bytes bytes each) -> blocks of 8 channels [out / 8, groups, bytes]: the
    group's codes as interleave_q41 lays them out, then each field of the 8 channels in turn."""
    out_features, row_bytes = rows.shape
    groups = row_bytes // (16 + sum(field_bytes))
    blocks = out_features // 8
    codes = rows[:, : 16 * groups].reshape(blocks, 8, groups, 4, 4).permute(0, 2, 3, 1, 4)  # [b, g, k, c, i]
    parts, at = [codes], 16 * groups
    for size in field_bytes:
        parts.append(rows[:, at: at + size * groups].reshape(blocks, 8, groups, size).permute(0, 2, 1, 3))
        at += size * groups
    return torch.cat([t.reshape(blocks, groups, -1) for t in parts], dim=2).contiguous()


def pack_q80(weight: torch.Tensor) -> torch.Tensor:
    """weight [out, in] -> GGUF's Q8_0 rows [out, in + in / 16] of uint8 for the native kernels: each
    channel's int8 codes, then its float16 scales (a group's largest magnitude / 127). A Q8_0
    checkpoint's weights come back exactly. Rows are packed PACK_ROWS at a time, whose temporaries
    stay in cache: Gemma 3's 262k-row embedding took 0.18 s against 0.7 in one pass."""
    out_features, in_features = weight.shape
    if in_features % INT4_GROUP_SIZE:
        raise ValueError(f"Q8_0 needs in_features divisible by {INT4_GROUP_SIZE}, got {in_features}")
    packed = torch.empty(out_features, in_features + in_features // 16, dtype=torch.uint8)
    for start in range(0, out_features, PACK_ROWS):
        rows = weight[start:start + PACK_ROWS].detach().float()
        groups = rows.reshape(len(rows), -1, INT4_GROUP_SIZE)
        scale = (groups.abs().amax(-1) / 127).half()
        codes = (groups / scale.float().clamp(min=2**-24)[..., None]).round_().clamp_(-127, 127)
        codes = codes.to(torch.int8)
        packed[start:start + PACK_ROWS, :in_features] = codes.flatten(1).view(torch.uint8)
        packed[start:start + PACK_ROWS, in_features:] = scale.view(torch.uint8)
    return packed


def interleave_q80(rows: torch.Tensor) -> torch.Tensor:
    """pack_q80's rows [out, in + in / 16] -> blocks of 16 channels [ceil(out / 16), groups, 544], the
    last padded with zero channels: for each group, the 16 channels' codes 2 at a time (byte 32 p +
    2 c + i is code 2 p + i of channel c), then their 16 scales. The native kernels multiply 16
    channels at once in this layout, reading one stream of bytes per block (kernels/cpu_ops.cpp).
    Moved as 16-bit elements (a code pair, a scale): Gemma 3's 262k-row embedding took 0.20-0.24 s
    byte by byte, 0.10 s so."""
    out_features, row_bytes = rows.shape
    groups = row_bytes // 34
    out = torch.empty(-(-out_features // 16), groups, 16 * 34, dtype=torch.uint8)
    code_pairs, scales = out[..., : 16 * 32].view(torch.int16), out[..., 16 * 32:].view(torch.int16)
    for start in range(0, out_features, PACK_ROWS):  # PACK_ROWS at a time, as pack_q80
        chunk = rows[start:start + PACK_ROWS]
        chunk = F.pad(chunk, (0, 0, 0, -len(chunk) % 16))
        blocks, first = len(chunk) // 16, start // 16
        pairs = chunk[:, : 32 * groups].view(torch.int16).reshape(blocks, 16, groups, 16)  # [b, c, g, p]
        code_pairs[first:first + blocks].view(blocks, groups, 16, 16).copy_(pairs.permute(0, 2, 3, 1))
        chunk_scales = chunk[:, 32 * groups:].view(torch.int16).reshape(blocks, 16, groups)  # [b, c, g]
        scales[first:first + blocks] = chunk_scales.permute(0, 2, 1)
    return out


# E2M1's magnitudes (kernels' kFp4Doubled halved) and the midpoints that round to them
FP4_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_FP4_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def pack_mxfp4(weight: torch.Tensor) -> torch.Tensor:
    """weight [out, in] -> MXFP4 rows [out, in * 17 / 32] of uint8: each channel's 4-bit E2M1 codes
    (byte j of a group: code j in the low nibble, code j + 16 in the high one, as a GGUF's MXFP4 block
    holds them), then its E8M0 scale bytes, one per group of 32 (2^(e - 127)). The scale is the OCP
    MX rule's, llama.cpp's too: the largest power of two at most the group's largest magnitude, over
    4 (E2M1's largest power of two), each weight rounded to the nearest of the 15 values, those past 6
    to 6. Weights that are MXFP4 already (a dequantized checkpoint's) come back exactly."""
    out_features, in_features = weight.shape
    if in_features % INT4_GROUP_SIZE:
        raise ValueError(f"mxfp4 needs in_features divisible by {INT4_GROUP_SIZE}, got {in_features}")
    packed = torch.empty(out_features, in_features * 17 // 32, dtype=torch.uint8)
    midpoints = torch.tensor(_FP4_MIDPOINTS)
    for start in range(0, out_features, PACK_ROWS):  # pieces whose temporaries stay in cache, as pack_q80
        groups = weight[start:start + PACK_ROWS].detach().float().reshape(-1, in_features // 32, 32)
        exponent = torch.frexp(groups.abs().amax(-1))[1] - 3  # floor(log2(amax)) - 2
        exponent = (exponent + 127).clamp_(1, 254)  # 0 (2^-127) the kernels read as 0: the same weights
        scaled = groups / torch.ldexp(torch.ones(exponent.shape), exponent - 127)[..., None]
        magnitudes = torch.bucketize(scaled.abs(), midpoints).to(torch.uint8)
        codes = magnitudes | (((scaled < 0) & (magnitudes > 0)).to(torch.uint8) << 3)  # no -0: 0's code is 0
        packed[start:start + PACK_ROWS] = mxfp4_rows(codes, exponent.to(torch.uint8))
    return packed


def mxfp4_rows(codes: torch.Tensor, exponents: torch.Tensor) -> torch.Tensor:
    """codes uint8 [..., out, groups, 32] (0..15), E8M0 exponents uint8 [..., out, groups] ->
    pack_mxfp4's rows [..., out, groups * 17]."""
    nibbles = (codes[..., :16] | (codes[..., 16:] << 4)).flatten(-2)
    return torch.cat([nibbles, exponents], dim=-1)


def interleave_mxfp4(rows: torch.Tensor) -> torch.Tensor:
    """pack_mxfp4's rows -> blocks of 8 channels [out / 8, groups, 136]: interleave_q41's code bytes,
    then the 8 channels' scale bytes."""
    return _interleave_by_8(rows, field_bytes=(1,))


class Mxfp4Linear(DenseForLargeBatches):
    """y = x W^T + b with W in MXFP4 (OCP's microscaling 4-bit floats: E2M1 codes in groups of 32
    along the input, an E8M0 power-of-two scale each), the format GPT-OSS's experts were trained and
    published in: a checkpoint's blocks are kept as they are (models/loader.py), 4.25 bits a weight
    against int4's 5. The native kernel multiplies them (interleave_mxfp4's blocks, 8-bit
    activations, looking the codes up as integers) up to INTERLEAVED_MAX_ROWS rows, a dense
    product beyond."""

    max_rows = INTERLEAVED_MAX_ROWS

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        """`weight`: float [out, in], or pack_mxfp4's rows (uint8 [out, in * 17 / 32]) as they are."""
        super().__init__()
        if not kernels.available():
            raise ValueError("mxfp4 weights need the native CPU kernels (hyperserve.kernels)")
        packed = weight.dtype == torch.uint8
        self.out_features = weight.shape[0]
        self.in_features = weight.shape[1] * 32 // 17 if packed else weight.shape[1]
        if self.out_features % 8:
            raise ValueError(f"mxfp4 needs out_features divisible by 8, got {self.out_features}")
        self.mxfp4 = interleave_mxfp4(weight.detach() if packed else pack_mxfp4(weight))
        self.num_bytes = self.mxfp4.numel()
        self._bias = None if bias is None else bias.detach().float()

    def dense(self) -> torch.Tensor:
        return torch.ops.hyperserve.dequantize(self.mxfp4, self.in_features, "mxfp4").to(dense_dtype())

    def small_batch(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.hyperserve.quantized_linear(x, self.mxfp4, "mxfp4")


class Q8Embedding(nn.Module):
    """The token embedding in Q8_0 (pack_q80, or interleave_q80's blocks where the int4 weights are
    interleaved), rows dequantized on lookup: a quarter of float32's memory, and the same bytes as a
    tied Q8Head."""

    def __init__(self, q80: torch.Tensor, num_embeddings: int, embedding_dim: int,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.q80, self.embedding_dim, self.dtype = q80, embedding_dim, dtype
        self.num_embeddings = num_embeddings
        self.num_bytes = q80.numel()

    def lookup(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Float32 rows [N, embedding_dim] of N token ids."""
        return torch.ops.hyperserve.dequantize(self.q80, self.embedding_dim, "q8_0", input_ids.reshape(-1))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.lookup(input_ids).view(*input_ids.shape, self.embedding_dim).to(self.dtype)


class Q8Head(nn.Module):
    """The LM head of an int4 model in Q8_0, run by the native kernel for any number of rows (16-bit
    activations per group of 32), so a row's logits never depend on how many rows its step samples.
    A step samples one row per request (and its drafts), and up to 128 rows the kernel beat the
    dequantized float32 product (at 16 rows 14.5 against 84 ms; 2-core AMD EPYC, AVX2 only).
    `shared`: the bytes belong to a tied Q8Embedding, which counts them."""

    def __init__(self, q80: torch.Tensor, out_features: int, in_features: int, shared: bool) -> None:
        super().__init__()
        self.q80, self.out_features, self.in_features = q80, out_features, in_features
        self.num_bytes = 0 if shared else q80.numel()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # float32 logits: in bfloat16 near-ties would tie; interleaved blocks pad the vocabulary
        return torch.ops.hyperserve.quantized_linear(x.float(), self.q80, "q8_0")[:, : self.out_features]


class Q8Linear(DenseForLargeBatches):
    """y = x W^T + b with W in GGUF's Q8_0 (pack_q80: int8 codes in groups of 32 along the input, a
    float16 scale each; interleave_q80's blocks where the int4 weights are interleaved), by the
    native kernel against 16-bit activations per group up to INTERLEAVED_MAX_ROWS rows, as a dense
    product beyond. Q5_0, Q6_K and Q8_0 weights fit its 8 bits exactly or nearly."""

    max_rows = INTERLEAVED_MAX_ROWS

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        rows = pack_q80(weight)
        self.q80 = interleave_q80(rows) if interleaves_q41() else rows
        self.num_bytes = self.q80.numel()
        self._bias = None if bias is None else bias.detach().float()

    def dense(self) -> torch.Tensor:
        weight = torch.ops.hyperserve.dequantize(self.q80, self.in_features, "q8_0")
        return weight[: self.out_features].to(dense_dtype())

    def small_batch(self, x: torch.Tensor) -> torch.Tensor:
        # interleaved blocks pad the output to a multiple of 16 channels
        return torch.ops.hyperserve.quantized_linear(x.float(), self.q80, "q8_0")[:, : self.out_features]


class Int8Head(DenseForLargeBatches):
    """The LM head of an int4 model without the native kernels: int8 (per-channel scales).
    Decode-sized batches run it as a dynamic int8 linear, whose activation scale covers one or a
    few tokens; larger ones multiply its dequantized weight (rarely needed: a step computes
    logits only for the tokens it samples)."""

    def __init__(self, weight: torch.Tensor, dense: torch.dtype) -> None:
        super().__init__()
        self._int8 = Int8Linear(weight, None)
        self.dense_dtype = dense
        self.num_bytes = 0  # _int8 counts itself

    def dense(self) -> torch.Tensor:
        return torch.ops.quantized.linear_unpack(self._int8._packed)[0].dequantize().to(self.dense_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.float())  # float32 logits, as Q8Head's

    def small_batch(self, x: torch.Tensor) -> torch.Tensor:
        return self._int8(x)


def int8_reduce_range() -> bool:
    """Whether fbgemm's dynamic int8 linears need 7-bit activations: on CPUs without VNNI (see the
    module's docstring). fbgemm picks its kernels from the hardware, so HYPERSERVE_MAX_ISA does not count."""
    return not {"avx512_vnni", "avx_vnni", "amx_int8"} & hardware_cpu_flags()


class Int8Linear(nn.Module):
    """y = x W^T + b with W in int8, per-output-channel scales (symmetric)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        weight = weight.detach().float()
        scales = (weight.abs().amax(dim=1).clamp(min=1e-8) / 127).double()  # [out]
        zero_points = torch.zeros(weight.shape[0], dtype=torch.long)
        qweight = torch.quantize_per_channel(weight, scales, zero_points, axis=0, dtype=torch.qint8)
        bias = None if bias is None else bias.detach().float()
        self._packed = torch.ops.quantized.linear_prepack(qweight, bias)
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.num_bytes = weight.numel() + 8 * weight.shape[0] + (0 if bias is None else 4 * bias.numel())
        self.reduce_range = int8_reduce_range()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.quantized.linear_dynamic(x, self._packed, self.reduce_range)


class Fp8Linear(nn.Module):
    """y = x W^T + b with W in float8 (e4m3) and one scale per output channel. Larger calls scale
    their input to float8 per row (token), so one token's outliers cost no other token precision,
    and run torch._scaled_mm: FP8 tensor cores on Hopper/Ada GPUs. Calls of a few rows on CUDA
    (decode) run the Triton GEMV instead (layers/triton_gemv.py): weight-only float8, reading
    half the weight bytes of bfloat16 without the activation quantization's extra kernels. The CPU,
    which has no float8 arithmetic, runs it weight-only too: the weight is widened per call (scaling
    activations to e4m3 as well cost SmolLM2 +3.4% perplexity on an AVX2-only EPYC)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        weight = weight.detach().float()
        scale = weight.abs().amax(dim=1).clamp(min=1e-12) / FP8_MAX  # [out]
        self._weight_t = (weight / scale[:, None]).to(torch.float8_e4m3fn).t()  # [in, out], column-major
        self._scale = scale[None, :].contiguous()  # [1, out]
        self._bias = None if bias is None else bias.detach()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        bias_bytes = 0 if bias is None else bias.numel() * bias.element_size()
        self.num_bytes = weight.numel() + 4 * weight.shape[0] + bias_bytes

    @property
    def gemv_operands(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(float8 weight [N, K], per-channel scale, bias or None) as triton_gemv.gemv takes them."""
        return self._weight_t.t(), self._scale[0], self._bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = few_rows_gemv(x, *self.gemv_operands)
        if y is not None:
            return y
        if not x.is_cuda:
            weight = self._weight_t.t().to(x.dtype) * self._scale[0, :, None].to(x.dtype)
            return F.linear(x, weight, None if self._bias is None else self._bias.to(x.dtype))
        rows = x.reshape(-1, self.in_features)
        x_scale = rows.abs().amax(dim=1, keepdim=True).float().clamp(min=1e-12) / FP8_MAX  # [M, 1]
        codes = (rows.float() / x_scale).to(torch.float8_e4m3fn)
        # the row-wise scaled GEMM writes bfloat16 only
        y = torch._scaled_mm(codes, self._weight_t, scale_a=x_scale, scale_b=self._scale,
                             out_dtype=torch.bfloat16)
        if self._bias is not None:
            y = y + self._bias.to(y.dtype)
        return y.to(x.dtype).view(*x.shape[:-1], self.out_features)


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's weights: its parameters and the packed weights of quantized layers,
    which are not parameters (they count themselves in num_bytes)."""
    packed = sum(getattr(m, "num_bytes", 0) for m in model.modules())
    return sum(p.numel() * p.element_size() for p in model.parameters()) + packed


MLP_PROJECTIONS = frozenset({"gate_up_proj", "down_proj"})  # mxfp4's: the MLPs' and experts'


def quantize_linears(module: nn.Module, method: str) -> None:
    """Replace the projections inside `module` by their `method` kind in place, the LM head (and
    for int8 the KEEP_FLOAT_INT8 layers) excepted; their float weights are then dropped. mxfp4
    takes the MLPs' projections (GPT-OSS's experts, the MXFP4 tensors of its checkpoints) and
    keeps the others in Q8_0, as GPT-OSS's own checkpoints keep attention in 8 or 16 bits and
    llama.cpp's GGUFs of it in Q8_0. The loader calls it on each decoder layer as soon as its
    weights are in (models/loader.py)."""
    if method not in METHODS:
        raise ValueError(f"quantization must be one of {METHODS}, got {method!r}")
    fbgemm = method == "int8" and not kernels.available()
    kept = KEEP_FLOAT_INT8 if fbgemm else {"lm_head"}
    linears = [(parent, name, child) for parent in module.modules() for name, child in parent.named_children()
               if isinstance(child, nn.Linear) and name not in kept]
    for parent, name, linear in linears:
        if method == "int4":
            setattr(parent, name, Int4Linear(linear.weight, linear.bias, dense_dtype()))
        elif method == "int8":
            kind = Int8Linear if fbgemm else Q8Linear
            quantized = kind(linear.weight, linear.bias)
            setattr(parent, name, quantized)
        elif method == "mxfp4":
            kind = Mxfp4Linear if name in MLP_PROJECTIONS else Q8Linear
            setattr(parent, name, kind(linear.weight, linear.bias))
        else:  # fp8: every projection but the LM head, as vLLM does
            setattr(parent, name, Fp8Linear(linear.weight, linear.bias))


def packs_embeddings_q80(method: str | None) -> bool:
    """Whether `method` keeps the embedding and the LM head in Q8_0 (Q8Embedding, Q8Head)."""
    return method in ("int4", "int8", "mxfp4") and kernels.available()


def quantize_model(model: nn.Module, method: str, dtype: torch.dtype,
                   packed: dict[str, torch.Tensor] | None = None) -> tuple[int, int]:
    """Replace the model's projections in place (those not replaced yet), then cast what stays
    float to `dtype`; returns weight bytes before and after. For int4 and int8 the model must hold
    float32 weights (a bfloat16 round trip would lose the exactness of int4 on Q4_1 checkpoints);
    fp8 takes any float dtype, since e4m3 keeps fewer mantissa bits than bfloat16. With int4 the LM
    head is 8-bit, and so is int8's with the native kernels (see the module's docstring). `packed`:
    the embedding's or the head's pack_q80 rows where the loader read them as such (their weights
    then never left the meta device)."""
    before = weight_bytes(model)
    quantize_linears(model, method)
    tied, hidden_size = model.lm_head is None, model.config.hidden_size
    if packs_embeddings_q80(method):
        packed = packed or {}

        def pack(name: str, weight: torch.Tensor) -> torch.Tensor:
            rows = packed[name] if name in packed else pack_q80(weight)
            # interleaved where the int4 weights are: the same bytes, for kernels with no per-row permutes
            return interleave_q80(rows) if interleaves_q41() else rows

        embedding_weight = model.model.embed_tokens.weight
        embedding = pack("model.embed_tokens.weight", embedding_weight)
        model.model.embed_tokens = Q8Embedding(embedding, embedding_weight.shape[0], hidden_size, dtype)
        head_weight = embedding_weight if tied else model.lm_head.weight
        head = embedding if tied else pack("lm_head.weight", head_weight)
        model.lm_head = Q8Head(head, head_weight.shape[0], hidden_size, shared=tied)
    elif method == "int4":  # without the native kernels: the head in PyTorch's int8
        head_weight = model.model.embed_tokens.weight if tied else model.lm_head.weight
        model.lm_head = Int8Head(head_weight, dense_dtype())
    model.to(dtype)
    after = weight_bytes(model)
    logger.info("quantized the linear layers to %s: weights %.0f MB -> %.0f MB", method, before / 2**20,
                after / 2**20)
    return before, after
