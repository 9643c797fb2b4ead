import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from hyperserve import LLM
from hyperserve.config import ModelConfig
from hyperserve.engine.model_runner import SeqChunk
from hyperserve.layers.quantization import KEEP_FLOAT, Int8Linear, quantize_model
from hyperserve.models.loader import build_model
from tests.conftest import tiny_config

TEXT = Path(__file__).parents[2] / "data" / "quality_text.txt"


def test_int8_linear_matches_float_within_quantization_error():
    torch.manual_seed(0)
    weight, bias = torch.randn(96, 64) * 0.1, torch.randn(96)
    x = torch.randn(5, 64)
    expected = F.linear(x, weight, bias)
    got = Int8Linear(weight, bias)(x)
    assert (got - expected).norm() / expected.norm() < 0.02
    assert (Int8Linear(weight.flip(0), bias)(x) - expected).norm() / expected.norm() > 0.5  # a wrong weight shows


def test_quantize_model_replaces_projections_and_shrinks_weights():
    from hyperserve.layers.attention import TorchPagedAttention

    model = build_model(tiny_config("llama"), None, TorchPagedAttention(), 512, torch.float32, "cpu")
    before, after = quantize_model(model, "int8")
    kinds = {name.rsplit(".", 1)[-1]: type(module).__name__ for name, module in model.named_modules()
             if name.endswith(("proj", "lm_head"))}
    assert kinds == {"qkv_proj": "Int8Linear", "o_proj": "Int8Linear", "gate_up_proj": "Int8Linear",
                     "down_proj": "Linear", "lm_head": "Linear"}
    assert set(KEEP_FLOAT) == {"down_proj", "lm_head"}
    assert after < before


@pytest.mark.parametrize("bad", [dict(quantization="int3"), dict(quantization="int8", device="cuda")])
def test_invalid_quantization_is_rejected(bad):
    with pytest.raises(ValueError, match="quantization"):
        ModelConfig(**bad)


def _perplexity(llm: LLM, token_ids: list[int]) -> float:
    blocks = list(range(-(-len(token_ids) // llm.engine.config.cache.block_size)))
    with torch.inference_mode():
        logits = llm.engine.runner.forward([SeqChunk(token_ids, 0, blocks, num_logits=len(token_ids))])
    logprobs = torch.log_softmax(logits[:-1].float(), dim=-1)
    return math.exp(-logprobs[torch.arange(len(token_ids) - 1), torch.tensor(token_ids[1:])].mean().item())


@pytest.mark.slow
def test_int8_smollm2_perplexity_is_within_3_percent_of_float32():
    reference = LLM(kv_cache_memory_gb=0.25, max_model_len=1024)
    token_ids = reference.tokenizer(TEXT.read_text()).input_ids[:512]
    float_ppl = _perplexity(reference, token_ids)
    int8_ppl = _perplexity(LLM(kv_cache_memory_gb=0.25, max_model_len=1024, quantization="int8"), token_ids)
    assert float_ppl < int8_ppl < float_ppl * 1.03
