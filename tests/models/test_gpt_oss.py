"""GPT-OSS beyond the logits of a transformers checkpoint (those are checked with the other
architectures, tests/models/test_llama.py): OpenAI's MXFP4 checkpoints, read as transformers reads
them, and the model served end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hyperserve import LLM
from hyperserve.models.gpt_oss import FP4_VALUES, dequantize_mxfp4
from tests.conftest import tiny_config
from tests.models.test_llama import _check_against_transformers


def to_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float [..., out, in] -> (blocks uint8 [..., out, in / 32, 16], scales uint8 [..., out, in / 32]):
    each block of 32 scaled by the power of two that brings its largest into E2M1's 6, its values
    rounded to the nearest code."""
    groups = weight.float().unflatten(-1, (-1, 32))
    exponent = torch.ceil(torch.log2(groups.abs().amax(-1).clamp(min=2.0**-100) / 6.0))
    scaled = groups / torch.exp2(exponent).unsqueeze(-1)
    codes = (scaled.unsqueeze(-1) - torch.tensor(FP4_VALUES)).abs().argmin(-1).to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4), (exponent + 127).to(torch.uint8)


def test_mxfp4_blocks_dequantize_as_transformers_reads_them():
    """Our reading of MXFP4 blocks and scales equals transformers' own (which it then transposes to
    its [E, in, out] layout): the nibble order, the codes and the E8M0 scales."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    generator = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 8, 2, 16), dtype=torch.uint8, generator=generator)
    scales = torch.randint(117, 137, (3, 8, 2), dtype=torch.uint8, generator=generator)
    expected = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).transpose(1, 2)
    assert torch.equal(dequantize_mxfp4(blocks, scales), expected)


@pytest.fixture
def mxfp4_checkpoint(save_hf_model):
    """A random GPT-OSS saved as OpenAI's checkpoints are: each layer's experts as MXFP4 blocks and
    scales (their biases as they are), the config naming the quantization. The transformers model
    returned holds the weights those blocks stand for, as transformers reads them."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    hf_model, path = save_hf_model(tiny_config("gpt_oss", intermediate_size=64))  # widths in blocks of 32
    tensors = {}
    with torch.no_grad():
        for name, tensor in hf_model.state_dict().items():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                blocks, scales = to_mxfp4(tensor.transpose(1, 2))  # transformers' [E, in, out]
                tensor.copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
                tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
            else:
                tensors[name] = tensor.contiguous()
    from safetensors.torch import save_file

    save_file(tensors, str(Path(path) / "model.safetensors"))
    config = json.loads((Path(path) / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (Path(path) / "config.json").write_text(json.dumps(config))
    return hf_model, path


def test_an_mxfp4_checkpoint_matches_transformers(mxfp4_checkpoint):
    """The experts' blocks (gate and up interleaved row by row) load dequantized: the logits and
    greedy tokens of transformers on the same weights, in one prefill and in chunks of 7."""
    hf_model, path = mxfp4_checkpoint
    for chunk in (512, 7):
        llm = LLM(model=path, num_kv_blocks=64, block_size=4, max_model_len=128, dtype="float32",
                  max_num_batched_tokens=chunk)
        _check_against_transformers(llm, hf_model, abs_tol=2e-4)
