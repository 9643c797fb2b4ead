"""The Triton GEMV against float64: float8 weights with per-channel scales and bfloat16 weights,
1 to 16 rows, shapes that no tile divides, with and without bias. On the CPU it runs under
TRITON_INTERPRET=1 (set in conftest); on CUDA, natively."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import DEVICES, needs_triton

pytestmark = needs_triton


def fp8_weight(n: int, k: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    weight = torch.randn(n, k, generator=generator)
    scale = weight.abs().amax(dim=1) / 448.0
    return (weight / scale[:, None]).to(torch.float8_e4m3fn), scale


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tiles", [None, (8, 64, 4)], ids=["default-tiles", "small-tiles"])
@pytest.mark.parametrize(("rows", "n", "k", "weights", "with_bias"), [
    (1, 100, 300, "fp8", True), (7, 64, 512, "fp8", False), (16, 33, 257, "fp8", True),
    (1, 96, 320, "bf16", False), (16, 70, 130, "bf16", True)])
def test_gemv_matches_float64(device, tiles, rows, n, k, weights, with_bias):
    from hyperserve.layers.triton_gemv import GemvTiles, gemv

    tiles = tiles and GemvTiles(*tiles)  # (block_n, block_k, num_warps): any tiling, the same function

    generator = torch.Generator().manual_seed(rows * n + k)
    x = torch.randn(rows, k, generator=generator).to(torch.bfloat16)
    if weights == "fp8":
        weight, scale = fp8_weight(n, k, generator)
        dense = weight.double() * scale.double()[:, None]
    else:
        weight, scale = torch.randn(n, k, generator=generator).to(torch.bfloat16), None
        dense = weight.double()
    bias = torch.randn(n, generator=generator).to(torch.bfloat16) if with_bias else None
    expected = x.double() @ dense.T + (bias.double() if with_bias else 0)
    out = gemv(x.to(device), weight.to(device), None if scale is None else scale.to(device),
               None if bias is None else bias.to(device), tiles=tiles)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, n)
    error = (out.cpu().double() - expected).norm() / expected.norm()
    assert error < 8e-3  # the output's bfloat16 rounding
    wrong = gemv(x.to(device), weight.flip(0).to(device), None if scale is None else scale.to(device))
    assert (wrong.cpu().double() - expected).norm() / expected.norm() > 0.5


def test_more_rows_than_a_program_holds_are_refused():
    from hyperserve.layers.triton_gemv import MAX_ROWS, gemv

    with pytest.raises(ValueError, match="at most"):
        gemv(torch.zeros(MAX_ROWS + 1, 8), torch.zeros(4, 8))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("folded", ["norm", "gated", "residual", "gated+residual", "norm+bias+fp8"])
def test_folded_norm_swiglu_and_residual_match_float64(device, rows, folded):
    """What a decode layer folds into its GEMVs (layers/gemv_decode.py): the RMSNorm of the input,
    SwiGLU of a fused gate/up output, the residual added after. Inputs far from unit RMS and norm
    weights far from 1, so that a missing or misplaced scale shows."""
    from hyperserve.layers.triton_gemv import GemvTiles, gemv

    n, k, eps = 70, 300, 1e-5
    generator = torch.Generator().manual_seed(rows)
    x = (3 * torch.randn(rows, 2 * k if "gated" in folded else k, generator=generator)).to(torch.bfloat16)
    if "fp8" in folded:
        weight, scale = fp8_weight(n, k, generator)
        dense = weight.double() * scale.double()[:, None]
    else:
        weight, scale = torch.randn(n, k, generator=generator).to(torch.bfloat16), None
        dense = weight.double()
    bias = torch.randn(n, generator=generator).to(torch.bfloat16) if "bias" in folded else None
    norm_weight = (0.5 + torch.rand(k, generator=generator)).to(torch.bfloat16)
    residual = (100 * torch.randn(rows, n, generator=generator)).to(torch.bfloat16)  # as large as the product

    inputs = x.double()
    if "gated" in folded:
        gate, up = inputs.chunk(2, dim=-1)  # rounded as silu_and_mul's output is: its heavy tail's
        inputs = (torch.nn.functional.silu(gate).bfloat16().double() * up).bfloat16().double()  # 0.8% of it
    if "norm" in folded:
        inputs = inputs * torch.rsqrt(inputs.pow(2).mean(-1, keepdim=True) + eps) * norm_weight.double()
    expected = inputs @ dense.T + (bias.double() if bias is not None else 0)
    expected += residual.double() if "residual" in folded else 0

    def run(tiles=None):
        return gemv(x.to(device), weight.to(device), None if scale is None else scale.to(device),
                    None if bias is None else bias.to(device), tiles,
                    norm=(norm_weight.to(device), eps) if "norm" in folded else None, gated="gated" in folded,
                    residual=residual.to(device) if "residual" in folded else None).cpu().double()

    for out in (run(), run(GemvTiles(8, 64, 4))):  # one K tile and several: the squares summed across tiles
        assert out.shape == (rows, n)
        # bfloat16 roundings of the input and output; Triton's interpreter truncates where CUDA rounds
        assert (out - expected).norm() / expected.norm() < 1.5e-2
