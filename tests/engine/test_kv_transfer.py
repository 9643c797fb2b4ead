"""KV blocks computed by one engine and taken by another (disaggregated prefill, engine side)."""

from __future__ import annotations

import pytest

from hyperserve import LLM, SamplingParams
from tests.conftest import DEVICES, EXACT, tiny_config

BLOCK = 16


def engines(path: str, device: str, num_blocks: int = 64) -> tuple[LLM, LLM]:
    options = dict(model=path, device=device, num_kv_blocks=num_blocks, block_size=BLOCK,
                   max_model_len=num_blocks * BLOCK, **EXACT)
    return LLM(**options), LLM(**options)


def answer(llm: LLM, prompt: list[int]):
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    return llm.generate([prompt], params, use_tqdm=False)[0]


@pytest.mark.parametrize("arch", ["llama", "deepseek_v3"])  # DeepSeek: its latent cache, one tensor a layer
@pytest.mark.parametrize("device", DEVICES)
def test_imported_blocks_give_the_answer_the_prefill_engine_gives(save_hf_model, device, arch):
    _, path = save_hf_model(tiny_config(arch))
    prefill, decode = engines(path, device)
    prompt = list(range(3, 3 + 5 * BLOCK + 7))  # 5 full blocks and 7 tokens
    expected = answer(prefill, prompt)
    hashes = prefill.engine.kv_transfer.prefix_hashes(prompt)
    assert len(hashes) == 5
    blocks = [prefill.engine.kv_cache.pool.lookup(h) for h in hashes]  # cached once the request finished
    tensors = prefill.engine.kv_transfer.read_blocks(blocks)
    assert set(tensors) == ({"key"} if arch == "deepseek_v3" else {"key", "value"})
    assert decode.engine.kv_transfer.import_prefix(hashes, tensors) == 5
    assert decode.engine.kv_transfer.import_prefix(hashes, tensors) == 0, "blocks it holds are not taken twice"
    got = answer(decode, prompt)
    assert got.outputs[0].token_ids == expected.outputs[0].token_ids
    assert got.metrics.num_cached_tokens == 5 * BLOCK  # it computed only the last 7 tokens
    assert decode.engine.kv_cache.num_free_blocks == 64


def test_a_full_pool_takes_what_fits_and_blocks_of_another_shape_are_refused(save_hf_model):
    _, path = save_hf_model(tiny_config("llama"))
    prefill, decode = engines(path, "cpu", num_blocks=4)
    prompt = list(range(3, 3 + 2 * BLOCK + 1))
    answer(prefill, prompt)
    hashes = prefill.engine.kv_transfer.prefix_hashes(prompt)
    tensors = prefill.engine.kv_transfer.read_blocks([prefill.engine.kv_cache.pool.lookup(h) for h in hashes])
    decode.engine.kv_cache.pool.allocate(3)  # one block left
    assert decode.engine.kv_transfer.import_prefix(hashes, tensors) == 1
    with pytest.raises(ValueError, match="do not fit"):
        decode.engine.kv_transfer.import_prefix(hashes, {name: t[:, :1] for name, t in tensors.items()})
