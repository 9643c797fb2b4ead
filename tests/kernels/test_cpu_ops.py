"""The native CPU kernels against plain PyTorch arithmetic on the same numbers."""

import pytest
import torch

from hyperserve import kernels
from hyperserve.layers.quantization import cpu_flags, pack_q41

pytestmark = pytest.mark.skipif(not kernels.available(), reason="the native CPU kernels could not be built here")


def q4_1(out_features: int, in_features: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A random Q4_1 weight: (the kernels' packed rows, the same weight in float32)."""
    generator = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (out_features, in_features // 32, 32), generator=generator, dtype=torch.uint8)
    scale = (torch.rand(out_features, in_features // 32, generator=generator) * 0.01 + 1e-3).half().float()
    low = (-torch.rand(out_features, in_features // 32, generator=generator) * 0.05).half().float()
    weight = (codes.float() * scale[..., None] + low[..., None]).reshape(out_features, in_features)
    return pack_q41(codes, scale, low), weight


@pytest.mark.parametrize("portable", [False, True])
@pytest.mark.parametrize("in_features", [64, 352])  # 2 groups; 11 (eight at a time, then three)
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 16])  # row tiles of 4, and what is left over
def test_int4_linear_equals_the_dequantized_weight_within_16_bit_activations(rows, in_features, portable):
    packed, weight = q4_1(80, in_features)
    x = torch.randn(rows, in_features)
    expected = x @ weight.T
    got = torch.ops.hyperserve.int4_linear(x, packed, portable)
    assert got.shape == (rows, 80) and got.dtype == torch.float32
    assert (got - expected).norm() / expected.norm() < 1e-4
    wrong, _ = q4_1(80, in_features, seed=1)
    assert (torch.ops.hyperserve.int4_linear(x, wrong, portable) - expected).norm() / expected.norm() > 0.3


def test_int4_linear_rows_do_not_depend_on_their_batch():
    """Each row is quantized and summed on its own, so batching never changes a sequence's numbers."""
    packed, _ = q4_1(96, 128)
    x = torch.randn(7, 128)
    together = torch.ops.hyperserve.int4_linear(x, packed)
    alone = torch.cat([torch.ops.hyperserve.int4_linear(x[i : i + 1], packed) for i in range(7)])
    assert torch.equal(together, alone)


def test_int4_linear_keeps_the_input_dtype_and_rejects_a_weight_of_another_shape():
    packed, weight = q4_1(32, 64)
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    assert torch.ops.hyperserve.int4_linear(x, packed).dtype == torch.bfloat16
    with pytest.raises(RuntimeError, match="int4"):
        torch.ops.hyperserve.int4_linear(torch.randn(2, 96), packed)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        torch.ops.hyperserve.int4_linear(torch.randn(2, 48), packed)


def test_the_instruction_set_follows_the_cpu_flags():
    expected = "avx2" if {"avx2", "fma", "f16c"} <= cpu_flags() else "portable"
    assert kernels.isa() == expected
