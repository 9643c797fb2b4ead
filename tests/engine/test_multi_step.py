"""Multi-step decoding (num_scheduler_steps > 1) against one step per schedule: the same tokens,
logprobs and finish reasons, every block back in the pool. On CUDA the steps replay the decode
graphs with the sampled tokens kept on the device; on the CPU the same buffers run eagerly, with
the Triton decode kernel in its interpreter, and the plain forward pass is checked too."""

from __future__ import annotations

import random

import pytest

from hyperserve import LLM, SamplingParams
from hyperserve.engine.cuda_graphs import DecodeGraphs
from tests.conftest import DEVICES, assert_same_outputs, needs_triton, tiny_config

NUM_BLOCKS = 40
STEPS = 4


def make_llm(path: str, device: str, num_scheduler_steps: int, graphs: bool = False, **kwargs) -> LLM:
    llm = LLM(model=path, device=device, dtype="float32", num_kv_blocks=NUM_BLOCKS, block_size=16, max_model_len=128,
              max_num_seqs=8, num_scheduler_steps=num_scheduler_steps,
              attention_backend="triton" if graphs else "auto", **kwargs)
    runner = llm.engine.runner
    if graphs and runner.decode_graphs is None:  # the CPU: the graphs' buffers and padding, run eagerly
        runner.decode_graphs = DecodeGraphs(runner._decode_logits, 8, 8, 16, runner.padding_slot, None,
                                            runner.device, use_cuda_graphs=False)
    return llm


def steps_taken(llm: LLM) -> list[int]:
    """Record num_steps of every step the engine runs from now on."""
    taken, execute = [], llm.engine.runner.execute

    def recording(out, kv_cache):
        taken.append(out.num_steps)
        return execute(out, kv_cache)

    llm.engine.runner.execute = recording
    return taken


def compare(path: str, device: str, graphs: bool) -> None:
    rng = random.Random(0)
    prompts = [[rng.randrange(256) for _ in range(n)] for n in (5, 23, 40, 9)]
    single = make_llm(path, device, 1, graphs)
    greedy = SamplingParams(temperature=0, max_tokens=11, ignore_eos=True)  # not a multiple of the steps
    first = single.generate(prompts[:1], greedy, use_tqdm=False)[0].outputs[0].token_ids
    params = [
        greedy,
        SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[first[6]], ignore_eos=True),  # stops mid-way
        SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=17, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=14, frequency_penalty=1.5, logprobs=2, ignore_eos=True),
    ]
    prompts[1] = prompts[0]
    expected = single.generate(prompts, params, use_tqdm=False)
    multi = make_llm(path, device, STEPS, graphs)
    taken = steps_taken(multi)
    got = multi.generate(prompts, params, use_tqdm=False)
    assert STEPS in taken
    assert expected[1].outputs[0].finish_reason == "stop"
    assert_same_outputs(got, expected, logprobs_of=3)
    assert multi.engine.kv_cache.num_free_blocks == NUM_BLOCKS


@pytest.mark.parametrize("device", DEVICES)
def test_multi_step_matches_single_steps(device, save_hf_model):
    _, path = save_hf_model(tiny_config("llama"))
    compare(path, device, graphs=device == "cuda")


@needs_triton
def test_multi_step_through_the_graph_buffers_matches_single_steps(save_hf_model):
    _, path = save_hf_model(tiny_config("llama", head_dim=16))
    compare(path, "cpu", graphs=True)


def test_a_short_pool_or_context_falls_back_to_single_steps(save_hf_model):
    _, path = save_hf_model(tiny_config("llama"))
    # 4 blocks of 16 tokens: two 30-token prompts fill 2 blocks each, and their 4-token steps
    # would need a third block each
    llm = LLM(model=path, device="cpu", dtype="float32", num_kv_blocks=5, block_size=16, max_model_len=40,
              num_scheduler_steps=STEPS)
    taken = steps_taken(llm)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outputs = llm.generate([[1] * 30, [2] * 30], params, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 8 for o in outputs)
    assert STEPS not in taken[:3]  # no room for 4 tokens each until a request is preempted or ends
    assert llm.engine.kv_cache.num_free_blocks == 5
    # near max_model_len the steps shrink to what is left: 40 - 37 + 1 = 4, then none past the end
    taken.clear()
    out = llm.generate([[3] * 37], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 3
    assert max(taken) <= 4
    assert llm.engine.kv_cache.num_free_blocks == 5
