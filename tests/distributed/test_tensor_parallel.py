"""Tensor parallelism on the CPU: two processes over gloo against one process on the same weights."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
from contextlib import nullcontext

import httpx
import pytest
import torch

from hyperserve import LLM, LoRARequest, SamplingParams
from hyperserve.layers.fused_decode import FusedDecode
from hyperserve.layers.quantization import interleaves_q41
from tests.conftest import FLOAT32, tiny_config
from tests.server.conftest import start_server, stop_server

pytestmark = pytest.mark.slow

# long prompts prefill in chunks
OPTIONS = dict(max_model_len=1024, num_kv_blocks=64, max_num_batched_tokens=64)


def generate(prompts, max_tokens: int = 16, lora_request=None, **options
             ) -> tuple[list[list[int]], list[list[float]], list[list[float]], int]:
    """Greedy tokens, their logprobs and each step's margin (best logprob less the second best) from
    one engine, and how many worker processes it ran;
    checks that every KV block came back and that closing the engine stopped its workers and gave
    the threads back."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)
    threads = torch.get_num_threads()  # the ranks split the cores while they run
    with LLM(**{**OPTIONS, **options}) as llm:
        free = llm.engine.kv_cache.num_free_blocks
        outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=lora_request)
        assert llm.engine.kv_cache.num_free_blocks == free
        workers = list(llm.engine.workers.processes) if llm.engine.workers is not None else []
    assert not any(p.is_alive() for p in workers), "closing the engine stops its workers"
    assert torch.get_num_threads() == threads, "and gives this process its threads back"
    tokens = [o.outputs[0].token_ids for o in outputs]
    logprobs = [[entry[token].logprob for token, entry in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]
                for o in outputs]
    margins = [[float.__sub__(*sorted((e.logprob for e in entry.values()), reverse=True)[:2])
                for entry in o.outputs[0].logprobs] for o in outputs]
    return tokens, logprobs, margins, len(workers)


def assert_close(actual: list[list[float]], expected: list[list[float]], tolerance: float) -> None:
    worst = max((abs(a - e) for row_a, row_e in zip(actual, expected) for a, e in zip(row_a, row_e)),
                default=0.0)
    assert worst <= tolerance, f"logprobs differ by up to {worst}"


def assert_same_until_a_near_tie(actual: tuple, expected: tuple, tolerance: float) -> None:
    """Greedy (tokens, logprobs, margins) of two runs agree token for token, except that after a
    step whose two best tokens were within `tolerance` of each other (logprob margin) the runs may
    go different ways: rounding at other points (8-bit activations of the AVX2 kernels) can tip such
    a tie. Until there, logprobs agree within `tolerance`."""
    references = zip(*expected[:3])
    for tokens, logprobs, (ref_tokens, ref_logprobs, margins) in zip(actual[0], actual[1], references):
        same = next((i for i, (a, b) in enumerate(zip(tokens, ref_tokens)) if a != b), len(ref_tokens))
        assert same == len(ref_tokens) or margins[same] <= tolerance, (tokens, ref_tokens, margins[same])
        assert_close([logprobs[:same]], [ref_logprobs[:same]], tolerance)


@pytest.fixture(scope="module")
def smollm2_prompts(chat_prompt_ids, smollm2_tokenizer):
    story = smollm2_tokenizer("The quick brown fox jumps over the lazy dog by the river. " * 12).input_ids
    return chat_prompt_ids[:3] + [story]  # the story (~150 tokens) prefills in three chunks


# int4's 8-bit activations (quantization.interleaves_q41): a value that the split sums in another
# order can round to another 8-bit code, which moved logprobs by up to 0.17 on a 2-core AVX2 EPYC,
# 0.31 on a Zen 4 EPYC and 0.41 on an Intel VM with AVX-512 VNNI and no BF16, with a float32 model.
# Where the model runs in bfloat16 (dense_dtype) its roundings add to that: 0.58 on the Zen 4, the
# tokens the same up to there. A wrong split differs by whole nats.
INT4_TOLERANCE = 0.75 if interleaves_q41() else 0.1


