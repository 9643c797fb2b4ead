"""Loading the real SmolLM2 GGUF: weights as transformers reads them, greedy tokens identical."""

from __future__ import annotations

import pytest
import torch

from hyperserve import LLM, SamplingParams
from hyperserve.layers.attention import TorchPagedAttention
from hyperserve.models.loader import build_model, load_config
from hyperserve.models.registry import resolve_model
from tests.conftest import FLOAT32

pytestmark = pytest.mark.slow


def test_gguf_weights_equal_transformers_dequantization(smollm2_source, hf_smollm2):
    config = load_config(smollm2_source)
    ours = build_model(config, smollm2_source, TorchPagedAttention(), 64, torch.float32, "cpu")
    layer, reference = ours.model.layers[3], hf_smollm2.model.layers[3]
    q, k, v = layer.self_attn.qkv_proj.weight.split(layer.self_attn.shard_sizes)
    assert torch.equal(q, reference.self_attn.q_proj.weight)  # Q/K rows un-permuted like transformers
    assert torch.equal(k, reference.self_attn.k_proj.weight)
    assert torch.equal(v, reference.self_attn.v_proj.weight)
    assert torch.equal(ours.model.embed_tokens.weight, hf_smollm2.model.embed_tokens.weight)


def test_smollm2_greedy_matches_transformers(hf_smollm2, chat_prompt_ids):
    llm = LLM(num_kv_blocks=512, max_model_len=2048, **FLOAT32)
    params = SamplingParams(temperature=0, max_tokens=64)
    outputs = llm.generate(chat_prompt_ids, params, use_tqdm=False)  # all 8 in one batch
    for prompt, output in zip(chat_prompt_ids, outputs):
        with torch.no_grad():
            reference = hf_smollm2.generate(
                torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=64, do_sample=False,
            )[0, len(prompt):].tolist()
        assert output.outputs[0].token_ids == reference


def test_unknown_model_lists_the_available_ones():
    with pytest.raises(ValueError, match="smollm2-135m"):
        resolve_model("no-such-model")
