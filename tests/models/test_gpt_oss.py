"""GPT-OSS beyond the logits of a transformers checkpoint (those are checked with the other
architectures, tests/models/test_llama.py): OpenAI's MXFP4 checkpoints, read as transformers reads
them, and the model served end to end."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from hyperserve import LLM, kernels
from hyperserve.config import ModelConfig
from hyperserve.layers.lora import unwrapped
from hyperserve.layers.quantization import Mxfp4Linear
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
    """Without quantization the experts' blocks (gate and up interleaved row by row) load
    dequantized: the logits and greedy tokens of transformers on the same weights, in one prefill
    and in chunks of 7."""
    hf_model, path = mxfp4_checkpoint
    for chunk in (512, 7):
        llm = LLM(model=path, num_kv_blocks=64, block_size=4, max_model_len=128, dtype="float32",
                  quantization=None, max_num_batched_tokens=chunk)
        _check_against_transformers(llm, hf_model, abs_tol=2e-4)


needs_kernels = pytest.mark.skipif(not kernels.available(), reason="mxfp4 runs on the native CPU kernels")


def expert_weights(llm: LLM, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's experts as the engine holds them: gate_up [E, 2 I, H] and down [E, H, I], float32."""
    experts = llm.engine.runner.model.model.layers[layer].mlp.experts
    projections = [[unwrapped(getattr(expert, name)) for expert in experts] for name in ("gate_up_proj", "down_proj")]
    assert all(isinstance(p, Mxfp4Linear) for ps in projections for p in ps)
    return tuple(torch.stack([p.dense().float() for p in ps]) for ps in projections)