def test_smollm2_over_two_ranks_matches_one(smollm2_prompts, monkeypatch):
    """SmolLM2 in its default int4: its 3 K/V heads split 2 and 1; its 49,152-token vocabulary and
    1,536-wide MLP evenly. int4 rounds activations to bfloat16 (and on AVX2-only CPUs to 8 bits) at
    other points than one rank does. The ranks run the PyTorch layers (their outputs are all-reduced
    between ops), so the one process runs them too rather than its fused native layers, whose
    float32 residual stream would differ by more than any split (0.37 nats on a 2-core EPYC).
    In float32 (the tiny models below) the split is exact to 1e-3."""
    with monkeypatch.context() as patch:
        patch.setattr(FusedDecode, "unsupported", staticmethod(lambda model, kv_caches: "as the ranks run"))
        *single, _ = generate(smollm2_prompts)
    *split, workers = generate(smollm2_prompts, tensor_parallel_size=2)
    assert workers == 1
    assert_same_until_a_near_tie(split, single, INT4_TOLERANCE)


TWO_GPUS = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA devices")])


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "gemma2", "gemma3", "mixtral", "qwen3_moe", "qwen2_moe",
                                  "gpt_oss", "phi3"])
@pytest.mark.parametrize("device", ["cpu", TWO_GPUS])
def test_uneven_heads_width_and_vocabulary(save_hf_model, device, arch):
    """6 query / 3 K/V heads, an MLP width of 160 (cut at 32s: 64 and 96) and 1,001 tokens (padded
    to 1,002), with Qwen2's Q/K/V biases, Qwen3's QK norms (whole on every rank), Gemma 3's (and
    its tied, scaled embedding, a sliding-window layer beside a global one, and the norms after
    attention and MLP, which take the all-reduced sum), Gemma 2's capped scores and logits (the
    logits capped after the ranks' vocabularies are gathered), experts (Mixtral's 4 of width 160;
    Qwen3-MoE's of width 48, cut 24 and 24, beside a dense layer of 160; Qwen2-MoE's beside a
    shared expert of width 96, cut 48 and 48, and its gate, whole; GPT-OSS's biased ones, their
    router's bias whole, its attention sinks split by head), or Phi-3's q/k/v and
    gate/up fused in the checkpoint: every slice is uneven or padded. On CUDA: NCCL."""
    extra = {"mlp_only_layers": [0]} if arch in ("qwen2_moe", "qwen3_moe") else {}
    config = tiny_config(arch, num_attention_heads=6, num_key_value_heads=3, intermediate_size=160,
                         vocab_size=1001, hidden_size=96, **extra)
    _, path = save_hf_model(config)
    prompts = [[5, 17, 300, 999, 1000, 42], list(range(100, 260))]
    tokens, logprobs, _, _ = generate(prompts, model=path, device=device, **FLOAT32)
    tp_tokens, tp_logprobs, _, _ = generate(prompts, model=path, device=device, tensor_parallel_size=2,
                                            **FLOAT32)
    assert tp_tokens == tokens
    assert_close(tp_logprobs, logprobs, 1e-3)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_more_ranks_than_kv_heads_replicate_them(save_hf_model, arch):
    """One K/V head (Gemma 3 270M's and 1B's) on both ranks, each with 2 of the 4 query heads: each
    rank's pool holds the head whole, and the o projection's partial sums add up as with split heads."""
    config = tiny_config(arch, num_attention_heads=4, num_key_value_heads=1, intermediate_size=160,
                         vocab_size=1001, hidden_size=64)
    _, path = save_hf_model(config)
    prompts = [[5, 17, 300, 999, 1000, 42], list(range(100, 260))]
    tokens, logprobs, _, _ = generate(prompts, model=path, **FLOAT32)
    tp_tokens, tp_logprobs, _, _ = generate(prompts, model=path, tensor_parallel_size=2, **FLOAT32)
    assert tp_tokens == tokens
    assert_close(tp_logprobs, logprobs, 1e-3)


