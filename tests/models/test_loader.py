"""Loading the real SmolLM2 GGUF: weights as transformers reads them, greedy tokens identical."""

from __future__ import annotations

import pytest
import torch

from hyperserve import LLM, SamplingParams, kernels
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


@pytest.mark.skipif(not kernels.available(), reason="the native CPU kernels could not be built here")
def test_int4_holds_the_gguf_weights_exactly(smollm2_source, hf_smollm2):
    """Q4_1 projections and the Q8_0 embedding (also the tied head) are re-packed, not re-quantized."""
    config = load_config(smollm2_source)
    ours = build_model(config, smollm2_source, TorchPagedAttention(), 64, torch.bfloat16, "cpu", quantization="int4")
    embedding = ours.model.embed_tokens
    assert embedding.q80 is ours.lm_head.q80  # tied: one copy
    reference = hf_smollm2.model.embed_tokens.weight
    assert torch.equal(torch.ops.hyperserve.dequantize(embedding.q80, config.hidden_size, "q8_0"), reference)
    ids = torch.tensor([0, 504, 49151])
    assert torch.equal(embedding(ids), reference[ids].bfloat16())
    down = ours.model.layers[3].mlp.down_proj
    assert torch.equal(torch.ops.hyperserve.dequantize(down.q41, down.in_features, "q4_1"),
                       hf_smollm2.model.layers[3].mlp.down_proj.weight)


def test_gguf_metadata_is_parsed_once_into_files_that_read_back_the_same(smollm2_source, tmp_path, monkeypatch):
    import gguf
    from transformers import AutoConfig, AutoTokenizer

    from hyperserve.models import loader

    monkeypatch.setenv("HYPERSERVE_GGUF_CACHE", str(tmp_path))
    loader.gguf_metadata_directory.cache_clear()
    loader.gguf_index.cache_clear()
    try:
        directory = loader.gguf_metadata_directory(smollm2_source.path)
        assert directory.parent == tmp_path
        assert {p.name for p in directory.iterdir()} >= {"config.json", "tokenizer.json", "gguf_index.json"}
        reader = gguf.GGUFReader(smollm2_source.path)  # the references below share one parse of the file
        monkeypatch.setattr(gguf, "GGUFReader", lambda *args, **kwargs: reader)
        assert loader.gguf_index(smollm2_source.path) == loader._read_gguf_index(smollm2_source.path)
        reference = AutoConfig.from_pretrained(smollm2_source.directory, gguf_file=smollm2_source.gguf_file)
        ours = loader.load_config(smollm2_source)
        assert {k: v for k, v in ours.to_dict().items() if k != "_name_or_path"} == \
            {k: v for k, v in reference.to_dict().items() if k != "_name_or_path"}
        tokenizer = loader.load_tokenizer(smollm2_source)
        original = AutoTokenizer.from_pretrained(smollm2_source.directory, gguf_file=smollm2_source.gguf_file)
        chat = [{"role": "user", "content": "Ünïcode, code ```x = 1``` and <|im_end|>?"}]
        assert tokenizer.apply_chat_template(chat) == original.apply_chat_template(chat)
        assert tokenizer.eos_token_id == original.eos_token_id
    finally:
        loader.gguf_metadata_directory.cache_clear()
        loader.gguf_index.cache_clear()