def hf_expert_weights(hf_model, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' experts in our layout: [E, in, out] transposed, gate rows before up rows."""
    experts = hf_model.model.layers[layer].mlp.experts
    gate_up = experts.gate_up_proj.detach().transpose(1, 2)
    return torch.cat([gate_up[:, 0::2], gate_up[:, 1::2]], dim=1), experts.down_proj.detach().transpose(1, 2)


def never_dequantized(*args, **kwargs):
    raise AssertionError("MXFP4 blocks were dequantized where mxfp4 keeps them")


@needs_kernels
def test_an_mxfp4_checkpoint_keeps_its_blocks_by_default(mxfp4_checkpoint, monkeypatch):
    """On the CPU an MXFP4 checkpoint runs in mxfp4: its experts' blocks kept as stored (the weights
    are transformers' exactly), attention in Q8_0, the experts' inputs rounded to 8 bits (as
    llama.cpp's). Log-probs within 0.85 of transformers', in one prefill and in chunks: this tiny
    model's large random weights magnify that rounding (0.78 here; the native layers' int8, with
    16-bit inputs, strays 0.09 on it, int4 1.4), where a wrong expert or code strays by nats."""
    from hyperserve.models import gpt_oss

    hf_model, path = mxfp4_checkpoint
    monkeypatch.setattr(gpt_oss, "dequantize_mxfp4", never_dequantized)
    assert ModelConfig(model=path).quantization == "mxfp4"
    assert ModelConfig(model=path).torch_dtype == torch.bfloat16
    for chunk in (512, 7):
        llm = LLM(model=path, num_kv_blocks=64, block_size=4, max_model_len=128, max_num_batched_tokens=chunk)
        for layer in range(hf_model.config.num_hidden_layers):
            for ours, theirs in zip(expert_weights(llm, layer), hf_expert_weights(hf_model, layer)):
                assert torch.equal(ours, theirs)
        _check_against_transformers(llm, hf_model, abs_tol=0.85, same_greedy=False)


def write_gguf(hf_model, path, tokenizer_gguf, dense: str = "F32") -> None:
    """hf_model as llama.cpp's converter writes GPT-OSS: `gpt-oss` names and metadata (YaRN's
    scaling, the window), each layer's experts stacked with gate and up apart ([E, out, in]) in
    MXFP4, their biases, the router's and the sinks in float32, the other matrices in `dense` (F32,
    or Q8_0 as in llama.cpp's MXFP4 files; benchmarks/cpu_vs_llamacpp.py's GPT-OSS). The experts of
    hf_model become what the file's blocks stand for, as gguf's own dequantize reads them."""
    import gguf
    from gguf.quants import dequantize, quantize

    from tests.models.test_loader import close_gguf, gguf_writer

    config = hf_model.config
    writer = gguf_writer(path, "gpt-oss", config, tokenizer_gguf)
    writer.add_expert_count(config.num_local_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    writer.add_expert_feed_forward_length(config.intermediate_size)
    writer.add_sliding_window(config.sliding_window)
    rope = config.rope_parameters
    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(rope["factor"])
    writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    names = {"embed_tokens.weight": "token_embd.weight", "norm.weight": "output_norm.weight",
             "input_layernorm.weight": "attn_norm.weight",
             "post_attention_layernorm.weight": "post_attention_norm.weight",
             "self_attn.sinks": "attn_sinks.weight", "mlp.router.weight": "ffn_gate_inp.weight",
             "mlp.router.bias": "ffn_gate_inp.bias",
             **{f"self_attn.{ours}_proj.{leaf}": f"attn_{theirs}.{leaf}" for leaf in ("weight", "bias")
                for ours, theirs in (("q", "q"), ("k", "k"), ("v", "v"), ("o", "output"))}}
    mxfp4 = gguf.GGMLQuantizationType.MXFP4
    with torch.no_grad():
        for name, tensor in hf_model.state_dict().items():
            layer, _, local = name.removeprefix("model.layers.").partition(".")
            if name == "lm_head.weight":
                target = "output.weight"
            elif not name.startswith("model.layers."):
                target = names[name.removeprefix("model.")]
            else:  # None: an expert tensor
                target = f"blk.{layer}.{names[local]}" if local in names else None
            if target is not None and dense != "F32" and tensor.dim() == 2 and "ffn_gate_inp" not in target:
                kind = gguf.GGMLQuantizationType[dense]
                writer.add_tensor(target, quantize(tensor.numpy(), kind), raw_dtype=kind)
            elif target is not None:
                writer.add_tensor(target, tensor.numpy())
            elif local in ("mlp.experts.gate_up_proj", "mlp.experts.down_proj"):  # [E, in, out]
                weight = tensor.transpose(1, 2).numpy()
                parts = ({"ffn_gate_exps": weight[:, 0::2], "ffn_up_exps": weight[:, 1::2]}
                         if "gate_up" in local else {"ffn_down_exps": weight})
                read = {}
                for base, part in parts.items():  # an expert at a time: the quantizer's temporaries are large
                    blocks = np.stack([quantize(np.ascontiguousarray(expert), mxfp4) for expert in part])
                    writer.add_tensor(f"blk.{layer}.{base}.weight", blocks, raw_dtype=mxfp4)
                    read[base] = torch.from_numpy(dequantize(blocks, mxfp4).reshape(part.shape))
                read = (torch.stack([read["ffn_gate_exps"], read["ffn_up_exps"]], dim=2).flatten(1, 2)
                        if "gate_up" in local else read["ffn_down_exps"])
                tensor.copy_(read.transpose(1, 2))
            elif local in ("mlp.experts.gate_up_proj_bias", "mlp.experts.down_proj_bias"):
                bias = tensor.numpy()
                parts = ({"ffn_gate_exps": bias[:, 0::2], "ffn_up_exps": bias[:, 1::2]}
                         if "gate_up" in local else {"ffn_down_exps": bias})
                for base, part in parts.items():
                    writer.add_tensor(f"blk.{layer}.{base}.bias", np.ascontiguousarray(part))
    close_gguf(writer)


def test_a_gguf_as_llama_cpp_writes_it_matches_transformers(smollm2_source, tmp_path, monkeypatch):
    """A `gpt-oss` GGUF (MXFP4 experts, gate and up apart, llama.cpp's names for the sinks and the
    norm before the MLP, YaRN in the metadata): the config read from the metadata (transformers'
    reading of it fails), the expert width from the tensors, and logits and greedy tokens of
    transformers on the weights the file stands for. By default (mxfp4) the experts are the
    file's blocks as they are: the same weights."""
    from hyperserve.models import gguf_reader
    from tests.models.test_loader import random_model

    monkeypatch.setenv("HYPERSERVE_GGUF_CACHE", str(tmp_path / "cache"))
    # a GGUF stores no SwiGLU limit: llama.cpp's is the model's, 7
    config = tiny_config("gpt_oss", vocab_size=49152, intermediate_size=96, max_position_embeddings=256,
                         swiglu_limit=7.0)
    model = random_model(config)
    write_gguf(model, tmp_path / "model.gguf", smollm2_source.path)
    assert gguf_reader.gguf_weight_bits(tmp_path / "model.gguf") == 4
    llm = LLM(model=str(tmp_path / "model.gguf"), num_kv_blocks=64, block_size=4, max_model_len=128,
              dtype="float32", quantization=None)
    ours = llm.engine.hf_config
    assert (ours.model_type, ours.intermediate_size, ours.layer_types) == (
        "gpt_oss", 96, ["sliding_attention", "full_attention"])
    assert ours.rope_parameters["rope_type"] == "yarn" and ours.rope_parameters["factor"] == 4.0
    _check_against_transformers(llm, model, abs_tol=2e-4)
    if kernels.available():
        monkeypatch.setattr(gguf_reader, "dequantize_mxfp4", never_dequantized)
        llm = LLM(model=str(tmp_path / "model.gguf"), num_kv_blocks=64, block_size=4, max_model_len=128)
        assert llm.engine.config.model.quantization == "mxfp4"
        for layer in range(config.num_hidden_layers):
            for ours, theirs in zip(expert_weights(llm, layer), hf_expert_weights(model, layer)):
                assert torch.equal(ours, theirs)