def test_lora_adapters_over_two_ranks(save_hf_model, tmp_path):
    """Each rank reads the adapters and keeps its part (B's rows of q, k, v, gate and up; A's
    columns of o and down, whose deltas join the all-reduce): a batch mixing two adapters and the
    base model, over uneven splits, gives one process's tokens."""
    from tests.engine.test_lora import make_adapter

    config = tiny_config("llama", num_attention_heads=6, num_key_value_heads=3, hidden_size=96,
                         intermediate_size=160)
    _, path = save_hf_model(config)
    make_adapter(path, tmp_path / "all", seed=1)
    make_adapter(path, tmp_path / "some", seed=2, rank=8, targets=["q_proj", "v_proj", "down_proj"])
    loras = [None, LoRARequest("all", 1, str(tmp_path / "all")),
             LoRARequest("some", 2, str(tmp_path / "some"))]
    prompts = [[5, 17, 200, 99, 100, 42], list(range(100, 160)), [7, 8, 9] * 5]
    tokens, logprobs, _, _ = generate(prompts, model=path, enable_lora=True, lora_request=loras, **FLOAT32)
    base, *_ = generate(prompts, model=path, **FLOAT32)
    assert base[1] != tokens[1] and base[2] != tokens[2], "the adapters should change the answers"
    tp_tokens, tp_logprobs, _, workers = generate(prompts, model=path, enable_lora=True, lora_request=loras,
                                                  tensor_parallel_size=2, **FLOAT32)
    assert workers == 1
    assert tp_tokens == tokens
    assert_close(tp_logprobs, logprobs, 1e-3)


@pytest.mark.parametrize("method", ["ngram", "draft", "self"])
def test_speculative_decoding_over_two_ranks(save_hf_model, method):
    """Verification steps (k + 1 rows of a sequence) run on every rank; a draft model (here the
    model itself) runs on rank 0 alone, unsplit; a self-draft (the first of the two layers) on
    every rank, as its layers are split."""
    config = tiny_config("llama", num_attention_heads=6, num_key_value_heads=3, hidden_size=96)
    _, path = save_hf_model(config)
    prompts = [[5, 6, 7, 8] * 10, list(range(100, 140))]  # the first repeats: n-grams find drafts
    tokens, *_ = generate(prompts, max_tokens=24, model=path, **FLOAT32)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    speculative = {"method": method, "num_tokens": 3, "verify_cost": 0.0}
    if method == "draft":
        speculative["model"] = path
    with LLM(model=path, **OPTIONS, **FLOAT32, tensor_parallel_size=2, speculative=speculative) as llm:
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert llm.engine.scheduler.spec_stats.num_drafts > 0
    assert [o.outputs[0].token_ids for o in outputs] == tokens


