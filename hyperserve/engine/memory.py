"""Sizing the KV pool on CUDA from gpu_memory_utilization, and handing memory back after loading.

The pool gets what is left of utilization x the GPU's memory after the weights, the activations of
the largest step and what lives outside PyTorch's allocator (the CUDA context, cuBLAS workspaces).
The activations are measured, not estimated: one step of max_num_batched_tokens prefill tokens
runs with its logits and the sampler's sort, and the allocator's peak is read back. CUDA graphs,
captured later, take their memory from the same budget's headroom (their pool is a few MB per
bucket at decode sizes).
"""

from __future__ import annotations

import ctypes
import logging

import torch

from hyperserve.config import EngineConfig
from hyperserve.layers.attention import AttentionMetadata, KVCache, PrefillSpan
from hyperserve.models.llama import LlamaForCausalLM, head_dim_of

logger = logging.getLogger("hyperserve.memory")


@torch.inference_mode()
def profile_step(model: LlamaForCausalLM, config: EngineConfig, num_tokens: int) -> None:
    """The largest step the scheduler can send: num_tokens prompt tokens, logits for
    max_num_seqs rows, and the sampler's softmax and sort over them."""
    device, block_size = torch.device(config.model.device), config.cache.block_size
    hf = model.config
    caches = [KVCache.allocate(-(-num_tokens // block_size), block_size, hf.num_key_value_heads, head_dim_of(hf),
                               config.model.torch_dtype, config.cache.kv_cache_dtype, device)
              for _ in range(hf.num_hidden_layers)]
    positions = torch.arange(num_tokens, device=device)
    meta = AttentionMetadata(positions, [], [PrefillSpan(0, num_tokens, None, None)], model.sliding_window)
    hidden = model(torch.zeros_like(positions), positions, caches, meta)
    logits = model.compute_logits(hidden[-min(num_tokens, config.scheduler.max_num_seqs):])
    torch.softmax(logits, dim=-1).sort(dim=-1)


def cuda_kv_cache_budget(model: LlamaForCausalLM, config: EngineConfig, max_model_len: int) -> int:
    """Bytes the KV pool may take on this GPU."""
    device = torch.device(config.model.device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    profile_step(model, config, min(config.scheduler.max_num_batched_tokens, max_model_len))
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)  # weights + the step's activations
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    outside_torch = total - free - torch.cuda.memory_reserved(device)
    utilization = config.cache.gpu_memory_utilization
    budget = int(total * utilization) - peak - outside_torch
    logger.info("GPU memory %.1f GiB x %.2f: weights and peak activations %.2f GiB, outside PyTorch %.2f GiB, "
                "KV pool %.2f GiB", total / 2**30, utilization, peak / 2**30, outside_torch / 2**30, budget / 2**30)
    if budget <= 0:
        raise ValueError(f"no GPU memory is left for the KV pool at gpu_memory_utilization={utilization}: "
                         "raise it, lower max_num_batched_tokens, or quantize the weights (quantization='fp8')")
    return budget


def return_freed_heap() -> None:
    """Give the C heap's free pages back to the OS. Loading builds the model in float32 and
    quantizing frees those copies, but glibc keeps freed heap pages mapped: 250 MB of SmolLM2's
    1.1 GB after loading. A no-op where the C library has no malloc_trim."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass
