"""AsyncEngine on a tiny random model, in process: a request submitted final_only (a response
that is not streamed) gets one output, the finished one, with the tokens a streamed request gets
one output per step."""

from __future__ import annotations

import asyncio

from hyperserve.engine.engine import LLMEngine
from hyperserve.sampling_params import SamplingParams
from hyperserve.server.async_engine import AsyncEngine
from tests.conftest import tiny_config


def test_a_final_only_request_is_handed_over_once_with_what_a_streamed_one_gets(save_hf_model):
    _, path = save_hf_model(tiny_config("llama"))
    engine = AsyncEngine(lambda: LLMEngine.from_kwargs(model=path, num_kv_blocks=64, block_size=4, max_model_len=128,
                                                      dtype="float32"))
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

    async def outputs(request_id: str, final_only: bool) -> list:
        return [output async for output in engine.submit(request_id, [1, 2, 3], params, final_only=final_only)]

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
