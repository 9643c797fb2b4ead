"""The engine under faults and hostile parameters, on a tiny random Llama: a failing step fails
only its own requests, fatal failures stop the engine loudly, and bounded parameters are enforced."""

from __future__ import annotations

import json

import pytest
import torch

from hyperserve import LLM, SamplingParams
from hyperserve.engine.engine import MAX_FAILED_STEPS, EngineDeadError, PinLimitError
from tests.conftest import tiny_config

NUM_BLOCKS = 64
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture
def tiny_llm(save_hf_model):
    _, path = save_hf_model(tiny_config("llama"))
    return LLM(model=path, num_kv_blocks=NUM_BLOCKS, block_size=4, max_model_len=256, max_num_seqs=1,
               dtype="float32")


def fail_when_running(llm: LLM, request_id: str, error: Exception, times: int = 1) -> list[int]:
    """Make the runner raise `error` on the next `times` steps that run `request_id`."""
    execute, calls = llm.engine.runner.execute, []

    def faulty(out, kv_cache):
        if any(r.request_id == request_id for r in out.requests) and len(calls) < times:
            calls.append(1)
            raise error
        return execute(out, kv_cache)

    llm.engine.runner.execute = faulty
    return calls


def drain(llm: LLM) -> dict[str, object]:
    finals = {}
    while llm.engine.has_unfinished_requests():
        for output in llm.engine.step():
            if output.finished:
                finals[output.request_id] = output
    return finals


def test_a_failing_step_fails_only_its_request_and_frees_its_blocks(tiny_llm):
    engine = tiny_llm.engine
    expected = tiny_llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    fail_when_running(tiny_llm, "poison", RuntimeError("kernel exploded"))
    engine.add_request("poison", [1, 2, 3], GREEDY)
    engine.add_request("healthy", [5, 6, 7], GREEDY)  # max_num_seqs=1: runs after the poisoned one
    finals = drain(tiny_llm)
    assert finals["poison"].error == "RuntimeError: kernel exploded"
    assert finals["poison"].outputs[0].finish_reason == "error"
    assert finals["healthy"].error is None and finals["healthy"].outputs[0].token_ids == expected
    assert engine.kv_cache.num_free_blocks == NUM_BLOCKS


def test_repeated_failures_stop_the_engine(tiny_llm):
    engine = tiny_llm.engine
    for i in range(MAX_FAILED_STEPS):
        fail_when_running(tiny_llm, f"r{i}", RuntimeError("again"))
        engine.add_request(f"r{i}", [1, 2, 3], GREEDY)
    with pytest.raises(EngineDeadError):
        drain(tiny_llm)


@pytest.mark.parametrize("error", [MemoryError(), torch.OutOfMemoryError("CUDA out of memory"),
                                   RuntimeError("CUDA error: an illegal memory access was encountered")])
def test_device_and_memory_failures_stop_the_engine_at_once(tiny_llm, error):
    fail_when_running(tiny_llm, "r", error)
    tiny_llm.engine.add_request("r", [1, 2, 3], GREEDY)
    with pytest.raises(EngineDeadError):
        tiny_llm.engine.step()


def test_seeded_generators_are_released_when_a_request_is_aborted(tiny_llm):
    engine = tiny_llm.engine
    engine.add_request("seeded", [1, 2, 3], SamplingParams(temperature=1.0, seed=7, max_tokens=50))
    engine.step()
    assert "seeded" in engine.runner.sampling.generators
    engine.abort_request("seeded")
    assert engine.runner.sampling.generators == {}
    engine.add_request("finishes", [1, 2, 3], SamplingParams(temperature=1.0, seed=7, max_tokens=2))
    drain_and_check = [engine.step() for _ in range(2)]
    assert drain_and_check[-1][0].finished and engine.runner.sampling.generators == {}


@pytest.mark.parametrize("params", [
    dict(seed=2**64), dict(seed=-1), dict(top_k=-2), dict(logit_bias={3: 101.0}),
])
def test_sampling_params_out_of_range_are_refused(params):
    with pytest.raises(ValueError):
        SamplingParams(**params)


@pytest.mark.parametrize("params", [
    dict(stop_token_ids=[10**6]), dict(logit_bias={-1: 1.0}), dict(logit_bias={256: 1.0}),
    dict(stop=["x"] * 17), dict(stop_token_ids=list(range(65))),
])
def test_token_ids_outside_the_vocabulary_and_oversized_lists_are_refused(tiny_llm, params):
    with pytest.raises(ValueError):
        tiny_llm.engine.add_request("bad", [1, 2, 3], SamplingParams(**params))
    assert not tiny_llm.engine.has_unfinished_requests()


def test_logit_bias_forces_and_bans_tokens(tiny_llm):
    plain = tiny_llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    forced = tiny_llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                                           logit_bias={42: 100.0}), use_tqdm=False)
    assert forced[0].outputs[0].token_ids == [42] * 8
    banned = tiny_llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                                           logit_bias={plain[0]: -100.0}), use_tqdm=False)
    assert banned[0].outputs[0].token_ids[0] != plain[0]


def test_prefix_block_hashes_are_sha256_chains(tiny_llm):
    import hashlib
    from array import array

    engine = tiny_llm.engine
    engine.add_request("r", list(range(1, 10)), GREEDY)
    request = engine.scheduler.requests["r"]
    first, second = engine.kv_cache._hashes(request)
    assert first == hashlib.sha256(array("q", [1, 2, 3, 4]).tobytes()).digest()
    assert second == hashlib.sha256(first + array("q", [5, 6, 7, 8]).tobytes()).digest()


def test_pins_cannot_take_more_than_their_share_of_the_pool(tiny_llm):
    engine = tiny_llm.engine
    cap = engine.kv_cache.max_pinned_blocks  # half of 64 blocks of 4 tokens
    with pytest.raises(PinLimitError) as refused:
        engine.pin_prefix("too-big", list(range(1, 4 * (cap + 1) + 1)), ttl_s=60)
    assert not refused.value.retryable
    engine.pin_prefix("fits", list(range(1, 4 * cap + 1)), ttl_s=60)
    drain(tiny_llm)
    assert engine.kv_cache.num_pinned_blocks == cap
    with pytest.raises(PinLimitError) as full:
        engine.pin_prefix("one-more", list(range(100, 110)), ttl_s=60)
    assert full.value.retryable


def test_every_eos_id_of_the_generation_config_ends_generation(save_hf_model):
    _, path = save_hf_model(tiny_config("llama"))
    probe = LLM(model=path, num_kv_blocks=NUM_BLOCKS, block_size=4, max_model_len=128, dtype="float32")
    greedy = probe.generate([[1, 2, 3]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    second_eos = next(t for t in greedy if t != greedy[0])
    config = json.loads((probe.engine.source.directory / "generation_config.json").read_text())
    config["eos_token_id"] = [255, second_eos]  # as Llama 3 lists end of text, of turn, of message
    (probe.engine.source.directory / "generation_config.json").write_text(json.dumps(config))
    llm = LLM(model=path, num_kv_blocks=NUM_BLOCKS, block_size=4, max_model_len=128, dtype="float32")
    assert {255, second_eos} <= llm.engine.eos_token_ids
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.token_ids == greedy[: greedy.index(second_eos) + 1]


def test_smollm2_eos_ids_come_from_its_gguf(smollm2_source):
    from hyperserve.models import loader

    config = loader.load_config(smollm2_source)
    assert loader.load_eos_token_ids(smollm2_source, config, None) == {2}  # <|im_end|>
