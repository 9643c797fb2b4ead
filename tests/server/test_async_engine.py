"""AsyncEngine on a tiny random model, in process: a request submitted final_only (a response
that is not streamed) gets one output, the finished one, with the tokens a streamed request gets
one output per step; an idle engine still lets pins expire."""

from __future__ import annotations

import asyncio
import time

from hyperserve.engine.engine import LLMEngine
from hyperserve.sampling_params import SamplingParams
from hyperserve.server.async_engine import AsyncEngine
from tests.conftest import tiny_config


def tiny_engine(path: str) -> AsyncEngine:
    options = dict(model=path, num_kv_blocks=64, block_size=4, max_model_len=128, dtype="float32")
    return AsyncEngine(lambda: LLMEngine.from_kwargs(**options))


def test_a_final_only_request_is_handed_over_once_with_what_a_streamed_one_gets(save_hf_model):
    _, path = save_hf_model(tiny_config("llama"))
    engine = tiny_engine(path)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

    async def outputs(request_id: str, final_only: bool) -> list:
        stream = engine.submit(request_id, [1, 2, 3], params, final_only=final_only)
        return [output async for output in stream]

    async def both() -> tuple[list, list]:
        return await asyncio.gather(outputs("streamed", False), outputs("whole", True))

    try:
        engine.ready.result(timeout=60)
        streamed, whole = asyncio.run(both())
    finally:
        engine.shutdown()
    assert len(streamed) == 6 and [o.finished for o in streamed] == [False] * 5 + [True]
    assert len(whole) == 1 and whole[0].finished
    assert whole[0].outputs[0].token_ids == streamed[-1].outputs[0].token_ids
    assert len(whole[0].outputs[0].token_ids) == 6


def test_an_idle_engine_releases_a_pin_when_it_expires(save_hf_model):
    """No request comes after the pin: the engine thread wakes at its expiry all the same, so its
    blocks return to the pool and the KV use reported falls back to nothing."""
    _, path = save_hf_model(tiny_config("llama"))
    engine = tiny_engine(path)

    async def pin() -> None:
        async for _ in engine.submit("pin", list(range(1, 14)), SamplingParams(max_tokens=1), pin_ttl_s=0.3):
            pass

    try:
        kv = engine.ready.result(timeout=60).kv_cache
        asyncio.run(pin())
        assert kv.num_pinned_blocks == 3 and kv.usage > 0
        deadline = time.time() + 5
        while kv.num_pinned_blocks and time.time() < deadline:
            time.sleep(0.05)
        assert kv.num_pinned_blocks == 0 and kv.usage == 0
    finally:
        engine.shutdown()
