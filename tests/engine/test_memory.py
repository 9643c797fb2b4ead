"""KV pool sizing: the CPU's fixed default and CUDA's gpu_memory_utilization."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hyperserve import LLM
from hyperserve.engine.memory import profile_step
from hyperserve.models.loader import kv_bytes_per_token
from tests.conftest import tiny_config


def test_kv_cache_memory_gb_sizes_the_pool(save_hf_model):
    _, path = save_hf_model(tiny_config("llama"))
    per_block = kv_bytes_per_token(tiny_config("llama"), torch.float32) * 16
    llm = LLM(model=path, dtype="float32", kv_cache_memory_gb=0.01)
    assert llm.engine.kv_cache.pool.num_blocks == int(0.01 * 2**30) // per_block


def _after_unrelated_prompts(path: str, sized: bool, count: int) -> LLM:
    """An engine (its default pool, or one sized to 0.5 GB) after `count` unrelated prompts of 41
    tokens (2 full blocks each), one at a time; the latest is still a prefix-cache hit."""
    from hyperserve import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    prompts = [[i, *((7 * i + j) % 256 for j in range(40))] for i in range(count)]
    llm = LLM(model=path, dtype="float32", max_model_len=64, **({"kv_cache_memory_gb": 0.5} if sized else {}))
    for prompt in prompts:
        llm.generate([prompt], params, use_tqdm=False)
    assert llm.generate([prompts[-1]], params, use_tqdm=False)[0].metrics.num_cached_tokens == 32
    return llm


def test_the_cpu_default_pool_stops_growing_with_unrelated_prompts(save_hf_model):
    """The default pool (written on demand up to 4 GB) keeps one context's blocks idle in the prefix
    cache (at most a quarter of the pool), or as many as ran at once, and reuses the least recent
    beyond: a long-running server's memory stays near its working set. A pool the user sizes caches
    until it is full."""
    _, path = save_hf_model(tiny_config("llama"))
    used = {}
    for sized in (False, True):
        llm = _after_unrelated_prompts(path, sized, 24)
        pool = llm.engine.kv_cache.pool
        used[sized] = pool.num_used_blocks
        assert pool.min_idle_cached == (None if sized else 4)  # 64 tokens in blocks of 16
        if not sized:
            assert llm.engine._min_idle_cached(8) == 2  # at most a quarter of the pool
        llm.close()
    assert used[False] <= 10
    assert used[True] == 24 * 2 + 1  # each prompt's 2 full blocks stay cached, its third is reused


def test_the_cpu_default_pool_of_gemmas_windowed_layers_stops_growing_too(save_hf_model):
    """Gemma 3's sliding-window layers have a pool of their own (2 GB of float32 KV for the 270M
    model, which grew by 280 MB per 32 unrelated prompts while it cached until full): by default it
    keeps one sequence's share of it idle (or as many blocks as ran at once), as the first group keeps
    one context; sized by the user, it caches every prompt."""
    _, path = save_hf_model(tiny_config("gemma3"))  # a window of 8 tokens
    used = {}
    for sized in (False, True):
        llm = _after_unrelated_prompts(path, sized, 40)
        windowed = llm.engine.kv_cache.groups[1].pool
        per_sequence = windowed.num_blocks // llm.engine.config.scheduler.max_num_seqs
        assert windowed.min_idle_cached == (None if sized else per_sequence)
        used[sized] = windowed.num_used_blocks
        llm.close()
    assert used[False] <= per_sequence + 4
    assert used[True] == 40 * 2 + 1


_LAZY_POOL = """
import os, torch
from pathlib import Path
from hyperserve.layers.attention import KVCache

def rss():
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")

before = rss()
cache = KVCache.allocate(4096, 16, 8, 128, torch.float32, "auto", "cpu")  # 2 x 256 MiB
allocated = rss() - before
zeros = bool(cache.key.abs().sum() == 0 and cache.value.abs().sum() == 0)
cache.write(torch.arange(16 * 64), torch.ones(16 * 64, 8, 128), torch.ones(16 * 64, 8, 128))
print(allocated, zeros, rss() - before)
"""


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="reads the process RSS from /proc")
def test_the_cpu_kv_pool_takes_memory_only_as_blocks_are_written():
    """In a fresh process: this one's heap holds whatever earlier tests freed, which a large
    allocation may reuse (and must then clear page by page)."""
    result = subprocess.run([sys.executable, "-c", _LAZY_POOL], capture_output=True, text=True, check=True)
    allocated, zeros, written = result.stdout.split()
    assert int(allocated) < 64 * 2**20
    assert zeros == "True"  # reads as zeros all the same
    assert 7 * 2**20 < int(written) < 64 * 2**20 + 8 * 2**20  # 64 blocks written: 2 x 4 MiB


def test_profile_step_runs_the_largest_step(save_hf_model):
    """The measured step is a real forward (here on the CPU): max_num_batched_tokens prompt tokens,
    as several prompts where one may not be that long, logits for max_num_seqs rows, the sampler's
    sort. (Capped at one prompt of max_model_len, it measured an eighth of a 16,384-token step's
    activations on an H100, and the pool took what the step then needed.)"""
    _, path = save_hf_model(tiny_config("mistral", sliding_window=8))
    llm = LLM(model=path, dtype="float32", num_kv_blocks=64, max_model_len=40, max_num_batched_tokens=100,
              max_num_seqs=3)
    model = llm.engine.runner.model
    seen = []
    hook = model.register_forward_pre_hook(lambda _, args: seen.append((len(args[0]), args[1].tolist())))
    profile_step(model, llm.engine.config, 100, 40)
    hook.remove()
    assert seen == [(100, [*range(40), *range(40), *range(20)])]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("utilization", [0.3, 0.6])
def test_gpu_memory_utilization_bounds_what_the_engine_takes(utilization, save_hf_model):
    _, path = save_hf_model(tiny_config("llama"))
    total = torch.cuda.mem_get_info()[1]
    llm = LLM(model=path, device="cuda", gpu_memory_utilization=utilization, max_model_len=256)
    used = torch.cuda.memory_reserved()
    assert used <= utilization * total  # weights, activations, the pool and the CUDA graphs
    assert used >= (utilization - 0.05) * total  # and the pool took nearly all the rest
    del llm
