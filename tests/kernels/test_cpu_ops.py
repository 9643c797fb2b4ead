"""The native CPU kernels against plain PyTorch arithmetic on the same numbers."""

import pytest
import torch

from hyperserve import kernels
from hyperserve.layers.quantization import (
    FP4_MAGNITUDES,
    Q8Embedding,
    cpu_flags,
    interleave_mxfp4,
    interleave_q41,
    interleave_q80,
    mxfp4_rows,
    pack_mxfp4,
    pack_q41,
    pack_q80,
)

pytestmark = pytest.mark.skipif(not kernels.available(), reason="the native CPU kernels could not be built here")


def quantized(out_features: int, in_features: int, format: str = "q4_1", seed: int = 0) -> tuple[torch.Tensor, ...]:
    """A random weight in `format`: (the kernels' packed rows, the same weight in float32)."""
    generator = torch.Generator().manual_seed(seed)
    groups = (out_features, in_features // 32)
    scale = (torch.rand(groups, generator=generator) * 0.01 + 1e-3).half().float()
    if format == "q8_0":
        codes = torch.randint(-127, 128, (*groups, 32), generator=generator)
        codes[..., 0] = 127  # each group reaches +-127, as GGUF's Q8_0 groups do
        weight = (codes * scale[..., None]).reshape(out_features, in_features)
        return pack_q80(weight), weight
    codes = torch.randint(0, 16, (*groups, 32), generator=generator, dtype=torch.uint8)
    low = (-torch.rand(groups, generator=generator) * 0.05).half().float()
    weight = (codes.float() * scale[..., None] + low[..., None]).reshape(out_features, in_features)
    return pack_q41(codes, scale, low), weight


ISAS = ["portable", "avx2", "avx512_vnni"]


def isas_here() -> list[str]:
    """The instruction sets this CPU can run, up to the one the kernels pick."""
    return ISAS[: ISAS.index(kernels.isa()) + 1]


def runnable(isa: str) -> None:
    if isa not in isas_here():
        pytest.skip(f"this CPU has no {isa}")


@pytest.mark.parametrize("format", ["q4_1", "q8_0"])
@pytest.mark.parametrize("isa", ISAS)
# 2 groups (one pair); 11 (eight at a time, then three: an odd count AVX-512 leaves to AVX2); 36 (16 and 2 pairs)
@pytest.mark.parametrize("in_features", [64, 352, 1152])
@pytest.mark.parametrize("rows", [1, 2, 3, 8, 9, 16])  # tiles of 4 and 2 channels, of 8 rows, the rest
def test_quantized_linear_equals_the_dequantized_weight_within_16_bit_activations(rows, in_features, isa, format):
    runnable(isa)
    packed, weight = quantized(80, in_features, format)
    x = torch.randn(rows, in_features)
    expected = x @ weight.T
    got = torch.ops.hyperserve.quantized_linear(x, packed, format, isa)
    assert got.shape == (rows, 80) and got.dtype == torch.float32
    assert (got - expected).norm() / expected.norm() < 1e-4
    wrong, _ = quantized(80, in_features, format, seed=1)
    assert (torch.ops.hyperserve.quantized_linear(x, wrong, format, isa) - expected).norm() / expected.norm() > 0.3


@pytest.mark.parametrize("isa", ISAS)
def test_no_rows_give_an_empty_output(isa):
    """A prefill chunk that samples nothing asks the LM head for logits of no rows (the row
    tiling once divided by the row count there, and the process died of SIGFPE)."""
    runnable(isa)
    packed, _ = quantized(80, 64, "q8_0")
    assert torch.ops.hyperserve.quantized_linear(torch.empty(0, 64), packed, "q8_0", isa).shape == (0, 80)


@pytest.mark.parametrize("format", ["q4_1", "q8_0"])
def test_every_instruction_set_gives_the_portable_kernels_numbers(format):
    """Integer sums are exact, so the paths differ only in the order of their float additions."""
    runnable("avx2")
    packed, _ = quantized(64, 576, format)
    x = torch.randn(5, 576)
    portable = torch.ops.hyperserve.quantized_linear(x, packed, format, "portable")
    for isa in isas_here()[1:]:
        torch.testing.assert_close(torch.ops.hyperserve.quantized_linear(x, packed, format, isa), portable,
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("format", ["q4_1", "q8_0"])
def test_dequantize_gives_the_packed_weight_back_exactly(format):
    packed, weight = quantized(48, 96, format)
    assert torch.equal(torch.ops.hyperserve.dequantize(packed, 96, format), weight)
    channels = torch.tensor([47, 0, 8, 8])  # an embedding lookup: only these, in this order
    assert torch.equal(torch.ops.hyperserve.dequantize(packed, 96, format, channels), weight[channels])
    with pytest.raises(RuntimeError, match="channel 48 out of range"):
        torch.ops.hyperserve.dequantize(packed, 96, format, torch.tensor([48]))


def test_q8_0_packing_is_exact_for_a_q8_0_weight_and_close_for_any():
    """pack_q80 re-quantizes a GGUF Q8_0 tensor (dequantized on load) to its own codes."""
    packed, weight = quantized(16, 64, "q8_0")
    assert torch.equal(pack_q80(weight), packed)
    dense = torch.randn(16, 64)
    error = torch.ops.hyperserve.dequantize(pack_q80(dense), 64, "q8_0") - dense
    assert error.norm() / dense.norm() < 0.01


@pytest.mark.parametrize("format", ["q4_1", "q8_0"])
@pytest.mark.parametrize("isa", ISAS)
def test_quantized_linear_rows_do_not_depend_on_their_batch(format, isa):
    """Each row is quantized and summed on its own, so batching never changes a sequence's numbers."""
    runnable(isa)
    packed, _ = quantized(96, 128, format)
    x = torch.randn(11, 128)
    together = torch.ops.hyperserve.quantized_linear(x, packed, format, isa)
    alone = torch.cat([torch.ops.hyperserve.quantized_linear(x[i : i + 1], packed, format, isa) for i in range(11)])
    assert torch.equal(together, alone)


def test_quantized_linear_keeps_the_input_dtype_and_rejects_a_weight_of_another_shape_or_format():
    packed, weight = quantized(32, 64)
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    assert torch.ops.hyperserve.quantized_linear(x, packed, "q4_1").dtype == torch.bfloat16
    with pytest.raises(RuntimeError, match="expected contiguous uint8"):
        torch.ops.hyperserve.quantized_linear(torch.randn(2, 96), packed, "q4_1")
    with pytest.raises(RuntimeError, match="expected contiguous uint8"):
        torch.ops.hyperserve.quantized_linear(x, packed, "q8_0")  # Q8_0 rows are longer
    with pytest.raises(RuntimeError, match="multiple of 32"):
        torch.ops.hyperserve.quantized_linear(torch.randn(2, 48), packed, "q4_1")
    with pytest.raises(RuntimeError, match="format"):
        torch.ops.hyperserve.quantized_linear(x, packed, "q5_k")


def test_the_instruction_set_follows_the_cpu_flags():
    flags = cpu_flags()
    expected = "avx2" if {"avx2", "fma", "f16c"} <= flags else "portable"
    if expected == "avx2" and {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"} <= flags:
        expected = "avx512_vnni"
    assert kernels.isa() == expected
    if expected != "avx512_vnni":
        with pytest.raises(RuntimeError, match="cannot run avx512_vnni"):
            torch.ops.hyperserve.quantized_linear(torch.randn(1, 64), quantized(8, 64)[0], "q4_1", "avx512_vnni")


def eight_bit_product(x: torch.Tensor, packed: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x W^T as the interleaved kernel computes it: x rounded to 8 bits per group of 32 (scale
    amax / 127) against each weight's q * d, plus each group's minimum m times x's exact sum."""
    groups = x.reshape(x.shape[0], -1, 32)
    scale = groups.abs().amax(-1, keepdim=True) / 127
    rounded = (torch.round(groups / scale) * scale).reshape(x.shape)
    num_groups = x.shape[1] // 32
    mins = packed[:, 18 * num_groups:].contiguous().view(torch.float16).float().repeat_interleave(32, dim=1)
    return rounded @ (weight - mins).T + x @ mins.T


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("in_features", [64, 576])
# one pass of 1-3 rows (a group's float steps at once) or 4-8 (groups' integer sums first, in chunks
# of 8 of 18 groups), and passes split evenly (17 rows: 6, 6, 5)
@pytest.mark.parametrize("rows", [1, 3, 4, 8, 9, 17])
def test_interleaved_q4_1_equals_the_dequantized_weight_against_8_bit_activations(rows, in_features, isa):
    runnable(isa)
    packed, weight = quantized(80, in_features)
    x = torch.randn(rows, in_features)
    expected = eight_bit_product(x, packed, weight)
    got = torch.ops.hyperserve.quantized_linear(x, interleave_q41(packed), "q4_1", isa)
    assert got.shape == (rows, 80)
    assert (got - expected).norm() / expected.norm() < 1e-5
    assert (got - x @ weight.T).norm() / expected.norm() > 1e-4  # the activations really are 8-bit
    wrong = interleave_q41(quantized(80, in_features, seed=1)[0])
    assert (torch.ops.hyperserve.quantized_linear(x, wrong, "q4_1", isa) - expected).norm() / expected.norm() > 0.3


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("layout", ["rows", "interleaved"])
def test_a_projection_as_wide_as_an_8b_models_down_proj_runs_natively(isa, layout):
    """14,336 inputs (Llama-3-8B's and Mistral-7B's down_proj; Qwen3-8B's is 12,288): more groups
    than a row's scratch held before (256), which failed every such model in int4."""
    runnable(isa)
    packed, weight = quantized(16, 14336)
    x = torch.randn(9, 14336)
    if layout == "rows":
        got, expected, tolerance = torch.ops.hyperserve.quantized_linear(x, packed, "q4_1", isa), x @ weight.T, 1e-4
    else:
        got = torch.ops.hyperserve.quantized_linear(x, interleave_q41(packed), "q4_1", isa)
        expected, tolerance = eight_bit_product(x, packed, weight), 1e-5
    assert got.shape == (9, 16)
    assert (got - expected).norm() / expected.norm() < tolerance


def test_interleaving_keeps_every_weight_in_its_place():
    packed, weight = quantized(48, 96)
    interleaved = interleave_q41(packed)
    assert interleaved.shape == (6, 3, 160) and interleaved.numel() == packed.numel()
    assert torch.equal(torch.ops.hyperserve.dequantize(interleaved, 96, "q4_1"), weight)


def test_interleaved_rows_do_not_depend_on_their_batch_and_avx2_gives_the_portable_numbers():
    runnable("avx2")
    packed, _ = quantized(96, 576)
    interleaved = interleave_q41(packed)
    x = torch.randn(11, 576)
    together = torch.ops.hyperserve.quantized_linear(x, interleaved, "q4_1", "avx2")
    alone = torch.cat([torch.ops.hyperserve.quantized_linear(x[i : i + 1], interleaved, "q4_1", "avx2")
                       for i in range(11)])
    assert torch.equal(together, alone)
    # the same integer sums; the group sums of x are added in another order
    portable = torch.ops.hyperserve.quantized_linear(x, interleaved, "q4_1", "portable")
    torch.testing.assert_close(together, portable, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("one_stream_rows", [0, 8])  # blocks in pairs; one at a time up to 8 rows
@pytest.mark.parametrize("rows", [1, 3, 8, 17])  # passes of 8 rows or fewer, split evenly
@pytest.mark.parametrize("out_features", [96, 88])  # blocks of 8 in pairs, and one left alone
def test_avx512_multiplies_interleaved_blocks_to_the_avx2_kernels_bits(out_features, rows, one_stream_rows):
    """vpdpbusd's 32-bit sums are the AVX2 kernel's exact integer sums and the float steps after
    them are the same, lane for lane, whether the blocks are read in pairs or one at a time: a
    draft verified on either CPU class rounds as on the other."""
    runnable("avx512_vnni")
    interleaved = interleave_q41(quantized(out_features, 576)[0])
    x = torch.randn(rows, 576)
    avx2 = torch.ops.hyperserve.quantized_linear(x, interleaved, "q4_1", "avx2")
    torch.ops.hyperserve.set_one_stream_rows(one_stream_rows)
    try:
        assert torch.equal(torch.ops.hyperserve.quantized_linear(x, interleaved, "q4_1", "avx512_vnni"), avx2)
    finally:
        torch.ops.hyperserve.set_one_stream_rows(0)


@pytest.mark.parametrize("rows", [1, 4, 5, 9, 17])  # passes of up to 3 rows (AVX2) or 8, split evenly
def test_interleaved_q8_0_gives_the_row_layouts_product_on_every_instruction_set(rows):
    """The LM head in blocks of 16 channels: 16-bit activations as in the row layout, so within float
    rounding of it, and the same integer sums and float steps on every instruction set, bit for bit.
    40 channels: the last block is padded with zero channels, whose outputs are zero."""
    packed, weight = quantized(40, 576, "q8_0")
    interleaved = interleave_q80(packed)
    assert interleaved.shape == (3, 18, 544)
    x = torch.randn(rows, 576)
    expected = x @ weight.T
    portable = torch.ops.hyperserve.quantized_linear(x, interleaved, "q8_0", "portable")
    assert portable.shape == (rows, 48) and torch.equal(portable[:, 40:], torch.zeros(rows, 8))
    assert (portable[:, :40] - expected).norm() / expected.norm() < 1e-4
    for isa in isas_here()[1:]:
        assert torch.equal(torch.ops.hyperserve.quantized_linear(x, interleaved, "q8_0", isa), portable), isa
    wrong = interleave_q80(quantized(40, 576, "q8_0", seed=1)[0])
    assert (torch.ops.hyperserve.quantized_linear(x, wrong, "q8_0")[:, :40] - expected).norm() / expected.norm() > 0.3


def test_an_interleaved_embedding_looks_up_the_rows_of_the_row_layout():
    packed, weight = quantized(40, 96, "q8_0")
    assert torch.equal(torch.ops.hyperserve.dequantize(interleave_q80(packed), 96, "q8_0")[:40], weight)
    ids = torch.tensor([[39, 0, 17], [16, 15, 17]])
    rows, blocks = (Q8Embedding(q, 40, 96, torch.float32) for q in (packed, interleave_q80(packed)))
    assert torch.equal(blocks(ids), rows(ids)) and torch.equal(rows(ids), weight[ids])


def test_an_interleaved_weight_must_fit_its_input():
    packed, _ = quantized(32, 64)
    with pytest.raises(RuntimeError, match="Q4_1 interleaved"):
        torch.ops.hyperserve.quantized_linear(torch.randn(2, 96), interleave_q41(packed), "q4_1")
    with pytest.raises(RuntimeError, match="Q8_0 interleaved"):
        torch.ops.hyperserve.quantized_linear(torch.randn(2, 64), interleave_q41(packed), "q8_0")


FP4_VALUES = torch.tensor([*FP4_MAGNITUDES, *(-v for v in FP4_MAGNITUDES)])  # by code: sign is the top bit


def mxfp4_weight(out_features: int, in_features: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A random weight as an MXFP4 checkpoint holds it: (interleave_mxfp4's blocks, its float32
    values), with scales from 2^-10 to 2^-4 and every code, -0 included."""
    generator = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (out_features, in_features // 32, 32), generator=generator, dtype=torch.uint8)
    exponents = torch.randint(117, 124, (out_features, in_features // 32), generator=generator, dtype=torch.uint8)
    weight = FP4_VALUES[codes.long()] * torch.exp2(exponents.float() - 127)[..., None]
    return interleave_mxfp4(mxfp4_rows(codes, exponents)), weight.reshape(out_features, in_features)


def eight_bit_rounding(x: torch.Tensor) -> torch.Tensor:
    """x rounded as the interleaved kernels take it: to 8 bits per group of 32, scale amax / 127."""
    groups = x.reshape(x.shape[0], -1, 32)
    scale = groups.abs().amax(-1, keepdim=True) / 127
    return (torch.round(groups / scale) * scale).reshape(x.shape)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("in_features", [64, 576])
@pytest.mark.parametrize("rows", [1, 3, 4, 9])  # a group's float steps at once, integer sums first, two passes
def test_mxfp4_equals_the_dequantized_weight_against_8_bit_activations(rows, in_features, isa):
    """The codes looked up as doubled integers, offset to be unsigned and corrected by the input's
    code sums: the exact product of the MXFP4 weight with the 8-bit input."""
    runnable(isa)
    packed, weight = mxfp4_weight(80, in_features)
    x = torch.randn(rows, in_features)
    expected = eight_bit_rounding(x) @ weight.T
    got = torch.ops.hyperserve.quantized_linear(x, packed, "mxfp4", isa)
    assert got.shape == (rows, 80)
    assert (got - expected).norm() / expected.norm() < 1e-5
    wrong = mxfp4_weight(80, in_features, seed=1)[0]
    assert (torch.ops.hyperserve.quantized_linear(x, wrong, "mxfp4", isa) - expected).norm() / expected.norm() > 0.3


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("rows", [1, 9])
def test_mxfp4_groups_at_the_largest_sums_stay_exact(rows, isa):
    """Codes of +-6 and inputs at their group's maximum, of the same signs (the largest products,
    in every channel and row, positive or negative): a group's offset codes then sum past 16 bits
    (32 * 24 * 127), which the AVX2 kernel's 16-bit sums wrap; less the offset times the inputs
    each pair of lanes met they are within range again, and the products exact. The signs differ
    between those two pairs of lanes, so each must take its own inputs' offset."""
    runnable(isa)
    signs = torch.tensor([1.0, 1.0, -1.0, -1.0]).repeat(16)  # positions 4i, 4i+1 against 4i+2, 4i+3
    codes = torch.where(signs > 0, 7, 15).to(torch.uint8).reshape(1, 2, 32).repeat(16, 1, 1)  # +6, -6
    codes[1::2] ^= 8  # the other sign
    packed = interleave_mxfp4(mxfp4_rows(codes, torch.full((16, 2), 120, dtype=torch.uint8)))
    weight = FP4_VALUES[codes.long()].reshape(16, 64) * 2.0 ** -7
    x = signs.repeat(rows, 1)
    x[1::2] *= -1
    got = torch.ops.hyperserve.quantized_linear(x, packed, "mxfp4", isa)
    assert torch.equal(got, x @ weight.T)
    assert got.abs().amin() == 6 * 2.0 ** -7 * 64


@pytest.mark.parametrize("out_features", [96, 88])  # blocks of 8 in pairs, and one left alone
def test_mxfp4_gives_the_portable_kernels_bits_on_every_instruction_set_and_batch(out_features):
    packed, _ = mxfp4_weight(out_features, 352)
    x = torch.randn(17, 352)
    portable = torch.ops.hyperserve.quantized_linear(x, packed, "mxfp4", "portable")
    for isa in isas_here()[1:]:
        for one_stream_rows in ([0, 8] if isa == "avx512_vnni" else [0]):
            torch.ops.hyperserve.set_one_stream_rows(one_stream_rows)
            try:
                together = torch.ops.hyperserve.quantized_linear(x, packed, "mxfp4", isa)
                alone = torch.ops.hyperserve.quantized_linear(x[:1], packed, "mxfp4", isa)
            finally:
                torch.ops.hyperserve.set_one_stream_rows(0)
            assert torch.equal(together, portable) and torch.equal(alone, portable[:1]), (isa, one_stream_rows)


def test_mxfp4_packing_keeps_mxfp4_weights_exactly_and_rounds_others_to_the_nearest_value():
    packed, weight = mxfp4_weight(48, 96)
    assert packed.shape == (6, 3, 136)
    assert torch.equal(torch.ops.hyperserve.dequantize(packed, 96, "mxfp4"), weight)
    # the same values (a group's bytes may differ: its scale by the OCP rule, -0 as 0)
    assert torch.equal(torch.ops.hyperserve.dequantize(interleave_mxfp4(pack_mxfp4(weight)), 96, "mxfp4"), weight)
    any_weight = torch.randn(48, 96)
    back = torch.ops.hyperserve.dequantize(interleave_mxfp4(pack_mxfp4(any_weight)), 96, "mxfp4")
    groups, back = any_weight.reshape(48, 3, 32), back.reshape(48, 3, 32)
    scale = torch.exp2(torch.floor(torch.log2(groups.abs().amax(-1, keepdim=True))) - 2)  # the OCP rule
    nearest = (groups.unsqueeze(-1) / scale.unsqueeze(-1) - FP4_VALUES).abs().argmin(-1)
    assert torch.equal(back, FP4_VALUES[nearest] * scale)


def test_an_mxfp4_weight_must_be_interleaved_and_fit_its_input():
    packed, _ = mxfp4_weight(16, 64)
    with pytest.raises(RuntimeError, match="MXFP4 interleaved"):
        torch.ops.hyperserve.quantized_linear(torch.randn(2, 96), packed, "mxfp4")
    with pytest.raises(RuntimeError, match="MXFP4 is interleaved only"):
        torch.ops.hyperserve.quantized_linear(torch.randn(2, 64), pack_mxfp4(torch.randn(16, 64)), "mxfp4")
