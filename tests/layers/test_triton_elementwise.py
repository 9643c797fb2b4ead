"""The fused add + RMSNorm and SiLU-and-multiply kernels against PyTorch's ops, in bfloat16 and
float32, at widths no block divides. On the CPU they run under TRITON_INTERPRET=1 (set in
conftest); on CUDA, natively."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.conftest import DEVICES, needs_triton

pytestmark = needs_triton


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("with_residual", [True, False])
def test_add_rms_norm_matches_pytorch(device, dtype, with_residual):
    from hyperserve.layers.triton_elementwise import add_rms_norm

    generator = torch.Generator().manual_seed(0)
    x, residual = (torch.randn(2, 7, 300, generator=generator)[i].to(device, dtype) for i in range(2))
    weight = torch.rand(300, generator=generator).to(device, dtype) + 0.5
    summed = x + residual if with_residual else x
    expected = F.rms_norm(summed.float(), (300,), weight.float(), 1e-6)
    normed, got_sum = add_rms_norm(x, residual if with_residual else None, weight, 1e-6)
    if device == "cuda":
        assert torch.equal(got_sum, summed)  # the residual stream, rounded as PyTorch's add rounds it
    else:  # Triton's interpreter rounds to bfloat16 towards zero: one step at most
        assert torch.allclose(got_sum.float(), summed.float(), rtol=2**-7, atol=0)
    tolerance = 1e-2 if dtype == torch.bfloat16 else 1e-5
    assert normed.dtype == dtype and (normed.float() - expected).norm() / expected.norm() < tolerance
    wrong = F.rms_norm(summed.float(), (300,), weight.flip(0).float(), 1e-6)
    assert (normed.float() - wrong).norm() / wrong.norm() > 0.1


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_silu_and_mul_matches_pytorch(device, dtype):
    from hyperserve.layers.triton_elementwise import silu_and_mul

    gate_up = torch.randn(5, 2 * 1500, generator=torch.Generator().manual_seed(1)).to(device, dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    expected = (F.silu(gate) * up).float()
    got = silu_and_mul(gate_up)
    tolerance = 1e-2 if dtype == torch.bfloat16 else 1e-5
    assert got.shape == (5, 1500) and (got.float() - expected).norm() / expected.norm() < tolerance
    swapped = (F.silu(up) * gate).float()
    assert (got.float() - swapped).norm() / swapped.norm() > 0.1
