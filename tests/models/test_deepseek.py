"""DeepSeek's latent attention beyond the logits (those are checked against transformers with the
other architectures, tests/models/test_llama.py): what its cache holds, prefix hits on it, the
checkpoint layers it skips, and what it refuses."""

from __future__ import annotations

import pytest

from hyperserve import LLM, SamplingParams
from hyperserve.models import loader
from tests.conftest import random_prompts, tiny_config


@pytest.fixture
def deepseek(save_hf_model):
    _, path = save_hf_model(tiny_config("deepseek_v3"))
    return path


def test_the_cache_holds_one_latent_vector_a_token_as_key_and_value(deepseek):
    """kv_lora_rank + qk_rope_head_dim values a token and layer (32 + 8), once: K and V are one
    tensor, and the memory the pool is sized by counts it once."""
    llm = LLM(model=deepseek, num_kv_blocks=16, block_size=4, max_model_len=64, dtype="float32")
    caches = llm.engine.runner.kv_caches
    assert all(cache.key is cache.value and cache.key.shape[1:] == (1, 40) for cache in caches)
    config = llm.engine.hf_config
    assert loader.kv_bytes_per_token(config, llm.engine.runner.dtype) == config.num_hidden_layers * 40 * 4


def test_a_prefix_hit_answers_as_computed_afresh(deepseek):
    """The cached latents of a shared prefix serve a later prompt: its tokens and log-probabilities
    equal an engine's without prefix caching."""
    engine = dict(model=deepseek, num_kv_blocks=64, block_size=4, max_model_len=128, dtype="float32",
                  max_num_batched_tokens=16)
    prefix = random_prompts((30,))[0]
    prompts = [prefix + [1, 2, 3], prefix + [9, 8, 7, 6]]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    cached_llm, fresh = LLM(**engine), LLM(**engine, enable_prefix_caching=False)
    cached = [cached_llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
    assert cached[1].metrics.num_cached_tokens == 28
    for out, prompt in zip(cached, prompts):
        ref = fresh.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        assert out.outputs[0].token_ids == ref.token_ids
        assert [e[t].logprob for t, e in zip(ref.token_ids, ref.logprobs)] == pytest.approx(
            [e[t].logprob for t, e in zip(out.outputs[0].token_ids, out.outputs[0].logprobs)], abs=1e-5)


def test_what_latent_attention_does_not_run_yet_is_refused_with_the_reason(deepseek):
    with pytest.raises(ValueError, match="does not run DeepSeek's latent attention"):
        LLM(model=deepseek, num_kv_blocks=16, attention_backend="triton")
    from hyperserve.distributed.group import TensorParallel
    from hyperserve.layers.attention import TorchPagedAttention
    from hyperserve.models.deepseek import LatentAttention

    config = tiny_config("deepseek_v3")
    with pytest.raises(ValueError, match="tensor parallelism of DeepSeek's latent attention"):
        LatentAttention(config, None, TorchPagedAttention(), TensorParallel(0, 2))


def test_v3s_multi_token_prediction_layer_is_skipped_as_it_loads(deepseek):
    """V3's checkpoints hold one layer past num_hidden_layers (its multi-token prediction module),
    which serving does not run: its tensors are skipped, not refused."""
    from pathlib import Path

    import torch
    from safetensors.torch import save_file

    mtp = {"model.layers.2.self_attn.q_a_proj.weight": torch.zeros(24, 64),
           "model.layers.2.eh_proj.weight": torch.zeros(64, 128)}
    save_file(mtp, str(Path(deepseek) / "mtp.safetensors"))
    prompt = random_prompts((12,))[0]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm = LLM(model=deepseek, num_kv_blocks=16, block_size=4, max_model_len=64, dtype="float32")
    assert len(llm.engine.runner.model.model.layers) == 2
    assert len(llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids) == 4


def test_an_adapter_of_its_attention_is_refused_with_the_reason(save_hf_model, tmp_path):
    """LoRA of latent attention does not run yet: an adapter of V2-Lite's q_proj is refused, saying so,
    and the engine serves on."""
    from hyperserve import LoRARequest
    from tests.engine.test_lora import ENGINE, make_adapter

    _, base = save_hf_model(tiny_config("deepseek_v2"))
    make_adapter(str(base), tmp_path / "adapter", seed=1, targets=["q_proj"])
    llm = LLM(model=str(base), **ENGINE)
    with pytest.raises(ValueError, match="latent attention"):
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False,
                     lora_request=LoRARequest("attention", 1, str(tmp_path / "adapter")))
    served = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)[0]
    assert len(served.outputs[0].token_ids) == 2
    assert llm.engine.kv_cache.num_free_blocks == llm.engine.kv_cache.pool.num_blocks