def test_kv_blocks_move_whole_between_two_ranks_and_one_process(save_hf_model, tmp_path):
    """read_blocks gathers every rank's heads of a block (here 2 and 1 of 3), write_blocks gives each
    rank its own: blocks computed over two ranks are one process's, they serve one process through
    the disk tier (and after a restart), and one process's blocks serve the two ranks
    (disaggregated prefill)."""
    config = tiny_config("llama", num_attention_heads=6, num_key_value_heads=3, hidden_size=96)
    _, path = save_hf_model(config)
    options = dict(model=path, num_kv_blocks=64, block_size=16, max_model_len=1024, **FLOAT32)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    first, second = list(range(3, 90)), list(range(100, 187))  # 5 full blocks and 7 tokens each

    def answer(llm: LLM, prompt: list[int]):
        return llm.generate([prompt], params, use_tqdm=False)[0]

    def blocks(llm: LLM, prompt: list[int]) -> tuple[list[bytes], dict[str, torch.Tensor]]:
        hashes = llm.engine.kv_transfer.prefix_hashes(prompt)
        ids = [llm.engine.kv_cache.pool.lookup(h) for h in hashes]
        return hashes, llm.engine.kv_transfer.read_blocks(ids)

    with (LLM(**options, tensor_parallel_size=2, disk_cache_dir=str(tmp_path)) as split,
          LLM(**options) as single):
        expected = {tuple(p): answer(single, p).outputs[0].token_ids for p in (first, second)}
        assert answer(split, first).outputs[0].token_ids == expected[tuple(first)]
        hashes, gathered = blocks(split, first)
        _, own = blocks(single, first)
        assert len(hashes) == 5 and gathered.keys() == own.keys()
        assert all(torch.allclose(gathered[name], own[name], atol=1e-5) for name in own)
        for block_hash, block_id in zip(hashes, [split.engine.kv_cache.pool.lookup(h) for h in hashes]):
            split.engine.kv_cache.lower_tier.spill(block_id, block_hash)
        second_hashes, second_blocks = blocks(single, second)
        assert split.engine.kv_transfer.import_prefix(second_hashes, second_blocks) == 5
        taken = answer(split, second)
        assert taken.metrics.num_cached_tokens == 5 * 16
        assert taken.outputs[0].token_ids == expected[tuple(second)]
    with LLM(**options, disk_cache_dir=str(tmp_path)) as restarted:
        read = answer(restarted, first)
        assert read.metrics.num_disk_cached_tokens == 5 * 16
        assert read.outputs[0].token_ids == expected[tuple(first)]


def test_a_cuda_pool_sized_by_gpu_memory_utilization_is_refused_under_tensor_parallelism():
    """Its measuring step would run on rank 0 alone and wait for the others: a clear error, before
    any process starts (checked without a GPU: the check comes before the device count's)."""
    from hyperserve.config import EngineConfig
    from hyperserve.engine.engine import _check_tensor_parallel

    config = tiny_config("llama")
    refused = EngineConfig.from_kwargs(model="unused", device="cuda", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="kv_cache_memory_gb"):
        _check_tensor_parallel(refused, config)
    sized = EngineConfig.from_kwargs(model="unused", device="cuda", tensor_parallel_size=2,
                                     kv_cache_memory_gb=1)
    enough = torch.cuda.device_count() >= 2
    with nullcontext() if enough else pytest.raises(ValueError, match="needs as many GPUs"):
        _check_tensor_parallel(sized, config)


@pytest.mark.parametrize("arch,overrides,options,message", [
    ("llama", {"num_attention_heads": 3, "num_key_value_heads": 1, "hidden_size": 48}, {},
     "exceeds the model's 1 K/V heads: it must then be a multiple of them that divides the 3 query heads"),
], ids=["query-heads-that-do-not-split"])
def test_what_cannot_be_split_is_refused_before_any_process_starts(save_hf_model, arch, overrides, options,
                                                                   message):
    _, path = save_hf_model(tiny_config(arch, **overrides))
    with pytest.raises(ValueError, match=message):
        LLM(path, tensor_parallel_size=2, **OPTIONS, **options)
    assert multiprocessing.active_children() == []


def test_the_server_serves_over_two_ranks_and_stops_its_worker():
    prompt = "The capital of France is"
    server = start_server("--tensor-parallel-size", "2", "--max-model-len", "1024",
                          "--kv-cache-memory-gb", "0.25", log_name="tensor-parallel")
    try:
        children = subprocess.run(["pgrep", "-P", str(server.process.pid)], capture_output=True, text=True)
        worker_pids = [int(pid) for pid in children.stdout.split()  # not multiprocessing's resource tracker
                       if b"spawn_main" in open(f"/proc/{pid}/cmdline", "rb").read()]
        assert len(worker_pids) == 1
        response = httpx.post(f"{server.url}/v1/completions", timeout=60,
                              json={"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True})
        assert response.status_code == 200, response.text
    finally:
        stop_server(server)
    with LLM(max_model_len=1024, kv_cache_memory_gb=0.25) as llm:
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        expected = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].text
    assert response.json()["choices"][0]["text"] == expected
    assert not any(os.path.exists(f"/proc/{pid}") for pid in worker_pids), "the worker outlived the server"
