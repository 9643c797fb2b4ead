"""Prefix caching on the real SmolLM2: outputs identical with the cache on and off."""

from __future__ import annotations

import pytest

from hyperserve import LLM, SamplingParams
from tests.conftest import EXACT

pytestmark = pytest.mark.slow

BLOCK = 16


@pytest.fixture(scope="module")
def cached_llm():
    return LLM(num_kv_blocks=200, block_size=BLOCK, max_model_len=1024, **EXACT)


@pytest.fixture(scope="module")
def uncached_llm():
    return LLM(num_kv_blocks=200, block_size=BLOCK, max_model_len=1024, **EXACT, enable_prefix_caching=False)


@pytest.fixture(scope="module")
def system_prompt(smollm2_tokenizer) -> list[int]:
    text = "You are a meticulous assistant. Answer briefly and cite the rule you used. " * 6
    return smollm2_tokenizer(text).input_ids


def prompts_sharing(prefix: list[int], length: int, tokenizer) -> list[list[int]]:
    questions = ["What is 2 + 2?", "Name a planet.", "Spell cat backwards.", "Is ice cold?"]
    return [prefix[:length] + tokenizer(q).input_ids for q in questions]


@pytest.mark.parametrize("shared", [BLOCK * 3, BLOCK * 3 + 7, 70])  # on and off block boundaries
def test_greedy_and_seeded_outputs_match_with_cache_off(cached_llm, uncached_llm, system_prompt,
                                                        smollm2_tokenizer, shared):
    prompts = prompts_sharing(system_prompt, shared, smollm2_tokenizer)
    for params in (SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                   SamplingParams(temperature=0.9, seed=5, max_tokens=24, ignore_eos=True)):
        expected = [o.outputs[0].token_ids for o in uncached_llm.generate(prompts, params, use_tqdm=False)]
        cached_llm.generate(prompts[:1], params, use_tqdm=False)  # warm the cache
        outputs = cached_llm.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == expected
        assert all(o.metrics.num_cached_tokens >= (shared // BLOCK) * BLOCK for o in outputs[1:])
    assert uncached_llm.engine.kv_cache.num_hit_tokens == 0


def test_second_chat_turn_reuses_the_first_turn_prompt_and_answer(cached_llm):
    turn1 = [{"role": "user", "content": "Give me three tips for learning to cook."}]
    first = cached_llm.chat(turn1, SamplingParams(temperature=0, max_tokens=60), use_tqdm=False)[0]
    answer = first.outputs[0].text
    turn2 = turn1 + [{"role": "assistant", "content": answer}, {"role": "user", "content": "And for baking?"}]
    second = cached_llm.chat(turn2, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0]
    # the second prompt repeats the first and the answer as generated, up to where the template's
    # tokenization of the answer text parts from the generated tokens (it may split a "\n\n" token)
    before = first.prompt_token_ids + first.outputs[0].token_ids
    common = next(i for i, (a, b) in enumerate(zip(before + [-1], second.prompt_token_ids)) if a != b)
    assert common >= len(first.prompt_token_ids) + BLOCK  # a whole block of the answer at least
    assert second.metrics.num_cached_tokens >= common // BLOCK * BLOCK


def test_under_pressure_cached_blocks_are_evicted_and_outputs_still_match(system_prompt, smollm2_tokenizer):
    # 40 blocks: each request needs ~10, so caching everything is impossible.
    small = LLM(num_kv_blocks=40, block_size=BLOCK, max_model_len=600, **EXACT)
    reference = LLM(num_kv_blocks=40, block_size=BLOCK, max_model_len=600, **EXACT, enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    prompts = [p for length in (40, 90, 130) for p in prompts_sharing(system_prompt, length, smollm2_tokenizer)]
    expected = [o.outputs[0].token_ids for o in reference.generate(prompts, params, use_tqdm=False)]
    for _ in range(2):
        outputs = small.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == expected
    kv = small.engine.kv_cache
    assert kv.pool.num_evictions > 0 and kv.num_hit_tokens > 0
    assert kv.num_free_blocks == 40  # nothing in use: every block is free (cached or not)


def test_n_samples_compute_the_prompt_once(cached_llm, smollm2_tokenizer):
    prompt = smollm2_tokenizer("Lighthouses guard rocky coasts at night. " * 12).input_ids  # never seen before
    kv = cached_llm.engine.kv_cache
    hits_before = kv.num_hit_tokens
    out = cached_llm.generate([prompt], SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=6),
                              use_tqdm=False)[0]
    assert len(out.outputs) == 3
    # Sample 0 computes the prompt; samples 1 and 2 wait for it, then take all its full blocks.
    full_blocks_tokens = (len(prompt) - 1) // BLOCK * BLOCK
    assert kv.num_hit_tokens - hits_before == 2 * full_blocks_tokens


def test_a_cache_salt_shares_cached_prompts_only_with_requests_of_the_same_salt(cached_llm, system_prompt):
    """A tenant's prompt is not cached for another tenant (who could time it), nor for requests
    without a salt; the same answer comes either way."""
    engine, prompt = cached_llm.engine, system_prompt[::-1]  # seen by no other test
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)

    def run(request_id: str, salt: str):
        engine.add_request(request_id, prompt, params, cache_salt=salt)
        while not (done := [o for o in engine.step() if o.request_id == request_id and o.finished]):
            pass
        return done[0]

    full = (len(prompt) - 1) // BLOCK * BLOCK
    outputs = [run(f"salt-{i}", salt) for i, salt in enumerate(["tenant a", "tenant a", "tenant b", "", ""])]
    assert [o.metrics.num_cached_tokens for o in outputs] == [0, full, 0, 0, full]
    assert len({tuple(o.outputs[0].token_ids) for o in outputs}) == 1
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.pool.num_blocks


def _pressure(llm: LLM, seed: int) -> None:
    """Fill a 40-block pool several times over with prompts sharing nothing with the document."""
    import random

    rng = random.Random(seed)
    prompts = [[rng.randrange(1000, 40000) for _ in range(150)] for _ in range(6)]
    llm.generate(prompts, SamplingParams(max_tokens=20, ignore_eos=True), use_tqdm=False)


@pytest.mark.parametrize("pinned", [True, False])
def test_pinned_document_survives_pressure_until_its_ttl(system_prompt, smollm2_tokenizer, pinned):
    llm = LLM(num_kv_blocks=40, block_size=BLOCK, max_model_len=600, **EXACT)
    question = smollm2_tokenizer(" Question: what is rule one?").input_ids
    if pinned:
        pin_id, num_pinned = llm.pin_prefix(system_prompt, ttl_s=3600)
        assert num_pinned == len(system_prompt) // BLOCK * BLOCK
    else:
        llm.generate([system_prompt], SamplingParams(max_tokens=1), use_tqdm=False)  # cached, not pinned
    _pressure(llm, seed=1)
    out = llm.generate([system_prompt + question], SamplingParams(max_tokens=4), use_tqdm=False)[0]
    if not pinned:
        assert out.metrics.num_cached_tokens == 0  # evicted: the control for the pinned case
        return
    assert out.metrics.num_cached_tokens >= num_pinned
    llm.engine.kv_cache.pins[pin_id].expires_at = 0  # the TTL ends
    _pressure(llm, seed=2)
    assert pin_id not in llm.engine.kv_cache.pins
    out = llm.generate([system_prompt + question], SamplingParams(max_tokens=4), use_tqdm=False)[0]
    assert out.metrics.num_cached_tokens == 0
    assert llm.engine.kv_cache.num_free_blocks == 40


def test_unpin_releases_the_blocks(cached_llm, system_prompt):
    kv = cached_llm.engine.kv_cache
    free_before = kv.num_free_blocks
    pin_id, num_pinned = cached_llm.pin_prefix(system_prompt, ttl_s=60)
    assert kv.num_free_blocks == free_before - num_pinned // BLOCK
    assert cached_llm.unpin_prefix(pin_id) and not cached_llm.unpin_prefix(pin_id)
    assert kv.num_free_blocks == free_before


def test_disk_tier_serves_evicted_prefixes_across_a_restart(tmp_path, system_prompt, smollm2_tokenizer):
    question = smollm2_tokenizer(" Question: which rule applies?").input_ids
    prompt = system_prompt + question
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    reference = LLM(num_kv_blocks=40, block_size=BLOCK, max_model_len=600, **EXACT, enable_prefix_caching=False)
    expected = reference.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids

    options = dict(num_kv_blocks=40, block_size=BLOCK, max_model_len=600, disk_cache_dir=str(tmp_path), **EXACT)
    llm = LLM(**options)
    llm.generate([system_prompt], SamplingParams(max_tokens=1), use_tqdm=False)
    _pressure(llm, seed=3)  # evicts the document's blocks: they spill to disk
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    full = len(system_prompt) // BLOCK * BLOCK
    assert out.metrics.num_disk_cached_tokens >= full - BLOCK and out.metrics.num_cached_tokens >= full - BLOCK
    assert out.outputs[0].token_ids == expected

    restarted = LLM(**options)  # a new engine, an empty pool: only the disk remembers
    out = restarted.generate([prompt], params, use_tqdm=False)[0]
    assert out.metrics.num_disk_cached_tokens >= full - BLOCK
    assert out.outputs[0].token_ids == expected

    # A corrupt file is a miss: the block is recomputed, the answer is unchanged, nothing raises.
    files = sorted(restarted.engine.kv_cache.lower_tier.store.directory.glob("*.safetensors"))
    for path in files:
        path.write_bytes(path.read_bytes()[:100])
    again = LLM(**options)
    out = again.generate([prompt], params, use_tqdm=False)[0]
    assert out.metrics.num_disk_cached_tokens == 0 and out.outputs[0].token_ids == expected
    assert again.engine.kv_cache.lower_tier.store.num_corrupt >= 1

    # Another model (here: another KV dtype) never reads these blocks: its namespace differs.
    other = LLM(**options, kv_cache_dtype="int8")
    assert other.engine.kv_cache.lower_tier.store.directory != again.engine.kv_cache.lower_tier.store.directory
